"""The page pool: free-queue order, eviction, touch, and the integrity check."""

from __future__ import annotations

import numpy as np
import pytest

from pagekeeper.core.errors import InvalidArgument, InvariantViolation
from pagekeeper.core.events import AllCleared, PageRemoved, PageStored
from pagekeeper.core.pool import PagePool

# Every test runs with the pool's C loops (where built) and with its Python loops.
pytestmark = pytest.mark.usefixtures("pool_loops")


def cache(pool: PagePool, pages: list[int], tag: bytes = b"h") -> None:
    pool.cache(
        0,
        pages,
        [tag + bytes([p]) for p in pages],
        parent_hash=None,
        token_ids=list(range(len(pages))),
        page_size=1,
        lora_name=None,
    )


def make(n: int = 10) -> PagePool:
    pool = PagePool(n)
    pool.ensure_groups(1)
    return pool


def test_initial_queue_excludes_null_page():
    pool = make()
    assert pool.free_queue() == list(range(1, 10))
    assert pool.num_free_pages == 9
    assert pool.usage() == 0.0
    assert pool.check_invariants() == []


def test_allocate_takes_from_head_in_order():
    pool = make()
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(1) == [4]
    assert pool.free_queue() == [5, 6, 7, 8, 9]
    assert [pool.ref_count(p) for p in (1, 2, 3, 4, 5)] == [1, 1, 1, 1, 0]
    assert pool.usage() == pytest.approx(4 / 9)


def test_free_unhashed_to_head_as_one_run_last_to_first():
    pool = make()
    pages = pool.allocate(4)  # 1 2 3 4
    pool.free(pages[::-1])
    assert pool.free_queue() == [4, 3, 2, 1, 5, 6, 7, 8, 9]


def test_free_hashed_to_tail_in_given_order_and_mixed_split():
    pool = make()
    pages = pool.allocate(4)  # 1 2 3 4
    cache(pool, [1, 2])  # 3 and 4 stay unhashed (a partial page, say)
    pool.free(pages[::-1])  # order 4 3 2 1
    assert pool.free_queue() == [4, 3, 5, 6, 7, 8, 9, 2, 1]
    assert pool.check_invariants() == []


def test_shared_page_stays_out_of_queue_until_last_reference():
    pool = make()
    pages = pool.allocate(2)
    pool.touch([1])
    pool.free(pages[::-1])
    assert 1 not in pool.free_queue() and pool.ref_count(1) == 1
    pool.free([1])
    assert pool.free_queue()[0] == 1


def test_lazy_eviction_hash_survives_free_until_reuse():
    pool = make(4)  # pages 1 2 3
    pages = pool.allocate(3)
    cache(pool, pages)
    pool.take_events()
    pool.free(pages[::-1])  # all hashed -> tail in order 3 2 1
    assert pool.free_queue() == [3, 2, 1]
    assert pool.lookup(0, b"h\x02") == 2  # still hittable
    got = pool.allocate(2)  # takes 3 and 2, evicting both
    assert got == [3, 2]
    assert pool.lookup(0, b"h\x02") is None and pool.lookup(0, b"h\x01") == 1
    events = pool.take_events()
    assert [e.page_ids for e in events if isinstance(e, PageRemoved)] == [(3, 2)]  # one event a run
    assert pool.num_evictions == 2


def test_touch_removes_free_cached_page_from_middle():
    pool = make()
    pages = pool.allocate(3)
    cache(pool, pages)
    pool.free(pages[::-1])  # queue: 4..9, 3, 2, 1
    pool.touch([2])
    assert pool.free_queue() == [4, 5, 6, 7, 8, 9, 3, 1]
    assert pool.ref_count(2) == 1
    assert pool.check_invariants() == []
    # Holes in the run are skipped when taking many pages at once.
    taken = pool.allocate(8)
    assert taken == [4, 5, 6, 7, 8, 9, 3, 1]
    assert pool.check_invariants() == []


def test_duplicate_hashes_first_inserted_wins_then_next():
    pool = make()
    a = pool.allocate(1)
    b = pool.allocate(1)
    pool.cache(0, a, [b"x"], parent_hash=None, token_ids=[1], page_size=1, lora_name=None)
    pool.cache(0, b, [b"x"], parent_hash=None, token_ids=[1], page_size=1, lora_name=None)
    assert pool.lookup(0, b"x") == a[0]
    pool.free(a)
    pool.allocate(pool.num_free_pages)  # evicts a, whichever position it is in
    assert pool.lookup(0, b"x") == b[0]
    assert pool.check_invariants() == []


