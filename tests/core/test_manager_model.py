"""Property-based: the core against the naive model, invariants after every step."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagekeeper.core import pool as pool_module
from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.events import PageRemoved, PageStored
from pagekeeper.core.hashing import hash_pages
from pagekeeper.core.manager import PageManager
from tests.core.refmodel import RefModel
from tests.helpers.props import examples

PREFIXES = [[7] * 40, list(range(100, 150)), [3, 1, 4, 1, 5, 9, 2, 6] * 5]


def prompt_strategy():
    return st.tuples(
        st.integers(0, len(PREFIXES)),  # len(PREFIXES) = no shared prefix
        st.integers(0, 50),
        st.lists(st.integers(0, 20), min_size=0, max_size=24),
    ).map(lambda t: (PREFIXES[t[0]][: t[1]] if t[0] < len(PREFIXES) else []) + t[2])


class ManagerVsModel(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(
        num_pages=st.integers(2, 64),
        page_size=st.sampled_from([2, 4, 8, 16]),
        caching=st.booleans(),
    )
    def setup(self, num_pages, page_size, caching):
        cfg = PoolConfig(
            num_pages=num_pages,
            groups=(GroupConfig(GroupKind.FULL, page_size),),
            enable_prefix_caching=caching,
            max_model_len=256,
        )
        self.manager = PageManager(cfg)
        self.model = RefModel(num_pages, page_size, caching=caching, max_model_len=256)
        self.counter = 0
        self.cached_pages: set[int] = set()

    @rule(
        target=requests,
        tokens=prompt_strategy(),
        chunk=st.integers(0, 30),
        lookahead=st.integers(0, 3),
    )
    def admit(self, tokens, chunk, lookahead):
        if not tokens:
            tokens = [1]
        self.counter += 1
        rid = f"r{self.counter}"
        expected_hits = self.model._hits(tokens, len(tokens) - 1) if self.model.caching else []
        rest = len(tokens) - len(expected_hits) * self.model.page_size
        num_new = min(chunk, rest) if chunk else None
        got = self.manager.admit(
            rid, tokens, num_new_tokens=num_new, num_lookahead_tokens=lookahead
        )
        want = self.model.admit(rid, tokens, num_new, lookahead)
        if want is None:
            assert got is None
            assert not self.manager.has_request(rid)
            return rid  # a name that holds nothing
        assert got is not None
        num_hit, pages, hits = want
        assert got.num_cached_tokens == num_hit
        assert list(got.hit_page_ids[0]) == hits
        assert list(got.new_page_ids[0]) == pages
        return rid

    @rule(
        rid=requests,
        new=st.lists(st.integers(0, 20), min_size=0, max_size=20),
        lookahead=st.integers(0, 2),
        extra=st.integers(0, 5),
        named=st.integers(0, 3),
    )
    def grow(self, rid, new, lookahead, extra, named):
        if rid not in self.model.reqs:
            return
        req = self.model.reqs[rid]
        computed = req["computed"]
        num_tokens = len(req["tokens"]) + len(new)
        if num_tokens > 256:
            return
        pending = num_tokens - computed
        num_new = pending if pending > 0 else min(extra, 0) or 0
        if num_new < 1:
            return
        # Up to ``named`` of the pages the new tokens complete named by the client (with
        # the manager's own hashes, so the model holds: the rest are chained on from them).
        ps = self.model.page_size
        first, end = len(req["tokens"]) // ps, num_tokens // ps
        page_hashes = None
        if named and end > first:
            chain = hash_pages([*req["tokens"], *new], ps)
            page_hashes = chain[first : min(end, first + named)]
        got = self.manager.allocate(
            rid,
            num_new,
            new_token_ids=new,
            num_lookahead_tokens=lookahead,
            new_page_hashes=page_hashes,
        )
        want = self.model.grow(rid, new, num_new, lookahead)
        if want is None:
            assert got is None
        else:
            assert got is not None
            assert list(got.new_page_ids[0]) == want

    @rule(seed=st.integers(0, 2**16), lookahead=st.integers(0, 2))
    def decode_all(self, seed, lookahead):
        """One batched decode step over every live request (the pool may run dry midway:
        the model grows them one by one in the same order)."""
        rids = [r for r, q in self.model.reqs.items() if len(q["tokens"]) < 256]
        tokens = [(seed + 7 * i) % 21 for i in range(len(rids))]
        got = self.manager.allocate_decodes(rids, tokens, num_lookahead_tokens=lookahead)
        for rid, token in zip(rids, tokens, strict=True):
            want = self.model.grow(rid, [token], 1, lookahead)
            if want is None:
                assert got[rid] is None
            elif want:
                assert list(got[rid].new_page_ids[0]) == want
            else:
                assert rid not in got

    @rule(rid=consumes(requests))
    def free(self, rid):
        if rid not in self.model.reqs:
            return
        self.manager.free(rid)
        self.model.free(rid)

    @rule(tokens=prompt_strategy())
    def lookup(self, tokens):
        if not tokens:
            return
        before = self.manager.pool.free_queue()
        got = self.manager.lookup(tokens)
        assert got.num_hit_tokens == self.model.lookup(tokens)
        assert self.manager.pool.free_queue() == before

    @precondition(lambda self: not self.model.reqs)
    @rule()
    def reset(self):
        assert self.manager.reset_prefix_cache() == self.model.reset()

    @rule()
    def forget(self):
        """A worker with an empty KV cache joined: every hash goes, held pages' too."""
        assert self.manager.forget_prefix_cache() == self.model.forget()

    @invariant()
    def same_state(self):
        self.manager.check_invariants()
        assert self.manager.pool.free_queue() == self.model.queue
        assert self.manager.pool.num_free_pages == self.model.num_free()
        assert sorted(self.model.key_of) == sorted(p for p in self.model.key_of)
        for rid, req in self.model.reqs.items():
            assert self.manager.page_table(rid).tolist() == req["pages"]

    @invariant()
    def events_follow_the_index(self):
        for event in self.manager.take_events():
            if isinstance(event, PageStored):
                assert not (set(event.page_ids) & self.cached_pages)
                self.cached_pages |= set(event.page_ids)
            elif isinstance(event, PageRemoved):
                assert set(event.page_ids) <= self.cached_pages
                self.cached_pages -= set(event.page_ids)
            else:
                self.cached_pages.clear()
        assert self.cached_pages == set(self.model.key_of)


