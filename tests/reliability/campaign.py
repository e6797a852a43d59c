"""Long reliability campaigns (``make crash``, ``make soak``, ``make fuzz``): the in-suite
tests' scenarios, run longer. Each prints its figures as JSON and keeps them in
``artifacts/reliability/campaign-<kind>.json`` (git-ignored) for docs/reliability.md.

    python -m tests.reliability.campaign crash [--crashes 50] [--seed 1]
    python -m tests.reliability.campaign soak  [--duration 300] [--schedulers 4] [--workers 3]
    python -m tests.reliability.campaign fuzz  [--inputs 2000] [--seed 1]

``crash``: CRASHES ``kill -9`` of a process writing the durable log (each followed by a
recovery compared, digest for digest, with a never-crashed twin; every fifth with the
newest journal segment and the WAL torn as a power loss leaves them), then CRASHES
``kill -9`` of the real service under load (acknowledged steps present, tables equal to the
schedulers' models, no page held twice, the workers' reference attention matching through
the recovered tables). ``soak``: the load test for DURATION seconds. ``fuzz``: INPUTS
random and mutated protobuf messages spread over every RPC (over gRPC, then again in frames
on the same-node socket), INPUTS/10 x 4 Steps with odd field values per pool kind (full,
hybrid; ``field_fuzz.py``), plus INPUTS damaged log records and snapshots fed to
recovery's decoders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "reliability"


def _crash(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tests.reliability.kill9 import run_campaign
    from tests.reliability.service_crash import run_service_crashes

    driver = run_campaign(
        workdir / "driver",
        seed=args.seed,
        crashes=args.crashes,
        pool="hybrid" if args.seed % 2 else "full",
        tear_every=5,
        max_acks=500,
    )
    print(f"log writer: {driver.crashes} kills, {driver.records} records", flush=True)
    service = run_service_crashes(workdir / "service", crashes=args.crashes, seed=args.seed)
    return {
        "log_writer_kills": driver.crashes,
        "log_writer_records": driver.records,
        "log_writer_torn": driver.torn,
        "acknowledged_records_lost": driver.lost_acked,
        "service_kills": service.crashes,
        "service_acked_steps": service.acked_steps,
        "service_answer_lost_kills": service.answer_lost_kills,
        "steps_retried_from_memory": service.retried_from_memory,
        "steps_reapplied_after_restart": service.reapplied_after_crash,
        "tables_checked": service.requests_checked,
        "attention_steps_checked": service.attention_steps,
        "attention_rows_checked": service.attention_rows,
        "max_attention_error": service.max_attention_error,
        "restart_seconds_p50": float(np.median(service.restart_seconds)),
        "pages_lost": service.pages_lost,
        "seconds": driver.seconds + service.seconds,
    }


def _soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tests.reliability.load import run_load

    result = run_load(
        workdir / "soak",
        duration=args.duration,
        num_schedulers=args.schedulers,
        num_workers=args.workers,
        warmup=min(10.0, args.duration / 5),
    )
    figures = dataclasses.asdict(result)
    figures["steps_per_second"] = result.steps_per_second
    pages = result.pages_after
    problems = list(result.errors)
    if pages.get("num_used_pages") != 0 or pages["num_free_pages"] != pages["num_pages"] - 1:
        problems.append(f"pages not all free after the drain: {pages}")
    if result.fds_end > result.fds_start + 4:
        problems.append(f"file descriptors grew {result.fds_start} -> {result.fds_end}")
    figures["problems"] = problems
    return figures


def _fuzz(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from pagekeeper.durability.commands import RecordDecodeError, decode_command, encode_command
    from pagekeeper.durability.snapshot import SnapshotError, decode_snapshot, encode_snapshot
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
    from tests.helpers.grpc_util import Scheduler
    from tests.helpers.server import launch
    from tests.reliability.field_fuzz import run_field_fuzz
    from tests.reliability.fuzz import SERVICE, _mutate, run_rpc_fuzz
    from tests.reliability.workload import Workload, new_state

    sockdir = tempfile.mkdtemp(prefix="pk-fuzz-")
    server = launch(
        workdir / "fuzz",
        "--local-socket",
        os.path.join(sockdir, "step.sock"),
        "--num-pages",
        "128",
        "--max-model-len",
        "512",
        "--max-message-bytes",
        str(256 * 1024),
        "--max-clients",
        "200",
        "--lease-ttl-s",
        "3600",
        "--max-lease-ttl-s",
        "3600",
        "--debug-invariants",
    )
    try:
        Scheduler(server, "victim").admit("v-a", list(range(64)))
        worker = server.stub().RegisterClient(
            pb.RegisterClientRequest(role=pb.CLIENT_ROLE_WORKER, device="cpu")
        )
        per_rpc = max(1, args.inputs // len(SERVICE.methods))
        rpc = run_rpc_fuzz(server, worker, inputs_per_rpc=per_rpc, seed=args.seed, check_every=3)
        local = run_rpc_fuzz(
            server,
            worker,
            inputs_per_rpc=per_rpc,
            seed=args.seed + 1,
            check_every=3,
            transport="local",
        )
        assert server.is_running()
    finally:
        server.stop()
        shutil.rmtree(sockdir, ignore_errors=True)

    # Well-formed steps with odd field values, in process (full and hybrid pools).
    fields = [
        run_field_fuzz(seed=args.seed + k, rounds=max(1, args.inputs // 10), hybrid=bool(k))
        for k in (0, 1)
    ]
    problems = [p for f in fields for p in f["problems"]]
    assert not problems, "mutated Step fields: " + "; ".join(problems[:5])

    # Recovery's decoders: damaged records and snapshots are refused as such, never crash.
    rng = np.random.default_rng(args.seed)
    state, workload = new_state(), Workload(args.seed)
    bodies = []
    for _ in range(200):
        command, result = workload.run_one(state)
        if not isinstance(result, Exception):
            bodies.append(encode_command(command, result))
    snapshot = encode_snapshot(state.snapshot_state())
    refused = decoded = 0
    for i in range(args.inputs):
        is_snapshot = i % 10 == 0
        base = snapshot if is_snapshot else bodies[int(rng.integers(len(bodies)))]
        data = _mutate(base, rng)
        try:
            decode_snapshot(data) if is_snapshot else decode_command(data)
            decoded += 1
        except (RecordDecodeError, SnapshotError):
            refused += 1
    return {
        "rpc_inputs_tried": rpc["inputs_tried"],
        "rpc_refused": rpc["refused"],
        "rpc_codes": rpc["codes"],
        "local_inputs_tried": local["inputs_tried"],
        "local_refused": local["refused"],
        "local_codes": local["codes"],
        "field_mutated_steps": sum(f["steps"] for f in fields),
        "field_mutated_refused": sum(f["refused"] for f in fields),
        "damaged_records_and_snapshots": args.inputs,
        "damaged_refused": refused,
        "damaged_still_decodable": decoded,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    crash = sub.add_parser("crash")
    crash.add_argument("--crashes", type=int, default=50)
    crash.add_argument("--seed", type=int, default=1)
    soak = sub.add_parser("soak")
    soak.add_argument("--duration", type=float, default=300.0)
    soak.add_argument("--schedulers", type=int, default=4)
    soak.add_argument("--workers", type=int, default=3)
    fuzz = sub.add_parser("fuzz")
    fuzz.add_argument("--inputs", type=int, default=2000)
    fuzz.add_argument("--seed", type=int, default=1)
    for p in (crash, soak, fuzz):
        p.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    run = {"crash": _crash, "soak": _soak, "fuzz": _fuzz}[args.kind]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"pagekeeper-{args.kind}-") as tmp:
        figures = run(args, args.workdir or Path(tmp))
    figures["campaign_seconds"] = time.monotonic() - started
    figures["date"] = time.strftime("%Y-%m-%d")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(figures, indent=2, sort_keys=True, default=str)
    (ARTIFACTS / f"campaign-{args.kind}.json").write_text(text)
    print(text)
    return 1 if figures.get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
