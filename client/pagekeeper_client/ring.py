"""The table ring: its byte layout, its descriptor, and the value types a reader returns.

This module is the single definition of how published kernel block tables are laid out in
memory. The service writes it (``pagekeeper.publish``), a worker reads it
(``pagekeeper_client.transports``); both import it from here, and it needs only numpy and the
standard library, so a worker never installs the service. torch is imported lazily, only by
the ``to_torch`` conversions.

Layout (all integers little-endian, every region 64-byte aligned)::

    control block                                   data (per slot, slot_data_stride bytes)
    +--------------------------------------+        +-----------------------------------------+
    | header: int64 words                  |        | table 0: block_table int32 [R, K0]      |
    |   magic, layout version, generation, |        |          row_lengths int32 [R]          |
    |   state, depth, R, N, num tables,    |        |          slot_mapping int64 [N]         |
    |   sizes, writer pid, last step,      |        | table 1: ...                            |
    |   (group, kernel block size, K) x T  |        +-----------------------------------------+
    +--------------------------------------+        x depth slots
    | slot header x depth: int64 words     |
    |   seq (seqlock), step, epoch,        |        R = max_num_reqs, N = max_num_tokens,
    |   num_reqs, num_tokens,              |        K_t = max kernel blocks per row, table t
    |   (num_cols, pad_id, num_tokens) x T |
    +--------------------------------------+

``shm`` keeps both in one mapping (data right after the page-aligned control block);
``cuda_ipc`` keeps the control block in host shared memory and the data in device memory;
``cpu_ipc`` (the CUDA transport's CPU stand-in) keeps the data in a separate memfd.

Seqlock protocol, per slot. The writer takes the slots in turn, one per published step
(slot 0 first; published step ids have gaps, since a step that only admits publishes
nothing, so the slot is not ``S % depth``). Publishing step ``S`` into its slot:
``seq += 1`` (odd: writing) -> write data and slot words -> ``seq += 1`` (even: stable) ->
``last_step = S`` (a failed write leaves the slot empty, step -1, and the next step takes it).
A reader waiting for step ``S`` looks at every slot (``depth`` is small): read ``seq`` (even)
and ``step``; ``step == S`` -> copy -> re-read ``seq``: unchanged means the copy is exactly
what the writer wrote for ``S``; changed means the writer started overwriting it and the
reader fell behind (there is nothing left to retry: that step's data is gone). No slot holds
``S`` and none holds a later step: not yet published, keep waiting. A later step but not
``S`` (on a second look): overwritten (or never published), the reader fell behind.

Waiting: a reader spins ~50 us on the slots' words, then sleeps on a futex on the seq word of
the slot the writer takes next (the one after the newest step's), which the writer wakes
right after the slot turns even (and on close); without futexes (not Linux) it sleeps with
exponential backoff up to 1 ms.

The writer never waits for readers. Step ``S``'s slot is rewritten only when ``depth`` more
steps are published, so a worker that finishes with step ``S`` before the scheduler
publishes ``depth`` more never loses a step; one that falls further behind gets
:class:`ReaderFellBehind`, never torn data.

Memory ordering. The control words are aligned int64 written and read through numpy scalar
stores/loads (single 8-byte moves on x86-64 and aarch64, so a word is never torn). Each
Python statement is a separate call into C code that the compiler cannot reorder across.
On x86-64 (TSO) stores become visible to other cores in program order and loads are not
reordered with loads, so "data stores then seq store" in the writer and "seq load, data
loads, seq load" in the reader are exactly the seqlock's release/acquire pairs; glibc's
``memcpy`` ends its non-temporal (streaming) store path with ``sfence``, so large copies are
ordered too. On weakly ordered CPUs (aarch64) :func:`memory_fence` adds a lock round trip
(an acquire/release pair in CPython's lock) on both sides; the torn-write stress test is
what proves the protocol, and it runs on every transport in CI.
"""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from pagekeeper_client._futex import futex_wake

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]

