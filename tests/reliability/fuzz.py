"""Random and mutated protobuf bytes to every RPC (shared by the test suite and ``make
fuzz``), over gRPC or over the service's same-node socket (``transport="local"``: the
unary methods in frames; streams have no frame form).

Each RPC gets, through grpc's generic raw-bytes calls, random byte strings and mutations of
one valid request with real ids (bit flips, truncations, insertions, duplicated runs,
runaway varints, changed field tags). Every answer must be a documented status code (never
UNKNOWN or INTERNAL), and a refused call must leave the state digest exactly as it was; an
accepted one (a mutation can still be a valid request) moves the baseline. A registration
accepted with a lease shorter than the server's default is unregistered at once: its expiry
mid-run would change the state under a later refused call.
"""

from __future__ import annotations

import contextlib

import grpc
import numpy as np

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.errors import status_code
from pagekeeper_client.local import METHOD_NUMBERS
from tests.helpers.frames import FrameConnection
from tests.helpers.grpc_util import Scheduler, i32, state_digest
from tests.helpers.server import RunningServer

SERVICE = pb.DESCRIPTOR.services_by_name["PagekeeperService"]
PRECISE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.PERMISSION_DENIED,
}


def _examples(fuzz: Scheduler, worker: pb.RegisterClientResponse) -> list[tuple[str, bytes]]:
    """Valid requests (serialized) with real ids, one per RPC and a second ``Step`` whose
    decodes travel in column form: mutations start here."""
    step = pb.StepRequest(
        client_id=fuzz.client_id,
        generation=fuzz.generation,
        step_id=10**9,
        growths=[pb.Growth(request_id="f-a", num_new_tokens=1, new_token_ids=i32([7]))],
        admissions=[pb.Admission(request_id="f-new", token_ids=i32(range(20)))],
        batch=pb.Batch(request_ids=["f-a", "f-new"]),
    )
    messages = {
        "GetPoolInfo": pb.GetPoolInfoRequest(),
        "RegisterClient": pb.RegisterClientRequest(
            role=pb.CLIENT_ROLE_WORKER,
            device="cpu",
            kernel_support=[
                pb.GroupKernelSupport(
                    group_id=0, backends=[pb.KernelBackend(name="x", block_sizes=[8])]
                )
            ],
        ),
        "Heartbeat": pb.HeartbeatRequest(client_id=worker.client_id, generation=1),
        "Unregister": pb.UnregisterRequest(client_id=worker.client_id, generation=99),
        "Step": step,
        "Lookup": pb.LookupRequest(token_ids=i32(range(40))),
        "GetBlockTable": pb.GetBlockTableRequest(request_id="f-a", kernel_block_size=8),
        "WatchEvents": pb.WatchEventsRequest(since_seq=0),
        "WatchTables": pb.WatchTablesRequest(client_id=worker.client_id, generation=1),
        "ResetPrefixCache": pb.ResetPrefixCacheRequest(),
    }
    assert set(messages) == {m.name for m in SERVICE.methods}
    decoding = ["f-a", *COLUMN_IDS]
    columns = pb.StepRequest(
        client_id=fuzz.client_id,
        generation=fuzz.generation,
        step_id=10**9 + 1,
        free_request_ids=["f-z"],
        growth_columns=pb.GrowthColumns(
            request_ids=decoding,
            new_token_ids=i32([7] * (len(decoding) + 1)),
            num_new_token_ids=i32([2] + [1] * (len(decoding) - 1)),
            num_new_tokens=i32([2] + [1] * (len(decoding) - 1)),
        ),
        batch=pb.Batch(request_ids=decoding),
    )
    examples = [(name, m.SerializeToString()) for name, m in messages.items()]
    return [*examples, ("Step", columns.SerializeToString())]


# Running requests a column-form Step decodes (more than the per-growth threshold of 8).
COLUMN_IDS = [f"f-c{i}" for i in range(9)]


def _mutate(data: bytes, rng: np.random.Generator) -> bytes:
    raw = bytearray(data)
    kind = int(rng.integers(7))
    if kind == 0 or not raw:
        return rng.bytes(int(rng.integers(0, 200)))
    at = int(rng.integers(len(raw)))
    if kind == 1:
        raw[at] ^= 1 << int(rng.integers(8))
    elif kind == 2:
        del raw[at:]
    elif kind == 3:
        raw[at:at] = rng.bytes(int(rng.integers(1, 16)))
    elif kind == 4:
        end = min(len(raw), at + int(rng.integers(1, 32)))
        raw[at:at] = raw[at:end]
    elif kind == 5:
        raw[at] = 0xFF  # a varint that never ends, or a huge length
    else:
        raw[at] = int(rng.integers(256))  # another field number / wire type
    return bytes(raw)


