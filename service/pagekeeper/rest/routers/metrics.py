"""Prometheus exposition."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from pagekeeper.metrics import CONTENT_TYPE
from pagekeeper.rest.deps import RuntimeDep

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus text format.",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Metrics."}},
)
async def metrics(runtime: RuntimeDep) -> Response:
    return Response(runtime.metrics.render(), media_type=CONTENT_TYPE)
