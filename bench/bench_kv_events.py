#!/usr/bin/env python3
"""What publishing KV events over ZeroMQ (``--kv-events-endpoint``) costs the service.

The publisher runs on the service's loop after each step: it turns the step's events into
vLLM's structs and msgpack-encodes them (``pagekeeper.kvevents``). This measures that work
against the step's own (``ServiceState.step``, the baseline, timed in the same loop) on a
full pool of 131,072 pages of 16 tokens, for two steps:

* ``admit 8x2000``: 8 new 2,000-token prompts (no hit; every page evicts a cached one): 8
  stored events of 125 pages and 2,000 token ids each, and the removals;
* the same prompts of a LoRA adapter with two 576-token images each (every page's
  ``extra_keys`` on the wire: the adapter's name, and the image on the pages it covers);
* ``decode 256``: 256 running requests one token each, 16 of them filling a page (16
  stored events of one page).

Each sample applies the step, then publishes with int hashes (vLLM's default) and with
whole digests, each timed alone, in alternating order (a subscriber is connected, so the
sends are real);
frees and fillers between samples are not timed. Printed: medians over ``--samples`` and
the ratios publish / step.

    .venv/bin/python bench/bench_kv_events.py [--samples 200]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[1]
for sub in ("service", "client"):
    sys.path.insert(0, str(ROOT / sub))

from pagekeeper.core.config import GroupConfig, PoolConfig  # noqa: E402
from pagekeeper.core.types import ExtraKeys, MultiModalKey  # noqa: E402
from pagekeeper.kvevents import KvEventPublisher  # noqa: E402
from pagekeeper.notify import ChangeNotifier  # noqa: E402
from pagekeeper.state import (  # noqa: E402
    Admission,
    ClientRole,
    Growth,
    Limits,
    RegisterCommand,
    ServiceState,
    StepCommand,
)

NUM_PAGES = 131_072
PAGE_SIZE = 16


class Bench:
    def __init__(self) -> None:
        self.state = ServiceState(
            PoolConfig(
                num_pages=NUM_PAGES, groups=(GroupConfig(page_size=PAGE_SIZE),), max_model_len=8192
            ),
            Limits(lease_ttl_s=3600.0, max_lease_ttl_s=3600.0),
        )
        self.client = self.state.register(
            RegisterCommand(now=0.0, role=ClientRole.SCHEDULER)
        ).client_id
        self.step_id = 0
        self.next_id = 0
        self.rng = np.random.default_rng(0)
        self.publishers = {
            fmt: KvEventPublisher(
                self.state, ChangeNotifier(), endpoint="tcp://127.0.0.1:0", hash_format=fmt
            )
            for fmt in ("int", "bytes")
        }
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.subs = []
        for publisher in self.publishers.values():
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.connect(publisher.endpoint)
            self.subs.append(sub)
        time.sleep(0.3)

    def step(self, **parts: object) -> float:
        self.step_id += 1
        command = StepCommand(
            now=0.0, client_id=self.client, generation=1, step_id=self.step_id, **parts
        )  # type: ignore[arg-type]
        started = time.perf_counter()
        self.state.step(command)
        return time.perf_counter() - started

    def publish_all(self) -> dict[str, float]:
        # Alternating which goes first: the first reads the step's events from cold caches.
        self.flip = not getattr(self, "flip", False)
        order = list(self.publishers.items())
        out = {}
        for fmt, publisher in order if self.flip else order[::-1]:
            started = time.perf_counter()
            publisher.publish_pending()
            out[fmt] = time.perf_counter() - started
        for sub in self.subs:  # keep the subscribers' queues short
            while sub.poll(0):
                sub.recv_multipart()
        return out

    def ids(self, n: int) -> list[str]:
        out = [f"r{self.next_id + i}" for i in range(n)]
        self.next_id += n
        return out

    def prompt(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 50_000, n, dtype=np.int32)

    def admit(self, ids: list[str], length: int, keyed: bool = False) -> float:
        return self.step(
            admissions=tuple(
                Admission(r, self.prompt(length), extra_keys=self.keys(r) if keyed else None)
                for r in ids
            )
        )

    @staticmethod
    def keys(request_id: str) -> ExtraKeys:
        """A LoRA request with two 576-token images (each page's event carries its keys)."""
        return ExtraKeys(
            lora_name="adapter-a",
            lora_path="/loras/a",
            mm_inputs=(
                MultiModalKey(f"{request_id}-image-0", 100, 576),
                MultiModalKey(f"{request_id}-image-1", 900, 576),
            ),
        )

    def close(self) -> None:
        for sub in self.subs:
            sub.close(linger=0)
        self.ctx.term()
        for publisher in self.publishers.values():
            publisher.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    bench = Bench()
    rows: dict[str, dict[str, list[float]]] = {}
    events: dict[str, list[int]] = {}
    try:
        # Fill the pool's cache so that every admission evicts.
        while bench.state.stats().num_cached_pages < NUM_PAGES - 2000:
            ids = bench.ids(8)
            bench.admit(ids, 2000)
            bench.step(frees=tuple(ids))
            bench.publish_all()

        for name, keyed in (("admit 8x2000", False), ("  LoRA+2 images", True)):
            rows[name] = {"step": [], "int": [], "bytes": []}
            events[name] = []
            for _ in range(args.samples):
                ids = bench.ids(8)
                before = bench.state.last_event_seq
                rows[name]["step"].append(bench.admit(ids, 2000, keyed))
                events[name].append(bench.state.last_event_seq - before)
                for fmt, t in bench.publish_all().items():
                    rows[name][fmt].append(t)
                bench.step(frees=tuple(ids))
                bench.publish_all()

        name = "decode 256"
        rows[name] = {"step": [], "int": [], "bytes": []}
        events[name] = []
        running = bench.ids(256)
        lengths = {}
        for k in range(16):  # staggered: 16 rows fill a page each step
            group = running[k::16]
            bench.admit(group, 1000 + k)
            lengths.update(dict.fromkeys(group, 1000 + k))
        bench.publish_all()
        for _ in range(min(args.samples, 400)):
            growths = tuple(
                Growth(r, 1, np.array([int(bench.rng.integers(50_000))], dtype=np.int32))
                for r in running
            )
            before = bench.state.last_event_seq
            rows[name]["step"].append(bench.step(growths=growths))
            events[name].append(bench.state.last_event_seq - before)
            for fmt, t in bench.publish_all().items():
                rows[name][fmt].append(t)
    finally:
        bench.close()

    print(
        f"KV events over ZeroMQ: publish cost vs the step itself ({args.samples} samples; "
        f"{platform.python_implementation()} {platform.python_version()})"
    )
    print(
        f"{'step':<14} {'events':>6} {'step p50':>9} {'int p50':>9} {'ratio':>6} "
        f"{'bytes p50':>10} {'ratio':>6}"
    )
    for name, r in rows.items():
        step = statistics.median(r["step"]) * 1e3
        as_int = statistics.median(r["int"]) * 1e3
        as_bytes = statistics.median(r["bytes"]) * 1e3
        print(
            f"{name:<14} {statistics.median(events[name]):>6.0f} {step:>7.3f}ms "
            f"{as_int:>7.3f}ms {as_int / step:>6.2f} {as_bytes:>8.3f}ms {as_bytes / step:>6.2f}"
        )
    print("ratio = publish p50 / step p50 (the step's own work, same loop, same run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
