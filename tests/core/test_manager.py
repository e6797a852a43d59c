"""Scenario tests that pin exact page ids and eviction order (DESIGN §2), written by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.errors import AlreadyExists, ConfigError, InvalidArgument, NotFound
from pagekeeper.core.events import AllCleared, PageRemoved, PageStored
from pagekeeper.core.manager import (
    CheckedPageHashes,
    CheckedTokens,
    PageManager,
    check_page_hashes,
    check_token_ids,
)
from pagekeeper.core.types import ExtraKeys

PS = 4

# Every test runs with the pool's C loops (where built) and with its Python loops.
pytestmark = pytest.mark.usefixtures("pool_loops")


def full(num_pages: int = 11, caching: bool = True, max_model_len: int = 64) -> PageManager:
    return PageManager(
        PoolConfig(
            num_pages=num_pages,
            groups=(GroupConfig(GroupKind.FULL, PS),),
            enable_prefix_caching=caching,
            max_model_len=max_model_len,
        )
    )


def pages(m: PageManager, rid: str, group: int = 0) -> list[int]:
    return m.page_table(rid, group).tolist()


def test_fill_share_free_evict_reuse():
    m = full()  # pages 1..10, 4 tokens each
    a = m.admit("a", list(range(10)))  # 3 pages: 2 full + a partial
    assert a.new_page_ids == ((1, 2, 3),) and a.num_cached_tokens == 0
    # b shares a's first 8 tokens: the two full pages are hits.
    b = m.admit("b", list(range(8)) + [99, 98, 97])
    assert b.num_cached_tokens == 8 and b.hit_page_ids == ((1, 2),)
    assert b.new_page_ids == ((4,),)
    assert m.pool.ref_count(1) == 2
    # Freeing a: page 3 (partial, unhashed) to the head; 1, 2 still held by b.
    m.free("a")
    assert m.pool.free_queue() == [3, 5, 6, 7, 8, 9, 10]
    # Freeing b: 4 (partial) to the head, then 2, 1 (cached) to the tail, last page first.
    m.free("b")
    assert m.pool.free_queue() == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
    m.check_invariants()
    # c needs 7 pages: takes 4 3 5 6 7 8 9 without evicting anything cached.
    c = m.admit("c", [50 + i for i in range(26)])
    assert c.new_page_ids == ((4, 3, 5, 6, 7, 8, 9),)
    assert [e for e in m.take_events() if isinstance(e, PageRemoved)] == []
    # d needs 2 more: page 10, then 2 (cached: evicted, LRU order = a's last page first).
    d = m.admit("d", [200 + i for i in range(5)])
    assert d.new_page_ids == ((10, 2),)
    removed = [e for e in m.take_events() if isinstance(e, PageRemoved)]
    assert [e.page_ids for e in removed] == [(2,)]
    # Page 1 is still cached: a prompt starting like a's hits it.
    e = m.admit("e", list(range(4)) + [7])
    assert e is None  # no free page left for its partial page
    m.check_invariants()
    m.free("c")
    e = m.admit("e", list(range(4)) + [7])
    assert e.hit_page_ids == ((1,),) and e.num_cached_tokens == 4


def test_prompt_last_token_is_never_a_hit():
    m = full()
    m.admit("a", list(range(8)))  # exactly two full pages, both cached
    m.free("a")
    b = m.admit("b", list(range(8)))
    assert b.num_cached_tokens == 4  # the second page holds the last token: recomputed
    assert m.lookup(list(range(8))).num_hit_tokens == 8  # a router's lookup sees both


def test_hit_pages_in_free_queue_count_against_capacity():
    m = full(num_pages=4)  # 3 pages
    m.admit("a", list(range(8)) + [1])  # pages 1 2 3
    m.free("a")  # queue: 3, 2, 1 ... (3 unhashed to head; 2, 1 tail) -> [3, 2, 1]
    assert m.pool.free_queue() == [3, 2, 1]
    # 9 tokens: 2 hit pages (both free) + 1 new = all 3 free pages: fits exactly.
    b = m.admit("b", list(range(8)) + [5])
    assert b is not None and b.new_page_ids == ((3,),) and b.hit_page_ids == ((1, 2),)
    m.free("b")
    # 13 tokens with the same prefix: 2 hits + 2 new = 4 > 3 free: refused, nothing changed.
    before = m.pool.free_queue()
    assert m.admit("c", list(range(8)) + [5, 6, 7, 8, 9]) is None
    assert m.pool.free_queue() == before and not m.has_request("c")
    m.check_invariants()


def test_decode_fills_page_then_caches_it():
    m = full()
    m.admit("a", [1, 2, 3])  # one page
    m.take_events()
    assert m.allocate("a", 1, new_token_ids=[4]).new_page_ids == ((),)
    stored = m.take_events()
    assert len(stored) == 1 and stored[0].token_ids == (1, 2, 3, 4)
    grown = m.allocate("a", 1, new_token_ids=[5])
    assert grown.new_page_ids == ((2,),)
    assert m.request_info("a").num_computed_tokens == 5


def test_lookahead_slots_allocated_not_cached():
    m = full()
    a = m.admit("a", [1, 2, 3], num_lookahead_tokens=3)  # 6 slots -> 2 pages
    assert a.new_page_ids == ((1, 2),)
    assert [e for e in m.take_events() if isinstance(e, PageStored)] == []


def test_chunked_prefill():
    m = full()
    a = m.admit("a", list(range(10)), num_new_tokens=4)
    assert a.new_page_ids == ((1,),)
    b = m.allocate("a", 6)
    assert b.new_page_ids == ((2, 3),)
    assert m.request_info("a").num_computed_tokens == 10


def test_caching_off_frees_everything_to_head():
    m = full(caching=False)
    m.admit("a", list(range(10)))
    m.free("a")
    assert m.pool.free_queue()[:3] == [3, 2, 1]
    assert m.admit("b", list(range(10))).num_cached_tokens == 0


def test_extra_keys_separate_caches():
    m = full()
    m.admit("a", list(range(9)), extra_keys=ExtraKeys(lora_name="x", lora_path="/x"))
    b = m.admit("b", list(range(9)))
    assert b.num_cached_tokens == 0
    c = m.admit("c", list(range(9)), extra_keys=ExtraKeys(lora_name="x", lora_path="/x"))
    assert c.num_cached_tokens == 8
    d = m.admit("d", list(range(9)), extra_keys=ExtraKeys(cache_salt="s"))
    assert d.num_cached_tokens == 0


def test_client_page_hashes_are_used():
    m = full()
    m.admit("a", list(range(9)), page_hashes=[b"H1", b"H2"])
    # Same hashes, different tokens: the client's hashes decide (vLLM's engine sends them).
    b = m.admit("b", [9] * 9, page_hashes=[b"H1", b"H2"])
    assert b.num_cached_tokens == 8


def test_page_hashes_are_checked_once():
    """check_page_hashes refuses what admit refuses (naming a repeated hash); what it
    returns passes through again unchanged, and admit takes it as the plain list."""
    with pytest.raises(InvalidArgument, match="non-empty bytes"):
        check_page_hashes([b"a", b""])
    with pytest.raises(InvalidArgument, match="non-empty bytes"):
        check_page_hashes([b"a", "b"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match=f"page hash {b'B'.hex()} repeats"):
        check_page_hashes([b"A", b"B", b"C", b"B"])
    checked = check_page_hashes([b"H1", b"H2"])
    assert type(checked) is CheckedPageHashes and checked == (b"H1", b"H2")
    assert check_page_hashes(checked) is checked
    m, n = full(), full()
    m.admit("a", list(range(9)), page_hashes=checked)
    n.admit("a", list(range(9)), page_hashes=[b"H1", b"H2"])
    assert m.lookup(list(range(9))) == n.lookup(list(range(9)))
    assert m.take_events() == n.take_events()


def test_checked_token_ids_are_kept_as_they_are():
    """check_token_ids refuses a negative id; what it returns is widened once and admit
    keeps that very array (the same pages, hashes and events as the plain ids)."""
    with pytest.raises(InvalidArgument, match="non-negative"):
        check_token_ids(np.array([3, -1, 4], dtype=np.int32))
    with pytest.raises(InvalidArgument, match="1-D integer array"):
        check_token_ids(np.zeros((2, 3), dtype=np.int32))
    for dtype in (np.int32, np.int64):
        checked = check_token_ids(np.arange(9, dtype=dtype))
        assert type(checked) is CheckedTokens and len(checked) == 9
        assert checked.array.typecode == "Q" and checked.array.tolist() == list(range(9))
    m, n = full(), full()
    kept = checked.array
    m.admit("a", checked)
    n.admit("a", list(range(9)))
    assert m._requests["a"].token_ids is kept
    assert pages(m, "a") == pages(n, "a") and m.take_events() == n.take_events()
    m.allocate("a", 1, new_token_ids=[9])  # the kept array grows as the request's own
    n.allocate("a", 1, new_token_ids=[9])
    assert kept.tolist() == list(range(10))
    assert m.lookup(list(range(10))) == n.lookup(list(range(10)))


def test_client_hashes_that_meet_their_completed_chain_are_refused():
    """The client names page 0 by the chain's second hash and page 1 by its first; the
    manager completes page 2 from the client's last hash, which gives the second again.
    Both would hit the same cached page: refused, and nothing changes."""
    m = PageManager(
        PoolConfig(num_pages=4, groups=(GroupConfig(GroupKind.FULL, 2),), max_model_len=16)
    )
    m.admit("a", [7, 7, 7, 7])
    h0, h1 = m.lookup([7, 7, 7, 7]).page_hashes
    before = (m.pool.free_queue(), pages(m, "a"), m.pool.num_cached_pages)
    with pytest.raises(InvalidArgument, match="repeat once the chain is completed"):
        m.admit("b", [7] * 7, page_hashes=[h1, h0])
    assert not m.has_request("b")
    assert (m.pool.free_queue(), pages(m, "a"), m.pool.num_cached_pages) == before
    m.check_invariants()


def test_reset_prefix_cache():
    m = full()
    m.admit("a", list(range(9)))
    assert m.reset_prefix_cache() is False
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert any(isinstance(e, AllCleared) for e in m.take_events())
    assert m.admit("b", list(range(9))).num_cached_tokens == 0


def test_forget_prefix_cache_with_running_requests():
    """A worker whose KV cache holds nothing joined: the held pages' hashes go too (no hit
    on them), they stay their requests', and what the requests fill later is cached."""
    m = full()
    m.admit("a", list(range(9)))  # 2 full pages cached, held
    m.admit("x", list(range(50, 58)))
    m.free("x")  # 2 cached pages, free
    m.take_events()
    assert m.reset_prefix_cache() is False
    held = pages(m, "a")
    assert m.forget_prefix_cache() == 4
    assert [type(e) for e in m.take_events()] == [AllCleared]
    assert m.pool.num_cached_pages == 0 and pages(m, "a") == held
    assert m.lookup(list(range(9))).num_hit_tokens == 0
    assert m.lookup(list(range(50, 58))).num_hit_tokens == 0
    m.check_invariants()
    m.allocate("a", 4, new_token_ids=[9, 10, 11, 12])  # fills page 3: cached again
    assert m.lookup(list(range(13))).num_hit_tokens == 0  # the chain starts unhit
    assert m.pool.num_cached_pages == 1
    m.free("a")
    m.check_invariants()
    assert m.admit("b", list(range(9))).num_cached_tokens == 0


