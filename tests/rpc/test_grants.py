"""``grants_in_columns``: the growths a step granted pages, answered in three int32 columns
instead of one ``AllocationResult`` each, and the same answer either way."""

from __future__ import annotations

import numpy as np

from pagekeeper.rpc import convert
from pagekeeper.state import AllocationOutcome, AllocationStatus, StepResult
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

OK, NO_CAPACITY = AllocationStatus.OK, AllocationStatus.NO_CAPACITY


def i32(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def result(*outcomes: AllocationOutcome) -> StepResult:
    return StepResult(
        step_id=3,
        listed=outcomes,
        is_published=False,
        published_slot=-1,
        unscheduled_request_ids=(),
        num_free_pages=10,
        last_event_seq=0,
        publish_error="",
    )


def request(
    growth_ids: list[str], admissions: list[str], *, columns: bool = True
) -> pb.StepRequest:
    req = pb.StepRequest(client_id="c", step_id=3, grants_in_columns=True)
    if columns:
        req.growth_columns.request_ids.extend(growth_ids)
    else:
        req.growths.extend(pb.Growth(request_id=r) for r in growth_ids)
    req.admissions.extend(pb.Admission(request_id=r) for r in admissions)
    return req


# Growths a..e were sent; b and e got pages (two groups), d was refused; one admission.
OUTCOMES = (
    AllocationOutcome("b", OK, new_page_ids=((7,), ())),
    AllocationOutcome("d", NO_CAPACITY),
    AllocationOutcome("e", OK, new_page_ids=((8, 9), (3,))),
    AllocationOutcome(
        "x", OK, num_cached_tokens=4, new_page_ids=((5,), (6,)), hit_page_ids=((1,), (2,))
    ),
)


def test_granted_growths_travel_in_columns_the_rest_as_results() -> None:
    for columns in (True, False):
        response = convert.step_result_to_pb(
            result(*OUTCOMES), request(list("abcde"), ["x"], columns=columns)
        )
        grants = response.grants
        assert i32(grants.growth_index) == [1, 4]  # b and e among the request's growths
        assert i32(grants.num_pages) == [1, 0, 2, 1]  # per growth, per group
        assert i32(grants.page_ids) == [7, 8, 9, 3]
        assert [r.request_id for r in response.results] == ["d", "x"]
        assert response.results[0].status == pb.ALLOCATION_STATUS_NO_CAPACITY
        assert i32(response.results[1].hit_page_ids[0]) == [1]


def test_without_the_flag_every_outcome_is_a_result() -> None:
    req = request(list("abcde"), ["x"])
    req.grants_in_columns = False
    response = convert.step_result_to_pb(result(*OUTCOMES), req)
    assert not response.HasField("grants")
    assert [r.request_id for r in response.results] == ["b", "d", "e", "x"]
    assert convert.step_result_to_pb(result(*OUTCOMES)) == response  # no request: the same


def test_outcomes_that_do_not_line_up_with_the_request_fall_back_to_results() -> None:
    # A granted growth the request does not name (a retry whose request differs).
    response = convert.step_result_to_pb(result(*OUTCOMES), request(list("abcd"), ["x"]))
    assert not response.HasField("grants")
    assert [r.request_id for r in response.results] == ["b", "d", "e", "x"]
    # Only admissions: nothing to put in columns.
    response = convert.step_result_to_pb(result(OUTCOMES[3]), request([], ["x"]))
    assert not response.HasField("grants") and len(response.results) == 1
    # Only refused growths: no grants, the refusals listed.
    response = convert.step_result_to_pb(result(OUTCOMES[1]), request(list("abcd"), []))
    assert not response.HasField("grants") and [r.request_id for r in response.results] == ["d"]


def test_the_command_made_of_the_request_gives_the_same_answer() -> None:
    """The servicer passes what step_from_pb made of the request (its growth ids are
    Python strings already); the answer is the one built from the message alone."""
    cases = [
        (OUTCOMES, request(list("abcde"), ["x"])),
        (OUTCOMES, request(list("abcde"), ["x"], columns=False)),
        (OUTCOMES, request(list("abcd"), ["x"])),  # does not line up: all results
        ((OUTCOMES[1],), request(list("abcd"), [])),
        ((OUTCOMES[3],), request([], ["x"])),
    ]
    for outcomes, req in cases:
        command = convert.step_from_pb(req, 0.0)
        with_command = convert.step_result_to_pb(result(*outcomes), req, command)
        assert with_command == convert.step_result_to_pb(result(*outcomes), req)
    granted = convert.step_result_to_pb(
        result(*OUTCOMES), cases[0][1], convert.step_from_pb(cases[0][1], 0.0)
    )
    assert i32(granted.grants.growth_index) == [1, 4]


def test_growths_the_state_kept_as_columns_travel_as_they_are() -> None:
    """A result whose crossings the state kept as columns (``GrowthGrants``): the grant
    columns come from them directly, merged in growth order with any listed grant, and
    without the flag every outcome is listed in growth order, as if built one by one."""
    from dataclasses import replace

    from pagekeeper.state import GrowthGrants

    ids = list("abcde")
    refused = AllocationOutcome("d", NO_CAPACITY)
    admitted = OUTCOMES[3]
    only_columns = replace(
        result(refused, admitted), grants=GrowthGrants(ids, [0, 1, 4], [7, 8, 9], 1)
    )
    req = request(ids, ["x"])
    response = convert.step_result_to_pb(only_columns, req)
    assert i32(response.grants.growth_index) == [0, 1, 4]
    assert i32(response.grants.num_pages) == [1, 1, 1]
    assert i32(response.grants.page_ids) == [7, 8, 9]
    assert [r.request_id for r in response.results] == ["d", "x"]
    # A listed grant of several pages (growth 2) between the columns' growths.
    listed_too = replace(
        result(AllocationOutcome("c", OK, new_page_ids=((5, 6),)), refused, admitted),
        grants=GrowthGrants(ids, [0, 1, 4], [7, 8, 9], 2),
    )
    response = convert.step_result_to_pb(listed_too, req)
    assert i32(response.grants.growth_index) == [0, 1, 2, 4]
    assert i32(response.grants.num_pages) == [1, 1, 2, 1]
    assert i32(response.grants.page_ids) == [7, 8, 5, 6, 9]
    assert [o.request_id for o in listed_too.results] == ["a", "b", "c", "d", "e", "x"]
    req.grants_in_columns = False
    response = convert.step_result_to_pb(listed_too, req)
    assert [r.request_id for r in response.results] == ["a", "b", "c", "d", "e", "x"]
    assert i32(response.results[2].new_page_ids[0]) == [5, 6]
