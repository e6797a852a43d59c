"""The seqlock reader shared by every transport that maps a control block (shm, cpu_ipc,
cuda_ipc), and the host-memory reader used by shm and cpu_ipc."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagekeeper_client import _futex
from pagekeeper_client.ring import (
    NO_STEP,
    S_EPOCH,
    S_NUM_REQS,
    S_SEQ,
    S_STEP,
    S_TABLES,
    SLOT_TABLE_WORDS,
    STATE_CLOSED,
    DescriptorError,
    ReaderFellBehind,
    ReaderStats,
    RingClosed,
    RingControl,
    RingDescriptor,
    RingError,
    RingLayout,
    StepTables,
    StepTimeout,
    TableArrays,
    TorchStepTables,
    TorchTables,
    memory_fence,
    slot_arrays,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

SPIN_SECONDS = 50e-6
"""Busy-poll this long before sleeping: a step usually lands within microseconds of the
scheduler's Step reply, and a sleep costs ~60 us of scheduler latency at least."""
MIN_SLEEP_SECONDS = 20e-6
MAX_SLEEP_SECONDS = 1e-3
"""Backoff ceiling where futexes are unavailable: a step is noticed at most ~1 ms late."""
FUTEX_MAX_WAIT_SECONDS = 0.05
"""Longest single futex sleep: closure and exporter death are noticed within this."""


@dataclass(frozen=True, slots=True)
class TableMeta:
    num_cols: int
    pad_id: int
    num_tokens: int


def map_file(path: str, size: int, *, writable: bool, what: str) -> mmap.mmap:
    """mmap a whole file of exactly ``size`` bytes, turning OS errors into clear ones."""
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise DescriptorError(
            f"{what} {path} does not exist: the publisher closed the ring (or it was never "
            "created on this host)"
        ) from None
    except PermissionError as exc:
        raise DescriptorError(f"{what} {path}: permission denied ({exc})") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise DescriptorError(f"{what} {path} is {actual} bytes, the descriptor says {size}")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(fd, size, access=access)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 probes without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def close_mapping(mapping: mmap.mmap) -> None:
    """Unmap now, or (if numpy views of it are still alive) when the last view goes."""
    with contextlib.suppress(BufferError):
        mapping.close()


