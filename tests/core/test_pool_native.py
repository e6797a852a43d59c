"""The page pool's C loops (``pagekeeper.core._poolops``) against its Python loops.

A state machine drives two pools, one with each, through the same random operations (valid
and invalid, with colliding hashes, pages listed twice, pages outside the pool when caching)
and requires the same answers, errors, events and every internal structure after each one.
The C functions' own contract (all or nothing; out-of-range pages refused before anything
changes) is checked directly.
"""

from __future__ import annotations

import array
import gc
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagekeeper.core import pool as pool_module
from pagekeeper.core.errors import InvalidArgument, PagekeeperError
from pagekeeper.core.pool import PagePool
from pagekeeper.core.types import Allocation
from tests.core.native_memcheck import call_both
from tests.helpers.props import examples

needs_native = pytest.mark.skipif(
    not pool_module.native_pool(), reason="pagekeeper.core._poolops is not built here"
)

NUM_PAGES = 24
GROUPS = 2


class NativeVsPython(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.native = PagePool(NUM_PAGES, native=True)
        self.python = PagePool(NUM_PAGES, native=False)
        for pool in (self.native, self.python):
            pool.ensure_groups(GROUPS)
        self.held: list[int] = []  # one entry per reference the pools hand out

    def both(self, op: str, *args: object, **kwargs: object) -> tuple[str, object]:
        return call_both(self.native, self.python, op, *args, **kwargs)

    @rule(num=st.integers(0, 12))
    def allocate(self, num: int) -> None:
        outcome, pages = self.both("allocate", num)
        if outcome == "ok":
            self.held.extend(pages)  # type: ignore[arg-type]

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if not self.held:
            return
        picked = data.draw(st.lists(st.sampled_from(self.held), min_size=1, max_size=8))
        if data.draw(st.booleans()) and len(picked) > 1:
            picked.append(picked[0])  # a page listed twice: the run pass must undo
        for page in set(picked):
            for _ in range(min(picked.count(page), self.held.count(page))):
                self.held.remove(page)
        self.both("free", picked)

    @rule(
        data=st.data(),
        group=st.integers(0, GROUPS - 1),
        tags=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    )
    def cache(self, data: st.DataObject, group: int, tags: list[int]) -> None:
        # Pages held or not, the null page now and then; hashes from a small set so some
        # are already indexed or repeat within the run.
        candidates = sorted(set(self.held)) + [0, data.draw(st.integers(-2, NUM_PAGES + 2))]
        pages = data.draw(
            st.lists(st.sampled_from(candidates), min_size=len(tags), max_size=len(tags))
        )
        hashes = [b"h%02d" % tag for tag in tags]
        self.both(
            "cache",
            group,
            pages,
            hashes,
            parent_hash=None,
            token_ids=list(range(len(pages))),
            page_size=1,
            lora_name=None,
        )

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        # A prefix hit: pages found under cached hashes (free or held).
        cached = [p for p, h in enumerate(self.native._page_hash) if h is not None]
        if not cached:
            return
        pages = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=6, unique=True))
        if data.draw(st.booleans()):
            pages.sort(reverse=True)
        if self.both("touch", pages)[0] == "ok":
            self.held.extend(pages)

    @rule()
    def reset(self) -> None:
        self.both("reset_prefix_cache")

    @invariant()
    def sound(self) -> None:
        assert self.native.check_invariants() == self.python.check_invariants()


NativeVsPython = settings(
    max_examples=examples(120),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)(NativeVsPython)
TestNativeVsPython = needs_native(NativeVsPython.TestCase)


# -- the C functions' own contract --------------------------------------------------------


def ops() -> ModuleType:
    assert pool_module._ops is not None
    return pool_module._ops


def fresh() -> tuple[dict, list, list[int], bytearray]:
    """index, hash_of, state, cached of a six-page pool: pages 1-3 held, 4 cached and held
    (hash b"x"), 5 free."""
    state = [0, 2, 2, 2, 3, 0]
    cached = bytearray(6)
    cached[4] = 1
    return {b"x": 4}, [None, None, None, None, b"x", None], state, cached


@needs_native
@pytest.mark.parametrize(
    "pages, hashes",
    [
        ([1, 2], [b"a", b"x"]),  # a hash already indexed
        ([1, 2, 3], [b"a", b"b", b"a"]),  # a hash twice in the run
        ([1, 0], [b"a", b"b"]),  # the null page
        ([1, 4], [b"a", b"b"]),  # a cached page
        ([1, 5], [b"a", b"b"]),  # a free page
        ([1, 2], [b"a", "b"]),  # not bytes
        ([1, 2, 1], [b"a", b"b", b"c"]),  # a page twice
    ],
)
def test_cache_refuses_and_changes_nothing(pages: list[int], hashes: list[object]) -> None:
    index, hash_of, state, cached = fresh()
    before = (dict(index), list(hash_of), list(state), bytes(cached))
    assert ops().cache(index, hash_of, state, cached, pages, hashes, 1) is False
    assert (index, hash_of, state, bytes(cached)) == before


@needs_native
def test_cache_enters_a_fresh_run() -> None:
    index, hash_of, state, cached = fresh()
    assert ops().cache(index, hash_of, state, cached, [3, 1], [b"c", b"a"], 2) is True
    assert index == {b"x": 4, b"c": 3, b"a": 1}
    assert hash_of == [None, b"a", None, b"c", b"x", None]
    assert state == [0, 3, 2, 3, 3, 0]
    assert bytes(cached) == bytes([0, 2, 0, 2, 1, 0])


