"""Bare frames of the service's same-node socket (``pagekeeper_client.local``'s framing),
for tests that speak it without a client: protocol edge cases, fuzzing, scripted peers."""

from __future__ import annotations

import socket

from pagekeeper_client.local import HEADER, HELLO, MAGIC, METHOD_NUMBERS


def frame(code: int, payload: bytes) -> bytes:
    """One frame: the header (length, method number or status) and the payload."""
    return HEADER.pack(len(payload), code) + payload


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """The next frame: (method number or status, payload)."""
    length, code = HEADER.unpack(recv_exactly(sock, HEADER.size))
    return code, recv_exactly(sock, length)


class FrameConnection:
    """A bare connection to a service's same-node socket."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    def send(self, code: int, payload: bytes) -> None:
        self.sock.sendall(frame(code, payload))

    def hello(self, token: str) -> None:
        self.send(HELLO, MAGIC + token.encode())
        status, body = self.answer()
        assert status == 0, body

    def answer(self) -> tuple[int, bytes]:
        return read_frame(self.sock)

    def call(self, method: str, request: object) -> tuple[int, bytes]:
        self.send(METHOD_NUMBERS[method], request.SerializeToString())  # type: ignore[attr-defined]
        return self.answer()

    def is_closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
