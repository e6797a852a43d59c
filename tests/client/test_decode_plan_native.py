"""The mirror's decode loop in C (``_clientops.hold_decodes``) against the Python loop it
stands in for: whole decode steps planned on twin mirrors, one with the C loop and one
without, must leave the same requests, the same held-back rows and the same growths."""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest

import pagekeeper_client.client as client_module
from pagekeeper_client.client import SchedulerState, _DecodePlan, _PendingGrowth, _Tracked
from pagekeeper_client.types import GroupInfo, GroupKind, PoolConfig

clientops = pytest.importorskip("pagekeeper_client._clientops")

PAGE_SIZE = 4
MAX_LEN = 96


def pool(caching: bool) -> PoolConfig:
    return PoolConfig(
        num_pages=4096,
        groups=(GroupInfo(0, GroupKind.FULL, PAGE_SIZE),),
        enable_prefix_caching=caching,
        hash_algorithm="sha256_cbor",
        max_model_len=MAX_LEN,
    )


def growth_fields(growth: Any) -> tuple[Any, ...]:
    return (
        growth.request_id,
        growth.token_bytes,
        growth.num_computed_tokens,
        growth.num_new_tokens,
        growth.num_lookahead_tokens,
        growth.needs_pages,
        growth.num_pages_needed,
        growth.prev_num_tokens,
        growth.prev_num_computed_tokens,
        growth.prev_held,
        growth.is_local,
        growth.is_computed_given,
        growth.is_plain,
        growth.tracked.num_tokens if growth.tracked is not None else None,
    )


def mirror_fields(state: SchedulerState) -> dict[str, tuple[Any, ...]]:
    return {
        rid: (t.num_tokens, t.num_computed_tokens, t.held, [list(p) for p in t.pages])
        for rid, t in state.requests.items()
    }


def plan_fields(plan: _DecodePlan, state: SchedulerState) -> tuple[Any, ...]:
    names = {id(t): rid for rid, t in state.requests.items()}
    return (
        [growth_fields(g) for g in plan.growths],
        [names[id(t)] for t in plan.held],
        sorted(rid for rid, t in state.requests.items() if t.pending is not None),
    )