LAYOUT_VERSION = 2
"""Bumped on any change of the byte layout or its use; readers refuse a version they do not
know, so the service and the workers on a node are upgraded together (a worker reading
another version gets a RingError at once, never a misread table). 2: slots taken in turn,
one per published step (1: slot ``step % depth``)."""

RING_MAGIC = int.from_bytes(b"PKRING\x00\x01", "little")
"""First word of every control block."""

TRANSPORT_KINDS = ("shm", "cpu_ipc", "cuda_ipc", "stream")

ALIGN = 64
"""Alignment of every array in the ring (a cache line; also enough for any dtype view)."""

PAGE = 4096
"""Control block and slot strides are page multiples so slots can be pinned page-aligned."""

MAX_RING_BYTES = 1 << 40
"""Sanity bound on a ring's size: a descriptor claiming more is rejected as corrupt."""

# -- control block: header words -------------------------------------------------------------
H_MAGIC = 0
H_LAYOUT_VERSION = 1
H_GENERATION = 2
H_STATE = 3
H_DEPTH = 4
H_MAX_NUM_REQS = 5
H_MAX_NUM_TOKENS = 6
H_NUM_TABLES = 7
H_HEADER_BYTES = 8
H_SLOT_HEADER_STRIDE = 9
H_CONTROL_BYTES = 10
H_DATA_OFFSET = 11
H_SLOT_DATA_STRIDE = 12
H_DATA_BYTES = 13
H_WRITER_PID = 14
H_LAST_STEP = 15
H_TABLES = 24
"""Word index of the first table triple (group_id, kernel_block_size, max_kernel_blocks)."""
HEADER_FIXED_WORDS = H_TABLES

STATE_INITIALISING = 0
STATE_OPEN = 1
STATE_CLOSED = 2

# -- control block: per-slot header words ----------------------------------------------------
S_SEQ = 0
S_STEP = 1
S_EPOCH = 2
S_NUM_REQS = 3
S_NUM_TOKENS = 4
S_TABLES = 8
"""Word index of the first per-table triple (num_cols, pad_id, num_tokens)."""
SLOT_FIXED_WORDS = S_TABLES
SLOT_TABLE_WORDS = 3

NO_STEP = -1
"""``step`` of a slot that holds no published step."""


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


_FENCE_LOCK = threading.Lock()
_NEEDS_FENCE = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686")


def memory_fence() -> None:
    """Order this thread's earlier memory accesses before its later ones, as well as Python
    can: nothing on x86-64 (TSO already does), a lock round trip elsewhere."""
    if _NEEDS_FENCE:
        _FENCE_LOCK.acquire()
        _FENCE_LOCK.release()


# -- errors -----------------------------------------------------------------------------------
class RingError(Exception):
    """Base of every error the ring and its transports raise."""


class DescriptorError(RingError, ValueError):
    """A descriptor (or the ring it points at) is invalid, unreachable or not for us."""


class ReaderFellBehind(RingError):
    """The step asked for was overwritten by a later one before (or while) it was read."""

    def __init__(self, message: str, *, step_seq: int, found_step: int) -> None:
        super().__init__(message)
        self.step_seq = step_seq
        self.found_step = found_step


class RingClosed(RingError):
    """The publisher closed the ring (or, for IPC transports, invalidated every import)."""


class StepTimeout(RingError, TimeoutError):
    """The step was not published within the timeout."""


class SlotFormatError(RingError, ValueError):
    """A packed slot (stream transport) is malformed."""


# -- descriptor -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RingGeometry:
    """Fixed capacity of every ring slot (tables beyond it are rejected, not truncated)."""

    depth: int = 2
    max_num_reqs: int = 256
    max_num_tokens: int = 8192
    # One entry per published table: (group_id, kernel_block_size, max_kernel_blocks_per_row).
    tables: tuple[tuple[int, int, int], ...] = ()

    def table_index(self, group_id: int, kernel_block_size: int) -> int:
        """Position of table (group_id, kernel_block_size) in every slot; KeyError if absent."""
        for i, (g, kbs, _) in enumerate(self.tables):
            if g == group_id and kbs == kernel_block_size:
                return i
        raise KeyError((group_id, kernel_block_size))


