"""Domain errors of the core.

Every error the core raises is a :class:`PagekeeperError` with a stable ``code``; the
transports map codes to gRPC status codes and HTTP problem bodies in one table
(``pagekeeper.errors_map``). A raised error always means *nothing changed*.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    ABORTED = "aborted"
    UNAVAILABLE = "unavailable"
    PERMISSION_DENIED = "permission_denied"
    UNAUTHENTICATED = "unauthenticated"
    INTERNAL = "internal"


class PagekeeperError(Exception):
    """Base of every error pagekeeper raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(PagekeeperError):
    code = ErrorCode.INVALID_ARGUMENT


class ConfigError(InvalidArgument):
    """A configuration value is invalid; ``field`` names it (dotted path)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotFound(PagekeeperError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(PagekeeperError):
    code = ErrorCode.ALREADY_EXISTS


class ResourceExhausted(PagekeeperError):
    """A configured limit (requests, clients, message size) would be exceeded.

    Running out of *pages* is not an error: allocation returns ``None`` instead.
    """

    code = ErrorCode.RESOURCE_EXHAUSTED


class FailedPrecondition(PagekeeperError):
    code = ErrorCode.FAILED_PRECONDITION


class Superseded(PagekeeperError):
    """A call under a registration that is no longer the client id's current one (a newer
    registration took the id over): the caller is fenced off, and must not register
    again on its own (that would fence its successor in turn)."""

    code = ErrorCode.ABORTED


class Unavailable(PagekeeperError):
    """The service cannot answer now (it lost its durable log and is stopping); the call
    may be made again once it is back."""

    code = ErrorCode.UNAVAILABLE


class PermissionDenied(PagekeeperError):
    code = ErrorCode.PERMISSION_DENIED


class Unauthenticated(PagekeeperError):
    code = ErrorCode.UNAUTHENTICATED


class InvariantViolation(PagekeeperError):
    """``check_invariants()`` found a breach; the message lists every failing term."""

    code = ErrorCode.INTERNAL