def twins(rng: random.Random, caching: bool, num: int) -> tuple[SchedulerState, SchedulerState]:
    state = SchedulerState(pool(caching))
    for k in range(num):
        computed = rng.randrange(0, 60)
        num_tokens = computed + rng.choice((0, 0, 0, 1))
        num_pages = -(-computed // PAGE_SIZE) + rng.choice((0, 0, 1))
        held = b"".join(rng.randrange(1000).to_bytes(4, "little") for _ in range(rng.randrange(3)))
        state.requests[f"r{k}"] = _Tracked(
            num_tokens, computed, [list(range(1, num_pages + 1))], held=held
        )
    return state, copy.deepcopy(state)


def settle(state: SchedulerState, plan: _DecodePlan, next_page: list[int]) -> None:
    """What the service's answer does to the mirror (pages for the growths that need them)."""
    for growth in plan.growths:
        t = growth.tracked
        assert t is not None
        t.pending = None
        for _ in range(growth.num_pages_needed):
            t.pages[0].append(next_page[0])
            next_page[0] += 1


def plan_without_c(
    state: SchedulerState, ids: list[str], tokens: list[int], lookahead: int
) -> _DecodePlan:
    """``plan_decodes`` with the C loops switched off (the Python loops alone)."""
    saved = client_module._clientops
    client_module._clientops = None
    try:
        return state.plan_decodes(ids, tokens, lookahead)
    finally:
        client_module._clientops = saved


def run_both(
    native: SchedulerState,
    python: SchedulerState,
    ids: list[str],
    tokens: list[int],
    lookahead: int,
) -> tuple[_DecodePlan, _DecodePlan]:
    plan_c = native.plan_decodes(ids, tokens, lookahead)
    plan_py = plan_without_c(python, ids, tokens, lookahead)
    assert plan_fields(plan_c, native) == plan_fields(plan_py, python)
    assert mirror_fields(native) == mirror_fields(python)
    return plan_c, plan_py


def twin_step(
    rng: random.Random,
    native: SchedulerState,
    python: SchedulerState,
    lookahead: int,
    next_pages: tuple[list[int], list[int]],
) -> _DecodePlan:
    """One random decode step of some running requests on both mirrors, compared, then
    settled as the service's answer would (``next_pages``: each mirror's next page id)."""
    live = [
        rid
        for rid, t in native.requests.items()
        if max(t.num_tokens, t.num_computed_tokens) + 1 < MAX_LEN - lookahead
    ]
    ids = rng.sample(live, rng.randrange(0, len(live) + 1))
    tokens = [rng.randrange(50_000) for _ in ids]
    plan_c, plan_py = run_both(native, python, ids, tokens, lookahead)
    settle(native, plan_c, next_pages[0])
    settle(python, plan_py, next_pages[1])
    return plan_c


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_c_loop_plans_whole_steps_as_the_python_loop(caching: bool, lookahead: int) -> None:
    rng = random.Random(f"{caching}-{lookahead}")
    native, python = twins(rng, caching, 40)
    next_pages = ([1000], [1000])
    num_held = 0
    for _ in range(30):
        num_held += len(twin_step(rng, native, python, lookahead, next_pages).held)
    assert num_held > 100  # the C loop did hold rows back (not only hand them over)


def test_rows_it_does_not_expect_go_to_the_python_loop() -> None:
    """A count that is not an exact int, pages not in lists: the C loop stops at that row
    and the Python loop plans it, with the same outcome as the Python loop alone."""
    native, python = twins(random.Random(5), True, 12)
    for state in (native, python):
        state.requests["r3"].num_computed_tokens = np.int64(
            state.requests["r3"].num_computed_tokens
        )
        state.requests["r7"].pages = [tuple(state.requests["r7"].pages[0])]  # type: ignore[list-item]
        state.requests["r9"].held = bytearray(state.requests["r9"].held)  # type: ignore[assignment]
    ids = [f"r{k}" for k in range(12)]
    run_both(native, python, ids, list(range(12)), 0)


def test_without_holding_every_row_is_a_growth() -> None:
    native, python = twins(random.Random(9), True, 20)
    native.hold_decodes = python.hold_decodes = False
    plan_c, _ = run_both(native, python, [f"r{k}" for k in range(20)], [7] * 20, 0)
    assert len(plan_c.growths) == 20 and not plan_c.held


def test_hold_decodes_contract() -> None:
    rows = [_Tracked(5, 5, [[1, 2]]), _Tracked(8, 8, [[1, 2]]), _Tracked(3, 3, [[1]])]
    held: list[_Tracked] = []
    tokens = b"".join(k.to_bytes(4, "little") for k in (11, 12, 13))
    # Row 0 fits (6 slots in 2 pages of 4); row 1 needs a third page: stop there.
    assert clientops.hold_decodes(rows, tokens, 0, 4, 64, 0, 0, held) == 1
    assert held == [rows[0]] and rows[0].held == (11).to_bytes(4, "little")
    assert (rows[0].num_tokens, rows[0].num_computed_tokens) == (6, 6)
    assert (rows[1].num_tokens, rows[1].held) == (8, b"")
    # From row 2 on: 4 slots fit its one page, but token 4 completes it (alignment 4).
    assert clientops.hold_decodes(rows, tokens, 2, 4, 64, 0, 4, held) == 2
    assert clientops.hold_decodes(rows, tokens, 2, 4, 64, 0, 0, held) == 3
    assert rows[2].held == (13).to_bytes(4, "little") and len(held) == 2
    assert clientops.hold_decodes(rows, tokens, 3, 4, 64, 0, 0, held) == 3
    with pytest.raises(ValueError, match="token bytes"):
        clientops.hold_decodes(rows, tokens[:8], 0, 4, 64, 0, 0, held)
    with pytest.raises(ValueError, match="start"):
        clientops.hold_decodes(rows, tokens, 4, 4, 64, 0, 0, held)
    with pytest.raises(ValueError, match="page_size"):
        clientops.hold_decodes(rows, tokens, 0, 0, 64, 0, 0, held)
    with pytest.raises(TypeError):
        clientops.hold_decodes(tuple(rows), tokens, 0, 4, 64, 0, 0, held)
    with pytest.raises(TypeError):
        clientops.hold_decodes(rows, tokens, 0, 4, 64, 0, 0)


def test_plan_decodes_contract() -> None:
    """``plan_decodes`` holds back what ``hold_decodes`` would and plans the other rows as
    the mirror's loop body does: a growth carrying the held tokens, counts one up, the
    growth pending, nothing held; it stops at a row it does not expect."""
    rows = [
        _Tracked(5, 5, [[1, 2]]),
        _Tracked(8, 8, [[1, 2]], held=(9).to_bytes(4, "little")),
        _Tracked(3, 3, [[1]]),
        _Tracked(4, 4, ([1],)),  # type: ignore[arg-type]  # pages not in a list
    ]
    ids = ["a", "b", "c", "d"]
    held: list[_Tracked] = []
    growths: list[_PendingGrowth] = []
    tokens = b"".join(k.to_bytes(4, "little") for k in (11, 12, 13, 14))
    # Row 0 held; row 1 needs a third page: planned, its held token first; row 2 completes
    # its page (alignment 4): planned; row 3 is not a layout it knows.
    assert (
        clientops.plan_decodes(
            rows, ids, tokens, 0, 4, 64, 0, 4, held, growths, _PendingGrowth, True
        )
        == 3
    )
    assert held == [rows[0]]
    b, c = growths
    assert (b.request_id, b.token_bytes, b.prev_held) == (
        "b",
        (9).to_bytes(4, "little") + (12).to_bytes(4, "little"),
        (9).to_bytes(4, "little"),
    )
    assert (b.num_computed_tokens, b.prev_num_tokens, b.needs_pages, b.num_pages_needed) == (
        8,
        8,
        True,
        1,
    )
    assert (b.is_local, b.is_computed_given, b.is_plain, b.tracked) == (
        False,
        True,
        False,
        rows[1],
    )
    assert (c.needs_pages, c.num_pages_needed, c.is_local, c.is_plain) == (False, 0, True, True)
    assert rows[1].pending is b and rows[1].held == b"" and rows[1].num_computed_tokens == 9
    assert rows[2].pending is c and (rows[2].num_tokens, rows[2].num_computed_tokens) == (4, 4)
    # Without holding, row 0 is a growth too.
    more: list[_PendingGrowth] = []
    fresh = [_Tracked(5, 5, [[1, 2]])]
    assert (
        clientops.plan_decodes(
            fresh, ["e"], tokens[:4], 0, 4, 64, 0, 0, [], more, _PendingGrowth, False
        )
        == 1
    )
    assert more[0].request_id == "e" and more[0].is_local and fresh[0].pending is more[0]
    with pytest.raises(ValueError, match="ids"):
        clientops.plan_decodes(rows, ids[:2], tokens, 0, 4, 64, 0, 0, [], [], _PendingGrowth, True)
    with pytest.raises(TypeError):
        clientops.plan_decodes(rows, ids, tokens, 0, 4, 64, 0, 0, [], [], _PendingGrowth)


def test_check_decodes_contract() -> None:
    requests = {
        "a": _Tracked(5, 5, [[1, 2]]),
        "b": _Tracked(MAX_LEN, 10, [[1]]),  # no room for a token
        "c": _Tracked(5, 8, [[1, 2]]),  # computed ran 3 ahead
        "d": _Tracked(np.int64(5), 5, [[1, 2]]),  # type: ignore[arg-type]
    }
    assert clientops.check_decodes(["a"], requests, MAX_LEN, 0) == [requests["a"]]
    assert clientops.check_decodes([], requests, MAX_LEN, 0) == []
    assert clientops.check_decodes(["a", "x"], requests, MAX_LEN, 0) == 1
    assert clientops.check_decodes(["a", "b"], requests, MAX_LEN, 0) == 1
    assert clientops.check_decodes(["c", "a"], requests, MAX_LEN, 0) == 0
    assert clientops.check_decodes(["c", "a"], requests, MAX_LEN, 3) == [
        requests["c"],
        requests["a"],
    ]
    assert clientops.check_decodes(["a", "d"], requests, MAX_LEN, 0) == 1
    assert clientops.check_decodes(["a", ["unhashable"]], requests, MAX_LEN, 0) == 1
    with pytest.raises(TypeError):
        clientops.check_decodes(("a",), requests, MAX_LEN, 0)


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        (["r0", "nope"], "NotFoundError"),
        (["r0", "r1", "r0"], "InvalidArgumentError"),
        (["r0", "full"], "InvalidArgumentError"),
        (["r0", "ahead"], "InvalidArgumentError"),
    ],
)
def test_bad_steps_are_refused_alike_and_plan_nothing(ids: list[str], error: str) -> None:
    native, python = twins(random.Random(3), True, 4)
    for state in (native, python):
        state.requests["full"] = _Tracked(MAX_LEN, MAX_LEN - 1, [[1] * (MAX_LEN // PAGE_SIZE)])
        state.requests["ahead"] = _Tracked(5, 9, [[1, 2, 3]])
    before = mirror_fields(native)
    with pytest.raises(Exception) as native_error:
        native.plan_decodes(ids, list(range(len(ids))), 0)
    with pytest.raises(Exception) as python_error:
        plan_without_c(python, ids, list(range(len(ids))), 0)
    assert type(native_error.value).__name__ == type(python_error.value).__name__ == error
    assert str(native_error.value) == str(python_error.value)
    assert mirror_fields(native) == mirror_fields(python) == before


def test_rows_that_change_the_lists_while_read_do_not_crash_it() -> None:
    """An attribute read can run code (a property); the loops hold their own references
    and re-check the list lengths, so a row that empties the lists is safe."""
    rows: list[Any] = []
    requests: dict[str, Any] = {}

    class Meddler:
        num_tokens = 5
        num_computed_tokens = 5
        held = b""

        @property
        def pages(self) -> list[list[int]]:
            rows.clear()
            return [[1, 2]]

        def __getattribute__(self, name: str) -> Any:
            if name == "num_computed_tokens":
                requests.clear()
            return object.__getattribute__(self, name)

    rows.extend([Meddler(), Meddler()])
    held: list[Any] = []
    tokens = bytes(8)
    assert clientops.hold_decodes(rows, tokens, 0, 4, 64, 0, 0, held) == 1
    assert len(held) == 1 and held[0].num_tokens == 6 and rows == []
    requests.update(a=Meddler(), b=Meddler())
    assert clientops.check_decodes(["a", "b"], requests, 64, 0) == 1


def prepared_batch(state: SchedulerState, batch: Any, native: bool) -> Any:
    """``prepare_step``'s batch for ``batch`` (the C loops on or off)."""
    saved = client_module._clientops
    client_module._clientops = saved if native else None
    try:
        prepared = state.prepare_step(
            client_id="c", generation=1, step_id=1, batch=batch, num_scheduled_tokens=None
        )
    finally:
        client_module._clientops = saved
    return prepared.request.batch


@pytest.mark.parametrize("seed", range(40))
def test_batch_counts_of_held_rows_in_c_match_the_python_loop(seed: int) -> None:
    """A published batch's ``num_computed_tokens`` (the client's counts for rows holding
    back decodes, -1 for the rest; left out when no row holds any) from ``held_ends``
    equals the Python loop's, byte for byte: rows held or not, ids the mirror does not
    know, lists and tuples, an odd ``held`` (the C pass defers to the loop)."""
    rng = random.Random(seed)
    state, _ = twins(rng, True, rng.randrange(0, 12))
    batch: Any = [rid for rid in state.requests if rng.random() < 0.8]
    if rng.random() < 0.3:
        batch.append("unknown")
    rng.shuffle(batch)
    if rng.random() < 0.5:
        batch = tuple(batch)
    if state.requests and rng.random() < 0.1:
        next(iter(state.requests.values())).held = bytearray(b"\x01\x00\x00\x00")
    native = prepared_batch(state, batch, True)
    python = prepared_batch(state, batch, False)
    assert native.num_computed_tokens == python.num_computed_tokens
    assert list(native.request_ids) == list(python.request_ids) == list(batch)
    if any(state.requests[r].held for r in batch if r in state.requests):
        assert native.num_computed_tokens  # some row holds decodes: the counts travel


def test_held_ends_defers_to_the_python_loop_when_unsure() -> None:
    """Counts past int32, an ``held`` that is not bytes, an unhashable id: NotImplemented."""
    big = _Tracked(2**31, 2**31, [[1]], held=b"\x00\x00\x00\x00")
    odd = _Tracked(5, 5, [[1]], held=bytearray(b"\x00\x00\x00\x00"))
    plain = _Tracked(5, 5, [[1]], held=b"")
    assert clientops.held_ends({"a": big}, ["a"]) is NotImplemented
    assert clientops.held_ends({"a": odd}, ["a"]) is NotImplemented
    assert clientops.held_ends({"a": plain}, [["unhashable"]]) is NotImplemented
    assert clientops.held_ends({"a": plain}, ["a", "b"]) is None
    held = _Tracked(7, 6, [[1, 2]], held=b"\x05\x00\x00\x00")
    assert (
        clientops.held_ends({"a": plain, "h": held}, ("a", "h", "zz"))
        == np.array([-1, 6, -1], dtype="<i4").tobytes()
    )
