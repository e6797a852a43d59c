"""The example scheduler and workers: end to end across processes, and their checks."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagekeeper_client import PagekeeperClient
from pagekeeper_client.examples import scheduler as example_scheduler
from pagekeeper_client.examples.worker import ExampleWorker
from pagekeeper_client.ring import TorchTables
from pagekeeper_client.types import GroupInfo, GroupKind, PoolConfig
from pagekeeper_client.worker import WorkerTables
from tests.helpers.server import ROOT, clean_env


def _spawn(module: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=clean_env(),
        )


def _wait(process: subprocess.Popen[bytes], log: Path, timeout: float) -> int:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
        raise AssertionError(f"{log.name} did not finish\n{log.read_text()[-3000:]}") from None


def test_scheduler_and_two_checking_workers(server_factory, tmp_path):
    """The example scheduler publishes every step; two workers with different kernel block
    sizes read the same batches and their paged attention equals dense attention. Twice
    against one service: the second pair's workers start with empty KV caches while the
    prefix cache still names the first pair's pages (they read NaN there until a fresh
    worker's registration made the service forget them)."""
    server = server_factory("--num-pages", "72", "--max-model-len", "1024", publish_transport="shm")
    for run in ("first", "second"):
        _run_checked_pair(server, tmp_path / run)


def _run_checked_pair(server, tmp_path: Path) -> None:
    tmp_path.mkdir()
    feed_file = tmp_path / "feed"
    workers = []
    for name, backend in (("w16", "0=REF:16"), ("w8", "0=8,128")):
        log = tmp_path / f"{name}.log"
        workers.append(
            (
                _spawn(
                    "pagekeeper_client.examples.worker",
                    "--address", server.grpc_address,
                    "--feed-file", str(feed_file),
                    "--backend", backend,
                    "--check",
                    "--name", name,
                    "--summary-json", str(tmp_path / f"{name}.json"),
                    log=log,
                ),
                log,
            )
        )  # fmt: skip
    scheduler_log = tmp_path / "scheduler.log"
    scheduler = _spawn(
        "pagekeeper_client.examples.scheduler",
        "--address", server.grpc_address,
        "--feed-address", "127.0.0.1:0",
        "--feed-file", str(feed_file),
        "--wait-workers", "2",
        "--steps", "24",
        "--max-running", "12",
        "--admit-per-step", "3",
        "--system-len-min", "40",
        "--system-len-max", "120",
        "--summary-json", str(tmp_path / "scheduler.json"),
        log=scheduler_log,
    )  # fmt: skip
    assert _wait(scheduler, scheduler_log, 120) == 0, scheduler_log.read_text()[-3000:]
    for process, log in workers:
        assert _wait(process, log, 60) == 0, log.read_text()[-3000:]

    summary = json.loads((tmp_path / "scheduler.json").read_text())
    assert summary["steps"] == summary["published"] == 24
    assert summary["worker_failures"] == []
    assert summary["cached_tokens"] > 0 and summary["prefix_hit_rate"] > 0.3
    assert summary["preemptions"] > 0 and summary["readmitted"] > 0
    assert summary["rpcs_per_step"] < 1.2  # batched mode: one call per step
    reports = {}
    for name in ("w16", "w8"):
        report = json.loads((tmp_path / f"{name}.json").read_text())
        reports[name] = report
        assert report["failures"] == 0 and report["steps"] == 24
        assert report["rows_checked"] == report["rows"] > 0
        assert report["max_err"] < 1e-4
    assert reports["w16"]["kernel_block_sizes"] == [16]
    assert reports["w8"]["kernel_block_sizes"] == [8]
    assert reports["w16"]["rows"] == reports["w8"]["rows"]
    assert reports["w16"]["tokens"] == reports["w8"]["tokens"]


