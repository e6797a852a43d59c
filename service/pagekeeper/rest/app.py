"""The FastAPI app factory: routers, the problem-body error handlers, latency metrics.

No module-level state: everything hangs off ``app.state.runtime``, handed in by the caller,
so tests build as many independent apps as they like (and override dependencies).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagekeeper import __version__
from pagekeeper.core.errors import ErrorCode, PagekeeperError
from pagekeeper.errors_map import PROBLEM_CONTENT_TYPE, http_problem, problem
from pagekeeper.rest.deps import ReaderDep
from pagekeeper.rest.routers import admin, clients, events, health, lookup, metrics, pages, pool
from pagekeeper.rest.routers import requests as requests_router
from pagekeeper.rest.routers.dashboard import install as install_dashboard
from pagekeeper.rest.schemas import Problem
from pagekeeper.runtime import Runtime

log = logging.getLogger(__name__)

DESCRIPTION = """\
Introspection and administration of one pagekeeper pool (the hot path is gRPC).

Errors are RFC 9457 problem bodies (`application/problem+json`). Admin endpoints need
`Authorization: Bearer <admin token>`.
"""


_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


def _validation_message(err: Mapping[str, Any], content_type: str) -> str:
    """One validation error as a line a person can act on: pydantic's own wording for a
    field, plain words for a body that is missing, not JSON or not a JSON object."""
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    where = ".".join(str(p) for p in loc)
    if kind == "json_invalid" and loc[:1] == ("body",):
        at = f" at character {loc[1]}" if len(loc) == 2 else ""
        reason = (err.get("ctx") or {}).get("error", "")
        return f"body: not valid JSON{at}" + (f" ({reason})" if reason else "")
    if loc == ("body",) and kind in ("missing", "model_attributes_type"):
        if not content_type.split(";")[0].strip().lower().endswith("json"):
            got = content_type or "none"
            return f"body: send a JSON object with content-type: application/json (got {got})"
        if kind == "missing":
            return "body: a JSON object is required"
        return "body: must be a JSON object"
    if kind == "int_parsing_size":
        # pydantic speaks of a string here even when the JSON held a number.
        return f"{where}: number too large for an integer"
    return f"{where}: {err.get('msg', '')}"


def _problem_response(
    status: int, body: dict[str, object], headers: Mapping[str, str] | None = None
) -> JSONResponse:
    if status == 401:
        # RFC 9110: a 401 names the scheme it wants.
        headers = {**(headers or {}), "WWW-Authenticate": 'Bearer realm="pagekeeper"'}
    return JSONResponse(body, status_code=status, media_type=PROBLEM_CONTENT_TYPE, headers=headers)


DOCS_STATIC_URL = "/docs/static"
"""Where the API docs pages' own scripts and styles are served (fastapi-offline's copies)."""


def create_app(runtime: Runtime) -> FastAPI:
    """Build the REST app over one runtime (state, settings, metrics)."""
    # /docs (Swagger UI) and /redoc with their scripts and styles served from here
    # (DOCS_STATIC_URL), not a public CDN: they work on a host without internet access.
    app = FastAPIOffline(
        static_url=DOCS_STATIC_URL,
        title="pagekeeper",
        version=__version__,
        description=DESCRIPTION,
        # Documented once for every route: a validation failure is a problem body too.
        responses={
            422: {
                "model": Problem,
                "description": "Malformed parameters or body.",
                "content": {
                    PROBLEM_CONTENT_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}
                },
            }
        },
    )
    app.state.runtime = runtime

    @app.exception_handler(PagekeeperError)
    async def on_domain_error(request: Request, exc: PagekeeperError) -> JSONResponse:
        status, body = http_problem(exc)
        return _problem_response(status, body)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        details = "; ".join(_validation_message(err, content_type) for err in exc.errors())
        body = problem(ErrorCode.INVALID_ARGUMENT, details or "invalid request")
        body["status"] = 422
        return _problem_response(422, body)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            body = problem(ErrorCode.NOT_FOUND, str(exc.detail))
        else:
            # Routing's own answers (405 Method Not Allowed, ...): no type of ours fits, so
            # RFC 9457's "about:blank" with the status phrase; its headers (Allow) kept.
            body = {
                "type": "about:blank",
                "title": HTTPStatus(exc.status_code).phrase,
                "status": exc.status_code,
                "detail": str(exc.detail),
            }
        return _problem_response(exc.status_code, body, exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _problem_response(500, problem(ErrorCode.INTERNAL, "internal error"))

    http_seconds = runtime.metrics.http_seconds

    @app.middleware("http")
    async def observe_latency(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        # Label by route template, never the raw path (ids would explode the label set).
        template = getattr(route, "path", "unmatched")
        # Any token is a method to HTTP: only the known ones get a label of their own.
        method = request.method if request.method in _KNOWN_METHODS else "other"
        http_seconds.labels(method, template, str(response.status_code)).observe(
            time.perf_counter() - started
        )
        return response

    for module in (health, admin, metrics):
        app.include_router(module.router)
    # The reads: open unless http_read_auth (then a token, the service's or the admin's).
    for module in (pool, pages, requests_router, clients, events, lookup):
        app.include_router(module.router, dependencies=[ReaderDep])
    install_dashboard(app)  # GET /, /dashboard/static/..., /v1/dashboard/...
    return app
