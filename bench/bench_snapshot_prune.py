#!/usr/bin/env python3
"""What registering a snapshot costs the appending thread (the event loop), measured in the
same run three ways: the records it covers as rows of the database (format 2, how every
record was kept until 2026-12-06) deleted inline (the log without its checkpoint thread: how
every registration worked until 2026-12-05) and by the checkpoint thread in batches; and the
records in journal segments (the service now), which go whole once a checkpoint has synced
the registration.

For each: a log of ``--records`` records of ``--size`` bytes, then the registration of a
snapshot covering them (timed), then appends every 2 ms for ``--seconds`` (their latency,
against the same appends before the registration; appends go to segments in all three).
Plain script::

    .venv/bin/python bench/bench_snapshot_prune.py [--records 10000] [--size 40000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "service"))

from pagekeeper.durability.log import CommandLog, DurabilityLevel, record_crc  # noqa: E402


def _appends(log: CommandLog, first: int, seconds: float, body: bytes) -> list[float]:
    times = []
    seq = first
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        log.append(seq, body)
        times.append(time.perf_counter() - started)
        seq += 1
        time.sleep(0.002)
    return sorted(times)


def _figures(times: list[float]) -> str:
    p99 = times[int(0.99 * (len(times) - 1))]
    return (
        f"p50 {statistics.median(times) * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us, "
        f"max {times[-1] * 1e3:.2f} ms ({len(times)} appends)"
    )


def run(mode: str, records: int, size: int, seconds: float) -> float:
    body = os.urandom(size)
    with tempfile.TemporaryDirectory() as directory:
        log = CommandLog(directory, DurabilityLevel.PROCESS)
        if mode != "rows, inline":
            log.start_background_checkpoints()
        if mode == "segments":
            for seq in range(1, records + 1):
                log.append(seq, body)
        else:
            # Format 2: the records as rows (one transaction per 500, as fast as it goes).
            for start in range(1, records + 1, 500):
                seqs = range(start, min(start + 500, records + 1))
                with log._write_lock:
                    log._db.executemany(
                        "INSERT INTO log (seq, crc, body) VALUES (?, ?, ?)",
                        [(seq, record_crc(seq, body), body) for seq in seqs],
                    )
        before = _appends(log, records + 1, seconds / 2, body)
        covered = records + len(before)
        snapshot = log.store_snapshot_file(covered, b"state")
        started = time.perf_counter()
        log.commit_snapshot_file(snapshot)
        registration = time.perf_counter() - started
        after = _appends(log, covered + 1, seconds, body)
        stats = log.checkpoint_stats
        print(f"{mode}: registration {registration * 1e3:.2f} ms")
        print(f"  appends before it: {_figures(before)}")
        print(f"  appends after it:  {_figures(after)}")
        if stats is not None and mode != "segments":
            print(f"  rows deleted by the thread meanwhile: {stats.num_pruned} of {records}")
        if mode == "segments":
            segments, size_left = log.journal_usage()
            print(f"  journal after it: {segments} segment(s), {size_left / 1e6:.1f} MB")
        log.close()
    return registration


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=40_000, help="bytes per record")
    parser.add_argument("--seconds", type=float, default=4.0, help="of appends after it")
    ns = parser.parse_args()
    print(f"{ns.records} records of {ns.size} bytes, then one snapshot registration")
    inline = run("rows, inline", ns.records, ns.size, ns.seconds)
    threaded = run("rows, checkpoint thread", ns.records, ns.size, ns.seconds)
    segments = run("segments", ns.records, ns.size, ns.seconds)
    print(
        f"registration on the appending thread: rows inline {inline * 1e3:.1f} ms, rows by "
        f"the thread {threaded * 1e3:.2f} ms, segments {segments * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
