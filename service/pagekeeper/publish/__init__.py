"""Table publication: the service writes each step's kernel block tables where workers read
them. One interface (:class:`TablePublisher`), four transports:

=========  ==================================================================
shm        ring file under /dev/shm, mapped by workers on this host (default)
cuda_ipc   ring in GPU memory exported over CUDA IPC, plus per-slot IPC events
cpu_ipc    memfd-backed CPU stand-in of cuda_ipc (same descriptor and lifetime rules)
stream     packed bytes for the WatchTables gRPC stream (workers on other hosts)
=========  ==================================================================
"""

from __future__ import annotations

from typing import Any

from pagekeeper.core.errors import InvalidArgument
from pagekeeper.publish.api import RingDescriptor, RingGeometry, TablePublisher

PUBLISHER_KINDS = ("shm", "cuda_ipc", "cpu_ipc", "stream")


def create_publisher(kind: str, geometry: RingGeometry, **options: Any) -> TablePublisher:
    """Build the publisher of one transport.

    ``options`` go to the transport: ``generation`` (all), ``shm_dir`` and ``mode``
    (shm, cpu_ipc, cuda_ipc), ``device`` (cuda_ipc, e.g. "cuda:0").
    Raises ``InvalidArgument`` for an unknown kind or a bad geometry,
    ``FailedPrecondition`` for cuda_ipc without CUDA.
    """
    if kind == "shm":
        from pagekeeper.publish.shm import ShmPublisher

        return ShmPublisher(geometry, **options)
    if kind == "cpu_ipc":
        from pagekeeper.publish.cpu_ipc import CpuIpcPublisher

        return CpuIpcPublisher(geometry, **options)
    if kind == "cuda_ipc":
        from pagekeeper.publish.cuda_ipc import CudaIpcPublisher

        return CudaIpcPublisher(geometry, **options)
    if kind == "stream":
        from pagekeeper.publish.stream import StreamPublisher

        return StreamPublisher(geometry, **options)
    raise InvalidArgument(f"unknown publisher kind {kind!r}; one of {list(PUBLISHER_KINDS)}")


__all__ = [
    "PUBLISHER_KINDS",
    "RingDescriptor",
    "RingGeometry",
    "TablePublisher",
    "create_publisher",
]
