"""The dashboard's sampler (rates, interval hit rate and percentiles, bounded history) and
the server-sent event framing."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from pagekeeper.core.config import PoolConfig
from pagekeeper.dashboard import SSE_KEEPALIVE, DashboardSampler, format_sse
from pagekeeper.state import Admission, ClientRole, RegisterCommand, ServiceState, StepCommand


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class Driver:
    """One scheduler stepping a small state."""

    def __init__(self, num_pages: int = 16) -> None:
        self.state = ServiceState(PoolConfig(num_pages=num_pages, max_model_len=1024))
        reply = self.state.register(RegisterCommand(now=0.0, role=ClientRole.SCHEDULER))
        self.client = (reply.client_id, reply.generation)
        self.step_id = 0

    def step(self, **kwargs: object) -> None:
        self.step_id += 1
        self.state.step(
            StepCommand(
                now=1.0,
                client_id=self.client[0],
                generation=self.client[1],
                step_id=self.step_id,
                **kwargs,  # type: ignore[arg-type]
            )
        )

    def admit(self, request_id: str, tokens: range) -> None:
        self.step(admissions=(Admission(request_id, np.asarray(tokens, dtype=np.int32)),))


def make_sampler(state: ServiceState, history: int = 600) -> tuple[DashboardSampler, Clock]:
    mono = Clock(100.0)
    sampler = DashboardSampler(
        state, history=history, monotonic=mono, wall_clock=lambda: 1.7e9 + mono.now
    )
    return sampler, mono


def test_first_sample_has_no_rates():
    driver = Driver()
    sampler, _ = make_sampler(driver.state)
    first = sampler.sample()
    assert first.seq == 1
    assert first.steps_per_s == first.evictions_per_s == 0.0
    assert first.hit_rate is None
    assert first.step_p50_ms is None and first.step_p99_ms is None
    assert first.num_clients == 1
    assert first.num_free_pages == 15
    assert first.usage == 0.0


def test_rates_hit_rate_and_percentiles_cover_the_interval():
    driver = Driver()
    sampler, mono = make_sampler(driver.state)
    driver.admit("warm", range(0, 48))  # before the first sample: not in the interval
    sampler.sample()

    driver.admit("a", range(100, 164))  # 4 pages, all full and cached
    driver.admit("b", range(100, 164))  # hits 3 pages: 48 of its 64 tokens
    mono.now += 2.0
    sample = sampler.sample()
    assert sample.steps_per_s == pytest.approx(2 / 2.0)
    assert sample.hit_rate == pytest.approx(48 / 128)
    stats = driver.state.stats()
    assert sample.hit_rate_total == pytest.approx(stats.prefix_hit_rate)
    assert sample.num_requests == 3
    assert sample.num_used_pages == stats.num_used_pages
    recent = np.asarray(list(driver.state.counters.step_seconds)[-2:]) * 1000
    assert sample.step_p50_ms == pytest.approx(float(np.percentile(recent, 50)))
    assert sample.step_p99_ms == pytest.approx(float(np.percentile(recent, 99)))

    # An idle interval: zero rates, no hit rate, no percentiles (gaps in the charts).
    mono.now += 1.0
    idle = sampler.sample()
    assert idle.steps_per_s == 0.0
    assert idle.hit_rate is None
    assert idle.step_p50_ms is None


def test_evictions_per_second():
    driver = Driver(num_pages=16)
    sampler, mono = make_sampler(driver.state)
    driver.admit("a", range(0, 64))  # pages 1-4, cached
    driver.step(frees=("a",))  # free but cached
    sampler.sample()
    before = driver.state.stats().num_evictions
    driver.admit("big", range(5000, 5000 + 15 * 16))  # every free page: evicts 1-4
    evicted = driver.state.stats().num_evictions - before
    assert evicted == 4
    mono.now += 0.5
    sample = sampler.sample()
    assert sample.evictions_per_s == pytest.approx(evicted / 0.5)
    assert sample.usage == pytest.approx(1.0)


def test_history_is_bounded_and_resumable():
    driver = Driver()
    sampler, mono = make_sampler(driver.state, history=5)
    for _ in range(8):
        mono.now += 1.0
        sampler.sample()
    assert [s.seq for s in sampler.samples] == [4, 5, 6, 7, 8]
    assert [s.seq for s in sampler.since(6)] == [7, 8]
    assert [s.seq for s in sampler.since(0)] == [4, 5, 6, 7, 8]
    assert sampler.since(8) == []
    assert sampler.last_seq == 8


def test_task_samples_on_a_cadence_and_stops():
    driver = Driver()
    stopping = False
    sampler = DashboardSampler(driver.state, interval_s=0.01, is_stopping=lambda: stopping)

    async def scenario() -> None:
        nonlocal stopping
        sampler.start()
        sampler.start()  # idempotent
        version = sampler.notifier.version
        assert await sampler.notifier.wait(version, timeout=2.0)
        await asyncio.sleep(0.08)
        assert sampler.last_seq >= 3
        stopping = True
        await asyncio.sleep(0.05)
        assert not sampler.is_running  # the loop saw the flag and returned
        count = sampler.last_seq
        await asyncio.sleep(0.05)
        assert sampler.last_seq == count

    asyncio.run(scenario())


def test_bad_arguments():
    state = Driver().state
    with pytest.raises(ValueError):
        DashboardSampler(state, interval_s=0)
    with pytest.raises(ValueError):
        DashboardSampler(state, history=0)


# -- server-sent events ----------------------------------------------------------------------


def parse_event(raw: bytes) -> dict[str, str]:
    """Parse one event the way the HTML spec's EventSource does (single-line data)."""
    text = raw.decode()
    assert text.endswith("\n\n"), "an event ends with a blank line"
    fields: dict[str, str] = {}
    for line in text[:-2].split("\n"):
        name, _, value = line.partition(":")
        fields[name] = value[1:] if value.startswith(" ") else value
    return fields


def test_sse_event_framing():
    raw = format_sse({"a": 1, "text": "two\nlines"}, event="sample", event_id=42, retry_ms=2000)
    assert raw.startswith(b"retry: 2000\nevent: sample\nid: 42\ndata: ")
    assert raw.count(b"\n") == 5  # four fields, then the blank line
    fields = parse_event(raw)
    assert fields["event"] == "sample"
    assert fields["id"] == "42"
    assert json.loads(fields["data"]) == {"a": 1, "text": "two\nlines"}


def test_sse_minimal_event_and_keepalive():
    assert format_sse([1, 2]) == b"data: [1,2]\n\n"
    assert SSE_KEEPALIVE.startswith(b":") and SSE_KEEPALIVE.endswith(b"\n\n")


def test_sse_refuses_what_would_break_the_stream():
    with pytest.raises(ValueError):
        format_sse({}, event="two\nlines")
    with pytest.raises(ValueError):
        format_sse({"x": math.nan})  # not JSON: EventSource clients would choke


def test_sample_rows_are_json_clean():
    driver = Driver()
    sampler, mono = make_sampler(driver.state)
    sampler.sample()
    mono.now += 1
    row = sampler.sample().to_dict()
    fields = parse_event(format_sse(row, event="sample", event_id=row["seq"]))
    assert json.loads(fields["data"]) == row