@needs_native
@pytest.mark.parametrize("bad", [-1, 6, 99, 2**70])
def test_out_of_range_pages_change_nothing(bad: int) -> None:
    index, hash_of, state, cached = fresh()
    before = (dict(index), list(hash_of), list(state), bytes(cached))
    if -1 < bad < 2**31:
        with pytest.raises(IndexError):
            ops().take_run(array.array("i", [5, bad]), 0, 2, state)
    with pytest.raises(IndexError):
        ops().release(state, [1, bad], 2, 0)
    with pytest.raises(IndexError):
        ops().cache(index, hash_of, state, cached, [1, bad], [b"a", b"b"], 1)
    with pytest.raises(IndexError):
        ops().evict(index, hash_of, cached, [4, bad], 1)
    assert (index, hash_of, state, bytes(cached)) == before


@needs_native
def test_release_undoes_a_broken_run() -> None:
    state = [0, 3, 3, 2, 3]
    assert ops().release(state, [1, 2, 3], 3, 1) is False  # page 3 is in another state
    assert state == [0, 3, 3, 2, 3]
    assert ops().release(state, [1, 2, 1], 3, 1) is False  # page 1 twice
    assert state == [0, 3, 3, 2, 3]
    assert ops().release(state, [4, 2, 1], 3, 1) is True
    assert state == [0, 1, 1, 2, 1]


@needs_native
def test_take_run_skips_holes_and_reports_cached_pages() -> None:
    state = [0, 0, 1, 0, 1]
    queue = array.array("i", [-1, 4, -1, 1, 2, 3])
    assert ops().take_run(queue, 0, 3, state) == ([4, 1, 2], [4, 2], 5)
    assert state == [0, 2, 2, 0, 2]
    assert ops().take_run(queue, 5, 0, state) == ([], [], 5)


@needs_native
def test_take_run_changes_nothing_when_it_fails() -> None:
    state = [0, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="fewer than 3"):
        ops().take_run(array.array("i", [1, -1, 2]), 0, 3, state)  # the queue runs out
    with pytest.raises(ValueError, match="state"):
        ops().take_run(array.array("i", [1, 2]), 0, 2, [0, 0, -3])  # not a page's state
    with pytest.raises(TypeError):
        ops().take_run(array.array("q", [1, 2]), 0, 2, state)  # not int32 cells
    assert state == [0, 0, 1, 0, 1]


@needs_native
def test_pack_i32_is_the_wire_layout() -> None:
    values = (0, 1, -1, 2**31 - 1, -(2**31), 131071)
    assert ops().pack_i32(values) == np.array(values, dtype="<i4").tobytes()
    assert ops().pack_i32([]) == b""
    with pytest.raises(OverflowError):
        ops().pack_i32([2**31])
    with pytest.raises(TypeError):
        ops().pack_i32([1.0])


@needs_native
@pytest.mark.parametrize("dtype", ["int32", "int64", "uint32", "uint64"])
def test_widen_tokens_checks_and_widens(dtype: str) -> None:
    src = np.array([0, 7, 50_000, 2**31 - 1], dtype=dtype)
    dst = array.array("Q", bytes(8 * len(src)))
    assert ops().widen_tokens(src, dst) is True
    assert list(dst) == src.tolist()
    assert ops().widen_tokens(src, None) is True
    if dtype.startswith("int"):
        negative = np.array([3, -1], dtype=dtype)
        out = array.array("Q", bytes(16))
        with pytest.raises(ValueError, match="non-negative"):
            ops().widen_tokens(negative, out)
        assert list(out) == [0, 0]  # nothing written


@needs_native
def test_widen_tokens_declines_other_layouts() -> None:
    assert ops().widen_tokens(np.arange(4, dtype=np.int16), None) is False
    assert ops().widen_tokens(np.arange(8, dtype=np.int32)[::2], None) is False  # strided
    assert ops().widen_tokens(np.arange(4, dtype=">i4"), None) is False  # foreign order
    assert ops().widen_tokens(np.arange(4.0), None) is False
    with pytest.raises(ValueError, match="as many items"):
        ops().widen_tokens(np.arange(4, dtype=np.int32), array.array("Q", bytes(8)))


@needs_native
def test_evict_leaves_other_groups_to_the_general_path() -> None:
    index, hash_of, _, cached = fresh()
    index[b"y"] = 3
    hash_of[3] = b"y"
    cached[3] = 2  # another group
    before = (dict(index), list(hash_of), bytes(cached))
    assert ops().evict(index, hash_of, cached, [4, 3], 1) is None
    assert (index, hash_of, bytes(cached)) == before
    assert ops().evict(index, hash_of, cached, [3], 2) == [b"y"]
    assert index == {b"x": 4} and hash_of[3] is None and hash_of[4] == b"x" and cached[3] == 0


@needs_native
def test_atomic_tuple_is_left_out_of_the_collector_only_when_it_can_be_in_no_cycle() -> None:
    atomic = ops().atomic_tuple([b"h1", 7, None, b"h2"])
    assert atomic == (b"h1", 7, None, b"h2") and type(atomic) is tuple
    assert not gc.is_tracked(atomic)
    assert ops().atomic_tuple(x for x in range(3)) == (0, 1, 2)
    inner: list[object] = []
    mixed = ops().atomic_tuple([b"h", inner])
    assert mixed == (b"h", []) and gc.is_tracked(mixed)
    inner.append(mixed)  # a cycle through it: still collectable
    del inner, mixed
    assert ops().atomic_tuple(()) == ()
    with pytest.raises(TypeError):
        ops().atomic_tuple(5)