def test_bad_input_changes_nothing():
    m = full(max_model_len=16)
    m.admit("a", [1, 2, 3])
    snapshot = (m.pool.free_queue(), pages(m, "a"))
    with pytest.raises(AlreadyExists):
        m.admit("a", [1])
    with pytest.raises(InvalidArgument):
        m.admit("b", list(range(17)))
    with pytest.raises(InvalidArgument):
        m.admit("b", [])
    with pytest.raises(InvalidArgument):
        m.admit("b", [1, -2])
    with pytest.raises(InvalidArgument):
        m.admit("b", [1, 2], num_new_tokens=0)
    with pytest.raises(NotFound):
        m.allocate("zz", 1)
    with pytest.raises(InvalidArgument):
        m.allocate("a", 1, new_token_ids=list(range(14)))
    with pytest.raises(InvalidArgument):
        m.allocate("a", 0)
    with pytest.raises(NotFound):
        m.free("zz")
    assert (m.pool.free_queue(), pages(m, "a")) == snapshot
    assert not m.has_request("b")
    m.check_invariants()


def test_build_batch_expands_pages_and_maps_slots():
    m = full()
    m.admit("a", list(range(10)))  # pages 1 2 3
    m.admit("b", [7, 7, 7])  # page 4
    m.allocate("b", 1, new_token_ids=[8])
    (t,) = m.build_batch(["b", "a"], [2])
    assert t.block_table.dtype == np.int32 and t.slot_mapping.dtype == np.int64
    assert t.block_table.tolist() == [[8, 9, 0, 0, 0, 0], [2, 3, 4, 5, 6, 7]]
    assert t.row_lengths.tolist() == [2, 6]
    # b scheduled token 3 (page 4 slot 3); a scheduled tokens 0..9 on pages 1 2 3.
    assert t.slot_mapping.tolist() == [19, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    (t4,) = m.build_batch(["b", "a"], [4])
    assert t4.slot_mapping.tolist() == t.slot_mapping.tolist()


def test_build_batch_rows_running_ahead_of_the_manager():
    """A scheduler that holds back decodes needing no page says where its rows end."""
    m = full()
    m.admit("a", list(range(10)))  # pages 1 2 3 (slots 4..15), 10 computed
    m.admit("b", [7, 7, 7])  # page 4, 3 computed
    # a is one held decode ahead: its row schedules that one token (position 10, slot 14);
    # b (-1) keeps what it was last allocated for.
    (t,) = m.build_batch(["a", "b"], num_computed_tokens=[11, -1])
    assert t.slot_mapping.tolist() == [14, 16, 17, 18]
    (t,) = m.build_batch(["a", "b"], num_scheduled_tokens=[2, 1], num_computed_tokens=[12, 3])
    assert t.slot_mapping.tolist() == [14, 15, 18]
    with pytest.raises(InvalidArgument, match="behind"):
        m.build_batch(["a"], num_computed_tokens=[9])
    with pytest.raises(InvalidArgument):
        m.build_batch(["a"], num_computed_tokens=[13])  # position 12: past a's pages
    with pytest.raises(InvalidArgument, match="num_scheduled_tokens outside"):
        m.build_batch(["a"], num_scheduled_tokens=[13], num_computed_tokens=[12])


def sliding(num_pages: int = 30, window: int = 8) -> PageManager:
    return PageManager(
        PoolConfig(
            num_pages=num_pages,
            groups=(GroupConfig(GroupKind.SLIDING_WINDOW, PS, window=window),),
            max_model_len=128,
        )
    )


def test_sliding_window_releases_pages_that_left_the_window():
    m = sliding()
    m.admit("a", list(range(16)))  # 4 pages, computed 16
    assert pages(m, "a") == [1, 2, 3, 4]
    m.allocate("a", 1, new_token_ids=[0])
    # computed 16: skipped tokens = 16 - 8 + 1 = 9 -> 2 pages left the window.
    assert pages(m, "a") == [0, 0, 3, 4, 5]
    assert m.pool.free_queue()[-2:] == [2, 1]  # cached, to the tail, last to first
    m.check_invariants()


def test_build_batch_refuses_slots_in_pages_the_window_released():
    """A batch scheduling tokens whose pages the window already released would write their
    KV into the shared null page: refused, naming the row (later positions are fine)."""
    m = sliding()
    m.admit("a", list(range(16)))
    m.allocate("a", 1, new_token_ids=[0])  # table [0, 0, 3, 4, 5], 17 tokens
    with pytest.raises(InvalidArgument, match=r"'a'.*position 5.*already released"):
        m.build_batch(["a"], num_scheduled_tokens=[12])  # tokens 5..16: page 1 is null
    (t,) = m.build_batch(["a"], num_scheduled_tokens=[9])  # tokens 8..16: pages 3 4 5
    assert t.slot_mapping.tolist() == [12, 13, 14, 15, 16, 17, 18, 19, 20]
    (t,) = m.build_batch(["a"], num_scheduled_tokens=[0])  # nothing scheduled: no slot
    assert t.slot_mapping.tolist() == []
    # A row running ahead past its own pages is the range check's to refuse, with its
    # reason (not an IndexError, nor "released" from a wider row's padding).
    m.admit("b", list(range(40)))  # 10 pages: the gathered table is wider than a's
    for rows, ends in ((["a"], [30]), (["a", "b"], [30, -1])):
        with pytest.raises(InvalidArgument, match="row 0: positions up to 29 need page"):
            m.build_batch(rows, num_computed_tokens=ends)


def test_sliding_window_hit_needs_enough_contiguous_pages():
    m = sliding(window=8)  # needs cdiv(7, 4) = 2 contiguous pages
    m.admit("a", list(range(21)))
    m.free("a")
    b = m.admit("b", list(range(21)))  # max hit 20 tokens = 5 pages; window covers last 2
    assert b.num_cached_tokens == 20
    # Pages before the window are null in the table and were not touched.
    assert pages(m, "b")[:3] == [0, 0, 0]


def test_hybrid_full_plus_sliding_window_common_hit_and_order():
    m = PageManager(
        PoolConfig(
            num_pages=40,
            groups=(
                GroupConfig(GroupKind.FULL, PS),
                GroupConfig(GroupKind.SLIDING_WINDOW, PS, window=8),
            ),
            max_model_len=128,
        )
    )
    a = m.admit("a", list(range(10)))
    # Group 0's new pages first, then group 1's.
    assert a.new_page_ids == ((1, 2, 3), (4, 5, 6))
    m.free("a")
    # Group 0 freed first, then group 1: group 1's unhashed page is at the very head.
    assert m.pool.free_queue()[:2] == [6, 3]
    b = m.admit("b", list(range(10)))
    assert b.num_cached_tokens == 8
    m.check_invariants()


def test_mamba_holds_one_state_page():
    m = PageManager(
        PoolConfig(
            num_pages=20,
            groups=(GroupConfig(GroupKind.FULL, PS), GroupConfig(GroupKind.MAMBA, PS)),
        )
    )
    m.admit("a", list(range(10)))
    for _ in range(8):
        m.allocate("a", 1, new_token_ids=[1])
    assert len(pages(m, "a", 1)) == 1
    # No state caching: nothing can be reused across requests.
    assert m.admit("b", list(range(10))).num_cached_tokens == 0
    tables = m.build_batch(["a", "b"])
    assert tables[1].row_lengths.tolist() == [1, 1] and len(tables[1].slot_mapping) == 0


def test_mamba_state_caching_keeps_only_live_state():
    m = PageManager(
        PoolConfig(
            num_pages=30, groups=(GroupConfig(GroupKind.MAMBA, PS, enable_state_caching=True),)
        )
    )
    m.admit("a", list(range(13)))
    m.allocate("a", 1, new_token_ids=[1])
    live = [p for p in pages(m, "a") if p]
    assert len(live) == 1
    m.free("a")
    b = m.admit("b", list(range(13)))
    assert b.num_cached_tokens == 12  # the newest cached state


def test_chunked_local_prefix_outside_chunk_is_null():
    m = PageManager(
        PoolConfig(
            num_pages=30,
            groups=(GroupConfig(GroupKind.CHUNKED_LOCAL, PS, chunk=8),),
        )
    )
    m.admit("a", list(range(10)))
    m.allocate("a", 1, new_token_ids=[5])
    assert pages(m, "a")[:2] == [0, 0]  # the first chunk (8 tokens) is done with


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="num_pages"):
        PoolConfig(num_pages=1)
    with pytest.raises(ConfigError, match=r"groups\[0\].page_size"):
        PoolConfig(groups=(GroupConfig(GroupKind.FULL, 0),))
    with pytest.raises(ConfigError, match=r"groups\[0\].window"):
        PoolConfig(groups=(GroupConfig(GroupKind.SLIDING_WINDOW, 16, window=0),))
    with pytest.raises(ConfigError, match=r"groups\[1\].page_size"):
        PoolConfig(groups=(GroupConfig(GroupKind.FULL, 16), GroupConfig(GroupKind.FULL, 24)))
    with pytest.raises(ConfigError, match="hash_algorithm"):
        PoolConfig(hash_algorithm="md5")
    with pytest.raises(ConfigError, match="max_model_len"):
        PoolConfig(max_model_len=0)
    with pytest.raises(ConfigError, match=r"groups\[0\].chunk"):
        PoolConfig(groups=(GroupConfig(GroupKind.CHUNKED_LOCAL, 16, chunk=20),))
    with pytest.raises(ConfigError, match="unknown"):
        PoolConfig.from_dict({"num_pages": 10, "bogus": 1})


