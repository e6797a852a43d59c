"""Stream transport: a slot's contents as one self-describing byte string.

For a worker on another host, the service's ``WatchTables`` server stream carries each
published step as ``pack_slot(...)`` bytes (raw little-endian arrays after a small header);
the worker feeds them to a :class:`StreamTableView`, which answers ``wait(step)`` like the
mapped transports (same timeouts, same "reader fell behind" rule over ``depth`` steps).

Packed slot format (version 1, little-endian)::

    header  32 B  magic "PKSLOT\\0\\1", u32 layout version, u32 num_tables,
                  i64 step_seq, u64 epoch (the ring generation), u32 num_reqs, u32 reserved
    tables  24 B each: i32 group_id, i32 kernel_block_size, u32 num_cols, u32 num_tokens,
                  i32 pad_id, u32 reserved
    arrays  per table, each padded to 8 bytes: block_table int32 [num_reqs, num_cols],
                  row_lengths int32 [num_reqs], slot_mapping int64 [num_tokens]
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pagekeeper_client.ring import (
    LAYOUT_VERSION,
    DescriptorError,
    ReaderFellBehind,
    ReaderStats,
    RingClosed,
    RingDescriptor,
    RingError,
    SlotFormatError,
    StepTables,
    StepTimeout,
    TableArrays,
    TablesLike,
    TorchStepTables,
    validate_descriptor,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

SLOT_MAGIC = b"PKSLOT\x00\x01"
_HEADER = struct.Struct("<8sIIqQII")
_TABLE = struct.Struct("<iiIIiI")
_PAD = bytes(8)


def _pad8(nbytes: int) -> int:
    return -nbytes % 8


def pack_slot(step_seq: int, epoch: int, tables: Sequence[TablesLike]) -> bytes:
    """Pack one step's tables (``BatchTables`` or :class:`TableArrays`) into bytes.

    Arrays must have the layout's dtypes (int32 tables and lengths, int64 slot mapping) and
    one row per request in every table. One copy of the array bytes is made.
    """
    if not tables:
        raise ValueError("pack_slot: at least one table")
    num_reqs = int(tables[0].block_table.shape[0])
    heads = [_HEADER.pack(SLOT_MAGIC, LAYOUT_VERSION, len(tables), step_seq, epoch, num_reqs, 0)]
    bodies: list[Any] = []
    for i, t in enumerate(tables):
        bt, rl, sm = t.block_table, t.row_lengths, t.slot_mapping
        if bt.dtype != np.int32 or rl.dtype != np.int32 or sm.dtype != np.int64:
            raise ValueError(
                f"pack_slot: table {i} dtypes are {bt.dtype}/{rl.dtype}/{sm.dtype}, "
                "expected int32/int32/int64"
            )
        if bt.ndim != 2 or bt.shape[0] != num_reqs or rl.shape != (num_reqs,) or sm.ndim != 1:
            raise ValueError(
                f"pack_slot: table {i} shapes {bt.shape}/{rl.shape}/{sm.shape} do not describe "
                f"{num_reqs} requests"
            )
        heads.append(
            _TABLE.pack(t.group_id, t.kernel_block_size, bt.shape[1], sm.shape[0], t.pad_id, 0)
        )
        for array in (bt, rl, sm):
            contiguous = np.ascontiguousarray(array)
            if contiguous.nbytes == 0:
                continue  # nothing to send (and memoryview cannot cast an empty shape)
            bodies.append(contiguous.data.cast("B"))
            pad = _pad8(contiguous.nbytes)
            if pad:
                bodies.append(_PAD[:pad])
    return b"".join([*heads, *bodies])


def unpack_slot(payload: bytes | bytearray | memoryview) -> StepTables:
    """Decode :func:`pack_slot` bytes; the arrays are zero-copy views of ``payload``
    (read-only for ``bytes``). Raises :class:`SlotFormatError` on any inconsistency."""
    view = memoryview(payload).cast("B")
    size = len(view)
    if size < _HEADER.size:
        raise SlotFormatError(f"packed slot: {size} bytes is shorter than its header")
    magic, version, num_tables, step_seq, epoch, num_reqs, _ = _HEADER.unpack_from(view, 0)
    if magic != SLOT_MAGIC:
        raise SlotFormatError("packed slot: bad magic")
    if version != LAYOUT_VERSION:
        raise SlotFormatError(
            f"packed slot: layout version {version}, reader knows {LAYOUT_VERSION}"
        )
    offset = _HEADER.size + num_tables * _TABLE.size
    if num_tables < 1 or offset > size:
        raise SlotFormatError(f"packed slot: {num_tables} tables do not fit in {size} bytes")
    tables = []
    for i in range(num_tables):
        group_id, kbs, num_cols, num_tokens, pad_id, _ = _TABLE.unpack_from(
            view, _HEADER.size + i * _TABLE.size
        )
        arrays: list[Any] = []
        for dtype, count in (
            (np.int32, num_reqs * num_cols),
            (np.int32, num_reqs),
            (np.int64, num_tokens),
        ):
            nbytes = count * np.dtype(dtype).itemsize
            if offset + nbytes > size:
                raise SlotFormatError(f"packed slot: table {i} runs past the end ({size} bytes)")
            arrays.append(np.frombuffer(view, dtype=dtype, count=count, offset=offset))
            offset += nbytes + _pad8(nbytes)
        tables.append(
            TableArrays(
                group_id,
                kbs,
                arrays[0].reshape(num_reqs, num_cols),
                arrays[1],
                arrays[2],
                pad_id,
            )
        )
    if offset != size:
        raise SlotFormatError(f"packed slot: {size - offset} trailing bytes")
    return StepTables(step_seq, epoch, num_reqs, tuple(tables), is_copy=False)


class StreamTableView:
    """A worker's view of the stream transport: ``feed`` it the packed slots a
    ``WatchTables`` stream delivers (in step order); ``wait`` like the mapped views.

    Holds the last ``depth`` steps that arrived, so the "fell behind" rule matches the
    rings: step ``S`` is gone once ``depth`` later steps arrived.
    """

    def __init__(self, descriptor: RingDescriptor) -> None:
        layout = validate_descriptor(descriptor)
        if descriptor.kind != "stream":
            raise DescriptorError(f"StreamTableView reads 'stream' rings, not {descriptor.kind!r}")
        self._descriptor = descriptor
        self._layout = layout
        self._depth = descriptor.geometry.depth
        self._slots: list[StepTables | None] = [None] * self._depth
        """The last ``depth`` steps that arrived, in slots taken in turn (as the rings)."""
        self._next_slot = 0
        self._last_step = -1
        self._is_closed = False
        self._is_view_closed = False
        self._cond = threading.Condition()
        self.stats = ReaderStats()

    @property
    def descriptor(self) -> RingDescriptor:
        return self._descriptor

    def feed(self, payload: bytes | bytearray | memoryview) -> int:
        """Accept one packed slot; returns its step. Raises :class:`SlotFormatError` for a
        slot that is malformed, from another generation, outside the geometry, or out of
        order (nothing is stored then)."""
        step = unpack_slot(payload)
        geometry = self._descriptor.geometry
        if step.epoch != self._descriptor.generation:
            raise SlotFormatError(
                f"packed slot of generation {step.epoch}, this view follows generation "
                f"{self._descriptor.generation}"
            )
        if step.num_reqs > geometry.max_num_reqs:
            raise SlotFormatError(
                f"packed slot: {step.num_reqs} requests > {geometry.max_num_reqs}"
            )
        found = sorted((t.group_id, t.kernel_block_size) for t in step.tables)
        expected = sorted((g, k) for g, k, _ in geometry.tables)
        if found != expected:
            raise SlotFormatError(f"packed slot tables {found} != ring tables {expected}")
        for t in step.tables:
            limit = geometry.tables[geometry.table_index(t.group_id, t.kernel_block_size)][2]
            if t.block_table.shape[1] > limit or t.slot_mapping.shape[0] > geometry.max_num_tokens:
                raise SlotFormatError(
                    f"packed slot: table ({t.group_id}, {t.kernel_block_size}) exceeds the geometry"
                )
        with self._cond:
            if step.step_seq <= self._last_step:
                raise SlotFormatError(
                    f"packed slot step {step.step_seq} arrived after step {self._last_step}"
                )
            self._slots[self._next_slot] = step
            self._next_slot = (self._next_slot + 1) % self._depth
            self._last_step = step.step_seq
            self._cond.notify_all()
        return step.step_seq

    def carry(self, old: StreamTableView) -> None:
        """Take over the steps ``old`` holds (the same ring, its stream resumed): a step it
        delivered stays readable, and the resumed stream goes on after its last."""
        if old.descriptor != self._descriptor:
            raise ValueError("carry: the views follow different rings")
        with old._cond:
            slots, next_slot, last = list(old._slots), old._next_slot, old._last_step
        with self._cond:
            self._slots, self._next_slot, self._last_step = slots, next_slot, last

    def feed_all(self, payloads: Iterable[bytes]) -> None:
        """Feed a whole stream (e.g. a ``WatchTables`` response iterator), then mark the
        view closed: waiters for steps that never came get :class:`RingClosed`."""
        try:
            for payload in payloads:
                self.feed(payload)
        finally:
            self.mark_closed()

    def mark_closed(self) -> None:
        """The stream ended: no further step will arrive."""
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()

    @property
    def has_ended(self) -> bool:
        """Whether :meth:`mark_closed` was called (the stream ended)."""
        return self._is_closed

    def latest_step(self) -> int:
        with self._cond:
            return self._last_step

    def is_current(self, step_seq: int) -> bool:
        with self._cond:
            return self._held(step_seq) is not None

    def _held(self, step_seq: int) -> StepTables | None:
        for held in self._slots:
            if held is not None and held.step_seq == step_seq:
                return held
        return None

    def wait(self, step_seq: int, timeout: float | None = None, *, copy: bool = True) -> StepTables:
        """Block until step ``step_seq`` arrived; return its tables (``copy=False``: the
        read-only arrays decoded in place from the message, which never change)."""
        if not isinstance(step_seq, int) or step_seq < 0:
            raise ValueError(f"step_seq must be an int >= 0, got {step_seq!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._is_view_closed:
                    raise RingError("this table view is closed")
                held = self._held(step_seq)
                if held is not None:
                    self.stats.num_reads += 1
                    return _copy_step(held) if copy else held
                found = self._last_step
                if found > step_seq:
                    self.stats.num_fell_behind += 1
                    raise ReaderFellBehind(
                        f"step {step_seq} is gone: the view holds steps up to {found} (depth "
                        f"{self._depth}); the reader fell behind (or step {step_seq} was never "
                        "published)",
                        step_seq=step_seq,
                        found_step=found,
                    )
                if self._is_closed:
                    raise RingClosed(
                        f"step {step_seq} will never arrive: the stream ended after step "
                        f"{self._last_step}"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise StepTimeout(
                        f"step {step_seq} did not arrive within {timeout}s: the view holds "
                        f"steps up to {found} (stale)"
                    )
                self.stats.num_sleeps += 1
                self._cond.wait(remaining)

    def wait_tensors(
        self,
        step_seq: int,
        timeout: float | None = None,
        *,
        device: str | torch.device | None = None,
        copy: bool = True,
    ) -> TorchStepTables:
        """Step ``step_seq``'s tables as torch tensors (copied to ``device`` if given)."""
        return self.wait(step_seq, timeout, copy=copy).to_torch(device, non_blocking=False)

    def close(self) -> None:
        with self._cond:
            self._is_view_closed = True
            self._slots = [None] * self._depth
            self._cond.notify_all()

    def __enter__(self) -> StreamTableView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_step(step: StepTables) -> StepTables:
    return StepTables(
        step.step_seq,
        step.epoch,
        step.num_reqs,
        tuple(
            TableArrays(
                t.group_id,
                t.kernel_block_size,
                t.block_table.copy(),
                t.row_lengths.copy(),
                t.slot_mapping.copy(),
                t.pad_id,
            )
            for t in step.tables
        ),
        is_copy=True,
    )
