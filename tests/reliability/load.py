"""Several schedulers and workers against one service for a bounded time (shared by the test
suite and ``make soak``).

Schedulers run in threads, each on its own channel, stepping as fast as the service answers
(admissions with shared prefixes, decodes, frees, preemption); the first one publishes its
batches (published step ids increase pool-wide), the others allocate only. Workers read every
step they can from the shared-memory ring and heartbeat. Measured: the Step round trip of
every scheduler (p50 / p99 / max), steps and table reads per second, the service's RSS
and open file descriptors after a warm-up and at the end, and its own pause histograms
(event-loop lag, collections) at the end. At the end every scheduler frees
its requests and every worker unregisters: all pages must be back in the free queue, the
ring file gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from tests.helpers.server import RunningServer, launch
from tests.reliability.fleet import KV, SimScheduler, SimWorker, StepCounter

NUM_PAGES = 1024


@dataclass
class LoadResult:
    seconds: float = 0.0
    steps: int = 0
    steps_over_local_socket: int = 0
    table_reads: int = 0
    step_p50_ms: float = 0.0
    step_p99_ms: float = 0.0
    step_max_ms: float = 0.0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    fds_start: int = 0
    fds_end: int = 0
    errors: list[str] = field(default_factory=list)
    pages_after: dict[str, int] = field(default_factory=dict)
    server_pauses: dict[str, float] = field(default_factory=dict)
    """The service's own pause histograms at the end of the run (see ``pause_figures``)."""

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pause_figures(metrics_text: str) -> dict[str, float]:
    """From a /metrics page: how many event-loop lag samples and collections (by
    generation) there were, how many took over 10 and over 50 ms, and the bucket bound
    that holds the longest (inf: over a second)."""
    buckets: dict[str, dict[float, float]] = {"loop_lag": {}, "gc0": {}, "gc1": {}, "gc2": {}}
    for line in metrics_text.splitlines():
        if line.startswith("pagekeeper_event_loop_lag_seconds_bucket"):
            kind = "loop_lag"
        elif line.startswith("pagekeeper_gc_pause_seconds_bucket"):
            kind = "gc" + line.split('generation="')[1][0]
        else:
            continue
        bound = float(line.split('le="')[1].split('"')[0])
        table = buckets[kind]
        table[bound] = table.get(bound, 0.0) + float(line.split()[-1])
    figures: dict[str, float] = {}
    for kind, table in buckets.items():
        total = table.get(float("inf"), 0.0)
        figures[f"{kind}_count"] = total
        figures[f"{kind}_over_10ms"] = total - table.get(0.01, 0.0)
        figures[f"{kind}_over_50ms"] = total - table.get(0.05, 0.0)
        figures[f"{kind}_max_under_s"] = min(
            (bound for bound, n in table.items() if n >= total), default=0.0
        )
    return figures


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def run_load(
    workdir: Path,
    *,
    duration: float,
    num_schedulers: int = 3,
    num_workers: int = 2,
    warmup: float = 1.5,
    seed: int = 0,
    durability: str = "process",
) -> LoadResult:
    # Half the schedulers step over the same-node socket, half over gRPC.
    sockdir = tempfile.mkdtemp(prefix="pk-load-")
    local_socket = os.path.join(sockdir, "step.sock")
    server: RunningServer = launch(
        workdir,
        "--local-socket",
        local_socket,
        "--num-pages",
        str(NUM_PAGES),
        "--max-model-len",
        "1024",
        "--lease-ttl-s",
        "30",
        "--durability",
        durability,
        "--snapshot-every",
        "2000",
        publish_transport="shm",
    )
    result = LoadResult()
    counter = StepCounter()
    counter_lock = threading.Lock()
    stop = threading.Event()
    latencies: list[list[float]] = [[] for _ in range(num_schedulers)]
    reads = [0] * num_workers
    kv = KV(seed)
    workers = [
        SimWorker(server.grpc_address, num_pages=8, kv=kv, seed=i) for i in range(num_workers)
    ]
    schedulers = [
        SimScheduler(
            server.grpc_address,
            seed=seed * 100 + i,
            counter=counter,
            name=f"load{i}",
            max_running=8,
            max_tokens=400,
            local_socket=local_socket if i % 2 else None,
        )
        for i in range(num_schedulers)
    ]

    def schedule(index: int) -> None:
        sched = schedulers[index]
        try:
            while not stop.is_set():
                with counter_lock:
                    pending = sched.plan()
                if index:
                    pending.request.ClearField("batch")
                started = time.perf_counter()
                with counter_lock if index == 0 else _NoLock():
                    # The publisher sends under the id lock: ids reach the service in order.
                    reply = sched.send(pending)
                latencies[index].append(time.perf_counter() - started)
                sched.acknowledge(pending, reply)
        except Exception as exc:  # reported, and fails the run
            result.errors.append(f"scheduler {index}: {type(exc).__name__}: {exc}")

    def read(index: int) -> None:
        worker = workers[index]
        last = 0
        beat = time.monotonic()
        try:
            while not stop.is_set():
                latest = worker.view.latest_step()
                if latest > last:
                    try:
                        worker.view.wait(latest, timeout=1.0)
                        reads[index] += 1
                    except Exception:  # overwritten meanwhile (depth 2): take the next one
                        pass
                    last = latest
                else:
                    time.sleep(0.0005)
                if time.monotonic() - beat > 2:
                    worker.heartbeat()
                    beat = time.monotonic()
        except Exception as exc:
            result.errors.append(f"worker {index}: {type(exc).__name__}: {exc}")

    try:
        for worker in workers:
            worker.register()
        for sched in schedulers:
            sched.register()
        threads = [
            threading.Thread(target=schedule, args=(i,), daemon=True) for i in range(num_schedulers)
        ] + [threading.Thread(target=read, args=(i,), daemon=True) for i in range(num_workers)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(warmup)
        result.rss_start_mb, result.fds_start = _rss_mb(server.pid), _fds(server.pid)
        time.sleep(max(0.0, duration - warmup))
        result.rss_end_mb, result.fds_end = _rss_mb(server.pid), _fds(server.pid)
        stop.set()
        result.server_pauses = pause_figures(server.http().get("/metrics").text)
        for thread in threads:
            thread.join(30)
        result.seconds = time.monotonic() - started
        result.steps = sum(len(x) for x in latencies)
        result.steps_over_local_socket = sum(len(x) for x in latencies[1::2])
        result.table_reads = sum(reads)
        all_latencies = np.array([x for lane in latencies for x in lane]) * 1000
        if all_latencies.size:
            result.step_p50_ms, result.step_p99_ms = (
                float(v) for v in np.percentile(all_latencies, [50, 99])
            )
            result.step_max_ms = float(all_latencies.max())
        # Drain: every request freed, every worker gone; nothing may stay behind.
        for sched in schedulers:
            request = pb.StepRequest(
                client_id=sched.client_id,
                generation=sched.generation,
                step_id=counter.next(),
                free_request_ids=list(sched.requests),
            )
            sched.stub.Step(request, timeout=10)
            sched.requests.clear()
        ring_path = None
        for worker in workers:
            reply = worker.heartbeat()
            ring_path = reply.ring.path or ring_path
            worker.stub.Unregister(
                pb.UnregisterRequest(client_id=worker.client_id, generation=worker.generation),
                timeout=10,
            )
        result.pages_after = server.http().get("/v1/pool").json()["pages"]
        if ring_path and os.path.exists(ring_path):
            result.errors.append(f"ring {ring_path} still exists after every worker left")
        assert server.stop() == 0
    finally:
        stop.set()
        for sched in schedulers:
            sched.close()
        for worker in workers:
            worker.close()
        if server.is_running():
            server.stop()  # SIGTERM: a graceful stop also unlinks the ring
        if os.path.exists(local_socket):
            result.errors.append(f"local socket {local_socket} still exists after the stop")
        shutil.rmtree(sockdir, ignore_errors=True)
    return result


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = ["LoadResult", "pause_figures", "run_load"]
