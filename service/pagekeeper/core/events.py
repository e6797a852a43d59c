"""KV-cache events, with the fields vLLM's KV events carry (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), plus the KV-cache group.

The core appends events as pages enter and leave the prefix-cache index and hands them
out with one call, :meth:`PageManager.take_events`. Each event has a sequence number,
assigned by the core in order (deterministic: a replay yields the same numbers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PageStored:
    """Full pages entered the prefix-cache index (one event per caching act)."""

    seq: int
    group_id: int
    page_hashes: tuple[bytes, ...]
    parent_page_hash: bytes | None
    token_ids: tuple[int, ...]
    page_size: int
    page_ids: tuple[int, ...]
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class PageRemoved:
    """Cached pages left the index (evicted on reuse, or dropped)."""

    seq: int
    group_id: int
    page_hashes: tuple[bytes, ...]
    page_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The whole prefix cache was reset."""

    seq: int


KVEvent = PageStored | PageRemoved | AllCleared
