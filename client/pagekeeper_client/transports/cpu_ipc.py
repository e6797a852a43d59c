"""``cpu_ipc``: the CPU stand-in of the CUDA IPC transport, so its protocol runs in CI.

It has the CUDA transport's shape and rules, with host memory in place of device memory:

- the exporter keeps the control block in a shared-memory file and the data in a memfd (the
  "device allocation"); the memory handle names that memfd by exporter pid, fd number,
  device and inode, and an importer opens it through ``/proc/<pid>/fd/<fd>`` (same host,
  same user or root, a shared PID namespace);
- one "event" handle per slot, emulated by the slot's seqlock;
- an importer never opens its own export (CUDA cannot, so neither can this);
- the exporter outlives every importer: when it closes, every import is invalid, even one
  still mapped, exactly as freed device memory would be.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass

from pagekeeper_client.ring import (
    STATE_CLOSED,
    DescriptorError,
    RingClosed,
    RingControl,
    RingDescriptor,
    validate_descriptor,
)
from pagekeeper_client.transports._mapped import MappedHostReader, close_mapping, map_file

_HANDLE = struct.Struct("<8sIIQQQQ")
_HANDLE_MAGIC = b"PKMEMFD\x01"
_EVENT = struct.Struct("<8sIIQ")
_EVENT_MAGIC = b"PKCPUEV\x01"


@dataclass(frozen=True, slots=True)
class MemfdHandle:
    """What a cpu_ipc memory handle says: which memfd of which process, and its size."""

    pid: int
    fd: int
    st_dev: int
    st_ino: int
    size: int
    generation: int

    def pack(self) -> bytes:
        return _HANDLE.pack(
            _HANDLE_MAGIC, self.pid, self.fd, self.st_dev, self.st_ino, self.size, self.generation
        )

    @classmethod
    def unpack(cls, data: bytes) -> MemfdHandle:
        if len(data) != _HANDLE.size:
            raise DescriptorError(
                f"ipc_handle: a cpu_ipc handle is {_HANDLE.size} bytes, got {len(data)}"
            )
        magic, pid, fd, st_dev, st_ino, size, generation = _HANDLE.unpack(data)
        if magic != _HANDLE_MAGIC:
            raise DescriptorError("ipc_handle: not a cpu_ipc memory handle (bad magic)")
        return cls(pid, fd, st_dev, st_ino, size, generation)

    @property
    def proc_path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


def pack_event_handle(pid: int, slot: int, generation: int) -> bytes:
    """The token standing in for slot ``slot``'s interprocess CUDA event."""
    return _EVENT.pack(_EVENT_MAGIC, pid, slot, generation)


def check_event_handle(data: bytes, *, pid: int, slot: int, generation: int) -> None:
    if len(data) != _EVENT.size:
        raise DescriptorError(
            f"event_handles[{slot}]: expected {_EVENT.size} bytes, got {len(data)}"
        )
    magic, found_pid, found_slot, found_generation = _EVENT.unpack(data)
    if magic != _EVENT_MAGIC:
        raise DescriptorError(f"event_handles[{slot}]: not a cpu_ipc event handle")
    if (found_pid, found_slot, found_generation) != (pid, slot, generation):
        raise DescriptorError(
            f"event_handles[{slot}]: names pid {found_pid} slot {found_slot} generation "
            f"{found_generation}, expected pid {pid} slot {slot} generation {generation}"
        )


def open_memfd(handle: MemfdHandle, offset: int, size: int) -> mmap.mmap:
    """Map the exporter's memfd read-only through /proc, checking it is the exported one."""
    try:
        fd = os.open(handle.proc_path, os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        raise DescriptorError(
            f"cpu_ipc: cannot reach {handle.proc_path}: the exporter (pid {handle.pid}) exited "
            "or closed the ring (the exporter must outlive every importer)"
        ) from None
    except PermissionError as exc:
        raise DescriptorError(
            f"cpu_ipc: {handle.proc_path}: permission denied ({exc}); the importer needs the "
            "exporter's user (or root) and its PID namespace"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (
            handle.st_dev,
            handle.st_ino,
        ):
            raise DescriptorError(
                f"cpu_ipc: {handle.proc_path} is no longer the exported memfd (fd reused after "
                "the exporter closed the ring)"
            )
        if info.st_size < offset + size:
            raise DescriptorError(
                f"cpu_ipc: the memfd holds {info.st_size} bytes, the descriptor needs "
                f"{offset + size}"
            )
        if offset % mmap.ALLOCATIONGRANULARITY:
            raise DescriptorError(f"offset {offset} is not page aligned")
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ, offset=offset)
    finally:
        os.close(fd)


class CpuIpcTableView(MappedHostReader):
    """An importer of a cpu_ipc ring (see the module docstring for the rules)."""

    def __init__(self, descriptor: RingDescriptor) -> None:
        layout = validate_descriptor(descriptor)  # refuses our own export
        if descriptor.kind != "cpu_ipc":
            raise DescriptorError(f"CpuIpcTableView reads 'cpu_ipc' rings, not {descriptor.kind!r}")
        handle = MemfdHandle.unpack(descriptor.ipc_handle)
        if handle.pid != descriptor.exporter_pid:
            raise DescriptorError(
                f"ipc_handle: exported by pid {handle.pid}, descriptor says "
                f"{descriptor.exporter_pid}"
            )
        if handle.generation != descriptor.generation:
            raise DescriptorError(
                f"ipc_handle: generation {handle.generation}, descriptor says "
                f"{descriptor.generation}"
            )
        if handle.size != descriptor.size_bytes:
            raise DescriptorError(
                f"ipc_handle: exports {handle.size} bytes, descriptor says {descriptor.size_bytes}"
            )
        for slot, event in enumerate(descriptor.event_handles):
            check_event_handle(event, pid=handle.pid, slot=slot, generation=descriptor.generation)
        control_map = map_file(
            descriptor.path, layout.control_bytes, writable=False, what="control block"
        )
        mappings = [control_map]
        try:
            control = RingControl(control_map, layout)
            control.check(descriptor, data_offset=0)
            if control.state == STATE_CLOSED:
                raise RingClosed(
                    f"cpu_ipc ring generation {descriptor.generation} was closed by its exporter"
                )
            data_map = open_memfd(handle, descriptor.offset, descriptor.size_bytes)
            mappings.append(data_map)
        except BaseException:
            for mapping in mappings:
                close_mapping(mapping)
            raise
        super().__init__(
            descriptor,
            layout,
            control,
            data_buffer=data_map,
            data_offset=0,
            invalidate_on_close=True,
            mappings=tuple(mappings),
        )
