"""Clients that die, go silent, retry everything, or come back as someone else.

A scheduler's lease ends, after ``lease_grace_s``, in its requests being freed; a worker's
in its unregistration and the release of the ring; a stale generation can change nothing;
a retried step changes nothing. The service runs with ``--debug-invariants`` throughout.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from tests.helpers.grpc_util import Scheduler, i32, state_digest, status_of
from tests.helpers.server import ROOT, clean_env

LEASE = ("--lease-ttl-s", "1", "--lease-grace-s", "1.5", "--debug-invariants")


def _spawn(role: str, address: str) -> subprocess.Popen[str]:
    env = clean_env({"PYTHONPATH": str(ROOT)})
    return subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.fault_clients", role, address],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic()


def _long_lived(server) -> Scheduler:
    """A scheduler whose own lease outlasts the test (the clients under test have 1 s).
    Asked for at its first registration: registering with the 1 s default and extending
    it afterwards raced the lease on a loaded machine."""
    return Scheduler(server, lease_ttl_ms=60_000)


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the client went quiet"
    return proc.stdout.readline()


def _pool(server) -> dict:
    return server.http().get("/v1/pool").json()["pages"]


def test_scheduler_killed_mid_step_loses_its_pages_after_the_grace(server_factory):
    server = server_factory(*LEASE)
    proc = _spawn("scheduler", server.grpc_address)
    try:
        client_id = _read_line(proc, 30).split()[1]
        for _ in range(30):
            assert _read_line(proc, 10).startswith("step")
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-loop: a step may be in flight
        proc.wait(10)
    killed_at = time.monotonic()
    http = server.http()
    assert http.get("/v1/requests").json()["items"], "the scheduler held no requests"
    gone = _wait_for(
        lambda: not http.get("/v1/requests").json()["items"], 15, "the requests to be freed"
    )
    # Never before lease + grace (the lease was renewed by its last step, before the kill).
    assert gone - killed_at >= 1.0 + 1.5 - 0.05
    assert [c["client_id"] for c in http.get("/v1/clients").json()] == []
    pages = _pool(server)
    assert pages["num_used_pages"] == 0
    assert pages["num_free_pages"] == pages["num_pages"] - 1
    # Its id is gone: a late call from it is refused, not applied.
    stub = server.stub()
    assert (
        status_of(stub.Step, pb.StepRequest(client_id=client_id, generation=1, step_id=10**6))
        == grpc.StatusCode.NOT_FOUND
    )


def test_worker_killed_while_reading_is_unregistered_and_its_ring_released(server_factory):
    server = server_factory(*LEASE, "--max-lease-ttl-s", "60", publish_transport="shm")
    sched = _long_lived(server)
    proc = _spawn("worker", server.grpc_address)
    try:
        line = _read_line(proc, 30).split()
        assert line[0] == "registered", proc.stderr.read()
        ring_path = Path(line[2])
        assert ring_path.exists()
        sched.admit("w-a", list(range(40)))
        published = 0
        for i in range(200):
            reply = sched.step(
                growths=[pb.Growth(request_id="w-a", num_new_tokens=1, new_token_ids=i32([i]))],
                batch=pb.Batch(request_ids=["w-a"]),
            )
            published += reply.is_published
            if i == 20:
                assert _read_line(proc, 10).startswith("read")  # it is reading
        assert published
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    http = server.http()
    _wait_for(
        lambda: all(c["role"] != "worker" for c in http.get("/v1/clients").json()),
        15,
        "the worker's lease to expire",
    )
    assert not ring_path.exists(), "the ring of the only worker was not released"
    # The scheduler goes on; its steps no longer publish (no worker left).
    sched.stub.Heartbeat(
        pb.HeartbeatRequest(client_id=sched.client_id, generation=sched.generation)
    )
    reply = sched.step(
        growths=[pb.Growth(request_id="w-a", num_new_tokens=1, new_token_ids=i32([1]))],
        batch=pb.Batch(request_ids=["w-a"]),
    )
    assert not reply.is_published


def test_silent_client_is_fenced_then_dropped(server_factory):
    server = server_factory(*LEASE)
    quiet = Scheduler(server, name="quiet")
    assert quiet.admit("q-a", list(range(50))).status == pb.ALLOCATION_STATUS_OK
    http = server.http()
    # Lease over, grace running: refused (FAILED_PRECONDITION), pages still held.
    time.sleep(1.2)
    assert quiet.stub and status_of(quiet.stub.Step, quiet.request(free_request_ids=["q-a"])) in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
    )
    _wait_for(lambda: not http.get("/v1/requests").json()["items"], 15, "the grace to end")
    assert _pool(server)["num_used_pages"] == 0
    # After the grace the id is gone: a takeover is refused, a new registration works.
    assert (
        status_of(
            quiet.stub.RegisterClient,
            pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, client_id=quiet.client_id),
        )
        == grpc.StatusCode.NOT_FOUND
    )


def test_stale_generation_cannot_touch_the_successors_pages(pagekeeper_server):
    server = pagekeeper_server
    old = Scheduler(server, name="old")
    assert old.admit("gen-a", list(range(64))).status == pb.ALLOCATION_STATUS_OK
    takeover = old.stub.RegisterClient(
        pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, client_id=old.client_id),
        metadata=server.metadata,
    )
    assert takeover.generation == old.generation + 1
    before = state_digest(server)
    for request in (
        old.request(free_request_ids=["gen-a"]),
        old.request(admissions=[pb.Admission(request_id="gen-b", token_ids=i32(range(9)))]),
    ):
        error = status_of(old.stub.Step, request, metadata=server.metadata)
        assert error == grpc.StatusCode.ABORTED  # fenced off: not to register again
    for call, message in (
        (old.stub.Heartbeat, pb.HeartbeatRequest(client_id=old.client_id, generation=1)),
        (old.stub.Unregister, pb.UnregisterRequest(client_id=old.client_id, generation=1)),
    ):
        assert status_of(call, message, metadata=server.metadata) == grpc.StatusCode.ABORTED
    assert state_digest(server) == before
    # The successor owns the request and frees it.
    old.generation = takeover.generation
    old.free("gen-a")


def _drive(sched: Scheduler, *, twice: bool) -> list[pb.StepResponse]:
    answers = []
    running: list[str] = []
    for n in range(40):
        request = sched.request(
            free_request_ids=running[:1] if n % 5 == 4 else [],
            growths=[
                pb.Growth(request_id=r, num_new_tokens=1, new_token_ids=i32([n]))
                for r in running[1 if n % 5 == 4 else 0 :]
            ],
            admissions=[pb.Admission(request_id=f"d{n}", token_ids=i32(range(n, n + 30)))],
        )
        reply = sched.stub.Step(request, metadata=sched.md)
        if twice:
            before = state_digest(sched.server)
            retry = sched.stub.Step(request, metadata=sched.md)
            assert retry.is_retry and state_digest(sched.server) == before
            retry.is_retry = False
            assert retry == reply
        if n % 5 == 4:
            running = running[1:]
        running.append(f"d{n}")
        answers.append(reply)
    return answers


@pytest.mark.parametrize("flags", [()])
def test_retrying_every_step_twice_changes_nothing(server_factory, flags):
    """A scheduler that sends every step twice ends with the same pages, answers and
    events as one that sends each once."""
    single, double = server_factory(*flags), server_factory(*flags)
    once = _drive(Scheduler(single), twice=False)
    twice = _drive(Scheduler(double), twice=True)
    assert once == twice
    assert state_digest(single) == state_digest(double)


def test_worker_lease_expiry_keeps_the_scheduler_working(server_factory):
    """A worker that goes silent while a scheduler publishes: the scheduler's steps keep
    succeeding before, during and after the worker's expiry."""
    server = server_factory(*LEASE, publish_transport="shm")
    sched = _long_lived(server)
    worker = server.stub().RegisterClient(
        pb.RegisterClientRequest(role=pb.CLIENT_ROLE_WORKER, device="cpu")
    )
    assert worker.ring.path and os.path.exists(worker.ring.path)
    sched.admit("k-a", list(range(20)))
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        reply = sched.step(
            growths=[pb.Growth(request_id="k-a", num_new_tokens=1, new_token_ids=i32([3]))],
            batch=pb.Batch(request_ids=["k-a"]),
        )
        assert reply.results == [] or reply.results[0].status == pb.ALLOCATION_STATUS_OK
        time.sleep(0.05)
    assert not os.path.exists(worker.ring.path)