def test_stored_event_fields():
    pool = make()
    pages = pool.allocate(2)
    pool.cache(
        0,
        pages,
        [b"a", b"b"],
        parent_hash=b"p",
        token_ids=[1, 2, 3, 4],
        page_size=2,
        lora_name="lora",
    )
    (event,) = pool.take_events()
    assert isinstance(event, PageStored)
    assert event.page_hashes == (b"a", b"b") and event.parent_page_hash == b"p"
    assert event.token_ids == (1, 2, 3, 4) and event.page_size == 2
    assert event.lora_name == "lora" and event.page_ids == tuple(pages) and event.seq == 1
    assert pool.take_events() == []


def test_reset_only_when_nothing_is_held():
    pool = make()
    pages = pool.allocate(2)
    cache(pool, pages)
    assert pool.reset_prefix_cache() is False
    pool.free(pages[::-1])
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_pages == 0 and pool.lookup(0, b"h\x01") is None
    assert isinstance(pool.take_events()[0], AllCleared)
    assert pool.check_invariants() == []


def test_allocate_more_than_free_is_refused_without_change():
    pool = make(4)
    with pytest.raises(InvalidArgument):
        pool.allocate(4)
    assert pool.free_queue() == [1, 2, 3]


def test_double_free_is_an_invariant_violation():
    pool = make()
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(InvariantViolation):
        pool.free(pages)


def test_recentering_keeps_order_under_long_churn():
    rng = np.random.default_rng(0)
    pool = make(50)
    held: list[list[int]] = []
    for step in range(3000):
        if held and (rng.random() < 0.5 or pool.num_free_pages < 20):
            pages = held.pop(int(rng.integers(len(held))))
            if rng.random() < 0.5:
                cache(pool, pages[:1], tag=b"s" + step.to_bytes(4, "big"))
            pool.free(pages[::-1])
        else:
            held.append(pool.allocate(int(rng.integers(1, 20))))
    assert pool.check_invariants() == []
    assert pool.num_free_pages + sum(map(len, held)) == 49


def test_check_invariants_reports_corruption():
    pool = make()
    pool.allocate(2)
    pool._state[5] = 6  # corrupt: page 5 is queued with a non-zero ref count
    problems = pool.check_invariants()
    assert any("free-queue membership" in p for p in problems)


def test_memory_per_page_is_small():
    pool = PagePool(1 << 20)
    assert pool.nbytes() / pool.num_pages <= 32


def test_cached_free_pages_keep_their_cell_and_stale_cells_are_never_read():
    """Positions are kept for cached free pages only (a hit takes them from the middle);
    the cells a taken page leaves behind are stale and must not matter."""
    pool = make(12)
    a = pool.allocate(4)  # 1..4
    b = pool.allocate(3)  # 5..7
    cache(pool, a)
    pool.free(a[::-1])  # cached: to the tail, positions kept
    pool.free(b[::-1])  # uncached: to the head, no positions
    assert pool.free_queue() == [7, 6, 5, 8, 9, 10, 11, 4, 3, 2, 1]
    assert pool.check_invariants() == []
    pool.touch([3])  # a hit on a cached free page: a hole where it was
    assert pool.free_queue() == [7, 6, 5, 8, 9, 10, 11, 4, 2, 1]
    got = pool.allocate(9)  # runs over the hole; evicts 4 and 2 on the way
    assert got == [7, 6, 5, 8, 9, 10, 11, 4, 2]
    assert pool.free_queue() == [1] and pool.check_invariants() == []
    pool.free([9])
    pool.free([7])  # uncached pages back in front of the stale cells they left
    assert pool.free_queue() == [7, 9, 1] and pool.check_invariants() == []


def test_touch_of_a_free_page_without_a_hash_still_finds_it():
    pool = make(8)
    pages = pool.allocate(3)
    pool.free(pages[::-1])  # uncached, at the head: 3, 2, 1, 4, ...
    pool.touch([2])  # not a prefix hit (no hash), but a valid call: searched for
    assert pool.ref_count(2) == 1 and 2 not in pool.free_queue()
    assert pool.free_queue() == [3, 1, 4, 5, 6, 7] and pool.check_invariants() == []


