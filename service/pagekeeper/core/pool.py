"""The page pool: reference counts, the free queue (which *is* the eviction order) and the
prefix-cache index, for every page of every KV-cache group.

Memory is a few small integers per page in flat arrays, never a Python object per page::

    state      list   per page   2 x ref count + 1 while cached (8 bytes: a pointer to one
                                 of CPython's shared small ints; 0/1 = in the free queue)
    position   int32  per page   its cell in the queue buffer (cached free pages; lazily)
    is_cached  uint8  per page   group id + 1 while the page is in the prefix-cache index
    page_hash  list   per page   its hash while cached, else None (a pointer: 8 bytes)
    buffer     int32  2 x pages  the free queue, a double-ended run with holes

The state is a list rather than an ``array``: it is read and written on every page of every
allocation, free and prefix hit, and CPython specialises subscripts of a list of ints (not
of an ``array``), which makes those paths 1.2-1.4x faster. Folding the cached bit into it
saves a second lookup per page when a page is freed or taken. Its values stay small (a ref
count up to 127 is a shared small int), so the list costs 8 bytes a page and no int object.

The free queue is the same sequence vLLM keeps in its doubly linked list, stored as a
run ``buffer[head:tail]`` of a double-ended array. Taking from the head advances ``head``;
a freed run goes in front of ``head`` or after ``tail``; removing a page from the middle
(a prefix hit on a free cached page) leaves a hole (-1) in O(1). Holes are skipped when
taking pages and squeezed out when the run is re-centred, which happens only when one
end runs out of room (amortised O(1) per page). Each array is also exposed as a numpy
view of the same memory, so bulk operations are vectorised while single-page operations
stay on fast scalar indexing. Where the package was built with a C compiler, the per-page
loops of the bulk paths (allocation, eviction, caching a run, a same-state free) run in C
on these same objects (``_poolops.c``), with the same results.

Only what a later operation reads is written. A page is free exactly when its ref count
is 0 (the null page aside). Its ``position`` is needed only to take it out of the middle
of the queue, which happens only to cached pages (prefix hits). A free whose pages are
all cached and reach 0 together (a released prefix hit, a request that ended on a page
boundary) queues them as one run without writing positions: the cells from ``indexed``
to ``tail`` may hold pages whose positions are stale, and the first hit that needs one
writes that whole stretch in one go (a numpy scatter past a few dozen cells). A hit on
exactly that run usually finds it in place anyway (the position is checked against the
cell before it is trusted). The general free path writes positions as it queues.
Cells outside ``[head, tail)`` are never read, so taking pages from the head
does not clear them. Allocating and freeing a page thus costs two array writes.
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
import numpy.typing as npt

from pagekeeper.core.errors import InvalidArgument, InvariantViolation
from pagekeeper.core.events import (
    AllCleared,
    KVEvent,
    TokenRun,
    new_removed,
    new_stored,
)
from pagekeeper.core.extensions import load_extension
from pagekeeper.core.hashing import narrow_extra_keys
from pagekeeper.core.types import ExtraKeys

NULL_PAGE = 0
# Below this many pages, plain scalar loops beat numpy's per-call overhead.
_SMALL = 64
_HOLES = array("i", [-1]) * _SMALL
# ``struct`` writes a short list of ints into an int32 buffer 2-3x faster than building an
# ``array`` from it (or than writing the cells one by one).
_INT32S = [struct.Struct(f"={k}i") for k in range(_SMALL + 1)]


# Entries a group's PageIndex is first sized for, at most: 2,048 slots of 24 bytes (48 KB).
# The table doubles as the cache first fills; the rebuilds are geometric, so the total is
# about one rebuild of the final size (the one at 128K entries, ~10 ms, happened at any
# presize up to 64K); those below 64K entries add ~5 ms in all, once (1.2 ms at 16K, 2.5
# ms at 32K). Sized for 65,536 entries (3 MB: 48 bytes a page of a 65,536-page pool) it
# broke the start-up memory target.
_INDEX_PRESIZE = 1_024

# The C accelerator of the per-page loops below (``_poolops.c``: the same loops on the
# same objects), built with the package where a C compiler is; results are identical.
_ops: ModuleType | None = load_extension("_poolops", "PAGEKEEPER_NATIVE_POOL")


pack_i32_native: Callable[[Sequence[int]], bytes] | None = None if _ops is None else _ops.pack_i32
"""Little-endian int32 bytes of a sequence of ints in one C pass (None where the C loops
are not built): the wire's arrays of page ids."""


# An event's tuples of hashes and page ids, built untracked by the cyclic GC (they hold
# only bytes and ints): otherwise the next young collection traverses every one of them,
# and with thousands of events waiting for it that is a pause of tens of milliseconds.
_event_tuple: Callable[[Iterable[Any]], tuple[Any, ...]] = (
    tuple if _ops is None else _ops.atomic_tuple
)


def _keep_tracked(obj: object) -> bool:
    return False


# The events themselves (and a stored event's token run and its array), untracked once
# built: immutable, they can be in no cycle, and the event buffer keeps up to 65,536 of
# them for many seconds, so they survived into the older generations, whose collections
# then scanned them (3 objects a stored event; 10-25 ms pauses in a soak run).
_untrack: Callable[[object], bool] = _keep_tracked if _ops is None else _ops.untrack


class EventPlace(NamedTuple):
    """A ``stored`` event's place held in the pool's event list, and its seq."""

    position: int
    seq: int


# What a reserved place holds until its event is made (never taken out of the pool).
_RESERVED = cast(KVEvent, object())


class PendingEviction(NamedTuple):
    """Cached pages an allocation took whose index entries and ``removed`` event wait for
    :meth:`PagePool.evict_pending` (see :attr:`PagePool.evict_later`)."""

    pages: list[int]
    place: EventPlace


