"""Leases run on the wall clock. The lease reaper renews every lease before expiring any
when the service itself was held past a tick (not the clients' fault); a step of the wall
clock (ahead or back) moves every lease by the step, found where the clock is read, so each
keeps the real time it had left."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from pagekeeper.runtime import Runtime, build_runtime
from pagekeeper.server import _reap_leases
from pagekeeper.settings import Settings
from pagekeeper.state import ClientRole, ExpireLeasesCommand, HeartbeatCommand, RegisterCommand

TTL = 10.0


class Clocks:
    """A wall clock and a monotonic one the test moves by hand."""

    def __init__(self) -> None:
        self.wall = 1_000.0
        self.mono = 0.0

    def runtime(self) -> Runtime:
        """A runtime (no durability) on these clocks."""
        return build_runtime(
            Settings(durability="none", publish_transport="none", lease_ttl_s=TTL),
            clock=lambda: self.wall,
            monotonic=lambda: self.mono,
            publisher_factory=None,
        )

    def advance(self, seconds: float, *, wall_only: bool = False) -> None:
        self.wall += seconds
        if not wall_only:
            self.mono += seconds


def _run(moves: list[tuple[float, bool]]) -> tuple[bool, dict[str, float]]:
    """Register a client, then apply each ``(seconds, wall_only)`` move between reaper ticks;
    returns whether the client is still registered and the resume counters."""
    clocks = Clocks()
    runtime = clocks.runtime()
    client_id = runtime.state.register(
        RegisterCommand(now=clocks.wall, role=ClientRole.WORKER)
    ).client_id

    async def scenario() -> None:
        reaper = asyncio.create_task(_reap_leases(runtime, 0.005))
        try:
            await asyncio.sleep(0.02)
            for seconds, wall_only in moves:
                clocks.advance(seconds, wall_only=wall_only)
                await asyncio.sleep(0.03)  # a few ticks see it
        finally:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)

    asyncio.run(scenario())
    alive = any(c.client_id == client_id for c in runtime.state.clients())
    counters = {
        reason: runtime.metrics.lease_resumes.labels(reason)._value.get()
        for reason in ("stall", "clock_jump", "clock_back")
    }
    return alive, counters


def test_time_passing_tick_by_tick_expires_the_lease() -> None:
    alive, counters = _run([(0.5, False)] * 30)  # 15 s in half-second ticks
    assert not alive
    assert counters == {"stall": 0, "clock_jump": 0, "clock_back": 0}


def test_a_wall_clock_step_ahead_keeps_every_lease() -> None:
    alive, counters = _run([(0.5, False), (3_600.0, True), (0.5, False)])
    assert alive
    assert counters == {"stall": 0, "clock_jump": 1, "clock_back": 0}


def test_a_stalled_service_renews_every_lease() -> None:
    # 60 s between two ticks on both clocks: the process was held (stopped, starved).
    alive, counters = _run([(0.5, False), (60.0, False), (0.5, False)])
    assert alive
    assert counters == {"stall": 1, "clock_jump": 0, "clock_back": 0}


def test_a_step_ahead_is_not_a_renewal() -> None:
    alive, _ = _run([(3_600.0, True)] + [(0.5, False)] * 30)  # then 15 s pass normally
    assert not alive


def test_a_wall_clock_step_back_keeps_no_dead_client() -> None:
    # Not moved, the lease would run 3,600 s longer: the dead client's pages held.
    alive, counters = _run([(0.5, False), (-3_600.0, True)] + [(0.5, False)] * 30)
    assert not alive
    assert counters == {"stall": 0, "clock_jump": 0, "clock_back": 1}


def test_a_clock_stepped_again_and_again_never_keeps_a_dead_client() -> None:
    # 1.5 s every 3 s for a minute (a 10 s lease, no heartbeat), back or ahead: every
    # lease moves with each step and keeps the time it had left.
    for step, reason in ((-1.5, "clock_back"), (1.5, "clock_jump")):
        alive, counters = _run(([(0.5, False)] * 6 + [(step, True)]) * 20)
        assert not alive and counters[reason] >= 3


def test_a_step_back_never_ends_a_lease_sooner() -> None:
    # 9.5 s were left at the jump; 8 s later the client is still registered.
    alive, _ = _run([(0.5, False), (-3_600.0, True)] + [(0.5, False)] * 16)
    assert alive
    # A small step back (under a second) is ordinary clock discipline: nothing is done.
    alive, counters = _run([(0.5, False), (-0.5, True), (0.5, False)])
    assert alive and counters["clock_back"] == 0


def test_a_step_moves_each_lease_by_the_step_and_a_heartbeat_after_it_is_not_moved() -> None:
    """The step is found where the clock is read, before anything is stamped with the new
    time: a lease keeps the real time it had left (6 s of 10, the clock 5 s back: 6 s
    later it ends, not 10), and a heartbeat served right after the step, before any reaper
    tick, is not moved a second time."""
    clocks = Clocks()
    runtime = clocks.runtime()
    state = runtime.state
    dead = state.register(RegisterCommand(now=runtime.now(), role=ClientRole.WORKER))
    live = state.register(RegisterCommand(now=runtime.now(), role=ClientRole.WORKER))
    clocks.advance(4.0)
    runtime.now()  # a tick: 6 s left each
    clocks.advance(-5.0, wall_only=True)
    state.heartbeat(HeartbeatCommand(runtime.now(), live.client_id, live.generation))
    remaining = {c.client_id: c.expires_at - clocks.wall for c in state.clients()}
    assert remaining == {dead.client_id: 6.0, live.client_id: TTL}
    assert runtime.metrics.lease_resumes.labels("clock_back")._value.get() == 1
    for _ in range(3):  # later reads see no step: nothing moves again
        runtime.now()
    clocks.advance(6.5)
    state.expire_leases(ExpireLeasesCommand(runtime.now()))
    assert [c.client_id for c in state.clients()] == [live.client_id]


def test_a_clock_of_the_callers_alone_never_steps() -> None:
    """An embedding's own wall clock (a test's, a simulator's), without a monotonic one:
    its progress against real time is not a step of the clock."""
    ticks = iter(range(0, 10_000, 2))
    runtime = build_runtime(
        Settings(durability="none", publish_transport="none", lease_ttl_s=TTL),
        clock=lambda: 10_000.0 + next(ticks),  # 2 s a read, however fast they come
        publisher_factory=None,
    )
    runtime.state.register(RegisterCommand(now=runtime.now(), role=ClientRole.WORKER))
    for _ in range(3):
        runtime.now()
    assert [runtime.metrics.lease_resumes.labels(r)._value.get() for r in ("clock_jump",)] == [0]


def test_a_restart_after_the_clock_went_back_sets_leases_to_one(tmp_path: Path) -> None:
    """Down while the wall clock went back an hour: the restart's resume sets every lease
    to exactly one full lease (journaled as such, so a second restart replays it), not the
    hour longer; a restart with the clock where it was keeps the plain resume."""
    from pagekeeper.durability.recovery import Durability

    def start(wall: float) -> Runtime:
        settings = Settings(publish_transport="none", lease_ttl_s=TTL, data_dir=str(tmp_path))
        durability = Durability.open(tmp_path, "process")
        return build_runtime(
            settings, clock=lambda: wall, publisher_factory=None, durability=durability
        )

    runtime = start(10_000.0)
    client_id = runtime.state.register(
        RegisterCommand(now=10_000.0, role=ClientRole.WORKER)
    ).client_id
    runtime.close()
    runtime = start(6_400.0)
    (client,) = runtime.state.clients()
    assert client.client_id == client_id and client.expires_at == 6_400.0 + TTL
    runtime.close()
    runtime = start(6_401.0)  # the clock going on: at least one lease, as always
    (client,) = runtime.state.clients()
    assert client.expires_at == 6_401.0 + TTL
    runtime.close()


def test_a_stopped_service_keeps_its_clients_and_recovers_the_renewal(tmp_path: Path) -> None:
    """The real process, SIGSTOPped for longer than a lease: on SIGCONT the reaper sees its
    late tick and renews every lease before expiring any; the renewal is journaled, so a
    restart (after kill -9) replays it and keeps the client."""
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
    from tests.helpers.server import launch

    server = launch(tmp_path, "--lease-ttl-s", "1", "--durability", "process")
    try:
        worker = server.stub().RegisterClient(
            pb.RegisterClientRequest(role=pb.CLIENT_ROLE_WORKER, name="stopped"), timeout=10
        )
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(2.5)  # over two leases' worth
        os.kill(server.pid, signal.SIGCONT)
        time.sleep(0.5)  # a few reaper ticks (every 0.25 s)
        ids = [c["client_id"] for c in server.http().get("/v1/clients").json()]
        assert worker.client_id in ids, server.logs()
        metrics = server.http().get("/metrics").text
        assert 'pagekeeper_lease_resumes_total{reason="stall"} 1.0' in metrics
        assert "every lease set to at least one full lease before expiring any" in server.logs()
        # Not forever: with no heartbeat the lease now runs out as usual.
        deadline = time.monotonic() + 10
        while worker.client_id in [c["client_id"] for c in server.http().get("/v1/clients").json()]:
            assert time.monotonic() < deadline, "the renewed lease never ran out"
            time.sleep(0.1)
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait(10)
    # The journal holds the renewal and the expiry: a restart replays both.
    again = launch(tmp_path, "--lease-ttl-s", "1", "--durability", "process")
    try:
        assert again.http().get("/readyz").status_code == 200
    finally:
        again.stop()