@needs_native
def test_event_tuples_are_not_tracked_by_the_collector() -> None:
    """An admission's events carry ~125 hashes and page ids each: tracked tuples would be
    traversed by the next young collection (a 20 ms pause with thousands waiting)."""
    pool = PagePool(NUM_PAGES, native=True)
    pool.ensure_groups(1)
    pages = pool.allocate(4)
    pool.cache(
        0, pages, [b"a", b"b", b"c", b"d"],
        parent_hash=None, token_ids=list(range(16)), page_size=4, lora_name=None,
    )  # fmt: skip
    pool.free(pages)
    pool.allocate(NUM_PAGES - 1)  # evicts them
    stored, removed = pool.take_events()
    assert stored.page_hashes == (b"a", b"b", b"c", b"d") and stored.page_ids == tuple(pages)
    assert sorted(removed.page_hashes) == [b"a", b"b", b"c", b"d"]
    for event in (stored, removed):
        assert not gc.is_tracked(event.page_hashes) and not gc.is_tracked(event.page_ids)
        # The events themselves too: the buffer keeps thousands for seconds, and the
        # older generations' collections scanned every one.
        assert not gc.is_tracked(event)
    assert not gc.is_tracked(stored.token_ids)
    assert stored.token_ids == tuple(range(16))
    (packed,) = (o for o in gc.get_referents(stored.token_ids) if not isinstance(o, type))
    assert not gc.is_tracked(packed)  # its array


class _Slots:
    __slots__ = ("a", "b")

    def __init__(self, a: object, b: object) -> None:
        self.a, self.b = a, b


@needs_native
def test_untrack_only_what_can_be_in_no_cycle() -> None:
    leaf = _Slots(b"h", 7)
    assert gc.is_tracked(leaf)
    assert ops().untrack(leaf) is True and not gc.is_tracked(leaf)
    assert ops().untrack(leaf) is False  # already untracked
    holder = _Slots(leaf, ("x", 1))  # an untracked object and an atomic tuple
    assert ops().untrack(holder) is True and not gc.is_tracked(holder)
    inner: list[object] = []
    refers = _Slots(b"h", inner)  # a list may come to hold it: must stay collectable
    assert ops().untrack(refers) is False and gc.is_tracked(refers)
    inner.append(refers)
    assert ops().untrack(5) is False and ops().untrack(b"bytes") is False
    with_dict = type("WithDict", (), {})()
    with_dict.x = 1
    # An instance's __dict__ is tracked (it can change): left alone.
    assert ops().untrack(with_dict) is False and gc.is_tracked(with_dict)


@needs_native
@pytest.mark.parametrize(
    "call",
    [
        lambda o: o.take_run(array.array("i", [1]), 0, 1, (0, 0)),
        lambda o: o.take_run(b"\1\0\0\0", 0, 1, [0, 0]),  # bytes: no int32 format
        lambda o: o.take_run(array.array("i", [1]), -1, 1, [0, 0]),
        lambda o: o.release([0, 2], 1, 2, 0),
        lambda o: o.cache({}, [None] * 2, [0, 2], b"\0\0", [1], [b"a"], 1),
        lambda o: o.cache({}, [None] * 2, [0, 2], bytearray(2), [1], [b"a"], 0),
        lambda o: o.cache({}, {}, [0, 2], bytearray(2), [1], [b"a"], 1),
        lambda o: o.cache({}, [None] * 3, [0, 2], bytearray(2), [1], [b"a"], 1),
        lambda o: o.evict([], [None] * 2, bytearray(2), [1], 1),
    ],
)
def test_wrong_types_are_refused(call: Callable[[ModuleType], object]) -> None:
    with pytest.raises((TypeError, ValueError)):
        call(ops())


def test_forcing_native_without_the_extension_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "_ops", None)
    with pytest.raises(PagekeeperError, match="not built"):
        PagePool(4, native=True)


def test_native_pool_can_be_turned_off() -> None:
    """PAGEKEEPER_NATIVE_POOL=0 runs the Python loops."""
    code = "from pagekeeper.core import pool; print(pool.native_pool(), pool.PagePool(4)._ops)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PAGEKEEPER_NATIVE_POOL": "0"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == ["False", "None"]


def test_native_pool_is_built_where_it_can_be() -> None:
    """Optional, but where a C compiler is (as on the CI machine) a build that silently
    failed is a regression."""
    if os.environ.get("PAGEKEEPER_NATIVE_POOL") == "0":
        pytest.skip("turned off by PAGEKEEPER_NATIVE_POOL=0")
    if not shutil.which("cc"):
        pytest.skip("no C compiler: the Python loops run")
    assert pool_module.native_pool(), "setup.py did not build pagekeeper.core._poolops"


# -- decode_rows: the manager's plain decode rows -------------------------------------------


def _decode_twins(
    caching: bool,
    max_model_len: int,
    num_pages: int,
    prompts: list[list[int]],
    page_size: int = 4,
) -> list:
    """Two managers, one decoding with the C row pass (the default where built) and one
    with the Python loop, each running ``prompts`` as requests ``r0``, ``r1``, ..."""
    from pagekeeper.core.config import GroupConfig, PoolConfig
    from pagekeeper.core.manager import PageManager

    managers = []
    for native in (True, False):
        config = PoolConfig(
            num_pages=num_pages,
            groups=(GroupConfig(page_size=page_size),),
            enable_prefix_caching=caching,
            max_model_len=max_model_len,
        )
        manager = PageManager(config)
        if not native:
            manager.pool._ops = None
        for k, prompt in enumerate(prompts):
            manager.admit(f"r{k}", prompt)
        manager.take_events()
        managers.append(manager)
    return managers


def _spy_decode_rows(manager) -> list[int]:
    """Wrap the manager's C loops so each ``decode_rows`` call records the row it starts
    at; returns that (live) list."""
    calls: list[int] = []
    real = manager.pool._ops

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def decode_rows(self, *args):
            calls.append(args[2])
            return real.decode_rows(*args)

    manager.pool._ops = Spy()
    return calls


