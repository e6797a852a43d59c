#!/usr/bin/env python3
"""What each durability level costs per step.

In-process rows: three identical :class:`ServiceState` (131,072 pages of 16 tokens) receive
the same commands, one with no journal (``none``: the baseline), one appending to journal
segments (``process``: one ``write()`` a record), one also ``fdatasync``-ing each
(``fsync``); samples are interleaved (none, process, fsync, fsync, process, none, ...) so
machine drift hits all alike. A row's time is the whole ``state.step`` (validation,
allocation, encoding, commit); ``+process`` / ``+fsync`` are the medians' differences from
``none``; ``record`` is the encoded size of the step's log record.

RPC rows (``--rpc``, on by default): the same decode step through the real service started
once per level (``--durability none|process|fsync``), Step round trip p50 from one client,
interleaved the same way.

Snapshot and recovery rows: the state after the run, snapshotted (bytes, seconds) and
recovered from its log without the snapshot (records replayed per second).

    .venv/bin/python bench/bench_durability.py [--samples 200] [--quick] [--no-rpc]
        [--write-docs docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _services import decode_step_medians, order, services, tokens

from pagekeeper.core.config import PoolConfig
from pagekeeper.durability import Durability
from pagekeeper.durability.commands import encode_command
from pagekeeper.state import (
    Admission,
    Batch,
    ClientRole,
    GrowthColumns,
    HeartbeatCommand,
    Limits,
    RegisterCommand,
    ServiceState,
    StepCommand,
)

POOL = PoolConfig(num_pages=131072, max_model_len=8192)
LIMITS = Limits(lease_ttl_s=3600.0, max_lease_ttl_s=3600.0, max_requests_per_step=1024)
LEVELS = ("none", "process", "fsync")
DOC_START = "<!-- bench_durability:start -->"
DOC_END = "<!-- bench_durability:end -->"


class Lane:
    """One state at one level, fed by :class:`Scenario`."""

    def __init__(self, level: str, workdir: Path) -> None:
        self.level = level
        self.state = ServiceState(POOL, LIMITS)
        self.durability: Durability | None = None
        if level != "none":
            self.durability = Durability.open(workdir / level, level, snapshot_every=10**9)
            self.durability.recover(self.state)
            self.durability.attach(self.state)

    def close(self) -> None:
        if self.durability is not None:
            self.state.journal = None
            self.durability.close()


class Scenario:
    """Commands that every lane receives, built once per step."""

    def __init__(self, num_running: int) -> None:
        self.now = 1000.0
        self.step_id = 0
        self.num_running = num_running
        self.running: list[str] = []
        self.next_request = 0

    def register(self) -> RegisterCommand:
        return RegisterCommand(now=self.now, role=ClientRole.SCHEDULER, name="bench")

    def _step(self, **fields) -> StepCommand:
        self.step_id += 1
        self.now += 0.001
        return StepCommand(self.now, "scheduler-1", 1, self.step_id, **fields)

    def admit(self, n: int, length: int, shared: int = 0) -> StepCommand:
        admissions = []
        for _ in range(n):
            rid = f"r{self.next_request}"
            self.next_request += 1
            prompt = np.concatenate(
                [tokens(0, shared), tokens(self.next_request * 7919, length - shared)]
            )
            admissions.append(Admission(rid, prompt))
            self.running.append(rid)
        return self._step(admissions=tuple(admissions))

    def decode(self, batch: int) -> StepCommand:
        ids = self.running[:batch]
        # In column form, as PagekeeperClient sends a decode step.
        columns = GrowthColumns.decodes(ids, tokens(self.step_id, len(ids)))
        return self._step(growth_columns=columns, batch=Batch(tuple(ids)))

    def sched_step(self) -> StepCommand:
        """256 decodes + 4 admissions of 2,000 tokens (1,024 shared) + 4 frees."""
        frees = tuple(self.running[:4])
        self.running = self.running[4:]
        decoding = self.running[:256]
        columns = GrowthColumns.decodes(decoding, tokens(self.step_id, len(decoding)))
        admissions = []
        for _ in range(4):
            rid = f"r{self.next_request}"
            self.next_request += 1
            prompt = np.concatenate(
                [tokens(0, 1024), tokens(self.next_request * 7919, 2000 - 1024)]
            )
            admissions.append(Admission(rid, prompt))
        self.running += [a.request_id for a in admissions]
        return self._step(frees=frees, growth_columns=columns, admissions=tuple(admissions))

    def free_all(self) -> StepCommand:
        frees, self.running = tuple(self.running), []
        return self._step(frees=frees)


def measure_in_process(samples: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lanes = [Lane(level, Path(tmp)) for level in LEVELS]
        scenario = Scenario(256)

        def apply_all(command, times: list[list[float]] | None = None, i: int = 0) -> None:
            for k in order(i, 3):
                started = time.perf_counter()
                lanes[k].state.apply(command)
                if times is not None:
                    times[k].append(time.perf_counter() - started)

        apply_all(scenario.register())
        for _ in range(4):
            apply_all(scenario.admit(64, 200))

        def run(name: str, make: Callable[[], StepCommand], n: int, after=None) -> None:
            times: list[list[float]] = [[], [], []]
            sizes = []
            for i in range(n):
                command = make()
                sizes.append(len(encode_command(command)))
                apply_all(command, times, i)
                if after is not None:
                    apply_all(after())
            medians = [statistics.median(t) for t in times]
            rows.append(
                {
                    "name": name,
                    "none": medians[0],
                    "process": medians[1],
                    "fsync": medians[2],
                    "process_p99": float(np.percentile(times[1], 99)),
                    "fsync_p99": float(np.percentile(times[2], 99)),
                    "record_bytes": int(statistics.median(sizes)),
                }
            )
            print(f"  {name}: {[f'{m * 1e6:.0f} us' for m in medians]}", flush=True)

        run("decode step, 64 requests", lambda: scenario.decode(64), samples)
        run("decode step, 256 requests", lambda: scenario.decode(256), samples)
        run(
            "heartbeat",
            lambda: HeartbeatCommand(scenario.now, "scheduler-1", 1),  # type: ignore[return-value]
            samples,
        )
        apply_all(scenario.free_all())
        run(
            "admission step, 8 x 2,000 tokens",
            lambda: scenario.admit(8, 2000),
            max(10, samples // 8),
            after=scenario.free_all,
        )
        apply_all(scenario.admit(256, 64))
        run("sched step (core bench's)", scenario.sched_step, max(10, samples // 8))

        # Snapshot and recovery of the process lane's state.
        lane = lanes[1]
        assert lane.durability is not None
        num_records = lane.durability.last_seq
        started = time.perf_counter()
        lane.durability.snapshot(lane.state)
        snapshot_s = time.perf_counter() - started
        snapshot_bytes = lane.durability.stats.last_snapshot_bytes
        replay_dir = Path(tmp) / "fsync"
        lanes[2].close()
        fresh = ServiceState(POOL, LIMITS)
        again = Durability.open(replay_dir, "fsync")
        started = time.perf_counter()
        report = again.recover(fresh)
        replay_s = time.perf_counter() - started
        again.close()
        rows.append(
            {
                "name": "snapshot",
                "seconds": snapshot_s,
                "bytes": snapshot_bytes,
                "requests": len(lane.state.request_ids()),
                "records": num_records,
            }
        )
        rows.append(
            {
                "name": "replay",
                "seconds": replay_s,
                "records": report.num_replayed,
                "per_second": report.num_replayed / replay_s,
            }
        )
        lanes[0].close()
        lanes[1].close()
    return rows


def measure_rpc(samples: int) -> dict[str, float]:
    import grpc

    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc

    with tempfile.TemporaryDirectory() as tmp:
        args = [["--durability", level, "--data-dir", f"{tmp}/data-{level}"] for level in LEVELS]
        with services(Path(tmp), args) as infos:
            stubs = [
                pb_grpc.PagekeeperServiceStub(grpc.insecure_channel(info["grpc_address"]))
                for info in infos
            ]
            medians = decode_step_medians(stubs, samples)
    return dict(zip(LEVELS, medians, strict=True))


def _us(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def render(rows: list[dict], rpc: dict[str, float] | None, samples: int) -> str:
    lines = [
        "## Durability: what each level costs per step (`bench/bench_durability.py`)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}; {samples} interleaved "
        "samples per level (fewer for the admission rows). In-process: the whole "
        "`ServiceState.step` with no journal (`none`), journaled into segment files with "
        "one `write()` a record (`process`) and an `fdatasync` after it (`fsync`). "
        "p99 in brackets.",
        "",
        "| step | none | process | fsync | +process | +fsync | record |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "none" not in row:
            continue
        lines.append(
            f"| {row['name']} | {_us(row['none'])} | {_us(row['process'])} "
            f"({_us(row['process_p99'])}) | {_us(row['fsync'])} ({_us(row['fsync_p99'])}) | "
            f"{_us(row['process'] - row['none'])} | {_us(row['fsync'] - row['none'])} | "
            f"{row['record_bytes']:,} B |"
        )
    if rpc:
        lines += [
            "",
            "| Step round trip through the service (decode, 64 requests) | none | process | "
            "fsync | process / none | fsync / none |",
            "|---|---:|---:|---:|---:|---:|",
            f"| p50 | {_us(rpc['none'])} | {_us(rpc['process'])} | {_us(rpc['fsync'])} | "
            f"{rpc['process'] / rpc['none']:.2f}x | {rpc['fsync'] / rpc['none']:.2f}x |",
        ]
    snap = next(r for r in rows if r["name"] == "snapshot")
    replay = next(r for r in rows if r["name"] == "replay")
    lines += [
        "",
        f"Snapshot of the final state ({snap['requests']} running requests, 131,072 pages): "
        f"{snap['bytes'] / 1e6:.1f} MB in {_us(snap['seconds'])}. Recovery from the log alone "
        f"(no snapshot): {replay['records']:,} records replayed in {_us(replay['seconds'])} "
        f"({replay['per_second']:,.0f} records/s); `snapshot_every` (default 10,000) bounds "
        "it.",
    ]
    return "\n".join(lines)


def write_docs(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{DOC_START}\n{section}\n{DOC_END}"
    if DOC_START in text and DOC_END in text:
        head, rest = text.split(DOC_START, 1)
        _, tail = rest.split(DOC_END, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="40 samples")
    parser.add_argument("--no-rpc", action="store_true")
    parser.add_argument("--write-docs", type=Path, default=None)
    args = parser.parse_args()
    samples = 40 if args.quick else args.samples
    print("in process:", flush=True)
    rows = measure_in_process(samples)
    rpc = None if args.no_rpc else measure_rpc(samples)
    section = render(rows, rpc, samples)
    print()
    print(section)
    if args.write_docs:
        write_docs(args.write_docs, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