def test_stats_count_hits_and_usage():
    m = full()
    m.admit("a", list(range(9)))
    m.admit("b", list(range(9)))
    s = m.stats()
    assert s.prefix_queries_tokens == 18 and s.prefix_hits_tokens == 8
    assert s.num_used_pages == 4 and s.num_free_pages == 6
    assert s.usage == pytest.approx(0.4)
    assert s.padding_tokens_per_group == [3 + 3]


def test_docstring_example():
    manager = PageManager(PoolConfig(num_pages=1024))
    manager.admit("a", list(range(100)))
    second = manager.admit("b", list(range(100)))
    assert second.num_cached_tokens == 96
    manager.allocate("a", 1, new_token_ids=[42])
    tables = manager.build_batch(["a", "b"], [16])
    assert tables[0].block_table.shape == (2, 7)
    manager.free("a")
    manager.check_invariants()


# -- allocate_decodes: a whole decode step in one call --------------------------------------


def _twins(**kw) -> tuple[PageManager, PageManager]:
    a, b = full(**kw), full(**kw)
    for m in (a, b):
        m.admit("x", list(range(7)))  # 2 pages, 1 slot left in page 2
        m.admit("y", list(range(8)))  # 2 full pages (the second is y's own), then a decode
        m.admit("z", [9] * 3)
        m.take_events()
    return a, b


