"""The pause metrics: the event-loop lag probe sees a stalled loop, and the GC watch times
every collection by generation (and stops when told)."""

from __future__ import annotations

import asyncio
import gc
import time

from pagekeeper.core.config import GroupConfig, PoolConfig
from pagekeeper.metrics import Metrics
from pagekeeper.state import Limits, ServiceState


def _metrics() -> Metrics:
    config = PoolConfig(num_pages=64, groups=(GroupConfig(page_size=16),), max_model_len=256)
    return Metrics(ServiceState(config, Limits()))


def _sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_the_probe_sees_a_stalled_loop():
    metrics = _metrics()

    async def stall() -> None:
        probe = asyncio.create_task(metrics.probe_loop_lag(period=0.01))
        await asyncio.sleep(0.05)  # a few on-time samples first
        time.sleep(0.08)  # a handler holding the loop: the probe's timer comes due inside
        await asyncio.sleep(0.03)
        probe.cancel()

    asyncio.run(stall())
    count = _sample(metrics, "pagekeeper_event_loop_lag_seconds_count")
    under_25ms = _sample(metrics, "pagekeeper_event_loop_lag_seconds_bucket", {"le": "0.025"})
    assert count >= 3
    assert count - under_25ms >= 1  # the stall: late by ~70 ms
    assert under_25ms >= 1  # the samples before it were on time
    assert _sample(metrics, "pagekeeper_event_loop_lag_seconds_sum") >= 0.05


def test_the_gc_watch_times_each_collection_until_removed():
    metrics = _metrics()
    labels = {"generation": "2"}
    metrics.watch_gc()
    metrics.watch_gc()  # once only
    try:
        gc.collect()
        gc.collect()
        assert _sample(metrics, "pagekeeper_gc_pause_seconds_count", labels) == 2
        assert _sample(metrics, "pagekeeper_gc_pause_seconds_sum", labels) > 0
        gc.collect(0)
        assert _sample(metrics, "pagekeeper_gc_pause_seconds_count", {"generation": "0"}) >= 1
    finally:
        metrics.unwatch_gc()
    gc.collect()
    assert _sample(metrics, "pagekeeper_gc_pause_seconds_count", labels) == 2
    assert metrics._on_gc not in gc.callbacks
