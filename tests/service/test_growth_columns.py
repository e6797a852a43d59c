"""Growths in column form: the same outcomes as the same growths as messages, checked as a
whole step before anything changes, and journaled so a replay rebuilds the same form."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.errors import InvalidArgument, NotFound, PagekeeperError, PermissionDenied
from pagekeeper.core.manager import decode_columns
from pagekeeper.durability.commands import decode_command, encode_command
from pagekeeper.state import (
    Admission,
    AllocationStatus,
    Growth,
    GrowthColumns,
    Limits,
    ServiceState,
    StepCommand,
    StepResult,
)
from tests.helpers.props import examples
from tests.service.test_state import scheduler, tokens

needs_native_columns = pytest.mark.skipif(
    decode_columns is None, reason="the C pool loops (decode_columns) are not built"
)

FULL = PoolConfig(num_pages=48, groups=(GroupConfig(GroupKind.FULL, 4),), max_model_len=96)
HYBRID = PoolConfig(
    num_pages=96,
    groups=(
        GroupConfig(GroupKind.FULL, 4),
        GroupConfig(GroupKind.SLIDING_WINDOW, 4, window=6),
    ),
    max_model_len=96,
)


def columns_of(growths: list[Growth]) -> GrowthColumns:
    arrays = [g.new_token_ids for g in growths]
    return GrowthColumns(
        request_ids=tuple(g.request_id for g in growths),
        num_new_tokens=np.array([g.num_new_tokens for g in growths], dtype=np.int32),
        new_token_ids=np.concatenate(arrays) if arrays else np.empty(0, np.int32),
        num_new_token_ids=np.array([len(a) for a in arrays], dtype=np.int32),
        num_computed_tokens=np.array(
            [-1 if g.num_computed_tokens is None else g.num_computed_tokens for g in growths],
            dtype=np.int32,
        ),
        num_lookahead_tokens=np.array([g.num_lookahead_tokens for g in growths], dtype=np.int32),
    )


def workload_step(
    rng: np.random.Generator, running: dict[str, int], step_id: int
) -> tuple[tuple[str, ...], list[Growth], tuple[Admission, ...]]:
    """Mostly plain decodes, some multi-token / explicit / lookahead growths, some frees
    and admissions; lengths tracked from the answers by the caller."""
    rids = list(running)
    frees = tuple(r for r in rids if rng.random() < 0.08)
    growths = []
    for rid in rids:
        if rid in frees or running[rid] >= 88:
            continue
        kind = rng.random()
        if kind < 0.6:
            growths.append(Growth(rid, 1, tokens(int(rng.integers(0, 30)), 1)))
        elif kind < 0.7:
            # A decode carrying k held-back decodes' tokens (a client's hold_decodes).
            k = int(rng.integers(1, 4))
            toks = tokens(int(rng.integers(0, 30)), k + 1)
            growths.append(Growth(rid, 1, toks, num_computed_tokens=running[rid] + k))
        elif kind < 0.8:
            growths.append(Growth(rid, 1, tokens(7, 1), num_lookahead_tokens=2))
        elif kind < 0.9:
            n = int(rng.integers(2, 5))
            growths.append(Growth(rid, n, tokens(int(rng.integers(0, 30)), n)))
        else:
            growths.append(Growth(rid, 1, tokens(3, 1), num_computed_tokens=running[rid]))
    admissions = tuple(
        Admission(f"s{step_id}-{j}", tokens(int(rng.integers(0, 3)) * 8, int(rng.integers(5, 30))))
        for j in range(int(rng.integers(0, 3)))
    )
    return frees, growths, admissions


def step_both_forms(
    states: list[ServiceState],
    clients: list[tuple[str, int]],
    step_id: int,
    frees: tuple[str, ...],
    growths: list[Growth],
    admissions: tuple[Admission, ...],
) -> list[tuple[StepResult, StepCommand]]:
    """The same step on twin states: the growths as messages on the first, as columns on
    the second; each answer with its command."""
    answers = []
    for state, me, columnar in zip(states, clients, (False, True), strict=True):
        kw: dict[str, object] = (
            {"growth_columns": columns_of(growths)} if columnar else {"growths": tuple(growths)}
        )
        command = StepCommand(1.0, me[0], me[1], step_id, frees, admissions=admissions, **kw)
        answers.append((state.step(command), command))
    return answers


def follow_answer(
    states: list[ServiceState],
    clients: list[tuple[str, int]],
    running: dict[str, int],
    step: tuple[tuple[str, ...], list[Growth], tuple[Admission, ...]],
    result: StepResult,
) -> int:
    """Bring ``running`` (request -> tokens) up to the answered step, preempt (free on every
    twin) the growths refused, compare the twins' requests, pools and events; returns how
    many were preempted."""
    frees, growths, admissions = step
    for rid in frees:
        del running[rid]
    statuses = {o.request_id: o.status for o in result.results}
    num_preempted = 0
    for g in growths:
        if statuses.get(g.request_id, AllocationStatus.OK) is AllocationStatus.OK:
            running[g.request_id] += len(g.new_token_ids)
        else:
            num_preempted += 1
            del running[g.request_id]
            for state, me in zip(states, clients, strict=True):
                state.manager.free(g.request_id)
                state._clients[me[0]].request_ids.discard(g.request_id)
    for a in admissions:
        if statuses[a.request_id] is AllocationStatus.OK:
            running[a.request_id] = len(a.token_ids)
    for twin in states[1:]:
        for rid in running:
            assert states[0].request_info(rid) == twin.request_info(rid)
        assert states[0].manager.pool.free_queue() == twin.manager.pool.free_queue()
        # The same tokens too: the pages they filled were hashed and announced alike.
        assert list(states[0]._events) == list(twin._events)
    return num_preempted


@pytest.mark.parametrize("config", [FULL, HYBRID], ids=["full", "hybrid"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_columns_match_messages_step_for_step(config: PoolConfig, seed: int) -> None:
    states = [ServiceState(config, Limits(), debug_invariants=True) for _ in range(2)]
    clients = [scheduler(s) for s in states]
    rng = np.random.default_rng(seed)
    running: dict[str, int] = {}
    num_no_capacity = 0
    for step_id in range(1, 60):
        step = workload_step(rng, running, step_id)
        (by_message, _), (by_column, _) = step_both_forms(states, clients, step_id, *step)
        assert by_message == by_column
        num_no_capacity += follow_answer(states, clients, running, step, by_message)
    assert num_no_capacity > 0, "the workload should run the pool dry at least once"


def two_running() -> tuple[ServiceState, tuple[str, int]]:
    state = ServiceState(FULL, Limits(), debug_invariants=True)
    me = scheduler(state)
    state.step(
        StepCommand(
            1.0,
            me[0],
            me[1],
            1,
            admissions=(Admission("a", tokens(0, 7)), Admission("b", tokens(50, 90))),
        )
    )
    return state, me


def decodes(ids: list[str], toks: list[int]) -> GrowthColumns:
    return GrowthColumns.decodes(ids, np.array(toks, dtype=np.int32))


def replace_column(cols: GrowthColumns, **changes: object) -> GrowthColumns:
    fields = {name: getattr(cols, name) for name in GrowthColumns.__slots__}
    # A changed column is no longer vouched for as defaults (unless the test says so).
    fields["defaults_only"] = False
    fields.update(changes)
    return GrowthColumns(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"growth_columns": decodes(["a", "zz"], [1, 2])}, NotFound, "zz"),
        ({"growth_columns": decodes(["a", "a"], [1, 2])}, InvalidArgument, "grown twice"),
        ({"growth_columns": decodes(["a"], [1]), "frees": ("a",)}, InvalidArgument, "freed"),
        ({"growth_columns": decodes(["a", "b"], [1, -4])}, InvalidArgument, "'b'.*>= 0"),
        # b holds 90 tokens; 7 more exceed max_model_len 96
        (
            {
                "growth_columns": replace_column(
                    decodes(["a", "b"], [1, 2]),
                    new_token_ids=np.arange(8, dtype=np.int32),
                    num_new_token_ids=np.array([1, 7], dtype=np.int32),
                )
            },
            InvalidArgument,
            "'b': 97 tokens exceed max_model_len 96",
        ),
        (
            {"growth_columns": replace_column(decodes(["a"], [1]), new_token_ids=tokens(0, 2))},
            InvalidArgument,
            "adds up to 1 tokens but new_token_ids holds 2",
        ),
        # The same with the count columns left out (as the wire leaves them for decodes).
        (
            {
                "growth_columns": replace_column(
                    decodes(["a"], [1]), new_token_ids=tokens(0, 2), defaults_only=True
                )
            },
            InvalidArgument,
            "adds up to 1 tokens but new_token_ids holds 2",
        ),
        (
            {
                "growth_columns": replace_column(
                    decodes(["a", "b"], [1, 2]), num_new_tokens=np.array([1], dtype=np.int32)
                )
            },
            InvalidArgument,
            "num_new_tokens has 1 entries for 2 growths",
        ),
        (
            {
                "growth_columns": replace_column(
                    decodes(["a"], [1]), num_new_tokens=np.array([0], dtype=np.int32)
                )
            },
            InvalidArgument,
            "num_new_tokens must be >= 1",
        ),
        (
            {
                "growth_columns": replace_column(
                    decodes(["a"], [1]), num_computed_tokens=np.array([-2], dtype=np.int32)
                )
            },
            InvalidArgument,
            "num_computed_tokens -2",
        ),
        (
            {
                "growth_columns": replace_column(
                    decodes(["a"], [1]), num_new_tokens=np.array([5], dtype=np.int32)
                )
            },
            InvalidArgument,
            "exceed its 8 tokens",
        ),
        (
            {"growth_columns": decodes(["a"], [1]), "growths": (Growth("b", 1, tokens(0, 1)),)},
            InvalidArgument,
            "not both",
        ),
        # Lookahead lets computed + new run past a's 8 tokens, never past max_model_len 96.
        (
            {
                "growth_columns": replace_column(
                    decodes(["a"], [1]),
                    num_new_tokens=np.array([95], dtype=np.int32),
                    num_lookahead_tokens=np.array([95], dtype=np.int32),
                )
            },
            InvalidArgument,
            "'a': 7 computed \\+ 95 new tokens exceed max_model_len 96",
        ),
        (
            {"growths": (Growth("a", 95, tokens(0, 1), num_lookahead_tokens=95),)},
            InvalidArgument,
            "'a': 7 computed \\+ 95 new tokens exceed max_model_len 96",
        ),
    ],
)
def test_bad_columns_change_nothing(kwargs, error, match) -> None:
    state, me = two_running()
    before = {rid: state.request_info(rid) for rid in ("a", "b")}
    queue = state.manager.pool.free_queue()
    with pytest.raises(error, match=match):
        state.step(StepCommand(2.0, me[0], me[1], 2, **kwargs))
    assert {rid: state.request_info(rid) for rid in ("a", "b")} == before
    assert state.manager.pool.free_queue() == queue


def test_columns_of_another_client_are_refused() -> None:
    state, _ = two_running()
    other = scheduler(state)
    with pytest.raises(PermissionDenied):
        state.step(StepCommand(2.0, other[0], other[1], 1, growth_columns=decodes(["a"], [1])))


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ({3: "foreign", 7: "missing"}, PermissionDenied, "'o0' belongs to another client"),
        ({2: "missing", 5: "foreign"}, NotFound, "'nope' holds no pages"),
    ],
)
def test_many_columns_name_the_first_unknown_or_foreign_request(bad, error, match) -> None:
    """A step of many columns (checked as arrays) names the first bad row, whichever its
    kind, as the row-by-row check does, and changes nothing."""
    state, me = two_running()
    other = scheduler(state)
    own = [f"m{i}" for i in range(12)]
    state.step(
        StepCommand(2.0, me[0], me[1], 2, admissions=tuple(Admission(r, tokens(0, 3)) for r in own))
    )
    state.step(StepCommand(2.0, other[0], other[1], 1, admissions=(Admission("o0", tokens(0, 3)),)))
    ids = list(own)
    for row, kind in bad.items():
        ids[row] = "o0" if kind == "foreign" else "nope"
    before = {rid: state.request_info(rid) for rid in own}
    with pytest.raises(error, match=match):
        state.step(StepCommand(3.0, me[0], me[1], 3, growth_columns=decodes(ids, [1] * 12)))
    assert {rid: state.request_info(rid) for rid in own} == before
    state.step(StepCommand(3.0, me[0], me[1], 3, growth_columns=decodes(own, [1] * 12)))
    assert all(state.request_info(rid).num_tokens == 4 for rid in own)


def test_columns_round_trip_through_the_journal_codec() -> None:
    cols = columns_of(
        [
            Growth("a", 1, tokens(5, 1)),
            Growth("b", 3, tokens(9, 0), num_computed_tokens=17, num_lookahead_tokens=2),
            Growth("c", 2, tokens(1, 2)),
        ]
    )
    command = StepCommand(3.5, "s-1", 2, 7, ("x",), growth_columns=cols)
    decoded, _ = decode_command(encode_command(command))
    assert decoded.growths == ()
    got = decoded.growth_columns
    assert got is not None and got.request_ids == cols.request_ids
    for name in GrowthColumns.__slots__[1:6]:
        assert getattr(got, name).tolist() == getattr(cols, name).tolist(), name
    assert not got.defaults_only
    uniform = GrowthColumns.decodes(["a", "b"], np.array([3, 4], dtype=np.int32))
    decoded, _ = decode_command(encode_command(StepCommand(1.0, "s", 1, 1, growth_columns=uniform)))
    assert decoded.growth_columns is not None
    assert decoded.growth_columns.new_token_ids.tolist() == [3, 4]
    assert decoded.growth_columns.num_computed_tokens.tolist() == [-1, -1]
    assert decoded.growth_columns.defaults_only  # replayed as the plain decodes they are
    ahead = GrowthColumns.decodes(["a", "b"], np.array([3, 4], dtype=np.int32), 2)
    decoded, _ = decode_command(encode_command(StepCommand(1.0, "s", 1, 1, growth_columns=ahead)))
    assert decoded.growth_columns is not None and not decoded.growth_columns.defaults_only


def test_decodes_crossing_together_are_granted_as_columns() -> None:
    """Eight or more plain decodes taking one page each together: the state keeps them as
    columns (no outcome apiece), and the answer is the same as the messages' in every form
    it takes -- the outcomes in growth order (merged with a multi-page lookahead growth, a
    refusal and an admission), the wire's grant columns, the snapshot tree, a retry."""
    from pagekeeper.rpc import convert
    from pagekeeper.state import step_result_from_tree, step_result_to_tree
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

    config = PoolConfig(num_pages=71, groups=(GroupConfig(GroupKind.FULL, 4),), max_model_len=96)
    states = [ServiceState(config, Limits(), debug_invariants=True) for _ in range(2)]
    clients = [scheduler(s) for s in states]
    rids = [f"r{i:02d}" for i in range(24)]
    admissions = tuple(Admission(r, tokens(10 * i, 8)) for i, r in enumerate(rids))
    for state, me in zip(states, clients, strict=True):
        state.step(StepCommand(1.0, me[0], me[1], 1, admissions=admissions))
    # 24 requests at a page boundary (2 pages each, 48 held, 22 free): the ninth takes 2
    # pages (lookahead 4), the others one each, and the last three find none (a refusal
    # ends the batch of 12 before it).
    growths = [
        Growth(r, 1, tokens(500 + i, 1), num_lookahead_tokens=4 if i == 8 else 0)
        for i, r in enumerate(rids)
    ]
    results = []
    for state, me, columnar in zip(states, clients, (False, True), strict=True):
        kw: dict[str, object] = (
            {"growth_columns": columns_of(growths)} if columnar else {"growths": tuple(growths)}
        )
        extra = (Admission("late", tokens(900, 3)),)
        command = StepCommand(2.0, me[0], me[1], 2, admissions=extra, **kw)
        results.append((state.step(command), command))
    (by_message, _), (by_column, command) = results
    assert by_message.grants is None and by_column.grants is not None
    assert len(by_column.grants.growth_index) >= 8
    assert len(by_column.listed) < len(by_message.listed)
    assert by_column == by_message and by_column.results == by_message.results
    statuses = {o.request_id: o.status for o in by_column.results}
    assert [r for r in rids if statuses[r] is AllocationStatus.NO_CAPACITY] == rids[21:]
    assert by_column.results[-1].request_id == "late"  # refused too: the pool is dry
    assert [o.request_id for o in by_column.results][:-1] == [
        r for r in rids if r in {o.request_id for o in by_column.results}
    ]
    # The wire: grant columns (growth order) and the listed rest, as from the messages.
    request = pb.StepRequest(client_id=command.client_id, step_id=2, grants_in_columns=True)
    request.growth_columns.request_ids.extend(rids)
    request.admissions.add(request_id="late")
    fast = convert.step_result_to_pb(by_column, request, command)
    slow = convert.step_result_to_pb(by_message, request)
    assert fast == slow and fast.HasField("grants")
    assert convert.step_result_to_pb(by_column, request) == slow  # no command: ids compared
    request.grants_in_columns = False
    assert convert.step_result_to_pb(by_column, request) == convert.step_result_to_pb(
        by_message, request
    )
    other = pb.StepRequest(client_id=command.client_id, step_id=2, grants_in_columns=True)
    other.growth_columns.request_ids.extend(reversed(rids))  # does not line up: all listed
    other.admissions.add(request_id="late")
    assert not convert.step_result_to_pb(by_column, other).HasField("grants")
    # Snapshot tree and retry: the same answer.
    assert step_result_from_tree(step_result_to_tree(by_column)) == by_message
    retried = states[1].step(command)
    assert retried.is_retry and retried.results == by_message.results
    assert states[0].manager.pool.free_queue() == states[1].manager.pool.free_queue()
    for rid in rids:
        assert states[0].request_info(rid) == states[1].request_info(rid)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_lockstep_decodes_match_messages_step_for_step(seed: int) -> None:
    """Requests decoding in lock step cross into pages together, so the column form keeps
    many steps' crossings as columns (``GrowthGrants``), between lookahead growths,
    held-token carriers, refusals when the pool runs dry, frees and admissions: every step's
    answer (in every form), request and pool equal the same growths as messages."""
    from pagekeeper.rpc import convert
    from pagekeeper.state import step_result_from_tree, step_result_to_tree
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

    config = PoolConfig(num_pages=160, groups=(GroupConfig(GroupKind.FULL, 4),), max_model_len=96)
    states = [ServiceState(config, Limits(), debug_invariants=True) for _ in range(2)]
    clients = [scheduler(s) for s in states]
    rng = np.random.default_rng(seed)
    running: dict[str, int] = {}
    num_granted = 0
    serial = 0
    for step_id in range(1, 80):
        frees = tuple(r for r in running if rng.random() < 0.03)
        growths = []
        for rid in running:
            if rid in frees or running[rid] >= 80:
                continue
            kind = rng.random()
            if kind < 0.85:
                growths.append(Growth(rid, 1, tokens(int(rng.integers(0, 30)), 1)))
            elif kind < 0.92:
                k = int(rng.integers(1, 3))
                toks = tokens(int(rng.integers(0, 30)), k + 1)
                growths.append(Growth(rid, 1, toks, num_computed_tokens=running[rid] + k))
            else:
                growths.append(Growth(rid, 1, tokens(7, 1), num_lookahead_tokens=3))
        admissions = []
        if len(running) < 40 and rng.random() < 0.5:
            # Several at once, of one length: they decode in lock step from here.
            length = 4 * int(rng.integers(2, 6))
            for _ in range(int(rng.integers(8, 16))):
                serial += 1
                admissions.append(Admission(f"q{serial}", tokens(serial * 7, length)))
        step = (frees, growths, tuple(admissions))
        (by_message, _), (by_column, command) = step_both_forms(states, clients, step_id, *step)
        num_granted += 0 if by_column.grants is None else len(by_column.grants.growth_index)
        assert by_column == by_message
        assert step_result_from_tree(step_result_to_tree(by_column)) == by_message
        request = pb.StepRequest(client_id=command.client_id, step_id=step_id)
        request.grants_in_columns = True
        request.growth_columns.request_ids.extend(g.request_id for g in growths)
        for a in admissions:
            request.admissions.add(request_id=a.request_id)
        assert convert.step_result_to_pb(by_column, request, command) == (
            convert.step_result_to_pb(by_message, request)
        )
        follow_answer(states, clients, running, step, by_message)
    assert num_granted >= 30, "the workload should cross into pages together often"