def test_allocate_decodes_matches_allocate_one_by_one():
    a, b = _twins()
    for step in range(6):
        tokens = [step, 50 + step, 90 + step]
        want = {}
        for rid, token in zip("xyz", tokens, strict=True):
            got = a.allocate(rid, 1, new_token_ids=[token])
            if got is None or any(got.new_page_ids):
                want[rid] = got
        assert b.allocate_decodes(list("xyz"), tokens) == want
        assert b.take_events() == a.take_events()
        for rid in "xyz":
            assert b.request_info(rid) == a.request_info(rid)
        b.check_invariants()
    assert b.pool.free_queue() == a.pool.free_queue()


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_allocate_decodes_with_held_tokens_matches_allocate(hybrid):
    """Held-back decodes' tokens ride with the next decode: the same as allocate() with
    them prepended and counted as computed (pages, hashes, events, no-capacity answers)."""

    def make() -> PageManager:
        if not hybrid:
            return full(num_pages=12)
        return PageManager(
            PoolConfig(
                num_pages=30,
                groups=(GroupConfig(GroupKind.FULL, PS), GroupConfig(GroupKind.FULL, 2 * PS)),
                max_model_len=64,
            )
        )

    a, b = make(), make()
    for m in (a, b):
        m.admit("x", list(range(5)))
        m.admit("y", list(range(20, 26)))
        m.admit("z", list(range(40, 47)))
        m.take_events()
    rng = np.random.default_rng(3)
    for _ in range(12):
        held = {rid: rng.integers(0, 9, int(rng.integers(0, 3))).tolist() for rid in "xyz"}
        held = {rid: extra for rid, extra in held.items() if extra}
        tokens = rng.integers(0, 9, 3).tolist()
        want = {}
        for rid, token in zip("xyz", tokens, strict=True):
            extra = held.get(rid, [])
            got = a.allocate(
                rid,
                1,
                new_token_ids=[*extra, token],
                num_computed_tokens=a.request_info(rid).num_computed_tokens + len(extra),
            )
            if got is None or any(got.new_page_ids):
                want[rid] = got
        assert b.allocate_decodes(list("xyz"), tokens, held_token_ids=held) == want
        assert b.take_events() == a.take_events()
        for rid in "xyz":
            assert b.request_info(rid) == a.request_info(rid)
        b.check_invariants()
    assert b.pool.free_queue() == a.pool.free_queue()
    assert b.pool.num_cached_pages > 0
    with pytest.raises(InvalidArgument, match="does not decode here"):
        b.allocate_decodes(["x"], [1], held_token_ids={"y": [2]})
    with pytest.raises(InvalidArgument, match="held token ids"):
        b.allocate_decodes(["x"], [1], held_token_ids={"x": [-2]})
    with pytest.raises(InvalidArgument, match="max_model_len"):
        b.allocate_decodes(["x"], [1], held_token_ids={"x": [0] * 64})
    for rid in "xyz":
        assert b.request_info(rid) == a.request_info(rid)


