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
        "The admin token (PAGEKEEPER_ADMIN_TOKEN or one in PAGEKEEPER_ADMIN_TOKEN_FILE, "
        "else the service token)."
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


AdminDep = Depends(require_admin)
