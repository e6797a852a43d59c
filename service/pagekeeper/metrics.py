"""Prometheus metrics: one registry per service instance (never the global default).

Latency histograms are observed per call by the adapters; everything else (pool gauges,
step counters) is read from the state at scrape time by :class:`StateCollector`, so the
hot path pays for nothing but one histogram observation per RPC.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagekeeper.state import ServiceState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Sub-millisecond resolution: a Step round trip is ~1 ms, the state's part far less.
_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


# Pauses: from what a collection of the young generation takes to a stalled loop.
_PAUSE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

LOOP_PROBE_S = 0.05
"""How often the event-loop probe sets its timer (20 wake-ups a second: ~0.05% of a core)."""


class StateCollector(Collector):
    """Pool gauges and service counters, computed from the state on every scrape."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        stats = self.state.stats()
        counters = self.state.counters

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"pagekeeper_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"pagekeeper_{name}", doc, value=value)

        yield gauge("pages", "Pages in the pool, null page included.", stats.num_pages)
        yield gauge("free_pages", "Pages in the free queue.", stats.num_free_pages)
        yield gauge("used_pages", "Pages held by requests.", stats.num_used_pages)
        yield gauge("cached_pages", "Pages in the prefix-cache index.", stats.num_cached_pages)
        yield gauge(
            "free_cached_pages",
            "Free pages still in the prefix cache.",
            stats.num_free_cached_pages,
        )
        yield gauge("requests", "Running requests.", stats.num_requests)
        yield gauge("usage_ratio", "Fraction of the pool in use.", stats.usage)
        yield gauge("prefix_hit_rate", "Prefix-cache hit rate in tokens.", stats.prefix_hit_rate)
        clients = self.state.clients()
        yield gauge("clients", "Registered clients.", len(clients))
        yield gauge(
            "revoked_requests",
            "Requests freed under their schedulers (an admin's force-free, a worker that "
            "joined with an empty KV cache) that they have not freed since.",
            sum(len(c.revoked) for c in clients),
        )
        yield gauge(
            "last_event_seq", "Sequence number of the latest KV event.", self.state.last_event_seq
        )
        num_events, num_bytes, first_seq = self.state.event_buffer()
        yield gauge(
            "event_buffer_events", "KV events kept for resumption (event_buffer_size).", num_events
        )
        yield gauge(
            "event_buffer_bytes",
            "Estimated bytes of the KV events kept for resumption (event_buffer_bytes).",
            num_bytes,
        )
        yield gauge(
            "event_buffer_first_seq",
            "Oldest KV event a watcher can resume from; one further back has fallen behind.",
            first_seq,
        )
        yield counter(
            "prefix_queries_tokens",
            "Tokens looked up in the prefix cache.",
            stats.prefix_queries_tokens,
        )
        yield counter(
            "prefix_hits_tokens", "Tokens served from the prefix cache.", stats.prefix_hits_tokens
        )
        yield counter("evictions", "Cached pages evicted on reuse.", stats.num_evictions)
        yield counter(
            "allocated_pages", "Pages handed to requests.", stats.num_allocated_pages_total
        )
        yield counter("freed_pages", "Pages returned by requests.", stats.num_freed_pages_total)
        yield counter("no_capacity", "Allocations answered no-capacity.", stats.num_no_capacity)
        yield counter("steps", "Steps applied.", counters.num_steps)
        yield counter(
            "step_retries",
            "Steps answered from memory (retries), since the process started.",
            counters.num_step_retries,
        )
        yield counter(
            "steps_rejected",
            "Steps rejected by validation, since the process started.",
            counters.num_steps_rejected,
        )
        yield counter("published", "Batches published.", counters.num_published)
        yield counter(
            "publish_errors", "Batches whose publication failed.", counters.num_publish_errors
        )
        yield counter(
            "expired_clients", "Clients dropped on lease expiry.", counters.num_expired_clients
        )
        yield counter(
            "force_frees",
            "Requests freed by an operator (DELETE /v1/requests/{id}).",
            counters.num_force_frees,
        )
        yield counter(
            "prefix_cache_forgets",
            "Workers that registered with an empty KV cache, each emptying the prefix cache.",
            counters.num_prefix_cache_forgets,
        )
        yield counter(
            "kv_loss_revocations",
            "Running requests freed and revoked when a worker with an empty KV cache joined.",
            counters.num_kv_loss_revocations,
        )


