"""Cross-process wake-ups on a word of shared memory (Linux ``futex``), through ctypes.

A worker waiting for a step would otherwise poll with sleeps and notice the step up to a
sleep late (~1 ms at the backoff ceiling). With a futex it sleeps in the kernel on the slot's
seq word and the publisher wakes it right after turning that word even: no lost wake-up,
because ``FUTEX_WAIT`` re-checks the word atomically before sleeping. The key of a futex in a
shared file mapping is (inode, offset), so it works across processes for ``/dev/shm`` files
and memfds alike, and on a read-only mapping (waiting only reads the word).

Where the syscall is unavailable (not Linux, unknown architecture) :data:`AVAILABLE` is
False and readers fall back to sleeping with backoff.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYSCALL_NUMBERS = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> tuple[object | None, int]:
    number = _SYSCALL_NUMBERS.get(platform.machine().lower(), -1)
    if not sys.platform.startswith("linux") or number < 0:
        return None, -1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None, -1
    syscall.restype = ctypes.c_long
    return syscall, number


_syscall, _SYS_FUTEX = _load()
AVAILABLE = _syscall is not None


def futex_wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected`` (its low 32 bits), for
    at most ``timeout`` seconds. Returns on a wake-up, a changed word, a signal or the
    timeout alike: the caller re-checks its condition."""
    if _syscall is None:  # pragma: no cover - guarded by AVAILABLE
        raise OSError("futex is not available on this platform")
    timeout = max(timeout, 0.0)
    seconds = int(timeout)
    spec = _Timespec(seconds, int((timeout - seconds) * 1e9))
    # Every argument as a C long: syscall() is variadic and reads longs.
    _syscall(  # type: ignore[operator]
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_long(_FUTEX_WAIT),
        ctypes.c_long(expected & 0xFFFFFFFF),
        ctypes.c_void_p(ctypes.addressof(spec)),
        ctypes.c_void_p(0),
        ctypes.c_long(0),
    )


def futex_wake(address: int) -> None:
    """Wake every process sleeping in :func:`futex_wait` on ``address`` (no-op without
    futex support)."""
    if _syscall is None:
        return
    _syscall(  # type: ignore[operator]
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_long(_FUTEX_WAKE),
        ctypes.c_long(_WAKE_ALL),
        ctypes.c_void_p(0),
        ctypes.c_void_p(0),
        ctypes.c_long(0),
    )
