"""``LocalChannel`` / ``AsyncLocalChannel`` against a scripted peer (no service): frames
split at every byte, answers larger than the receive buffer, requests larger than the
socket's buffer, a peer that hangs or goes away, error statuses mapped to the typed errors."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.errors import (
    DeadlineExceededError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from pagekeeper_client.local import (
    HELLO,
    MAGIC,
    METHOD_NUMBERS,
    AsyncLocalChannel,
    LocalChannel,
)
from tests.helpers.frames import frame, read_frame

Script = Callable[[socket.socket], None]


def answer(conn: socket.socket, status: int, body: bytes, *, bytewise: bool = False) -> None:
    data = frame(status, body)
    if bytewise:
        for i in range(len(data)):
            conn.sendall(data[i : i + 1])
    else:
        conn.sendall(data)


@pytest.fixture
def peer() -> Iterator[Callable[[Script], str]]:
    """``start(script)``: a unix socket whose one connection ``script`` handles (after a
    hello it checks); returns the path."""
    tmp = Path(tempfile.mkdtemp(prefix="pk-chan-"))
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []
    failures: list[BaseException] = []

    def start(script: Script) -> str:
        path = str(tmp / f"peer{len(listeners)}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listeners.append(listener)

        def run() -> None:
            conn, _ = listener.accept()
            try:
                code, body = read_frame(conn)
                assert code == HELLO and body.startswith(MAGIC)
                if body[len(MAGIC) :] == b"bad":
                    answer(conn, 16, b"wrong bearer token")
                    return
                answer(conn, 0, b"9.9.9")
                script(conn)
            except BaseException as exc:  # reported by the fixture
                failures.append(exc)
            finally:
                conn.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        return path

    yield start
    for thread in threads:
        thread.join(10)
    for listener in listeners:
        listener.close()
    shutil.rmtree(tmp, ignore_errors=True)
    assert not failures, failures


def test_split_answers_big_answers_and_big_requests(peer):
    big_hashes = [bytes([i % 256]) * 32 for i in range(8_000)]  # ~280 KB answer
    big_tokens = bytes(range(256)) * 4_000  # ~1 MB request

    def script(conn: socket.socket) -> None:
        code, body = read_frame(conn)
        assert code == METHOD_NUMBERS["GetPoolInfo"]
        answer(
            conn, 0, pb.GetPoolInfoResponse(server_version="x").SerializeToString(), bytewise=True
        )
        code, body = read_frame(conn)
        assert code == METHOD_NUMBERS["Lookup"]
        assert pb.LookupRequest.FromString(body).token_ids == big_tokens
        answer(
            conn, 0, pb.LookupResponse(num_hit_tokens=7, page_hashes=big_hashes).SerializeToString()
        )
        code, body = read_frame(conn)
        answer(conn, 0, pb.GetPoolInfoResponse(server_version="after").SerializeToString())

    channel = LocalChannel(peer(script), timeout=10)
    assert channel.server_version == "9.9.9"
    got = channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 10)
    assert got.server_version == "x"
    request = pb.LookupRequest(token_ids=big_tokens)
    got = channel.call("Lookup", request, pb.LookupResponse, 10)
    assert got.num_hit_tokens == 7 and list(got.page_hashes) == big_hashes
    # The grown buffer still serves small answers.
    got = channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 10)
    assert got.server_version == "after"
    channel.close()
    assert not channel.is_open


def test_statuses_become_typed_errors_and_the_connection_goes_on(peer):
    def script(conn: socket.socket) -> None:
        read_frame(conn)
        answer(conn, 5, b"request 'x' holds no pages")
        read_frame(conn)
        answer(conn, 0, pb.GetPoolInfoResponse(server_version="ok").SerializeToString())

    channel = LocalChannel(peer(script), timeout=10)
    with pytest.raises(NotFoundError, match="holds no pages") as caught:
        channel.call(
            "GetBlockTable", pb.GetBlockTableRequest(request_id="x"), pb.GetBlockTableResponse, 10
        )
    assert caught.value.method == "GetBlockTable"
    got = channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 10)
    assert got.server_version == "ok"


def test_a_refused_hello_is_an_error_and_closes(peer):
    with pytest.raises(UnauthenticatedError, match="wrong bearer token"):
        LocalChannel(peer(lambda conn: None), token="bad", timeout=10)


def test_no_answer_in_time_is_a_deadline_and_drops_the_connection(peer):
    release = threading.Event()

    def script(conn: socket.socket) -> None:
        read_frame(conn)
        release.wait(10)  # never answers in time

    channel = LocalChannel(peer(script), timeout=10)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 0.3)
    assert time.monotonic() - started < 5
    assert not channel.is_open  # a late answer would desynchronise the stream
    with pytest.raises(UnavailableError, match="closed"):
        channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 1)
    release.set()


def test_a_peer_that_goes_away_is_unavailable(peer):
    def script(conn: socket.socket) -> None:
        read_frame(conn)  # then closes without answering

    channel = LocalChannel(peer(script), timeout=10)
    with pytest.raises(UnavailableError, match="broke"):
        channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 5)
    assert not channel.is_open


def test_requests_over_the_size_limit_are_refused_before_sending(peer):
    def script(conn: socket.socket) -> None:
        read_frame(conn)
        answer(conn, 0, b"")

    channel = LocalChannel(peer(script), timeout=10, max_message_bytes=1024)
    with pytest.raises(ResourceExhaustedError, match="max_message_bytes 1024"):
        channel.call("Lookup", pb.LookupRequest(token_ids=b"\0" * 2048), pb.LookupResponse, 5)
    # Nothing was sent: the next call is answered normally.
    got = channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 5)
    assert got == pb.GetPoolInfoResponse()


def test_cannot_connect_is_unavailable(tmp_path):
    with pytest.raises(UnavailableError, match="cannot connect"):
        LocalChannel(str(tmp_path / "nobody.sock"), timeout=1)


def test_async_channel_big_answers_errors_and_deadline(peer):
    big_hashes = [bytes([i % 256]) * 32 for i in range(8_000)]
    release = threading.Event()

    def script(conn: socket.socket) -> None:
        read_frame(conn)
        answer(
            conn, 0, pb.LookupResponse(page_hashes=big_hashes).SerializeToString(), bytewise=False
        )
        read_frame(conn)
        answer(conn, 9, b"the pool is busy", bytewise=True)
        read_frame(conn)
        release.wait(10)

    path = peer(script)

    async def main() -> None:
        channel = await AsyncLocalChannel.connect(path, timeout=10)
        assert channel.server_version == "9.9.9"
        got = await channel.call("Lookup", pb.LookupRequest(), pb.LookupResponse, 10)
        assert list(got.page_hashes) == big_hashes
        with pytest.raises(Exception, match="the pool is busy") as caught:
            await channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 10)
        assert caught.value.code.name == "FAILED_PRECONDITION"
        with pytest.raises(DeadlineExceededError):
            await channel.call("GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, 0.3)
        assert not channel.is_open

    asyncio.run(main())
    release.set()


class GatedPeer:
    """A unix socket serving any number of connections, each answering its requests with
    the request's own bytes (an echo of a HeartbeatRequest parses as one) -- but only
    once ``gate`` requests are waiting at the same time: calls that a channel serialized
    would never all arrive, and time out."""

    def __init__(self, path: str, gate: int) -> None:
        self.path = path
        self.barrier = threading.Barrier(gate, timeout=5)
        self.lock = threading.Lock()
        self.pending = self.most_pending = self.num_connections = 0
        self.failures: list[BaseException] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.num_connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            code, body = read_frame(conn)
            assert code == HELLO and body.startswith(MAGIC)
            answer(conn, 0, b"9.9.9")
            while True:
                try:
                    code, body = read_frame(conn)
                except ConnectionError:
                    return
                with self.lock:
                    self.pending += 1
                    self.most_pending = max(self.most_pending, self.pending)
                self.barrier.wait()
                with self.lock:
                    self.pending -= 1
                answer(conn, 0, body)
        except BaseException as exc:
            self.failures.append(exc)
        finally:
            conn.close()

    def close(self) -> None:
        self.listener.close()


def test_concurrent_calls_each_get_a_connection(tmp_path_factory):
    """Four threads call at once on one channel: four connections, the four calls in flight
    together (the peer answers none until all four arrived), each its own answer; calls
    after that reuse the idle connections."""
    tmp = Path(tempfile.mkdtemp(prefix="pk-pool-"))
    peer = GatedPeer(str(tmp / "p.sock"), gate=4)
    channel = LocalChannel(peer.path, timeout=10)
    try:
        answers: dict[int, str] = {}

        def call(k: int) -> None:
            request = pb.HeartbeatRequest(client_id=f"thread-{k}")
            answers[k] = channel.call("Heartbeat", request, pb.HeartbeatRequest, 10).client_id

        for _ in range(3):  # the same four connections every round
            threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(15)
            assert answers == {k: f"thread-{k}" for k in range(4)}
            answers.clear()
        assert peer.most_pending == 4 and not peer.failures
        assert channel.num_connections == peer.num_connections == 4
    finally:
        channel.close()
        peer.close()
        shutil.rmtree(tmp, ignore_errors=True)
    assert channel.num_connections == 0 and not channel.is_open


def test_connections_are_capped_and_calls_wait_for_one(tmp_path_factory):
    """max_connections=2 with three threads calling: at most two calls are ever in flight
    (the third waits for a connection) and every call is answered."""
    tmp = Path(tempfile.mkdtemp(prefix="pk-pool-"))
    peer = GatedPeer(str(tmp / "p.sock"), gate=2)
    channel = LocalChannel(peer.path, timeout=10, max_connections=2)
    try:
        answers: list[str] = []

        def call(k: int) -> None:
            request = pb.HeartbeatRequest(client_id=f"c{k}")
            got = channel.call("Heartbeat", request, pb.HeartbeatRequest, 10)
            answers.append(got.client_id)

        # Four calls: two pairs pass the gate of two.
        threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        assert sorted(answers) == ["c0", "c1", "c2", "c3"]
        assert peer.most_pending == 2 and peer.num_connections == 2 and not peer.failures
    finally:
        channel.close()
        peer.close()
        shutil.rmtree(tmp, ignore_errors=True)
    with pytest.raises(ValueError, match="max_connections"):
        LocalChannel(str(tmp / "none.sock"), max_connections=0)


def test_async_concurrent_calls_each_get_a_connection():
    """The asyncio channel: three tasks at once, three connections, all in flight together;
    a task cancelled mid-call closes the channel (its answer could still arrive and be read
    by the next call otherwise)."""
    tmp = Path(tempfile.mkdtemp(prefix="pk-pool-"))
    peer = GatedPeer(str(tmp / "p.sock"), gate=3)

    async def main() -> None:
        channel = await AsyncLocalChannel.connect(peer.path, timeout=10)

        async def call(k: int) -> str:
            request = pb.HeartbeatRequest(client_id=f"task-{k}")
            got = await channel.call("Heartbeat", request, pb.HeartbeatRequest, 10)
            return str(got.client_id)

        assert await asyncio.gather(*(call(k) for k in range(3))) == [
            "task-0",
            "task-1",
            "task-2",
        ]
        assert channel.num_connections == 3 and channel.is_open
        # One call alone never passes the gate of three: cancelled, it closes the channel.
        pending = asyncio.ensure_future(call(9))
        await asyncio.sleep(0.2)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert not channel.is_open and channel.num_connections == 0
        with pytest.raises(UnavailableError, match="closed"):
            await call(10)

    try:
        asyncio.run(main())
        assert peer.most_pending == 3
    finally:
        peer.barrier.abort()
        peer.close()
        shutil.rmtree(tmp, ignore_errors=True)
