"""The prefix-cache index of the C pool loops (``pagekeeper.core._poolops.PageIndex``).

A state machine drives it and a dict through the same operations on tables small enough
that clusters wrap around the end and deletions shift entries back across it; the two must
agree after every step. Then what it is for: its table never changes size under any amount
of churn at a steady size (a dict rebuilds itself), and snapshots list the index in page
order, so equal pools snapshot alike whatever their history or hash seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagekeeper.core import pool as pool_module
from pagekeeper.core.config import GroupConfig, PoolConfig
from pagekeeper.core.errors import InvariantViolation
from pagekeeper.core.manager import PageManager
from pagekeeper.core.pool import PagePool
from pagekeeper.core.snapshot import capture_manager, snapshot_manager
from pagekeeper.durability.snapshot import digest_tree
from tests.helpers.props import examples

pytestmark = pytest.mark.skipif(
    not pool_module.native_pool(), reason="pagekeeper.core._poolops is not built here"
)

KEYS = st.sampled_from([b"", b"a", b"b", b"ab"] + [bytes([i]) * (i % 5 + 1) for i in range(40)])


def page_index(expected: int = 0):  # type: ignore[no-untyped-def]
    assert pool_module._ops is not None
    return pool_module._ops.PageIndex(expected)


class IndexVsDict(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = page_index()  # 8 slots: grows as the machine fills it
        self.model: dict[bytes, int] = {}

    @rule(key=KEYS, value=st.integers(-(2**70), 2**70))
    def set(self, key: bytes, value: int) -> None:
        self.index[key] = value
        self.model[key] = value

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        if key in self.model:
            del self.index[key]
            del self.model[key]
        else:
            with pytest.raises(KeyError):
                del self.index[key]

    @rule(key=KEYS)
    def pop(self, key: bytes) -> None:
        assert self.index.pop(key, None) == self.model.pop(key, None)

    @rule(pairs=st.lists(st.tuples(KEYS, st.integers(0, 50)), max_size=6))
    def update(self, pairs: list[tuple[bytes, int]]) -> None:
        self.index.update(pairs)
        self.model.update(pairs)

    @rule(pairs=st.lists(st.tuples(KEYS, st.integers(0, 50)), min_size=1, max_size=4))
    def bad_update(self, pairs: list[tuple[bytes, int]]) -> None:
        # A bad pair anywhere changes nothing, the good pairs before it included.
        with pytest.raises(TypeError):
            self.index.update([*pairs, ("not bytes", 1)])

    @precondition(lambda self: len(self.model) > 20)
    @rule()
    def clear(self) -> None:
        self.index.clear()
        self.model.clear()

    @rule(key=KEYS)
    def read(self, key: bytes) -> None:
        assert self.index.get(key) == self.model.get(key)
        assert self.index.get(key, -1) == self.model.get(key, -1)
        assert (key in self.index) == (key in self.model)
        if key in self.model:
            assert self.index[key] == self.model[key]
        else:
            with pytest.raises(KeyError):
                self.index[key]

    @rule(
        run=st.lists(st.one_of(KEYS, st.just("not bytes")), max_size=12), limit=st.integers(-2, 14)
    )
    def prefix(self, run: list[bytes | str], limit: int) -> None:
        # What the full-attention hit does: a get per hash up to the first miss.
        expected = []
        for key in run[: max(limit, 0)]:
            if not isinstance(key, bytes) or key not in self.model:
                break
            expected.append(self.model[key])
        assert self.index.prefix(run, limit) == expected

    @invariant()
    def same(self) -> None:
        assert len(self.index) == len(self.model)
        assert dict(self.index.items()) == self.model
        assert sorted(self.index) == sorted(self.model) == sorted(self.index.keys())
        assert self.index.slots >= 2 * len(self.model)  # at most half full


TestIndexVsDict = settings(max_examples=examples(150), stateful_step_count=60, deadline=None)(
    IndexVsDict
).TestCase


def test_other_keys_and_values() -> None:
    index = page_index()
    index[b"x"] = 3
    assert index.get("x") is None and "x" not in index and 3 not in index
    with pytest.raises(KeyError):
        index["x"]
    with pytest.raises(TypeError):
        index["x"] = 1
    with pytest.raises(TypeError):
        index[b"y"] = "page"
    with pytest.raises(TypeError):
        index[bytearray(b"x")] = 1
    with pytest.raises(TypeError):
        hash(index)
    assert dict(index) == {b"x": 3} and len(index) == 1


def test_steady_churn_never_resizes() -> None:
    # A pool-sized index under the load that made a dict rebuild itself every ~218,000
    # insertions at 131,072 entries: evict the oldest hash, insert a new one, forever.
    n = 4096
    index = page_index(n)
    slots, size = index.slots, sys.getsizeof(index)
    live = [i.to_bytes(8, "little") for i in range(n)]
    index.update((h, page) for page, h in enumerate(live))
    for i in range(n, 20 * n):
        old = live[i % n]
        assert index.pop(old) == i % n
        live[i % n] = i.to_bytes(8, "little")
        index[live[i % n]] = i % n
    assert index.slots == slots and sys.getsizeof(index) == size
    assert len(index) == n and all(index[h] == page for page, h in enumerate(live))


def test_pools_use_it_with_the_c_loops_only() -> None:
    native, python = PagePool(16, native=True), PagePool(16, native=False)
    for pool in (native, python):
        pool.ensure_groups(1)
    assert type(native.index(0)).__name__ == "PageIndex"
    assert type(python.index(0)) is dict


def _filled(order: list[int]) -> PageManager:
    """A pool with the same pages cached whatever ``order`` they were cached in; the last
    two pages hold hashes cached already (duplicates, which wait behind the first)."""
    manager = PageManager(
        PoolConfig(num_pages=64, groups=(GroupConfig(page_size=4),), max_model_len=256)
    )
    pool = manager.pool
    pages = pool.allocate(len(order) + 2)
    for i, tag in [*((i, i) for i in order), (len(order), 3), (len(order) + 1, 5)]:
        pool.cache(
            0,
            [pages[i]],
            [b"hash %d" % tag],
            parent_hash=None,
            token_ids=[0, 0, 0, 0],
            page_size=4,
            lora_name=None,
        )
    return manager


def test_snapshots_list_the_index_in_page_order() -> None:
    forward = _filled(list(range(12)))
    backward = _filled(list(reversed(range(12))))
    trees = [snapshot_manager(manager)["pool"] for manager in (forward, backward)]
    index = trees[0]["index"][0]
    entries = sorted(forward.pool.index(0).items(), key=lambda item: item[1])
    assert list(zip(index["hashes"], index["pages"].tolist(), strict=True)) == entries
    assert index["dup_hashes"] == [b"hash 3", b"hash 5"] and len(index["dup_pages"]) == 2
    # Their events differ (the order of caching); the index trees do not.
    assert digest_tree({"i": trees[0]["index"]}) == digest_tree({"i": trees[1]["index"]})
    assert digest_tree({"e": trees[0]["events"]}) != digest_tree({"e": trees[1]["events"]})
    restored = PageManager.restore_state(forward.config, snapshot_manager(forward))
    assert dict(restored.pool.index(0).items()) == dict(forward.pool.index(0).items())
    assert restored.pool.check_invariants() == []


def test_a_capture_is_not_changed_by_later_steps() -> None:
    manager = _filled(list(range(12)))
    want = digest_tree(snapshot_manager(manager))
    build = capture_manager(manager)
    pool = manager.pool
    pool.free([page for page, h in enumerate(pool._page_hash) if h is not None])
    pool.allocate(pool.num_free_pages)  # evicts every cached page, duplicates included
    assert pool.num_cached_pages == 0
    assert digest_tree(build()) == want


def test_a_broken_index_fails_the_snapshot() -> None:
    # The tree's index is read from the cached pages; a pool whose index disagrees with
    # them (an entry lost) fails the snapshot rather than record another index.
    manager = _filled(list(range(12)))
    index = manager.pool.index(0)
    del index[next(iter(index))]
    with pytest.raises(InvariantViolation, match="index entries"):
        snapshot_manager(manager)


def test_snapshot_is_the_same_under_another_hash_seed(tmp_path: Path) -> None:
    # The PageIndex's own order follows Python's salted bytes hash, which differs from
    # process to process; a recovered state is compared with one that replayed the same
    # steps by the digest of their snapshots.
    script = (
        "import json, sys; sys.path[:0] = sys.argv[1:]\n"
        "from tests.core.test_page_index import _filled\n"
        "from pagekeeper.core.snapshot import snapshot_manager\n"
        "from pagekeeper.durability.snapshot import digest_tree\n"
        "print(json.dumps(digest_tree({'m': snapshot_manager(_filled(list(range(12))))})))\n"
    )
    root = Path(__file__).resolve().parents[2]
    digests = set()
    for seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", script, str(root), str(root / "service")],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
        )
        digests.add(json.loads(done.stdout))
    assert digests == {digest_tree({"m": snapshot_manager(_filled(list(range(12))))})}
