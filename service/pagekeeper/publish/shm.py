"""Shared-memory publisher: the ring is one file under ``/dev/shm``, mapped with ``mmap``.

Not ``multiprocessing.shared_memory``: its resource tracker unlinks a segment when any
attaching process exits, which would pull the ring from under the service. The service
creates the file (mode 0600 by default: workers run as the service's user) and unlinks it on
close; workers that mapped it before keep their mapping and can still read the steps that
were published (waiting for a later one raises ``RingClosed``).
"""

from __future__ import annotations

from pagekeeper.publish._ring import HostRingWriter, create_ring_file
from pagekeeper_client.ring import RingDescriptor, RingGeometry


class ShmPublisher(HostRingWriter):
    """Publishes steps into a shared-memory ring (control block and data in one mapping)."""

    kind = "shm"

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
        path, mapping = create_ring_file(
            shm_dir, self.kind, self._generation, layout.embedded_bytes, mode
        )
        self._resources.paths.append(path)
        self._resources.mappings.append(mapping)
        self._resources.control = mapping
        self._path = path
        self._attach(mapping, mapping, layout.control_bytes)

    @property
    def path(self) -> str:
        return self._path

    def descriptor(self) -> RingDescriptor:
        return RingDescriptor(
            kind=self.kind,
            generation=self._generation,
            geometry=self._geometry,
            size_bytes=self._layout.embedded_bytes,
            path=self._path,
        )