@dataclass(frozen=True, slots=True)
class RingDescriptor:
    """Where and how a worker maps the ring. ``kind`` is "shm", "cuda_ipc", "cpu_ipc"
    (the memfd-backed CPU stand-in of CUDA IPC) or "stream".

    Fields by kind:

    - shm: ``path`` is the ring file (control block and data in one mapping of
      ``size_bytes`` bytes).
    - cpu_ipc / cuda_ipc: ``path`` is the control block file (host shared memory);
      ``ipc_handle`` exports the data buffer of ``size_bytes`` bytes at ``offset``;
      ``event_handles`` holds one interprocess event per slot (cuda_ipc: CUDA IPC event
      handles; cpu_ipc: tokens, the event being emulated by the seqlock);
      ``exporter_pid`` is the exporting process, which may not import its own export.
      cuda_ipc also sets ``device``, ``gpu_uuid`` and torch's IPC reference counter
      (``ref_counter_handle``/``ref_counter_offset``).
    - stream: only the geometry and generation matter; slots arrive as packed bytes.

    ``dtype`` is the element type of the exported buffer (always "uint8": the ring is
    bytes; the arrays inside have the fixed dtypes of the layout).
    """

    kind: str
    generation: int
    geometry: RingGeometry
    size_bytes: int
    layout_version: int = LAYOUT_VERSION
    path: str = ""  # shm: ring file under /dev/shm; IPC kinds: the control block file
    device: str = ""  # cuda_ipc: "cuda:N" on the exporter (importers locate it by gpu_uuid)
    gpu_uuid: str = ""
    ipc_handle: bytes = b""  # IPC kinds: opaque handle bytes (memory), offset below
    event_handles: tuple[bytes, ...] = field(default_factory=tuple)
    offset: int = 0
    # Extensions (compatible: all defaulted).
    exporter_pid: int = 0
    dtype: str = "uint8"
    ref_counter_handle: bytes = b""  # cuda_ipc: torch's IPC reference-counter file name
    ref_counter_offset: int = 0


# -- layout -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TableLayout:
    """Where one table's arrays sit inside a slot (byte offsets from the slot's start)."""

    group_id: int
    kernel_block_size: int
    max_kernel_blocks: int
    block_table_offset: int
    row_lengths_offset: int
    slot_mapping_offset: int