def plain_running(ahead: bool = False) -> tuple[ServiceState, tuple[str, int], list[str]]:
    """Ten requests of 7 tokens (r0..r9), one of 96 tokens with 50 computed ("long", a
    chunked prefill at max_model_len 96) and one request of another client ("theirs");
    with ``ahead``, r9's computed count runs 2 past its tokens (a lookahead growth of 3
    new tokens, 1 token id)."""
    state = ServiceState(FULL, Limits(), debug_invariants=True)
    me, other = scheduler(state), scheduler(state)
    ids = [f"r{i}" for i in range(10)]
    admissions = tuple(Admission(r, tokens(3 * i, 7)) for i, r in enumerate(ids))
    state.step(
        StepCommand(
            1.0,
            *me,
            1,
            admissions=(*admissions, Admission("long", tokens(1, 96), num_new_tokens=50)),
        )
    )
    state.step(StepCommand(1.0, *other, 1, admissions=(Admission("theirs", tokens(2, 5)),)))
    if ahead:
        lookahead = Growth("r9", 3, tokens(4, 1), num_lookahead_tokens=2)
        state.step(StepCommand(1.0, *me, 2, growths=(lookahead,)))
    return state, me, ids


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"r3": "zz"}, NotFound, "'zz' holds no pages"),
        ({"r3": "theirs"}, PermissionDenied, "'theirs' belongs to another client"),
        ({"r3": "r2"}, InvalidArgument, "'r2' is grown twice"),
        ({"frees": "r4"}, InvalidArgument, "'r4' is both freed and grown"),
        ({"token": -1}, InvalidArgument, "'r5': token ids must be >= 0"),
        ({"r3": "long"}, InvalidArgument, "'long': 97 tokens exceed max_model_len 96"),
        ({"ahead": True}, InvalidArgument, "'r9': 10 computed \\+ 1 new tokens exceed its 9"),
    ],
)
def test_plain_decode_columns_refused_as_in_full(change, error, match) -> None:
    """Columns vouched plain (``defaults_only``, as the wire conversion makes them) are
    checked by the rows' maxima; every problem still gets the full check's answer, and
    the step changes nothing."""
    state, me, ids = plain_running(ahead=bool(change.get("ahead")))
    step_id = 3
    ids = [change.get(r, r) for r in ids]
    toks = np.arange(10, dtype=np.int32)
    if "token" in change:
        toks[5] = change["token"]
    cols = GrowthColumns.decodes(ids, toks)
    assert cols.defaults_only
    frees = (change["frees"],) if "frees" in change else ()
    before = {r: state.request_info(r) for r in state.manager.request_ids()}
    queue = state.manager.pool.free_queue()
    with pytest.raises(error, match=match):
        state.step(StepCommand(2.0, *me, step_id, frees, growth_columns=cols))
    assert {r: state.request_info(r) for r in state.manager.request_ids()} == before
    assert state.manager.pool.free_queue() == queue


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_plain_decode_columns_match_messages(seed: int) -> None:
    """Plain decodes only, vouched (``defaults_only``), between frees and admissions until
    the pool runs dry: every answer, request and pool equals the messages' (and the
    unvouched columns')."""
    config = PoolConfig(num_pages=120, groups=(GroupConfig(GroupKind.FULL, 4),), max_model_len=96)
    states = [ServiceState(config, Limits(), debug_invariants=True) for _ in range(3)]
    clients = [scheduler(s) for s in states]
    rng = np.random.default_rng(seed)
    running: dict[str, int] = {}
    serial = num_refused = 0
    for step_id in range(1, 70):
        frees = tuple(r for r in running if rng.random() < 0.04)
        growths = [
            Growth(r, 1, tokens(int(rng.integers(0, 30)), 1))
            for r in running
            if r not in frees and running[r] < 90
        ]
        admissions = tuple(
            Admission(f"q{serial + j}", tokens((serial + j) % 5 * 8, int(rng.integers(5, 30))))
            for j in range(int(rng.integers(0, 4)) if len(running) < 40 else 0)
        )
        serial += len(admissions)
        vouched = columns_of(growths)
        vouched = dataclasses.replace(vouched, defaults_only=True)
        forms = [
            {"growths": tuple(growths)},
            {"growth_columns": columns_of(growths)},
            {"growth_columns": vouched},
        ]
        results = [
            state.step(StepCommand(1.0, *me, step_id, frees, admissions=admissions, **form))
            for state, me, form in zip(states, clients, forms, strict=True)
        ]
        assert results[0] == results[1] == results[2]
        step = (frees, growths, admissions)
        num_refused += follow_answer(states, clients, running, step, results[0])
    assert num_refused > 0, "the workload should run the pool dry at least once"


