"""The same-node socket (``--local-socket``): the unary calls over plain frames on a unix
socket, against a real server process.

Equivalence with gRPC is checked by driving two servers (one with the socket, one without)
through the same client calls and comparing every answer and the final state; the frame
protocol's edge cases (no hello, a wrong token, an unknown method, bad bytes, an oversized
frame, split and pipelined frames) each get a clear status and change nothing.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pagekeeper_client import PagekeeperClient
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.errors import NotFoundError, UnavailableError
from pagekeeper_client.local import HEADER, MAGIC, METHOD_NUMBERS
from tests.helpers.frames import FrameConnection, frame
from tests.helpers.grpc_util import i32, state_digest
from tests.helpers.server import ServerStartError, clean_env, launch

TOKEN = "local-token"


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory for socket files (a unix socket path holds at most 107 bytes;
    pytest's tmp paths can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="pk-local-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def local_server(server_factory, sockdir):
    return server_factory(
        "--num-pages", "256", "--max-model-len", "2048", "--local-socket", str(sockdir / "pk.sock"),
        "--max-message-bytes", "65536", "--durability", "none",
        token=TOKEN,
    )  # fmt: skip


class Raw(FrameConnection):
    """A bare connection whose hello carries this module's token by default."""

    def hello(self, token: str = TOKEN) -> None:
        super().hello(token)


def _code(status: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == status)


def test_listens_owner_only_advertises_and_goes_away(local_server, sockdir):
    path = sockdir / "pk.sock"
    assert local_server.info["local_socket"] == str(path)
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    client = PagekeeperClient(local_server.grpc_address, token=TOKEN)
    client.register("scheduler")
    assert client.registration.local_socket == str(path)
    assert client.transport == "local"
    client.admit("adv-1", list(range(40)))
    client.flush()
    assert client.stats.num_local_calls == 1
    client.close()
    local_server.stop()
    assert not path.exists()