@dataclass(frozen=True, slots=True)
class RingLayout:
    """Every size and offset of a ring, computed from its geometry alone."""

    geometry: RingGeometry
    header_bytes: int
    slot_header_stride: int
    slot_header_words: int
    control_bytes: int
    slot_data_stride: int
    data_bytes: int
    tables: tuple[TableLayout, ...]

    @classmethod
    def for_geometry(cls, geometry: RingGeometry) -> RingLayout:
        validate_geometry(geometry)
        num_tables = len(geometry.tables)
        header_bytes = align_up(8 * (HEADER_FIXED_WORDS + 3 * num_tables), ALIGN)
        slot_header_words = SLOT_FIXED_WORDS + SLOT_TABLE_WORDS * num_tables
        slot_header_stride = align_up(8 * slot_header_words, ALIGN)
        control_bytes = align_up(header_bytes + geometry.depth * slot_header_stride, PAGE)
        offset = 0
        tables = []
        for group_id, kernel_block_size, max_kernel_blocks in geometry.tables:
            bt = offset
            offset = align_up(bt + 4 * geometry.max_num_reqs * max_kernel_blocks, ALIGN)
            rl = offset
            offset = align_up(rl + 4 * geometry.max_num_reqs, ALIGN)
            sm = offset
            offset = align_up(sm + 8 * geometry.max_num_tokens, ALIGN)
            tables.append(TableLayout(group_id, kernel_block_size, max_kernel_blocks, bt, rl, sm))
        slot_data_stride = align_up(offset, PAGE)
        return cls(
            geometry=geometry,
            header_bytes=header_bytes,
            slot_header_stride=slot_header_stride,
            slot_header_words=slot_header_words,
            control_bytes=control_bytes,
            slot_data_stride=slot_data_stride,
            data_bytes=geometry.depth * slot_data_stride,
            tables=tuple(tables),
        )

    @property
    def embedded_bytes(self) -> int:
        """Size of a ring holding control block and data in one mapping (shm)."""
        return self.control_bytes + self.data_bytes

    def slot_offset(self, slot: int, data_offset: int = 0) -> int:
        return data_offset + slot * self.slot_data_stride


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_geometry(geometry: RingGeometry) -> None:
    """Raise :class:`DescriptorError` unless the geometry describes a usable ring."""
    if not isinstance(geometry, RingGeometry):
        raise DescriptorError(f"geometry must be a RingGeometry, got {type(geometry).__name__}")
    for name in ("depth", "max_num_reqs", "max_num_tokens"):
        value = getattr(geometry, name)
        if not _is_int(value) or value < 1:
            raise DescriptorError(f"geometry.{name} must be an int >= 1, got {value!r}")
    if not geometry.tables:
        raise DescriptorError("geometry.tables must name at least one table")
    seen: set[tuple[int, int]] = set()
    for i, entry in enumerate(geometry.tables):
        if len(entry) != 3 or not all(_is_int(v) for v in entry):
            raise DescriptorError(
                f"geometry.tables[{i}] must be (group_id, kernel_block_size, "
                f"max_kernel_blocks), got {entry!r}"
            )
        group_id, kernel_block_size, max_kernel_blocks = entry
        if group_id < 0 or kernel_block_size < 1 or max_kernel_blocks < 1:
            raise DescriptorError(f"geometry.tables[{i}] has a non-positive size: {entry!r}")
        if (group_id, kernel_block_size) in seen:
            raise DescriptorError(
                f"geometry.tables[{i}] repeats (group {group_id}, kernel block size "
                f"{kernel_block_size})"
            )
        seen.add((group_id, kernel_block_size))
    per_slot = sum(
        4 * geometry.max_num_reqs * (k + 1) + 8 * geometry.max_num_tokens
        for _, _, k in geometry.tables
    )
    if per_slot * geometry.depth > MAX_RING_BYTES:
        raise DescriptorError(f"geometry needs {per_slot * geometry.depth} bytes: too large")


def normalize_gpu_uuid(uuid: str) -> str:
    """``"GPU-AbC..."`` and ``"abc..."`` name the same GPU."""
    text = uuid.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def validate_descriptor(descriptor: RingDescriptor) -> RingLayout:
    """Check every field a reader relies on before touching any memory; return the layout.

    Raises :class:`DescriptorError` naming the first bad field.
    """
    if not isinstance(descriptor, RingDescriptor):
        raise DescriptorError(
            f"expected a RingDescriptor, got {type(descriptor).__name__} (convert from protobuf "
            "first)"
        )
    if descriptor.kind not in TRANSPORT_KINDS:
        raise DescriptorError(
            f"kind: unknown transport {descriptor.kind!r}; one of {list(TRANSPORT_KINDS)}"
        )
    if descriptor.layout_version != LAYOUT_VERSION:
        raise DescriptorError(
            f"layout_version: this reader knows version {LAYOUT_VERSION}, the ring is version "
            f"{descriptor.layout_version}"
        )
    if not _is_int(descriptor.generation) or descriptor.generation <= 0:
        raise DescriptorError(f"generation must be a positive int, got {descriptor.generation!r}")
    layout = RingLayout.for_geometry(descriptor.geometry)
    if descriptor.dtype != "uint8":
        raise DescriptorError(f"dtype: the ring is a uint8 buffer, got {descriptor.dtype!r}")
    if not _is_int(descriptor.offset) or descriptor.offset < 0:
        raise DescriptorError(f"offset must be an int >= 0, got {descriptor.offset!r}")
    kind = descriptor.kind
    if kind == "stream":
        return layout
    if not descriptor.path:
        raise DescriptorError(f"path: a {kind} ring needs the path of its control block")
    if kind == "shm":
        if descriptor.size_bytes != layout.embedded_bytes:
            raise DescriptorError(
                f"size_bytes: geometry implies {layout.embedded_bytes} bytes, descriptor says "
                f"{descriptor.size_bytes}"
            )
        return layout
    # IPC kinds: an exported data buffer plus one event per slot.
    if descriptor.size_bytes != layout.data_bytes:
        raise DescriptorError(
            f"size_bytes: geometry implies a {layout.data_bytes}-byte data buffer, descriptor "
            f"says {descriptor.size_bytes}"
        )
    if not descriptor.ipc_handle:
        raise DescriptorError(f"ipc_handle: a {kind} ring needs a memory handle")
    if len(descriptor.event_handles) != descriptor.geometry.depth:
        raise DescriptorError(
            f"event_handles: need one per slot ({descriptor.geometry.depth}), got "
            f"{len(descriptor.event_handles)}"
        )
    if not _is_int(descriptor.exporter_pid) or descriptor.exporter_pid <= 0:
        raise DescriptorError(f"exporter_pid must be a pid, got {descriptor.exporter_pid!r}")
    if descriptor.exporter_pid == os.getpid():
        raise DescriptorError(
            f"{kind}: this process exported the ring; an importer never opens its own export "
            "(CUDA refuses it too): read it in another process"
        )
    if kind == "cuda_ipc" and not descriptor.gpu_uuid:
        raise DescriptorError("gpu_uuid: a cuda_ipc ring must name its GPU")
    return layout


