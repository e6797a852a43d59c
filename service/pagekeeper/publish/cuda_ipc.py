"""CUDA IPC publisher: the ring's data lives on a GPU and is exported to worker processes.

- Data: one ``torch.uint8`` tensor of ``depth * slot_data_stride`` bytes on ``cuda:N``,
  exported with ``UntypedStorage._share_cuda_()``: the CUDA IPC memory handle of the caching
  allocator's block (torch's versioned handle bytes), the storage's byte offset in that block,
  its size, and torch's IPC reference-counter file (the importer decrements it when it lets
  go). The same handle bytes are given to every importer; torch caches the mapping per
  handle in each importer.
- Control block: host shared memory (a ``/dev/shm`` file), the same seqlock words as the shm
  ring: the host must know which step a slot holds before a worker waits on its event.
- One interprocess ``torch.cuda.Event`` per slot, recorded on the publisher's copy stream
  after the slot's host-to-device copies and *before* the slot's seq turns even.

Per step: seq odd -> wait until the slot's pinned staging buffer is free (its previous copy
done) -> memcpy the tables into it -> async H2D copies of the used bytes on the copy stream ->
record the slot's event -> slot words -> seq even. The service thread never blocks on the
GPU except to reuse a staging buffer (``depth`` steps later).

Lifetime: the exporter outlives every importer (close it only at shutdown, after workers
are gone or told); closing marks the ring closed so importers fail clearly rather than read
freed memory. An importer never opens its own export.
"""

from __future__ import annotations

import os
from typing import Any

from pagekeeper.core.errors import FailedPrecondition, InvalidArgument
from pagekeeper.publish._ring import (
    CheckedTable,
    HostRingWriter,
    create_ring_file,
    write_host_slot,
)
from pagekeeper_client.ring import RingDescriptor, RingGeometry, normalize_gpu_uuid, slot_arrays


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is installed with the worker extra
        raise FailedPrecondition("the cuda_ipc publisher needs torch (pagekeeper[worker])") from exc
    return torch


class CudaIpcPublisher(HostRingWriter):
    """Publishes steps into a device ring exported over CUDA IPC."""

    kind = "cuda_ipc"

    def __init__(
        self,
        geometry: RingGeometry,
        *,
        device: str = "cuda:0",
        generation: int | None = None,
        shm_dir: str | None = None,
        mode: int = 0o600,
    ) -> None:
        torch = _import_torch()
        if not torch.cuda.is_available():
            raise FailedPrecondition("cuda_ipc: CUDA is not available in the service process")
        target = torch.device(device)
        if target.type != "cuda":
            raise InvalidArgument(f"cuda_ipc: device must be cuda:N, got {device!r}")
        index = target.index if target.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise InvalidArgument(f"cuda_ipc: no device {device!r} here")
        super().__init__(geometry, generation)
        layout = self._layout
        self._torch = torch
        self._device = torch.device("cuda", index)
        path, control = create_ring_file(
            shm_dir, self.kind, self._generation, layout.control_bytes, mode
        )
        self._resources.paths.append(path)
        self._resources.mappings.append(control)
        self._resources.control = control
        self._path = path
        with torch.cuda.device(index):
            self._stream = torch.cuda.Stream(device=self._device)
            self._ring = torch.zeros(layout.data_bytes, dtype=torch.uint8, device=self._device)
            torch.cuda.synchronize(self._device)  # zeros land before anyone imports
            (
                _,
                handle,
                size_bytes,
                offset_bytes,
                ref_counter_handle,
                ref_counter_offset,
                _,
                _,
            ) = self._ring.untyped_storage()._share_cuda_()
            # Interprocess events cannot time; blocking=False lets synchronize() spin.
            self._events = [
                torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                for _ in range(self._depth)
            ]
            for event in self._events:
                event.record(self._stream)  # creates it on this device
            self._event_handles = tuple(bytes(event.ipc_handle()) for event in self._events)
            self._staging = [
                torch.empty(layout.slot_data_stride, dtype=torch.uint8, pin_memory=True)
                for _ in range(self._depth)
            ]
        if int(size_bytes) != layout.data_bytes:
            raise FailedPrecondition(
                f"cuda_ipc: exported storage is {size_bytes} bytes, expected {layout.data_bytes}"
            )
        self._handle = bytes(handle)
        self._offset = int(offset_bytes)
        self._ref_counter_handle = bytes(ref_counter_handle)
        self._ref_counter_offset = int(ref_counter_offset)
        self._gpu_uuid = normalize_gpu_uuid(str(torch.cuda.get_device_properties(index).uuid))
        self._staging_arrays = [slot_arrays(s.numpy(), layout, 0, 0) for s in self._staging]
        self._attach_control(control)

    def _attach_control(self, control_buffer: Any) -> None:
        from pagekeeper_client.ring import RingControl

        control = RingControl(control_buffer, self._layout)
        control.initialise(generation=self._generation, data_offset=0, writer_pid=os.getpid())
        self._resources.seq_addresses = control.seq_addresses
        self._control = control

    @property
    def device(self) -> Any:
        return self._device

    def _write_data(self, slot: int, num_reqs: int, checked: list[CheckedTable]) -> None:
        torch = self._torch
        # The staging buffer's previous H2D copy (step - depth) must be done before reuse.
        self._events[slot].synchronize()
        write_host_slot(self._staging_arrays[slot], num_reqs, checked)
        staging = self._staging[slot]
        base = self._layout.slot_offset(slot)
        with torch.cuda.stream(self._stream):
            for start, stop in self._used_ranges(num_reqs, checked):
                self._ring[base + start : base + stop].copy_(staging[start:stop], non_blocking=True)

    def _used_ranges(self, num_reqs: int, checked: list[CheckedTable]) -> list[tuple[int, int]]:
        ranges = []
        for c in checked:
            spec = self._layout.tables[c.index]
            ranges.append(
                (
                    spec.block_table_offset,
                    spec.block_table_offset + 4 * num_reqs * spec.max_kernel_blocks,
                )
            )
            ranges.append((spec.row_lengths_offset, spec.row_lengths_offset + 4 * num_reqs))
            ranges.append((spec.slot_mapping_offset, spec.slot_mapping_offset + 8 * c.num_tokens))
        return [(a, b) for a, b in ranges if b > a]

    def _after_data(self, slot: int) -> None:
        self._events[slot].record(self._stream)

    def descriptor(self) -> RingDescriptor:
        return RingDescriptor(
            kind=self.kind,
            generation=self._generation,
            geometry=self._geometry,
            size_bytes=self._layout.data_bytes,
            path=self._path,
            device=str(self._device),
            gpu_uuid=self._gpu_uuid,
            ipc_handle=self._handle,
            event_handles=self._event_handles,
            offset=self._offset,
            exporter_pid=os.getpid(),
            ref_counter_handle=self._ref_counter_handle,
            ref_counter_offset=self._ref_counter_offset,
        )

    def device_slot(self, slot: int) -> Any:
        """The device bytes of one slot (for tests that check the exporter's side)."""
        base = self._layout.slot_offset(slot)
        return self._ring[base : base + self._layout.slot_data_stride]

    def close(self) -> None:
        """Mark the ring closed, let pending copies finish, drop the device ring."""
        if self._is_closed:
            return
        self._stream.synchronize()
        super().close()
        self._staging_arrays = []
        self._staging = []
        self._events = []
        self._ring = None
