"""The gRPC servicer: convert the request, call the state, convert the answer.

Unary handlers run their whole body synchronously (no ``await`` between reading and writing
the state), so a step is atomic with respect to every other call in the process. Errors of
the core leave through :mod:`pagekeeper.errors_map`, the one status table.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from pagekeeper import __version__
from pagekeeper.auth import BearerTokens, PresentedToken
from pagekeeper.core.errors import NotFound, PagekeeperError, PermissionDenied
from pagekeeper.errors_map import grpc_status
from pagekeeper.rpc import convert
from pagekeeper.runtime import Runtime
from pagekeeper.state import (
    ClientRole,
    HeartbeatCommand,
    RegisterCommand,
    ResetPrefixCacheCommand,
    UnregisterCommand,
)
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")

DEFAULT_EVENTS_PER_MESSAGE = 1024
MAX_EVENTS_PER_MESSAGE = 16384
# Streams re-check their client's registration at least this often while idle.
_STREAM_RECHECK_S = 1.0


def _stream_token(tokens: BearerTokens | None, context: Any) -> PresentedToken | None:
    """The token a stream opened with (the interceptor accepted it then), to stop the stream
    once it is revoked; None when the service asks for none."""
    if tokens is None:
        return None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            header = value.encode() if isinstance(value, str) else value
            return PresentedToken(tokens, header.removeprefix(b"Bearer "))
    return PresentedToken(tokens, b"")


_REVOKED = "the stream's bearer token was revoked"


class LocalCaller:
    """The context the same-node socket hands a handler body: the client id and ticket its
    connection's hello carried (empty: none), in place of gRPC's certificate."""

    __slots__ = ("client_id", "ticket", "verified")

    def __init__(self, client_id: str = "", ticket: bytes = b"") -> None:
        self.client_id = client_id
        self.ticket = ticket
        self.verified: tuple[str, str] | None = None
        """``(client id, certificate subject)`` the ticket was last checked against."""


class Received:
    """A request parsed by a transport, with the bytes it was parsed from: what the
    transports hand the bodies of :data:`KEEPS_BYTES` (``Step``, whose journal record
    holds the request as it came instead of serializing the message again)."""

    __slots__ = ("data", "message")

    def __init__(self, message: Any, data: bytes | memoryview) -> None:
        self.message = message
        self.data = data


KEEPS_BYTES = frozenset({"Step"})
"""The methods whose bodies take a :class:`Received` (a plain message works too)."""


def peer_identity(context: Any) -> str:
    """The TLS certificate subject of the caller's connection: its common name, else its
    first subject alternative name ("" without one, or off gRPC)."""
    if context is None or type(context) is LocalCaller:
        return ""
    auth = context.auth_context()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        values = auth.get(key)
        if values:
            first = values[0]
            return first.decode(errors="replace") if isinstance(first, bytes) else str(first)
    return ""


def run_unary(
    servicer: PagekeeperServicer,
    name: str,
    body: Callable[[Any, Any, Any], Any],
    request: Any,
    context: Any,
) -> tuple[Any, grpc.StatusCode, str]:
    """Run a synchronous handler body for either transport (gRPC, the same-node socket):
    ``(response, OK, "")``, or ``(None, status, reason)`` from the one status table (an
    unexpected exception is logged and INTERNAL). Times the call by method and status."""
    started = time.perf_counter()
    status, reason, response = grpc.StatusCode.OK, "", None
    try:
        response = body(servicer, request, context)
    except PagekeeperError as exc:
        status, reason = grpc_status(exc)
    except Exception:
        status, reason = grpc.StatusCode.INTERNAL, f"internal error in {name}"
        log.exception("%s failed", name)
    servicer._rpc_seconds.labels(name, status.name).observe(time.perf_counter() - started)
    return response, status, reason


def _unary(
    method: Callable[[Any, Req, grpc.aio.ServicerContext], Resp],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Any]:
    """Wrap a synchronous handler body for gRPC (:func:`run_unary`, then abort with the
    status if the body failed).

    The same-node socket (:mod:`pagekeeper.rpc.local`) runs the bodies themselves
    (``__wrapped__``) with its connection's :class:`LocalCaller` as the context: a body
    must not use gRPC's context beyond :func:`peer_identity`."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(
        self: PagekeeperServicer, request: Req, context: grpc.aio.ServicerContext
    ) -> Resp:
        response, status, reason = run_unary(self, name, method, request, context)
        if status is not grpc.StatusCode.OK:
            await context.abort(status, reason)
        return response  # type: ignore[no-any-return]

    return handler


