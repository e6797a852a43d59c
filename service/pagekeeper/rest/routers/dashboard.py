"""The live dashboard: ``GET /`` serves the page, ``/dashboard/static/...`` its files (shipped
in the package, no CDN: it works offline), and the JSON it reads:

* ``GET /v1/dashboard/page-map?bins=N`` — per KV-cache group, per bin, how many pages are
  free, cached, used, shared or null (or another group's): what the page map draws.
* ``GET /v1/dashboard/requests?limit=K`` — the requests holding the most pages.
* ``GET /v1/dashboard/samples?since=SEQ`` — the sampled time series kept so far.
* ``GET /v1/dashboard/stream`` — the same series as server-sent events (not in the OpenAPI
  document: it never ends). First an ``event: history`` with every kept sample (``replace``:
  true) or, on a reconnect that sends ``Last-Event-ID``, only the missed ones; then one
  ``event: sample`` per sample (about one a second), each with ``id: <seq>``; a
  ``: keep-alive`` comment when idle. It ends when the service shuts down.

Every endpoint here is ``async``: it runs on the event loop that applies steps, so what it
reads is never half a step. The sampler starts with the app when the app is built inside
the running service (:func:`install`), else on the first dashboard request.
"""

from __future__ import annotations

import asyncio
import heapq
import mimetypes
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import Field

from pagekeeper.core.config import GroupKind
from pagekeeper.core.errors import NotFound
from pagekeeper.dashboard import (
    MAX_BINS,
    PAGE_STATES,
    SSE_KEEPALIVE,
    DashboardSampler,
    build_page_map,
    format_sse,
)
from pagekeeper.rest.deps import ReaderDep, RuntimeDep
from pagekeeper.rest.schemas import Model
from pagekeeper.runtime import Runtime

router = APIRouter(tags=["dashboard"])

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
SSE_RETRY_MS = 2000
KEEPALIVE_S = 15.0
MAX_REQUESTS = 200

# -- models --------------------------------------------------------------------------------

StateCounts = Annotated[
    dict[str, int],
    Field(description="Pages per state: free, cached, used, shared, null (and other in a lane)."),
]


class PageMapLane(Model):
    group_id: int = Field(description="The KV-cache group this lane shows.")
    kind: str = Field(description="The group's kind (full, sliding_window, ...).")
    page_size: int = Field(description="Tokens per page of this group.")
    name: str = Field(description="The group's label.")
    totals: StateCounts
    bins: dict[str, list[int]] = Field(
        description="Per state with a non-zero total: its page count in every bin (bin order). "
        "A state missing here is 0 in every bin. 'other': pages another group holds or caches."
    )


class PageMapModel(Model):
    num_pages: int = Field(description="Pages in the pool, null page 0 included.")
    num_bins: int = Field(
        description="Bins in every lane: min(bins asked, num_pages). Page p is in bin "
        "p * num_bins // num_pages (bins differ by at most one page)."
    )
    states: list[str] = Field(description="Every state name, in legend order.")
    pool_totals: StateCounts
    groups: list[PageMapLane] = Field(description="One lane per KV-cache group.")
    version: int = Field(
        description="Mutation counter of the pool when this map was taken. Under load a map "
        "may be reused for a moment (building one is kept under 10% of the service's time)."
    )


class LargestRequest(Model):
    request_id: str = Field(description="Request id.")
    owner: str = Field(description="Client id of the scheduler that admitted it.")
    num_tokens: int = Field(description="Tokens known (prompt + output so far).")
    num_computed_tokens: int = Field(description="Tokens whose KV is computed.")
    num_cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")
    num_pages: list[int] = Field(description="Per group: pages held (null slots excluded).")
    num_pages_total: int = Field(description="Pages held over every group.")


class LargestRequests(Model):
    items: list[LargestRequest] = Field(description="Most pages first (ties: admission order).")
    num_requests: int = Field(description="Running requests in all.")