def test_allocate_decodes_reports_only_new_pages_and_no_capacity():
    m = full(num_pages=6)  # pages 1..5
    m.admit("x", list(range(8)))  # pages 1, 2 (both full)
    m.admit("y", list(range(100, 112)))  # pages 3, 4, 5 (all full)
    m.take_events()
    # x's next token needs a new page; none is free. y is in the same spot after x fails.
    assert m.allocate_decodes(["x", "y"], [1, 2]) == {"x": None, "y": None}
    assert m.request_info("x").num_tokens == 8  # nothing appended for a refused request
    m.free("y")  # cached pages to the tail, y's last page first: 5, 4, 3
    got = m.allocate_decodes(["x"], [1])
    assert got["x"].new_page_ids == ((5,),)  # the queue's head, evicted
    assert m.allocate_decodes(["x"], [2]) == {}  # fits: absent from the answer
    assert m.request_info("x").num_tokens == 10
    m.check_invariants()


def test_allocate_decodes_pool_running_dry_midway_serves_in_order():
    m = full(num_pages=4)  # pages 1..3
    m.admit("a", list(range(4)))
    m.admit("b", list(range(10, 14)))
    m.take_events()
    got = m.allocate_decodes(["a", "b"], [7, 8])  # one page left: a gets it, b does not
    assert got == {"a": got["a"], "b": None} and got["a"].new_page_ids == ((3,),)
    m.check_invariants()