class PagekeeperServicer(pb_grpc.PagekeeperServiceServicer):  # type: ignore[misc]
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.state = runtime.state
        self._rpc_seconds = runtime.metrics.rpc_seconds
        self._step_seconds = runtime.metrics.step_apply_seconds
        settings = runtime.settings
        self._pool_pb = convert.pool_config_to_pb(settings.pool)
        self._limits_pb = convert.limits_to_pb(self.state.limits, settings.max_message_bytes)
        tls = runtime.tls
        self._bind_identities = tls is not None and tls.requires_client_certificates
        """Registrations are bound to the caller's certificate (mutual TLS)."""
        self.local_socket = ""
        """The same-node socket's absolute path once it listens (advertised at registration)."""
        self._ticket_key = b""
        durability = runtime.durability
        if self._bind_identities:
            # Stable across restarts where the state is (a recovered registration's ticket
            # still opens the socket); a state that starts empty needs none.
            self._ticket_key = (
                durability.secret("local_ticket") if durability is not None else os.urandom(32)
            )
        self.state_id = (
            durability.secret("state_id") if durability is not None else os.urandom(32)
        )[:8].hex()
        """Names this service's state: kept with the data dir, new when the state starts
        empty (see RegisterClientResponse.state_id)."""

    def _check_state(self, client_id: str, state_id: str) -> None:
        """A call naming another state of this service (registered before the state was
        reset) is for a client that no longer exists here, even where the new state gave
        out the same id and generation again."""
        if state_id and state_id != self.state_id:
            raise NotFound(
                f"client {client_id!r} registered with state {state_id}, but this service's "
                f"state is {self.state_id}: it was reset (a wiped data dir, or durability "
                "none) and that registration and its requests are gone; register anew"
            )

    def local_ticket(self, client_id: str, identity: str) -> str:
        """What a same-node socket connection presents to act for ``client_id``, bound to
        ``identity``: an HMAC of both under this service's key (hex)."""
        message = f"{client_id}\0{identity}".encode()
        return hmac.new(self._ticket_key, message, hashlib.sha256).hexdigest()

    def _check_identity(self, client_id: str, context: Any) -> None:
        """With mutual TLS, a call for a client bound to a certificate must come over a
        gRPC connection with that certificate, or a same-node socket connection that opened
        with the client's ticket (handed out at registration)."""
        if not self._bind_identities:
            return
        bound = self.state.identity_of(client_id)
        if not bound:
            return
        if context is None or type(context) is LocalCaller:
            if context is not None and context.client_id == client_id:
                if context.verified == (client_id, bound):
                    return
                expected = self.local_ticket(client_id, bound).encode()
                if hmac.compare_digest(context.ticket, expected):
                    context.verified = (client_id, bound)
                    return
            raise PermissionDenied(
                f"client {client_id!r} is bound to certificate {bound!r}; this same-node "
                "socket connection did not open with its ticket (RegisterClientResponse"
                ".local_ticket, sent in the hello)"
            )
        if (presented := peer_identity(context)) != bound:
            raise PermissionDenied(
                f"client {client_id!r} is bound to certificate {bound!r}; this connection "
                f"presents {presented!r}"
            )

    # -- pool ---------------------------------------------------------------------------
    @_unary
    def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context: Any) -> pb.GetPoolInfoResponse:
        state = self.state
        return pb.GetPoolInfoResponse(
            config=self._pool_pb,
            limits=self._limits_pb,
            counters=convert.counters_to_pb(
                state.stats(), state.counters, len(state.clients()), state.last_event_seq
            ),
            server_version=__version__,
        )

    # -- registration -------------------------------------------------------------------
    @_unary
    def RegisterClient(
        self, request: pb.RegisterClientRequest, context: Any
    ) -> pb.RegisterClientResponse:
        role = convert.role_from_pb(request.role)
        identity = ""
        if self._bind_identities:
            if context is None or type(context) is LocalCaller:
                raise PermissionDenied(
                    "with mutual TLS a client registers over gRPC, with its certificate "
                    "(the same-node socket carries none)"
                )
            identity = peer_identity(context)
        result = self.state.register(
            RegisterCommand(
                now=self.runtime.now(),
                role=role,
                name=request.name,
                client_id=request.client_id,
                lease_ttl_s=request.lease_ttl_ms / 1000.0,
                device=request.device,
                kernel_support=convert.kernel_support_from_pb(request.kernel_support),
                identity=identity,
                fresh_kv_cache=request.fresh_kv_cache,
            )
        )
        response = pb.RegisterClientResponse(
            client_id=result.client_id,
            generation=result.generation,
            lease_ttl_ms=round(result.lease_ttl_s * 1000),
            kernel_block_sizes=[
                pb.KernelBlockSize(group_id=g, kernel_block_size=k)
                for g, k in enumerate(result.kernel_block_sizes)
            ],
            pool=self._pool_pb,
            limits=self._limits_pb,
            last_step_id=result.last_step_id,
            last_published_step_seq=result.last_published_step_seq,
            local_socket=self.local_socket,
            local_ticket=self.local_ticket(result.client_id, identity)
            if identity and self.local_socket
            else "",
            state_id=self.state_id,
            request_ids=result.request_ids,
        )
        if result.ring is not None:
            response.ring.CopyFrom(convert.ring_to_pb(result.ring))
        log.info(
            "registered %s %s generation %d%s",
            role.value,
            result.client_id,
            result.generation,
            f" kernel block sizes {list(result.kernel_block_sizes)}"
            if role is ClientRole.WORKER
            else "",
        )
        return response

    @_unary
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        self._check_state(request.client_id, request.state_id)
        self._check_identity(request.client_id, context)
        result = self.state.heartbeat(
            HeartbeatCommand(self.runtime.now(), request.client_id, request.generation)
        )
        response = pb.HeartbeatResponse(
            lease_ttl_ms=round(result.lease_ttl_s * 1000), last_event_seq=result.last_event_seq
        )
        if result.ring is not None:
            response.ring.CopyFrom(convert.ring_to_pb(result.ring))
        return response

    @_unary
    def Unregister(self, request: pb.UnregisterRequest, context: Any) -> pb.UnregisterResponse:
        self._check_state(request.client_id, request.state_id)
        self._check_identity(request.client_id, context)
        freed = self.state.unregister(
            UnregisterCommand(self.runtime.now(), request.client_id, request.generation)
        )
        log.info("unregistered %s (%d requests freed)", request.client_id, freed)
        return pb.UnregisterResponse(num_freed_requests=freed)

    # -- the hot path -------------------------------------------------------------------
    @_unary
    def Step(self, request: pb.StepRequest | Received, context: Any) -> pb.StepResponse:
        data = None
        if type(request) is Received:
            request, data = request.message, request.data
        self._check_state(request.client_id, request.state_id)
        self._check_identity(request.client_id, context)
        command = convert.step_from_pb(request, self.runtime.now(), data)
        started = time.perf_counter()
        result = self.state.step(command)
        self._step_seconds.observe(time.perf_counter() - started)
        return convert.step_result_to_pb(result, request, command)

    @_unary
    def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        result = self.state.lookup(
            convert.decode_i32(request.token_ids, "token_ids"),
            convert.extra_keys_from_pb(request.extra_keys)
            if request.HasField("extra_keys")
            else None,
            tuple(request.page_hashes) if request.page_hashes else None,
            request.packed_page_hashes or None,
        )
        return pb.LookupResponse(
            num_hit_tokens=result.num_hit_tokens,
            page_ids=[convert.encode_i32(pages) for pages in result.page_ids],
            page_hashes=list(result.page_hashes),
        )

    @_unary
    def GetBlockTable(
        self, request: pb.GetBlockTableRequest, context: Any
    ) -> pb.GetBlockTableResponse:
        pages, kernel_ids, kbs = self.state.block_table(
            request.request_id, request.group_id, request.kernel_block_size
        )
        info = self.state.request_info(request.request_id)
        return pb.GetBlockTableResponse(
            request_id=request.request_id,
            group_id=request.group_id,
            page_size=self.state.pool_config.groups[request.group_id].page_size,
            kernel_block_size=kbs,
            page_ids=convert.encode_i32(pages),
            kernel_block_ids=convert.encode_i32(kernel_ids),
            num_tokens=info.num_tokens,
            num_computed_tokens=info.num_computed_tokens,
            num_cached_tokens=info.num_cached_tokens,
            owner=info.owner,
        )

    @_unary
    def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: Any
    ) -> pb.ResetPrefixCacheResponse:
        dropped = self.state.reset_prefix_cache(ResetPrefixCacheCommand(self.runtime.now()))
        log.info("prefix cache reset over gRPC (%d cached pages dropped)", dropped)
        return pb.ResetPrefixCacheResponse(num_dropped_pages=dropped)

    # -- streams ------------------------------------------------------------------------
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        limit = request.max_events_per_message or DEFAULT_EVENTS_PER_MESSAGE
        if not 0 < limit <= MAX_EVENTS_PER_MESSAGE:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_events_per_message must lie in [1, {MAX_EVENTS_PER_MESSAGE}]",
            )
        runtime = self.runtime
        presented = _stream_token(runtime.tokens.calls, context)
        since = request.since_seq
        is_first = True
        while not runtime.is_stopping:
            if presented is not None and presented.is_revoked():
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REVOKED)
            version = runtime.events.version
            page = self.state.events_since(since, limit)
            if page.events or page.fell_behind or is_first:
                is_first = False
                yield pb.WatchEventsResponse(
                    events=[convert.event_to_pb(e) for e in page.events],
                    fell_behind=page.fell_behind,
                    first_retained_seq=page.first_retained_seq,
                    last_event_seq=page.last_event_seq,
                )
                if page.events:
                    since = page.events[-1].seq
                elif page.fell_behind:
                    since = page.first_retained_seq - 1
                continue
            await runtime.events.wait(version)

    async def WatchTables(
        self, request: pb.WatchTablesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchTablesResponse]:
        runtime, hub = self.runtime, self.runtime.hub
        try:
            self._check_state(request.client_id, request.state_id)
            self._check_identity(request.client_id, context)
            client = self.state.check_client(request.client_id, request.generation, runtime.now())
        except PagekeeperError as exc:
            await context.abort(*grpc_status(exc))
        if client.role is not ClientRole.WORKER:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "WatchTables is for registered workers"
            )
        presented = _stream_token(runtime.tokens.calls, context)
        since = (
            request.since_step_seq
            if request.since_exact or request.since_step_seq
            else hub.last_step_seq
        )
        while not runtime.is_stopping:
            if presented is not None and presented.is_revoked():
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REVOKED)
            version = hub.notifier.version
            batches, fell_behind = hub.batches_after(since)
            for batch in batches:
                yield pb.WatchTablesResponse(
                    step_seq=batch.step_seq,
                    epoch=batch.epoch,
                    tables=[convert.table_to_pb(t) for t in batch.tables],
                    fell_behind=fell_behind,
                )
                fell_behind = False
                since = batch.step_seq
            if batches:
                continue
            if not await hub.notifier.wait(version, timeout=_STREAM_RECHECK_S):
                # Idle: end the stream once the worker is no longer registered.
                try:
                    self.state.check_client(request.client_id, request.generation, runtime.now())
                except PagekeeperError as exc:
                    await context.abort(*grpc_status(exc))