ManagerVsModel = settings(
    max_examples=examples(80),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)(ManagerVsModel)
TestManagerVsModel = ManagerVsModel.TestCase


class HybridInvariants(RuleBasedStateMachine):
    """Random hybrid configs: no reference model, but every invariant after every step,
    all-or-nothing admission, and conservation."""

    requests = Bundle("hreq")

    @initialize(
        num_pages=st.integers(3, 60),
        base=st.sampled_from([2, 4, 8]),
        kinds=st.lists(
            st.sampled_from(["full", "swa", "chunk", "mamba", "mamba_cached", "full2x"]),
            min_size=1,
            max_size=3,
        ),
        caching=st.booleans(),
    )
    def setup(self, num_pages, base, kinds, caching):
        groups = []
        for kind in kinds:
            if kind == "full":
                groups.append(GroupConfig(GroupKind.FULL, base))
            elif kind == "full2x":
                groups.append(GroupConfig(GroupKind.FULL, base * 2))
            elif kind == "swa":
                groups.append(GroupConfig(GroupKind.SLIDING_WINDOW, base, window=base * 2 + 1))
            elif kind == "chunk":
                groups.append(GroupConfig(GroupKind.CHUNKED_LOCAL, base, chunk=base * 2))
            elif kind == "mamba":
                groups.append(GroupConfig(GroupKind.MAMBA, base))
            else:
                groups.append(GroupConfig(GroupKind.MAMBA, base, enable_state_caching=True))
        if num_pages < 1 + len(groups):
            num_pages = 1 + len(groups)
        self.manager = PageManager(
            PoolConfig(
                num_pages=num_pages,
                groups=tuple(groups),
                enable_prefix_caching=caching,
                max_model_len=128,
            )
        )
        self.counter = 0

    @rule(target=requests, tokens=prompt_strategy())
    def admit(self, tokens):
        tokens = (tokens or [1])[:100]
        self.counter += 1
        rid = f"h{self.counter}"
        free_before = self.manager.pool.num_free_pages
        queue_before = self.manager.pool.free_queue()
        got = self.manager.admit(rid, tokens)
        if got is None:
            assert self.manager.pool.num_free_pages == free_before
            assert self.manager.pool.free_queue() == queue_before
        else:
            assert got.num_cached_tokens < len(tokens)
            info = self.manager.request_info(rid)
            for g, pages in zip(self.manager.groups, info.page_ids, strict=True):
                if g.config.kind is GroupKind.MAMBA and not g.config.enable_state_caching:
                    assert len(pages) == 1
        return rid

    @rule(rid=requests, n=st.integers(1, 12))
    def decode(self, rid, n):
        if not self.manager.has_request(rid):
            return
        info = self.manager.request_info(rid)
        if info.num_tokens + n > 128:
            return
        self.manager.allocate(rid, n, new_token_ids=[5] * n)

    @rule(rid=consumes(requests))
    def free(self, rid):
        if self.manager.has_request(rid):
            self.manager.free(rid)

    @rule(tokens=prompt_strategy())
    def lookup(self, tokens):
        if tokens:
            self.manager.lookup(tokens)

    @invariant()
    def sound(self):
        self.manager.check_invariants()


HybridInvariants = settings(
    max_examples=examples(60),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)(HybridInvariants)
TestHybridInvariants = HybridInvariants.TestCase


class _PythonPoolLoops:
    """The same machine with the page pool's Python loops (the classes above run its C
    loops where they are built)."""

    def setUp(self) -> None:
        self._saved_ops = pool_module._ops
        pool_module._ops = None
        super().setUp()  # type: ignore[misc]

    def tearDown(self) -> None:
        pool_module._ops = self._saved_ops
        super().tearDown()  # type: ignore[misc]


@pytest.mark.skipif(not pool_module.native_pool(), reason="the C loops ran above as the default")
class TestManagerVsModelPythonPool(_PythonPoolLoops, TestManagerVsModel):  # type: ignore[misc,valid-type]
    pass


@pytest.mark.skipif(not pool_module.native_pool(), reason="the C loops ran above as the default")
class TestHybridInvariantsPythonPool(_PythonPoolLoops, TestHybridInvariants):  # type: ignore[misc,valid-type]
    pass