@pytest.mark.parametrize("lookahead", [0, 1, 5])
def test_allocate_decodes_many_crossings_match_allocate_one_by_one(lookahead):
    """Requests crossing into a page take their pages in one pool call, between requests
    that fill a page (cached in order), one that needs several pages (lookahead) and, once
    the pool runs dry, refusals: the same pages, events (one removed event per evicted
    page), answers in the same order, and the same pool, as allocate() one by one."""

    def make() -> PageManager:
        m = full(num_pages=90, max_model_len=256)
        for i in range(12):  # cached free pages to evict, some sharing a prefix
            m.admit(f"old{i}", [i % 3] * 4 + rng.integers(0, 5, 4 * (i % 3 + 1)).tolist())
        for i in range(12):
            m.free(f"old{i}")
        for i in range(24):  # staggered lengths: some cross, some fill a page, some neither
            m.admit(f"r{i}", [i % 3] * 4 + list(range(100, 100 + 3 + (i % 7 == 0) + i % 2)))
        m.take_events()
        return m

    rng = np.random.default_rng(lookahead)
    a = make()
    rng = np.random.default_rng(lookahead)
    b = make()
    rids = [f"r{i}" for i in range(24)]
    num_crossings = num_refused = 0
    for _ in range(14):
        tokens = rng.integers(0, 5, len(rids)).tolist()
        want = {}
        for rid, token in zip(rids, tokens, strict=True):
            got = a.allocate(rid, 1, new_token_ids=[token], num_lookahead_tokens=lookahead)
            if got is None or any(got.new_page_ids):
                want[rid] = got
        answer = b.allocate_decodes(rids, tokens, num_lookahead_tokens=lookahead)
        assert list(answer.items()) == list(want.items())
        num_crossings = max(num_crossings, sum(1 for v in answer.values() if v is not None))
        num_refused += sum(1 for v in answer.values() if v is None)
        assert b.take_events() == a.take_events()
        for rid in rids:
            assert b.request_info(rid) == a.request_info(rid)
        assert b.pool.free_queue() == a.pool.free_queue()
        b.check_invariants()
    assert num_crossings >= 8  # a step where many requests took their pages in one call
    assert num_refused > 0  # the pool ran dry: refusals were answered in order
    assert b.pool.num_evictions == a.pool.num_evictions > 0


