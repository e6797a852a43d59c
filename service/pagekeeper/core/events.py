"""KV-cache events, with the fields vLLM's KV events carry (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), plus the KV-cache group.

The core appends events as pages enter and leave the prefix-cache index and hands them
out with one call, :meth:`PageManager.take_events`. Each event has a sequence number,
assigned by the core in order (deterministic: a replay yields the same numbers).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import overload

from pagekeeper.core.types import ExtraKeys


class TokenRun(Sequence[int]):
    """The token ids of a ``stored`` event: an immutable sequence of ints kept packed, 8
    bytes a token, instead of a tuple of int objects.

    An admission stores ~1,000 tokens at once; boxing each into an int for a tuple cost more
    than the rest of caching the pages. A run compares equal to any tuple, list or run of
    the same ints and hashes like the equal tuple, so it stands wherever a tuple did.
    """

    __slots__ = ("_ids",)

    def __init__(self, token_ids: Iterable[int] = ()) -> None:
        self._ids = array("Q", token_ids)

    @classmethod
    def adopt(cls, token_ids: array[int]) -> TokenRun:
        """Wrap an ``array('Q')`` the caller hands over (a fresh slice: never mutated
        after), without copying it."""
        run = cls.__new__(cls)
        run._ids = token_ids
        return run

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenRun: ...
    def __getitem__(self, index: int | slice) -> int | TokenRun:
        if isinstance(index, slice):
            return TokenRun.adopt(self._ids[index])
        return self._ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenRun):
            return self._ids == other._ids
        if isinstance(other, tuple):
            return len(other) == len(self._ids) and tuple(self._ids) == other
        if isinstance(other, list):
            return len(other) == len(self._ids) and self._ids.tolist() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._ids))

    def __repr__(self) -> str:
        return f"TokenRun({self._ids.tolist()!r})"

    def __reduce__(self) -> tuple[type[TokenRun], tuple[list[int]]]:
        return TokenRun, (self._ids.tolist(),)

    def tobytes(self) -> bytes:
        """The ids as unsigned 64-bit ints in the machine's byte order (``array('Q')``)."""
        return self._ids.tobytes()

    def tolist(self) -> list[int]:
        return self._ids.tolist()


@dataclass(frozen=True, slots=True)
class PageStored:
    """Full pages entered the prefix-cache index (one event per caching act)."""

    seq: int
    group_id: int
    page_hashes: tuple[bytes, ...]
    parent_page_hash: bytes | None
    token_ids: Sequence[int]
    """The pages' tokens in order: a :class:`TokenRun` from the core (equal to the tuple)."""
    page_size: int
    page_ids: tuple[int, ...]
    lora_name: str | None = None
    extra_keys: ExtraKeys | None = None
    """The request's extra keys when it has any (the same object for all its events): page
    ``first_page + i`` of the run hashed :func:`pagekeeper.core.hashing.page_extra_keys`
    of them. None for a request without extra keys."""
    first_page: int = 0
    """Index of the run's first page in its request's table (of this group's page size)."""


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


# The core makes an event per caching act and per eviction run, up to dozens a step. A
# frozen dataclass's __init__ sets each field through object.__setattr__; filling the slots
# through their descriptors builds the same object in less than half the time (0.48 against
# 1.22 us for a PageStored). tests/core/test_events.py checks both builders against the
# constructors, field by field (a new field must be added here too).
_new = object.__new__
_STORED_SLOTS = [getattr(PageStored, f.name).__set__ for f in fields(PageStored)]
_REMOVED_SLOTS = [getattr(PageRemoved, f.name).__set__ for f in fields(PageRemoved)]
(
    _set_seq,
    _set_group,
    _set_hashes,
    _set_parent,
    _set_tokens,
    _set_page_size,
    _set_pages,
    _set_lora,
    _set_extra_keys,
    _set_first_page,
) = _STORED_SLOTS
_set_r_seq, _set_r_group, _set_r_hashes, _set_r_pages = _REMOVED_SLOTS


def new_stored(
    seq: int,
    group_id: int,
    page_hashes: tuple[bytes, ...],
    parent_page_hash: bytes | None,
    token_ids: Sequence[int],
    page_size: int,
    page_ids: tuple[int, ...],
    lora_name: str | None,
    extra_keys: ExtraKeys | None = None,
    first_page: int = 0,
) -> PageStored:
    """``PageStored(...)`` with the same fields, built faster (the core's hot path)."""
    event: PageStored = _new(PageStored)
    _set_seq(event, seq)
    _set_group(event, group_id)
    _set_hashes(event, page_hashes)
    _set_parent(event, parent_page_hash)
    _set_tokens(event, token_ids)
    _set_page_size(event, page_size)
    _set_pages(event, page_ids)
    _set_lora(event, lora_name)
    _set_extra_keys(event, extra_keys)
    _set_first_page(event, first_page)
    return event


def new_removed(
    seq: int, group_id: int, page_hashes: tuple[bytes, ...], page_ids: tuple[int, ...]
) -> PageRemoved:
    """``PageRemoved(...)`` with the same fields, built faster."""
    event: PageRemoved = _new(PageRemoved)
    _set_r_seq(event, seq)
    _set_r_group(event, group_id)
    _set_r_hashes(event, page_hashes)
    _set_r_pages(event, page_ids)
    return event


# Bytes an event keeps alive, roughly: the object and its tuples, each hash as a bytes object
# and a tuple slot, each page id as an int object and a slot, each token 8 bytes.
_EVENT_BYTES = 128
_PAGE_ID_BYTES = 36
_HASH_OVERHEAD_BYTES = 41
# The event's extra keys (narrowed to its pages: often the request's own object, counted
# anyway): the object and its strings' headers, and per multimodal input its object,
# tuple slot and identifier's header.
_KEYS_BYTES = 200
_MM_BYTES = 120


def event_nbytes(event: KVEvent) -> int:
    """An estimate of the memory ``event`` holds (deterministic: the same event gives the
    same figure, so a buffer trimmed by bytes is trimmed alike on replay)."""
    if type(event) is AllCleared:
        return _EVENT_BYTES
    hashes = event.page_hashes  # type: ignore[union-attr]
    size = (
        _EVENT_BYTES
        + len(hashes) * (_HASH_OVERHEAD_BYTES + (len(hashes[0]) if hashes else 0))
        + len(event.page_ids) * _PAGE_ID_BYTES  # type: ignore[union-attr]
    )
    if type(event) is PageStored:
        size += 8 * len(event.token_ids)
        keys = event.extra_keys
        if keys is not None:
            size += _KEYS_BYTES + sum(
                len(s) for s in (keys.lora_name, keys.lora_path, keys.cache_salt) if s
            )
            size += sum(_MM_BYTES + len(mm.identifier) for mm in keys.mm_inputs)
    return size
