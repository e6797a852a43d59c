"""Typed exceptions of the pagekeeper client.

Every failed RPC surfaces as a subclass of :class:`PagekeeperError` chosen by its gRPC status
code, carrying the server's human reason (``str(exc)`` and ``exc.reason``), the status code
and the RPC's name. Misuse detected by the client itself before any call (an unknown request
id, arguments the server would refuse) raises the same classes with ``code`` set to the
status the server would have answered, so callers handle both alike.

A call that fails changed nothing on the server (DESIGN section 5), except where noted:
:class:`UnavailableError` and :class:`DeadlineExceededError` leave it unknown whether the
server applied the call, which is why ``Step`` carries a step id and is retried with the same
one (the server answers a retry from memory).
"""

from __future__ import annotations

from typing import Any

import grpc

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "CancelledError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "NotRegisteredError",
    "PagekeeperError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
    "error_from_rpc",
    "error_from_status",
    "status_code",
]


class PagekeeperError(Exception):
    """Base class: a call failed. ``reason`` is the server's (or client's) explanation."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, reason: str, *, method: str = "", code: grpc.StatusCode | None = None):
        super().__init__(reason)
        self.reason = reason
        self.method = method
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.reason} [{self.code.name}]"


class InvalidArgumentError(PagekeeperError, ValueError):
    """The request was malformed or out of range; nothing changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(PagekeeperError, LookupError):
    """An unknown client id or request id."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(PagekeeperError):
    """A request id that already holds pages was admitted again."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(PagekeeperError, PermissionError):
    """The request belongs to another client (or the role may not make this call)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPreconditionError(PagekeeperError):
    """The call is valid but not now: a stale generation, an expired lease, an old step id,
    no kernel block size fits, the prefix cache cannot be reset while pages are held."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(PagekeeperError):
    """An enforced limit (requests or tokens per step, clients, message size)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnauthenticatedError(PagekeeperError, PermissionError):
    """Missing or wrong bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class UnavailableError(PagekeeperError, ConnectionError):
    """The server could not be reached (retries, where safe, are exhausted)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(PagekeeperError, TimeoutError):
    """The call's deadline passed; whether the server applied it is unknown."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(PagekeeperError):
    """The call was cancelled (e.g. the client closed)."""

    code = grpc.StatusCode.CANCELLED


class AbortedError(PagekeeperError):
    """A call under a registration another one has superseded (a newer registration took
    the client id over: the generation fence). Nothing changed; this client is fenced off
    and must not register the id again on its own."""

    code = grpc.StatusCode.ABORTED


class UnimplementedError(PagekeeperError, NotImplementedError):
    """The server does not implement this call (an older server?)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(PagekeeperError):
    """A bug on the server (its log has the traceback)."""

    code = grpc.StatusCode.INTERNAL


class UnknownError(PagekeeperError):
    code = grpc.StatusCode.UNKNOWN


class NotRegisteredError(PagekeeperError):
    """A call that needs a registration was made before ``register()`` (or after
    ``close()``). Raised by the client; nothing was sent."""

    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE: dict[grpc.StatusCode, type[PagekeeperError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnauthenticatedError,
        UnavailableError,
        DeadlineExceededError,
        CancelledError,
        AbortedError,
        UnimplementedError,
        InternalError,
        UnknownError,
    )
}
# Codes without a class of their own map onto the nearest one.
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidArgumentError
_BY_CODE[grpc.StatusCode.DATA_LOSS] = InternalError


def error_from_rpc(exc: Any, method: str = "") -> PagekeeperError:
    """The typed exception for a ``grpc.RpcError`` (sync or aio); the server's reason is
    its ``details()``."""
    code_fn = getattr(exc, "code", None)
    code = code_fn() if callable(code_fn) else None
    details_fn = getattr(exc, "details", None)
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return error_from_status(code, details, method)


_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The status code with this wire number (UNKNOWN for a number gRPC does not define)."""
    return _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_from_status(
    code: grpc.StatusCode, reason: str | None, method: str = ""
) -> PagekeeperError:
    """The typed exception for a status code and the server's reason (any transport)."""
    cls = _BY_CODE.get(code, UnknownError)
    return cls(str(reason or code.name.lower().replace("_", " ")), method=method, code=code)
