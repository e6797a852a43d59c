"""CUDA IPC transport, worker side: map the service's device ring once, read tables in place.

The service allocates the ring's data on a GPU with torch and exports it with
``UntypedStorage._share_cuda_()`` (a CUDA IPC memory handle of the caching allocator's block,
the storage's offset in it and its size, plus torch's IPC reference counter), and one
interprocess ``torch.cuda.Event`` per slot. Its control block (the seqlock words) stays in
host shared memory, because the host must know which step a slot holds before it can wait
on that slot's event.

A worker, per step:

1. waits on the host control block until the slot holds the step (the writer recorded the
   slot's event *before* marking the slot stable, so the event now covers the step's copy);
2. makes its current stream wait on the slot's event (``cudaStreamWaitEvent``: no host
   block) and re-checks the seq: if the writer began overwriting the slot meanwhile (``depth``
   steps later), the event may already cover that step, so the reader fell behind;
3. gets int32/int64 views of the slot in device memory, for kernels to read in place.

The writer does not wait for readers: a kernel still reading step ``S`` when the step
``depth`` published steps later is written races with it. ``is_current(S)`` after the kernel
(and a stream sync) proves it did not happen. Lifetime: the exporter outlives every
importer; an importer never opens its own export (CUDA would fail; we fail first, clearly).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagekeeper_client.ring import (
    STATE_CLOSED,
    DescriptorError,
    RingClosed,
    RingControl,
    RingDescriptor,
    StepTables,
    TableArrays,
    TorchStepTables,
    TorchTables,
    normalize_gpu_uuid,
    validate_descriptor,
)
from pagekeeper_client.transports._mapped import (
    SeqlockReader,
    close_mapping,
    device_step_views,
    map_file,
)
from pagekeeper_client.transports._torch import import_torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

CUDA_IPC_EVENT_HANDLE_SIZE = 64
"""``sizeof(cudaIpcEventHandle_t)``."""

CUDA_IPC_MEM_HANDLE_SIZE = 64
"""``sizeof(cudaIpcMemHandle_t)``."""

_TORCH_CUDA_MALLOC = ord("c")
"""The type byte of torch's handle of a cudaMalloc block: ``[format version, 'c']`` and
then exactly one cudaIpcMemHandle_t (66 bytes; format version 2 in torch 2.11, seen on an
H200). An expandable segment's handle (type 'e') has another layout."""


def check_memory_handle(handle: bytes) -> None:
    """Refuse a memory handle torch would misread. torch copies the cudaIpcMemHandle_t out of
    the bytes without checking their length (a truncated handle opened on an H200), so the
    importer checks the form it knows: a cudaMalloc block's handle is the two-byte header and
    one whole cudaIpcMemHandle_t. Other types are left to torch."""
    if len(handle) < 3:
        raise DescriptorError(f"ipc_handle: {len(handle)} bytes is not a torch CUDA IPC handle")
    want = 2 + CUDA_IPC_MEM_HANDLE_SIZE
    if handle[1] == _TORCH_CUDA_MALLOC and len(handle) != want:
        raise DescriptorError(
            f"ipc_handle: torch's handle of a cudaMalloc block is {want} bytes, got {len(handle)}"
        )


def local_device_index(gpu_uuid: str) -> int:
    """This process's index of the GPU with that UUID (indices differ between processes
    with different ``CUDA_VISIBLE_DEVICES``; UUIDs do not)."""
    torch = import_torch()
    wanted = normalize_gpu_uuid(gpu_uuid)
    for index in range(torch.cuda.device_count()):
        if normalize_gpu_uuid(str(torch.cuda.get_device_properties(index).uuid)) == wanted:
            return index
    raise DescriptorError(
        f"gpu_uuid: GPU {gpu_uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)"
    )


