"""Worker-side readers of published tables, one per transport, behind one interface.

``open_table_view(descriptor)`` returns the reader for the descriptor's kind; every reader
answers ``wait(step_seq, timeout)`` with that step's tables as numpy arrays and
``wait_tensors(step_seq, timeout, device=...)`` with torch tensors (on a GPU: pinned async
copy for host rings, in-place device views for ``cuda_ipc``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pagekeeper_client.ring import (
    DescriptorError,
    ReaderStats,
    RingDescriptor,
    StepTables,
    TorchStepTables,
)
from pagekeeper_client.transports.stream import StreamTableView, pack_slot, unpack_slot

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class TableView(Protocol):
    """What a worker holds to read published steps."""

    stats: ReaderStats

    @property
    def descriptor(self) -> RingDescriptor: ...

    def wait(
        self, step_seq: int, timeout: float | None = None, *, copy: bool = True
    ) -> StepTables: ...

    def wait_tensors(
        self,
        step_seq: int,
        timeout: float | None = None,
        *,
        device: str | torch.device | None = None,
        copy: bool = True,
    ) -> TorchStepTables: ...

    def latest_step(self) -> int: ...

    def is_current(self, step_seq: int) -> bool: ...

    def close(self) -> None: ...


def open_table_view(descriptor: RingDescriptor, *, pin: str = "staging") -> TableView:
    """Open the reader for ``descriptor.kind`` ("shm", "cpu_ipc", "cuda_ipc", "stream").

    ``pin`` applies to shm rings read onto a GPU ("staging" or "register"). A "stream" view
    is fed by the caller's ``WatchTables`` consumer (:meth:`StreamTableView.feed`).
    Raises :class:`DescriptorError` for an invalid or unreachable descriptor.
    """
    kind = getattr(descriptor, "kind", None)
    if kind == "shm":
        from pagekeeper_client.transports.shm import ShmTableView

        return ShmTableView(descriptor, pin=pin)
    if kind == "cpu_ipc":
        from pagekeeper_client.transports.cpu_ipc import CpuIpcTableView

        return CpuIpcTableView(descriptor)
    if kind == "cuda_ipc":
        from pagekeeper_client.transports.cuda_ipc import CudaIpcTableView

        return CudaIpcTableView(descriptor)
    if kind == "stream":
        return StreamTableView(descriptor)
    raise DescriptorError(f"kind: unknown transport {kind!r}")


__all__ = [
    "StreamTableView",
    "TableView",
    "open_table_view",
    "pack_slot",
    "unpack_slot",
]