def _decode_both(
    native, python, ids: list[str], tokens: list[int], lookahead: int = 0, held=None, named=None
) -> dict:
    """One decode step on both managers (``held``: held-back tokens per request; ``named``:
    the client's hashes of the pages rows complete): the same answers (in request order),
    events, request fields (tokens, hashes, the scheduled range a published batch writes)
    and free queue. Returns the answer."""
    kw = {"num_lookahead_tokens": lookahead, "held_token_ids": held, "page_hashes": named}
    want = python.allocate_decodes(ids, tokens, **kw)
    got = native.allocate_decodes(ids, tokens, **kw)
    assert list(got.items()) == list(want.items())  # in request order too
    assert native.take_events() == python.take_events()
    for rid in python.request_ids():
        assert native.request_info(rid) == python.request_info(rid)
        assert native._requests[rid] == python._requests[rid]
    assert native.pool.free_queue() == python.pool.free_queue()
    native.check_invariants()
    return want


@needs_native
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_decode_rows_in_c_match_the_python_loop(caching: bool, lookahead: int) -> None:
    """Whole decode steps until the pool runs dry and rows hit max_model_len (partial
    pages, a page just full, one that needs a page at the next token): the same with and
    without the C row pass."""
    lengths = (3, 4, 5, 7, 8, 2)
    prompts = [list(range(10 * k, 10 * k + n)) for k, n in enumerate(lengths)]
    native, python = _decode_twins(caching, 24, 16, prompts)
    running = [f"r{k}" for k in range(6)]
    refused = crossed = 0
    for step in range(40):
        tokens = [7 * step + k for k in range(len(running))]
        live = [r for r in running if native.request_info(r).num_tokens < 24 - lookahead - 1]
        tokens = tokens[: len(live)]
        if not live:
            break
        want = _decode_both(native, python, live, tokens, lookahead)
        refused += sum(answer is None for answer in want.values())
        crossed += sum(answer is not None for answer in want.values())
    assert refused and crossed  # the pool ran dry; rows crossed into pages


@needs_native
@pytest.mark.parametrize("caching", [True, False])
def test_decode_rows_crossing_past_the_free_pages_matches_the_python_loop(caching: bool) -> None:
    """Every row crosses into a page at once and the pool has pages for only some: the
    same rows served (in order), refused and listed with and without the C rows."""
    prompts = [[10 * k + j for j in range(4)] for k in range(8)]  # one full page each
    native, python = _decode_twins(caching, 64, 12, prompts)
    ids = [f"r{k}" for k in range(8)]
    for step in range(3):
        want = _decode_both(native, python, ids, [step * 8 + k for k in range(8)])
        if step == 0:
            assert sum(a is None for a in want.values()) == 5  # 3 free pages for 8 rows


def _admit_both(native, python, rid: str, prompt: list[int], **kw) -> None:
    want = python.admit(rid, prompt, **kw)
    assert native.admit(rid, prompt, **kw) == want
    assert native.take_events() == python.take_events()


def decode_workload(native, python, steps: list[tuple[str, int]], max_len: int) -> int:
    """Twin managers (C, Python) through random admissions, decode steps and frees, one
    ``(op, seed)`` each, compared after every step (:func:`_decode_both`); returns how many
    decode steps ran. Small alphabets make prompts and decode tokens recur (hashes already
    in the index); some requests have a LoRA or send their first page's hash (8 or 32
    bytes); lookahead makes a fill take a page too; some rows carry held-back tokens; some
    name the pages they complete (a few recurring hashes of 8 or 32 bytes, so some are in
    the index already); refused rows are preempted."""
    import random

    from pagekeeper.core.types import ExtraKeys

    running: list[str] = []
    decoded = 0
    for n, (op, seed) in enumerate(steps):
        rng = random.Random(seed)
        if op == "admit" and len(running) < 6:
            rid = f"a{n}"
            prompt = [rng.choice((1, 2)) for _ in range(rng.randrange(1, 14))]
            kw: dict = {}
            if rng.random() < 0.25:
                kw["extra_keys"] = ExtraKeys(lora_name="adapter")
            full = len(prompt) // native.hash_page_size
            if rng.random() < 0.25 and full:
                kw["page_hashes"] = [bytes([seed % 251, 7]) * (rng.choice((8, 32)) // 2)]
            _admit_both(native, python, rid, prompt, **kw)
            if native.has_request(rid):
                running.append(rid)
        elif op == "free" and running:
            rid = running.pop(rng.randrange(len(running)))
            native.free(rid)
            python.free(rid)
            assert native.take_events() == python.take_events()
        elif op == "decode" and running:
            lookahead = rng.choice((0, 0, 1))
            live = [
                r for r in running if python.request_info(r).num_tokens < max_len - lookahead - 4
            ]
            if not live:
                continue
            tokens = [
                rng.choice((1, 2)) if rng.random() < 0.8 else rng.randrange(2**40) for _ in live
            ]
            # Some rows carry 1-3 held-back decodes' tokens (a client's hold_decodes).
            held = {
                r: [rng.choice((1, 2)) for _ in range(rng.randrange(1, 4))]
                for r in live
                if rng.random() < 0.3
            }
            named = {}
            for r in live:
                before = python.request_info(r).num_tokens
                after = before + len(held.get(r, ())) + 1
                hps = python.hash_page_size
                completed = after // hps - before // hps
                if completed and rng.random() < 0.4:
                    last = python.last_page_hash(r)
                    pool = [bytes([k, 9]) * (rng.choice((8, 32)) // 2) for k in range(5)]
                    named[r] = rng.sample([h for h in pool if h != last], completed)
            answers = _decode_both(native, python, live, tokens, lookahead, held, named)
            decoded += 1
            for rid, answer in answers.items():
                if answer is None:  # refused: preempted, as a scheduler would
                    running.remove(rid)
                    native.free(rid)
                    python.free(rid)
            assert native.take_events() == python.take_events()
        if running:
            # The batch gather (C on one twin, Python on the other): same counts and
            # maxima, the same refusal of an unknown id or another owner.
            batch = running + ["ghost"] if rng.random() < 0.2 else list(running)
            owner = rng.choice((None, "", "someone"))
            counts = [np.zeros((2, len(batch)), dtype=np.int64) for _ in range(2)]
            twins = zip((native, python), counts, strict=True)
            rows = [m.running_rows(batch, owner, *c) for m, c in twins]
            assert (rows[0] is None) == (rows[1] is None)
            if rows[0] is not None and rows[1] is not None:
                assert rows[0][1:] == rows[1][1:]
                assert counts[0].tolist() == counts[1].tolist()
    return decoded


@needs_native
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["admit", "decode", "decode", "decode", "free"]),
            st.integers(0, 2**16),
        ),
        min_size=5,
        max_size=40,
    )
)
def test_filled_pages_cached_in_c_match_the_python_loop(steps: list[tuple[str, int]]) -> None:
    """The C decode loop caches a filled page itself (hash, index, ``stored`` event) in
    the plain case and leaves the rest to the Python loop: a hash already in the index,
    extra keys, a client's parent hash that is not a 32-byte digest, a fill that also
    takes a page, a crossing waiting for its page. Both twins give the same answers,
    events, requests and pools."""
    native, python = _decode_twins(True, 40, 48, [])
    decode_workload(native, python, steps, 40)


