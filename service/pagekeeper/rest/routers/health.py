"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pagekeeper.core.errors import ErrorCode
from pagekeeper.errors_map import PROBLEM_CONTENT_TYPE, problem
from pagekeeper.rest.deps import RuntimeDep
from pagekeeper.rest.schemas import Status, problem_responses

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Status, summary="Liveness: the process answers.")
async def healthz() -> Status:
    return Status(status="ok")


@router.get(
    "/readyz",
    response_model=Status,
    summary="Readiness: the pool exists and both servers listen.",
    responses=problem_responses(503),
)
async def readyz(runtime: RuntimeDep) -> Status | JSONResponse:
    if not runtime.is_ready:
        body = problem(ErrorCode.FAILED_PRECONDITION, "not ready: starting or shutting down")
        body["status"] = 503
        body["title"] = "Service unavailable"
        return JSONResponse(body, status_code=503, media_type=PROBLEM_CONTENT_TYPE)
    return Status(status="ready")
