"""The page pool: reference counts, the free queue (which *is* the eviction order) and the
prefix-cache index, for every page of every KV-cache group.

Memory is a few small integers per page in flat arrays, never a Python object per page::

    ref_count  int32  per page   how many requests hold it (0 = in the free queue)
    position   int32  per page   its cell in the queue buffer, -1 when not queued
    is_cached  uint8  per page   1 while the page is in the prefix-cache index
    buffer     int32  2 x pages  the free queue, a double-ended run with holes

The free queue is the same sequence vLLM keeps in its doubly linked list, stored as a
run ``buffer[head:tail]`` of a double-ended array. Taking from the head advances ``head``;
a freed run goes in front of ``head`` or after ``tail``; removing a page from the middle
(a prefix hit on a free cached page) leaves a hole (-1) in O(1). Holes are skipped when
taking pages and squeezed out when the run is re-centred, which happens only when one
end runs out of room (amortised O(1) per page). Each array is also exposed as a numpy
view of the same memory, so bulk operations are vectorised while single-page operations
stay on fast scalar indexing.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from pagekeeper.core.errors import InvalidArgument, InvariantViolation
from pagekeeper.core.events import AllCleared, KVEvent, PageRemoved, PageStored

NULL_PAGE = 0
# Below this many pages, plain scalar loops beat numpy's per-call overhead.
_SMALL = 12


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

    def __init__(self, num_pages: int, *, enable_caching: bool = True) -> None:
        if num_pages < 2:
            raise InvalidArgument(f"num_pages must be >= 2, got {num_pages}")
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self._ref, self._ref_np = _int32_array(num_pages, 0)
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
        # Prefix-cache index, one per group: hash -> first page holding it; further pages
        # with the same hash (vLLM keeps duplicates) wait in ``_dups`` in insertion order.
        self._index: list[dict[bytes, int]] = []
        self._dups: list[dict[bytes, list[int]]] = []
        self._page_key: dict[int, tuple[int, bytes]] = {}
        self._events: list[KVEvent] = []
        self._event_seq = 0
        self.num_evictions = 0
        self.num_allocated_total = 0
        self.num_freed_total = 0

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
        return len(self._page_key)

    def usage(self) -> float:
        """Fraction of the allocatable pages in use (the null page excluded), as vLLM."""
        return 1.0 - self._num_free / (self.num_pages - 1)

    def ref_count(self, page_id: int) -> int:
        return int(self._ref[page_id])

    def is_cached(self, page_id: int) -> bool:
        return bool(self._cached[page_id])

    def page_hash(self, page_id: int) -> tuple[int, bytes] | None:
        """``(group_id, hash)`` of a cached page, else None."""
        return self._page_key.get(page_id)

    def is_free(self, page_id: int) -> bool:
        return page_id != NULL_PAGE and self._pos[page_id] >= 0

    def ensure_groups(self, num_groups: int) -> None:
        while len(self._index) < num_groups:
            self._index.append({})
            self._dups.append({})

    # -- the free queue ------------------------------------------------------------------
    def free_queue(self) -> list[int]:
        """The free queue in order, head first (for tests and introspection)."""
        run = self._buf_np[self._head : self._tail]
        return [int(p) for p in run[run >= 0]]

    def _recenter(self) -> None:
        run = self._buf_np[self._head : self._tail]
        live = run[run >= 0].copy()
        capacity = len(self._buf)
        start = (capacity - len(live)) // 2
        self._buf_np[:] = -1
        self._buf_np[start : start + len(live)] = live
        self._pos_np[live] = np.arange(start, start + len(live), dtype=np.int32)
        self._head = start
        self._tail = start + len(live)

    def _take(self, n: int) -> list[int]:
        """Pop ``n`` pages from the head (caller checked ``n <= num_free``)."""
        buf, pos = self._buf, self._pos
        head = self._head
        if n <= _SMALL:
            out: list[int] = []
            while len(out) < n:
                page = buf[head]
                buf[head] = -1
                head += 1
                if page >= 0:
                    out.append(page)
                    pos[page] = -1
            self._head = head
        else:
            parts: list[npt.NDArray[np.int32]] = []
            need = n
            start = head
            while need:
                seg = self._buf_np[head : head + need]
                live = seg[seg >= 0]
                parts.append(live)
                head += len(seg)
                need -= len(live)
            self._buf_np[start:head] = -1
            self._head = head
            ids = np.concatenate(parts)
            self._pos_np[ids] = -1
            out = ids.tolist()
        self._num_free -= n
        return out

    def _prepend(self, pages: Sequence[int]) -> None:
        k = len(pages)
        if self._head < k:
            self._recenter()
        start = self._head - k
        if k <= _SMALL:
            buf, pos = self._buf, self._pos
            for i, page in enumerate(pages):
                buf[start + i] = page
                pos[page] = start + i
        else:
            ids = np.asarray(pages, dtype=np.int32)
            self._buf_np[start : self._head] = ids
            self._pos_np[ids] = np.arange(start, self._head, dtype=np.int32)
        self._head = start
        self._num_free += k

    def _append(self, pages: Sequence[int]) -> None:
        k = len(pages)
        if self._tail + k > len(self._buf):
            self._recenter()
        start = self._tail
        if k <= _SMALL:
            buf, pos = self._buf, self._pos
            for i, page in enumerate(pages):
                buf[start + i] = page
                pos[page] = start + i
        else:
            ids = np.asarray(pages, dtype=np.int32)
            self._buf_np[start : start + k] = ids
            self._pos_np[ids] = np.arange(start, start + k, dtype=np.int32)
        self._tail = start + k
        self._num_free += k

    def _remove(self, page: int) -> None:
        cell = self._pos[page]
        self._buf[cell] = -1
        self._pos[page] = -1
        self._num_free -= 1
        if cell == self._head:
            # Keep the head on a live cell so single-page takes stay short.
            buf, head, tail = self._buf, self._head + 1, self._tail
            while head < tail and buf[head] < 0:
                head += 1
            self._head = head

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Take ``num`` pages from the head of the free queue, evicting cached ones.

        The caller checks capacity first (allocation is all-or-nothing at the request level).
        """
        if num <= 0:
            return []
        if num > self._num_free:
            raise InvalidArgument(f"cannot allocate {num} pages: {self._num_free} free")
        pages = self._take(num)
        if num <= _SMALL:
            ref, cached = self._ref, self._cached
            for page in pages:
                ref[page] = 1
                if cached[page]:
                    self._evict(page)
        else:
            ids = np.asarray(pages, dtype=np.int32)
            self._ref_np[ids] = 1
            if self.enable_caching:
                hit = self._cached_np[ids]
                if hit.any():
                    for page in ids[hit.astype(bool)].tolist():
                        self._evict(page)
        self.num_allocated_total += num
        return pages

    def touch(self, pages: Iterable[int]) -> None:
        """A prefix hit: take each page out of the free queue if needed, ref count +1."""
        ref = self._ref
        for page in pages:
            if page == NULL_PAGE:
                continue
            if ref[page] == 0:
                self._remove(page)
            ref[page] += 1

    def free(self, pages: Sequence[int] | npt.NDArray[np.int32]) -> None:
        """Drop one reference of each page; ``pages`` are in eviction order (a request's
        pages last to first). Pages reaching 0 without a hash go to the head as one run,
        cached ones to the tail, both in the given order."""
        if len(pages) <= _SMALL:
            ref, cached = self._ref, self._cached
            head_run: list[int] = []
            tail_run: list[int] = []
            for page in pages:
                page = int(page)
                if page == NULL_PAGE:
                    continue
                count = ref[page] - 1
                if count < 0:
                    raise InvariantViolation(f"page {page} freed with ref count 0")
                ref[page] = count
                if count == 0:
                    (tail_run if cached[page] else head_run).append(page)
        else:
            ids = np.asarray(pages, dtype=np.int32)
            ids = ids[ids != NULL_PAGE]
            counts = self._ref_np[ids] - 1
            if (counts < 0).any():
                bad = ids[counts < 0].tolist()
                raise InvariantViolation(f"pages {bad} freed with ref count 0")
            self._ref_np[ids] = counts
            zero = ids[counts == 0]
            is_cached = self._cached_np[zero].astype(bool)
            head_run = zero[~is_cached].tolist()
            tail_run = zero[is_cached].tolist()
        if head_run:
            # One run, in the order given: the request's last page ends up at the head.
            self._prepend(head_run)
            self.num_freed_total += len(head_run)
        if tail_run:
            self._append(tail_run)
            self.num_freed_total += len(tail_run)

    # -- prefix-cache index --------------------------------------------------------------
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
    ) -> None:
        """Enter full pages into the index (one ``stored`` event for the run)."""
        index, dups = self._index[group_id], self._dups[group_id]
        stored_pages: list[int] = []
        stored_hashes: list[bytes] = []
        for page, page_hash in zip(pages, hashes, strict=True):
            if page == NULL_PAGE:
                continue
            if self._cached[page]:
                raise InvariantViolation(f"page {page} is already cached")
            if page_hash in index:
                dups.setdefault(page_hash, []).append(page)
            else:
                index[page_hash] = page
            self._cached[page] = 1
            self._page_key[page] = (group_id, page_hash)
            stored_pages.append(page)
            stored_hashes.append(page_hash)
        if stored_pages:
            self._event_seq += 1
            self._events.append(
                PageStored(
                    seq=self._event_seq,
                    group_id=group_id,
                    page_hashes=tuple(stored_hashes),
                    parent_page_hash=parent_hash,
                    token_ids=tuple(token_ids),
                    page_size=page_size,
                    page_ids=tuple(stored_pages),
                    lora_name=lora_name,
                )
            )

    def _unindex(self, page: int) -> tuple[int, bytes]:
        group_id, page_hash = self._page_key.pop(page)
        self._cached[page] = 0
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
        return group_id, page_hash

    def _evict(self, page: int) -> None:
        group_id, page_hash = self._unindex(page)
        self.num_evictions += 1
        self._event_seq += 1
        self._events.append(
            PageRemoved(
                seq=self._event_seq, group_id=group_id, page_hashes=(page_hash,), page_ids=(page,)
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only when no request holds a page (as vLLM)."""
        if self.num_used_pages != 0:
            return False
        for page in list(self._page_key):
            self._cached[page] = 0
        self._page_key.clear()
        for index, dups in zip(self._index, self._dups, strict=True):
            index.clear()
            dups.clear()
        self._event_seq += 1
        self._events.append(AllCleared(seq=self._event_seq))
        return True

    def take_events(self) -> list[KVEvent]:
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
        n = self.num_pages
        run = self._buf_np[self._head : self._tail]
        queued = run[run >= 0]
        outside = np.concatenate([self._buf_np[: self._head], self._buf_np[self._tail :]])
        if (outside >= 0).any():
            problems.append("queue buffer holds pages outside [head, tail)")
        if len(queued) != self._num_free:
            problems.append(f"num_free={self._num_free} but the queue holds {len(queued)}")
        counts = np.bincount(queued, minlength=n) if len(queued) else np.zeros(n, np.int64)
        if (counts > 1).any():
            problems.append(f"pages queued twice: {np.flatnonzero(counts > 1)[:10].tolist()}")
        if counts[NULL_PAGE]:
            problems.append("the null page is in the free queue")
        in_queue = counts > 0
        ref = self._ref_np
        zero = ref == 0
        zero[NULL_PAGE] = False
        if (in_queue != zero).any():
            bad = np.flatnonzero(in_queue != zero)[:10].tolist()
            problems.append(f"free-queue membership != (ref_count == 0) for pages {bad}")
        if (ref < 0).any():
            problems.append(f"negative ref counts at {np.flatnonzero(ref < 0)[:10].tolist()}")
        cells = np.flatnonzero(self._pos_np >= 0)
        if not np.array_equal(np.sort(cells), np.sort(queued)):
            problems.append("position array disagrees with queue membership")
        elif len(cells) and not np.array_equal(self._buf_np[self._pos_np[cells]], cells):
            problems.append("position array does not point back at its pages")
        if expected_refs is not None:
            diff = np.flatnonzero(expected_refs[1:] != ref[1:].astype(np.int64)) + 1
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
                    if self._page_key.get(member) != (group_id, page_hash):
                        problems.append(f"index entry for page {member} has a stale hash")
                    if member in seen:
                        problems.append(f"page {member} indexed twice")
                    seen.add(member)
            for page_hash in dups:
                if page_hash not in index:
                    problems.append("duplicate list without a primary index entry")
        if seen != set(self._page_key):
            problems.append(f"{len(self._page_key)} pages have hashes but {len(seen)} are indexed")
        flagged = set(np.flatnonzero(self._cached_np).tolist())
        if flagged != set(self._page_key):
            problems.append("is_cached flags disagree with the page hashes")
        if self._cached[NULL_PAGE]:
            problems.append("the null page is cached")
        return problems

    def nbytes(self) -> int:
        """Bytes of the per-page arrays (not counting the cache index contents)."""
        return (
            self._ref_np.nbytes + self._pos_np.nbytes + self._cached_np.nbytes + self._buf_np.nbytes
        )