@needs_native
def test_a_fill_after_a_waiting_crossing_keeps_the_event_order() -> None:
    """Row 0 crosses into a page (taken later, with the others, and evicting a cached
    page: a ``removed`` event), row 1 then fills its page (a ``stored`` event): the
    crossing's page is taken first, as one allocate() per row in order would."""
    native, python = _decode_twins(True, 64, 13, [])
    for k in range(3):  # every page of the pool cached and free
        _admit_both(native, python, f"old{k}", [50 + 16 * k + j for j in range(16)])
    for k in range(3):
        native.free(f"old{k}")
        python.free(f"old{k}")
    assert native.take_events() == python.take_events()
    assert native.pool.num_free_pages == native.pool.num_cached_pages == 12
    _admit_both(native, python, "r0", [1, 2, 3, 4])  # full: its next token crosses
    _admit_both(native, python, "r1", [5, 6, 7])  # its next token fills page 0
    events_before = len(python.pool._events)
    want = python.allocate_decodes(["r0", "r1"], [8, 9])
    kinds = [type(e).__name__ for e in python.pool._events[events_before:]]
    assert kinds == ["PageRemoved", "PageStored"], kinds
    got = native.allocate_decodes(["r0", "r1"], [8, 9])
    assert got == want
    assert native.take_events() == python.take_events()


@needs_native
@pytest.mark.parametrize(
    ("num_pages", "old_pages"), [(7, 0), (7, 2), (7, 1)], ids=["clean", "first", "second"]
)
def test_a_fill_after_crossings_into_clean_pages_stays_in_c(num_pages, old_pages) -> None:
    """Rows 0 and 1 cross into a page, row 2 then fills its page, row 3 fits. When the two
    pages the crossings will take are not cached (the free queue's head is clean), the fill
    is cached in the same C pass (one ``decode_rows`` call); when either is cached (the
    first, or only the second), the C pass has the crossings take their pages first
    (``take_crossings``: ``removed`` before ``stored``) and caches the fill, still in the
    same pass. Either way answers, events and pools are the Python loop's."""
    native, python = _decode_twins(True, 64, num_pages, [])
    if old_pages:  # a finished request's pages: cached, at the queue's tail
        _admit_both(native, python, "old", [70 + j for j in range(4 * old_pages)])
        native.free("old")
        python.free("old")
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6], [5, 6, 7], [3, 3]]
    for k, prompt in enumerate(prompts):
        _admit_both(native, python, f"r{k}", prompt)
    assert native.take_events() == python.take_events()
    assert native.pool.num_free_pages == 2
    cached_free = 0 if old_pages == 0 else native.pool.num_free_cached_pages
    calls = _spy_decode_rows(native)
    events_before = len(python.pool._events)
    ids = ["r0", "r1", "r2", "r3"]
    want = python.allocate_decodes(ids, [10, 11, 12, 13])
    kinds = [type(e).__name__ for e in python.pool._events[events_before:]]
    got = native.allocate_decodes(ids, [10, 11, 12, 13])
    assert got == want
    assert native.take_events() == python.take_events()
    assert native.pool.free_queue() == python.pool.free_queue()
    if cached_free:
        assert kinds[0] == "PageRemoved" and kinds[-1] == "PageStored", kinds
    else:
        assert kinds == ["PageStored"], kinds
    assert calls == [0]  # the whole step in one C pass


def _cycled_crossing_twins(num_rows: int, *, duplicate: bool = False) -> tuple:
    """Twins whose free queue's head holds cached pages (a finished request's), then
    ``num_rows`` requests alternating: even rows' next token crosses into a page (their
    page full), odd rows' fills theirs. ``duplicate``: one hash held by two pages (the
    pool no longer evicts plainly)."""
    native, python = _decode_twins(True, 64, 4 * num_rows + 8, [])
    old = []
    while native.pool.num_free_pages > 2:  # every page cached, the queue's head too
        num_pages = min(16, native.pool.num_free_pages - 2)
        old.append(f"old{len(old)}")
        tokens = [1000 * len(old) + j for j in range(4 * num_pages)]
        _admit_both(native, python, old[-1], tokens)
    if duplicate:
        # A second copy of the first old page, cached as a duplicate when filled.
        _admit_both(native, python, "twin", [1000, 1001, 1002])
        _decode_both(native, python, ["twin"], [1003])
    for rid in old:
        native.free(rid)
        python.free(rid)
    assert native.take_events() == python.take_events()
    for k in range(num_rows):
        prompt = [10 * k + j for j in range(4 if k % 2 == 0 else 3)]
        _admit_both(native, python, f"r{k}", prompt)
    return native, python


