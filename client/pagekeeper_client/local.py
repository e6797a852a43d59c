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
has none) and, for a client bound to a certificate (mutual TLS), a NUL, the client id, a NUL
and the ticket its registration returned (``ticket=(client_id, local_ticket)``); its answer
is the server version. A connection whose hello fails is answered with
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


class _Connection:
    """One socket of a :class:`LocalChannel` and its receive buffer (answer bodies are views
    of it, parsed before the connection serves another call)."""

    __slots__ = ("buf", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_RECV_CHUNK)


class _Channel:
    """What both channels keep: where to connect, how to say hello, the connection count."""

    def __init__(
        self,
        path: str,
        token: str | None,
        timeout: float,
        max_message_bytes: int,
        max_connections: int,
        ticket: tuple[str, str] | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.path = path
        self.max_message_bytes = max_message_bytes
        self.max_connections = max_connections
        self.server_version = ""
        self._hello = MAGIC + (token or "").encode()
        if ticket is not None and ticket[1]:
            client_id, value = ticket
            self._hello += b"\0" + client_id.encode() + b"\0" + value.encode()
        self._connect_timeout = timeout
        self._num_connections = 0
        self._closed = False

    @property
    def is_open(self) -> bool:
        return not self._closed

    def close(self) -> None:
        raise NotImplementedError

    @property
    def num_connections(self) -> int:
        """Connections open now (idle or serving a call)."""
        return self._num_connections


class LocalChannel(_Channel):
    """Connections to the service's unix socket; thread-safe.

    A connection carries one call at a time, so calls from several threads at once each
    get their own: an idle one, or a new one (opened with its hello) up to
    ``max_connections``, beyond which a call waits for one to come back. The service
    serves its connections concurrently, as gRPC serves concurrent calls.

    Raises :class:`UnavailableError` when it cannot connect or a connection breaks (the
    channel is then closed for good, every connection with it: make a new one) and the
    typed error of the service's status otherwise, as the gRPC path does.
    """

    def __init__(
        self,
        path: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        max_connections: int = 4,
        ticket: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(path, token, timeout, max_message_bytes, max_connections, ticket)
        self._pool = threading.Condition(threading.Lock())
        self._idle: list[_Connection] = []
        # The first connection now: a channel that cannot connect raises here.
        self._idle.append(self._open())
        self._num_connections = 1

    def call(self, method: str, request: Any, response_class: Any, timeout: float) -> Any:
        """One unary call: ``request`` (a message of the method's request type) in, the
        parsed response message out."""
        payload = request.SerializeToString()
        return self._roundtrip(
            METHOD_NUMBERS[method], payload, method, timeout, response_class.FromString
        )

    def close(self) -> None:
        """Close every idle connection now and each busy one when its call ends."""
        with self._pool:
            self._closed = True
            idle, self._idle = self._idle, []
            self._num_connections -= len(idle)
            self._pool.notify_all()
        for conn in idle:
            conn.sock.close()

    def _open(self) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._connect_timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise _cannot_connect(self.path, exc) from None
        conn = _Connection(sock)
        try:
            status, body = self._exchange(conn, HELLO, self._hello, "hello", self._connect_timeout)
            if status != 0:
                raise _error(status, body, "hello")  # the service closes it too
            self.server_version = bytes(body).decode()
        except BaseException:
            sock.close()
            raise
        return conn

    def _acquire(self, method: str) -> _Connection:
        with self._pool:
            while True:
                if self._closed:
                    raise UnavailableError("the local connection is closed", method=method)
                if self._idle:
                    return self._idle.pop()
                if self._num_connections < self.max_connections:
                    self._num_connections += 1  # reserved; opened outside the lock
                    break
                self._pool.wait()
        try:
            return self._open()
        except BaseException:
            with self._pool:
                self._num_connections -= 1
                self._pool.notify()
            raise

    def _release(self, conn: _Connection, *, broken: bool) -> None:
        with self._pool:
            if broken:
                # A connection that broke or timed out cannot be trusted, nor can the
                # service behind it: the channel closes (the client reconnects later).
                self._closed = True
                idle, self._idle = self._idle, []
            else:
                idle = []
                if not self._closed:
                    self._idle.append(conn)
                    self._pool.notify()
                    return
            self._num_connections -= 1 + len(idle)
            self._pool.notify_all()
        conn.sock.close()
        for other in idle:
            other.sock.close()

    def _roundtrip(
        self,
        number: int,
        payload: bytes,
        method: str,
        timeout: float,
        parse: Callable[[memoryview], Any],
    ) -> Any:
        """Send a frame on a connection of the call's own, read the answer and ``parse``
        its body before the connection goes back to the pool (the body is a view of the
        connection's buffer, which its next call reuses)."""
        _check_size(payload, self.max_message_bytes, method)
        conn = self._acquire(method)
        try:
            status, body = self._exchange(conn, number, payload, method, timeout)
        except BaseException:
            self._release(conn, broken=True)
            raise
        try:
            if status == 0:
                return parse(body)
            raise _error(status, body, method)  # an answer: the connection stays in step
        finally:
            self._release(conn, broken=False)

    def _exchange(
        self, conn: _Connection, number: int, payload: bytes, method: str, timeout: float
    ) -> tuple[int, memoryview]:
        """One frame out, one in; a lost or late answer is UnavailableError /
        DeadlineExceededError (the caller then drops the connection)."""
        sock = conn.sock
        try:
            sock.settimeout(timeout)
            _send(sock, HEADER.pack(len(payload), number), payload)
            return _receive(conn, sock)
        except TimeoutError:
            # The answer may still come: the stream cannot be trusted any more.
            raise _no_answer(timeout, method) from None
        except OSError as exc:
            raise _broken(exc, method) from None


def _receive(conn: _Connection, sock: socket.socket) -> tuple[int, memoryview]:
    """Read one answer frame; its body is a view of the connection's buffer."""
    buf = conn.buf
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
                conn.buf = buf = buf + bytes(need - len(buf))
                view = memoryview(buf)
    return status, view[size:need]


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


class AsyncLocalChannel(_Channel):
    """The asyncio twin of :class:`LocalChannel` (``await AsyncLocalChannel.connect(...)``):
    concurrent calls each get a connection of their own, up to ``max_connections``."""

    def __init__(
        self,
        path: str,
        *,
        token: str | None,
        timeout: float,
        max_message_bytes: int,
        max_connections: int,
        ticket: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(path, token, timeout, max_message_bytes, max_connections, ticket)
        # One event loop: the idle list changes only between awaits, no lock needed; the
        # semaphore bounds the calls in flight, hence the connections.
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)

    @classmethod
    async def connect(
        cls,
        path: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        max_connections: int = 4,
        ticket: tuple[str, str] | None = None,
    ) -> AsyncLocalChannel:
        channel = cls(
            path,
            token=token,
            timeout=timeout,
            max_message_bytes=max_message_bytes,
            max_connections=max_connections,
            ticket=ticket,
        )
        channel._idle.append(await channel._open())
        return channel

    async def call(self, method: str, request: Any, response_class: Any, timeout: float) -> Any:
        payload = request.SerializeToString()
        body = await self._roundtrip(METHOD_NUMBERS[method], payload, method, timeout)
        return response_class.FromString(body)

    def close(self) -> None:
        """Close every idle connection now and each busy one when its call ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for _, writer in idle:
            self._num_connections -= 1
            writer.close()

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        timeout = self._connect_timeout
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(
                    self.path, limit=self.max_message_bytes + HEADER.size
                )
        except (OSError, TimeoutError) as exc:
            raise _cannot_connect(self.path, exc) from None
        self._num_connections += 1
        conn = (reader, writer)
        try:
            status, body = await self._exchange(conn, HELLO, self._hello, "hello", timeout)
            if status != 0:
                raise _error(status, body, "hello")  # the service closes it too
        except BaseException:
            self._num_connections -= 1
            writer.close()
            raise
        self.server_version = body.decode()
        return conn

    async def _roundtrip(self, number: int, payload: bytes, method: str, timeout: float) -> bytes:
        _check_size(payload, self.max_message_bytes, method)
        async with self._slots:
            if self._closed:
                raise UnavailableError("the local connection is closed", method=method)
            conn = self._idle.pop() if self._idle else await self._open()
            try:
                status, body = await self._exchange(conn, number, payload, method, timeout)
            except BaseException:
                # Lost, late or cancelled mid-call: an answer may still come on this
                # stream, and the service behind it is in doubt. The channel closes.
                self._num_connections -= 1
                conn[1].close()
                self.close()
                raise
            if self._closed:
                self._num_connections -= 1
                conn[1].close()
            else:
                self._idle.append(conn)
            if status == 0:
                return body
            raise _error(status, body, method)

    async def _exchange(
        self,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        number: int,
        payload: bytes,
        method: str,
        timeout: float,
    ) -> tuple[int, bytes]:
        reader, writer = conn
        try:
            async with asyncio.timeout(timeout):
                writer.writelines((HEADER.pack(len(payload), number), payload))
                header = await reader.readexactly(HEADER.size)
                length, status = HEADER.unpack(header)
                return status, await reader.readexactly(length)
        except TimeoutError:
            raise _no_answer(timeout, method) from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise _broken(exc, method) from None


def _send(sock: socket.socket, header: bytes, payload: bytes) -> None:
    """Write a frame with one system call when the socket takes it all (the usual case),
    finishing a partial write with ``sendall``."""
    sent = sock.sendmsg((header, payload))
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(memoryview(payload)[sent - len(header) :])