class SampleModel(Model):
    seq: int = Field(description="Sample number, from 1 (the stream's event id).")
    t: float = Field(description="Wall-clock time, Unix seconds.")
    usage: float = Field(description="Fraction of the pool held by requests.")
    num_used_pages: int = Field(description="Pages held by requests.")
    num_free_pages: int = Field(description="Pages in the free queue.")
    num_free_cached_pages: int = Field(description="Free pages still in the prefix cache.")
    num_requests: int = Field(description="Running requests.")
    num_clients: int = Field(description="Registered clients.")
    hit_rate: float | None = Field(
        description="Prefix hit rate in tokens over the interval; null: no lookups."
    )
    hit_rate_total: float = Field(description="Prefix hit rate in tokens since start.")
    evictions_per_s: float = Field(description="Cached pages evicted per second.")
    steps_per_s: float = Field(description="Steps applied per second.")
    step_p50_ms: float | None = Field(
        description="Median step apply time over the interval, ms; null: no step."
    )
    step_p99_ms: float | None = Field(description="p99 step apply time over the interval, ms.")


class SampleList(Model):
    interval_s: float = Field(description="Seconds between samples.")
    last_seq: int = Field(description="Newest sample number (0: none yet).")
    samples: list[SampleModel] = Field(description="Kept samples after `since`, oldest first.")


# -- the sampler's life cycle ---------------------------------------------------------------


def ensure_sampler(app: FastAPI) -> DashboardSampler:
    """The app's sampler, created on first use and started if a loop is running."""
    sampler: DashboardSampler | None = getattr(app.state, "dashboard_sampler", None)
    if sampler is None:
        runtime: Runtime = app.state.runtime
        sampler = DashboardSampler(
            runtime.state, wall_clock=runtime.clock, is_stopping=lambda: runtime.is_stopping
        )
        app.state.dashboard_sampler = sampler
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return sampler  # no loop yet: the first dashboard request starts it
    if not sampler.is_running and not app.state.runtime.is_stopping:
        sampler.start()
    return sampler


def install(app: FastAPI) -> None:
    """Add the dashboard to an app (``create_app`` calls this). Built inside the running
    service, the sampler starts now, so history accumulates before anyone looks."""
    app.include_router(router)
    ensure_sampler(app)


def get_sampler(request: Request) -> DashboardSampler:
    return ensure_sampler(request.app)


SamplerDep = Annotated[DashboardSampler, Depends(get_sampler)]


# -- the page and its files -----------------------------------------------------------------


def _static_file(relative: str) -> Path:
    """A file under the static directory; NotFound for anything else (``..`` included)."""
    path = (STATIC_DIR / relative).resolve()
    if not path.is_relative_to(STATIC_DIR) or not path.is_file():
        raise NotFound(f"no dashboard file {relative!r}")
    return path


def _file_response(path: Path) -> FileResponse:
    media_type, _ = mimetypes.guess_type(path.name)
    if path.suffix == ".js":
        media_type = "text/javascript"
    # no-cache = revalidate every time (ETag/Last-Modified make that a 304): an upgraded
    # service never runs against a stale script.
    return FileResponse(
        path,
        media_type=media_type or "application/octet-stream",
        headers={"Cache-Control": "no-cache"},
    )


@router.get("/", include_in_schema=False)
async def index(sampler: SamplerDep) -> FileResponse:
    del sampler  # started here so a first visit already collects samples
    return _file_response(_static_file("index.html"))


@router.get("/dashboard/static/{relative:path}", include_in_schema=False)
async def static_file(relative: str) -> FileResponse:
    return _file_response(_static_file(relative))


# -- JSON ------------------------------------------------------------------------------------


@router.get(
    "/v1/dashboard/page-map",
    dependencies=[ReaderDep],
    response_model=PageMapModel,
    summary="Per group and per bin, pages in each state (the dashboard's page map).",
)
async def page_map(
    runtime: RuntimeDep,
    sampler: SamplerDep,
    bins: Annotated[
        int, Query(ge=1, le=MAX_BINS, description="Bins per lane (cells the client draws).")
    ] = 4096,
) -> PageMapModel:
    state = runtime.state
    groups = state.pool_config.groups
    result, version = sampler.page_maps.get(
        runtime.events.version,
        bins,
        lambda: build_page_map(state.manager.page_states(), len(groups), bins),
    )
    return PageMapModel(
        num_pages=result.num_pages,
        num_bins=result.num_bins,
        states=list(PAGE_STATES),
        pool_totals=result.pool_totals,
        groups=[
            PageMapLane(
                group_id=lane.group_id,
                kind=groups[lane.group_id].kind.value,
                page_size=groups[lane.group_id].page_size,
                name=groups[lane.group_id].name,
                totals=lane.totals,
                bins=lane.bins,
            )
            for lane in result.lanes
        ],
        version=version,
    )