@needs_native
@pytest.mark.parametrize("num_rows", [4, 20], ids=["few", "many"])
def test_crossings_before_fills_take_evicting_pages_in_c(num_rows: int) -> None:
    """Rows crossing into pages the free queue's head holds cached, each followed by a row
    filling its page: the C pass takes the crossings' pages itself (each evicted with its
    own ``removed`` event before the fill's ``stored``), with no Python allocation, and
    places them after the pass; answers, events and pools are the Python loop's. With
    ``crossed`` (the service's columns) the many crossings come back there, page for page
    what the Python loop hands each."""
    native, python = _cycled_crossing_twins(num_rows)
    ids = [f"r{k}" for k in range(num_rows)]
    tokens = [500 + k for k in range(num_rows)]
    assert native.pool.num_free_cached_pages >= num_rows
    taken_in_python: list[int] = []
    real_allocate = native.pool.allocate
    native.pool.allocate = lambda n: taken_in_python.append(n) or real_allocate(n)
    calls = _spy_decode_rows(native)
    want = python.allocate_decodes(ids, tokens)
    crossed: tuple[list[int], list[int]] = ([], [])
    got = native.allocate_decodes(ids, tokens, crossed=crossed)
    assert calls == [0] and taken_in_python == []
    got.update(
        (ids[row], Allocation(ids[row], 0, ((page,),))) for row, page in zip(*crossed, strict=True)
    )
    assert got == want
    assert list(want) == ids[::2]  # each crossing, one page, in order
    if num_rows >= 16:  # 8+ crossings: answered in the columns
        assert len(crossed[0]) == num_rows // 2
    events = native.take_events()
    assert events == python.take_events()
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["PageRemoved", "PageStored"] * (num_rows // 2), kinds
    for rid in python.request_ids():
        assert native.request_info(rid) == python.request_info(rid)
    assert native.pool.free_queue() == python.pool.free_queue()
    assert native.pool.num_evictions == python.pool.num_evictions
    assert native.pool.num_allocated_total == python.pool.num_allocated_total
    native.check_invariants()
    python.check_invariants()


@needs_native
def test_crossings_before_fills_with_a_duplicate_hash_take_pages_in_python() -> None:
    """A hash held by two pages: taking a cached page may hand its index entry to the
    other, the Python path's work; the C pass calls back for the crossings' pages (same
    answers, events and pools)."""
    native, python = _cycled_crossing_twins(6, duplicate=True)
    assert not native.pool.evicts_plainly(0)
    ids = [f"r{k}" for k in range(6)] + ["twin"]
    _decode_both(native, python, ids, [600 + k for k in range(7)])


@needs_native
def test_rows_carrying_held_tokens_stay_in_c() -> None:
    """Rows with held-back tokens (a scheduler's ``hold_decodes``), one that fits and two
    whose tokens fill their page, are applied in the same C pass as the plain rows (one
    that crosses into a page among them), with the Python loop's tokens, counts, pages and
    events. (Held tokens that fill a page just before the row's own token crosses into the
    next are the Python loop's: a fill that also takes a page.)"""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [16, 17, 18, 19]]
    native, python = _decode_twins(True, 64, 40, prompts)
    ids = ["r0", "r1", "r2", "r3"]
    calls = _spy_decode_rows(native)
    # r0: 1 held + its token fit in page 1; r1: 2 held + its token fill page 1 (8 tokens);
    # r2: 1 held + its token fill page 1 (6 + 2 tokens); r3: plain, crosses into page 1.
    held = {"r0": [21], "r1": [22, 23], "r2": [24]}
    want = _decode_both(native, python, ids, [31, 32, 33, 34], held=held)
    assert calls == [0]
    assert list(want) == ["r3"]  # the crossing's new page
    info = {r: native.request_info(r) for r in ids}
    assert [info[r].num_tokens for r in ids] == [7, 8, 8, 5]
    assert [native._requests[r].scheduled_start for r in ids] == [6, 7, 7, 4]
    assert native.groups[0].num_cached_pages["r1"] == 2
    assert native.groups[0].num_cached_pages["r2"] == 2


@needs_native
def test_filled_pages_cached_in_c_announce_what_the_python_loop_does() -> None:
    """A fill in C is really taken there (not left to Python) and gives the same hash,
    index entry and ``stored`` event as the Python loop, page after page."""
    prompts = [[10 * k + j for j in range(3)] for k in range(4)]  # 3 of 4 tokens each
    native, python = _decode_twins(True, 64, 40, prompts)
    ids = [f"r{k}" for k in range(4)]
    calls = _spy_decode_rows(native)
    for step in range(12):
        calls.clear()
        want = python.allocate_decodes(ids, [100 + 4 * step + k for k in range(4)])
        assert native.allocate_decodes(ids, [100 + 4 * step + k for k in range(4)]) == want
        if step % 4 == 0:  # every row fills a page: one C call takes them all
            assert calls == [0], calls
        # The same objects, held as often (a reference taken or dropped too many is a
        # leak or a crash waiting to happen): hashes, events, their tuples and runs.
        got_events, want_events = native.take_events(), python.take_events()
        assert got_events == want_events
        for got, expected in zip(got_events, want_events, strict=True):
            assert sys.getrefcount(got) == sys.getrefcount(expected)
            for name in ("page_hashes", "token_ids", "page_ids"):
                assert sys.getrefcount(getattr(got, name)) == sys.getrefcount(
                    getattr(expected, name)
                ), name
            assert gc.is_tracked(got) == gc.is_tracked(expected)
            assert gc.is_tracked(got.token_ids) == gc.is_tracked(expected.token_ids)
        for rid in ids:
            mine, theirs = native._requests[rid], python._requests[rid]
            assert mine == theirs
            assert list(map(sys.getrefcount, mine.hashes)) == list(
                map(sys.getrefcount, theirs.hashes)
            )
    assert native.pool.num_cached_pages == python.pool.num_cached_pages == 4 * 3