@pytest.mark.parametrize(
    ("rids", "tokens", "error", "match"),
    [
        (["x", "nope"], [1, 2], NotFound, "nope"),
        (["x", "x"], [1, 2], InvalidArgument, "twice"),
        (["x", "y"], [1], InvalidArgument, "1 new token ids for 2"),
        (["x", "y"], [1, -2], InvalidArgument, "non-negative"),
        (["x", "y"], [1, 2.5], InvalidArgument, "integers"),
        ([3, "y"], [1, 2], NotFound, "3"),
    ],
)
def test_allocate_decodes_bad_input_changes_nothing(rids, tokens, error, match):
    a, b = _twins()
    with pytest.raises(error, match=match):
        b.allocate_decodes(rids, tokens)
    for rid in "xyz":
        assert b.request_info(rid) == a.request_info(rid)
    assert b.pool.free_queue() == a.pool.free_queue()
    assert b.take_events() == []


def test_allocate_decodes_refuses_past_max_model_len_before_any_change():
    m = full(max_model_len=8)
    m.admit("x", list(range(3)))
    m.admit("y", list(range(8)))
    with pytest.raises(InvalidArgument, match=r"'y'.*max_model_len 8"):
        m.allocate_decodes(["x", "y"], [1, 2])
    assert m.request_info("x").num_tokens == 3
    # Held-back tokens count: x (3 tokens) + 4 held + its own = 8 fits, + 5 held does not.
    with pytest.raises(InvalidArgument, match=r"'x': 9 tokens exceed max_model_len 8"):
        m.allocate_decodes(["x"], [1], held_token_ids={"x": [5, 6, 7, 8, 9]})
    assert m.request_info("x").num_tokens == 3
    m.allocate_decodes(["x"], [1], held_token_ids={"x": [5, 6, 7, 8]})
    assert m.request_info("x").num_tokens == 8


