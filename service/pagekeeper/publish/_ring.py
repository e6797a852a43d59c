"""What every ring writer shares: batch validation, the seqlock write, file resources.

The byte layout itself lives in ``pagekeeper_client.ring`` (one definition, readable by a
worker without the service).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagekeeper.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pagekeeper.core.types import BatchTables
from pagekeeper_client._futex import futex_wake
from pagekeeper_client.ring import (
    H_LAST_STEP,
    H_STATE,
    NO_STEP,
    S_EPOCH,
    S_NUM_REQS,
    S_NUM_TOKENS,
    S_SEQ,
    S_STEP,
    S_TABLES,
    SLOT_TABLE_WORDS,
    STATE_CLOSED,
    DescriptorError,
    RingControl,
    RingDescriptor,
    RingGeometry,
    RingLayout,
    SlotArrays,
    memory_fence,
    slot_arrays,
)

_generation_lock = threading.Lock()
_last_generation = 0


def new_generation() -> int:
    """A positive id, increasing across calls and process restarts (wall-clock ns)."""
    global _last_generation
    with _generation_lock:
        _last_generation = max(time.time_ns(), _last_generation + 1)
        return _last_generation


def default_shm_dir() -> str:
    """``/dev/shm`` (tmpfs) where it exists, else the temp dir (still page-cache backed)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_name_counter = itertools.count()


def create_ring_file(
    shm_dir: str | None, kind: str, generation: int, size: int, mode: int
) -> tuple[str, mmap.mmap]:
    """Create (exclusively), size and map a shared-memory file; return (path, mapping)."""
    directory = shm_dir or default_shm_dir()
    path = os.path.join(
        directory, f"pagekeeper-{kind}-{os.getpid()}-{generation:x}-{next(_name_counter)}"
    )
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path, mapping