def test_plain_decodes_become_the_same_growths_without_the_arrays():
    """``checked_growths`` of plain decodes (``defaults_only``) takes no numpy reduction;
    the growths are those ``growths`` makes."""

    def fields(growths: tuple[Growth, ...]) -> list[tuple[object, ...]]:
        return [
            (
                g.request_id,
                g.num_new_tokens,
                g.new_token_ids.dtype,
                g.new_token_ids.tolist(),
                g.num_computed_tokens,
                g.num_lookahead_tokens,
            )
            for g in growths
        ]

    cols = decodes(["a", "b", "c"], [5, 6, 7])
    assert cols.defaults_only
    assert fields(cols.checked_growths()) == fields(cols.growths())
    assert fields(cols.checked_growths())[1] == ("b", 1, np.dtype(np.int32), [6], None, 0)
    varied = replace_column(cols, num_lookahead_tokens=np.array([0, 2, 0], dtype=np.int32))
    assert fields(varied.checked_growths()) == fields(varied.growths())


def _decode_twins() -> tuple[list[ServiceState], list[tuple[str, int]]]:
    """Two states running the same requests (r0..r11 of 5..38 tokens; r11 computed two
    short of its tokens), one checking decode columns in C and one in full."""
    config = PoolConfig(num_pages=128, groups=(GroupConfig(GroupKind.FULL, 4),), max_model_len=48)
    states = [ServiceState(config, Limits(), debug_invariants=True) for _ in range(2)]
    clients = [scheduler(s) for s in states]
    for state, me in zip(states, clients, strict=True):
        admissions = tuple(Admission(f"r{k}", tokens(k, 5 + 3 * k)) for k in range(12))
        state.step(StepCommand(1.0, *me, 1, admissions=admissions))
        state.step(StepCommand(1.0, *me, 2, frees=("r11",)))
        state.step(StepCommand(1.0, *me, 3, admissions=(Admission("r11", tokens(7, 38), 36),)))
    return states, clients


