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