@pytest.mark.parametrize("mode", ["batched", "sync", "deferred"])
def test_example_scheduler_modes(server_factory, tmp_path, mode):
    server = server_factory("--num-pages", "48", "--max-model-len", "1024")
    out = tmp_path / "summary.json"
    status = example_scheduler.main(
        [
            "--address", server.grpc_address,
            "--feed-address", "",
            "--mode", "batched" if mode == "batched" else "sync",
            *(["--defer-page-ids"] if mode == "deferred" else []),
            "--steps", "60",
            "--max-running", "16",
            "--summary-json", str(out),
            "--log-level", "warning",
        ]
    )  # fmt: skip
    assert status == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 60 and summary["finished"] > 0 and summary["preemptions"] > 0
    assert summary["local_answers"] > summary["decoded_tokens"] / 2
    if mode == "batched":
        assert summary["sync_steps"] == 0 and summary["rpcs_per_step"] < 1.1
    else:
        assert summary["sync_steps"] > 0 and summary["rpcs_per_step"] > 1
    assert (summary["deferred_answers"] > 0) is (mode == "deferred")


def _worker(kernel_block_size: int, *, check: bool = True) -> ExampleWorker:
    pool = PoolConfig(
        num_pages=8,
        groups=(GroupInfo(0, GroupKind.FULL, 16),),
        enable_prefix_caching=True,
        hash_algorithm="sha256_cbor",
        max_model_len=128,
    )
    handle = SimpleNamespace(pool=pool, kernel_block_sizes=(kernel_block_size,), device="cpu")
    args = argparse.Namespace(
        num_kv_heads=2, num_q_heads=4, head_dim=8, seed=0, max_cache_mb=64, check=check,
        sample=2, tolerance=1e-4, step_timeout=1.0, log_every=1000,
    )  # fmt: skip
    return ExampleWorker(handle, args)  # type: ignore[arg-type]


