"""Pages: one by id, or a filtered, paginated listing."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from pagekeeper.core.errors import InvalidArgument
from pagekeeper.rest.deps import StateDep
from pagekeeper.rest.schemas import PageList, PageModel, problem_responses
from pagekeeper.state import PageState, PageView

router = APIRouter(tags=["pages"])

MAX_LIMIT = 1000


def _page_model(view: PageView) -> PageModel:
    return PageModel(
        page_id=view.page_id,
        state=view.state,
        ref_count=view.ref_count,
        is_cached=view.is_cached,
        group_id=view.group_id,
        page_hash=view.page_hash.hex() if view.page_hash is not None else None,
    )


def parse_cursor(cursor: str | None) -> int:
    """Cursors are opaque to clients; here they are a decimal position."""
    if cursor is None:
        return 0
    # ASCII digits only: str.isdigit() also takes "²" (which int() refuses) and "٣".
    if not (cursor.isascii() and cursor.isdecimal()) or len(cursor) > 12:
        raise InvalidArgument(f"invalid cursor {cursor!r}")
    return int(cursor)


@router.get(
    "/v1/pages",
    response_model=PageList,
    summary="Pages, optionally by state.",
    responses=problem_responses(400),
)
async def list_pages(
    state: StateDep,
    page_state: Annotated[
        PageState | None,
        Query(alias="state", description="free, cached (free, hittable), used or null."),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Most pages returned.")] = 100,
    cursor: Annotated[
        str | None, Query(description="From a previous answer's next_cursor.")
    ] = None,
) -> PageList:
    ids, next_start = state.page_ids_in_state(page_state, parse_cursor(cursor), limit)
    return PageList(
        items=[_page_model(state.page(page_id)) for page_id in ids],
        next_cursor=None if next_start is None else str(next_start),
    )


@router.get(
    "/v1/pages/{page_id}",
    response_model=PageModel,
    summary="One page.",
    responses=problem_responses(404),
)
async def get_page(
    state: StateDep,
    page_id: Annotated[int, Path(ge=0, lt=2**31, description="Page id.")],
) -> PageModel:
    return _page_model(state.page(page_id))