# -- control block access -----------------------------------------------------------------------
class RingControl:
    """Typed access to a control block: the header words and each slot's header words.

    Both sides use it: the writer over a writable mapping, readers over a read-only one.
    """

    __slots__ = ("header", "layout", "seq_addresses", "slots")

    def __init__(self, buffer: Any, layout: RingLayout) -> None:
        self.layout = layout
        num_header_words = layout.header_bytes // 8
        self.header: Int64Array = np.frombuffer(
            buffer, dtype=np.int64, count=num_header_words, offset=0
        )
        stride_words = layout.slot_header_stride // 8
        flat: Int64Array = np.frombuffer(
            buffer,
            dtype=np.int64,
            count=stride_words * layout.geometry.depth,
            offset=layout.header_bytes,
        )
        # Rows are slots; only the first slot_header_words of each row are used.
        self.slots: Int64Array = flat.reshape(layout.geometry.depth, stride_words)
        # Where each slot's seq word lives in this process (futex wait / wake address).
        base = int(self.slots.ctypes.data)
        self.seq_addresses: tuple[int, ...] = tuple(
            base + slot * layout.slot_header_stride + 8 * S_SEQ
            for slot in range(layout.geometry.depth)
        )

    # Writer side ------------------------------------------------------------------------------
    def initialise(self, *, generation: int, data_offset: int, writer_pid: int) -> None:
        """Write a fresh header (state OPEN last, so a half-made ring is never taken as open)."""
        layout = self.layout
        geometry = layout.geometry
        header = self.header
        header[:] = 0
        header[H_MAGIC] = RING_MAGIC
        header[H_LAYOUT_VERSION] = LAYOUT_VERSION
        header[H_GENERATION] = generation
        header[H_DEPTH] = geometry.depth
        header[H_MAX_NUM_REQS] = geometry.max_num_reqs
        header[H_MAX_NUM_TOKENS] = geometry.max_num_tokens
        header[H_NUM_TABLES] = len(geometry.tables)
        header[H_HEADER_BYTES] = layout.header_bytes
        header[H_SLOT_HEADER_STRIDE] = layout.slot_header_stride
        header[H_CONTROL_BYTES] = layout.control_bytes
        header[H_DATA_OFFSET] = data_offset
        header[H_SLOT_DATA_STRIDE] = layout.slot_data_stride
        header[H_DATA_BYTES] = layout.data_bytes
        header[H_WRITER_PID] = writer_pid
        header[H_LAST_STEP] = NO_STEP
        for i, (group_id, kernel_block_size, max_kernel_blocks) in enumerate(geometry.tables):
            base = H_TABLES + 3 * i
            header[base] = group_id
            header[base + 1] = kernel_block_size
            header[base + 2] = max_kernel_blocks
        self.slots[:] = 0
        self.slots[:, S_STEP] = NO_STEP
        memory_fence()
        header[H_STATE] = STATE_OPEN

    # Reader side ------------------------------------------------------------------------------
    def check(self, descriptor: RingDescriptor, *, data_offset: int) -> None:
        """Raise :class:`DescriptorError` unless this control block is the one the
        descriptor describes (same magic, version, generation, geometry and sizes)."""
        header = self.header
        layout = self.layout
        geometry = layout.geometry
        if int(header[H_MAGIC]) != RING_MAGIC:
            raise DescriptorError(f"{descriptor.path}: not a pagekeeper ring (bad magic)")
        if int(header[H_LAYOUT_VERSION]) != LAYOUT_VERSION:
            raise DescriptorError(
                f"{descriptor.path}: ring layout version {int(header[H_LAYOUT_VERSION])}, "
                f"reader knows {LAYOUT_VERSION}"
            )
        if int(header[H_GENERATION]) != descriptor.generation:
            raise DescriptorError(
                f"{descriptor.path}: ring generation {int(header[H_GENERATION])} does not match "
                f"the descriptor's {descriptor.generation} (stale descriptor?)"
            )
        expected = {
            H_DEPTH: geometry.depth,
            H_MAX_NUM_REQS: geometry.max_num_reqs,
            H_MAX_NUM_TOKENS: geometry.max_num_tokens,
            H_NUM_TABLES: len(geometry.tables),
            H_HEADER_BYTES: layout.header_bytes,
            H_SLOT_HEADER_STRIDE: layout.slot_header_stride,
            H_CONTROL_BYTES: layout.control_bytes,
            H_DATA_OFFSET: data_offset,
            H_SLOT_DATA_STRIDE: layout.slot_data_stride,
            H_DATA_BYTES: layout.data_bytes,
        }
        for word, value in expected.items():
            if int(header[word]) != value:
                raise DescriptorError(
                    f"{descriptor.path}: header word {word} is {int(header[word])}, the "
                    f"descriptor's geometry implies {value}"
                )
        for i, entry in enumerate(geometry.tables):
            found = tuple(int(v) for v in header[H_TABLES + 3 * i : H_TABLES + 3 * i + 3])
            if found != entry:
                raise DescriptorError(
                    f"{descriptor.path}: table {i} is {found} in the ring, {entry} in the "
                    "descriptor"
                )
        if int(header[H_STATE]) == STATE_INITIALISING:
            raise DescriptorError(f"{descriptor.path}: the ring is not initialised yet")

    def wake(self, slot: int) -> None:
        """Wake readers sleeping on slot ``slot``'s seq word (writer side)."""
        futex_wake(self.seq_addresses[slot])

    def wake_all(self) -> None:
        for address in self.seq_addresses:
            futex_wake(address)

    @property
    def state(self) -> int:
        return int(self.header[H_STATE])

    @property
    def last_step(self) -> int:
        return int(self.header[H_LAST_STEP])


