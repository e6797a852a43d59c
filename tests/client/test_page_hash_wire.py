"""How the client sends page hashes: an admission's packed into one field
(``packed_page_hashes``) when the service says its page-hash size and every hash has it,
else one field each (a service from before the packed field, or hashes of other sizes,
which the service then checks as they are); a growth's the same way in its ``Growth``
message, or packed in the step's growth columns, which carry them only when every hash is
of the service's size (else the step's growths go as messages)."""

from __future__ import annotations

import dataclasses

import pytest

from pagekeeper_client.client import SchedulerState
from pagekeeper_client.errors import InvalidArgumentError
from pagekeeper_client.types import GroupInfo, GroupKind, PoolConfig

POOL = PoolConfig(
    num_pages=64,
    groups=(GroupInfo(0, GroupKind.FULL, 4),),
    enable_prefix_caching=True,
    hash_algorithm="sha256_cbor",
    max_model_len=256,
    page_hash_size=32,
)


def _message(pool: PoolConfig, hashes: list[bytes]):
    admission = SchedulerState(pool).plan_admission(
        "a",
        list(range(12)),
        num_new_tokens=0,
        extra_keys=None,
        page_hashes=hashes,
        num_lookahead_tokens=0,
        enable_cache_read=True,
    )
    return admission.message


def test_hashes_of_the_pool_size_travel_packed() -> None:
    hashes = [bytes([i]) * 32 for i in range(3)]
    message = _message(POOL, hashes)
    assert message.packed_page_hashes == b"".join(hashes)
    assert list(message.page_hashes) == []


def test_other_hashes_or_an_older_service_get_a_field_each() -> None:
    mixed = [b"\x01" * 32, b"\x02" * 16]
    assert list(_message(POOL, mixed).page_hashes) == mixed
    older = dataclasses.replace(POOL, page_hash_size=0)
    hashes = [bytes([i]) * 32 for i in range(3)]
    message = _message(older, hashes)
    assert list(message.page_hashes) == hashes and message.packed_page_hashes == b""
    assert _message(POOL, []).packed_page_hashes == b""


def test_lookups_send_them_the_same_way() -> None:
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
    from pagekeeper_client.client import put_page_hashes

    hashes = [bytes([i]) * 32 for i in range(3)]
    packed = pb.LookupRequest()
    put_page_hashes(packed, hashes, 32)
    assert packed.packed_page_hashes == b"".join(hashes) and not packed.page_hashes
    one_each = pb.LookupRequest()
    put_page_hashes(one_each, hashes, 0)
    assert list(one_each.page_hashes) == hashes and not one_each.packed_page_hashes


# -- a growth's page hashes ----------------------------------------------------------------

GROWING = dataclasses.replace(POOL, accepts_growth_page_hashes=True)
"""Pages of 4 tokens, page hashes of 32 bytes, a service that takes a growth's hashes."""


def _h(i: int, width: int = 32) -> bytes:
    return bytes([i]) * width


def _running(
    pool: PoolConfig = GROWING, *, hold: bool = False, **requests: tuple[int, int]
) -> SchedulerState:
    """A scheduler state holding ``name=(num_tokens, num_computed_tokens)`` requests, each
    with the pages its tokens need (plus one spare); ``hold``: it holds back decodes that
    complete no page."""
    from pagekeeper_client.client import _Tracked

    state = SchedulerState(pool, hold_decodes=hold)
    first = 1
    for name, (num_tokens, computed) in requests.items():
        n = num_tokens // 4 + 1
        state.requests[name] = _Tracked(num_tokens, computed, [list(range(first, first + n))])
        first += n
    return state


def _grow(state: SchedulerState, rid: str, tokens: list[int], hashes=None, **kwargs):
    growth = state.plan_growth(
        rid,
        kwargs.pop("num_new_tokens", len(tokens)),
        tokens,
        kwargs.pop("num_computed_tokens", None),
        0,
        hashes,
    )
    state.queue_growth(growth)
    return growth


def _step(state: SchedulerState):
    return state.prepare_step(
        client_id="c", generation=1, step_id=1, batch=None, num_scheduled_tokens=None
    ).request


def _i32(data: bytes) -> list[int]:
    import numpy as np

    return np.frombuffer(data, dtype="<i4").tolist()


def test_pool_config_says_whether_the_service_takes_growth_hashes() -> None:
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
    from pagekeeper_client.client import pool_from_pb

    message = pb.PoolConfig(num_pages=8, page_hash_size=32)
    assert not pool_from_pb(message).accepts_growth_page_hashes  # an older service
    message.accepts_growth_page_hashes = True
    assert pool_from_pb(message).accepts_growth_page_hashes


def test_a_decode_step_without_hashes_keeps_its_plain_columns() -> None:
    state = _running(a=(8, 8), b=(5, 5))
    _grow(state, "a", [1])
    _grow(state, "b", [2])
    request = _step(state)
    columns = request.growth_columns
    assert list(columns.request_ids) == ["a", "b"] and _i32(columns.new_token_ids) == [1, 2]
    assert columns.num_page_hashes == b"" and columns.packed_page_hashes == b""
    assert columns.num_new_tokens == b"" and not request.growths