def test_computed_tokens_never_pass_max_model_len_even_with_lookahead():
    """Speculative lookahead lets ``computed + new`` run past a request's tokens, never past
    max_model_len: slots stop there, and a computed token needs a slot. (Accepted before,
    the request reached 630 computed tokens in a 512-token pool, and its batch could no
    longer be built.)"""
    m = full(num_pages=40, max_model_len=64)
    m.admit("x", list(range(30)))
    pages = m.request_info("x").page_ids
    queue = m.pool.free_queue()
    past = r"'x': 30 computed \+ 40 new tokens exceed max_model_len 64"
    with pytest.raises(InvalidArgument, match=past):
        m.allocate("x", 40, num_lookahead_tokens=40)
    assert m.request_info("x").page_ids == pages and m.pool.free_queue() == queue
    assert m.request_info("x").num_computed_tokens == 30
    # Up to max_model_len exactly is fine: speculative tokens computed ahead of the tokens.
    assert m.allocate("x", 34, num_lookahead_tokens=34) is not None
    assert m.request_info("x").num_computed_tokens == 64
    m.build_batch(["x"])
    # Nothing more to compute: a decode is refused, by allocate and allocate_decodes alike.
    m.admit("y", [1, 2])
    queue = m.pool.free_queue()
    with pytest.raises(InvalidArgument, match=r"'x'.* 64 "):  # computed past its 31 tokens
        m.allocate("x", 1, new_token_ids=[5])
    with pytest.raises(InvalidArgument, match=r"'x': 64 computed \+ 1 new tokens exceed"):
        m.allocate_decodes(["y", "x"], [5, 6])
    assert m.request_info("y").num_tokens == 2 and m.pool.free_queue() == queue


def test_allocate_decodes_hybrid_groups_match_allocate():
    def hybrid() -> PageManager:
        m = PageManager(
            PoolConfig(
                num_pages=40,
                groups=(
                    GroupConfig(GroupKind.FULL, PS),
                    GroupConfig(GroupKind.SLIDING_WINDOW, PS, window=5),
                    GroupConfig(GroupKind.MAMBA, 2 * PS),
                ),
                max_model_len=64,
            )
        )
        m.admit("p", list(range(11)))
        m.admit("q", list(range(5)))
        return m

    a, b = hybrid(), hybrid()
    for step in range(10):
        want = {}
        for rid in "pq":
            got = a.allocate(rid, 1, new_token_ids=[step], num_lookahead_tokens=1)
            if got is None or any(got.new_page_ids):
                want[rid] = got
        assert b.allocate_decodes(["p", "q"], [step, step], num_lookahead_tokens=1) == want
        assert b.take_events() == a.take_events()
    for rid in "pq":
        assert b.request_info(rid) == a.request_info(rid)
    b.check_invariants()
