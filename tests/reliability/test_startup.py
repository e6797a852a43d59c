"""Start-up over a data directory: what it refuses loudly, what it repairs and reports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest

from pagekeeper.durability import Durability
from pagekeeper.durability.log import DB_NAME, SNAPSHOT_DIR
from pagekeeper.runtime import build_runtime
from pagekeeper.server import serve
from pagekeeper.settings import Settings
from pagekeeper.state import ServiceState
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc
from tests.helpers.grpc_util import Scheduler, i32
from tests.helpers.server import ROOT, ServerStartError, clean_env, launch
from tests.reliability import journal_files


def _serve(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pagekeeper serve`` that is expected to fail before it is ready."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pagekeeper",
            "serve",
            "--grpc-address",
            "127.0.0.1:0",
            "--http-address",
            "127.0.0.1:0",
            "--data-dir",
            str(data_dir),
            *args,
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=ROOT,
        timeout=60,
    )


def _fill(tmp_path: Path, *args: str) -> tuple[Path, int]:
    """A service that stepped a while and was killed: a log with records past its last
    snapshot. Returns the workdir and how many steps were acknowledged."""
    server = launch(tmp_path, "--snapshot-every", "10", *args)
    sched = Scheduler(server)
    for n in range(25):
        sched.step(admissions=[pb.Admission(request_id=f"s{n}", token_ids=i32(range(n, n + 20)))])
        if n == 15:
            time.sleep(1.5)  # the housekeeping task snapshots (every 0.5 s, 10 records due)
    os.kill(server.pid, signal.SIGKILL)
    server.process.wait(10)
    return tmp_path, sched.step_id


def test_unreadable_snapshot_fails_start_up_with_one_line(tmp_path):
    workdir, _ = _fill(tmp_path)
    db = sqlite3.connect(workdir / "data" / DB_NAME)
    (name,) = db.execute("SELECT name FROM snapshot_files").fetchone()
    db.close()
    path = workdir / "data" / SNAPSHOT_DIR / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A  # one flipped bit pattern in the body
    path.write_bytes(bytes(data))
    out = _serve(workdir / "data")
    assert out.returncode == 3
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("pagekeeper: cannot recover the durable state:")
    assert "unreadable snapshot" in last and "CRC mismatch" in last
    assert "Traceback" not in out.stderr


def test_damaged_log_tail_is_reported_in_the_log_and_the_metrics(tmp_path):
    workdir, last_step = _fill(tmp_path)
    last_seq, crc, _ = journal_files.records(workdir / "data")[-3]
    journal_files.edit_record(workdir / "data", last_seq, crc=(crc + 1) & 0xFFFFFFFF)
    server = launch(workdir)
    try:
        assert re.search(r"damaged: record \d+ fails its CRC", server.logs())
        metrics = server.http().get("/metrics").text
        assert "pagekeeper_durability_recovery_damaged 1.0" in metrics
        assert "pagekeeper_durability_last_snapshot_loop_seconds " in metrics
        assert "pagekeeper_durability_checkpoints_total " in metrics
        assert "pagekeeper_durability_records_pruned_total " in metrics
        assert "pagekeeper_durability_last_checkpoint_seconds " in metrics
        segments = re.search(r"^pagekeeper_durability_journal_segments (\S+)$", metrics, re.M)
        size = re.search(r"^pagekeeper_durability_journal_bytes (\S+)$", metrics, re.M)
        assert segments and float(segments.group(1)) >= 1
        assert size and float(size.group(1)) > 0
        dropped = re.search(
            r"^pagekeeper_durability_recovery_dropped_records (\S+)$", metrics, re.M
        )
        assert dropped and float(dropped.group(1)) == 3
        # The valid prefix is served: the scheduler's last steps before the damage exist.
        clients = server.http().get("/v1/clients").json()
        assert 0 < clients[0]["last_step_id"] < last_step
    finally:
        server.stop()


def test_a_second_instance_on_the_same_data_dir_is_refused(tmp_path):
    server = launch(tmp_path)
    try:
        out = _serve(tmp_path / "data")
        assert out.returncode == 3
        assert f"in use by another pagekeeper (pid {server.pid})" in out.stderr
    finally:
        server.stop()


def test_another_pool_configuration_is_refused(tmp_path):
    workdir, _ = _fill(tmp_path)
    out = _serve(workdir / "data", "--num-pages", "77")
    assert out.returncode == 3 and "another pool configuration" in out.stderr


def test_durability_none_writes_nothing_and_bad_levels_are_config_errors(tmp_path):
    server = launch(tmp_path, "--durability", "none")
    try:
        Scheduler(server).admit("n", list(range(10)))
        durability = server.http().get("/v1/pool").json()["durability"]
        assert durability["level"] == "none" and durability["data_dir"] is None
        assert durability["last_seq"] == 0 and durability["journal_segments"] == 0
    finally:
        server.stop()
    assert not (tmp_path / "data").exists()
    with pytest.raises(ServerStartError, match=r"server\.durability"):
        launch(tmp_path / "bad", "--durability", "sometimes")


def test_restart_keeps_state_and_applies_new_limits(tmp_path):
    """Graceful stop + start with a longer lease: everything is back, the change is logged."""
    server = launch(tmp_path, "--lease-ttl-s", "5")
    sched = Scheduler(server)
    sched.admit("keep", list(range(70)))
    pages = server.http().get("/v1/requests/keep").json()
    assert server.stop() == 0
    server = launch(tmp_path, "--lease-ttl-s", "7")
    try:
        assert server.http().get("/v1/requests/keep").json() == pages
        assert "limits changed" in server.logs() and "get a fresh lease" in server.logs()
        clients = server.http().get("/v1/clients").json()
        assert [c["client_id"] for c in clients] == [sched.client_id]
    finally:
        server.stop()


def test_stale_ring_files_of_a_dead_predecessor_are_removed(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = shm / "pagekeeper-shm-999999-18ed7904e540c92b-0"
    foreign = shm / "not-ours"
    mine = shm / f"pagekeeper-shm-{os.getpid()}-1-0"
    for path in (stale, foreign, mine):
        path.write_bytes(b"x")
    first = Durability.open(tmp_path / "data", "process")
    for path in (stale, foreign, mine):
        first.track_ring(str(path))
    first.close()
    second = Durability.open(tmp_path / "data", "process")
    try:
        assert second.stale_ring_files == (str(stale),)
        assert not stale.exists() and foreign.exists() and mine.exists()
        assert (tmp_path / "data" / "rings.txt").read_text() == ""
    finally:
        second.close()


def test_a_failed_log_write_stops_the_service(tmp_path):
    """Serving, the log becomes unwritable: the call that hit it is not acknowledged
    (INTERNAL), the next change is refused, readiness drops and ``serve`` returns with
    ``runtime.fatal`` set (``pagekeeper serve`` then exits 4)."""
    settings = Settings(
        grpc_address="127.0.0.1:0",
        http_address="127.0.0.1:0",
        data_dir=str(tmp_path / "data"),
        publish_transport="none",
    )
    durability = Durability.open(settings.data_dir, "process")
    runtime = build_runtime(settings, durability=durability)
    ready = tmp_path / "ready.json"

    async def scenario() -> list[grpc.StatusCode]:
        server = asyncio.create_task(serve(settings, ready_file=str(ready), runtime=runtime))
        while not ready.exists():
            await asyncio.sleep(0.01)
        address = json.loads(ready.read_text())["grpc_address"]
        codes = []
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.PagekeeperServiceStub(channel)
            reply = await stub.RegisterClient(
                pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER)
            )
            journal_files.lose_the_disk(durability._log)  # under the service
            for step_id in (1, 2):
                request = pb.StepRequest(
                    client_id=reply.client_id,
                    generation=reply.generation,
                    step_id=step_id,
                    admissions=[pb.Admission(request_id=f"x{step_id}", token_ids=i32(range(9)))],
                )
                try:
                    await stub.Step(request)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
        await asyncio.wait_for(server, 30)
        return codes

    codes = asyncio.run(scenario())
    assert codes[0] == grpc.StatusCode.INTERNAL
    # Refused by the fenced state, or, when it reaches a server already stopping, refused
    # (UNAVAILABLE) or cut off (CANCELLED) by gRPC: never acknowledged either way.
    assert codes[1] in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
    )
    assert runtime.fatal and "cannot append record" in runtime.fatal
    assert not runtime.is_ready
    # What was durable comes back: the registration, not the unacknowledged step.
    again, recovered = ServiceState(settings.pool), Durability.open(settings.data_dir, "process")
    try:
        recovered.recover(again)
        assert len(again.clients()) == 1 and again.request_ids() == []
    finally:
        recovered.close()
