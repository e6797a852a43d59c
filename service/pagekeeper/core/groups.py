"""Per-kind page layout of one KV-cache group (vLLM's single-type managers).

Each group keeps every running request's physical table as a row of a :class:`PageRows`
and knows three things that differ by kind: which cached prefix it can reuse
(:meth:`GroupManager.find_cache_hit`), which leading pages a request no longer reads
(:meth:`GroupManager.num_skipped_tokens`, they become the null page and go back to the
pool), and how many pages a request needs for some number of tokens.

Token regions of one request in one group, at an allocation::

    | skipped (null pages) |   computed   |   new (scheduled now)  | lookahead |
    0                      s              c                        c+n         c+n+l
    s = num_skipped_tokens(c): 0 for full attention; c - window + 1 for a sliding window;
        the start of the current chunk for chunked local; c - 1 for a cached mamba state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from itertools import takewhile
from operator import is_not

from pagekeeper.core.config import GroupConfig, GroupKind
from pagekeeper.core.pool import NULL_PAGE, EventPlace, PagePool
from pagekeeper.core.tables import PageRows
from pagekeeper.core.types import ExtraKeys

_is_not_none = partial(is_not, None)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupManager:
    """Full attention; the base the other kinds refine."""

    def __init__(self, group_id: int, config: GroupConfig, pool: PagePool, max_model_len: int):
        self.group_id = group_id
        self.config = config
        self.page_size = config.page_size
        self.pool = pool
        self.max_pages_per_request = self._max_pages(max_model_len)
        self.rows = PageRows(self.max_pages_per_request)
        self.request_rows: dict[str, int] = {}
        # Length of each request's table (mirrors the row length; read on every decode).
        self.page_counts: dict[str, int] = {}
        # Pages of each request already in the prefix-cache index (or deliberately skipped).
        self.num_cached_pages: dict[str, int] = {}

    def _max_pages(self, max_model_len: int) -> int:
        return cdiv(max_model_len, self.page_size)

    # -- kind-specific rules -------------------------------------------------------------
    @property
    def is_cacheable(self) -> bool:
        return True

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def num_required_pages(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def find_cache_hit(self, hashes: Sequence[bytes], max_length: int) -> list[int]:
        """Pages of the longest cached prefix of at most ``max_length`` tokens (null pages
        where the kind needs none). Hashes are this group's, one per page."""
        # The longest run of hashes found, in one C-level pass that stops at the first miss
        # (the native index's own, which asks for the slots a few hashes ahead).
        pool = self.pool
        index = pool.index(self.group_id)
        limit = max_length // self.page_size
        prefix = getattr(index, "prefix", None)
        if prefix is not None:
            hit: list[int] = prefix(hashes, limit)
        else:
            found: Iterator[int] = map(index.get, hashes[:limit])  # type: ignore[arg-type]
            hit = list(takewhile(_is_not_none, found))
        # A page taken by an allocation whose eviction is deferred still has its entry.
        return pool.live_prefix(hit) if pool.has_pending_evictions else hit

    # -- per-request state ---------------------------------------------------------------
    def has(self, request_id: str) -> bool:
        return request_id in self.request_rows

    def num_pages(self, request_id: str) -> int:
        return self.page_counts.get(request_id, 0)

    def pages(self, request_id: str) -> list[int]:
        row = self.request_rows.get(request_id)
        return [] if row is None else self.rows.row(row).tolist()

    def num_pages_to_allocate(
        self, request_id: str, num_tokens: int, hit_pages: Sequence[int], num_computed_tokens: int
    ) -> int:
        """Free pages this allocation consumes: new pages, plus hit pages that must be taken
        out of the free queue (they count against the same free pages)."""
        required = self.num_required_pages(num_tokens)
        held = self.page_counts.get(request_id)
        if held is not None:
            return max(required - held, 0)
        num_skipped_pages = self.num_skipped_tokens(num_computed_tokens) // self.page_size
        new = max(required - max(num_skipped_pages, len(hit_pages)), 0)
        kept = hit_pages[num_skipped_pages:]
        return new + self.pool.count_free(kept)

    def save_hits(
        self, request_id: str, hit_pages: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Admission: take the cached prefix (pages the window no longer needs become null)."""
        num_skipped_pages = self.num_skipped_tokens(num_computed_tokens) // self.page_size
        kept = list(hit_pages[num_skipped_pages:])
        if kept:
            self.pool.touch(kept)
        row = self.rows.add_row()
        self.request_rows[request_id] = row
        table = [NULL_PAGE] * min(num_skipped_pages, self.max_pages_per_request) + kept
        if table:
            # A fresh row, and ids the pool's index handed out: only the room is checked.
            self.rows.append_run(row, 0, table)
        self.page_counts[request_id] = len(table)
        self.num_cached_pages[request_id] = len(table)

    def admit_full(self, request_id: str, hit_pages: list[int], num_tokens: int) -> list[int]:
        """:meth:`save_hits` then :meth:`allocate_new` for a new request of a full-attention
        group (no page is skipped), in one pass and one write of its row: the hit pages
        touched, then the new ones taken. Returns the new pages."""
        if hit_pages:
            self.pool.touch(hit_pages)
        row = self.rows.add_row()
        self.request_rows[request_id] = row
        held = len(hit_pages)
        num_new = self.num_required_pages(num_tokens) - held
        pages = self.pool.allocate(num_new) if num_new > 0 else []
        table = hit_pages + pages if held else pages
        if table:
            # A fresh row, and ids the pool's index and queue handed out: only the room is
            # checked.
            self.rows.append_run(row, 0, table)
        self.page_counts[request_id] = held + len(pages)
        self.num_cached_pages[request_id] = held
        return pages

    def allocate_new(self, request_id: str, num_tokens: int) -> list[int]:
        row = self.request_rows.get(request_id)
        if row is None:
            row = self.rows.add_row()
            self.request_rows[request_id] = row
            self.page_counts[request_id] = 0
            self.num_cached_pages[request_id] = 0
        held = self.page_counts[request_id]
        num_new = self.num_required_pages(num_tokens) - held
        if num_new <= 0:
            return []
        pages = self.pool.allocate(num_new)
        if num_new == 1:
            self.rows.append_page(row, held, pages[0])
        else:
            self.rows.append_run(row, held, pages)
        self.page_counts[request_id] = held + num_new
        return pages

    def allocate_next_pages(
        self, request_ids: Sequence[str], num_pages: Sequence[int]
    ) -> list[int]:
        """One new page at the end of each request's table (decodes crossing into a page;
        ``num_pages[i]`` is what request ``i`` holds now, as ``page_counts`` says), in one
        pool call: the same pages and events as ``allocate_new`` for each in order."""
        pages = self.pool.allocate_each(len(request_ids))
        self.place_next_pages(request_ids, num_pages, pages)
        return pages

    def place_next_pages(
        self, request_ids: Sequence[str], num_pages: Sequence[int], pages: Sequence[int]
    ) -> None:
        """Put pages the pool handed out (one per request, in order) at the end of each
        request's table, as :meth:`allocate_next_pages` does with its own."""
        request_rows = self.request_rows
        self.rows.append_page_each([request_rows[r] for r in request_ids], num_pages, pages)
        page_counts = self.page_counts
        for request_id, held in zip(request_ids, num_pages, strict=True):
            page_counts[request_id] = held + 1

    def remove_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        """Release pages that fell out of the attention window (they become the null page)."""
        num_skipped = self.num_skipped_tokens(num_computed_tokens)
        if num_skipped <= 0:
            return
        row = self.request_rows.get(request_id)
        if row is None:
            return
        rows = self.rows
        last = min(num_skipped // self.page_size, self.page_counts[request_id])
        view = rows.row(row)
        released: list[int] = []
        for i in range(last - 1, -1, -1):
            page = int(view[i])
            if page == NULL_PAGE:
                break
            released.append(page)
            rows.set_page(row, i, NULL_PAGE)
        if released:
            self.pool.free(released)

    def cache(
        self,
        request_id: str,
        num_tokens: int,
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None,
        reserved: EventPlace | None = None,
    ) -> None:
        """Enter the request's newly full pages (up to ``num_tokens``) into the index
        (``extra_keys``: the request's, None when it has none; ``reserved``: the place of
        its ``stored`` event, held when its caching was deferred)."""
        if not self.is_cacheable:
            return
        num_cached = self.num_cached_pages.get(request_id, 0)
        num_full = min(num_tokens // self.page_size, len(hashes))
        if num_full <= num_cached:
            return
        row = self.request_rows[request_id]
        pages = self.rows.row(row)[num_cached:num_full].tolist()
        ps = self.page_size
        self.pool.cache(
            self.group_id,
            pages,
            hashes[num_cached:num_full],
            parent_hash=hashes[num_cached - 1] if num_cached else None,
            token_ids=token_ids[num_cached * ps : num_full * ps],
            page_size=ps,
            lora_name=None if extra_keys is None else extra_keys.lora_name,
            extra_keys=extra_keys,
            first_page=num_cached,
            reserved=reserved,
        )
        self.num_cached_pages[request_id] = num_full

    def cache_next(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None,
    ) -> None:
        """Enter the request's next full page into the index (``cache`` for the one page a
        decode fills; the hashes already cover it)."""
        k = self.num_cached_pages[request_id]
        ps = self.page_size
        self.pool.cache_one(
            self.group_id,
            self.rows.page(self.request_rows[request_id], k),
            hashes[k],
            parent_hash=hashes[k - 1] if k else None,
            token_ids=token_ids[k * ps : (k + 1) * ps],
            page_size=ps,
            lora_name=None if extra_keys is None else extra_keys.lora_name,
            extra_keys=extra_keys,
            first_page=k,
        )
        self.num_cached_pages[request_id] = k + 1

    def free(self, request_id: str) -> None:
        """Release the request's pages, last to first (leading null pages dropped)."""
        row = self.request_rows.pop(request_id, None)
        self.num_cached_pages.pop(request_id, None)
        self.page_counts.pop(request_id, None)
        if row is None:
            return
        pages = self.rows.row(row)[::-1]
        self.pool.free(pages)
        self.rows.release_row(row)


class SlidingWindowManager(GroupManager):
    """Attention over the last ``window`` tokens."""

    def __init__(self, group_id: int, config: GroupConfig, pool: PagePool, max_model_len: int):
        super().__init__(group_id, config, pool, max_model_len)
        assert config.window is not None
        self.window = config.window
        # Consecutive cached pages a hit needs to cover the window before the next token.
        self.contiguous_pages = max(cdiv(self.window - 1, self.page_size), 1)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1)

    def find_cache_hit(self, hashes: Sequence[bytes], max_length: int) -> list[int]:
        # Scan right to left for enough consecutive cached pages; everything before them
        # is outside the window, so the null page stands in for it.
        max_pages = min(max_length // self.page_size, len(hashes))
        hit = [NULL_PAGE] * max_pages
        lookup, group_id, need = self.pool.lookup, self.group_id, self.contiguous_pages
        run = 0
        for i in range(max_pages - 1, -1, -1):
            page = lookup(group_id, hashes[i])
            if page is None:
                run = 0
                continue
            hit[i] = page
            run += 1
            if run >= need:
                return hit[: i + run]
        # No full window anywhere: only a run starting at page 0 is usable.
        return hit[:run]


class ChunkedLocalManager(GroupManager):
    """Attention within fixed chunks of ``chunk`` tokens."""

    def __init__(self, group_id: int, config: GroupConfig, pool: PagePool, max_model_len: int):
        super().__init__(group_id, config, pool, max_model_len)
        assert config.chunk is not None
        self.chunk = config.chunk

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk) * self.chunk

    def find_cache_hit(self, hashes: Sequence[bytes], max_length: int) -> list[int]:
        # Pages before the chunk that holds the next token are never read again: null.
        start = (max_length // self.chunk) * self.chunk // self.page_size
        max_pages = min(max_length // self.page_size, len(hashes))
        hit = [NULL_PAGE] * min(start, max_pages)
        lookup, group_id = self.pool.lookup, self.group_id
        for i in range(len(hit), max_pages):
            page = lookup(group_id, hashes[i])
            if page is None:
                break
            hit.append(page)
        return hit


class MambaManager(GroupManager):
    """State-space layers. Without state caching a request holds exactly one state page
    (its table has one entry). With ``enable_state_caching`` the state after each full
    page is kept under that page's hash, and only the live state page stays with the
    request (the earlier ones go back to the pool, still hittable until reused)."""

    def __init__(self, group_id: int, config: GroupConfig, pool: PagePool, max_model_len: int):
        self.is_state_cached = config.enable_state_caching
        super().__init__(group_id, config, pool, max_model_len)

    def _max_pages(self, max_model_len: int) -> int:
        return cdiv(max_model_len, self.page_size) if self.is_state_cached else 1

    @property
    def is_cacheable(self) -> bool:
        return self.is_state_cached

    def num_required_pages(self, num_tokens: int) -> int:
        if self.is_state_cached:
            return cdiv(num_tokens, self.page_size)
        return 1 if num_tokens > 0 else 0

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1) if self.is_state_cached else 0

    def find_cache_hit(self, hashes: Sequence[bytes], max_length: int) -> list[int]:
        if not self.is_state_cached:
            return []
        # Only the newest state matters: the rightmost cached page.
        max_pages = min(max_length // self.page_size, len(hashes))
        lookup, group_id = self.pool.lookup, self.group_id
        for i in range(max_pages - 1, -1, -1):
            page = lookup(group_id, hashes[i])
            if page is not None:
                return [NULL_PAGE] * i + [page]
        return []


def make_group_manager(
    group_id: int, config: GroupConfig, pool: PagePool, max_model_len: int
) -> GroupManager:
    kinds: dict[GroupKind, type[GroupManager]] = {
        GroupKind.FULL: GroupManager,
        GroupKind.SLIDING_WINDOW: SlidingWindowManager,
        GroupKind.CHUNKED_LOCAL: ChunkedLocalManager,
        GroupKind.MAMBA: MambaManager,
    }
    return kinds[config.kind](group_id, config, pool, max_model_len)