def _drive(client: PagekeeperClient) -> list[object]:
    """A fixed session of calls; returns every answer in comparable form."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 20_000, 64).tolist()
    out: list[object] = []
    ids = [f"eq-{i}" for i in range(6)]
    for i, rid in enumerate(ids):
        tokens = shared + rng.integers(0, 20_000, 20 + 7 * i).tolist()
        result = client.admit(rid, tokens)
        out.append((result.status, result.num_cached_tokens))
    out.append(repr(client.flush()))
    for _ in range(40):
        crossing = client.allocate_decodes(ids, rng.integers(0, 20_000, len(ids)).tolist())
        out.append(sorted(crossing))
        step = client.step(batch=ids)
        out.append(repr(step))
    for rid in ids:
        out.append([p.tolist() for p in client.page_ids(rid)])
    lookup = client.lookup(shared + [1, 2, 3])
    out.append((lookup.num_hit_tokens, [p.tolist() for p in lookup.page_ids]))
    table = client.block_table(ids[2], kernel_block_size=8)
    out.append((table.page_ids.tolist(), table.kernel_block_ids.tolist()))
    client.free(*ids[:3])
    out.append(client.pool_info().counters)
    return out


def test_answers_and_state_match_grpc(server_factory, sockdir):
    flags = ("--num-pages", "512", "--max-model-len", "2048", "--durability", "none")
    plain = server_factory(*flags)
    local = server_factory(*flags, "--local-socket", str(sockdir / "eq.sock"))
    answers = []
    for server, transport in ((plain, "grpc"), (local, "local")):
        client = PagekeeperClient(server.grpc_address)
        client.register("scheduler", name="eq")
        assert client.transport == transport
        answers.append(_drive(client))
        if transport == "local":
            assert client.stats.num_local_calls > 40
        digest = state_digest(server)
        answers[-1].append(digest["pages"])
        answers[-1].append(digest["requests"])
        client.close()
    assert answers[0] == answers[1]


def test_errors_are_grpc_statuses_and_change_nothing(local_server):
    client = PagekeeperClient(local_server.grpc_address, token=TOKEN)
    client.register("scheduler")
    client.admit("err-1", list(range(50)))
    client.flush()
    before = state_digest(local_server)
    owner = client.registration
    raw = Raw(local_server.info["local_socket"])
    raw.hello()
    # An unknown request: NOT_FOUND with the reason gRPC gives.
    request = pb.StepRequest(
        client_id=owner.client_id,
        generation=owner.generation,
        step_id=99,
        free_request_ids=["no-such-request"],
    )
    status, reason = raw.call("Step", request)
    assert _code(status) is grpc.StatusCode.NOT_FOUND and b"no-such-request" in reason
    stub_error = None
    try:
        local_server.stub().Step(request, metadata=local_server.metadata)
    except grpc.RpcError as exc:
        stub_error = exc
    assert stub_error is not None and stub_error.details().encode() == reason
    # Bytes that are no StepRequest.
    status, reason = raw.call("Step", pb.StepRequest())
    assert _code(status) is not grpc.StatusCode.OK
    raw.send(METHOD_NUMBERS["Step"], b"\xff\xff\xff")
    status, reason = raw.answer()
    assert _code(status) is grpc.StatusCode.INVALID_ARGUMENT
    assert b"malformed pagekeeper.v1.StepRequest" in reason
    # An unknown method number: UNIMPLEMENTED, and the connection goes on.
    raw.send(200, b"")
    status, reason = raw.answer()
    assert _code(status) is grpc.StatusCode.UNIMPLEMENTED
    status, body = raw.call("GetPoolInfo", pb.GetPoolInfoRequest())
    assert status == 0 and pb.GetPoolInfoResponse.FromString(body).server_version
    # The typed exception on the client side.
    with pytest.raises(NotFoundError, match="no-such"):
        client.block_table("no-such-request")
    assert state_digest(local_server) == before
    client.close()


def test_hello_and_token(local_server):
    path = local_server.info["local_socket"]
    raw = Raw(path)
    status, body = raw.call("GetPoolInfo", pb.GetPoolInfoRequest())  # no hello first
    assert _code(status) is grpc.StatusCode.UNAUTHENTICATED and b"hello" in body
    assert raw.is_closed()
    raw = Raw(path)
    raw.send(0, MAGIC + b"wrong")
    status, body = raw.answer()
    assert _code(status) is grpc.StatusCode.UNAUTHENTICATED and b"token" in body
    assert raw.is_closed()
    raw = Raw(path)
    raw.send(0, b"HTTP/1.1 GET /")
    status, body = raw.answer()
    assert _code(status) is grpc.StatusCode.INVALID_ARGUMENT
    assert raw.is_closed()
    raw = Raw(path)
    raw.hello()
    assert raw.call("GetPoolInfo", pb.GetPoolInfoRequest())[0] == 0


def test_oversized_frame_is_refused_and_changes_nothing(local_server):
    client = PagekeeperClient(local_server.grpc_address, token=TOKEN)
    client.register("scheduler")
    before = state_digest(local_server)
    raw = Raw(local_server.info["local_socket"])
    raw.hello()
    raw.sock.sendall(struct.pack("<IB", 10_000_000, METHOD_NUMBERS["Step"]) + b"\0" * 100)
    status, body = raw.answer()
    assert _code(status) is grpc.StatusCode.RESOURCE_EXHAUSTED and b"65536" in body
    assert raw.is_closed()
    assert state_digest(local_server) == before
    client.close()


def test_split_and_pipelined_frames(local_server):
    client = PagekeeperClient(local_server.grpc_address, token=TOKEN)
    registration = client.register("scheduler")
    raw = Raw(local_server.info["local_socket"])
    raw.hello()
    steps = [
        pb.StepRequest(
            client_id=registration.client_id,
            generation=registration.generation,
            step_id=k + 1,
            admissions=[pb.Admission(request_id=f"split-{k}", token_ids=i32(range(k, k + 33)))],
        )
        for k in range(3)
    ]
    frames = b"".join(
        frame(METHOD_NUMBERS["Step"], data) for data in (s.SerializeToString() for s in steps)
    )
    # The first frame a byte at a time, the other two in one write.
    first = len(HEADER.pack(0, 0)) + len(steps[0].SerializeToString())
    for i in range(first):
        raw.sock.sendall(frames[i : i + 1])
    raw.sock.sendall(frames[first:])
    for k in range(3):
        status, body = raw.answer()
        assert status == 0, body
        result = pb.StepResponse.FromString(body).results[0]
        assert result.request_id == f"split-{k}" and result.status == pb.ALLOCATION_STATUS_OK
    # A step id answered again from memory, not applied twice (as over gRPC).
    status, body = raw.call("Step", steps[2])
    assert status == 0
    assert pb.StepResponse.FromString(body).results[0].request_id == "split-2"
    pool = pb.GetPoolInfoResponse.FromString(raw.call("GetPoolInfo", pb.GetPoolInfoRequest())[1])
    assert pool.counters.num_requests == 3
    client.close()


def test_broken_socket_is_reopened_or_left_for_grpc_with_the_same_step_id(local_server):
    client = PagekeeperClient(local_server.grpc_address, token=TOKEN)
    client.register("scheduler")
    client.admit("fb-1", list(range(30)))
    client.flush()
    assert client.transport == "local"
    # The connection dies under the client: the step is resent with the same id over a
    # fresh connection.
    first = client._local
    assert first is not None and first.num_connections == 1
    first._idle[0].sock.shutdown(socket.SHUT_RDWR)
    client.admit("fb-2", list(range(100, 130)))
    client.flush()
    assert client.stats.num_retries == 1
    assert client.transport == "local" and client._local is not first
    # Dies again and the socket is gone: the resend goes over gRPC.
    assert client._local is not None
    client._local._idle[0].sock.shutdown(socket.SHUT_RDWR)
    os.unlink(local_server.info["local_socket"])
    client.admit("fb-3", list(range(200, 230)))
    client.flush()
    assert client.stats.num_retries == 2
    assert client.transport == "grpc"
    assert set(client.request_ids()) == {"fb-1", "fb-2", "fb-3"}
    http = local_server.http()
    served = {r["request_id"] for r in http.get("/v1/requests").json()["items"]}
    assert served == {"fb-1", "fb-2", "fb-3"}
    client.close()


def test_auto_without_reach_stays_on_grpc_and_a_named_path_must_connect(local_server, sockdir):
    # The advertised path is not reachable from here (removed): auto falls back.
    os.unlink(local_server.info["local_socket"])
    client = PagekeeperClient(local_server.grpc_address, token=TOKEN)
    client.register("scheduler")
    assert client.transport == "grpc"
    assert client.admit("auto-1", list(range(20))).status.value == "ok"
    assert client.stats.num_local_calls == 0 and client.stats.num_steps == 1
    client.close()
    named = PagekeeperClient(
        local_server.grpc_address, token=TOKEN, local_socket=str(sockdir / "missing.sock")
    )
    before = {c["client_id"] for c in local_server.http().get("/v1/clients").json()}
    with pytest.raises(UnavailableError, match=r"missing\.sock"):
        named.register("scheduler")
    named.close()
    # Refused before registering: no registration left behind.
    after = {c["client_id"] for c in local_server.http().get("/v1/clients").json()}
    assert after == before


def test_metrics_count_local_calls(local_server):
    client = PagekeeperClient(local_server.grpc_address, token=TOKEN)
    client.register("scheduler")
    for k in range(3):
        client.admit(f"m-{k}", list(range(k, k + 20)))
        client.flush()
    text = local_server.http().get("/metrics").text
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("pagekeeper_rpc_duration_seconds_count")
        and 'method="Step"' in ln
        and 'code="OK"' in ln
    )
    assert float(line.rsplit(" ", 1)[1]) >= 3
    gauge = next(ln for ln in text.splitlines() if ln.startswith("pagekeeper_local_connections "))
    assert float(gauge.rsplit(" ", 1)[1]) == 1  # this client's connection
    client.close()


def test_stale_file_replaced_live_socket_and_other_files_refused(server_factory, sockdir):
    stale = sockdir / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))
    dead.close()  # the file stays, nobody listens
    server = server_factory("--local-socket", str(stale), "--durability", "none")
    assert server.info["local_socket"] == str(stale)
    # A second service on the same path: refused at start, the first keeps it.
    with pytest.raises(ServerStartError, match="another service listens"):
        launch(sockdir / "second", "--local-socket", str(stale), "--durability", "none")
    raw = Raw(str(stale))
    raw.hello("")
    assert raw.call("GetPoolInfo", pb.GetPoolInfoRequest())[0] == 0
    regular = sockdir / "file.sock"
    regular.write_text("not a socket")
    with pytest.raises(ServerStartError, match="not a socket"):
        launch(sockdir / "third", "--local-socket", str(regular), "--durability", "none")
    assert regular.read_text() == "not a socket"


def test_bad_path_is_one_config_line():
    long_path = "/tmp/" + "x" * 200 + ".sock"
    proc = subprocess.run(
        [sys.executable, "-m", "pagekeeper", "config", "--local-socket", long_path],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "server.local_socket" in lines[0] and "107" in lines[0]


def test_async_client_steps_over_the_socket_and_matches_the_sync_one(server_factory, sockdir):
    """The asyncio client on the same socket gives the answers the sync client gives (two
    servers, the same session)."""
    import asyncio

    from pagekeeper_client import AsyncPagekeeperClient

    flags = ("--num-pages", "256", "--max-model-len", "2048", "--durability", "none")
    first = server_factory(*flags, "--local-socket", str(sockdir / "a.sock"))
    second = server_factory(*flags, "--local-socket", str(sockdir / "b.sock"))

    def session(admit, decodes, step, lookup):
        rng = np.random.default_rng(11)
        ids = [f"as-{i}" for i in range(4)]
        out = []
        for i, rid in enumerate(ids):
            out.append(admit(rid, rng.integers(0, 9_000, 30 + 9 * i).tolist()))
        for _ in range(20):
            out.append(sorted(decodes(ids, rng.integers(0, 9_000, 4).tolist())))
            out.append(step(ids))
        out.append(lookup)
        return ids, out

    sync_client = PagekeeperClient(first.grpc_address)
    sync_client.register("scheduler", name="same")
    ids, sync_out = session(
        lambda r, t: sync_client.admit(r, t).num_cached_tokens,
        sync_client.allocate_decodes,
        lambda ids: repr(sync_client.step(batch=ids)),
        None,
    )
    sync_pages = [[p.tolist() for p in sync_client.page_ids(r)] for r in ids]
    assert sync_client.transport == "local"
    sync_client.close()

    async def main() -> tuple[list[object], list[object], int]:
        async with AsyncPagekeeperClient(second.grpc_address) as client:
            await client.register("scheduler", name="same")
            assert client.transport == "local"
            loop_out: list[object] = []
            rng = np.random.default_rng(11)
            names = [f"as-{i}" for i in range(4)]
            for i, rid in enumerate(names):
                got = await client.admit(rid, rng.integers(0, 9_000, 30 + 9 * i).tolist())
                loop_out.append(got.num_cached_tokens)
            for _ in range(20):
                crossing = await client.allocate_decodes(names, rng.integers(0, 9_000, 4).tolist())
                loop_out.append(sorted(crossing))
                loop_out.append(repr(await client.step(batch=names)))
            loop_out.append(None)
            pages = [[p.tolist() for p in client.page_ids(r)] for r in names]
            # The broken socket: the step is resent over a new connection.
            assert client._local is not None
            assert client._local.num_connections == 1
            client._local._idle[0][1].transport.abort()
            await client.admit("as-x", list(range(40)))
            return loop_out, pages, client.stats.num_retries

    async_out, async_pages, retries = asyncio.run(main())
    assert async_out == sync_out
    assert async_pages == sync_pages
    assert retries == 1


def test_many_pipelined_calls_are_all_answered_in_order(local_server):
    """A peer that writes far ahead of reading is paused (flow control), not buffered without
    bound, and every call is still answered, in order."""
    import threading

    raw = Raw(local_server.info["local_socket"])
    raw.hello()
    count = 5000  # ~200-byte answers: ~1 MB unread, far past the write buffer's high mark
    lookup = pb.LookupRequest(token_ids=i32(range(40))).SerializeToString()
    frames = b"".join(
        frame(METHOD_NUMBERS["GetPoolInfo"], b"")
        if k % 2
        else frame(METHOD_NUMBERS["Lookup"], lookup)
        for k in range(count)
    )
    sender = threading.Thread(target=raw.sock.sendall, args=(frames,))
    sender.start()
    time.sleep(0.5)  # let the service fill its buffer and pause reading
    for k in range(count):
        status, body = raw.answer()
        assert status == 0, (k, body)
        if k % 2:
            assert pb.GetPoolInfoResponse.FromString(body).counters.num_free_pages > 0
        else:
            assert pb.LookupResponse.FromString(body).num_hit_tokens == 0
    sender.join(10)
    assert not sender.is_alive()
    status, body = raw.call("GetPoolInfo", pb.GetPoolInfoRequest())
    assert status == 0


def test_a_killed_service_restarted_on_the_same_socket_loses_no_acknowledged_step(
    tmp_path, sockdir
):
    """kill -9 the service while a client steps over its socket; restart it on the same
    data directory, gRPC port and socket path (the dead one's file is stale and replaced).
    The step in flight is resent with its id until the service is back; the client's pages
    equal the service's afterwards, and it returns to the socket."""
    import signal
    import threading

    path = str(sockdir / "kill.sock")
    args = ("--local-socket", path, "--durability", "process", "--num-pages", "256")
    server = launch(tmp_path / "svc", *args)
    port = server.info["grpc_port"]
    client = PagekeeperClient(server.grpc_address, retry_s=60)
    restarted: list = []
    try:
        client.register("scheduler", lease_ttl=60)
        rng = np.random.default_rng(5)
        ids = [f"k-{i}" for i in range(6)]
        for rid in ids:
            client.admit(rid, rng.integers(0, 9_000, 40).tolist())
        for _ in range(10):
            client.allocate_decodes(ids, rng.integers(0, 9_000, len(ids)).tolist())
            client.step(batch=ids)
        assert client.transport == "local"
        retries = client.stats.num_retries
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)

        def restart() -> None:
            time.sleep(0.5)
            restarted.append(launch(tmp_path / "svc", *args, "--grpc-address", f"127.0.0.1:{port}"))

        thread = threading.Thread(target=restart)
        thread.start()
        for _ in range(5):
            client.allocate_decodes(ids, rng.integers(0, 9_000, len(ids)).tolist())
            client.step(batch=ids)  # the first one waits for the restart
        thread.join(60)
        assert restarted, "the service did not restart"
        assert client.stats.num_retries > retries
        http = restarted[0].http()
        for rid in ids:
            served = http.get(f"/v1/requests/{rid}").json()
            assert served["page_ids"][0] == client.page_ids(rid).tolist()
        time.sleep(2.1)  # the client retries the socket at most every 2 s
        client.allocate_decodes(ids, rng.integers(0, 9_000, len(ids)).tolist())
        client.step(batch=ids)
        assert client.transport == "local"
    finally:
        client.close()
        for running in restarted:
            running.stop()
        if server.process.poll() is None:
            server.stop()