@router.get(
    "/v1/dashboard/requests",
    dependencies=[ReaderDep],
    response_model=LargestRequests,
    summary="The running requests that hold the most pages.",
)
async def largest_requests(
    runtime: RuntimeDep,
    limit: Annotated[int, Query(ge=1, le=MAX_REQUESTS, description="Most requests.")] = 20,
) -> LargestRequests:
    state = runtime.state
    groups = state.manager.groups
    request_ids = state.request_ids()

    def held(request_id: str) -> list[int]:
        # Full-attention rows never hold the null page; other kinds may (slots that fell out
        # of the window / chunk), and those hold no memory.
        return [
            g.num_pages(request_id)
            if g.config.kind is GroupKind.FULL
            else sum(1 for p in g.pages(request_id) if p != 0)
            for g in groups
        ]

    ranked = []
    for i, rid in enumerate(request_ids):
        pages = held(rid)
        ranked.append((sum(pages), -i, rid, pages))  # ties: the earlier admission first
    top = heapq.nlargest(limit, ranked)
    items = []
    for total, _, rid, pages in top:
        info = state.request_info(rid)
        items.append(
            LargestRequest(
                request_id=rid,
                owner=info.owner,
                num_tokens=info.num_tokens,
                num_computed_tokens=info.num_computed_tokens,
                num_cached_tokens=info.num_cached_tokens,
                num_pages=pages,
                num_pages_total=total,
            )
        )
    return LargestRequests(items=items, num_requests=len(request_ids))


@router.get(
    "/v1/dashboard/samples",
    response_model=SampleList,
    summary="The dashboard's time series kept so far (about one sample a second).",
)
async def samples(
    sampler: SamplerDep,
    since: Annotated[int, Query(ge=0, lt=2**63, description="Only samples with seq > since.")] = 0,
) -> SampleList:
    return SampleList(
        interval_s=sampler.interval_s,
        last_seq=sampler.last_seq,
        samples=[SampleModel(**s.to_dict()) for s in sampler.since(since)],
    )


def _resume_point(sampler: DashboardSampler, last_event_id: str | None) -> tuple[int, bool]:
    """(send samples after this seq, whether the client must replace what it has)."""
    if last_event_id is None or not last_event_id.strip().isdigit():
        return 0, True
    seq = int(last_event_id.strip())
    oldest = sampler.samples[0].seq if sampler.samples else sampler.last_seq + 1
    if seq > sampler.last_seq or seq < oldest - 1:
        # Ahead of us (the service restarted) or behind what we kept: start over.
        return 0, True
    return seq, False


@router.get("/v1/dashboard/stream", include_in_schema=False)
async def stream(
    request: Request,
    runtime: RuntimeDep,
    sampler: SamplerDep,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    after, replace = _resume_point(sampler, last_event_id)

    async def events() -> AsyncIterator[bytes]:
        backlog = sampler.since(after)
        sent = backlog[-1].seq if backlog else after
        yield format_sse(
            {
                "interval_s": sampler.interval_s,
                "replace": replace,
                "samples": [s.to_dict() for s in backlog],
            },
            event="history",
            event_id=sent if backlog else None,
            retry_ms=SSE_RETRY_MS,
        )
        idle = 0.0
        while not runtime.is_stopping:
            version = sampler.notifier.version
            fresh = sampler.since(sent)
            for row in fresh:
                yield format_sse(row.to_dict(), event="sample", event_id=row.seq)
                sent = row.seq
            if fresh:
                idle = 0.0
            # Short waits: shutdown and disconnects are noticed within a second even when
            # no sample comes.
            if not await sampler.notifier.wait(version, timeout=1.0):
                idle += 1.0
                if idle >= KEEPALIVE_S:
                    idle = 0.0
                    yield SSE_KEEPALIVE
            if await request.is_disconnected():
                return

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