def _call(server: RunningServer, channel: grpc.Channel, name: str, data: bytes):
    path = f"/{SERVICE.full_name}/{name}"
    method = SERVICE.methods_by_name[name]
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path)(data, timeout=0.3, metadata=server.metadata)
            try:
                next(iter(stream))
            finally:
                stream.cancel()
            return grpc.StatusCode.OK
        channel.unary_unary(path)(data, timeout=10, metadata=server.metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        if method.server_streaming and code in (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
        ):
            return grpc.StatusCode.OK  # a valid watch that simply had nothing to say yet
        return code


class _LocalCaller:
    """Frames on the same-node socket; reconnects (with the hello) if the service closed
    the connection."""

    def __init__(self, server: RunningServer) -> None:
        self.path = server.info["local_socket"]
        self.token = server.token or ""
        self.conn: FrameConnection | None = None

    def __call__(self, name: str, data: bytes) -> grpc.StatusCode:
        if self.conn is None:
            self.conn = FrameConnection(self.path)
            self.conn.hello(self.token)
        self.conn.send(METHOD_NUMBERS[name], data)
        status, _ = self.conn.answer()
        return status_code(status)


def _unregister_short_leases(server: RunningServer) -> None:
    """Unregister every client whose lease is shorter than the server's default. A mutated
    ``RegisterClient`` can ask for any lease, 1 ms included; such a client expires during
    the run and the reaper's change would read as the doing of whatever refused call is
    checked next (seen in ``make fuzz`` with 6,000 inputs). Clients on the default lease
    or longer outlive any bounded run."""
    http = server.http()
    default = http.get("/v1/pool").json()["limits"]["lease_ttl_s"]
    stub = server.stub()
    for client in http.get("/v1/clients").json():
        if client["lease_ttl_s"] < default:
            with contextlib.suppress(grpc.RpcError):  # expired in the meantime: gone anyway
                stub.Unregister(
                    pb.UnregisterRequest(
                        client_id=client["client_id"], generation=client["generation"]
                    ),
                    metadata=server.metadata,
                )


def run_rpc_fuzz(
    server: RunningServer,
    worker: pb.RegisterClientResponse,
    *,
    inputs_per_rpc: int,
    seed: int,
    check_every: int = 1,
    transport: str = "grpc",
) -> dict:
    """Fuzz every RPC; returns the figures (inputs tried, refused, codes seen). The state
    digest is compared around every ``check_every``-th input (1: all of them).
    ``transport="local"``: the unary RPCs over the server's same-node socket."""
    fuzz = Scheduler(server, "fuzz")
    for rid in ("f-a", "f-z", *COLUMN_IDS):
        assert fuzz.admit(rid, list(range(200, 240))).status == pb.ALLOCATION_STATUS_OK
    examples = _examples(fuzz, worker)
    rng = np.random.default_rng(seed)
    channel = server.channel()
    local = _LocalCaller(server) if transport == "local" else None
    if local is not None:
        examples = [(name, valid) for name, valid in examples if name in METHOD_NUMBERS]
    tried = refused = 0
    codes: dict[str, int] = {}
    digest = state_digest(server)
    for name, valid in examples:
        for i in range(inputs_per_rpc):
            data = _mutate(valid, rng) if i else rng.bytes(int(rng.integers(1, 64)))
            code = local(name, data) if local is not None else _call(server, channel, name, data)
            tried += 1
            codes[code.name] = codes.get(code.name, 0) + 1
            assert code in PRECISE, f"{name}: {code} for {data!r}"
            if code is not grpc.StatusCode.OK:
                refused += 1
            if code is grpc.StatusCode.OK and name == "RegisterClient":
                _unregister_short_leases(server)
            if i % check_every == 0 or code is grpc.StatusCode.OK:
                after = state_digest(server)
                if code is not grpc.StatusCode.OK:
                    assert after == digest, f"{name}: a refused call ({code}) changed the state"
                digest = after
    # Its requests go with it, so another run on this server may use the same ids (unless
    # a mutated RegisterClient took the id over: then that registration holds them).
    with contextlib.suppress(grpc.RpcError):
        fuzz.stub.Unregister(
            pb.UnregisterRequest(client_id=fuzz.client_id, generation=fuzz.generation),
            metadata=fuzz.md,
        )
    if local is not None and local.conn is not None:
        local.conn.sock.close()
    return {"inputs_tried": tried, "refused": refused, "codes": codes}