# -- results -------------------------------------------------------------------------------------
class TablesLike(Protocol):
    """Anything shaped like one published table (``pagekeeper.core.types.BatchTables``,
    :class:`TableArrays`)."""

    @property
    def group_id(self) -> int: ...
    @property
    def kernel_block_size(self) -> int: ...
    @property
    def block_table(self) -> Int32Array: ...
    @property
    def row_lengths(self) -> Int32Array: ...
    @property
    def slot_mapping(self) -> Int64Array: ...
    @property
    def pad_id(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TableArrays:
    """One table of a step as numpy arrays (rows in batch order).

    ``block_table[i, :row_lengths[i]]`` are request i's kernel block ids. Views from a
    zero-copy read are read-only and valid until ``depth`` more steps are published.
    """

    group_id: int
    kernel_block_size: int
    block_table: Int32Array
    row_lengths: Int32Array
    slot_mapping: Int64Array
    pad_id: int = 0


@dataclass(frozen=True, slots=True)
class TorchTables:
    """One table of a step as torch tensors (int32 block table and row lengths, int64 slot
    mapping), on the worker's device."""

    group_id: int
    kernel_block_size: int
    block_table: torch.Tensor
    row_lengths: torch.Tensor
    slot_mapping: torch.Tensor
    pad_id: int = 0


def _find_table(tables: Sequence[Any], group_id: int, kernel_block_size: int | None) -> Any:
    matches = [
        t
        for t in tables
        if t.group_id == group_id
        and (kernel_block_size is None or t.kernel_block_size == kernel_block_size)
    ]
    if len(matches) != 1:
        what = f"group {group_id}" + (
            "" if kernel_block_size is None else f", kernel block size {kernel_block_size}"
        )
        raise KeyError(f"{len(matches)} tables match {what}")
    return matches[0]


@dataclass(frozen=True, slots=True)
class StepTables:
    """A published step's tables as numpy arrays."""

    step_seq: int
    epoch: int
    num_reqs: int
    tables: tuple[TableArrays, ...]
    is_copy: bool = True

    def table(self, group_id: int = 0, kernel_block_size: int | None = None) -> TableArrays:
        """The table of one group (and kernel block size, when a group has several)."""
        table: TableArrays = _find_table(self.tables, group_id, kernel_block_size)
        return table

    def to_torch(
        self, device: str | torch.device | None = None, *, non_blocking: bool = False
    ) -> TorchStepTables:
        """Wrap the arrays as CPU tensors (zero-copy, ``torch.from_numpy``) and, for a
        device, copy them there (``non_blocking`` needs pinned memory to overlap)."""
        from pagekeeper_client.transports._torch import step_to_torch

        return step_to_torch(self, device, non_blocking=non_blocking)


@dataclass(frozen=True, slots=True)
class TorchStepTables:
    """A published step's tables as torch tensors."""

    step_seq: int
    epoch: int
    num_reqs: int
    tables: tuple[TorchTables, ...]

    def table(self, group_id: int = 0, kernel_block_size: int | None = None) -> TorchTables:
        table: TorchTables = _find_table(self.tables, group_id, kernel_block_size)
        return table


@dataclass(slots=True)
class ReaderStats:
    """Cheap counters a view keeps (the stress tests read them)."""

    num_reads: int = 0
    num_busy_polls: int = 0
    """Polls that found the slot being written (seq odd)."""
    num_stale_polls: int = 0
    """Polls that found an older step in the slot."""
    num_sleeps: int = 0
    num_fell_behind: int = 0


# -- slot data views -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SlotArrays:
    """Full-capacity numpy views of one slot's arrays in a host buffer."""

    block_tables: tuple[Int32Array, ...]
    row_lengths: tuple[Int32Array, ...]
    slot_mappings: tuple[Int64Array, ...]


def slot_arrays(buffer: Any, layout: RingLayout, slot: int, data_offset: int) -> SlotArrays:
    """numpy views of slot ``slot`` of a ring whose data starts at ``data_offset``."""
    base = layout.slot_offset(slot, data_offset)
    r = layout.geometry.max_num_reqs
    n = layout.geometry.max_num_tokens
    bts: list[Int32Array] = []
    rls: list[Int32Array] = []
    sms: list[Int64Array] = []
    for t in layout.tables:
        bts.append(
            np.frombuffer(
                buffer, np.int32, r * t.max_kernel_blocks, base + t.block_table_offset
            ).reshape(r, t.max_kernel_blocks)
        )
        rls.append(np.frombuffer(buffer, np.int32, r, base + t.row_lengths_offset))
        sms.append(np.frombuffer(buffer, np.int64, n, base + t.slot_mapping_offset))
    return SlotArrays(tuple(bts), tuple(rls), tuple(sms))
