#!/usr/bin/env python3
"""Table publication: from a published batch to tables readable in the worker.

Batch: 256 requests x 1,024 kernel blocks (int32 block table, 1 MiB), row lengths, and a slot
mapping of 8,192 tokens (int64, 64 KiB): 1.07 MB per step. Rows, interleaved (A B C … A B C)
so machine drift hits every variant alike; median µs per step, ``x memcpy`` = variant /
baseline:

* ``memcpy``: plain numpy copies of the same three arrays into preallocated arrays (the
  baseline: the least a transport that moves the bytes once can cost);
* ``shm publish``: the service's write (validation + seqlock + copy into the ring);
* ``shm publish + read (copy)``: plus the worker's ``wait(copy=True)``: the slot copied into
  arrays the worker owns, seqlock re-checked, wrapped as torch tensors;
* ``shm publish + read (zero-copy)``: plus ``wait(copy=False)``: torch tensors over the
  mapped slot (the bytes cross once; on a GPU worker the one H2D copy reads them);
* ``stream pack + unpack``: the WatchTables path minus the network: ``pack_slot``,
  ``StreamTableView.feed`` + ``wait(copy=True)``, torch tensors.

The last rows measure the cross-process latency of the shm path: the service process
publishes, a worker process waiting in ``wait(step)`` returns the copied tables; the time
from the start of ``publish`` to the worker holding them (one monotonic clock), with the
worker still spinning, and after 5 ms idle (it sleeps in its backoff by then).

Goal (issue 4): the shared-memory path within 2x of memcpy. The path that makes the tables
readable in the worker moves the bytes once (the publish), like the baseline; a worker that
also wants a private copy pays a second memcpy, so that row sits near 2x by construction.

Run: ``.venv/bin/python bench/bench_publish.py [--iterations N]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client")]

from pagekeeper.core.types import BatchTables  # noqa: E402
from pagekeeper.publish import RingGeometry  # noqa: E402
from pagekeeper.publish.shm import ShmPublisher  # noqa: E402
from pagekeeper.publish.stream import StreamPublisher  # noqa: E402
from pagekeeper_client.transports import open_table_view, pack_slot  # noqa: E402
from pagekeeper_client.transports.stream import StreamTableView  # noqa: E402

NUM_REQS = 256
NUM_KBLOCKS = 1024
NUM_TOKENS = 8192
GEOMETRY = RingGeometry(
    depth=2,
    max_num_reqs=NUM_REQS,
    max_num_tokens=NUM_TOKENS,
    tables=((0, 16, NUM_KBLOCKS),),
)


def make_batch(rng: np.random.Generator) -> BatchTables:
    return BatchTables(
        group_id=0,
        kernel_block_size=16,
        block_table=rng.integers(0, 1 << 24, (NUM_REQS, NUM_KBLOCKS), dtype=np.int32),
        row_lengths=rng.integers(1, NUM_KBLOCKS + 1, NUM_REQS, dtype=np.int32),
        slot_mapping=rng.integers(0, 1 << 40, NUM_TOKENS, dtype=np.int64),
    )


def _reader(descriptor: Any, num_steps: int, conn: Any) -> None:
    """Worker process: wait for each step, note when its tables are in hand, acknowledge."""
    import torch  # noqa: F401  (imported before timing starts)

    view = open_table_view(descriptor)
    conn.send("ready")
    done = []
    try:
        for step in range(num_steps):
            tables = view.wait(step, timeout=30, copy=True).to_torch()
            done.append(time.perf_counter())
            del tables
            conn.send(step)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        raise
    conn.send(done)
    view.close()


def cross_process_latency(
    num_steps: int, batch: BatchTables, shm_dir: str, idle_seconds: float
) -> list[float]:
    """Publish step by step (each after the worker acknowledged the previous one and
    ``idle_seconds`` passed); return publish-start -> worker-has-tables per step."""
    publisher = ShmPublisher(GEOMETRY, shm_dir=shm_dir)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_reader, args=(publisher.descriptor(), num_steps, child))
    process.start()
    assert parent.recv() == "ready"
    starts = []
    for step in range(num_steps):
        if idle_seconds:
            time.sleep(idle_seconds)
        starts.append(time.perf_counter())
        publisher.publish(step, [batch])
        if not parent.poll(60):
            raise RuntimeError("the worker process did not acknowledge")
        ack = parent.recv()
        if ack != step:
            raise RuntimeError(f"worker failed: {ack}")
    done = parent.recv()
    process.join(30)
    publisher.close()
    return [d - s for s, d in zip(starts, done, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--latency-steps", type=int, default=300)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    batch = make_batch(rng)
    nbytes = batch.block_table.nbytes + batch.row_lengths.nbytes + batch.slot_mapping.nbytes
    dst = [np.empty_like(a) for a in (batch.block_table, batch.row_lengths, batch.slot_mapping)]
    shm_dir = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    shm = ShmPublisher(GEOMETRY, shm_dir=shm_dir)
    shm_view = open_table_view(shm.descriptor())
    stream = StreamPublisher(GEOMETRY, generation=shm.generation)
    stream_view = StreamTableView(stream.descriptor())
    counter = {"shm": 0, "stream": 0}

    def memcpy() -> None:
        np.copyto(dst[0], batch.block_table)
        np.copyto(dst[1], batch.row_lengths)
        np.copyto(dst[2], batch.slot_mapping)

    def shm_publish() -> None:
        counter["shm"] += 1
        shm.publish(counter["shm"], [batch])

    def shm_read_copy() -> None:
        counter["shm"] += 1
        shm.publish(counter["shm"], [batch])
        shm_view.wait(counter["shm"], timeout=1, copy=True).to_torch()

    def shm_read_zero_copy() -> None:
        counter["shm"] += 1
        shm.publish(counter["shm"], [batch])
        shm_view.wait(counter["shm"], timeout=1, copy=False).to_torch()

    def stream_round_trip() -> None:
        counter["stream"] += 1
        payload = pack_slot(counter["stream"], stream.generation, [batch])
        stream_view.feed(payload)
        stream_view.wait(counter["stream"], timeout=1, copy=True).to_torch()

    variants: list[tuple[str, Callable[[], None]]] = [
        ("memcpy (baseline)", memcpy),
        ("shm publish", shm_publish),
        ("shm publish + read (copy)", shm_read_copy),
        ("shm publish + read (zero-copy)", shm_read_zero_copy),
        ("stream pack + unpack (copy)", stream_round_trip),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(20):  # warm-up: page faults, allocator, torch import
        for _, fn in variants:
            fn()
    for _ in range(args.iterations):
        for name, fn in variants:
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    shm_view.close()
    shm.close()

    latencies = {
        "shm cross-process, worker spinning": cross_process_latency(
            args.latency_steps, batch, shm_dir, 0.0
        ),
        "shm cross-process, worker idle 5 ms": cross_process_latency(
            args.latency_steps // 3, batch, shm_dir, 0.005
        ),
    }

    base = statistics.median(samples["memcpy (baseline)"])
    print(
        f"table publication: {NUM_REQS} requests x {NUM_KBLOCKS} kernel blocks + "
        f"{NUM_TOKENS} slots = {nbytes / 1e6:.2f} MB per step, median of {args.iterations}"
    )
    print(f"{'variant':<40} {'median us':>10} {'x memcpy':>9} {'GB/s':>7}")
    for name, _ in variants:
        median = statistics.median(samples[name])
        print(
            f"{name:<40} {median * 1e6:>10.1f} {median / base:>9.2f} {nbytes / median / 1e9:>7.2f}"
        )
    print("publish start -> tables (copied, as tensors) in a worker process:")
    for name, latency in latencies.items():
        median = statistics.median(latency)
        p90 = sorted(latency)[int(0.9 * len(latency))]
        print(
            f"{name:<40} {median * 1e6:>10.1f} {median / base:>9.2f} "
            f"{nbytes / median / 1e9:>7.2f}   (p90 {p90 * 1e6:.1f} us)"
        )
    zero_copy = statistics.median(samples["shm publish + read (zero-copy)"]) / base
    copied = statistics.median(samples["shm publish + read (copy)"]) / base
    goal = "met" if zero_copy <= 2.0 else "NOT met"
    print(
        f"goal: shm path (publish + tables readable in the worker, zero-copy) within 2x "
        f"memcpy: {zero_copy:.2f}x, {goal}; with a private copy in the worker (two copies "
        f"by construction): {copied:.2f}x"
    )


if __name__ == "__main__":
    main()
