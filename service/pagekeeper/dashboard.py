"""What the dashboard shows, computed without any transport: the binned page map and the
sampled time series.

* :func:`bin_page_states` turns the core's per-page arrays into per-group, per-bin counts of
  each page state, vectorised (one ``bincount`` over the pool: ~10 ms at 1M pages),
  so a browser draws one cell per bin however large the pool is.
* :class:`DashboardSampler` reads the state's counters about once a second and keeps a bounded
  history of :class:`Sample` rows (rates and interval percentiles come from the difference
  between two consecutive reads), which the event stream replays to every new viewer.
* :func:`format_sse` writes one server-sent event.

A page's state in the map::

    page 0                               -> null    (pads tables, never handed out)
    ref_count > 1                        -> shared  (held by several requests: a prefix hit)
    ref_count == 1                       -> used
    ref_count == 0 and in the prefix index -> cached  (free, but a hit can still revive it)
    ref_count == 0 otherwise             -> free

Pages draw from one pool shared by every KV-cache group, and a page held or cached belongs to
exactly one group. Each group gets a *lane* over the whole page-id range: its own pages in
their state, pages no group owns (free, null) as such, and pages another group owns as
``other``. So every lane's bins sum to the pages they cover, and a single-group pool has no
``other`` at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pagekeeper.notify import ChangeNotifier
from pagekeeper.state import ServiceState

log = logging.getLogger(__name__)

PAGE_STATES = ("free", "cached", "used", "shared", "null", "other")
"""Column order of the state axis of :func:`bin_page_states`."""
FREE, CACHED, USED, SHARED, NULL, OTHER = range(len(PAGE_STATES))
_NUM_OWN_STATES = 5  # every state but OTHER, which only exists from a lane's point of view

MAX_BINS = 65536
"""Most bins one page map may ask for (a 4K screen of 6-pixel cells holds ~230K; the page
asks for ~14K per lane: a map drawn from more bins is not more readable)."""

DEFAULT_INTERVAL_S = 1.0
DEFAULT_HISTORY = 600
"""Samples kept: ten minutes at one per second."""


# -- the page map ---------------------------------------------------------------------------


def bin_edges(num_pages: int, num_bins: int) -> npt.NDArray[np.int64]:
    """First page id of every bin, plus ``num_pages`` at the end (``num_bins + 1`` values).

    Page ``p`` falls in bin ``p * num_bins // num_pages``, so bins differ in size by at most
    one page; bin ``b`` starts at ``ceil(b * num_pages / num_bins)``. The page's JavaScript
    computes the same edges for its tooltips.
    """
    b = np.arange(num_bins + 1, dtype=np.int64)
    return -((-b * num_pages) // num_bins)


def bin_page_states(
    ref_count: npt.NDArray[np.integer[Any]],
    is_cached: npt.NDArray[np.bool_],
    group: npt.NDArray[np.integer[Any]],
    num_groups: int,
    num_bins: int,
) -> npt.NDArray[np.int64]:
    """Count the pages of every state in every bin, per group lane.

    ``ref_count``, ``is_cached`` and ``group`` (-1: no group) are the per-page arrays of
    :meth:`PageManager.page_states`. Returns an ``int64`` array of shape
    ``(num_groups, min(num_bins, num_pages), len(PAGE_STATES))``: for lane ``g`` and bin
    ``b``, how many of the bin's pages are free, cached, used, shared, null, or owned by
    another group (see the module docstring). With ``num_bins >= num_pages`` every bin is one
    page, exactly.
    """
    return _lanes(_count_by_owner(ref_count, is_cached, group, num_groups, num_bins))


def _count_by_owner(
    ref_count: npt.NDArray[np.integer[Any]],
    is_cached: npt.NDArray[np.bool_],
    group: npt.NDArray[np.integer[Any]],
    num_groups: int,
    num_bins: int,
) -> npt.NDArray[np.int64]:
    """Counts of shape ``(bins, 1 + num_groups, 5)``: per bin, per owner (0: no group,
    1 + g: group g) and per own state (every state but ``other``)."""
    num_pages = int(ref_count.shape[0])
    if num_pages < 1:
        raise ValueError("the pool has no pages")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if is_cached.shape[0] != num_pages or group.shape[0] != num_pages:
        raise ValueError("ref_count, is_cached and group must have one entry per page")
    num_bins = min(num_bins, num_pages)

    # One category per page (owner * 5 + state), offset by its bin, then one bincount: a
    # handful of in-place int32 passes over the pool, never a Python loop over pages.
    # State codes by arithmetic (nested np.where is 5x slower at 1M pages): with
    # r = min(ref, 2): FREE=0 or CACHED=1 when r == 0, USED=2 when r == 1, SHARED=3 when 2.
    num_categories = (num_groups + 1) * _NUM_OWN_STATES
    key = np.minimum(ref_count, 2).astype(np.int32)
    key += key > 0
    key += is_cached & (key == 0)
    key[0] = NULL
    owner = group.astype(np.int32)
    owner += 1  # 0: no group (free pages, the null page)
    np.clip(owner, 0, num_groups, out=owner)
    owner *= _NUM_OWN_STATES
    key += owner
    # Bins are contiguous page ranges: repeat each bin's offset over its pages (no per-page
    # int64 division).
    offsets = np.arange(num_bins, dtype=np.int32) * num_categories
    key += (
        offsets
        if num_bins == num_pages
        else np.repeat(offsets, np.diff(bin_edges(num_pages, num_bins)))
    )
    counts = np.bincount(key, minlength=num_bins * num_categories)
    return counts.reshape(num_bins, num_groups + 1, _NUM_OWN_STATES).astype(np.int64, copy=False)


def _lanes(counts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Per-owner counts -> one lane per group: its own pages, the unowned ones, and every
    other group's pages as ``other``."""
    num_bins, num_owners, _ = counts.shape
    unowned = counts[:, 0, :]  # (bins, states)
    owned = counts[:, 1:, :].transpose(1, 0, 2)  # (groups, bins, states)
    owned_per_bin = owned.sum(axis=2)  # (groups, bins)
    lanes = np.empty((num_owners - 1, num_bins, len(PAGE_STATES)), dtype=np.int64)
    lanes[:, :, :_NUM_OWN_STATES] = owned + unowned[np.newaxis]
    lanes[:, :, OTHER] = owned_per_bin.sum(axis=0)[np.newaxis] - owned_per_bin
    return lanes


