"""Running requests: list, detail (with a kernel table on demand), admin force-free."""

from __future__ import annotations

import base64
import bisect
from typing import Annotated

from fastapi import APIRouter, Path, Query
from starlette.convertors import PathConvertor, register_url_convertor

from pagekeeper.core.config import GroupKind
from pagekeeper.core.errors import InvalidArgument
from pagekeeper.core.tables import expand_to_kernel_blocks
from pagekeeper.rest.deps import AdminDep, RuntimeDep, StateDep
from pagekeeper.rest.schemas import (
    FreedRequest,
    RequestDetail,
    RequestList,
    RequestSummary,
    problem_responses,
)
from pagekeeper.state import ForceFreeCommand

router = APIRouter(tags=["requests"])

MAX_LIMIT = 1000


class _RequestIdConvertor(PathConvertor):
    """A request id in a path: anything, "/" and line breaks included (gRPC takes any
    string; ``:path``'s ``.*`` stops at a newline, which made such a request unreachable
    and impossible to force-free)."""

    regex = r"[\s\S]+"


register_url_convertor("request_id", _RequestIdConvertor())
RequestIdPath = Annotated[str, Path(min_length=1, max_length=256, description="Request id.")]


def _summary_fields(state: StateDep, request_id: str) -> dict[str, object]:
    info = state.request_info(request_id)
    return {
        "request_id": info.request_id,
        "owner": info.owner,
        "num_tokens": info.num_tokens,
        "num_computed_tokens": info.num_computed_tokens,
        "num_cached_tokens": info.num_cached_tokens,
        "num_pages": [len(pages) for pages in info.page_ids],
        "page_ids": [list(pages) for pages in info.page_ids],
    }


@router.get(
    "/v1/requests",
    response_model=RequestList,
    summary="Running requests.",
    responses=problem_responses(400),
)
async def list_requests(
    state: StateDep,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Most requests returned.")] = 100,
    cursor: Annotated[
        str | None, Query(description="From a previous answer's next_cursor.")
    ] = None,
) -> RequestList:
    # In request id order, the cursor naming the last id returned: a walk lists every
    # request that runs throughout it exactly once, whatever finishes or starts meanwhile.
    ids = sorted(state.request_ids())
    start = 0 if cursor is None else bisect.bisect_right(ids, _id_from_cursor(cursor))
    chunk = ids[start : start + limit]
    items = []
    for request_id in chunk:
        fields = _summary_fields(state, request_id)
        fields.pop("page_ids")
        items.append(RequestSummary(**fields))  # type: ignore[arg-type]
    more = start + len(chunk) < len(ids)
    return RequestList(items=items, next_cursor=_cursor_after(chunk[-1]) if more else None)


def _cursor_after(request_id: str) -> str:
    """Opaque to clients: "k" and the last id returned, base64url."""
    return "k" + base64.urlsafe_b64encode(request_id.encode()).decode().rstrip("=")


def _id_from_cursor(cursor: str) -> str:
    body = cursor[1:]
    try:
        if not cursor.startswith("k") or len(cursor) > 1024:
            raise ValueError
        padded = body + "=" * (-len(body) % 4)
        return base64.b64decode(padded, altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeDecodeError):  # binascii.Error is a ValueError
        raise InvalidArgument(f"invalid cursor {cursor!r}") from None


@router.get(
    # An id may hold "/" (sent as %2F, which the router would split on) or a line break.
    "/v1/requests/{request_id:request_id}",
    response_model=RequestDetail,
    summary="One request's pages per group; ?kernel_block_size=N adds its kernel tables.",
    responses=problem_responses(400, 404),
)
async def get_request(
    state: StateDep,
    request_id: RequestIdPath,
    kernel_block_size: Annotated[
        int | None,
        Query(
            ge=1,
            lt=2**20,
            description=(
                "Must divide the page size of every attention group; a Mamba group's state "
                "pages are never split (shown whole, as workers get them)."
            ),
        ),
    ] = None,
) -> RequestDetail:
    fields = _summary_fields(state, request_id)
    kernel_ids = None
    if kernel_block_size is not None:
        kernel_ids = []
        for group, pages in zip(state.pool_config.groups, fields["page_ids"], strict=True):  # type: ignore[call-overload]
            if group.kind is GroupKind.MAMBA:
                kernel_ids.append(list(pages))
                continue
            if group.page_size % kernel_block_size != 0:
                raise InvalidArgument(
                    f"kernel_block_size {kernel_block_size} does not divide page size "
                    f"{group.page_size}"
                )
            ratio = group.page_size // kernel_block_size
            kernel_ids.append(expand_to_kernel_blocks(pages, ratio).tolist() if pages else [])
    return RequestDetail(
        **fields,  # type: ignore[arg-type]
        kernel_block_size=kernel_block_size,
        kernel_block_ids=kernel_ids,
    )


@router.delete(
    "/v1/requests/{request_id:request_id}",
    response_model=FreedRequest,
    summary="Admin: free a request's pages, whoever owns it.",
    description=(
        "For a request whose owner is gone or stuck. Its owner learns it at its next step "
        "that names the request: a growth is answered NO_CAPACITY, the batch leaves it out, "
        "the answer's `revoked_request_ids` lists it, and the owner's free of it is accepted "
        "as done. A live engine may still write the request's KV into those pages until "
        "then, while the pool can hand them to another request."
    ),
    dependencies=[AdminDep],
    responses=problem_responses(401, 403, 404),
)
async def delete_request(runtime: RuntimeDep, request_id: RequestIdPath) -> FreedRequest:
    owner = runtime.state.request_info(request_id).owner
    runtime.state.force_free(ForceFreeCommand(runtime.now(), request_id))
    return FreedRequest(request_id=request_id, owner=owner)
