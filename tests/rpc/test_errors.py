"""Every gRPC error code, provoked on purpose; each rejected call leaves the state unchanged.

The state is compared through the REST introspection API (pages, requests with their page
tables, clients with generations and last step ids, the KV event sequence) before and after.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from tests.helpers.grpc_util import Scheduler, error_of, i32, state_digest


@pytest.fixture
def populated(pagekeeper_server):
    """Two schedulers; the first runs two requests."""
    owner = Scheduler(pagekeeper_server, "owner")
    rng = np.random.default_rng(7)
    for rid in ("err-a", "err-b"):
        tokens = rng.integers(0, 30_000, 50).tolist()
        assert owner.admit(f"{owner.client_id}-{rid}", tokens).status == pb.ALLOCATION_STATUS_OK
    other = Scheduler(pagekeeper_server, "other")
    yield owner, other
    owner.stub.Unregister(
        pb.UnregisterRequest(client_id=owner.client_id, generation=owner.generation),
        metadata=owner.md,
    )


def _rid(owner: Scheduler, name: str) -> str:
    return f"{owner.client_id}-{name}"


def _bad_steps(owner: Scheduler, other: Scheduler):
    """(expected code, fragment of the reason, who sends it, StepRequest)."""
    a, b = _rid(owner, "err-a"), _rid(owner, "err-b")
    long_prompt = i32(range(4097))  # max_model_len is 4096
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a whole number of int32",
        owner,
        owner.request(admissions=[pb.Admission(request_id="x", token_ids=b"\x01\x02\x03")]),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "exceed max_model_len",
        owner,
        # A valid free first: the whole step is refused, so the free does not happen either.
        owner.request(
            free_request_ids=[b], admissions=[pb.Admission(request_id="x", token_ids=long_prompt)]
        ),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "exceed max_model_len",
        owner,
        owner.request(
            growths=[pb.Growth(request_id=a, num_new_tokens=1, new_token_ids=i32(range(4050)))]
        ),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "freed twice",
        owner,
        owner.request(free_request_ids=[a, a]),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "both freed and grown",
        owner,
        owner.request(free_request_ids=[a], growths=[pb.Growth(request_id=a, num_new_tokens=1)]),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "num_new_tokens must be >= 1",
        owner,
        owner.request(growths=[pb.Growth(request_id=a, num_new_tokens=0)]),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "appears twice in the batch",
        owner,
        owner.request(free_request_ids=[b], batch=pb.Batch(request_ids=[a, a])),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "token ids must be >= 0",
        owner,
        owner.request(admissions=[pb.Admission(request_id="neg", token_ids=i32([1, -5]))]),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "step_id must be in [1, 2**63 - 1], got 0",
        owner,
        pb.StepRequest(client_id=owner.client_id, generation=owner.generation, step_id=0),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "step_id must be in [1, 2**63 - 1], got 9223372036854775808",
        owner,
        pb.StepRequest(client_id=owner.client_id, generation=owner.generation, step_id=2**63),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "repeats",
        owner,
        owner.request(
            admissions=[
                pb.Admission(
                    request_id="rep", token_ids=i32(list(range(40))), page_hashes=[b"h" * 32] * 2
                )
            ]
        ),
    )
    for fragment, fields in (
        ("repeats", {"packed_page_hashes": b"h" * 64}),
        ("not a whole number of 32-byte hashes", {"packed_page_hashes": b"h" * 48}),
        ("3 page hashes for 40 tokens (at most 2)", {"packed_page_hashes": bytes(range(96))}),
        (
            "page_hashes and packed_page_hashes both set",
            {"packed_page_hashes": bytes(range(32)), "page_hashes": [b"h" * 32]},
        ),
    ):
        yield (
            grpc.StatusCode.INVALID_ARGUMENT,
            fragment,
            owner,
            # A valid admission first: the whole step is refused.
            owner.request(
                admissions=[
                    pb.Admission(request_id="fine", token_ids=i32(list(range(40)))),
                    pb.Admission(request_id="packed", token_ids=i32(list(range(40))), **fields),
                ]
            ),
        )
    yield (
        grpc.StatusCode.NOT_FOUND,
        "holds no pages",
        owner,
        owner.request(free_request_ids=[b, "no-such-request"]),
    )
    yield (
        grpc.StatusCode.NOT_FOUND,
        "not registered",
        owner,
        pb.StepRequest(client_id="scheduler-999999", generation=1, step_id=1),
    )
    yield (
        grpc.StatusCode.ALREADY_EXISTS,
        "already holds pages",
        owner,
        owner.request(
            free_request_ids=[b], admissions=[pb.Admission(request_id=a, token_ids=i32([1, 2]))]
        ),
    )
    yield (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "max_requests_per_step",
        owner,
        owner.request(free_request_ids=[f"r{i}" for i in range(1025)]),
    )
    yield (
        grpc.StatusCode.PERMISSION_DENIED,
        "belongs to another client",
        other,
        other.request(free_request_ids=[a]),
    )
    yield (
        grpc.StatusCode.PERMISSION_DENIED,
        "belongs to another client",
        other,
        other.request(batch=pb.Batch(request_ids=[b])),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "not both",
        owner,
        owner.request(
            growths=[pb.Growth(request_id=a, num_new_tokens=1, new_token_ids=i32([1]))],
            growth_columns=pb.GrowthColumns(request_ids=[b], new_token_ids=i32([2])),
        ),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "token ids must be >= 0",
        owner,
        # A valid free and a valid decode first: nothing of the step happens.
        owner.request(
            free_request_ids=[b],
            growth_columns=pb.GrowthColumns(request_ids=[a], new_token_ids=i32([-1])),
        ),
    )
    yield (
        grpc.StatusCode.INVALID_ARGUMENT,
        "growth_columns.num_new_tokens has 1 entries for 2 growths",
        owner,
        owner.request(
            free_request_ids=[b],
            growth_columns=pb.GrowthColumns(
                request_ids=[a, b], new_token_ids=i32([1, 2]), num_new_tokens=i32([1])
            ),
        ),
    )
    yield (
        grpc.StatusCode.PERMISSION_DENIED,
        "belongs to another client",
        other,
        other.request(growth_columns=pb.GrowthColumns(request_ids=[a], new_token_ids=i32([1]))),
    )
    yield (
        grpc.StatusCode.ABORTED,
        "is not the current registration",
        owner,
        pb.StepRequest(
            client_id=owner.client_id,
            generation=owner.generation + 5,
            step_id=owner.step_id + 100,
            free_request_ids=[a],
        ),
    )


def test_every_bad_step_is_rejected_whole(pagekeeper_server, populated):
    owner, other = populated
    for code, reason, sender, request in _bad_steps(owner, other):
        before = state_digest(pagekeeper_server)
        error = error_of(sender.stub.Step, request, metadata=sender.md)
        assert error.code() == code, (code, reason, error.details())
        assert reason in error.details(), (reason, error.details())
        assert state_digest(pagekeeper_server) == before, (code, reason)


def test_a_rejected_step_id_can_be_reused(pagekeeper_server, populated):
    owner, _ = populated
    bad = owner.request(free_request_ids=["no-such-request"])
    assert error_of(owner.stub.Step, bad, metadata=owner.md).code() == grpc.StatusCode.NOT_FOUND
    good = pb.StepRequest(
        client_id=owner.client_id,
        generation=owner.generation,
        step_id=bad.step_id,
        free_request_ids=[_rid(owner, "err-b")],
    )
    reply = owner.stub.Step(good, metadata=owner.md)
    assert not reply.is_retry


def test_unauthenticated_changes_nothing(pagekeeper_server, populated):
    owner, _ = populated
    before = state_digest(pagekeeper_server)
    request = owner.request(free_request_ids=[_rid(owner, "err-a")])
    error = error_of(owner.stub.Step, request, metadata=(("authorization", "Bearer wrong"),))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert state_digest(pagekeeper_server) == before


def test_client_limit(server_factory):
    server = server_factory("--max-clients", "1")
    Scheduler(server)
    error = error_of(
        server.stub().RegisterClient, pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER)
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_clients 1" in error.details()
    error = error_of(server.stub().RegisterClient, pb.RegisterClientRequest())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_message_size_limit(server_factory):
    server = server_factory("--max-message-bytes", "4096")
    sched = Scheduler(server)
    before = state_digest(server)
    big = sched.request(admissions=[pb.Admission(request_id="big", token_ids=i32(range(2000)))])
    assert error_of(sched.stub.Step, big).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert state_digest(server) == before
