"""The same-node transport: pagekeeper's unary calls over a unix socket, without gRPC.

A Python gRPC round trip costs 0.5-1 ms of HTTP/2 framing and call machinery on the two
sides together; a scheduler on the same host as the service pays it on every step. The
service can also listen on a unix socket (``pagekeeper serve --local-socket PATH``) that
carries the very same request and response messages in plain frames::

    frame  = header payload
    header = length:uint32 little-endian, code:uint8      (length = len(payload))

A request's code names the method: ``0`` is the hello that opens every connection, then the
service's unary methods numbered from 1 in the order the .proto declares them
(:data:`METHODS`). A response's code is a gRPC status number: ``0`` with the serialized
response message, anything else with the UTF-8 reason. A connection carries one call at a
time and the service answers in order.

The hello's payload is :data:`MAGIC` followed by the bearer token (nothing when the service
has none); its answer is the server version. A connection whose hello fails is answered with
the status and closed.

Semantics are gRPC's, call for call: the service runs the same handler bodies, so a Step
sent here is validated, journaled, deduplicated by step id and answered exactly as over
gRPC, and an error is the same status with the same reason. Only the transport differs: no
deadlines travel (the client times out locally and drops the connection, which it cannot
resynchronise), and no streams (``WatchEvents`` and ``WatchTables`` stay on gRPC).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.errors import (
    DeadlineExceededError,
    PagekeeperError,
    ResourceExhaustedError,
    UnavailableError,
    error_from_status,
    status_code,
)

__all__ = [
    "HEADER",
    "HELLO",
    "MAGIC",
    "METHODS",
    "METHOD_NUMBERS",
    "AsyncLocalChannel",
    "LocalChannel",
]

HEADER = struct.Struct("<IB")
"""A frame's header: payload length, then the method number (requests) or status (answers)."""
MAGIC = b"pagekeeper-local/1\n"
"""Opens the hello payload; names the framing version."""
HELLO = 0
METHODS: tuple[str, ...] = tuple(
    m.name
    for m in pb.DESCRIPTOR.services_by_name["PagekeeperService"].methods
    if not m.client_streaming and not m.server_streaming
)
"""The unary methods, numbered from 1 in this order."""
METHOD_NUMBERS = {name: number for number, name in enumerate(METHODS, start=1)}
_RECV_CHUNK = 1 << 16


class LocalChannel:
    """One connection to the service's unix socket; thread-safe (calls take turns).

    Raises :class:`UnavailableError` when it cannot connect or the connection breaks (it is
    then closed for good: make a new one) and the typed error of the service's status
    otherwise, as the gRPC path does.
    """

    def __init__(
        self,
        path: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.path = path
        self.max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        self._buf = bytearray(_RECV_CHUNK)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise _cannot_connect(path, exc) from None
        self._sock: socket.socket | None = sock
        hello = _hello(token)
        self.server_version = self._roundtrip(HELLO, hello, "hello", timeout, bytes).decode()

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def call(self, method: str, request: Any, response_class: Any, timeout: float) -> Any:
        """One unary call: ``request`` (a message of the method's request type) in, the
        parsed response message out."""
        payload = request.SerializeToString()
        return self._roundtrip(
            METHOD_NUMBERS[method], payload, method, timeout, response_class.FromString
        )

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _roundtrip(
        self,
        number: int,
        payload: bytes,
        method: str,
        timeout: float,
        parse: Callable[[memoryview], Any],
    ) -> Any:
        """Send a frame, read the answer and ``parse`` its body under the lock (the body is
        a view of the channel's buffer, which the next call reuses)."""
        _check_size(payload, self.max_message_bytes, method)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise UnavailableError("the local connection is closed", method=method)
            try:
                sock.settimeout(timeout)
                _send(sock, HEADER.pack(len(payload), number), payload)
                status, body = self._receive(sock)
            except TimeoutError:
                # The answer may still come: the stream cannot be trusted any more.
                self._drop()
                raise _no_answer(timeout, method) from None
            except OSError as exc:
                self._drop()
                raise _broken(exc, method) from None
            if status == 0:
                return parse(body)
            if number == HELLO:
                self._drop()  # the service closes it too
            raise _error(status, body, method)

    def _receive(self, sock: socket.socket) -> tuple[int, memoryview]:
        """Read one answer frame; its body is a view of the channel's buffer."""
        buf = self._buf
        view = memoryview(buf)
        size = HEADER.size
        got = 0
        length = status = -1  # until the header is in
        need = size
        while got < need:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionResetError("the service closed the connection")
            got += k
            if length < 0 and got >= size:
                length, status = HEADER.unpack_from(buf)
                need = size + length
                if need > len(buf):
                    self._buf = buf = buf + bytes(need - len(buf))
                    view = memoryview(buf)
        return status, view[size:need]


def _hello(token: str | None) -> bytes:
    return MAGIC + (token or "").encode()


def _cannot_connect(path: str, exc: BaseException) -> UnavailableError:
    return UnavailableError(
        f"cannot connect to the local socket {path}: {exc or 'timed out'}", method="local"
    )


def _no_answer(timeout: float, method: str) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"no answer on the local socket within {timeout:g} s", method=method
    )