class Resources:
    """OS resources of one ring, released once (by ``close`` or when the publisher is
    garbage collected): files to unlink, fds to close, mappings to unmap."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.fds: list[int] = []
        self.mappings: list[mmap.mmap] = []
        self.control: mmap.mmap | None = None
        self.seq_addresses: tuple[int, ...] = ()

    def release(self) -> None:
        if self.control is not None and not self.control.closed:
            # Readers learn the ring is gone even when the publisher was never closed
            # explicitly (garbage collected, or the process exiting normally), and sleeping
            # ones wake up to see it.
            struct.pack_into("<q", self.control, 8 * H_STATE, STATE_CLOSED)
            for address in self.seq_addresses:
                futex_wake(address)
        self.control = None
        self.seq_addresses = ()
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.paths = []
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        for mapping in self.mappings:
            # numpy views still alive: the mapping goes with the last of them
            with contextlib.suppress(BufferError):
                mapping.close()
        self.mappings = []


@dataclass(frozen=True, slots=True)
class CheckedTable:
    """One validated table and its position in the slot."""

    index: int
    tables: Any  # BatchTables or anything shaped like it
    num_cols: int
    num_tokens: int


class RingWriter:
    """The publish protocol over a control block; subclasses write the slot data.

    ``publish`` is serialised by a lock (the service calls it from its event loop, tests
    from threads). A failed validation writes nothing; a failure while writing (device
    error) leaves the slot empty (step -1), never half-written and marked stable.
    """

    kind = ""

    def __init__(self, geometry: RingGeometry, generation: int | None) -> None:
        try:
            self._layout = RingLayout.for_geometry(geometry)
        except DescriptorError as exc:
            raise InvalidArgument(f"ring geometry: {exc}") from None
        if generation is not None and (not isinstance(generation, int) or generation <= 0):
            raise InvalidArgument(f"generation must be a positive int, got {generation!r}")
        self._geometry = geometry
        self._generation = generation if generation is not None else new_generation()
        self._depth = geometry.depth
        self._next_slot = 0
        """Slots are taken in turn, one per published step (published step ids have gaps:
        a step that admits only publishes nothing), so the last ``depth`` published steps
        are always in the ring."""
        self._last_step = NO_STEP
        self._is_closed = False
        self._lock = threading.Lock()
        self._index = {(g, k): i for i, (g, k, _) in enumerate(geometry.tables)}

    @property
    def geometry(self) -> RingGeometry:
        return self._geometry

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def last_step(self) -> int:
        return self._last_step

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    # -- validation -------------------------------------------------------------------------
    def check_batch(
        self, step_seq: int, tables: Sequence[BatchTables]
    ) -> tuple[int, list[CheckedTable]]:
        """Validate a batch against the geometry; return (num_reqs, tables in slot order).

        ``InvalidArgument`` for a malformed batch, ``ResourceExhausted`` for one that does not
        fit the geometry, ``FailedPrecondition`` after close.
        """
        if self._is_closed:
            raise FailedPrecondition(f"{self.kind} publisher is closed")
        if not isinstance(step_seq, int) or isinstance(step_seq, bool) or step_seq < 0:
            raise InvalidArgument(f"step_seq must be an int >= 0, got {step_seq!r}")
        if step_seq <= self._last_step:
            raise InvalidArgument(
                f"step_seq {step_seq} must exceed the last published step {self._last_step}"
            )
        geometry = self._geometry
        if len(tables) != len(geometry.tables):
            raise InvalidArgument(
                f"a batch publishes {len(geometry.tables)} tables {self._names()}, "
                f"got {len(tables)}"
            )
        checked: list[CheckedTable | None] = [None] * len(tables)
        num_reqs = -1
        for t in tables:
            key = (t.group_id, t.kernel_block_size)
            index = self._index.get(key)
            if index is None:
                raise InvalidArgument(f"table {key} is not in this ring {self._names()}")
            if checked[index] is not None:
                raise InvalidArgument(f"table {key} appears twice in the batch")
            bt, rl, sm = t.block_table, t.row_lengths, t.slot_mapping
            for name, array, dtype, ndim in (
                ("block_table", bt, np.int32, 2),
                ("row_lengths", rl, np.int32, 1),
                ("slot_mapping", sm, np.int64, 1),
            ):
                if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != ndim:
                    raise InvalidArgument(
                        f"table {key}: {name} must be a {ndim}-D {np.dtype(dtype).name} array, got "
                        f"{getattr(array, 'dtype', type(array).__name__)} "
                        f"{getattr(array, 'shape', '')}"
                    )
            rows, cols = bt.shape
            if rl.shape[0] != rows:
                raise InvalidArgument(f"table {key}: {rl.shape[0]} row lengths for {rows} rows")
            if num_reqs not in (-1, rows):
                raise InvalidArgument(f"table {key}: {rows} rows, other tables have {num_reqs}")
            num_reqs = rows
            if rows > geometry.max_num_reqs:
                raise ResourceExhausted(
                    f"batch of {rows} requests exceeds the ring's max_num_reqs "
                    f"{geometry.max_num_reqs}"
                )
            max_cols = geometry.tables[index][2]
            if cols > max_cols:
                raise ResourceExhausted(
                    f"table {key}: {cols} kernel blocks per row exceed the ring's {max_cols}"
                )
            if sm.shape[0] > geometry.max_num_tokens:
                raise ResourceExhausted(
                    f"table {key}: {sm.shape[0]} tokens exceed the ring's max_num_tokens "
                    f"{geometry.max_num_tokens}"
                )
            if rows and (int(rl.min()) < 0 or int(rl.max()) > cols):
                raise InvalidArgument(f"table {key}: row lengths must lie in [0, {cols}]")
            checked[index] = CheckedTable(index, t, cols, sm.shape[0])
        return num_reqs, [c for c in checked if c is not None]

    def _names(self) -> list[tuple[int, int]]:
        return [(g, k) for g, k, _ in self._geometry.tables]

    # -- the seqlock write ----------------------------------------------------------------------
    def _publish_seqlocked(
        self, control: RingControl, step_seq: int, tables: Sequence[BatchTables]
    ) -> int:
        with self._lock:
            num_reqs, checked = self.check_batch(step_seq, tables)
            slot = self._next_slot
            words = control.slots[slot]
            seq = int(words[S_SEQ])
            words[S_SEQ] = seq + 1  # odd: readers keep off
            memory_fence()
            try:
                self._write_data(slot, num_reqs, checked)
                words[S_STEP] = step_seq
                words[S_EPOCH] = self._generation
                words[S_NUM_REQS] = num_reqs
                words[S_NUM_TOKENS] = max(c.num_tokens for c in checked)
                for c in checked:
                    base = S_TABLES + SLOT_TABLE_WORDS * c.index
                    words[base] = c.num_cols
                    words[base + 1] = c.tables.pad_id
                    words[base + 2] = c.num_tokens
                self._after_data(slot)
            except BaseException:
                words[S_STEP] = NO_STEP
                memory_fence()
                words[S_SEQ] = seq + 2
                control.wake(slot)
                raise
            memory_fence()
            words[S_SEQ] = seq + 2  # even: stable
            control.header[H_LAST_STEP] = step_seq
            self._last_step = step_seq
            self._next_slot = (slot + 1) % self._depth  # a failed write keeps its slot
        control.wake(slot)  # readers asleep on this slot's seq word
        return slot

    def _write_data(self, slot: int, num_reqs: int, checked: list[CheckedTable]) -> None:
        raise NotImplementedError

    def _after_data(self, slot: int) -> None:
        """Hook after the data is written and before the slot turns stable (CUDA: record
        the slot's interprocess event)."""


def write_host_slot(arrays: SlotArrays, num_reqs: int, checked: list[CheckedTable]) -> None:
    """Copy validated tables into a slot's host views (one memcpy per array when rows are
    full width)."""
    for c in checked:
        t = c.tables
        bt = arrays.block_tables[c.index]
        if c.num_cols == bt.shape[1]:
            np.copyto(bt[:num_reqs], t.block_table)
        else:
            np.copyto(bt[:num_reqs, : c.num_cols], t.block_table)
        np.copyto(arrays.row_lengths[c.index][:num_reqs], t.row_lengths)
        np.copyto(arrays.slot_mappings[c.index][: c.num_tokens], t.slot_mapping)


class HostRingWriter(RingWriter):
    """A ring whose data lies in host memory the writer maps (shm, cpu_ipc)."""

    def __init__(self, geometry: RingGeometry, generation: int | None) -> None:
        super().__init__(geometry, generation)
        self._resources = Resources()
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._control: RingControl | None = None
        self._slots: list[SlotArrays] = []

    def _attach(self, control_buffer: Any, data_buffer: Any, data_offset: int) -> None:
        control = RingControl(control_buffer, self._layout)
        self._slots = [
            slot_arrays(data_buffer, self._layout, slot, data_offset) for slot in range(self._depth)
        ]
        # Touch every data page now, so the first steps do not pay the page faults.
        np.frombuffer(data_buffer, np.uint8, self._layout.data_bytes, data_offset)[:] = 0
        control.initialise(
            generation=self._generation, data_offset=data_offset, writer_pid=os.getpid()
        )
        self._resources.seq_addresses = control.seq_addresses
        self._control = control

    def publish(self, step_seq: int, tables: Sequence[BatchTables]) -> int:
        """Write step ``step_seq`` into the next slot in turn (see ``TablePublisher``)."""
        if self._control is None:
            raise FailedPrecondition(f"{self.kind} publisher is closed")
        return self._publish_seqlocked(self._control, step_seq, tables)

    def _write_data(self, slot: int, num_reqs: int, checked: list[CheckedTable]) -> None:
        write_host_slot(self._slots[slot], num_reqs, checked)

    def descriptor(self) -> RingDescriptor:
        raise NotImplementedError

    def close(self) -> None:
        """Mark the ring closed for readers, then release it (idempotent)."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            if self._control is not None:
                self._control.header[H_STATE] = STATE_CLOSED
                self._control.wake_all()
            self._control = None
            self._slots = []
        self._finalizer()

    def __enter__(self) -> HostRingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