class Metrics:
    """The registry and the instruments both adapters observe."""

    def __init__(self, state: ServiceState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(StateCollector(state))
        self.rpc_seconds = Histogram(
            "pagekeeper_rpc_duration_seconds",
            "Unary call latency inside the server (gRPC or the same-node socket), by method "
            "and status code.",
            ["method", "code"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.http_seconds = Histogram(
            "pagekeeper_http_duration_seconds",
            "HTTP request latency inside the server, by route and status.",
            ["method", "route", "status"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.local_connections = Gauge(
            "pagekeeper_local_connections",
            "Open connections on the same-node socket (0 when it is off).",
            registry=self.registry,
        )
        self.step_apply_seconds = Histogram(
            "pagekeeper_step_apply_seconds",
            "Time the state spent applying one Step (no transport).",
            buckets=_BUCKETS,
            registry=self.registry,
        )

        self.loop_lag_seconds = Histogram(
            "pagekeeper_event_loop_lag_seconds",
            f"How late the event loop ran a timer due {LOOP_PROBE_S:g} s ahead, sampled "
            f"{1 / LOOP_PROBE_S:g} times a second: whatever held the loop (a call's own work, "
            "a snapshot's capture, a collection) shows here, a stall of d seconds in about "
            f"min(1, d / {LOOP_PROBE_S:g}) of its occurrences.",
            buckets=_PAUSE_BUCKETS,
            registry=self.registry,
        )
        self.gc_pause_seconds = Histogram(
            "pagekeeper_gc_pause_seconds",
            "How long each cyclic garbage collection held the process, by generation.",
            ["generation"],
            buckets=_PAUSE_BUCKETS,
            registry=self.registry,
        )
        self.tls_reloads = Counter(
            "pagekeeper_tls_reloads",
            "Rotated TLS files seen, by result: loaded (new connections get them) or failed "
            "(the previous certificate keeps serving; see the log).",
            ["result"],
            registry=self.registry,
        )
        self.lease_resumes = Counter(
            "pagekeeper_lease_resumes",
            "Times the lease reaper set leases right before expiring any, by reason: stall "
            "(the service was held past a tick: every lease renewed), clock_jump / clock_back "
            "(the wall clock stepped ahead / back: every lease moved by the step).",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("stall", "clock_jump", "clock_back"):
            self.lease_resumes.labels(reason)  # every series exists from the start (at 0)
        self.token_reloads = Counter(
            "pagekeeper_token_reloads",
            "Changed bearer-token files seen, by result: loaded (the tokens listed are the "
            "ones accepted now) or failed (the tokens in force stay; see the log).",
            ["result"],
            registry=self.registry,
        )
        self.tls_not_after = Gauge(
            "pagekeeper_tls_certificate_expiry_timestamp_seconds",
            "When the TLS certificate both listeners serve expires (Unix time; 0 without "
            "TLS): alert on it minus now.",
            registry=self.registry,
        )
        self._gc_pauses = [self.gc_pause_seconds.labels(str(g)) for g in range(3)]
        self._gc_started = 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- pauses --------------------------------------------------------------------------
    async def probe_loop_lag(self, period: float = LOOP_PROBE_S) -> None:
        """Observe the loop's lag every ``period`` until cancelled (a task of the server)."""
        loop = asyncio.get_running_loop()
        observe = self.loop_lag_seconds.observe
        while True:
            due = loop.time() + period
            await asyncio.sleep(period)
            observe(max(loop.time() - due, 0.0))

    def watch_gc(self) -> None:
        """Time every collection from now on (until :meth:`unwatch_gc`)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside the collector, in whichever thread allocated: no allocation-heavy
        # work here (a histogram observation takes a lock and adds to two floats).
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_pauses[info["generation"]].observe(time.perf_counter() - self._gc_started)
