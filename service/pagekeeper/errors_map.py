"""The one table from core error codes to gRPC status codes and HTTP problem bodies.

Both adapters (``pagekeeper.rpc`` and ``pagekeeper.rest``) map errors through
:func:`grpc_status` and :func:`problem`, so a client sees the same error whichever door it
used. HTTP bodies follow RFC 9457 (``application/problem+json``)::

    {"type": "https://pagekeeper.dev/problems/not_found", "title": "Not found",
     "status": 404, "detail": "request 'r1' holds no pages"}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from pagekeeper.core.errors import ErrorCode, PagekeeperError

PROBLEM_TYPE_BASE = "https://pagekeeper.dev/problems/"
PROBLEM_CONTENT_TYPE = "application/problem+json"


@dataclass(frozen=True, slots=True)
class ErrorMapping:
    grpc_code: grpc.StatusCode
    http_status: int
    title: str


ERROR_TABLE: dict[ErrorCode, ErrorMapping] = {
    ErrorCode.INVALID_ARGUMENT: ErrorMapping(
        grpc.StatusCode.INVALID_ARGUMENT, 400, "Invalid argument"
    ),
    ErrorCode.NOT_FOUND: ErrorMapping(grpc.StatusCode.NOT_FOUND, 404, "Not found"),
    ErrorCode.ALREADY_EXISTS: ErrorMapping(grpc.StatusCode.ALREADY_EXISTS, 409, "Already exists"),
    # A configured limit: 429 says "too much", which is what the client must back off from.
    ErrorCode.RESOURCE_EXHAUSTED: ErrorMapping(
        grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "Limit exceeded"
    ),
    # The request is fine but the state refuses it now (stale generation, held pages).
    ErrorCode.FAILED_PRECONDITION: ErrorMapping(
        grpc.StatusCode.FAILED_PRECONDITION, 409, "Failed precondition"
    ),
    # A sequencer check: the call's registration generation is not the current one (a
    # newer registration took the client id over). Not FAILED_PRECONDITION, whose lease
    # case a client answers by registering again: a fenced client must not.
    ErrorCode.ABORTED: ErrorMapping(grpc.StatusCode.ABORTED, 409, "Superseded"),
    # A retry the fenced service cannot vouch for (its answer may not be durable).
    ErrorCode.UNAVAILABLE: ErrorMapping(grpc.StatusCode.UNAVAILABLE, 503, "Unavailable"),
    ErrorCode.PERMISSION_DENIED: ErrorMapping(
        grpc.StatusCode.PERMISSION_DENIED, 403, "Permission denied"
    ),
    ErrorCode.UNAUTHENTICATED: ErrorMapping(
        grpc.StatusCode.UNAUTHENTICATED, 401, "Unauthenticated"
    ),
    ErrorCode.INTERNAL: ErrorMapping(grpc.StatusCode.INTERNAL, 500, "Internal error"),
}


def mapping_for(error: PagekeeperError) -> ErrorMapping:
    return ERROR_TABLE.get(error.code, ERROR_TABLE[ErrorCode.INTERNAL])


def grpc_status(error: PagekeeperError) -> tuple[grpc.StatusCode, str]:
    """(status code, human reason) for a gRPC abort."""
    return mapping_for(error).grpc_code, error.message


def problem(code: ErrorCode, detail: str) -> dict[str, Any]:
    """An RFC 9457 problem body for ``code``."""
    mapping = ERROR_TABLE.get(code, ERROR_TABLE[ErrorCode.INTERNAL])
    return {
        "type": PROBLEM_TYPE_BASE + code.value,
        "title": mapping.title,
        "status": mapping.http_status,
        "detail": detail,
    }


def http_problem(error: PagekeeperError) -> tuple[int, dict[str, Any]]:
    """(HTTP status, problem body) for an error."""
    body = problem(error.code, error.message)
    return body["status"], body
