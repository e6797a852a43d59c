"""Dependencies shared by the routers: the runtime and the admin credential check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pagekeeper.core.errors import PermissionDenied, Unauthenticated
from pagekeeper.runtime import Runtime
from pagekeeper.state import ServiceState


async def get_runtime(request: Request) -> Runtime:
    """The runtime the app was built with (``app.state.runtime``; overridable in tests)."""
    runtime: Runtime = request.app.state.runtime
    return runtime


async def get_state(runtime: Annotated[Runtime, Depends(get_runtime)]) -> ServiceState:
    return runtime.state


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
StateDep = Annotated[ServiceState, Depends(get_state)]

_bearer = HTTPBearer(
    auto_error=False,
    description=(
        "Admin endpoints: the admin token (PAGEKEEPER_ADMIN_TOKEN or one in "
        "PAGEKEEPER_ADMIN_TOKEN_FILE, else the service token). Reads: none, unless the "
        "service runs with http_read_auth (then the service token or the admin token)."
    ),
)


async def require_admin(
    runtime: RuntimeDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Mutations need ``Authorization: Bearer <admin token>``. Without any token configured
    they are refused outright: force-freeing pages must be a deliberate act."""
    expected = runtime.tokens.admin
    if expected is None:
        raise PermissionDenied(
            "admin endpoints are disabled: start the service with PAGEKEEPER_ADMIN_TOKEN "
            "or PAGEKEEPER_ADMIN_TOKEN_FILE (else PAGEKEEPER_TOKEN or PAGEKEEPER_TOKEN_FILE) set"
        )
    if credentials is None:
        raise Unauthenticated("missing 'Authorization: Bearer <token>' header")
    if not expected.accepts(credentials.credentials.encode()):
        raise Unauthenticated("invalid bearer token")


async def require_reader(
    runtime: RuntimeDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """With ``http_read_auth``: reads need ``Authorization: Bearer <token>``, the service
    token or the admin token. Without it, nothing to check."""
    if not runtime.settings.http_read_auth:
        return
    if credentials is None:
        raise Unauthenticated("missing 'Authorization: Bearer <token>' header (http_read_auth)")
    given = credentials.credentials.encode()
    tokens = runtime.tokens
    if not any(h is not None and h.accepts(given) for h in (tokens.calls, tokens.admin)):
        raise Unauthenticated("invalid bearer token")


AdminDep = Depends(require_admin)
ReaderDep = Depends(require_reader)
