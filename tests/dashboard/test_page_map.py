"""The page map's binning: exact counts on known states, lanes per group, bin edges, size."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.manager import PageManager
from pagekeeper.dashboard import (
    PAGE_STATES,
    bin_edges,
    bin_page_states,
    build_page_map,
)

FREE, CACHED, USED, SHARED, NULL, OTHER = range(6)


def states(ref: list[int], cached: list[bool], group: list[int]) -> dict[str, np.ndarray]:
    return {
        "ref_count": np.asarray(ref, dtype=np.int32),
        "is_cached": np.asarray(cached, dtype=bool),
        "group": np.asarray(group, dtype=np.int16),
    }


def test_one_page_per_bin_is_each_page_state():
    # page:        0      1     2     3      4     5      6     7
    ref = [0, 1, 2, 0, 0, 3, 1, 0]
    cached = [False, True, True, True, False, False, False, False]
    group = [-1, 0, 0, 0, -1, 0, 0, -1]
    s = states(ref, cached, group)
    lanes = bin_page_states(s["ref_count"], s["is_cached"], s["group"], 1, 100)
    assert lanes.shape == (1, 8, len(PAGE_STATES))
    expected_state = [NULL, USED, SHARED, CACHED, FREE, SHARED, USED, FREE]
    assert lanes[0].argmax(axis=1).tolist() == expected_state
    assert (lanes[0].sum(axis=1) == 1).all()


def test_binned_counts_are_exact():
    # 10 pages into 3 bins: page p -> bin p*3//10 => bins [0..3], [4..6], [7..9].
    ref = [0, 1, 1, 2, 0, 0, 0, 5, 1, 0]
    cached = [False, False, True, True, True, False, True, False, False, False]
    group = [-1, 0, 0, 0, 0, -1, 0, 0, 0, -1]
    s = states(ref, cached, group)
    lanes = bin_page_states(s["ref_count"], s["is_cached"], s["group"], 1, 3)
    assert bin_edges(10, 3).tolist() == [0, 4, 7, 10]
    #                 free cached used shared null other
    assert lanes[0].tolist() == [
        [0, 0, 2, 1, 1, 0],  # pages 0-3: null, used, used (cached but held), shared
        [1, 2, 0, 0, 0, 0],  # pages 4-6: cached, free, cached
        [1, 0, 1, 1, 0, 0],  # pages 7-9: shared, used, free
    ]


def test_lanes_per_group_show_other_groups_pages_as_other():
    # Two groups sharing one pool: pages 1-2 group 0, pages 3-4 group 1, 5 free, 6 cached g1.
    ref = [0, 1, 2, 1, 1, 0, 0]
    cached = [False, False, False, True, False, False, True]
    group = [-1, 0, 0, 1, 1, -1, 1]
    s = states(ref, cached, group)
    lanes = bin_page_states(s["ref_count"], s["is_cached"], s["group"], 2, 7)
    g0 = lanes[0].argmax(axis=1).tolist()
    g1 = lanes[1].argmax(axis=1).tolist()
    assert g0 == [NULL, USED, SHARED, OTHER, OTHER, FREE, OTHER]
    assert g1 == [NULL, OTHER, OTHER, USED, USED, FREE, CACHED]
    # Binned: every lane's bins still sum to the pages they cover.
    binned = bin_page_states(s["ref_count"], s["is_cached"], s["group"], 2, 2)
    sizes = np.diff(bin_edges(7, 2))
    assert (binned.sum(axis=2) == sizes[np.newaxis]).all()
    assert binned[0].tolist() == [[0, 0, 1, 1, 1, 1], [1, 0, 0, 0, 0, 2]]
    assert binned[1].tolist() == [[0, 0, 1, 0, 1, 2], [1, 1, 1, 0, 0, 0]]


def test_build_page_map_totals_and_sparse_bins():
    ref = [0, 1, 2, 1, 1, 0, 0]
    cached = [False, False, False, True, False, False, True]
    group = [-1, 0, 0, 1, 1, -1, 1]
    page_map = build_page_map(states(ref, cached, group), 2, 4)
    assert page_map.num_pages == 7
    assert page_map.num_bins == 4
    assert page_map.pool_totals == {"free": 1, "cached": 1, "used": 3, "shared": 1, "null": 1}
    g0, g1 = page_map.lanes
    assert g0.totals == {"free": 1, "cached": 0, "used": 1, "shared": 1, "null": 1, "other": 3}
    assert g1.totals == {"free": 1, "cached": 1, "used": 2, "shared": 0, "null": 1, "other": 2}
    # Only states present anywhere in a lane travel; each list has one count per bin.
    assert set(g0.bins) == {"free", "used", "shared", "null", "other"}
    assert all(len(v) == 4 for v in g0.bins.values())
    assert sum(sum(v) for v in g1.bins.values()) == 7


def test_bin_edges_match_the_binning_rule():
    for num_pages, num_bins in [(10, 3), (1_000_003, 4096), (17, 17), (5, 1), (64, 7)]:
        edges = bin_edges(num_pages, num_bins)
        pages = np.arange(num_pages, dtype=np.int64)
        page_bin = pages * num_bins // num_pages
        assert edges[0] == 0
        assert edges[-1] == num_pages
        assert (np.searchsorted(edges, pages, side="right") - 1 == page_bin).all()
        sizes = np.diff(edges)
        assert sizes.max() - sizes.min() <= 1


def test_real_manager_state():
    """Pin the map to a vLLM-semantics scenario: a shared prefix, a freed (cached) request."""
    manager = PageManager(PoolConfig(num_pages=32))
    manager.admit("a", list(range(100)))  # pages 1-7 (6 full, cached)
    manager.admit("b", list(range(100)))  # hits 1-6 (now shared), new page 8
    manager.admit("c", list(range(1000, 1064)))  # pages 9-12, all full
    manager.free("c")  # 9-12: free but cached
    page_map = build_page_map(manager.page_states(), 1, 32)
    lane = page_map.lanes[0]
    assert lane.totals == {"free": 19, "cached": 4, "used": 2, "shared": 6, "null": 1, "other": 0}
    assert [i for i, n in enumerate(lane.bins["shared"]) if n] == [1, 2, 3, 4, 5, 6]
    assert [i for i, n in enumerate(lane.bins["used"]) if n] == [7, 8]
    assert [i for i, n in enumerate(lane.bins["cached"]) if n] == [9, 10, 11, 12]


def test_hybrid_manager_lanes_partition_the_pool():
    config = PoolConfig(
        num_pages=64,
        groups=(
            GroupConfig(GroupKind.FULL, page_size=16),
            GroupConfig(GroupKind.SLIDING_WINDOW, page_size=16, window=32),
        ),
    )
    manager = PageManager(config)
    manager.admit("a", list(range(100)))
    manager.admit("b", list(range(50)))
    states_ = manager.page_states()
    page_map = build_page_map(states_, 2, 64)
    held = states_["ref_count"] > 0
    for g, lane in enumerate(page_map.lanes):
        own = int((held & (states_["group"] == g)).sum())
        assert lane.totals["used"] + lane.totals["shared"] == own
        assert sum(lane.totals.values()) == 64
    # Each page appears once in the pool totals.
    assert sum(page_map.pool_totals.values()) == 64
    assert page_map.pool_totals["used"] + page_map.pool_totals["shared"] == int(held.sum())


@pytest.mark.parametrize("bad", [0, -3])
def test_rejects_bad_bins(bad: int):
    s = states([0, 1], [False, False], [-1, 0])
    with pytest.raises(ValueError):
        bin_page_states(s["ref_count"], s["is_cached"], s["group"], 1, bad)


def test_million_pages_is_fast():
    """The map is one vectorised pass: a 1M-page pool bins in milliseconds, not seconds."""
    rng = np.random.default_rng(7)
    n = 1_000_000
    ref = rng.integers(0, 3, n).astype(np.int32)
    cached = rng.random(n) < 0.3
    group = np.where((ref > 0) | cached, rng.integers(0, 2, n), -1).astype(np.int16)
    s = {"ref_count": ref, "is_cached": cached, "group": group}
    build_page_map(s, 2, 18_000)  # warm-up
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        page_map = build_page_map(s, 2, 18_000)
        timings.append(time.perf_counter() - started)
    assert sum(page_map.pool_totals.values()) == n
    for lane in page_map.lanes:
        assert sum(lane.totals.values()) == n
    # ~15-30 ms on a laptop core; the bound leaves room for a loaded CI machine.
    assert min(timings) < 0.5, timings


def test_page_map_cache_reuses_and_bounds_the_loop_share():
    from pagekeeper.dashboard import PageMapCache

    now = [0.0]
    built: list[int] = []
    cache = PageMapCache(max_loop_share=0.1, clock=lambda: now[0])
    s = states([0, 1], [False, False], [-1, 0])

    def build() -> object:
        built.append(1)
        now[0] += 0.5  # a slow build: 0.5 s
        return build_page_map(s, 1, 2)

    first, version = cache.get(1, 2, build)  # type: ignore[arg-type]
    assert version == 1 and len(built) == 1
    # Unchanged pool: the same map, whatever the time.
    now[0] += 100
    assert cache.get(1, 2, build) == (first, 1)  # type: ignore[arg-type]
    assert len(built) == 1
    # Changed pool, but the last build cost 0.5 s: no new build before 5 s have passed.
    built_at = now[0]
    assert cache.get(2, 2, build) != (first, 1)  # type: ignore[arg-type]
    assert len(built) == 2
    now[0] += 4.0
    _, version = cache.get(3, 2, build)  # type: ignore[arg-type]
    assert version == 2 and len(built) == 2, "reused the map of version 2"
    now[0] = built_at + 0.5 + 5.01
    _, version = cache.get(3, 2, build)  # type: ignore[arg-type]
    assert version == 3 and len(built) == 3
    # Another bin count is another map.
    cache.get(3, 7, build)  # type: ignore[arg-type]
    assert len(built) == 4