@dataclass(frozen=True, slots=True)
class GroupLane:
    group_id: int
    totals: dict[str, int]
    """Pages of each state in this lane (every state, zeros included)."""
    bins: dict[str, list[int]]
    """Per state with a non-zero total: its count in every bin. A state absent here is zero
    in every bin (keeps the answer small: most pools have no ``other``, few ``shared``)."""


@dataclass(frozen=True, slots=True)
class PageMap:
    num_pages: int
    num_bins: int
    lanes: tuple[GroupLane, ...]
    pool_totals: dict[str, int]
    """The whole pool, each page once: free, cached, used, shared, null."""


def build_page_map(
    page_states: Mapping[str, npt.NDArray[Any]], num_groups: int, num_bins: int
) -> PageMap:
    """The page map of a pool from :meth:`PageManager.page_states` arrays."""
    counts = _count_by_owner(
        page_states["ref_count"],
        page_states["is_cached"],
        page_states["group"],
        num_groups,
        num_bins,
    )
    lanes = _lanes(counts)
    lane_totals = lanes.sum(axis=1)  # (groups, states)
    pool = counts.sum(axis=(0, 1))  # (own states,)
    group_lanes = []
    for g in range(num_groups):
        totals = {s: int(lane_totals[g, i]) for i, s in enumerate(PAGE_STATES)}
        bins = {s: lanes[g, :, i].tolist() for i, s in enumerate(PAGE_STATES) if totals[s]}
        group_lanes.append(GroupLane(group_id=g, totals=totals, bins=bins))
    return PageMap(
        num_pages=int(page_states["ref_count"].shape[0]),
        num_bins=int(counts.shape[0]),
        lanes=tuple(group_lanes),
        pool_totals={s: int(pool[i]) for i, s in enumerate(PAGE_STATES[:_NUM_OWN_STATES])},
    )


