"""The example scheduler's "step feed": what a real engine sends its workers besides tables.

pagekeeper publishes each step's *tables* (kernel block ids, row lengths, slot mapping); an
engine also tells its workers which request each row is, how many tokens it schedules and
which tokens they are (vLLM's ``SchedulerOutput``). The example scheduler sends that over a
plain TCP connection per worker, and each worker acknowledges every step once it has run
it -- the way an engine waits for model outputs before the next step, which also keeps the
scheduler from publishing faster than the workers read (the ring's writer never waits).

Frames are a 4-byte little-endian length, then UTF-8 JSON. Messages::

    scheduler -> worker  {"type": "step", "step_seq": S, "sent_at": t,
                          "rows": [[request_id, seq_len, query_len], ...],   # batch order
                          "new": {request_id: [token ids, all known]},       # (re)admitted
                          "append": {request_id: [token ids]},              # since last step
                          "finished": [request_id, ...]}                    # freed
                         {"type": "end"}
    worker -> scheduler  {"type": "hello", "name": ..., "check": bool}
                         {"type": "ack", "step_seq": S, "ok": bool, "max_err": x, ...}
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

_LEN = struct.Struct("<I")
MAX_FRAME = 256 * 1024 * 1024


class FeedClosed(ConnectionError):
    """The other side closed the feed."""


def send_frame(sock: socket.socket, message: Mapping[str, Any]) -> None:
    payload = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise FeedClosed("the feed was closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > MAX_FRAME:
        raise ValueError(f"feed frame of {size} bytes is too large")
    message: dict[str, Any] = json.loads(_recv_exact(sock, size))
    return message


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


class _Peer:
    def __init__(self, sock: socket.socket, name: str, is_check: bool) -> None:
        self.sock = sock
        self.name = name
        self.is_check = is_check
        self.last_ack = 0
        self.last_sent = 0
        """The last step sent to it: the steps it must acknowledge."""
        self.acks: list[dict[str, Any]] = []
        self.is_alive = True
        self.is_synced = False
        """The scheduler took it in (:meth:`FeedServer.take_joined`): it gets steps from
        then on. A worker that joins mid-run gets none before, so none is awaited from it."""


class FeedServer:
    """The scheduler's end: accepts workers, broadcasts steps, collects acknowledgements."""

    def __init__(self, address: str = "127.0.0.1:0") -> None:
        host, port = parse_address(address)
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._peers: list[_Peer] = []
        self._cond = threading.Condition()
        self._is_closed = False
        self.num_failed_acks = 0
        self.failures: list[dict[str, Any]] = []
        threading.Thread(target=self._accept_loop, name="feed-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._is_closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                hello = recv_frame(sock)
            except (OSError, ValueError):
                sock.close()
                continue
            peer = _Peer(sock, str(hello.get("name", "?")), bool(hello.get("check")))
            with self._cond:
                self._peers.append(peer)
                self._cond.notify_all()
            threading.Thread(
                target=self._read_loop, args=(peer,), name=f"feed-{peer.name}", daemon=True
            ).start()

    def _read_loop(self, peer: _Peer) -> None:
        try:
            while True:
                message = recv_frame(peer.sock)
                if message.get("type") == "ack":
                    with self._cond:
                        peer.last_ack = int(message["step_seq"])
                        if not message.get("ok", True):
                            self.num_failed_acks += 1
                            self.failures.append({"worker": peer.name, **message})
                        self._cond.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                peer.is_alive = False
                self._cond.notify_all()

    @property
    def num_workers(self) -> int:
        with self._cond:
            return sum(p.is_alive for p in self._peers)

    def wait_for_workers(
        self, count: int, timeout: float, stop: threading.Event | None = None
    ) -> bool:
        """Wait until ``count`` workers are connected; False on timeout or when ``stop`` is
        set (a SIGTERM during start-up must not wait out the whole timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(p.is_alive for p in self._peers) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (stop is not None and stop.is_set()):
                    return False
                self._cond.wait(min(remaining, 0.2))
        return True

    def take_joined(self) -> list[str]:
        """The workers connected since the last call, taken in: steps go to them from now
        on. (The scheduler calls it before a step: one that joined mid-run lacks the running
        requests' KV, which the scheduler then computes again.)"""
        with self._cond:
            joined = [p for p in self._peers if p.is_alive and not p.is_synced]
            for peer in joined:
                peer.is_synced = True
        return [p.name for p in joined]

    def broadcast(self, message: Mapping[str, Any]) -> None:
        """Send ``message`` to the workers taken in (every live one for the "end")."""
        payload = json.dumps(message, separators=(",", ":")).encode()
        frame = _LEN.pack(len(payload)) + payload
        everyone = message.get("type") == "end"
        with self._cond:
            peers = [p for p in self._peers if p.is_alive and (p.is_synced or everyone)]
            if message.get("type") == "step":
                for peer in peers:
                    peer.last_sent = int(message["step_seq"])
        for peer in peers:
            try:
                peer.sock.sendall(frame)
            except OSError:
                with self._cond:
                    peer.is_alive = False

    def wait_acks(self, step_seq: int, timeout: float) -> bool:
        """Wait until every live worker it was sent to acknowledged ``step_seq``; False on
        timeout. (Not one that connected since: it never got the step.)"""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(p.is_alive and p.last_sent >= step_seq > p.last_ack for p in self._peers):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self) -> None:
        self.broadcast({"type": "end"})
        self._is_closed = True
        self._listener.close()
        with self._cond:
            peers = list(self._peers)
        for peer in peers:
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_WR)


class FeedClient:
    """The worker's end."""

    def __init__(self, address: str, *, name: str, is_check: bool, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        host, port = parse_address(address)
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(self.sock, {"type": "hello", "name": name, "check": is_check})

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        try:
            return recv_frame(self.sock)
        finally:
            self.sock.settimeout(None)

    def ack(self, step_seq: int, **info: Any) -> None:
        send_frame(self.sock, {"type": "ack", "step_seq": step_seq, **info})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