def _tables(pages: list[list[int]], ratio: int, slots: list[int]) -> WorkerTables:
    rows = [[p * ratio + j for p in row for j in range(ratio)] for row in pages]
    width = max(len(r) for r in rows)
    block_table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    table = TorchTables(
        0,
        16 // ratio,
        block_table,
        torch.tensor([len(r) for r in rows], dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
    )
    return WorkerTables(1, 1, len(pages), (table,))


@pytest.mark.parametrize("wrong", [None, "ratio", "page"])
def test_worker_check_catches_a_wrong_table(wrong):
    """Two requests sharing their first page; the check passes on the right tables and
    fails when the expansion ratio is off by one or a row points at the wrong page."""
    worker = _worker(8)
    shared = list(range(100, 116))
    a, b = shared + [7, 8, 9, 10], shared + [11, 12, 13]
    worker.apply_metadata({"new": {"a": a, "b": b}})
    pages = [[3, 5], [3, 6]]
    # Step: a computes all 20 tokens; b hits the shared page and computes its last 3.
    slots = [3 * 16 + i for i in range(16)] + [5 * 16 + i for i in range(4)]
    slots += [6 * 16 + i for i in range(3)]
    ratio = 2
    if wrong == "ratio":
        ratio = 3  # kernel ids p*3+j where the cache holds p*2+j
    table_pages = [[3, 5], [3, 2]] if wrong == "page" else pages
    tables = _tables(table_pages, ratio, slots)
    problems: list[str] = []
    rows = [["a", 20, 20], ["b", 19, 3]]
    worker.attend(tables, rows, problems)
    if wrong is None:
        assert problems == []
        assert worker.stats.rows_checked == 2
    else:
        assert problems and "differs from dense" in problems[0]


def test_example_worker_exits_cleanly_on_sigterm(server_factory, tmp_path):
    """Without a feed it only logs the tables: it registers without ``fresh_kv_cache``,
    so the requests running meanwhile are not revoked (it writes no KV)."""
    server = server_factory("--num-pages", "32", publish_transport="shm")
    scheduler = PagekeeperClient(server.grpc_address)
    scheduler.register("scheduler")
    scheduler.admit("watched", list(range(40)))
    log = tmp_path / "worker.log"
    worker = _spawn(
        "pagekeeper_client.examples.worker",
        "--address", server.grpc_address,
        "--backend", "0=16",
        "--name", "sigterm-worker",
        log=log,
    )  # fmt: skip
    http = server.http()
    deadline = time.monotonic() + 60
    while not any(c["name"] == "sigterm-worker" for c in http.get("/v1/clients").json()):
        assert worker.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    time.sleep(0.3)  # inside its follow loop
    step = scheduler.step(batch=["watched"])
    assert step.is_published and not step.revoked_request_ids
    scheduler.close()
    worker.send_signal(signal.SIGTERM)
    assert _wait(worker, log, 20) == 0, log.read_text()
    assert not any(c["name"] == "sigterm-worker" for c in http.get("/v1/clients").json())
    assert os.path.getsize(log) > 0


def test_example_worker_without_a_scheduler_says_so_in_one_line(server_factory, tmp_path):
    """No scheduler at the feed address: after --feed-timeout the worker exits 1 with one
    line that names the address and the flag, unregistered, no traceback."""
    server = server_factory("--num-pages", "32", publish_transport="shm")
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    log = tmp_path / "worker.log"
    worker = _spawn(
        "pagekeeper_client.examples.worker",
        "--address", server.grpc_address,
        "--feed-address", address,
        "--feed-timeout", "1",
        "--name", "lonely-worker",
        log=log,
    )  # fmt: skip
    assert _wait(worker, log, 60) == 1, log.read_text()
    text = log.read_text()
    assert f"could not reach the scheduler's feed at {address} within 1s" in text
    assert "--feed-timeout" in text
    assert "Traceback" not in text
    clients = server.http().get("/v1/clients").json()
    assert not any(c["name"] == "lonely-worker" for c in clients)


def test_a_worker_replaced_mid_run_joins_and_checks_every_row(server_factory, tmp_path):
    """A worker killed mid-run and a new one started in its place (a container restart):
    its registration revokes the running requests (their KV is not in it), the scheduler
    takes it in at its next step (preempting what runs, resetting the prefix cache) and
    no longer waits for the dead one; every row the new worker checks holds (it read NaN
    or waited forever before), and the run completes."""
    server = server_factory("--num-pages", "96", "--max-model-len", "1024", publish_transport="shm")
    feed_file = tmp_path / "feed"

    def worker(name: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{name}.log"
        return _spawn(
            "pagekeeper_client.examples.worker",
            "--address", server.grpc_address,
            "--feed-file", str(feed_file),
            "--check",
            "--log-every", "10",
            "--name", name,
            "--summary-json", str(tmp_path / f"{name}.json"),
            log=log,
        ), log  # fmt: skip

    def wait_for(log: Path, text: str) -> None:
        deadline = time.monotonic() + 120
        while text not in log.read_text():
            assert scheduler.poll() is None, scheduler_log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)

    steady, doomed = worker("steady"), worker("doomed")
    scheduler_log = tmp_path / "scheduler.log"
    scheduler = _spawn(
        "pagekeeper_client.examples.scheduler",
        "--address", server.grpc_address,
        "--feed-file", str(feed_file),
        "--wait-workers", "2",
        "--steps", "0",
        "--duration", "300",
        "--max-running", "8",
        "--summary-json", str(tmp_path / "scheduler.json"),
        log=scheduler_log,
    )  # fmt: skip
    wait_for(doomed[1], " 20 steps")
    doomed[0].kill()
    doomed[0].wait(10)
    replacement = worker("replacement")
    wait_for(replacement[1], " 20 steps")
    assert "joined mid-run" in scheduler_log.read_text()
    scheduler.send_signal(signal.SIGTERM)
    assert _wait(scheduler, scheduler_log, 60) == 0, scheduler_log.read_text()[-3000:]
    for process, log in (steady, replacement):
        assert _wait(process, log, 60) == 0, log.read_text()[-3000:]
    summary = json.loads((tmp_path / "scheduler.json").read_text())
    assert summary["worker_failures"] == [] and summary["worker_joins"] == 1
    report = json.loads((tmp_path / "replacement.json").read_text())
    assert report["failures"] == 0 and 20 <= report["steps"] < summary["steps"]
    assert report["rows_checked"] == report["rows"] > 0
    metrics = server.http().get("/metrics").text
    assert "pagekeeper_kv_loss_revocations_total 0.0" not in metrics
