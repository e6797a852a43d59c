"""Snapshot bytes and the state digest.

A snapshot body is ``b"PKSNAP" | format (u16 LE) | value`` where the value is
:meth:`pagekeeper.state.ServiceState.snapshot_state`'s tree encoded with
:mod:`pagekeeper.durability.values`. It is stored with a CRC (see
:mod:`pagekeeper.durability.log`); one that fails its CRC, its header or its decoding is
*unreadable*, and start-up fails on it loudly rather than guess: the log records it covers
are gone, so no older state could be trusted to be complete.

:func:`state_digest` hashes what must be identical between a state recovered from disk and
a twin that never crashed: pages (ref counts, cache flags, the free queue's order and
layout), the prefix-cache index with its duplicates, every request's tables, tokens, hashes
and counters, clients (leases, generations, ownership, stored step answers), the event
buffer and sequence numbers. It leaves out the service counters (a retry counts there but
is logged as the heartbeat it amounts to).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

from pagekeeper.durability.values import ValueDecodeError, decode, encode
from pagekeeper.state import ServiceState

MAGIC = b"PKSNAP"
FORMAT = 1
_HEADER = struct.Struct("<6sH")


class SnapshotError(RuntimeError):
    """A snapshot that cannot be read (start-up must fail on it)."""


def encode_snapshot(tree: dict[str, Any], pause: Callable[[], None] | None = None) -> bytes:
    """The body of a snapshot of ``tree`` (``pause``: see
    :func:`pagekeeper.durability.values.encode`)."""
    return _HEADER.pack(MAGIC, FORMAT) + encode(tree, pause)


def decode_snapshot(body: bytes) -> dict[str, Any]:
    if len(body) < _HEADER.size:
        raise SnapshotError("snapshot shorter than its header")
    magic, version = _HEADER.unpack_from(body)
    if magic != MAGIC:
        raise SnapshotError("not a pagekeeper snapshot (bad magic)")
    if version != FORMAT:
        raise SnapshotError(f"snapshot format {version} is not the supported {FORMAT}")
    try:
        tree = decode(memoryview(body)[_HEADER.size :])
    except ValueDecodeError as exc:
        raise SnapshotError(f"snapshot does not decode: {exc}") from None
    if not isinstance(tree, dict):
        raise SnapshotError("snapshot does not hold a state tree")
    return tree


def digest_tree(tree: dict[str, Any]) -> str:
    """SHA-256 (hex) of a state tree without its service counters."""
    payload = {k: v for k, v in tree.items() if k != "counters"}
    return hashlib.sha256(encode(payload)).hexdigest()


def state_digest(state: ServiceState) -> str:
    """SHA-256 (hex) of everything that must survive a restart, page for page."""
    return digest_tree(state.snapshot_state())


__all__ = [
    "SnapshotError",
    "decode_snapshot",
    "digest_tree",
    "encode_snapshot",
    "state_digest",
]
