"""Kill -9 the real service under load, restart it on the same data dir, check everything.

Two schedulers and a worker (:mod:`tests.reliability.fleet`) drive a ``pagekeeper serve``
subprocess (``--durability process --debug-invariants``, shared-memory ring). A timer
kills the service with ``SIGKILL`` at a random moment, wherever it is: inside a step,
between a step's publication and its commit, inside a snapshot. Then:

* the service restarts on the same data directory (recovery checks the invariants before
  it is ready; the stale ring file of the killed process is gone from /dev/shm);
* each scheduler takes its id over: the last applied step id is at least the last one it
  was acknowledged, and the step that was in flight is retried with the same id (answered
  from memory if it had been applied, applied now if not);
* the service's table of every running request equals the scheduler's model built from
  acknowledged answers, and no page is held twice except as a shared cached prefix;
* the worker, whose KV cache outlived the crash, keeps checking paged attention through the
  recovered tables against dense attention (a step answered from memory is republished to it
  by a resync step, as an engine re-running that forward pass would);
* the last acknowledged step, retried after the restart, gets its stored answer back
  unchanged (the step-response cache is durable).

Every other round kills differently: "answer lost" sends a step, waits until the service
shows it applied (``GET /v1/clients``), and kills it then, whether or not the answer made it
back; the retry after the restart must then come from memory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from tests.helpers.server import RunningServer, launch
from tests.reliability.fleet import (
    KV,
    Pending,
    SimScheduler,
    SimWorker,
    StepCounter,
    check_no_page_owned_twice,
)

NUM_PAGES = 96
SERVER_ARGS = (
    "--num-pages",
    str(NUM_PAGES),
    "--page-size",
    "16",
    "--max-model-len",
    "512",
    "--lease-ttl-s",
    "30",
    "--max-lease-ttl-s",
    "120",
    "--snapshot-every",
    "25",
    "--durability",
    "process",
    "--debug-invariants",
)
_CRASH_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass
class ServiceCrashResult:
    crashes: int = 0
    acked_steps: int = 0
    retried_from_memory: int = 0
    reapplied_after_crash: int = 0
    requests_checked: int = 0
    attention_steps: int = 0
    attention_rows: int = 0
    max_attention_error: float = 0.0
    stale_rings_removed: int = 0
    answer_lost_kills: int = 0
    pages_lost: int = -1
    """After the last restart: pages neither free nor held (num_pages - 1 - free - used)."""
    seconds: float = 0.0
    restart_seconds: list[float] = field(default_factory=list)


def _kill_once_applied(server: RunningServer, sched: SimScheduler, pending: Pending) -> None:
    """Send the step without waiting for its answer, kill the service as soon as it shows
    the step applied (it is then committed: one synchronous handler applies and logs)."""
    future = sched.stub.Step.future(pending.request, timeout=10)
    http = server.http()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        clients = http.get("/v1/clients").json()
        applied = {c["client_id"]: c["last_step_id"] for c in clients}
        if applied.get(sched.client_id, 0) >= pending.request.step_id:
            break
        time.sleep(0.002)
    else:
        raise AssertionError("the step never showed up as applied")
    os.kill(server.pid, signal.SIGKILL)
    with contextlib.suppress(grpc.RpcError):
        future.result()  # an answer or not: the scheduler treats the step as unanswered


def _start(workdir: Path) -> RunningServer:
    return launch(workdir, *SERVER_ARGS, publish_transport="shm")


def run_service_crashes(
    workdir: Path,
    *,
    crashes: int,
    seed: int = 0,
    min_delay: float = 0.3,
    max_delay: float = 1.5,
) -> ServiceCrashResult:
    rng = np.random.default_rng(seed)
    result = ServiceCrashResult()
    started = time.monotonic()
    server = _start(workdir)
    counter = StepCounter()
    kv = KV(seed)
    schedulers = [
        SimScheduler(server.grpc_address, seed=seed * 10 + i, counter=counter, name=f"s{i}")
        for i in range(2)
    ]
    worker = SimWorker(server.grpc_address, num_pages=NUM_PAGES, kv=kv, seed=seed)
    killer: threading.Timer | None = None
    try:
        for sched in schedulers:
            sched.register()
        worker.register()
        for round_number in range(crashes):
            answer_lost = round_number % 2 == 1
            deadline = time.monotonic() + float(rng.uniform(min_delay, max_delay))
            killer = None
            if not answer_lost:
                killer = threading.Timer(
                    deadline - time.monotonic(), os.kill, (server.pid, signal.SIGKILL)
                )
                killer.start()
            turn = 0
            lost_sender: SimScheduler | None = None
            while True:
                sched = schedulers[turn % len(schedulers)]
                turn += 1
                pending = sched.plan()
                if answer_lost and time.monotonic() > deadline:
                    _kill_once_applied(server, sched, pending)
                    lost_sender = sched
                    result.answer_lost_kills += 1
                    break
                try:
                    reply = sched.send(pending)
                except grpc.RpcError as exc:
                    if exc.code() not in _CRASH_CODES:
                        raise
                    break
                rows = sched.acknowledge(pending, reply)
                if reply.is_published:
                    worker.run_step(reply.step_id, rows)
            if killer is not None:
                killer.join()
            server.process.wait(30)
            assert server.process.returncode == -signal.SIGKILL
            old_pid = server.pid
            restart = time.monotonic()
            server = _start(workdir)
            result.restart_seconds.append(time.monotonic() - restart)
            result.crashes += 1
            leftovers = glob.glob(f"/dev/shm/pagekeeper-*-{old_pid}-*")
            assert not leftovers, f"stale ring files survived the restart: {leftovers}"
            result.stale_rings_removed += "removed" in server.logs()
            worker.close()
            worker.connect(server.grpc_address)
            worker.heartbeat()  # the registration survived: same id, same generation
            for sched in schedulers:
                sched.close()
                sched.connect(server.grpc_address)
                registration = sched.register()
                assert registration.last_step_id >= sched.last_acked_step, (
                    f"{sched.client_id}: acknowledged step {sched.last_acked_step} lost "
                    f"(service has {registration.last_step_id})"
                )
                pending = sched.pending
                if pending is not None:
                    pending.request.generation = sched.generation
                    reply = sched.send(pending)
                    rows = sched.acknowledge(pending, reply)
                    if reply.is_retry:
                        result.retried_from_memory += 1
                        if reply.is_published:
                            answer = sched.resync(rows)
                            assert answer.is_published
                            worker.run_step(answer.step_id, rows)
                    else:
                        assert sched is not lost_sender, (
                            "a step seen applied before the kill was lost"
                        )
                        result.reapplied_after_crash += 1
                        if reply.is_published:
                            worker.run_step(reply.step_id, rows)
                if sched.last_request is not None:
                    sched.retry_last()
                result.requests_checked += sched.verify_tables()
            check_no_page_owned_twice(schedulers)
        # A graceful stop snapshots; the next start replays nothing and keeps everything.
        assert server.stop() == 0
        server = _start(workdir)
        assert "+ 0 replayed" in server.logs(), server.logs()
        for sched in schedulers:
            sched.close()
            sched.connect(server.grpc_address)
            result.requests_checked += sched.verify_tables()
        pages = server.http().get("/v1/pool").json()["pages"]
        result.pages_lost = (
            pages["num_pages"] - 1 - pages["num_free_pages"] - pages["num_used_pages"]
        )
        assert result.pages_lost == 0, pages
        assert server.stop() == 0
    finally:
        if killer is not None:
            killer.cancel()
        if server.is_running():
            server.stop()  # SIGTERM: a graceful stop also unlinks the ring
        for sched in schedulers:
            sched.close()
        worker.close()
    result.acked_steps = sum(s.num_acked_steps for s in schedulers)
    result.attention_steps = worker.stats.steps
    result.attention_rows = worker.stats.rows
    result.max_attention_error = worker.stats.max_error
    result.seconds = time.monotonic() - started
    return result


__all__ = ["ServiceCrashResult", "run_service_crashes"]