class CudaIpcTableView(SeqlockReader):
    """An importer of a cuda_ipc ring: device views of each step's tables."""

    _device: torch.device

    def __init__(self, descriptor: RingDescriptor) -> None:
        torch = import_torch()
        layout = validate_descriptor(descriptor)  # refuses our own export
        if descriptor.kind != "cuda_ipc":
            raise DescriptorError(
                f"CudaIpcTableView reads 'cuda_ipc' rings, not {descriptor.kind!r}"
            )
        if not torch.cuda.is_available():
            raise DescriptorError("cuda_ipc: CUDA is not available in this process")
        check_memory_handle(bytes(descriptor.ipc_handle))
        for slot, event in enumerate(descriptor.event_handles):
            if len(event) != CUDA_IPC_EVENT_HANDLE_SIZE:
                raise DescriptorError(
                    f"event_handles[{slot}]: a CUDA IPC event handle is "
                    f"{CUDA_IPC_EVENT_HANDLE_SIZE} bytes, got {len(event)}"
                )
        if not descriptor.ref_counter_handle:
            raise DescriptorError("ref_counter_handle: a cuda_ipc ring carries torch's counter")
        index = local_device_index(descriptor.gpu_uuid)
        self._device = torch.device("cuda", index)
        control_map = map_file(
            descriptor.path, layout.control_bytes, writable=False, what="control block"
        )
        try:
            control = RingControl(control_map, layout)
            control.check(descriptor, data_offset=0)
            if control.state == STATE_CLOSED:
                raise RingClosed(
                    f"cuda_ipc ring generation {descriptor.generation} was closed by its exporter"
                )
            with torch.cuda.device(index):
                # event_sync_required=False: ordering comes from the per-slot events below.
                storage = torch.UntypedStorage._new_shared_cuda(
                    index,
                    bytes(descriptor.ipc_handle),
                    descriptor.size_bytes,
                    descriptor.offset,
                    bytes(descriptor.ref_counter_handle),
                    descriptor.ref_counter_offset,
                    bytes(CUDA_IPC_EVENT_HANDLE_SIZE),
                    False,
                )
                if storage.nbytes() != descriptor.size_bytes:
                    raise DescriptorError(
                        f"cuda_ipc: the imported storage is {storage.nbytes()} bytes, the "
                        f"descriptor says {descriptor.size_bytes}"
                    )
                ring = torch.empty(0, dtype=torch.uint8, device=self._device).set_(storage)
                events = [
                    torch.cuda.Event.from_ipc_handle(index, bytes(handle))
                    for handle in descriptor.event_handles
                ]
        except BaseException:
            close_mapping(control_map)
            raise
        super().__init__(descriptor, layout, control, invalidate_on_close=True)
        self._control_map = control_map
        self._ring: Any = ring
        self._events: list[Any] = events

    @property
    def device(self) -> torch.device:
        return self._device

    def _slot_bytes(self, slot: int) -> Any:
        start = self._layout.slot_offset(slot)
        return self._ring[start : start + self._layout.slot_data_stride]

    def _views(self, step_seq: int, timeout: float | None) -> tuple[int, int, TorchStepTables]:
        torch = import_torch()
        slot, seq = self._await_slot(step_seq, timeout)
        num_reqs, epoch, metas = self._read_meta(slot)
        stream = torch.cuda.current_stream(self._device)
        stream.wait_event(self._events[slot])
        self._recheck(slot, seq, step_seq)
        views = device_step_views(
            self._layout, self._slot_bytes(slot), step_seq, epoch, num_reqs, metas
        )
        return slot, seq, views

    def wait_tensors(
        self,
        step_seq: int,
        timeout: float | None = None,
        *,
        device: str | torch.device | None = None,
        copy: bool = False,
    ) -> TorchStepTables:
        """Step ``step_seq``'s tables as views of the ring on the GPU, ordered after the
        service's copy on the current stream (no host block).

        ``copy=True`` returns clones (ordered on the current stream) instead of views.
        """
        torch = import_torch()
        if device is not None and torch.device(device) != self._device:
            raise ValueError(f"this ring lives on {self._device}, not {device}")
        _, _, views = self._views(step_seq, timeout)
        if not copy:
            return views
        tables = tuple(
            TorchTables(
                t.group_id,
                t.kernel_block_size,
                t.block_table.clone(),
                t.row_lengths.clone(),
                t.slot_mapping.clone(),
                t.pad_id,
            )
            for t in views.tables
        )
        return TorchStepTables(views.step_seq, views.epoch, views.num_reqs, tables)

    def wait(self, step_seq: int, timeout: float | None = None, *, copy: bool = True) -> StepTables:
        """Host copies of step ``step_seq``'s tables (for tests and debugging; kernels use
        :meth:`wait_tensors`). Synchronizes the current stream, then re-validates the seq:
        the copies are exactly step ``step_seq``'s bytes or this raises."""
        torch = import_torch()
        slot, seq, views = self._views(step_seq, timeout)
        host = [
            (t.block_table.cpu(), t.row_lengths.cpu(), t.slot_mapping.cpu()) for t in views.tables
        ]
        torch.cuda.current_stream(self._device).synchronize()
        self._recheck(slot, seq, step_seq, count=False)
        tables = tuple(
            TableArrays(
                t.group_id, t.kernel_block_size, bt.numpy(), rl.numpy(), sm.numpy(), t.pad_id
            )
            for t, (bt, rl, sm) in zip(views.tables, host, strict=True)
        )
        return StepTables(views.step_seq, views.epoch, views.num_reqs, tables, is_copy=True)

    def close(self) -> None:
        """Drop the import (the exporter's memory is released when its last importer and
        the exporter let go)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._ring = None
        self._events = []
        del self._control
        close_mapping(self._control_map)

    def __enter__(self) -> CudaIpcTableView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