def test_hashes_of_one_size_ride_packed_in_the_columns() -> None:
    # b's decode completes its page 1 (tokens 4..7); c's chunk completes pages 2 and 3.
    for width, wire_width in ((32, 0), (16, 16)):  # 0: the service's own size
        state = _running(a=(8, 8), b=(7, 7), c=(8, 8))
        _grow(state, "a", [1])
        b = _grow(state, "b", [2], [_h(1, width)])
        assert b.is_plain and not b.is_held  # a plain decode, with its page's hash
        _grow(state, "c", list(range(8)), [_h(2, width), _h(3, width)])
        request = _step(state)
        columns = request.growth_columns
        assert list(columns.request_ids) == ["a", "b", "c"] and not request.growths
        assert _i32(columns.num_page_hashes) == [0, 1, 2]
        assert columns.packed_page_hashes == _h(1, width) + _h(2, width) + _h(3, width)
        assert columns.page_hash_size == wire_width


def test_plain_decodes_with_hashes_leave_the_count_columns_out() -> None:
    """A decode step whose rows are plain decodes, some naming the page they fill: the
    service's plain-decode form (ids, tokens and the hash columns only)."""
    state = _running(a=(8, 8), b=(7, 7), c=(3, 3))
    _grow(state, "a", [1])
    _grow(state, "b", [2], [_h(1)])
    _grow(state, "c", [3], [_h(2)])
    columns = _step(state).growth_columns
    assert _i32(columns.num_page_hashes) == [0, 1, 1]
    assert columns.packed_page_hashes == _h(1) + _h(2) and columns.page_hash_size == 0
    for name in ("num_new_tokens", "num_new_token_ids", "num_computed_tokens"):
        assert getattr(columns, name) == b"", name


def test_hashes_of_several_sizes_send_the_steps_growths_as_messages() -> None:
    state = _running(a=(8, 8), b=(7, 7), c=(8, 8))
    _grow(state, "a", [1])
    _grow(state, "b", [2], [_h(1)])  # the service's size: left 0
    _grow(state, "c", list(range(8)), [_h(2, 16), _h(3, 16)], num_computed_tokens=8)
    request = _step(state)
    assert not request.HasField("growth_columns")
    a, b, c = request.growths
    assert (a.request_id, a.num_new_tokens, _i32(a.new_token_ids)) == ("a", 1, [1])
    assert not a.HasField("num_computed_tokens") and not a.packed_page_hashes
    assert (b.packed_page_hashes, b.page_hash_size) == (_h(1), 0)
    assert (c.packed_page_hashes, c.page_hash_size) == (_h(2, 16) + _h(3, 16), 16)
    assert c.num_computed_tokens == 8 and c.num_new_tokens == 8


def test_held_back_decodes_travel_with_the_growth_that_names_the_page() -> None:
    state = _running(hold=True, b=(5, 5))
    for token in (6, 7):  # complete no page: held back
        assert _grow(state, "b", [token]).is_held
    with pytest.raises(InvalidArgumentError, match="2 page hashes for the 1 pages"):
        _grow(state, "b", [8], [_h(1), _h(2)])  # the service holds 5 tokens: page 1 only
    growth = _grow(state, "b", [8], [_h(1)])
    request = _step(state)
    assert _i32(request.growth_columns.new_token_ids) == [6, 7, 8] and growth.page_hashes


def test_a_growth_with_hashes_is_never_held_back() -> None:
    # Computed trails the tokens: this decode completes no computed page (it would be
    # held back), but its token completes page 1, which its hash names.
    state = _running(hold=True, b=(7, 5))
    assert _grow(state, "b", [8]).is_held
    state = _running(hold=True, b=(7, 5))
    growth = _grow(state, "b", [8], [_h(1)])
    assert not growth.is_held and state._growths == [growth]


@pytest.mark.parametrize(
    ("hashes", "match"),
    [
        ([_h(1), _h(2)], "2 page hashes for the 1 pages"),
        ([_h(1), _h(1)], "repeats"),
        ([b""], "one size in"),
        ([_h(1, 65)], "one size in"),
        (["ab"], "must be bytes"),
    ],
)
def test_bad_hashes_are_refused_before_anything_changes(hashes, match) -> None:
    state = _running(b=(7, 7))
    with pytest.raises(InvalidArgumentError, match=match):
        _grow(state, "b", [8], hashes)
    t = state.requests["b"]
    assert (t.num_tokens, t.num_computed_tokens, t.pending) == (7, 7, None)
    assert not state.has_queued and not state._has_growth_hashes


def test_a_service_that_does_not_take_them_is_told_loudly_not_ignored() -> None:
    from pagekeeper_client.errors import UnimplementedError

    state = _running(POOL, b=(7, 7))
    with pytest.raises(UnimplementedError, match="does not take a growth's page hashes"):
        _grow(state, "b", [8], [_h(1)])
    assert state.requests["b"].num_tokens == 7 and not state.has_queued
    assert not _grow(state, "b", [8], []).page_hashes  # none given: goes as ever


