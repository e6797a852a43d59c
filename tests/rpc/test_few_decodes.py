"""A few plain decodes in column form (the count columns left out, one token each) are
handed to the state as growths by the wire conversion, as the state would make them; any
other column form stays columns, for the state's own checks and refusals."""

from __future__ import annotations

import numpy as np

from pagekeeper.rpc import convert
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb


def _step(ids: list[str], tokens: list[int], **columns: bytes) -> pb.StepRequest:
    request = pb.StepRequest(client_id="c", step_id=1)
    request.growth_columns.request_ids.extend(ids)
    request.growth_columns.new_token_ids = np.array(tokens, dtype="<i4").tobytes()
    for name, value in columns.items():
        setattr(request.growth_columns, name, value)
    return request


def test_a_few_plain_decodes_become_growths() -> None:
    command = convert.step_from_pb(_step(["a", "b", "c"], [7, 8, 9]), 1.0)
    assert command.growth_columns is None
    got = [
        (g.request_id, g.num_new_tokens, g.new_token_ids.tolist(), g.num_computed_tokens,
         g.num_lookahead_tokens)
        for g in command.growths
    ]  # fmt: skip
    assert got == [("a", 1, [7], None, 0), ("b", 1, [8], None, 0), ("c", 1, [9], None, 0)]


def test_anything_else_stays_columns() -> None:
    many = [f"r{i}" for i in range(8)]
    cases = [
        _step(many, list(range(8))),  # as many as the column path takes
        _step(["a", "b"], [7, 8, 9]),  # tokens that do not add up: the state refuses
        _step(["a"], [7], num_lookahead_tokens=np.array([2], dtype="<i4").tobytes()),
    ]
    both = _step(["a"], [7])
    both.growths.append(pb.Growth(request_id="b", num_new_tokens=1))  # the state refuses
    cases.append(both)
    for request in cases:
        command = convert.step_from_pb(request, 1.0)
        assert command.growth_columns is not None
        assert command.growth_columns.request_ids == tuple(request.growth_columns.request_ids)