class CacheIndex(Protocol):
    """A group's prefix-cache index, hash -> first page holding it: a dict with the Python
    loops; with the C loops a ``_poolops.PageIndex``, which has the dict methods used here
    (lists, not views, from ``keys``/``values``/``items``). The PageIndex never rebuilds
    itself: a dict leaves a dummy slot per deletion and rebuilds its whole table when they
    use up its free slots, which with a large pool mostly cached (every allocation evicts
    and every admission inserts) meant one step in ~218 paid ~8 ms at 131,072 pages."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __getitem__(self, key: bytes, /) -> int: ...
    def __setitem__(self, key: bytes, value: int, /) -> None: ...
    def __delitem__(self, key: bytes, /) -> None: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def get(self, key: bytes, /) -> int | None: ...
    def values(self) -> Iterable[int]: ...
    def items(self) -> Iterable[tuple[bytes, int]]: ...
    def update(self, pairs: Iterable[tuple[bytes, int]], /) -> None: ...
    def clear(self) -> None: ...


def native_pool() -> bool:
    """Whether the page pool runs its C loops (``pagekeeper.core._poolops``)."""
    return _ops is not None


def _int32_array(size: int, fill: int) -> tuple[array[int], npt.NDArray[np.int32]]:
    arr = array("i", bytes(4 * size)) if fill == 0 else array("i", [fill]) * size
    view = np.frombuffer(arr, dtype=np.int32)
    return arr, view


class PagePool:
    """Pages ``1 … num_pages-1`` for allocation; page 0 is the null page, never handed out.

    Semantics follow vLLM v1's ``BlockPool`` (DESIGN §2): allocation takes from the head of
    the free queue and evicts cached pages it takes (lazy eviction); freeing puts pages
    without a hash at the head (reused first) and cached pages at the tail (LRU).
    """

    def __init__(
        self, num_pages: int, *, enable_caching: bool = True, native: bool | None = None
    ) -> None:
        """``native``: run the C loops (True), the Python ones (False), or the C ones where
        they are built (None, the default)."""
        if num_pages < 2:
            raise InvalidArgument(f"num_pages must be >= 2, got {num_pages}")
        if native and _ops is None:
            raise InvalidArgument("the C pool loops (pagekeeper.core._poolops) are not built")
        self._ops = _ops if native is None or native else None
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self._state = [0] * num_pages
        self._pos, self._pos_np = _int32_array(num_pages, -1)
        self._cached = bytearray(num_pages)
        self._cached_np = np.frombuffer(self._cached, dtype=np.uint8)
        capacity = 2 * num_pages + 64
        self._buf, self._buf_np = _int32_array(capacity, -1)
        # Initial queue: 1 … num_pages-1 in order (page 0 is reserved as the null page).
        start = (capacity - (num_pages - 1)) // 2
        self._head = start
        self._tail = start + num_pages - 1
        self._buf_np[self._head : self._tail] = np.arange(1, num_pages, dtype=np.int32)
        self._pos_np[1:] = np.arange(self._head, self._tail, dtype=np.int32)
        self._num_free = num_pages - 1
        # Free pages that are cached (state 1): kept as they change, so stats need no scan
        # of the queue (4M pages: ~15 ms). check_invariants recounts it.
        self._num_free_cached = 0
        # Cached pages queued in cells below this know their cell (``_pos``); from here to
        # the tail they may not yet (see the module docstring). Never above the tail.
        self._indexed = self._tail
        # Prefix-cache index, one per group: hash -> first page holding it; further pages
        # with the same hash (vLLM keeps duplicates) wait in ``_dups`` in insertion order.
        self._index: list[CacheIndex] = []
        self._dups: list[dict[bytes, list[int]]] = []
        # Hash of every cached page (None: not cached), a list by page id rather than a
        # dict: a write is one store, not a probe and an insert into a table that grows and
        # is rebuilt. ``_cached[page]`` holds its group id + 1 (0: not cached).
        self._page_hash: list[bytes | None] = [None] * num_pages
        self._events: list[KVEvent] = []
        self._event_seq = 0
        # Places in ``_events`` held for a ``stored`` event whose caching was deferred
        # (:meth:`reserve_event`): how many are still empty.
        self._num_reserved = 0
        self.evict_later: list[Any] | None = None
        """When a list: an allocation that takes cached pages appends a
        :class:`PendingEviction` to it (their ``removed`` event's seq and place reserved at
        once) instead of dropping them from the index now, unless some hash is held by two
        pages; the caller hands each to :meth:`evict_pending`, in order, before anything
        but lookups, hits and allocations reads or changes the pool (a lookup meanwhile
        passes its hits through :meth:`live_prefix`). Only for one group: the eviction
        then makes exactly one event."""
        self._num_pending_evictions = 0
        self.num_evictions = 0
        self.num_allocated_total = 0
        # Pages prefix hits took out of the free queue. With the allocations and the pages
        # in use it gives the frees (``num_freed_total``), so the free paths count nothing.
        self._num_taken_by_hits = 0

    # -- counters ------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_used_pages(self) -> int:
        """Pages held by requests (the null page not counted)."""
        return self.num_pages - 1 - self._num_free

    @property
    def num_cached_pages(self) -> int:
        return int(np.count_nonzero(self._cached_np))

    @property
    def num_free_cached_pages(self) -> int:
        """Cached pages in the free queue (a hit can still take them; eviction reuses them)."""
        return self._num_free_cached

    @property
    def num_freed_total(self) -> int:
        """Pages that went back to the free queue (their last reference dropped), ever:
        every page that left the queue (allocated, or taken by a hit) and is not in use."""
        return self.num_allocated_total + self._num_taken_by_hits - self.num_used_pages

    def restore_totals(self, num_allocated_total: int, num_freed_total: int) -> None:
        """Set the lifetime counters from a snapshot (after the free queue is restored)."""
        self.num_allocated_total = num_allocated_total
        self._num_taken_by_hits = num_freed_total - num_allocated_total + self.num_used_pages

    def usage(self) -> float:
        """Fraction of the allocatable pages in use (the null page excluded), as vLLM."""
        return 1.0 - self._num_free / (self.num_pages - 1)

    def ref_count(self, page_id: int) -> int:
        return self._state[page_id] >> 1

    def is_cached(self, page_id: int) -> bool:
        return bool(self._cached[page_id])

    def page_hash(self, page_id: int) -> tuple[int, bytes] | None:
        """``(group_id, hash)`` of a cached page, else None."""
        if not 0 <= page_id < self.num_pages:
            return None
        page_hash = self._page_hash[page_id]
        return None if page_hash is None else (self._cached[page_id] - 1, page_hash)

    def is_free(self, page_id: int) -> bool:
        return page_id != NULL_PAGE and self._state[page_id] < 2

    def free_mask(self) -> npt.NDArray[np.bool_]:
        """Per page: in the free queue (ref count 0, the null page excluded)."""
        mask = np.zeros(self.num_pages, dtype=np.bool_)
        mask[self._queued()] = True
        return mask

    def ref_count_array(self) -> npt.NDArray[np.int32]:
        """Every page's ref count, as a fresh int32 array (introspection, snapshots)."""
        try:
            # Every state below 256 (no page held 128 times): bytes() converts the list at
            # C speed, 1.7x faster than np.fromiter (50 ms for 4M pages on a slow core).
            raw = np.frombuffer(bytes(self._state), dtype=np.uint8)
        except ValueError:
            state = np.fromiter(self._state, dtype=np.int32, count=self.num_pages)
            state >>= 1
            return state
        counts: npt.NDArray[np.int32] = (raw >> 1).astype(np.int32)
        return counts

    def load_states(
        self, ref_counts: npt.NDArray[np.integer], cached: npt.NDArray[np.uint8]
    ) -> None:
        """Set every page's ref count and cache flag (group id + 1; 0: not cached) from a
        snapshot's arrays; the free queue and index are the caller's to restore."""
        self._cached_np[:] = cached
        self._state = (ref_counts.astype(np.int64) * 2 + (cached != 0)).tolist()
        self._num_free_cached = self._state.count(1)

    def new_index(self, num_groups: int = 1) -> CacheIndex:
        """An empty prefix-cache index for one of ``num_groups`` groups, sized for its share
        of the pool (all groups together index at most every page once) up to
        ``_INDEX_PRESIZE`` entries. A PageIndex doubles when filled past half and never
        shrinks: a larger pool's index grows a few times while the cache first fills (at
        131,072 entries that rebuild takes ~10 ms, at 1M ~80 ms, once each), then never
        again; sizing it for the whole pool up front would cost 48 bytes a page at
        start-up (with 4M pages, 192 MB) whether or not anything is ever cached."""
        if self._ops is None:
            index: dict[bytes, int] = {}
            return index
        expected = min(self.num_pages // max(1, num_groups), _INDEX_PRESIZE)
        return self._ops.PageIndex(expected)  # type: ignore[no-any-return]

    def count_free(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` sit in the free queue (the null page is never counted)."""
        states = list(map(self._state.__getitem__, pages))
        return states.count(0) + states.count(1) - list(pages).count(NULL_PAGE)

    def ensure_groups(self, num_groups: int) -> None:
        while len(self._index) < num_groups:
            self._index.append(self.new_index(num_groups))
            self._dups.append({})

    # -- the free queue ------------------------------------------------------------------
    def free_queue(self) -> list[int]:
        """The free queue in order, head first (for tests and introspection)."""
        queued: list[int] = self._queued().tolist()
        return queued

    def _queued(self) -> npt.NDArray[np.int32]:
        run = self._buf_np[self._head : self._tail]
        return run[run >= 0]

    def _recenter(self) -> None:
        run = self._buf_np[self._head : self._tail]
        live = run[run >= 0].copy()
        capacity = len(self._buf)
        start = (capacity - len(live)) // 2
        # Cells outside the run are never read: only the run itself is rewritten. Every
        # page moved, so no position is known: the next hit that needs one indexes the run.
        self._buf_np[start : start + len(live)] = live
        self._head = self._indexed = start
        self._tail = start + len(live)

    def _index_positions(self) -> None:
        """Write the position of every page queued from ``indexed`` to the tail."""
        head, tail = self._head, self._tail
        start = max(self._indexed, head)
        if tail - start <= _SMALL:
            buf, pos = self._buf, self._pos
            for cell in range(start, tail):
                page = buf[cell]
                if page >= 0:
                    pos[page] = cell
        else:
            seg = self._buf_np[start:tail]
            live = np.flatnonzero(seg >= 0)
            self._pos_np[seg[live]] = (live + start).astype(np.int32)
        self._indexed = tail

    def load_queue(self, capacity: int, head: int, tail: int, run: npt.NDArray[np.int32]) -> None:
        """Rebuild the free queue from a snapshot: ``run`` (page ids and -1 holes) in cells
        ``[head, tail)`` of a buffer of ``capacity`` cells. Counts are the caller's."""
        if not 0 <= head <= tail <= capacity or run.shape != (tail - head,):
            raise InvalidArgument("snapshot free queue does not fit its buffer")
        self._buf, self._buf_np = _int32_array(capacity, -1)
        self._buf_np[head:tail] = run
        # No position is known: the first hit that needs one indexes the run.
        self._head = self._indexed = head
        self._tail = tail

    def _prepend(self, pages: Sequence[int]) -> None:
        """Queue uncached pages at the head (no position: nothing takes them out of the
        middle)."""
        k = len(pages)
        if self._head < k:
            self._recenter()
        start = self._head - k
        self._write_cells(start, pages)
        self._head = start
        self._num_free += k

    def _append(self, pages: Sequence[int]) -> None:
        """Queue cached pages at the tail with their positions (the general free path: a
        request's pages minus its partial last page and pages others still hold)."""
        k = len(pages)
        if self._tail + k > len(self._buf):
            self._recenter()
        start = self._tail
        self._write_cells(start, pages)
        if k <= _SMALL:
            pos = self._pos
            cell = start
            for page in pages:
                pos[page] = cell
                cell += 1
        else:
            self._pos_np[self._buf_np[start : start + k]] = np.arange(
                start, start + k, dtype=np.int32
            )
        if self._indexed == start:
            self._indexed = start + k  # nothing unindexed before them
        self._tail = start + k
        self._num_free += k

    def _write_cells(self, start: int, pages: Sequence[int]) -> None:
        """Write a run of page ids into the queue buffer from cell ``start`` on."""
        k = len(pages)
        if k <= _SMALL:
            _INT32S[k].pack_into(self._buf, 4 * start, *pages)
        else:
            self._buf_np[start : start + k] = np.asarray(pages, dtype=np.int32)

    def _check_pages(self, pages: Sequence[int]) -> None:
        """Refuse, before anything changes, a page id outside the pool (a negative one
        would otherwise index from the end). For ``cache`` (once per run of pages); the
        free and hit paths take ids from the pool's own tables and index and stay lean."""
        if len(pages) and (min(pages) < 0 or max(pages) >= self.num_pages):
            bad = next(p for p in pages if not 0 <= p < self.num_pages)
            raise InvalidArgument(f"page {bad} is not in the pool (0 .. {self.num_pages - 1})")

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Take ``num`` pages from the head of the free queue, evicting cached ones.

        The caller checks capacity first (allocation is all-or-nothing at the request level).
        """
        state = self._state
        if num == 1 and self._num_free:
            # A decode crossing into a new page: the shortest path.
            buf, head = self._buf, self._head
            page = buf[head]
            while page < 0:
                head += 1
                page = buf[head]
            self._head = head + 1
            cached = state[page]
            state[page] = 2
            self._num_free -= 1
            self.num_allocated_total += 1
            if cached:
                self._num_free_cached -= 1
                self._evict_or_defer([page])
            return [page]
        if num <= 0:
            return []
        pages, evicted = self._take(num)
        if evicted:
            self._evict_or_defer(evicted)
        return pages

    def _evict_or_defer(self, evicted: list[int]) -> None:
        later = self.evict_later
        if later is None or any(self._dups):
            # With a hash held by two pages, evicting one hands its entry to the other:
            # a lookup could not tell a taken page's entry from a live one (and no
            # duplicate appears before the deferred work is done: only caching makes them).
            self._evict(evicted)
        else:
            later.append(PendingEviction(evicted, self.reserve_event()))
            self._num_pending_evictions += 1

    def evict_pending(self, pending: PendingEviction) -> None:
        """Drop a deferred eviction's pages from the index, its event in its place."""
        if self._num_pending_evictions <= 0:
            raise InvariantViolation("no eviction is pending")
        self._evict(pending.pages, place=pending.place)
        self._num_pending_evictions -= 1

    def evicts_plainly(self, group_id: int) -> bool:
        """Whether taking a cached page of ``group_id`` now evicts it at once from an index
        where its hash is its own (no deferred evictions, no hash held by two pages): what
        the C decode loop's page taking (``decode_rows``' ``pretaken``) does itself."""
        return self.evict_later is None and not self._dups[group_id]

    @property
    def has_pending_evictions(self) -> bool:
        return self._num_pending_evictions > 0

    def live_prefix(self, pages: list[int]) -> list[int]:
        """``pages`` (an index hit) up to the first one an allocation took while its
        eviction is pending: that page's hash is gone from the cache as far as a lookup is
        concerned (it holds other KV now)."""
        state = self._state
        for i, page in enumerate(pages):
            if not state[page] & 1:  # the cached bit: cleared when the page was taken
                return pages[:i]
        return pages

    def allocate_each(self, num: int) -> list[int]:
        """``num`` allocations of one page each in one call (decodes crossing into a new
        page): the same pages, evictions, events and counters as ``num`` calls of
        ``allocate(1)``, in order -- one ``removed`` event per evicted page."""
        if num <= 0:
            return []
        pages, evicted = self._take(num)
        if evicted:
            self._evict(evicted, event_per_page=True)
        return pages

    def _take(self, num: int) -> tuple[list[int], list[int]]:
        """The next ``num`` pages of the free queue, taken (held once); returns them and
        those of them that were cached, still indexed (the caller evicts them)."""
        if num > self._num_free:
            raise InvalidArgument(f"cannot allocate {num} pages: {self._num_free} free")
        if self._ops is not None:
            # The queue's scan, the state pass and the pages' list in one C call.
            pages, evicted, self._head = self._ops.take_run(self._buf, self._head, num, self._state)
        else:
            pages, evicted = self._take_py(num)
        self._num_free -= num
        self._num_free_cached -= len(evicted)
        self.num_allocated_total += num
        return pages, evicted

    def _take_py(self, num: int) -> tuple[list[int], list[int]]:
        """``_ops.take_run`` in Python: the queue's scan and the state pass."""
        head = self._head
        end = head + num
        if num <= _SMALL and -1 not in (run := self._buf[head:end]):
            # No hole in the way (the common case): the pages are the next ``num`` cells.
            pages = run.tolist()
            head = end
        else:
            parts: list[npt.NDArray[np.int32]] = []
            need = num
            while need:
                seg = self._buf_np[head : head + need]
                live = seg[seg >= 0]  # skip holes left by pages taken out of the middle
                parts.append(live)
                head += len(seg)
                need -= len(live)
            pages = (parts[0] if len(parts) == 1 else np.concatenate(parts)).tolist()
        self._head = head
        # Free pages have state 0 (no hash) or 1 (cached: evicted now); taken, they hold 2.
        state = self._state
        evicted = []
        for page in pages:
            if state[page]:
                evicted.append(page)
            state[page] = 2
        return pages, evicted

    def touch(self, pages: Iterable[int]) -> None:
        """A prefix hit: take each page out of the free queue if needed, ref count +1."""
        state, buf = self._state, self._buf
        if type(pages) is not list:
            pages = list(pages)
        k = len(pages)
        if k > 1 and state[pages[-1]] == 1:
            # A hit on the pages of a finished request: they were freed together, last page
            # first, so they usually lie in the queue as one run in reverse order. Checked
            # with one slice comparison inside the queue (cells in [head, tail) hold live
            # pages or holes, never the null page or a page twice), then taken as a run.
            # The run starts at a cached page and cached pages follow uncached ones in the
            # queue (checked by check_invariants), so every page of it is cached: state 1.
            first = pages[-1]
            cell = self._pos[first]
            head, tail = self._head, self._tail
            if not (head <= cell < tail and buf[cell] == first) and self._indexed < tail:
                self._index_positions()  # freed since the last hit: its position is stale
                cell = self._pos[first]
            end = cell + k
            if head <= cell and end <= tail and buf[cell:end].tolist() == pages[::-1]:
                for page in pages:
                    state[page] = 3
                self._num_free -= k
                self._num_free_cached -= k
                self._num_taken_by_hits += k
                if end == tail:
                    # The most recently freed run (the last turn of a conversation): the
                    # queue just ends before it, no holes left.
                    self._tail = cell
                    if self._indexed > cell:
                        self._indexed = cell
                    if buf[cell - 1] < 0:
                        self._trim_tail()
                else:
                    buf[cell:end] = _HOLES[:k] if k <= _SMALL else array("i", [-1]) * k
                    if cell == self._head:
                        self._skip_holes()
                return
        if self._indexed < self._tail and 1 in map(state.__getitem__, pages):
            self._index_positions()  # a cached free page is taken: positions needed
        pos = self._pos
        removed = removed_cached = 0
        for page in pages:
            s = state[page]
            if s < 2:
                if page == NULL_PAGE:
                    continue  # never queued, never counted
                if s:
                    buf[pos[page]] = -1  # leave a hole: O(1) removal from the middle
                    removed_cached += 1
                else:
                    self._unqueue_uncached(page)
                removed += 1
            state[page] = s + 2
        if removed:
            self._num_free -= removed
            self._num_free_cached -= removed_cached
            self._num_taken_by_hits += removed
            self._skip_holes()
            self._trim_tail()

    def _skip_holes(self) -> None:
        """Advance the head over holes."""
        buf, head, tail = self._buf, self._head, self._tail
        while head < tail and buf[head] < 0:
            head += 1
        self._head = head

    def _trim_tail(self) -> None:
        """Pull the tail back over holes (cells from the tail on are never read)."""
        buf, head, tail = self._buf, self._head, self._tail
        while tail > head and buf[tail - 1] < 0:
            tail -= 1
        self._tail = tail
        if self._indexed > tail:
            self._indexed = tail

    def _unqueue_uncached(self, page: int) -> None:
        """Take a free page without a hash out of the queue. Prefix hits only ever touch
        cached pages, whose positions are kept; this search is for any other caller."""
        run = self._buf_np[self._head : self._tail]
        cells = np.flatnonzero(run == page)
        if len(cells) != 1:
            raise InvariantViolation(f"free page {page} is queued {len(cells)} times")
        self._buf[self._head + int(cells[0])] = -1

    def free(self, pages: Sequence[int] | npt.NDArray[np.int32]) -> None:
        """Drop one reference of each page; ``pages`` are in eviction order (a request's
        pages last to first). Pages reaching 0 without a hash go to the head as one run,
        cached ones to the tail, both in the given order."""
        state = self._state
        if len(pages) == 1:
            page = pages[0]  # a numpy int indexes the list and the buffer alike
            s = state[page] - 2
            if s < 0:
                if page == NULL_PAGE:
                    return
                raise InvariantViolation(f"page {page} freed with ref count 0")
            state[page] = s
            if s < 2:
                self._num_free += 1
                if s:
                    self._num_free_cached += 1
                    tail = self._tail
                    if tail >= len(self._buf):
                        self._recenter()
                        tail = self._tail
                    self._buf[tail] = page
                    self._tail = tail + 1
                else:
                    head = self._head
                    if head == 0:
                        self._recenter()
                        head = self._head
                    head -= 1
                    self._buf[head] = page
                    self._head = head
            return
        if type(pages) is not list:
            pages = pages.tolist() if isinstance(pages, np.ndarray) else [int(p) for p in pages]
        k = len(pages)
        if self._tail + k > len(self._buf):
            self._recenter()
        # Every page held once and all cached (a released prefix hit, a request that filled
        # its last page: state 3) or all uncached (prefix caching off: state 2): one pass
        # sets the states and the pages join the tail, or the head, as one run. A page that
        # breaks the pass (another state; a page listed twice reads its new state the
        # second time) undoes it, and the general path below takes over.
        same = state[pages[0]] if k else 0
        if same == 3 or same == 2:
            now = same - 2
            if self._ops is not None:
                whole = self._ops.release(state, pages, same, now)
            else:
                whole = True
                pending = iter(pages)
                for page in pending:
                    if state[page] != same:
                        done = k - 1 - operator.length_hint(pending)
                        for taken in pages[:done]:
                            state[taken] = same  # undo: the general path starts from the states
                        whole = False
                        break
                    state[page] = now
            if whole:
                if now:
                    start = self._tail
                    self._write_cells(start, pages)  # positions: when a hit needs them
                    self._tail = start + k
                    self._num_free += k
                    self._num_free_cached += k
                else:
                    self._prepend(pages)
                return
        # The general path: each page that reaches 0 joins its run as it does (so a page
        # listed as often as it was held is queued once, when its last reference goes).
        head_run: list[int] = []
        tail_run: list[int] = []
        to_head, to_tail = head_run.append, tail_run.append
        bad = -1
        for page in pages:
            s = state[page] - 2
            if s < 2:
                if s < 0:
                    if page == NULL_PAGE:
                        continue
                    # A caller bug (the manager checks ownership first): the pages before
                    # it are queued consistently so the pool stays sound for
                    # check_invariants to report.
                    bad = page
                    break
                if s:
                    to_tail(page)
                else:
                    to_head(page)
            state[page] = s
        if tail_run:
            self._append(tail_run)
            self._num_free_cached += len(tail_run)
        if head_run:
            # One run, in the order given: the request's last page ends up at the head.
            self._prepend(head_run)
        if bad >= 0:
            raise InvariantViolation(f"page {bad} freed with ref count 0")

    # -- prefix-cache index --------------------------------------------------------------
    def index(self, group_id: int) -> CacheIndex:
        """The group's hash -> first page map, for scans (read only: never mutate it)."""
        return self._index[group_id]

    def lookup(self, group_id: int, page_hash: bytes) -> int | None:
        """First page cached under this hash in this group, or None."""
        return self._index[group_id].get(page_hash)

    def cache(
        self,
        group_id: int,
        pages: Sequence[int],
        hashes: Sequence[bytes],
        *,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        page_size: int,
        lora_name: str | None,
        extra_keys: ExtraKeys | None = None,
        first_page: int = 0,
        reserved: EventPlace | None = None,
    ) -> None:
        """Enter full pages into the index (one ``stored`` event for the run). ``extra_keys``
        and ``first_page`` (the run's place in its request's table) go into the event;
        ``reserved`` (from :meth:`reserve_event`) is where it goes and the seq it takes."""
        index, cached, hash_of = self._index[group_id], self._cached, self._page_hash
        if len(pages) != len(hashes):
            raise InvalidArgument(f"{len(pages)} pages but {len(hashes)} hashes")
        self._check_pages(pages)
        if self._ops is not None:
            # A run of held, uncached pages with new, distinct hashes, entered in one C call
            # (it changes nothing and says False otherwise: the general path below).
            entered = self._ops.cache(
                index, hash_of, self._state, cached, pages, hashes, group_id + 1
            )
        elif (
            len(pages) > 4
            and NULL_PAGE not in pages
            and not any(map(index.__contains__, hashes))
            and len(set(hashes)) == len(hashes)
            and len(set(pages)) == len(pages)
        ):
            # The common case (a run of fresh pages with new hashes): bulk dict updates.
            ids = np.asarray(pages, dtype=np.int64)
            state = self._state
            states = list(map(state.__getitem__, pages))
            if self._cached_np[ids].any() or min(states) < 2:
                raise InvariantViolation(f"pages {pages} include a cached or free page")
            index.update(zip(hashes, pages, strict=True))
            self._cached_np[ids] = group_id + 1
            for page, s, page_hash in zip(pages, states, hashes, strict=True):
                state[page] = s + 1
                hash_of[page] = page_hash
            entered = True
        else:
            entered = False
        if entered:
            stored_pages, stored_hashes = pages, hashes
        else:
            state = self._state
            seen = set()
            for page in pages:
                # Only held pages are cached (a free page's queue position is not kept).
                if page != NULL_PAGE and (cached[page] or state[page] < 2 or page in seen):
                    raise InvariantViolation(f"page {page} is already cached, free or listed twice")
                seen.add(page)
            stored_pages, stored_hashes = [], []
            first_stored = -1
            for i, (page, page_hash) in enumerate(zip(pages, hashes, strict=True)):
                if page == NULL_PAGE:
                    continue
                self._index_page(group_id, page, page_hash)
                stored_pages.append(page)
                stored_hashes.append(page_hash)
                if first_stored < 0:
                    first_stored = i
            if not stored_pages:
                if reserved is not None:
                    raise InvariantViolation("a reserved stored event has no page to store")
                return
            # One event over the run, null pages left out, as vLLM's: its first page is the
            # first stored one (a window's null pages lead). A null page between stored
            # ones (never seen) would shift the later pages' extra keys by one page each.
            first_page += first_stored
        self._stored_event(
            group_id,
            stored_pages,
            stored_hashes,
            parent_hash,
            token_ids,
            page_size,
            lora_name,
            extra_keys,
            first_page,
            reserved,
        )

    def cache_one(
        self,
        group_id: int,
        page: int,
        page_hash: bytes,
        *,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        page_size: int,
        lora_name: str | None,
        extra_keys: ExtraKeys | None = None,
        first_page: int = 0,
    ) -> None:
        """``cache`` for the one page a decode just filled (the shortest path)."""
        if self._cached[page] or self._state[page] < 2 or page == NULL_PAGE:
            raise InvariantViolation(f"page {page} is already cached, free or the null page")
        self._index_page(group_id, page, page_hash)
        self._stored_event(
            group_id,
            (page,),
            (page_hash,),
            parent_hash,
            token_ids,
            page_size,
            lora_name,
            extra_keys,
            first_page,
        )

    def _index_page(self, group_id: int, page: int, page_hash: bytes) -> None:
        """Enter one held, uncached page under its hash (a duplicate hash waits behind the
        first page holding it, as vLLM keeps duplicates)."""
        index = self._index[group_id]
        if page_hash in index:
            self._dups[group_id].setdefault(page_hash, []).append(page)
        else:
            index[page_hash] = page
        self._cached[page] = group_id + 1
        self._state[page] += 1
        self._page_hash[page] = page_hash

    def fill_parts(self, group_id: int) -> tuple[Any, ...]:
        """``(pool, index, hash_of, state, cached, events)`` of one group: what the C decode
        loop (``_poolops.decode_rows``' fill) reads and writes to cache a filled page as
        :meth:`cache_one` does. Its lists may change only while that loop runs."""
        return (
            self,
            self._index[group_id],
            self._page_hash,
            self._state,
            self._cached,
            self._events,
        )

    def _stored_event(
        self,
        group_id: int,
        pages: Sequence[int],
        hashes: Sequence[bytes],
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        page_size: int,
        lora_name: str | None,
        extra_keys: ExtraKeys | None,
        first_page: int,
        reserved: EventPlace | None = None,
    ) -> None:
        seq = self._seq_for(reserved)
        if extra_keys is not None:
            # Only what falls on these pages (not a thousand images into each event).
            extra_keys = narrow_extra_keys(extra_keys, first_page, len(pages), page_size)
        # The caller's slice of a request's ``array('Q')`` is a fresh copy: adopted.
        packed = (
            token_ids
            if type(token_ids) is array and token_ids.typecode == "Q"
            else array("Q", token_ids)
        )
        _untrack(packed)
        run = TokenRun.adopt(packed)
        _untrack(run)
        event = new_stored(
            seq,
            group_id,
            _event_tuple(hashes),
            parent_hash,
            run,
            page_size,
            _event_tuple(pages),
            lora_name,
            extra_keys,
            first_page,
        )
        self._put_event(event, reserved)

    def _seq_for(self, place: EventPlace | None) -> int:
        """The seq of an event made now: the next one, or the one its place holds."""
        if place is None:
            self._event_seq += 1
            return self._event_seq
        return place.seq

    def _put_event(self, event: KVEvent, place: EventPlace | None) -> None:
        """Append an event made now, or fill the place reserved for it."""
        _untrack(event)
        if place is None:
            self._events.append(event)
            return
        if self._events[place.position] is not _RESERVED:
            raise InvariantViolation(f"event place {place.position} is not reserved")
        self._events[place.position] = event
        self._num_reserved -= 1

    def reserve_event(self) -> EventPlace:
        """Hold the next event's seq and place for an event made later (a deferred caching's
        ``stored``, :meth:`cache` with ``reserved``; a deferred eviction's ``removed``):
        events after it keep their order and seqs, as if it had been made now. Filled
        before :meth:`take_events`."""
        self._event_seq += 1
        self._events.append(_RESERVED)
        self._num_reserved += 1
        return EventPlace(len(self._events) - 1, self._event_seq)

    @property
    def has_events(self) -> bool:
        """Whether events wait for :meth:`take_events`."""
        return bool(self._events)

    def _evict(
        self, pages: list[int], *, event_per_page: bool = False, place: EventPlace | None = None
    ) -> None:
        """Drop freshly taken pages from the index (lazy eviction happens here; the caller
        has already cleared their cached bit in the state). One ``removed`` event per run
        of pages of the same group, in allocation order (per page with
        ``event_per_page``: pages taken by separate one-page allocations); into the
        reserved ``place`` when given (the pages must then be of one group)."""
        cached, hash_of = self._cached, self._page_hash
        k = len(pages)
        if k > 1:
            group_plus_one = cached[pages[0]]
            if group_plus_one and not self._dups[group_plus_one - 1]:
                # The common case: one group, and no hash of that group is held by two
                # pages, so each page is its hash's one index entry.
                index = self._index[group_plus_one - 1]
                hashes: list[bytes] | None
                if self._ops is not None:
                    hashes = self._ops.evict(index, hash_of, cached, pages, group_plus_one)
                elif bytes(map(cached.__getitem__, pages)).count(group_plus_one) == k:
                    # Each page is cached (its flag says so), so each has a hash.
                    hashes = [hash_of[page] for page in pages]  # type: ignore[misc]
                    deque(map(index.__delitem__, hashes), maxlen=0)
                    for page in pages:
                        cached[page] = 0
                        hash_of[page] = None
                else:
                    hashes = None  # pages of several groups: the general path
                if hashes is not None:
                    if event_per_page:
                        # One ``removed`` event per page (hundreds when a decode step's
                        # crossings evict): _removed_event's work inline.
                        group_id = group_plus_one - 1
                        events, seq = self._events, self._event_seq
                        for page, removed in zip(pages, hashes, strict=True):
                            seq += 1
                            event = new_removed(
                                seq, group_id, _event_tuple((removed,)), _event_tuple((page,))
                            )
                            _untrack(event)
                            events.append(event)
                        self._event_seq = seq
                    else:
                        self._removed_event(group_plus_one - 1, pages, hashes, place)
                    self.num_evictions += k
                    return
        run_group = -1
        run_pages: list[int] = []
        run_hashes: list[bytes] = []
        for page in pages:
            group_id = cached[page] - 1
            page_hash = hash_of[page]
            if page_hash is None:
                raise InvariantViolation(f"cached page {page} has no hash")
            hash_of[page] = None
            cached[page] = 0
            index, dups = self._index[group_id], self._dups[group_id]
            if index.get(page_hash) == page:
                waiting = dups.get(page_hash)
                if waiting:
                    index[page_hash] = waiting.pop(0)
                    if not waiting:
                        del dups[page_hash]
                else:
                    del index[page_hash]
            else:
                waiting = dups[page_hash]
                waiting.remove(page)
                if not waiting:
                    del dups[page_hash]
            if (group_id != run_group or event_per_page) and run_pages:
                if place is not None:
                    raise InvariantViolation("a deferred eviction spans several groups")
                self._removed_event(run_group, run_pages, run_hashes)
                run_pages, run_hashes = [], []
            run_group = group_id
            run_pages.append(page)
            run_hashes.append(page_hash)
        if run_pages:
            self._removed_event(run_group, run_pages, run_hashes, place)
        self.num_evictions += len(pages)

    def _removed_event(
        self,
        group_id: int,
        pages: list[int],
        hashes: list[bytes],
        place: EventPlace | None = None,
    ) -> None:
        seq = self._seq_for(place)
        self._put_event(
            new_removed(seq, group_id, _event_tuple(hashes), _event_tuple(pages)), place
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only when no request holds a page (as vLLM)."""
        if self.num_used_pages != 0:
            return False
        self.forget_hashes()
        return True

    def forget_hashes(self) -> int:
        """Forget every hash, those of pages requests hold too (the KV they name is gone: a
        worker whose KV cache holds nothing joined). Pages no request holds become plain
        free pages where they are queued; held pages stay held and are no longer hit. One
        all-cleared event. Returns how many pages lost their hash."""
        state = self._state
        cached = np.flatnonzero(self._cached_np).tolist()
        for page in cached:
            state[page] &= ~1  # the cached bit (the rest counts the page's holders)
        self._cached_np[:] = 0
        self._num_free_cached = 0
        self._page_hash = [None] * self.num_pages
        for index, dups in zip(self._index, self._dups, strict=True):
            index.clear()
            dups.clear()
        self._event_seq += 1
        self._events.append(AllCleared(seq=self._event_seq))
        return len(cached)

    def take_events(self) -> list[KVEvent]:
        if self._num_reserved:
            raise InvariantViolation(
                f"{self._num_reserved} reserved events are not made yet (settle first)"
            )
        events, self._events = self._events, []
        return events

    @property
    def last_event_seq(self) -> int:
        return self._event_seq

    # -- integrity -----------------------------------------------------------------------
    def check_invariants(self, expected_refs: npt.NDArray[np.int64] | None = None) -> list[str]:
        """Recompute everything from scratch; returns the list of breaches (empty = sound).

        ``expected_refs`` (per page, from the requests' tables) is compared with the ref
        counts when given.
        """
        problems: list[str] = []
        if self._num_pending_evictions:
            problems.append(f"{self._num_pending_evictions} evictions are pending (settle first)")
        n = self.num_pages
        run = self._buf_np[self._head : self._tail]
        queued = run[run >= 0]
        if not 0 <= self._head <= self._tail <= len(self._buf):
            problems.append(f"queue bounds out of order: head {self._head}, tail {self._tail}")
        if len(queued) != self._num_free:
            problems.append(f"num_free={self._num_free} but the queue holds {len(queued)}")
        counts = np.bincount(queued, minlength=n) if len(queued) else np.zeros(n, np.int64)
        if (counts > 1).any():
            problems.append(f"pages queued twice: {np.flatnonzero(counts > 1)[:10].tolist()}")
        if counts[NULL_PAGE]:
            problems.append("the null page is in the free queue")
        in_queue = counts > 0
        if len(self._state) != n:
            problems.append(f"{len(self._state)} page states for {n} pages")
        state = np.fromiter(self._state, dtype=np.int64, count=n)
        ref = state >> 1
        zero = ref == 0
        zero[NULL_PAGE] = False
        if (in_queue != zero).any():
            bad = np.flatnonzero(in_queue != zero)[:10].tolist()
            problems.append(f"free-queue membership != (ref_count == 0) for pages {bad}")
        if (state < 0).any():
            problems.append(f"negative ref counts at {np.flatnonzero(state < 0)[:10].tolist()}")
        num_free_cached = int(np.count_nonzero(state == 1))
        if num_free_cached != self._num_free_cached:
            problems.append(
                f"num_free_cached={self._num_free_cached} but {num_free_cached} free pages "
                "are cached"
            )
        wrong_bit = (state & 1) != (self._cached_np != 0)
        if wrong_bit.any():
            bad = np.flatnonzero(wrong_bit)[:10].tolist()
            problems.append(f"cached bit of the state != is_cached for pages {bad}")
        # Cached pages are queued after uncached ones: cached pages only ever join at the
        # tail, uncached ones at the head (touch relies on it).
        queued_cached = self._cached_np[queued] != 0
        if len(queued) > 1 and (queued_cached[:-1] > queued_cached[1:]).any():
            problems.append("an uncached page is queued after a cached one")
        # Cached free pages (the ones a prefix hit can take from the middle) know their cell,
        # except in the stretch from ``indexed`` to the tail that no hit has needed yet.
        if not self._indexed <= self._tail:
            problems.append(f"positions indexed to {self._indexed}, past the tail {self._tail}")
        cells = np.flatnonzero(run >= 0) + self._head
        known = queued_cached & (cells < self._indexed)
        if not np.array_equal(self._pos_np[queued[known]], cells[known]):
            problems.append("a cached free page's position does not point at its cell")
        if expected_refs is not None:
            diff = np.flatnonzero(expected_refs[1:] != ref[1:]) + 1
            if len(diff):
                p = int(diff[0])
                problems.append(
                    f"ref counts != references from request tables at {diff[:10].tolist()} "
                    f"(page {p}: ref {int(ref[p])}, tables {int(expected_refs[p])})"
                )
        # The index: every entry points at a cached page with that hash, every cached page
        # is indexed exactly once.
        seen: set[int] = set()
        for group_id, (index, dups) in enumerate(zip(self._index, self._dups, strict=True)):
            for page_hash, page in index.items():
                members = [page, *dups.get(page_hash, [])]
                for member in members:
                    if self.page_hash(member) != (group_id, page_hash):
                        problems.append(f"index entry for page {member} has a stale hash")
                    if member in seen:
                        problems.append(f"page {member} indexed twice")
                    seen.add(member)
            for page_hash in dups:
                if page_hash not in index:
                    problems.append("duplicate list without a primary index entry")
        hashed = {page for page, h in enumerate(self._page_hash) if h is not None}
        if seen != hashed:
            problems.append(f"{len(hashed)} pages have hashes but {len(seen)} are indexed")
        flagged = set(np.flatnonzero(self._cached_np).tolist())
        if flagged != hashed:
            problems.append("is_cached flags disagree with the page hashes")
        if self._cached[NULL_PAGE]:
            problems.append("the null page is cached")
        if self._state[NULL_PAGE]:
            problems.append("the null page has a ref count or a cached bit")
        return problems

    def nbytes(self) -> int:
        """Bytes of the per-page arrays (not counting the cache index contents)."""
        return (
            sys.getsizeof(self._state)
            + sys.getsizeof(self._page_hash)
            + self._pos_np.nbytes
            + self._cached_np.nbytes
            + self._buf_np.nbytes
        )
