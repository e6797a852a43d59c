"""The same-node socket: the servicer's unary calls over a unix socket, without gRPC.

The framing is :mod:`pagekeeper_client.local`'s (defined once, beside the stubs). Each
frame is handled where it arrives, in the event loop, by the same handler body the gRPC
servicer runs, with no ``await`` in between: a step is as atomic here as over gRPC, and its
answer, journal record, step-id deduplication and error status are the same. The socket
file is created owner-only (0600); with a bearer token configured, the hello must carry it.
With mutual TLS, a call for a client bound to a certificate is served only on a connection
whose hello carried that client's ticket (from its registration over gRPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from collections.abc import Callable
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from pagekeeper import __version__
from pagekeeper.auth import PresentedToken
from pagekeeper.files import clear_stale_socket
from pagekeeper.rpc.servicer import (
    KEEPS_BYTES,
    LocalCaller,
    PagekeeperServicer,
    Received,
    run_unary,
)
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.local import HEADER, HELLO, MAGIC, METHODS

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK.value[0]
_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]

Handler = tuple[str, Any, Callable[[PagekeeperServicer, Any, Any], Any]]


def _handlers() -> dict[int, Handler]:
    """Method number -> (name, request class, the servicer's synchronous body)."""
    service = pb.DESCRIPTOR.services_by_name["PagekeeperService"]
    by_name = {m.name: m for m in service.methods}
    table: dict[int, Handler] = {}
    for number, name in enumerate(METHODS, start=1):
        body = getattr(PagekeeperServicer, name).__wrapped__  # what @_unary wraps
        table[number] = (name, getattr(pb, by_name[name].input_type.name), body)
    return table


class _Connection(asyncio.Protocol):
    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.greeted = False
        self.closing = False
        self.caller = LocalCaller()
        self.presented: PresentedToken | None = None  # the hello's token, when one is asked

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (another loop's, such as uvloop's, need not subclass
        # asyncio.Transport: no isinstance).
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)

    # Flow control: a peer that sends frames without reading the answers stops being read
    # once its unread answers pass the transport's high-water mark.
    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        limit = self.server.max_frame_bytes
        if not buf and len(data) >= HEADER.size:
            # The usual case: the whole frame came in one read; parse it in place.
            length, code = HEADER.unpack_from(data)
            if len(data) == HEADER.size + length and length <= limit:
                self._frame(code, memoryview(data)[HEADER.size :])
                return
        buf += data
        while len(buf) >= HEADER.size and not self.closing:
            length, code = HEADER.unpack_from(buf)
            if length > limit:
                self._fail(
                    _RESOURCE_EXHAUSTED,
                    f"frame of {length} bytes exceeds max_message_bytes {limit}",
                )
                return
            end = HEADER.size + length
            if len(buf) < end:
                return
            with memoryview(buf) as view:
                payload = bytes(view[HEADER.size : end])
            del buf[:end]
            self._frame(code, memoryview(payload))

    def _frame(self, code: int, payload: memoryview) -> None:
        if self.closing:
            return
        server = self.server
        if code == HELLO:
            self._hello(bytes(payload))
            return
        if not self.greeted:
            self._fail(_UNAUTHENTICATED, "the connection must open with a hello")
            return
        presented = self.presented
        if presented is not None and presented.is_revoked():
            self._fail(_UNAUTHENTICATED, "the connection's bearer token was revoked")
            return
        if server.runtime.is_stopping:
            self._answer(_UNAVAILABLE, b"the service is shutting down")
            return
        handler = server.handlers.get(code)
        if handler is None:
            self._answer(_UNIMPLEMENTED, f"no unary method number {code}".encode())
            return
        name, request_class, body = handler
        try:
            request = request_class.FromString(payload)
        except DecodeError as exc:
            # Answered before the handler, as gRPC's parser does (not timed).
            full_name = request_class.DESCRIPTOR.full_name
            reason = f"malformed {full_name} ({len(payload)} bytes): {exc}"
            self._answer(_INVALID_ARGUMENT, reason.encode())
            return
        if name in KEEPS_BYTES:
            request = Received(request, payload)
        response, status, reason = run_unary(server.servicer, name, body, request, self.caller)
        if status is grpc.StatusCode.OK:
            self._answer(_OK, response.SerializeToString())
        else:
            self._answer(status.value[0], reason.encode())

    def _hello(self, payload: bytes) -> None:
        if not payload.startswith(MAGIC):
            self._fail(_INVALID_ARGUMENT, "not a pagekeeper-local/1 hello")
            return
        tokens = self.server.tokens
        # MAGIC, the token, then (a client bound to a certificate) NUL, its id, NUL, its
        # ticket: the token itself never holds a NUL (an environment variable cannot).
        given, _, binding = payload[len(MAGIC) :].partition(b"\0")
        if tokens is not None:
            if not tokens.accepts(given):
                self._fail(_UNAUTHENTICATED, "missing or wrong bearer token")
                return
            self.presented = PresentedToken(tokens, given)
        if binding:
            client_id, _, ticket = binding.partition(b"\0")
            try:
                self.caller = LocalCaller(client_id.decode(), ticket)
            except UnicodeDecodeError:
                self._fail(_INVALID_ARGUMENT, "the hello's client id is not UTF-8")
                return
        self.greeted = True
        self._answer(_OK, __version__.encode())

    def _answer(self, status: int, body: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.closing:
            transport.writelines((HEADER.pack(len(body), status), body))

    def _fail(self, status: int, reason: str) -> None:
        """Answer with an error and close: the stream cannot go on."""
        self._answer(status, reason.encode())
        self.closing = True
        self.buf.clear()
        if self.transport is not None:
            self.transport.close()  # after the answer is written


class LocalServer:
    """The listening socket and its connections."""

    def __init__(self, servicer: PagekeeperServicer) -> None:
        runtime = servicer.runtime
        self.runtime = runtime
        self.servicer = servicer
        self.handlers = _handlers()
        self.tokens = runtime.tokens.calls
        self.max_frame_bytes = runtime.settings.max_message_bytes
        self.connections: set[_Connection] = set()
        runtime.metrics.local_connections.set_function(lambda: len(self.connections))
        self.path: str | None = None
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: str) -> str:
        """Listen on ``path`` (its directory is created, owner-only, if missing; a stale
        socket file left by a dead service is replaced; a live one is an error: two services
        must not share a path)."""
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, mode=0o700, exist_ok=True)
        mode = os.stat(directory).st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            log.warning(
                "the local socket's directory %s is world-writable without the sticky bit: "
                "another user could replace the socket; prefer a directory only this user "
                "can write",
                directory,
            )
        if clear_stale_socket(path, "local socket path"):
            raise OSError(f"another service listens on the local socket {path}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.listen(64)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)
        except BaseException:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        self.path = self.servicer.local_socket = path  # advertised at registration
        return path

    async def stop(self) -> None:
        """Stop listening, remove the socket file, close every connection (each call is
        answered before its handler returns, so closing loses none; buffered answers are
        written first)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2.0)
