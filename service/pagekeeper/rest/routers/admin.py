"""Admin actions (need the admin token)."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from pagekeeper.rest.deps import AdminDep, RuntimeDep
from pagekeeper.rest.schemas import ResetAnswer, problem_responses
from pagekeeper.state import ResetPrefixCacheCommand

log = logging.getLogger(__name__)

router = APIRouter(
    tags=["admin"],
    dependencies=[AdminDep],
    responses=problem_responses(401, 403),
)


@router.post(
    "/v1/admin/reset-prefix-cache",
    response_model=ResetAnswer,
    summary="Drop the prefix cache (409 while requests hold pages).",
    responses=problem_responses(409),
)
async def reset_prefix_cache(runtime: RuntimeDep) -> ResetAnswer:
    dropped = runtime.state.reset_prefix_cache(ResetPrefixCacheCommand(runtime.now()))
    log.info("prefix cache reset over HTTP (%d cached pages dropped)", dropped)
    return ResetAnswer(num_dropped_pages=dropped)