@dataclass(slots=True)
class _Row:
    request_id: object
    token_ids: array.array
    hashes: list
    num_computed_tokens: object
    scheduled_start: int = 0
    num_scheduled: int = 0


@needs_native
def test_decode_rows_applies_rows_in_order_up_to_the_first_it_cannot() -> None:
    ops = pool_module._ops
    assert ops is not None

    def row(rid: object, length: int, computed: object = None) -> _Row:
        n = length if computed is None else computed
        return _Row(rid, array.array("Q", range(length)), [b"h"] * (length // 4), n)

    counts = {"fits": 2, "crosses": 2, "fills": 2, "odd": 2, "twice": 1}
    cached = dict.fromkeys(counts, 1) | {"crosses": 2}  # its 2 full pages are cached
    lists: tuple[list, list, list] = ([], [], [])

    def run(rows: list, start: int = 0, free: int = 5, lookahead: int = 0, **kw) -> tuple:
        args = dict(caching=True, max_len=64) | kw
        tokens = [100] * len(rows)
        return ops.decode_rows(
            rows,
            tokens,
            start,
            free,
            counts,
            cached,
            4,
            4,
            args["max_len"],
            lookahead,
            args["caching"],
            *lists,
        )

    rows = [
        row("fits", 5),  # token 6 of 2 pages: applied
        row("crosses", 8),  # token 9 takes a third page: applied, listed
        row("fills", 7),  # token 8 fills page 2 (to cache, to hash): stop here
        row("fits", 5),  # after the stop: untouched
    ]
    before = [(list(r.token_ids), r.num_computed_tokens) for r in rows]
    assert run(rows) == (2, 4)  # stopped at row 2; one free page taken
    assert list(rows[0].token_ids) == [*range(5), 100]
    assert (rows[0].num_computed_tokens, rows[0].scheduled_start, rows[0].num_scheduled) == (
        6,
        5,
        1,
    )
    assert rows[1].num_computed_tokens == 9 and list(rows[1].token_ids)[-1] == 100
    assert lists == (["crosses"], [2], [1])
    for r, (tokens, computed) in zip(rows[2:], before[2:], strict=True):
        assert (list(r.token_ids), r.num_computed_tokens, r.num_scheduled) == (tokens, computed, 0)
    # Resumed after the stop (the caller handled row 2): row 3 applied, the end reached.
    assert run(rows, start=3) == (4, 5)
    # No free page left: a crossing stops (the caller refuses it), nothing listed.
    for listed in lists:
        listed.clear()
    assert run([row("crosses", 8)], free=0) == (0, 0) and lists == ([], [], [])
    # Two new pages (lookahead past the next page) are the caller's too.
    assert run([row("twice", 4)], lookahead=4) == (0, 5)
    # Fields that are not what the manager keeps: left to the caller, unchanged.
    odd = [row("odd", 5, computed="5"), row(("odd",), 5), row("unknown", 5)]
    for k, r in enumerate(odd):
        assert run([r]) == (0, 5)
        assert r.num_scheduled == 0 and len(r.token_ids) == 5, k
    # Without caching a filled page needs nothing; max_model_len caps the lookahead.
    assert run([row("fills", 7)], caching=False) == (1, 5)
    assert run([row("fits", 5)], lookahead=7) == (0, 5)  # 4 pages: two new ones
    assert run([row("fits", 5)], lookahead=7, max_len=8) == (1, 5)
    with pytest.raises(TypeError):
        ops.decode_rows(rows, [1], 0, 5, counts, cached, 4, 4, 64, 0, True, *lists)
    with pytest.raises(ValueError):
        ops.decode_rows([], [], 0, 5, counts, cached, 0, 4, 64, 0, True, *lists)
    with pytest.raises(ValueError):
        ops.decode_rows([], [], 0, -1, counts, cached, 4, 4, 64, 0, True, *lists)


@needs_native
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(
        st.tuples(st.integers(1, 40), st.integers(0, 40), st.sampled_from(["s1", "s2"])),
        min_size=0,
        max_size=12,
    ),
    picks=st.lists(st.integers(0, 14), max_size=16),
    owner=st.sampled_from([None, "s1", "s2"]),
)
def test_running_rows_in_c_equal_python(specs, picks, owner) -> None:
    """``PageManager.running_rows``: the C pass and the Python one give the same requests,
    maxima and per-row counts, and refuse the same batches (an unknown id, another
    owner's request, an id not a str)."""
    from pagekeeper.core.config import GroupConfig, PoolConfig
    from pagekeeper.core.manager import PageManager

    manager = PageManager(PoolConfig(num_pages=400, groups=(GroupConfig(page_size=4),)))
    names = []
    for k, (length, computed, whose) in enumerate(specs):
        rid = f"r{k}"
        prompt = np.arange(k * 50, k * 50 + length, dtype=np.int32)
        if manager.admit(rid, prompt, num_new_tokens=min(computed, length) or None, owner=whose):
            names.append(rid)
    # Indexes past the admitted requests name unknown ids; 14 a non-str id.
    ids: list[object] = [
        7 if p == 14 else names[p] if p < len(names) else f"nope{p}" for p in picks
    ]
    answers = []
    for ops in (manager.pool._ops, None):
        manager.pool._ops = ops
        lengths = np.full(len(ids) + 2, -9, dtype=np.int64)
        computed = np.full(len(ids) + 2, -9, dtype=np.int64)
        rows = manager.running_rows(ids, owner, lengths, computed)  # type: ignore[arg-type]
        answers.append(
            (rows, lengths.tolist() if rows else None, computed.tolist() if rows else None)
        )
    native, python = answers
    assert native == python
    rows = native[0]
    expect_ok = all(
        isinstance(r, str) and r in names and owner in (None, manager.requests[r].owner)
        for r in ids
    )
    assert (rows is not None) == expect_ok
    if rows is not None:
        reqs = [manager.requests[r] for r in ids]  # type: ignore[index]
        assert all(a is b for a, b in zip(rows.requests, reqs, strict=True))
        assert native[1][: len(ids)] == [len(r.token_ids) for r in reqs]
        assert native[2][: len(ids)] == [r.num_computed_tokens for r in reqs]
        assert native[1][len(ids) :] == [-9, -9]  # nothing written past the rows
        if not ids:
            assert rows[1:] == (0, 0, 0)


@needs_native
def test_running_rows_refuses_bad_buffers() -> None:
    from pagekeeper.core.config import GroupConfig, PoolConfig
    from pagekeeper.core.manager import PageManager

    manager = PageManager(PoolConfig(num_pages=40, groups=(GroupConfig(page_size=4),)))
    manager.admit("a", np.arange(9, dtype=np.int32))
    with pytest.raises(ValueError, match="int64"):
        manager.running_rows(["a"], None, np.zeros(1, dtype=np.int32))
    with pytest.raises(ValueError, match=">= 2 items"):
        manager.running_rows(["a", "a"], None, np.zeros(1, dtype=np.int64))
    frozen = np.zeros(1, dtype=np.int64)
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        manager.running_rows(["a"], None, None, frozen)
    with pytest.raises(TypeError):
        manager.running_rows(5, None)  # type: ignore[arg-type]
    rows = manager.running_rows(("a",))
    assert rows is not None and rows.max_tokens == 9 and rows.max_computed == 9


@needs_native
def test_running_rows_survives_ids_changed_under_it() -> None:
    """An owner whose ``__eq__`` (a str subclass) empties the list of ids being gathered:
    the C pass notices and refuses the batch (the caller goes row by row), no crash."""
    from pagekeeper.core.config import GroupConfig, PoolConfig
    from pagekeeper.core.manager import PageManager

    ids = ["a", "b", "c"]

    class Meddling(str):
        __hash__ = str.__hash__

        def __eq__(self, other: object) -> bool:
            ids.clear()
            return True

    manager = PageManager(PoolConfig(num_pages=40, groups=(GroupConfig(page_size=4),)))
    for rid in list(ids):
        manager.admit(rid, np.arange(5, dtype=np.int32), owner=Meddling("o"))
    assert manager.running_rows(ids, "o") is None


@needs_native
@pytest.mark.parametrize("size", [32, 16])
def test_rows_whose_filled_page_the_client_names_stay_in_c(size: int) -> None:
    """Decodes whose token fills a page with the client's hash for it (``page_hashes``:
    an engine's hashes, of the pool's size or not) are cached in the same C pass as the
    rest, under the client's hash, with the Python loop's pages, hashes and events; a
    row that fills its page after a client hash of another size is the Python loop's
    (C hashes only 32-byte parents)."""
    import hashlib

    prompts = [[10 * k + j for j in range(3)] for k in range(6)]  # 3 of 4 tokens each
    native, python = _decode_twins(True, 64, 60, prompts)
    ids = [f"r{k}" for k in range(6)]
    calls = _spy_decode_rows(native)
    for step in range(9):
        calls.clear()
        tokens = [100 + 6 * step + k for k in range(6)]
        # Rows 0, 2 and 4 name the page their token fills (steps 0 and 8, not 4).
        named = (
            {r: [hashlib.sha256(f"{r}/{step}".encode()).digest()[:size]] for r in ids[0::2]}
            if step in (0, 8)
            else None
        )
        want = python.allocate_decodes(ids, tokens, page_hashes=named)
        got = native.allocate_decodes(ids, tokens, page_hashes=named)
        assert list(got.items()) == list(want.items())
        assert native.take_events() == python.take_events()
        for rid in ids:
            assert native._requests[rid] == python._requests[rid]
        assert native.pool.free_queue() == python.pool.free_queue()
        native.check_invariants()
        if step == 0:
            assert calls == [0]  # every fill in one C pass, named or hashed
            assert native._requests["r0"].hashes == named["r0"]  # type: ignore[index]
        if step == 4:
            # The named rows' next pages chain on the client's hashes: in C from 32-byte
            # parents, the Python loop's from 16-byte ones.
            assert (calls == [0]) == (size == 32), calls
    with pytest.raises(InvalidArgument, match="2 page hashes for the 0 pages"):
        native.allocate_decodes(["r0"], [1], page_hashes={"r0": [b"x" * 32, b"y" * 32]})
    with pytest.raises(InvalidArgument, match="which does not decode here"):
        native.allocate_decodes(["r0"], [1], page_hashes={"r1": [b"x" * 32]})


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_decode_rows_in_c_match_the_python_loop_with_deferred_caching(seed: int) -> None:
    """The random decode workload with both managers deferring admissions' caching and
    evictions as the service runs them (``defer_caching``): settled before each decode
    step, the same answers, events and pools as the Python loop."""
    import random

    rng = random.Random(seed)
    native, python = _decode_twins(True, 64, rng.choice((12, 16, 24, 40)), [])
    for manager in (native, python):
        manager.defer_caching = True
    ops = ["admit", "decode", "decode", "decode", "free"]
    steps = [(rng.choice(ops), rng.randrange(10**6)) for _ in range(examples(150))]
    assert decode_workload(native, python, steps, 64) > 0
