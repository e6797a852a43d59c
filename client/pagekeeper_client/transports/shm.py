"""Shared-memory transport, worker side: map the service's ring file and read steps.

The service creates the ring as a file under ``/dev/shm`` (raw ``mmap``, not
``multiprocessing.shared_memory``, whose resource tracker unlinks segments when an unrelated
attaching process exits) and unlinks it when it closes; a view opened before that keeps its
mapping and can still read the steps already published.
"""

from __future__ import annotations

from pagekeeper_client.ring import DescriptorError, RingControl, RingDescriptor, validate_descriptor
from pagekeeper_client.transports._mapped import MappedHostReader, close_mapping, map_file


class ShmTableView(MappedHostReader):
    """A worker's view of a shared-memory ring.

    ``pin`` chooses how :meth:`wait_tensors` reaches a CUDA device: ``"staging"`` (default:
    memcpy into a pinned buffer, then an async copy) or ``"register"`` (``cudaHostRegister``
    the mapping once and copy from it directly; maps the file writable, since pinning
    read-only pages needs a flag not every GPU supports).
    """

    def __init__(self, descriptor: RingDescriptor, *, pin: str = "staging") -> None:
        layout = validate_descriptor(descriptor)
        if descriptor.kind != "shm":
            raise DescriptorError(f"ShmTableView reads 'shm' rings, not {descriptor.kind!r}")
        if pin not in ("staging", "register"):
            raise ValueError(f"pin must be 'staging' or 'register', got {pin!r}")
        mapping = map_file(
            descriptor.path, descriptor.size_bytes, writable=pin == "register", what="ring file"
        )
        try:
            control = RingControl(mapping, layout)
            control.check(descriptor, data_offset=layout.control_bytes)
        except BaseException:
            close_mapping(mapping)
            raise
        super().__init__(
            descriptor,
            layout,
            control,
            data_buffer=mapping,
            data_offset=layout.control_bytes,
            invalidate_on_close=False,
            mappings=(mapping,),
            pin=pin,
        )
