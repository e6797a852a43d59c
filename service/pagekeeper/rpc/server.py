"""Assemble the ``grpc.aio`` server: servicer, health, reflection, auth, limits, keepalive."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagekeeper.auth import BearerTokens
from pagekeeper.rpc.servicer import KEEPS_BYTES, PagekeeperServicer, Received
from pagekeeper.runtime import Runtime
from pagekeeper.settings import Settings
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PagekeeperService"].full_name
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def grpc_options(settings: Settings) -> list[tuple[str, Any]]:
    """Channel arguments of the server.

    Keepalive: clients may ping every 30 s even with no call in flight (the minimum accepted
    interval is 10 s, so a 30 s client never collects "too many pings" strikes); the server
    pings idle clients every 60 s and drops them after 20 s without an answer.
    """
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # Two servers must never share a port silently.
        ("grpc.so_reuseport", 0),
    ]


def _deny_handler(message: str) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Require ``authorization: Bearer <token>`` on every call except health checks (load
    balancers and orchestrators probe health without credentials)."""

    def __init__(self, tokens: BearerTokens) -> None:
        self._tokens = tokens  # followed as it reloads: each call checks the tokens in force
        self._missing = _deny_handler("missing 'authorization: Bearer <token>' metadata")
        self._wrong = _deny_handler("invalid bearer token")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if self._tokens.accepts_header(given):
                    return await continuation(handler_call_details)
                return self._wrong
        return self._missing


class MalformedRequest:
    """What a request that does not parse deserializes to: the handler answers
    INVALID_ARGUMENT with the reason (grpc itself would answer UNKNOWN)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parser(message_class: type[Message], keep_bytes: bool = False) -> Callable[[bytes], Any]:
    """The request deserializer: the message, or with ``keep_bytes`` a :class:`Received`
    holding the message and its bytes."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            message = message_class.FromString(data)
        except DecodeError as exc:
            return MalformedRequest(f"malformed {name} ({len(data)} bytes): {exc}")
        return Received(message, data) if keep_bytes else message

    return parse


def _guard_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is MalformedRequest:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await behavior(request, context)

    return guarded


def _guard_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is MalformedRequest:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        async for item in behavior(request, context):
            yield item

    return guarded


def add_servicer(servicer: PagekeeperServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated ``add_PagekeeperServiceServicer_to_server``,
    built from the service descriptor, except that a request whose bytes do not parse gets
    INVALID_ARGUMENT naming the message (not UNKNOWN)."""
    service = pb.DESCRIPTOR.services_by_name["PagekeeperService"]
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        behavior = getattr(servicer, method.name)
        if method.server_streaming:
            handler = grpc.unary_stream_rpc_method_handler(
                _guard_stream(behavior),
                request_deserializer=_parser(request_class),
                response_serializer=response_class.SerializeToString,
            )
        else:
            handler = grpc.unary_unary_rpc_method_handler(
                _guard_unary(behavior),
                request_deserializer=_parser(request_class, method.name in KEEPS_BYTES),
                response_serializer=response_class.SerializeToString,
            )
        handlers[method.name] = handler
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


class GrpcServer:
    """The started server, its bound address and its health servicer."""

    def __init__(self, runtime: Runtime) -> None:
        settings = runtime.settings
        tokens = runtime.tokens.calls
        interceptors = [BearerTokenInterceptor(tokens)] if tokens is not None else []
        self.server = grpc.aio.server(interceptors=interceptors, options=grpc_options(settings))
        self.servicer = PagekeeperServicer(runtime)
        add_servicer(self.servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.address = ""

    async def start(self, address: str, credentials: grpc.ServerCredentials | None = None) -> str:
        """Bind and start (over TLS with ``credentials``); returns the bound address (the
        real port when 0 was asked)."""
        is_unix = address.startswith("unix:")
        try:
            if credentials is None:
                port = self.server.add_insecure_port(address)
            else:
                port = self.server.add_secure_port(address, credentials)
            bound = port > 0 or is_unix
        except RuntimeError:  # grpcio says only "Failed to bind" (its C core logs why)
            bound = False
        if not bound:
            # Stopped now, on this loop: a server left to the collector would schedule
            # its shutdown on a loop that is closed by then (a traceback at exit).
            await self.server.stop(None)
            raise OSError(
                f"cannot bind gRPC to {address} (in use or unavailable: grpc logs the reason)"
            )
        if not is_unix:
            host = address.rpartition(":")[0]
            address = f"{host}:{port}"
        await self.set_serving(False)
        await self.server.start()
        self.address = address
        return address

    async def set_serving(self, is_serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """Stop accepting, let in-flight calls finish for up to ``grace`` seconds."""
        await self.set_serving(False)
        await self.server.stop(grace)