def _broken(exc: BaseException, method: str) -> UnavailableError:
    return UnavailableError(
        f"the local connection broke: {exc or type(exc).__name__}", method=method
    )


def _error(status: int, body: bytes | memoryview, method: str) -> PagekeeperError:
    return error_from_status(status_code(status), bytes(body).decode(errors="replace"), method)


def _check_size(payload: bytes, limit: int, method: str) -> None:
    if len(payload) > limit:
        raise ResourceExhaustedError(
            f"request of {len(payload)} bytes exceeds max_message_bytes {limit}", method=method
        )


class AsyncLocalChannel:
    """The asyncio twin of :class:`LocalChannel` (``await AsyncLocalChannel.connect(...)``);
    calls on one channel take turns."""

    def __init__(
        self,
        path: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        max_message_bytes: int,
    ) -> None:
        self.path = path
        self.max_message_bytes = max_message_bytes
        self.server_version = ""
        self._reader = reader
        self._writer: asyncio.StreamWriter | None = writer
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        path: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> AsyncLocalChannel:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(
                    path, limit=max_message_bytes + HEADER.size
                )
        except (OSError, TimeoutError) as exc:
            raise _cannot_connect(path, exc) from None
        channel = cls(path, reader, writer, max_message_bytes)
        hello = _hello(token)
        channel.server_version = (await channel._roundtrip(HELLO, hello, "hello", timeout)).decode()
        return channel

    @property
    def is_open(self) -> bool:
        return self._writer is not None

    async def call(self, method: str, request: Any, response_class: Any, timeout: float) -> Any:
        payload = request.SerializeToString()
        body = await self._roundtrip(METHOD_NUMBERS[method], payload, method, timeout)
        return response_class.FromString(body)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    async def _roundtrip(self, number: int, payload: bytes, method: str, timeout: float) -> bytes:
        _check_size(payload, self.max_message_bytes, method)
        async with self._lock:
            writer = self._writer
            if writer is None:
                raise UnavailableError("the local connection is closed", method=method)
            try:
                async with asyncio.timeout(timeout):
                    writer.writelines((HEADER.pack(len(payload), number), payload))
                    header = await self._reader.readexactly(HEADER.size)
                    length, status = HEADER.unpack(header)
                    body = await self._reader.readexactly(length)
            except TimeoutError:
                self.close()
                raise _no_answer(timeout, method) from None
            except (OSError, asyncio.IncompleteReadError) as exc:
                self.close()
                raise _broken(exc, method) from None
            if status == 0:
                return body
            if number == HELLO:
                self.close()
            raise _error(status, body, method)


def _send(sock: socket.socket, header: bytes, payload: bytes) -> None:
    """Write a frame with one system call when the socket takes it all (the usual case),
    finishing a partial write with ``sendall``."""
    sent = sock.sendmsg((header, payload))
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(memoryview(payload)[sent - len(header) :])
