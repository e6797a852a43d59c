"""The client's read of ``StepResponse.grants``: one result per granted growth, sliced from
three int32 columns, and a clear error when the columns do not fit the step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pagekeeper_client import InternalError
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.client import SchedulerState
from pagekeeper_client.types import AllocationStatus, GroupInfo, GroupKind, PoolConfig

POOL = PoolConfig(
    num_pages=64,
    groups=(
        GroupInfo(0, GroupKind.FULL, 4),
        GroupInfo(1, GroupKind.SLIDING_WINDOW, 4, window=8),
    ),
    enable_prefix_caching=True,
    hash_algorithm="sha256_cbor",
    max_model_len=256,
)


def answer(index: list[int], counts: list[int], pages: list[int]) -> pb.StepResponse:
    response = pb.StepResponse(step_id=1)
    grants = response.grants
    grants.growth_index = np.array(index, "<i4").tobytes()
    grants.num_pages = np.array(counts, "<i4").tobytes()
    grants.page_ids = np.array(pages, "<i4").tobytes()
    return response


def prepared(*ids: str) -> SimpleNamespace:
    return SimpleNamespace(growths=[SimpleNamespace(request_id=r) for r in ids])


def test_grants_become_one_result_per_growth_in_every_group() -> None:
    state = SchedulerState(POOL)
    got = state._grants(prepared("a", "b", "c"), answer([0, 2], [1, 0, 2, 1], [7, 8, 9, 3]))
    assert list(got) == ["a", "c"]
    assert got["a"].status is AllocationStatus.OK and got["a"].num_cached_tokens == 0
    assert [p.tolist() for p in got["a"].new_page_ids] == [[7], []]
    assert [p.tolist() for p in got["c"].new_page_ids] == [[8, 9], [3]]
    assert state._grants(prepared("a"), pb.StepResponse(step_id=1)) == {}  # none sent


@pytest.mark.parametrize(
    ("index", "counts", "pages"),
    [
        ([0], [1], [7]),  # one count for two groups
        ([0], [1, 1], [7]),  # counts promise more pages than sent
        ([3], [1, 0], [7]),  # no growth 3 in this step
        ([-1], [1, 0], [7]),
        ([1, 1], [1, 0, 1, 0], [7, 8]),  # one growth granted twice
    ],
)
def test_grants_that_do_not_fit_the_step_are_an_internal_error(index, counts, pages) -> None:
    with pytest.raises(InternalError):
        SchedulerState(POOL)._grants(prepared("a", "b", "c"), answer(index, counts, pages))