def test_only_held_pages_are_cached():
    pool = make(8)
    page = pool.allocate(1)
    pool.free(page)
    with pytest.raises(InvariantViolation, match="free"):
        cache(pool, page)
    many = pool.allocate(6)
    pool.free(many[-1:])
    with pytest.raises(InvariantViolation, match="free"):
        cache(pool, many)  # the bulk path: one of them is free
    assert pool.num_cached_pages == 0 and pool.check_invariants() == []


def test_check_invariants_reports_a_lost_position():
    pool = make()
    pages = pool.allocate(2)
    cache(pool, pages)
    pool.free(pages[::-1])
    pool._index_positions()  # (a hit would: freeing leaves positions to the first hit)
    pool._pos[pages[0]] = pool._head  # corrupt: the cached free page points elsewhere
    assert any("position" in p for p in pool.check_invariants())


def test_positions_are_written_when_a_hit_needs_them_and_stale_ones_are_caught():
    """Freeing leaves cached pages' positions unwritten (from ``indexed`` to the tail);
    a hit that needs one writes the stretch. A position left from an earlier stay in the
    queue may point at a cell that now holds another page: the hit must not trust it."""
    pool = make(16)
    a = pool.allocate(2)  # 1, 2
    b = pool.allocate(2)  # 3, 4
    cache(pool, a)
    cache(pool, b, tag=b"b")
    tail = pool._tail
    pool.free(a[::-1])  # ... 2 1 at cells tail, tail+1; positions not written
    assert pool._indexed == tail < pool._tail and pool.check_invariants() == []
    pool.touch(a)  # a run at the tail: indexes, then the queue ends before it
    assert pool._tail == tail and pool._indexed == tail and pool.ref_count(1) == 1
    pool.free(b[::-1])  # b takes a's old cells: pos[2] still says ``tail``, which holds 4
    pool.free(a[::-1])  # a goes after b
    assert pool._buf[tail] == 4 and pool._pos[2] == tail
    pool.touch(a)  # the stale position is caught, the stretch indexed, a taken
    assert [pool.ref_count(p) for p in (1, 2, 3, 4)] == [1, 1, 0, 0]
    assert pool.free_queue()[-2:] == [4, 3] and pool.check_invariants() == []
    pool.free(a[::-1])
    pool.touch([3])  # one page from the middle (page by page): b's cells are indexed
    pool.touch([1])
    assert [pool.ref_count(p) for p in (1, 2, 3, 4)] == [1, 0, 1, 0]
    assert pool.free_queue()[-2:] == [4, 2] and pool.check_invariants() == []


def test_free_of_cached_pages_held_once_undoes_its_pass_when_one_is_not():
    """The one-run pass over a free sets each state as it goes; a page that breaks it (a
    duplicate, a shared page, a page without a hash) sends the whole free down the general
    path with every state as it was."""
    pool = make(12)
    a = pool.allocate(4)  # 1..4
    cache(pool, a)
    pool.touch([2])  # page 2 shared by another request
    pool.free(a[::-1])  # 4 3 reach 0, 2 does not, 1 reaches 0
    assert [pool.ref_count(p) for p in a] == [0, 1, 0, 0]
    assert pool.free_queue()[-3:] == [4, 3, 1] and pool.check_invariants() == []
    b = pool.allocate(3)
    cache(pool, b, tag=b"b")
    with pytest.raises(InvariantViolation, match="ref count 0"):
        pool.free([b[2], b[1], b[2], b[0]])  # b[2] listed twice, held once
    assert [pool.ref_count(p) for p in b] == [1, 0, 0]
    assert pool.check_invariants() == []