class SeqlockReader:
    """Waits for steps in a ring's control block; subclasses read the slot data.

    ``invalidate_on_close``: IPC transports lose their data when the exporter closes (CUDA
    memory is freed), so every read after close fails; shared memory stays mapped, so a
    closed shm ring still serves the steps already in it.
    """

    def __init__(
        self,
        descriptor: RingDescriptor,
        layout: RingLayout,
        control: RingControl,
        *,
        invalidate_on_close: bool,
    ) -> None:
        self._descriptor = descriptor
        self._layout = layout
        self._control = control
        self._depth = layout.geometry.depth
        self._invalidate_on_close = invalidate_on_close
        self._is_closed = False
        self.stats = ReaderStats()

    @property
    def descriptor(self) -> RingDescriptor:
        return self._descriptor

    @property
    def layout(self) -> RingLayout:
        return self._layout

    def latest_step(self) -> int:
        """The last step the publisher finished writing (-1 before the first). Raises
        :class:`RingClosed` once the publisher closed the ring: no later step will come
        (a closed shm ring still serves the steps in it to :meth:`wait`)."""
        self._check_open()
        if self._control.state == STATE_CLOSED:
            raise RingClosed(
                f"{self._descriptor.kind} ring generation {self._descriptor.generation} is "
                f"closed (last published step {self._control.last_step})"
            )
        return self._control.last_step

    def is_current(self, step_seq: int) -> bool:
        """True while step ``step_seq``'s slot still holds it unchanged (not being
        overwritten). Check after using zero-copy views to prove they were not torn."""
        self._check_open()
        return self._find(step_seq) is not None

    def _find(self, step_seq: int) -> tuple[int, int] | None:
        """(slot, seq) of the slot holding step ``step_seq`` stable, if one does."""
        slots = self._control.slots
        for slot in range(self._depth):
            seq = int(slots[slot, S_SEQ])
            if seq % 2 == 0 and int(slots[slot, S_STEP]) == step_seq:
                memory_fence()
                if int(slots[slot, S_SEQ]) == seq:
                    return slot, seq
        return None

    def _check_open(self) -> None:
        if self._is_closed:
            raise RingError("this table view is closed")
        if self._invalidate_on_close:
            if self._control.state == STATE_CLOSED:
                raise RingClosed(
                    f"{self._descriptor.kind} ring generation {self._descriptor.generation}: "
                    "the exporter closed it, so every import is invalid (the exporter must "
                    "outlive its importers)"
                )
            if not pid_alive(self._descriptor.exporter_pid):
                raise RingClosed(
                    f"{self._descriptor.kind} ring generation {self._descriptor.generation}: "
                    f"the exporter (pid {self._descriptor.exporter_pid}) exited, so every "
                    "import is invalid (the exporter must outlive its importers)"
                )

    def _await_slot(self, step_seq: int, timeout: float | None) -> tuple[int, int]:
        """Block until step ``step_seq`` is stable in a slot; return (slot, seq).

        The writer takes the slots in turn, one per published step (step ids have gaps), so
        each poll looks at every slot (``depth`` is small). Spins for
        :data:`SPIN_SECONDS`, then sleeps on the seq word of the slot the writer takes
        next (with exponential backoff up to :data:`MAX_SLEEP_SECONDS` without futexes).
        """
        if not isinstance(step_seq, int) or step_seq < 0:
            raise ValueError(f"step_seq must be an int >= 0, got {step_seq!r}")
        self._check_open()
        depth = self._depth
        slots = self._control.slots
        stats = self.stats
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        spin_until = time.perf_counter() + SPIN_SECONDS
        delay = MIN_SLEEP_SECONDS
        seqs = [0] * depth
        saw_later = False
        while True:
            newest, newest_slot = NO_STEP, -1
            for slot in range(depth):
                seq = seqs[slot] = int(slots[slot, S_SEQ])
                if seq % 2:
                    stats.num_busy_polls += 1
                    continue
                found = int(slots[slot, S_STEP])
                memory_fence()
                if int(slots[slot, S_SEQ]) != seq:
                    continue
                if found == step_seq:
                    return slot, seq
                if found > newest:
                    newest, newest_slot = found, slot
            if newest > step_seq:
                # A later step is in the ring but not this one. Look once more (this pass
                # may have read its slot before the writer filled it, and the later one's
                # after): if it is still missing, it was overwritten (or never published).
                if saw_later:
                    stats.num_fell_behind += 1
                    raise ReaderFellBehind(
                        f"step {step_seq} is gone: the ring holds steps up to {newest} "
                        f"(depth {depth}); the reader fell behind (or step {step_seq} was "
                        "never published)",
                        step_seq=step_seq,
                        found_step=newest,
                    )
                saw_later = True
                continue
            stats.num_stale_polls += 1
            state = self._control.state
            if state == STATE_CLOSED:
                self._check_open()  # raises for IPC transports
                raise RingClosed(
                    f"step {step_seq} will never arrive: the publisher closed the ring "
                    f"(last published step {self._control.last_step})"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise StepTimeout(
                    f"step {step_seq} was not published within {timeout}s: the ring holds "
                    f"steps up to {newest} (stale), last published step "
                    f"{self._control.last_step}"
                )
            if time.perf_counter() < spin_until:
                continue
            stats.num_sleeps += 1
            if _futex.AVAILABLE:
                # Sleep in the kernel until the writer changes the seq of the slot it takes
                # next (it wakes us right after); the cap re-checks closure and liveness.
                upcoming = (newest_slot + 1) % depth if newest_slot >= 0 else 0
                wait = FUTEX_MAX_WAIT_SECONDS
                if deadline is not None:
                    wait = min(wait, max(deadline - time.monotonic(), 0.0))
                _futex.futex_wait(self._control.seq_addresses[upcoming], seqs[upcoming], wait)
                continue
            if deadline is not None:
                delay = min(delay, max(deadline - time.monotonic(), 0.0))
            time.sleep(delay)
            delay = min(delay * 2, MAX_SLEEP_SECONDS)

    def _read_meta(self, slot: int) -> tuple[int, int, tuple[TableMeta, ...]]:
        """(num_reqs, epoch, per-table meta) of a slot; validated against the geometry so a
        corrupt slot cannot make a reader index outside the ring."""
        words = self._control.slots[slot].tolist()  # one C call instead of one per word
        geometry = self._layout.geometry
        num_reqs = words[S_NUM_REQS]
        epoch = words[S_EPOCH]
        metas = []
        for t, (_, _, max_kernel_blocks) in enumerate(geometry.tables):
            base = S_TABLES + SLOT_TABLE_WORDS * t
            meta = TableMeta(words[base], words[base + 1], words[base + 2])
            if not (
                0 <= meta.num_cols <= max_kernel_blocks
                and 0 <= meta.num_tokens <= geometry.max_num_tokens
            ):
                raise RingError(f"slot {slot} table {t} is corrupt: {meta}")
            metas.append(meta)
        if not 0 <= num_reqs <= geometry.max_num_reqs:
            raise RingError(f"slot {slot} is corrupt: num_reqs {num_reqs}")
        return num_reqs, epoch, tuple(metas)

    def _recheck(self, slot: int, seq: int, step_seq: int, *, count: bool = True) -> None:
        """After reading: the slot's seq must not have moved, or the data may be torn."""
        memory_fence()
        now = int(self._control.slots[slot, S_SEQ])
        if now != seq:
            self.stats.num_fell_behind += 1
            raise ReaderFellBehind(
                f"step {step_seq} was overwritten while it was being read (slot {slot} seq "
                f"{seq} -> {now}); the reader fell behind",
                step_seq=step_seq,
                found_step=int(self._control.slots[slot, S_STEP]),
            )
        if count:
            self.stats.num_reads += 1


class _DeviceStager:
    """Copies host slots to one CUDA device, once per step, without blocking the CPU.

    ``staging`` mode: memcpy the slot into a pinned buffer (validated by the seqlock right
    away), then an async H2D copy. ``register`` mode: the ring mapping itself is pinned with
    ``cudaHostRegister``; the H2D copy reads it directly and the seqlock is re-checked once
    that copy completed (a short host wait).
    """

    def __init__(self, reader: MappedHostReader, device: torch.device, mode: str) -> None:
        from pagekeeper_client.transports._torch import import_torch

        torch = import_torch()
        self.torch = torch
        self.device = device
        self.mode = mode
        layout = reader.layout
        depth = layout.geometry.depth
        stride = layout.slot_data_stride
        self.device_slots = [
            torch.empty(stride, dtype=torch.uint8, device=device) for _ in range(depth)
        ]
        self.events: list[Any] = [None] * depth
        if mode == "staging":
            pinned = [torch.empty(stride, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
            self.host_slots = pinned
            self.host_arrays = [slot_arrays(p.numpy(), layout, 0, 0) for p in pinned]
        elif mode == "register":
            self.host_slots = [reader.torch_slot_bytes(slot) for slot in range(depth)]
            self.host_arrays = []
        else:
            raise ValueError(f"pin must be 'staging' or 'register', got {mode!r}")


class MappedHostReader(SeqlockReader):
    """A ring whose data lies in host memory this process maps (shm, cpu_ipc)."""

    def __init__(
        self,
        descriptor: RingDescriptor,
        layout: RingLayout,
        control: RingControl,
        *,
        data_buffer: Any,
        data_offset: int,
        invalidate_on_close: bool,
        mappings: tuple[mmap.mmap, ...],
        pin: str = "staging",
    ) -> None:
        super().__init__(descriptor, layout, control, invalidate_on_close=invalidate_on_close)
        self._data_buffer = data_buffer
        self._data_offset = data_offset
        self._mappings = mappings
        self._slots_arrays = [
            slot_arrays(data_buffer, layout, slot, data_offset)
            for slot in range(layout.geometry.depth)
        ]
        self._pin = pin
        self._stagers: dict[str, _DeviceStager] = {}
        self._registered_ptr: int | None = None

    def wait(self, step_seq: int, timeout: float | None = None, *, copy: bool = True) -> StepTables:
        """Block until step ``step_seq`` is published; return its tables.

        ``copy=True`` copies the slot into fresh arrays the caller owns (then validated:
        never torn). ``copy=False`` returns read-only views into the ring (validated at
        return; they stay valid until ``depth`` more steps are published, which
        :meth:`is_current` checks).

        Raises :class:`StepTimeout`, :class:`ReaderFellBehind`, :class:`RingClosed`.
        """
        slot, seq = self._await_slot(step_seq, timeout)
        num_reqs, epoch, metas = self._read_meta(slot)
        arrays = self._slots_arrays[slot]
        tables = []
        for t, meta in enumerate(metas):
            spec = self._layout.tables[t]
            bt = arrays.block_tables[t][:num_reqs, : meta.num_cols]
            rl = arrays.row_lengths[t][:num_reqs]
            sm = arrays.slot_mappings[t][: meta.num_tokens]
            if copy:
                bt, rl, sm = bt.copy(), rl.copy(), sm.copy()
            tables.append(
                TableArrays(spec.group_id, spec.kernel_block_size, bt, rl, sm, meta.pad_id)
            )
        self._recheck(slot, seq, step_seq)
        return StepTables(step_seq, epoch, num_reqs, tuple(tables), is_copy=copy)

    def wait_tensors(
        self,
        step_seq: int,
        timeout: float | None = None,
        *,
        device: str | torch.device | None = None,
        copy: bool = True,
    ) -> TorchStepTables:
        """Step ``step_seq``'s tables as torch tensors: CPU tensors over :meth:`wait`'s
        arrays, or (``device="cuda:N"``) device tensors filled by one pinned async copy per
        array. Device tensors of a step are reused ``depth`` published steps later."""
        from pagekeeper_client.transports._torch import import_torch

        torch = import_torch()
        target = None if device is None else torch.device(device)
        if target is None or target.type == "cpu":
            return self.wait(step_seq, timeout, copy=copy).to_torch()
        if target.type != "cuda":
            raise ValueError(f"device must be cpu or cuda, got {target}")
        return self._wait_on_device(step_seq, timeout, target)

    # -- GPU worker path ------------------------------------------------------------------
    def torch_slot_bytes(self, slot: int) -> Any:
        """A CPU uint8 tensor over one slot's data bytes (registered mode)."""
        from pagekeeper_client.transports._torch import from_numpy

        start = self._layout.slot_offset(slot, self._data_offset)
        view = np.frombuffer(self._data_buffer, np.uint8, self._layout.slot_data_stride, start)
        return from_numpy(view)

    def _register(self) -> None:
        """Pin the ring's data pages with cudaHostRegister (once)."""
        if self._registered_ptr is not None:
            return
        from pagekeeper_client.transports._torch import import_torch

        torch = import_torch()
        data = np.frombuffer(
            self._data_buffer, np.uint8, self._layout.data_bytes, self._data_offset
        )
        if not data.flags.writeable:
            raise RingError(
                "pin='register' needs a writable mapping (cudaHostRegister of read-only pages "
                "needs cudaHostRegisterReadOnly); open the view with pin='register' from the "
                "start or use pin='staging'"
            )
        ptr = int(data.ctypes.data)
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, self._layout.data_bytes, 1))
        if err != 0:
            raise RingError(
                f"cudaHostRegister of the ring failed (cudaError {err}); use pin='staging'"
            )
        self._registered_ptr = ptr

    def _wait_on_device(
        self, step_seq: int, timeout: float | None, device: torch.device
    ) -> TorchStepTables:
        key = str(device)
        stager = self._stagers.get(key)
        if stager is None:
            if self._pin == "register":
                self._register()
            stager = _DeviceStager(self, device, self._pin)
            self._stagers[key] = stager
        torch = stager.torch
        slot, seq = self._await_slot(step_seq, timeout)
        num_reqs, epoch, metas = self._read_meta(slot)
        previous = stager.events[slot]
        if previous is not None:
            # The pinned staging buffer of this slot is reused: its last copy must be done.
            previous.synchronize()
        ranges = self._used_ranges(num_reqs, metas)
        if stager.mode == "staging":
            src = self._slots_arrays[slot]
            dst = stager.host_arrays[slot]
            for t, meta in enumerate(metas):
                np.copyto(dst.block_tables[t][:num_reqs], src.block_tables[t][:num_reqs])
                np.copyto(dst.row_lengths[t][:num_reqs], src.row_lengths[t][:num_reqs])
                np.copyto(
                    dst.slot_mappings[t][: meta.num_tokens], src.slot_mappings[t][: meta.num_tokens]
                )
            self._recheck(slot, seq, step_seq)
        host = stager.host_slots[slot]
        dev = stager.device_slots[slot]
        stream = torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            for start, stop in ranges:
                dev[start:stop].copy_(host[start:stop], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        stager.events[slot] = event
        if stager.mode == "register":
            # The DMA read the shared pages directly: only once it finished does an
            # unchanged seq prove it read step_seq's bytes.
            event.synchronize()
            self._recheck(slot, seq, step_seq)
        return self._device_views(dev, step_seq, epoch, num_reqs, metas)

    def _used_ranges(self, num_reqs: int, metas: tuple[TableMeta, ...]) -> list[tuple[int, int]]:
        """Byte ranges of a slot that hold this step's data (full-width block table rows)."""
        ranges = []
        for t, meta in enumerate(metas):
            spec = self._layout.tables[t]
            ranges.append(
                (
                    spec.block_table_offset,
                    spec.block_table_offset + 4 * num_reqs * spec.max_kernel_blocks,
                )
            )
            ranges.append((spec.row_lengths_offset, spec.row_lengths_offset + 4 * num_reqs))
            ranges.append(
                (spec.slot_mapping_offset, spec.slot_mapping_offset + 8 * meta.num_tokens)
            )
        return [(a, b) for a, b in ranges if b > a]

    def _device_views(
        self,
        slot_bytes: torch.Tensor,
        step_seq: int,
        epoch: int,
        num_reqs: int,
        metas: tuple[TableMeta, ...],
    ) -> TorchStepTables:
        return device_step_views(self._layout, slot_bytes, step_seq, epoch, num_reqs, metas)

    def close(self) -> None:
        """Unmap the ring. Zero-copy arrays still held keep their mapping alive until
        they are dropped (the mapping is released with the last of them)."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._registered_ptr is not None:
            from pagekeeper_client.transports._torch import import_torch

            import_torch().cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None
        self._stagers.clear()
        self._slots_arrays = []
        self._data_buffer = None
        del self._control
        for mapping in self._mappings:
            close_mapping(mapping)
        self._mappings = ()

    def __enter__(self) -> MappedHostReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def device_step_views(
    layout: RingLayout,
    slot_bytes: torch.Tensor,
    step_seq: int,
    epoch: int,
    num_reqs: int,
    metas: tuple[TableMeta, ...],
) -> TorchStepTables:
    """Typed tensor views of one slot's bytes (on any device)."""
    from pagekeeper_client.transports._torch import import_torch

    torch = import_torch()
    r = layout.geometry.max_num_reqs
    tables = []
    for t, meta in enumerate(metas):
        spec = layout.tables[t]
        k = spec.max_kernel_blocks
        bt = slot_bytes[spec.block_table_offset : spec.block_table_offset + 4 * r * k]
        rl = slot_bytes[spec.row_lengths_offset : spec.row_lengths_offset + 4 * r]
        sm = slot_bytes[
            spec.slot_mapping_offset : spec.slot_mapping_offset + 8 * layout.geometry.max_num_tokens
        ]
        tables.append(
            TorchTables(
                spec.group_id,
                spec.kernel_block_size,
                bt.view(torch.int32).view(r, k)[:num_reqs, : meta.num_cols],
                rl.view(torch.int32)[:num_reqs],
                sm.view(torch.int64)[: meta.num_tokens],
                meta.pad_id,
            )
        )
    return TorchStepTables(step_seq, epoch, num_reqs, tuple(tables))