@needs_native_columns
@settings(max_examples=examples(300), deadline=None)
@given(data=st.data())
def test_decode_columns_checked_in_c_match_the_full_check(data) -> None:
    """Growth columns that are (nearly) all decodes, some carrying held-back tokens, some
    naming the pages they fill, some rows broken (counts, tokens, computed counts,
    lookahead, lengths, sizes, page hashes): the C pass
    (``decode_columns``) and the full check give the same refusal, word for word, or the
    same answers, requests, pools and events."""
    import pagekeeper.state as state_module

    states, clients = _decode_twins()
    ids = data.draw(st.permutations([f"r{k}" for k in range(12)]))
    ids = ids[: data.draw(st.integers(8, 12))]  # (fewer take the per-growth path)
    info = {r: states[0].request_info(r) for r in ids}
    num_new, counts, computed, ahead, toks = [], [], [], [], []
    for rid in ids:
        held = data.draw(st.integers(0, 3))
        tracked = info[rid].num_computed_tokens
        num_new.append(1)
        counts.append(held + 1)
        computed.append(-1 if held == 0 and data.draw(st.booleans()) else tracked + held)
        ahead.append(0)
        toks.extend(data.draw(st.integers(0, 99)) for _ in range(held + 1))
    columns = {
        "num_new_tokens": num_new,
        "num_new_token_ids": counts,
        "num_computed_tokens": computed,
        "num_lookahead_tokens": ahead,
    }
    for _ in range(data.draw(st.integers(0, 2))):  # break a row (or make it no decode)
        name = data.draw(st.sampled_from([*columns, "new_token_ids"]))
        target = toks if name == "new_token_ids" else columns[name]
        if target:
            at = data.draw(st.integers(0, len(target) - 1))
            target[at] = data.draw(st.integers(-3, 60))
    if data.draw(st.integers(0, 9)) == 0:
        toks.append(1)  # one token too many for the counts
    if data.draw(st.integers(0, 9)) == 0:
        columns["num_lookahead_tokens"] = [1] * len(ids)  # one lookahead for all
    hashes: dict[str, object] = {}
    if data.draw(st.booleans()):
        # Page hashes: mostly one for a row whose tokens complete a page, sometimes none,
        # two, one for a row completing none, or the request's previous page's.
        size = states[0].page_hash_size
        num_hashes, packed = [], b""
        for k, rid in enumerate(ids):
            count = max(0, columns["num_new_token_ids"][k])
            completes = (info[rid].num_tokens + count) // 4 > info[rid].num_tokens // 4
            num = data.draw(st.sampled_from([1, 1, 1, 0, 2]) if completes else st.just(0))
            if data.draw(st.integers(0, 19)) == 0:
                num = 1
            for j in range(num):
                h = bytes([k, j, data.draw(st.integers(0, 2))]) * (size // 3) + bytes(size % 3)
                if data.draw(st.integers(0, 19)) == 0:
                    h = states[0].manager.last_page_hash(rid) or h
                packed += h
            num_hashes.append(num)
        hashes = {"num_page_hashes": np.array(num_hashes, dtype=np.int32)}
        hashes["packed_page_hashes"] = packed
    cols = GrowthColumns(
        request_ids=tuple(ids),
        new_token_ids=np.array(toks, dtype=np.int32),
        **{k: np.array(v, dtype=np.int32) for k, v in columns.items()},
        **hashes,  # type: ignore[arg-type]
    )
    outcomes = []
    for state, me, native in zip(states, clients, (True, False), strict=True):
        saved = state_module.decode_columns
        state_module.decode_columns = saved if native else None
        try:
            result = state.step(StepCommand(2.0, *me, 4, growth_columns=cols))
            outcomes.append(("ok", result.results, result.grants))
        except PagekeeperError as exc:
            outcomes.append((type(exc).__name__, str(exc)))
        finally:
            state_module.decode_columns = saved
    assert outcomes[0] == outcomes[1]
    for rid in (f"r{k}" for k in range(12)):
        assert states[0].request_info(rid) == states[1].request_info(rid)
    assert states[0].manager.pool.free_queue() == states[1].manager.pool.free_queue()
    assert list(states[0]._events) == list(states[1]._events)


@needs_native_columns
def test_held_decode_columns_take_the_c_pass() -> None:
    """What a client holding back decodes sends (every row a decode, some carrying held
    tokens with their computed count) is checked by ``decode_columns`` alone and applied
    as one run."""
    import pagekeeper.state as state_module

    states, clients = _decode_twins()
    state, me = states[0], clients[0]
    calls: list[object] = []
    real = state_module.decode_columns

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    ids = [f"r{k}" for k in range(12)]
    info = {r: state.request_info(r) for r in ids}
    # r2 carries two held-back tokens, r11 names its count, the rest are plain.
    counts = [3 if r == "r2" else 1 for r in ids]
    computed = [-1] * 12
    computed[2] = info["r2"].num_computed_tokens + 2
    computed[11] = info["r11"].num_computed_tokens
    cols = GrowthColumns(
        request_ids=tuple(ids),
        num_new_tokens=np.ones(12, dtype=np.int32),
        new_token_ids=np.arange(14, dtype=np.int32),
        num_new_token_ids=np.array(counts, dtype=np.int32),
        num_computed_tokens=np.array(computed, dtype=np.int32),
        num_lookahead_tokens=np.zeros(12, dtype=np.int32),
    )
    state_module.decode_columns = spy
    try:
        state.step(StepCommand(2.0, *me, 4, growth_columns=cols))
    finally:
        state_module.decode_columns = real
    assert calls == [([0, 1, 4, *range(5, 14)], {"r2": [2, 3]}, 0)]
    assert state.request_info("r2").num_tokens == info["r2"].num_tokens + 3
    assert state.request_info("r11").num_computed_tokens == info["r11"].num_computed_tokens + 1