def test_touch_takes_a_run_freed_together_at_the_tail_or_in_the_middle():
    """A hit on a finished request's prefix finds its pages as one run of the queue (they
    were freed together, last page first) and takes them in one go: at the tail the queue
    just ends earlier, in the middle the cells become holes."""
    pool = make(16)
    a = pool.allocate(4)  # 1..4
    cache(pool, a)
    pool.free(a[::-1])  # tail: ... 4 3 2 1
    pool.touch(a[:3])  # pages 1, 2, 3 lie at the tail as 3 2 1
    assert [pool.ref_count(p) for p in a] == [1, 1, 1, 0]
    assert pool.free_queue()[-2:] == [15, 4] and pool.num_free_pages == 12
    assert pool._buf[pool._tail - 1] == 4  # taken from the tail: no holes left behind
    assert pool.check_invariants() == []
    pool.free(a[2::-1])  # back to the tail: ... 4 3 2 1
    b = pool.allocate(2)  # 5, 6
    cache(pool, b, tag=b"b")
    pool.free(b[::-1])  # ... 4 3 2 1 6 5: a's run is now in the middle
    pool.touch(a[:2])  # 2 1 in the middle: holes
    assert pool.free_queue()[-5:] == [15, 4, 3, 6, 5]
    assert pool.ref_count(1) == pool.ref_count(2) == 1 and pool.num_free_pages == 13
    assert pool.check_invariants() == []
    # Not a run in queue order (3 then 5 are apart): page by page.
    pool.touch([3, 5])
    assert pool.free_queue()[-3:] == [15, 4, 6] and pool.check_invariants() == []
    assert all(pool.is_cached(p) for p in (1, 2, 3, 5))


def test_touch_with_null_pages_and_shared_pages_falls_back_page_by_page():
    pool = make(12)
    a = pool.allocate(3)  # 1, 2, 3
    cache(pool, a)
    pool.free(a[::-1])
    # A sliding-window hit: the null page first, then pages 2 and 3 (a run 3 2 in the queue).
    pool.touch([0, 2, 3])
    assert [pool.ref_count(p) for p in (0, 1, 2, 3)] == [0, 0, 1, 1]
    pool.touch([2, 3])  # already held: ref count +1, nothing leaves the queue
    assert pool.ref_count(2) == pool.ref_count(3) == 2 and pool.num_free_pages == 9
    assert pool.check_invariants() == []


def test_free_of_a_page_listed_as_often_as_it_is_held_queues_it_once():
    pool = make(10)
    a = pool.allocate(3)  # 1, 2, 3
    cache(pool, a[:2])
    pool.touch([2])  # page 2 held twice
    pool.free([3, 2, 2, 1])  # mixed: 3 uncached, 2 and 1 cached
    assert pool.free_queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert pool.check_invariants() == []


def test_free_after_a_bad_page_keeps_the_pool_sound():
    pool = make(10)
    a = pool.allocate(3)
    pool.free([a[2]])
    with pytest.raises(InvariantViolation, match="ref count 0"):
        pool.free([a[0], a[2], a[1]])  # a[2] is already free
    assert pool.ref_count(a[0]) == 0 and pool.ref_count(a[1]) == 1
    assert pool.check_invariants() == []


def test_check_invariants_reports_an_uncached_page_queued_after_a_cached_one():
    pool = make(8)
    a = pool.allocate(2)
    cache(pool, a)
    pool.free(a[::-1])  # queue: 3 4 5 6 7 2 1
    tail = pool._tail
    pool._buf[tail - 2], pool._buf[tail - 3] = pool._buf[tail - 3], pool._buf[tail - 2]
    pool._pos[2] = tail - 3
    problems = pool.check_invariants()
    assert any("uncached page is queued after a cached one" in p for p in problems)


def test_ref_count_array_small_and_large_counts():
    pool = make(8)
    a = pool.allocate(3)
    pool.touch([a[0]])
    assert pool.ref_count_array().tolist() == [0, 2, 1, 1, 0, 0, 0, 0]
    for _ in range(200):  # a state past 255: the slower conversion
        pool.touch([a[1]])
    got = pool.ref_count_array()
    assert got.dtype == np.int32 and got.tolist() == [0, 2, 201, 1, 0, 0, 0, 0]
    assert pool.count_free([0, a[0], 4, 5]) == 2 and pool.check_invariants() == []


def test_free_of_nothing_changes_nothing():
    pool = make(8)
    pool.allocate(2)
    before = pool.free_queue()
    pool.free([])
    pool.free(np.array([], dtype=np.int32))
    assert pool.free_queue() == before and pool.num_free_pages == 5
    assert pool.check_invariants() == []


