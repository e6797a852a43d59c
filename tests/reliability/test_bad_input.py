"""Hostile input: every refusal is precise and changes nothing.

Random and mutated protobuf bytes go to every RPC through grpc's generic (raw bytes) calls;
then the targeted cases: ids that do not exist or belong to another client, tokens past
``max_model_len``, kernel block sizes that do not divide the page, oversized messages and
steps over the limits. A refused call must answer one of the documented status codes
(never UNKNOWN or INTERNAL) and leave the state digest (pages, requests with their tables,
clients with generations and step ids, event sequence) exactly as it was. The service runs
with ``--debug-invariants``; schemathesis covers the REST API (tests/rest).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from tests.helpers.grpc_util import Scheduler, i32, state_digest, status_of
from tests.helpers.server import RunningServer, launch
from tests.reliability.fuzz import run_rpc_fuzz

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "reliability"
MAX_MESSAGE = 256 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    sockdir = tempfile.mkdtemp(prefix="pk-bad-")  # a unix socket path is short
    running = launch(
        tmp_path_factory.mktemp("bad-input"),
        "--local-socket",
        os.path.join(sockdir, "step.sock"),
        "--num-pages",
        "128",
        "--max-model-len",
        "512",
        "--max-message-bytes",
        str(MAX_MESSAGE),
        "--max-requests-per-step",
        "64",
        "--max-tokens-per-step",
        "2048",
        "--max-clients",
        "40",
        "--lease-ttl-s",
        "600",
        "--max-lease-ttl-s",
        "600",
        "--debug-invariants",
    )
    yield running
    running.stop()
    shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture(scope="module")
def setup(server):
    """Two schedulers with running requests, a worker: a state worth protecting."""
    mine, other = Scheduler(server, "mine"), Scheduler(server, "other")
    assert mine.admit("m-a", list(range(40))).status == pb.ALLOCATION_STATUS_OK
    assert mine.admit("m-b", list(range(33))).status == pb.ALLOCATION_STATUS_OK
    assert other.admit("o-a", list(range(100, 150))).status == pb.ALLOCATION_STATUS_OK
    worker = server.stub().RegisterClient(
        pb.RegisterClientRequest(role=pb.CLIENT_ROLE_WORKER, device="cpu")
    )
    return mine, other, worker


def test_random_and_mutated_bytes_to_every_rpc(server, setup):
    _, _, worker = setup
    figures = run_rpc_fuzz(server, worker, inputs_per_rpc=30, seed=1234)
    assert figures["refused"] > figures["inputs_tried"] // 2
    assert figures["codes"].get("INVALID_ARGUMENT", 0) > 50
    _record("fuzz_rpc", figures)


def test_random_and_mutated_bytes_over_the_local_socket(server, setup):
    """The same inputs in frames on the same-node socket: the same documented statuses,
    and nothing changed by a refused one."""
    _, _, worker = setup
    figures = run_rpc_fuzz(server, worker, inputs_per_rpc=30, seed=4321, transport="local")
    assert figures["refused"] > figures["inputs_tried"] // 2
    assert figures["codes"].get("INVALID_ARGUMENT", 0) > 50
    assert server.is_running()
    _record("fuzz_local", figures)


def _refused(server, call, request, code, *, match: str = "") -> None:
    before = state_digest(server)
    try:
        call(request, metadata=server.metadata, timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == code, (exc.code(), exc.details())
        assert match in exc.details(), exc.details()
    else:
        raise AssertionError(f"{type(request).__name__} was accepted")
    assert state_digest(server) == before


def test_ids_that_do_not_exist_or_belong_to_another_client(server, setup):
    mine, other, worker = setup
    stub = mine.stub
    E = grpc.StatusCode
    cases = [
        (mine.request(free_request_ids=["o-a"]), E.PERMISSION_DENIED, "another client"),
        (
            mine.request(
                growths=[pb.Growth(request_id="o-a", num_new_tokens=1, new_token_ids=i32([1]))]
            ),
            E.PERMISSION_DENIED,
            "another client",
        ),
        (mine.request(batch=pb.Batch(request_ids=["o-a"])), E.PERMISSION_DENIED, ""),
        (mine.request(free_request_ids=["nope"]), E.NOT_FOUND, "nope"),
        (
            mine.request(admissions=[pb.Admission(request_id="o-a", token_ids=i32([1, 2]))]),
            E.ALREADY_EXISTS,
            "o-a",
        ),
        (
            pb.StepRequest(client_id="scheduler-999", generation=1, step_id=10**9),
            E.NOT_FOUND,
            "not registered",
        ),
        (
            pb.StepRequest(client_id=worker.client_id, generation=1, step_id=10**9),
            E.PERMISSION_DENIED,
            "worker",
        ),
        (
            pb.StepRequest(client_id=other.client_id, generation=other.generation + 5, step_id=9),
            E.ABORTED,
            "generation",
        ),
    ]
    for request, code, match in cases:
        _refused(server, stub.Step, request, code, match=match)
    _refused(server, stub.GetBlockTable, pb.GetBlockTableRequest(request_id="nope"), E.NOT_FOUND)
    _refused(
        server,
        stub.Heartbeat,
        pb.HeartbeatRequest(client_id="worker-999", generation=1),
        E.NOT_FOUND,
    )
    _refused(
        server,
        stub.Unregister,
        pb.UnregisterRequest(client_id=other.client_id, generation=other.generation + 1),
        E.ABORTED,
    )
    _refused(
        server,
        stub.RegisterClient,
        pb.RegisterClientRequest(role=pb.CLIENT_ROLE_WORKER, client_id=mine.client_id),
        E.FAILED_PRECONDITION,
        match="registered as scheduler",
    )
    _refused(
        server,
        stub.RegisterClient,
        pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, client_id="scheduler-999"),
        E.NOT_FOUND,
    )
    http = server.http()
    before = state_digest(server)
    assert http.get("/v1/requests/nope").status_code == 404
    assert http.delete("/v1/requests/o-a").status_code in (401, 403)  # no admin token
    assert state_digest(server) == before


def test_tokens_past_max_model_len(server, setup):
    mine, _, _ = setup
    E = grpc.StatusCode
    _refused(
        server,
        mine.stub.Step,
        mine.request(admissions=[pb.Admission(request_id="long", token_ids=i32(range(513)))]),
        E.INVALID_ARGUMENT,
        match="max_model_len",
    )
    _refused(
        server,
        mine.stub.Step,
        mine.request(
            growths=[pb.Growth(request_id="m-a", num_new_tokens=1, new_token_ids=i32(range(480)))]
        ),
        E.INVALID_ARGUMENT,
        match="max_model_len",
    )
    _refused(
        server,
        mine.stub.Lookup,
        pb.LookupRequest(token_ids=i32(range(600))),
        E.INVALID_ARGUMENT,
        match="max_model_len",
    )
    _refused(
        server,
        mine.stub.Step,
        mine.request(admissions=[pb.Admission(request_id="odd", token_ids=b"\x01\x02\x03")]),
        E.INVALID_ARGUMENT,
        match="int32",
    )


def test_kernel_block_sizes_that_do_not_divide_the_page(server, setup):
    mine, _, _ = setup
    E = grpc.StatusCode
    _refused(
        server,
        mine.stub.RegisterClient,
        pb.RegisterClientRequest(
            role=pb.CLIENT_ROLE_WORKER,
            kernel_support=[
                pb.GroupKernelSupport(
                    group_id=0, backends=[pb.KernelBackend(name="odd", block_sizes=[7, 5])]
                )
            ],
        ),
        E.FAILED_PRECONDITION,
        match="divides page size",
    )
    _refused(
        server,
        mine.stub.RegisterClient,
        pb.RegisterClientRequest(
            role=pb.CLIENT_ROLE_WORKER,
            kernel_support=[pb.GroupKernelSupport(group_id=3, backends=[])],
        ),
        E.INVALID_ARGUMENT,
    )
    _refused(
        server,
        mine.stub.GetBlockTable,
        pb.GetBlockTableRequest(request_id="m-a", kernel_block_size=7),
        E.INVALID_ARGUMENT,
        match="divisor",
    )
    before = state_digest(server)
    answer = server.http().get("/v1/requests/m-a", params={"kernel_block_size": 7})
    assert answer.status_code == 400 and "does not divide" in answer.json()["detail"]
    assert state_digest(server) == before


def test_oversized_messages_and_steps_over_the_limits(server, setup):
    mine, _, _ = setup
    E = grpc.StatusCode
    huge = mine.request(
        admissions=[pb.Admission(request_id="huge", token_ids=b"\x00" * (MAX_MESSAGE + 8))]
    )
    before = state_digest(server)
    assert status_of(mine.stub.Step, huge, metadata=server.metadata) == E.RESOURCE_EXHAUSTED
    assert state_digest(server) == before
    _refused(
        server,
        mine.stub.Step,
        mine.request(free_request_ids=[f"x{i}" for i in range(65)]),
        E.RESOURCE_EXHAUSTED,
        match="max_requests_per_step",
    )
    _refused(
        server,
        mine.stub.Step,
        mine.request(
            batch=pb.Batch(request_ids=["m-a", "m-b"], num_scheduled_tokens=i32([2000, 100]))
        ),
        E.RESOURCE_EXHAUSTED,
        match="max_tokens_per_step",
    )
    _refused(
        server,
        mine.stub.Step,
        mine.request(batch=pb.Batch(request_ids=["m-a", "m-a"])),
        E.INVALID_ARGUMENT,
        match="twice",
    )
    # The client's computed counts of rows running ahead (held-back decodes).
    for ends, counts, match in (
        ([5], None, "1 entries for 2"),
        ([-2, -1], None, "-2 outside [-1"),
        ([-1, 10**6], None, "max_model_len"),
        ([3, -1], [4, 1], "3 outside [4"),
    ):
        _refused(
            server,
            mine.stub.Step,
            mine.request(
                batch=pb.Batch(
                    request_ids=["m-a", "m-b"],
                    num_computed_tokens=i32(ends),
                    num_scheduled_tokens=i32(counts) if counts else b"",
                )
            ),
            E.INVALID_ARGUMENT,
            match=match,
        )
    # The service is still whole: a normal step goes through.
    assert mine.free("m-b").step_id == mine.step_id


def _record(name: str, figures: dict) -> None:
    """Keep the latest figures for docs/reliability.md (artifacts/ is git-ignored)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True))