def test_a_missing_directory_is_created_owner_only(server_factory, sockdir):
    path = sockdir / "made" / "here.sock"
    server = server_factory("--local-socket", str(path), "--durability", "none")
    assert server.info["local_socket"] == str(path)
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    raw = Raw(str(path))
    raw.hello("")
    assert raw.call("GetPoolInfo", pb.GetPoolInfoRequest())[0] == 0


def test_threads_share_the_socket_and_each_gets_its_own_answer(local_server):
    """Four lookup threads and the stepping thread at once: calls in flight together take
    connections of their own (at most the channel's four), every answer is the caller's."""
    import threading

    client = PagekeeperClient(local_server.grpc_address, token=TOKEN)
    client.register("scheduler")
    prompts = {k: [1000 * k + i for i in range(16 * k)] for k in range(1, 5)}
    for k, tokens in prompts.items():
        client.admit(f"th-{k}", tokens + [7])
    errors: list[str] = []

    def look(k: int) -> None:
        for _ in range(200):
            got = client.lookup(prompts[k] + [1])
            if got.num_hit_tokens != 16 * k or len(got.page_ids[0]) != k:
                errors.append(f"{k}: {got.num_hit_tokens}")

    threads = [threading.Thread(target=look, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for _ in range(50):
        client.step(batch=[f"th-{k}" for k in prompts])
    for t in threads:
        t.join(60)
    assert not errors, errors[:5]
    assert client.transport == "local" and client.stats.num_local_calls >= 850
    assert client._local is not None and 2 <= client._local.num_connections <= 4
    client.close()


def test_steps_are_journaled_as_the_bytes_they_came_in(tmp_path, sockdir):
    """A step's journal record holds the request bytes as they came, over gRPC and over
    the socket (not the message serialized again): bytes whose fields come in another
    order than protobuf writes them are found verbatim in the journal after a kill -9,
    and the restarted service replays them into the pages it answered."""
    import signal

    from pagekeeper.durability.commands import KIND_STEP_WIRE
    from tests.reliability.journal_files import record_crc, records

    path = str(sockdir / "journal.sock")
    args = ("--local-socket", path, "--durability", "process", "--num-pages", "256")
    workdir = tmp_path / "svc"
    server = launch(workdir, *args)
    restarted = None
    try:
        channel = server.channel()
        register = channel.unary_unary(
            "/pagekeeper.v1.PagekeeperService/RegisterClient",
            request_serializer=pb.RegisterClientRequest.SerializeToString,
            response_deserializer=pb.RegisterClientResponse.FromString,
        )
        reg = register(pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, name="raw"))
        step_bytes = channel.unary_unary(  # no serializer: the bytes go as they are
            "/pagekeeper.v1.PagekeeperService/Step",
            response_deserializer=pb.StepResponse.FromString,
        )
        rng = np.random.default_rng(11)

        def reordered(step_id: int, request_id: str) -> bytes:
            # The admission (field 6) before the client id (field 1): a valid encoding of
            # the message that protobuf itself never writes.
            admission = pb.StepRequest(
                admissions=[
                    pb.Admission(request_id=request_id, token_ids=i32(rng.integers(0, 9_000, 70)))
                ]
            )
            head = pb.StepRequest(
                client_id=reg.client_id, generation=reg.generation, step_id=step_id
            )
            sent = admission.SerializeToString() + head.SerializeToString()
            assert pb.StepRequest.FromString(sent).SerializeToString() != sent
            return sent

        over_grpc = reordered(1, "raw-grpc")
        answered = {"raw-grpc": step_bytes(over_grpc).results[0]}
        over_socket = reordered(2, "raw-local")
        conn = FrameConnection(path)
        conn.hello("")
        conn.send(METHOD_NUMBERS["Step"], over_socket)
        status, body = conn.answer()
        assert status == 0, body
        answered["raw-local"] = pb.StepResponse.FromString(body).results[0]
        conn.sock.close()
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)

        steps = [(s, c, b) for s, c, b in records(workdir / "data") if b[0] == KIND_STEP_WIRE]
        assert len(steps) == 2
        for (seq, crc, body), sent in zip(steps, (over_grpc, over_socket), strict=True):
            assert body.endswith(sent)
            assert crc == record_crc(seq, body)

        restarted = launch(workdir, *args)
        http = restarted.http()
        for rid, result in answered.items():
            served = http.get(f"/v1/requests/{rid}").json()
            assert served["page_ids"][0] == np.frombuffer(result.new_page_ids[0], "<i4").tolist()
            assert served["num_tokens"] == 70
    finally:
        if restarted is not None:
            restarted.stop()
        if server.process.poll() is None:
            server.stop()