def test_a_mixed_free_writes_positions_at_once_and_keeps_the_index_at_the_tail():
    """The general free path (a partial last page, or pages others still hold) writes the
    cached pages' positions as it queues them; with nothing unindexed before them, no hit
    has to index anything."""
    pool = make(12)
    a = pool.allocate(3)  # 1, 2, 3: page 3 stays uncached (a partial page)
    cache(pool, a[:2])
    pool.free(a[::-1])  # 3 to the head; 2 1 to the tail, positions written
    assert pool._indexed == pool._tail
    assert pool._pos[2] == pool._tail - 2 and pool._pos[1] == pool._tail - 1
    b = pool.allocate(2)  # the head: 3, then 4
    cache(pool, b, tag=b"b")
    pool.free(b[::-1])  # all cached: queued without positions
    assert pool._indexed == pool._tail - 2
    c = pool.allocate(2)  # 5, 6
    cache(pool, c[:1], tag=b"c")
    pool.free(c[::-1])  # mixed again, after an unindexed run: the index mark stays put
    assert pool._indexed == pool._tail - 3 and pool.check_invariants() == []
    pool.touch([1])  # from the middle: indexes the stretch
    assert pool._indexed == pool._tail and pool.check_invariants() == []


def test_free_of_uncached_pages_with_one_listed_twice_or_shared():
    pool = make(10)
    a = pool.allocate(3)  # 1, 2, 3, uncached
    pool.touch([a[1]])  # page 2 held twice
    pool.free([a[1], a[1]])  # as often as held: queued once, at the head
    assert pool.free_queue()[:1] == [2] and pool.ref_count(2) == 0
    with pytest.raises(InvariantViolation, match="ref count 0"):
        pool.free([a[2], a[0], a[2]])  # 3 listed twice, held once
    assert pool.ref_count(1) == 0 and pool.ref_count(3) == 0
    assert pool.free_queue()[:3] == [3, 1, 2] and pool.check_invariants() == []


def test_eviction_of_a_run_with_and_without_duplicate_hashes_in_its_group():
    """A run of one group whose hashes have no duplicates anywhere in the group is evicted
    in bulk; while the group holds a duplicate hash, page by page (the waiting duplicate is
    promoted). Both give one removed event per run, in allocation order."""
    pool = make(10)
    a = pool.allocate(3)  # 1, 2, 3
    cache(pool, a)
    pool.free(a[::-1])  # tail: 3 2 1
    pool.take_events()
    pool.allocate(6)  # 4..9: uncached, nothing evicted
    got = pool.allocate(2)  # 3, 2: the bulk path
    assert got == [3, 2] and pool.lookup(0, b"h\x03") is None and pool.lookup(0, b"h\x01") == 1
    (removed,) = pool.take_events()
    assert isinstance(removed, PageRemoved)
    assert removed.page_ids == (3, 2) and removed.page_hashes == (b"h\x03", b"h\x02")
    assert pool.check_invariants() == []

    pool = make(10)
    a = pool.allocate(3)  # 1, 2, 3
    cache(pool, a)
    b = pool.allocate(1)  # 4, held, caches page 2's hash too: a duplicate
    pool.cache(0, b, [b"h\x02"], parent_hash=None, token_ids=[], page_size=1, lora_name=None)
    pool.free(a[::-1])  # tail: 3 2 1
    pool.take_events()
    pool.allocate(5)  # 5..9
    assert pool.allocate(3) == [3, 2, 1]  # page by page: page 4 takes over h2
    assert pool.lookup(0, b"h\x02") == 4 and pool.lookup(0, b"h\x01") is None
    (removed,) = pool.take_events()
    assert isinstance(removed, PageRemoved) and removed.page_ids == (3, 2, 1)
    assert removed.page_hashes == (b"h\x03", b"h\x02", b"h\x01")
    assert pool.check_invariants() == []


