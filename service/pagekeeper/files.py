"""Files the service follows or listens on: a change stamp for files rotated under it
(TLS material, token files), and unix socket paths a process that died may have left."""

from __future__ import annotations

import os
import socket
import stat

FileStamp = tuple[int, int, int, int, int]
"""Device, inode, size, mtime and ctime in ns: a new file renamed into place, an edit, and
a chmod or chown (which can make an unreadable file readable) all change it."""


def file_stamp(path: str) -> FileStamp | None:
    """``path``'s :data:`FileStamp`, or None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def clear_stale_socket(path: str, label: str) -> bool:
    """Make ``path`` free for a unix socket: nothing there, or a socket nobody listens on
    (left by a process that died: removed). True when a live socket answers there (the
    caller refuses to take it over); OSError naming ``label`` when something other than a
    socket is there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{label} {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # nobody listens: left behind
        return False
    finally:
        probe.close()
    return True
