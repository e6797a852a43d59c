"""Small helpers for tests that talk gRPC to a :class:`RunningServer`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import numpy as np

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from tests.helpers.server import RunningServer


def i32(values: Iterable[int]) -> bytes:
    return np.asarray(list(values), dtype="<i4").tobytes()


def from_i32(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def from_i64(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i8").tolist()


class Scheduler:
    """A registered scheduler with its own step counter."""

    def __init__(self, server: RunningServer, name: str = "test", lease_ttl_ms: int = 0) -> None:
        self.server = server
        self.stub = server.stub()
        self.md = server.metadata
        reply = self.stub.RegisterClient(
            pb.RegisterClientRequest(
                role=pb.CLIENT_ROLE_SCHEDULER, name=name, lease_ttl_ms=lease_ttl_ms
            ),
            metadata=self.md,
        )
        self.client_id = reply.client_id
        self.generation = reply.generation
        self.step_id = max(reply.last_step_id, reply.last_published_step_seq)
        self.registration = reply

    def request(self, **fields: Any) -> pb.StepRequest:
        """A StepRequest with the next step id (not sent)."""
        self.step_id += 1
        return pb.StepRequest(
            client_id=self.client_id, generation=self.generation, step_id=self.step_id, **fields
        )

    def step(self, **fields: Any) -> pb.StepResponse:
        return self.stub.Step(self.request(**fields), metadata=self.md)

    def admit(self, request_id: str, tokens: Sequence[int], **fields: Any) -> pb.AllocationResult:
        reply = self.step(
            admissions=[pb.Admission(request_id=request_id, token_ids=i32(tokens), **fields)]
        )
        return reply.results[0]

    def free(self, *request_ids: str) -> pb.StepResponse:
        return self.step(free_request_ids=list(request_ids))


def status_of(call: Any, *args: Any, **kwargs: Any) -> grpc.StatusCode:
    """Run a call that must fail; return its status code."""
    try:
        call(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc.code()
    raise AssertionError("call succeeded, an error was expected")


def error_of(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    try:
        call(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("call succeeded, an error was expected")


def state_digest(server: RunningServer) -> dict[str, Any]:
    """What a rejected call must leave unchanged: pages, requests, clients, events."""
    http = server.http()
    pool = http.get("/v1/pool").json()
    requests = http.get("/v1/requests", params={"limit": 1000}).json()["items"]
    details = {
        r["request_id"]: http.get(f"/v1/requests/{r['request_id']}").json() for r in requests
    }
    clients = http.get("/v1/clients").json()
    return {
        "pages": pool["pages"],
        "last_event_seq": pool["last_event_seq"],
        "requests": details,
        "clients": sorted((c["client_id"], c["generation"], c["last_step_id"]) for c in clients),
    }
