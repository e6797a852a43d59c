"""``cpu_ipc`` publisher: the CPU stand-in of the CUDA IPC exporter (see
``pagekeeper_client.transports.cpu_ipc`` for the rules it mirrors).

The "device allocation" is a memfd this process keeps open; its handle names it by pid, fd
number, device and inode, and importers open it through ``/proc/<pid>/fd/<fd>``. The
control block is a shared-memory file, as for CUDA. Closing marks the ring closed (every
import becomes invalid, as freed device memory would), closes the memfd and unlinks the
control block.
"""

from __future__ import annotations

import mmap
import os

from pagekeeper.publish._ring import HostRingWriter, create_ring_file
from pagekeeper_client.ring import RingDescriptor, RingGeometry
from pagekeeper_client.transports.cpu_ipc import MemfdHandle, pack_event_handle


class CpuIpcPublisher(HostRingWriter):
    """Exports a ring over "IPC" handles backed by a memfd, with CUDA IPC's lifetime rules."""

    kind = "cpu_ipc"

    def __init__(
        self,
        geometry: RingGeometry,
        *,
        generation: int | None = None,
        shm_dir: str | None = None,
        mode: int = 0o600,
    ) -> None:
        super().__init__(geometry, generation)
        layout = self._layout
        path, control = create_ring_file(
            shm_dir, self.kind, self._generation, layout.control_bytes, mode
        )
        self._resources.paths.append(path)
        self._resources.mappings.append(control)
        self._resources.control = control
        fd = os.memfd_create(f"pagekeeper-ring-{self._generation:x}", os.MFD_CLOEXEC)
        self._resources.fds.append(fd)
        os.ftruncate(fd, layout.data_bytes)
        data = mmap.mmap(fd, layout.data_bytes, access=mmap.ACCESS_WRITE)
        self._resources.mappings.append(data)
        info = os.fstat(fd)
        self._handle = MemfdHandle(
            os.getpid(), fd, info.st_dev, info.st_ino, layout.data_bytes, self._generation
        )
        self._path = path
        self._attach(control, data, 0)

    def descriptor(self) -> RingDescriptor:
        pid = self._handle.pid
        return RingDescriptor(
            kind=self.kind,
            generation=self._generation,
            geometry=self._geometry,
            size_bytes=self._layout.data_bytes,
            path=self._path,
            device="cpu",
            ipc_handle=self._handle.pack(),
            event_handles=tuple(
                pack_event_handle(pid, slot, self._generation) for slot in range(self._depth)
            ),
            offset=0,
            exporter_pid=pid,
        )