class PageMapCache:
    """The last page map, reused while the pool has not changed, and recomputed at most so
    often that building maps takes at most ``max_loop_share`` of the event loop.

    The map is built on the loop that applies steps (so it never sees half a step); reading a
    large pool's page states costs real time (hundreds of milliseconds at 1M pages with a big
    prefix cache), so under load a viewer gets a map up to ``cost / max_loop_share`` old
    instead of slowing every scheduler down.
    """

    def __init__(
        self, *, max_loop_share: float = 0.1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 < max_loop_share <= 1:
            raise ValueError(f"max_loop_share must be in (0, 1], got {max_loop_share}")
        self.max_loop_share = max_loop_share
        self._clock = clock
        self._entry: tuple[int, int, float, float, PageMap] | None = None
        """(bins, version, computed at, cost in seconds, map)."""

    def get(self, version: int, bins: int, build: Callable[[], PageMap]) -> tuple[PageMap, int]:
        """The map for ``bins`` and the mutation version it reflects."""
        now = self._clock()
        entry = self._entry
        if entry is not None and entry[0] == bins:
            _, built_version, built_at, cost, page_map = entry
            if built_version == version or now - built_at < cost / self.max_loop_share:
                return page_map, built_version
        started = self._clock()
        page_map = build()
        finished = self._clock()
        self._entry = (bins, version, finished, finished - started, page_map)
        return page_map, version


# -- the time series ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One row of the dashboard's time series (rates over the interval since the previous
    sample; ``None`` where the interval had nothing to measure)."""

    seq: int
    """1, 2, 3, ... per sampler (the event stream's ``id:``)."""
    t: float
    """Wall-clock time of the sample, Unix seconds."""
    usage: float
    """Fraction of the pool held by requests, 0..1."""
    num_used_pages: int
    num_free_pages: int
    num_free_cached_pages: int
    num_requests: int
    num_clients: int
    hit_rate: float | None
    """Prefix-cache hit rate in tokens over the interval (None: no admission looked up)."""
    hit_rate_total: float
    """Prefix-cache hit rate in tokens since start."""
    evictions_per_s: float
    steps_per_s: float
    step_p50_ms: float | None
    """Median apply time of the interval's steps (None: no step)."""
    step_p99_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Counters:
    monotonic: float
    num_steps: int
    num_evictions: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


class DashboardSampler:
    """Samples one state every ``interval_s`` into a ring of ``history`` samples.

    :meth:`sample` does the work and is what tests call with their own clock;
    :meth:`start` runs it as an asyncio task on the running loop (the state is only ever
    read from that loop, so a sample never sees half a step). :attr:`notifier` wakes event
    streams after every sample.
    """

    def __init__(
        self,
        state: ServiceState,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        history: int = DEFAULT_HISTORY,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        is_stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.state = state
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=history)
        self.notifier = ChangeNotifier()
        self._wall_clock = wall_clock
        self._monotonic = monotonic
        self._is_stopping = is_stopping
        self._previous: _Counters | None = None
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.page_maps = PageMapCache()
        """Page maps for the dashboards this sampler serves (see :class:`PageMapCache`)."""

    @property
    def last_seq(self) -> int:
        return self._seq

    def sample(self) -> Sample:
        """Read the state now, append one sample and return it."""
        state = self.state
        stats = state.stats()
        counters = state.counters
        now = _Counters(
            monotonic=self._monotonic(),
            num_steps=counters.num_steps,
            num_evictions=stats.num_evictions,
            prefix_queries_tokens=stats.prefix_queries_tokens,
            prefix_hits_tokens=stats.prefix_hits_tokens,
        )
        before = self._previous
        hit_rate: float | None = None
        evictions_per_s = steps_per_s = 0.0
        p50: float | None = None
        p99: float | None = None
        if before is not None:
            dt = now.monotonic - before.monotonic
            # Counters only grow; max() keeps a replaced state from producing negative rates.
            num_steps = max(now.num_steps - before.num_steps, 0)
            num_evictions = max(now.num_evictions - before.num_evictions, 0)
            queried = now.prefix_queries_tokens - before.prefix_queries_tokens
            if dt > 0:
                evictions_per_s = num_evictions / dt
                steps_per_s = num_steps / dt
            if queried > 0:
                hit_rate = (now.prefix_hits_tokens - before.prefix_hits_tokens) / queried
            if num_steps:
                # The state keeps the apply times of its last 1024 steps; the interval's are
                # the newest ``num_steps`` of them (all 1024 when more steps ran).
                recent = list(counters.step_seconds)[-num_steps:]
                if recent:
                    q50, q99 = np.percentile(np.asarray(recent, dtype=np.float64), [50, 99])
                    p50, p99 = float(q50) * 1000.0, float(q99) * 1000.0
        self._previous = now
        self._seq += 1
        row = Sample(
            seq=self._seq,
            t=self._wall_clock(),
            usage=_finite(stats.usage),
            num_used_pages=stats.num_used_pages,
            num_free_pages=stats.num_free_pages,
            num_free_cached_pages=stats.num_free_cached_pages,
            num_requests=stats.num_requests,
            num_clients=len(state.clients()),
            hit_rate=hit_rate,
            hit_rate_total=_finite(stats.prefix_hit_rate),
            evictions_per_s=evictions_per_s,
            steps_per_s=steps_per_s,
            step_p50_ms=p50,
            step_p99_ms=p99,
        )
        self.samples.append(row)
        self.notifier.notify()
        return row

    def since(self, seq: int) -> list[Sample]:
        """Kept samples with ``seq`` greater than the given one, oldest first."""
        return [s for s in self.samples if s.seq > seq]

    # -- the task ---------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start sampling on the running loop (no-op when already running)."""
        if self.is_running:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dashboard-sampler")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while not self._is_stopping():
            try:
                self.sample()
            except Exception:  # a bad read must not end the series for good
                log.exception("dashboard sample failed")
            # Fixed cadence: a slow sample does not push every later one back.
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())


# -- server-sent events ---------------------------------------------------------------------


def format_sse(
    data: Any, *, event: str | None = None, event_id: int | None = None, retry_ms: int | None = None
) -> bytes:
    """One server-sent event: optional ``retry:``, ``event:``, ``id:``, then ``data:`` as
    compact JSON on one line, and the blank line that ends the event."""
    lines = []
    if retry_ms is not None:
        lines.append(f"retry: {int(retry_ms)}")
    if event is not None:
        if "\n" in event or "\r" in event:
            raise ValueError("an event name must be one line")
        lines.append(f"event: {event}")
    if event_id is not None:
        lines.append(f"id: {int(event_id)}")
    # JSON escapes newlines inside strings, so the payload is always one data line.
    lines.append("data: " + json.dumps(data, separators=(",", ":"), allow_nan=False))
    return ("\n".join(lines) + "\n\n").encode()


SSE_KEEPALIVE = b": keep-alive\n\n"
"""A comment line: keeps proxies from closing an idle stream; EventSource ignores it."""