def test_no_capacity_keeps_nothing_and_the_retry_sends_them_again() -> None:
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
    from pagekeeper_client.types import AllocationStatus

    state = _running(b=(8, 8))
    state.requests["b"].pages[0] = [1, 2]  # full: the chunk needs pages
    _grow(state, "b", list(range(8)), [_h(2), _h(3)])
    prepared = state.prepare_step(
        client_id="c", generation=1, step_id=1, batch=None, num_scheduled_tokens=None
    )
    response = pb.StepResponse(step_id=1)
    response.results.add(request_id="b", status=pb.ALLOCATION_STATUS_NO_CAPACITY)
    result = state.apply_step(prepared, response)
    assert result.results[0].status is AllocationStatus.NO_CAPACITY
    t = state.requests["b"]
    assert (t.num_tokens, t.num_computed_tokens) == (8, 8)
    assert not state._has_growth_hashes
    _grow(state, "b", list(range(8)), [_h(2), _h(3)])  # the same pages again: accepted
    assert _step(state).growth_columns.packed_page_hashes == _h(2) + _h(3)


def test_taking_a_hashed_growth_back_forgets_its_hashes() -> None:
    state = _running(a=(8, 8), b=(7, 7))
    growth = _grow(state, "b", [8], [_h(1)])
    _grow(state, "a", [1])
    state.withdraw_growth(growth)
    assert not state._has_growth_hashes and state.requests["b"].num_tokens == 7
    assert _step(state).growth_columns.num_page_hashes == b""
    _grow(state, "b", [8], [_h(1)])
    state.discard_queued()
    assert not state._has_growth_hashes and state.requests["b"].num_tokens == 7


def test_a_decode_step_names_the_pages_its_rows_complete() -> None:
    state = _running(hold=True, a=(8, 8), b=(7, 7))
    with pytest.raises(InvalidArgumentError, match="do not decode"):
        state.plan_decodes(["a", "b"], [1, 2], 0, {"c": _h(1)})
    with pytest.raises(InvalidArgumentError, match="1 page hashes for the 0 pages"):
        state.plan_decodes(["a", "b"], [1, 2], 0, {"a": _h(1)})
    assert state.requests["a"].num_tokens == 8 and state.requests["b"].num_tokens == 7
    plan = state.plan_decodes(["a", "b"], [1, 2], 0, {"b": _h(1)})
    assert plan.has_page_hashes and [g.request_id for g in plan.growths] == ["b"]
    assert [t for t in plan.held] == [state.requests["a"]]  # a completes nothing: held
    state.queue_decodes(plan)
    columns = _step(state).growth_columns
    assert list(columns.request_ids) == ["b"] and columns.packed_page_hashes == _h(1)


def test_one_growths_hashes_must_share_one_size() -> None:
    state = _running(c=(8, 8))
    with pytest.raises(InvalidArgumentError, match=r"one size .* got \[16, 32\]"):
        _grow(state, "c", list(range(8)), [_h(2), _h(3, 16)])
    assert state.requests["c"].num_tokens == 8 and not state.has_queued


def test_without_the_services_size_every_size_is_said() -> None:
    state = _running(dataclasses.replace(GROWING, page_hash_size=0), b=(7, 7))
    _grow(state, "b", [2], [_h(1)])
    columns = _step(state).growth_columns
    assert (columns.packed_page_hashes, columns.page_hash_size) == (_h(1), 32)


def test_a_decode_steps_hashes_plan_as_its_rows_one_by_one() -> None:
    """A decode step of many rows (held decodes, rows completing a page with and without a
    name, one crossing into a page) planned at once gives the queue, the held decodes and
    the wire of the same decodes planned one by one."""
    lengths = {f"r{k}": 5 + k for k in range(12)}  # 4-token pages: staggered in them
    named = {r: _h(k + 1) for k, r in enumerate(lengths) if (lengths[r] + 1) % 4 == 0}
    named.pop("r2")  # a row completing its page without a name: the service hashes it
    steps = []
    for batch in (True, False):
        state = _running(hold=True, **{r: (n, n) for r, n in lengths.items()})
        ids = list(lengths)
        tokens = [30 + k for k in range(len(ids))]
        if batch:
            state.queue_decodes(state.plan_decodes(ids, tokens, 0, named))
        else:
            for rid, token in zip(ids, tokens, strict=True):
                h = named.get(rid)
                growth = state.plan_growth(rid, 1, [token], None, 0, None if h is None else [h])
                if not growth.is_held:
                    state.queue_growth(growth)
        steps.append((_step(state), {r: state.requests[r].num_tokens for r in ids}))
    (batched, counts), (single, single_counts) = steps
    assert counts == single_counts
    assert batched.growth_columns == single.growth_columns
    assert _i32(batched.growth_columns.num_page_hashes).count(1) == len(named) > 0