def test_lifetime_counters_count_allocations_and_frees():
    pool = make(10)
    a = pool.allocate(3)
    cache(pool, a)
    pool.free(a[::-1])  # 3 freed
    pool.touch(a[:2])  # 2 taken back by a hit: not allocations
    pool.free([a[1]])
    assert (pool.num_allocated_total, pool.num_freed_total) == (3, 4)
    b = pool.allocate(2)
    pool.touch([b[0]])  # held twice: a hit on a held page takes nothing from the queue
    pool.free([b[0], b[0], b[1]])
    assert (pool.num_allocated_total, pool.num_freed_total) == (5, 6)
    twin = make(10)
    twin.allocate(1)
    twin.restore_totals(pool.num_allocated_total, pool.num_freed_total)
    assert (twin.num_allocated_total, twin.num_freed_total) == (5, 6)


def test_hits_after_a_recentre_find_their_pages_again():
    """Re-centring moves every queued page and writes no position: the next hit that needs
    one indexes the run, whether it takes a run or one page from the middle."""
    pool = make(10)
    capacity = len(pool._buf)
    recentres = []
    recentre = pool._recenter
    pool._recenter = lambda: (recentres.append(1), recentre())[1]  # type: ignore[method-assign]
    runs = []
    for step in range(capacity):  # each round queues 3 cached cells at the tail
        pages = pool.allocate(3)
        cache(pool, pages, tag=b"r" + step.to_bytes(2, "big"))
        pool.free(pages[::-1])
        runs.append(pages)
    assert recentres and pool._indexed < pool._tail  # re-centred: positions unknown
    assert pool.check_invariants() == []
    last = runs[-1]
    pool.touch(last[:2])  # a run (in the queue as 3 2 1 of the last round)
    middle = pool.free_queue()[len(pool.free_queue()) // 2]
    pool.touch([middle])  # one page from the middle
    assert [pool.ref_count(p) for p in (*last[:2], middle)] == [1, 1, 1]
    assert pool._indexed == pool._tail and pool.check_invariants() == []


@pytest.mark.parametrize("with_duplicate", [False, True], ids=["bulk", "duplicate"])
def test_allocate_each_equals_one_page_allocations_in_order(with_duplicate):
    """allocate_each(k) (a decode step's crossings) takes the pages, evicts, counts and
    reports exactly as k calls of allocate(1): one removed event per evicted page, also
    when a held page's duplicate hash is promoted, and across a hole in the queue."""

    def scenario(pool: PagePool) -> None:
        a = pool.allocate(4)  # 1..4
        cache(pool, a)
        if with_duplicate:
            b = pool.allocate(1)  # 5 (held) shares page 2's hash
            pool.cache(
                0, b, [b"h\x02"], parent_hash=None, token_ids=[], page_size=1, lora_name=None
            )
        pool.free(a[::-1])  # tail: 4 3 2 1
        pool.touch([3])  # a hit takes 3 out of the middle: a hole in the queue
        pool.take_events()

    one, each = make(12), make(12)
    scenario(one)
    scenario(each)
    num = one.num_free_pages - 1
    want = [one.allocate(1)[0] for _ in range(num)]
    assert each.allocate_each(num) == want
    events = each.take_events()
    assert events == one.take_events()
    assert [e.page_ids for e in events] == [(4,), (2,)]  # 6..11 first, 3 taken by the hit
    assert each.free_queue() == one.free_queue()
    assert (each.num_evictions, each.num_allocated_total) == (
        one.num_evictions,
        one.num_allocated_total,
    )
    for tag in (1, 2, 3, 4):
        assert each.lookup(0, b"h" + bytes([tag])) == one.lookup(0, b"h" + bytes([tag]))
    assert each.check_invariants() == []
    assert each.allocate_each(0) == []
    with pytest.raises(InvalidArgument, match="cannot allocate"):
        each.allocate_each(each.num_free_pages + 1)
    assert each.free_queue() == one.free_queue()


def test_allocate_each_reports_each_evicted_page_on_its_own():
    pool = make(6)
    a = pool.allocate(3)  # 1, 2, 3
    cache(pool, a)
    pool.free(a)  # tail: 1 2 3
    pool.allocate(2)  # 4, 5: uncached
    pool.take_events()
    assert pool.allocate_each(3) == [1, 2, 3]
    events = pool.take_events()
    assert [(e.page_ids, e.page_hashes) for e in events] == [
        ((1,), (b"h\x01",)),
        ((2,), (b"h\x02",)),
        ((3,), (b"h\x03",)),
    ]
    assert all(isinstance(e, PageRemoved) for e in events)
    assert pool.check_invariants() == []
