"""An example worker: follows the steps a scheduler publishes and proves the tables right.

It registers with pagekeeper (device, kernel block sizes its "attention backends" support),
maps the published tables (shared memory, CUDA IPC or the WatchTables stream, whatever the
service describes) and, for every step the scheduler announces on its step feed
(:mod:`pagekeeper_client.examples.feed`):

1. writes the K/V of the step's scheduled tokens into its own paged KV cache at the
   published slots (``slot_mapping``);
2. computes attention for the whole batch through the published kernel block table
   (:class:`~pagekeeper_client.attention.ReferencePagedAttention`);
3. compares rows with dense attention over each request's contiguous K/V
   (``scaled_dot_product_attention``): a sample of rows, or every row with ``--check``,
   where any mismatch fails the run (exit status 1);
4. acknowledges the step and logs its latency (tables readable after the scheduler's step,
   attention time).

K/V are a deterministic function of each token's whole prefix (a chained hash of the token
ids), as in a real model: requests sharing a prefix share its K/V, which is what makes
sharing their pages correct, and a table pointing at any other page reads other values (or
NaN, which the cache holds where nothing was written).

    python -m pagekeeper_client.examples.worker --address 127.0.0.1:50051 \\
        --feed-address 127.0.0.1:7000 --backend 0=FLASH_ATTN:16,32 --check

Environment: PAGEKEEPER_GRPC_ADDRESS, PAGEKEEPER_TOKEN, PAGEKEEPER_FEED_ADDRESS,
PAGEKEEPER_FEED_TIMEOUT, PAGEKEEPER_WORKER_DEVICE, PAGEKEEPER_WORKER_BACKENDS (e.g.
"0=16,32;1=x16").
Exits cleanly on SIGTERM/SIGINT (unregisters first).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagekeeper_client.attention import ReferencePagedAttention, dense_attention
from pagekeeper_client.errors import PagekeeperError
from pagekeeper_client.examples._cli import base_parser
from pagekeeper_client.examples.feed import FeedClient, FeedClosed
from pagekeeper_client.ring import RingError
from pagekeeper_client.types import GroupKind, KernelBackend
from pagekeeper_client.worker import WorkerHandle, WorkerTables, register_worker

log = logging.getLogger("pagekeeper.example.worker")

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


class KVContent:
    """Deterministic Q/K/V for a token given the chained hash of its prefix."""

    def __init__(self, *, num_kv_heads: int, num_q_heads: int, head_dim: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        shape_kv = (num_kv_heads, head_dim)
        shape_q = (num_q_heads, head_dim)
        self._freq = {
            "k": 5 + 45 * torch.rand(shape_kv, generator=g, dtype=torch.float64),
            "v": 5 + 45 * torch.rand(shape_kv, generator=g, dtype=torch.float64),
            "q": 5 + 45 * torch.rand(shape_q, generator=g, dtype=torch.float64),
        }
        self._phase = {
            k: 2 * math.pi * torch.rand(v.shape, generator=g, dtype=torch.float64)
            for k, v in self._freq.items()
        }

    @staticmethod
    def extend_keys(keys: list[int], tokens: list[int]) -> None:
        """Chain-hash ``tokens[len(keys):]`` onto ``keys`` (FNV-1a over the prefix)."""
        h = keys[-1] if keys else _FNV_OFFSET
        for token in tokens[len(keys) :]:
            h = ((h ^ (token + 1)) * _FNV_PRIME) & _MASK64
            keys.append(h)

    def vectors(self, which: str, keys: np.ndarray[Any, Any]) -> torch.Tensor:
        u = torch.from_numpy((keys >> np.uint64(40)).astype(np.float64) / float(1 << 24))
        out = torch.sin(u[:, None, None] * self._freq[which] + self._phase[which])
        return out.to(torch.float32)


@dataclass
class RequestState:
    tokens: list[int]
    keys: list[int] = field(default_factory=list)

    def keys_array(self, stop: int) -> np.ndarray[Any, Any]:
        if len(self.keys) < stop:
            KVContent.extend_keys(self.keys, self.tokens)
        if len(self.keys) < stop:
            raise ValueError(f"{stop} positions asked for, {len(self.tokens)} tokens known")
        return np.asarray(self.keys[:stop], dtype=np.uint64)


@dataclass
class Stats:
    steps: int = 0
    rows: int = 0
    tokens: int = 0
    rows_checked: int = 0
    failures: int = 0
    max_err: float = 0.0
    wait_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        def p50(values: list[float]) -> float:
            return statistics.median(values) if values else 0.0

        return {
            "steps": self.steps,
            "rows": self.rows,
            "tokens": self.tokens,
            "rows_checked": self.rows_checked,
            "failures": self.failures,
            "max_err": self.max_err,
            "wait_ms_p50": p50(self.wait_ms),
            "attention_ms_p50": p50(self.compute_ms),
            "publish_to_read_ms_p50": p50(self.latency_ms),
        }


class ExampleWorker:
    def __init__(self, handle: WorkerHandle, args: argparse.Namespace) -> None:
        self.handle = handle
        self.args = args
        self.stop = threading.Event()
        self.stats = Stats()
        self.requests: dict[str, RequestState] = {}
        self.content = KVContent(
            num_kv_heads=args.num_kv_heads,
            num_q_heads=args.num_q_heads,
            head_dim=args.head_dim,
            seed=args.seed,
        )
        pool = handle.pool
        self.caches: dict[int, tuple[ReferencePagedAttention, int | None]] = {}
        for group in pool.groups:
            if group.kind not in (GroupKind.FULL, GroupKind.SLIDING_WINDOW):
                log.warning(
                    "group %d (%s): no reference attention for this kind; not checked",
                    group.group_id,
                    group.kind.value,
                )
                continue
            nbytes = pool.num_pages * group.page_size * args.num_kv_heads * args.head_dim * 8
            if nbytes > args.max_cache_mb * 2**20:
                raise SystemExit(
                    f"group {group.group_id}: a KV cache for {pool.num_pages} pages of "
                    f"{group.page_size} tokens needs {nbytes / 2**20:.0f} MiB > "
                    f"--max-cache-mb {args.max_cache_mb}"
                )
            cache = ReferencePagedAttention.for_pages(
                num_pages=pool.num_pages,
                page_size=group.page_size,
                kernel_block_size=handle.kernel_block_sizes[group.group_id],
                num_kv_heads=args.num_kv_heads,
                head_dim=args.head_dim,
                device=handle.device,
            )
            window = group.window if group.kind is GroupKind.SLIDING_WINDOW else None
            self.caches[group.group_id] = (cache, window)

    # -- one step ---------------------------------------------------------------------
    def apply_metadata(self, message: dict[str, Any]) -> None:
        for rid in message.get("finished", ()):
            self.requests.pop(rid, None)
        for rid, tokens in message.get("new", {}).items():
            self.requests[rid] = RequestState(list(tokens))
        for rid, tokens in message.get("append", {}).items():
            state = self.requests.get(rid)
            if state is None:
                raise RuntimeError(f"tokens appended to unknown request {rid!r}")
            state.tokens.extend(tokens)

    def run_step(self, message: dict[str, Any]) -> dict[str, Any]:
        step_seq = int(message["step_seq"])
        self.apply_metadata(message)
        started = time.perf_counter()
        tables = self.handle.view.wait(step_seq, timeout=self.args.step_timeout)
        readable_at = time.time()
        waited = time.perf_counter() - started
        rows = message["rows"]
        problems: list[str] = []
        if tables.num_reqs != len(rows):
            problems.append(f"{tables.num_reqs} published rows, the feed announced {len(rows)}")
        max_err = 0.0
        compute_started = time.perf_counter()
        if not problems and rows:
            max_err = self.attend(tables, rows, problems)
        compute = time.perf_counter() - compute_started
        stats = self.stats
        stats.steps += 1
        stats.rows += len(rows)
        stats.tokens += sum(int(r[2]) for r in rows)
        stats.max_err = max(stats.max_err, max_err)
        stats.wait_ms.append(1e3 * waited)
        stats.compute_ms.append(1e3 * compute)
        latency = 1e3 * (readable_at - float(message.get("sent_at", readable_at)))
        stats.latency_ms.append(latency)
        ok = not problems
        if not ok:
            stats.failures += 1
            for problem in problems[:5]:
                log.error("step %d: %s", step_seq, problem)
        log.debug(
            "step %d: %d rows, tables readable %.3f ms after publish (waited %.3f ms), "
            "attention %.1f ms, max err %.2e",
            step_seq,
            len(rows),
            latency,
            1e3 * waited,
            1e3 * compute,
            max_err,
        )
        if stats.steps % self.args.log_every == 0:
            summary = stats.as_dict()
            log.info(
                "%d steps: tables readable p50 %.3f ms after publish, attention p50 %.1f ms, "
                "max err %.2e, failures %d",
                stats.steps,
                summary["publish_to_read_ms_p50"],
                summary["attention_ms_p50"],
                stats.max_err,
                stats.failures,
            )
        return {"ok": ok, "max_err": max_err, "problems": problems[:5], "latency_ms": latency}

    def attend(self, tables: WorkerTables, rows: list[list[Any]], problems: list[str]) -> float:
        seq_lens = [int(r[1]) for r in rows]
        query_lens = [int(r[2]) for r in rows]
        states = [self.requests.get(str(r[0])) for r in rows]
        for r, state in zip(rows, states, strict=True):
            if state is None:
                problems.append(f"row {r[0]!r}: no tokens known for it")
        if problems:
            return 0.0
        keys = np.concatenate(
            [
                s.keys_array(seq)[seq - q :]
                for s, seq, q in zip(states, seq_lens, query_lens, strict=True)
                if s is not None
            ]
        )
        content = self.content
        device = self.handle.device
        k = content.vectors("k", keys).to(device)
        v = content.vectors("v", keys).to(device)
        q = content.vectors("q", keys).to(device)
        sample = self.sample_rows(len(rows))
        max_err = 0.0
        for group_id, (cache, window) in self.caches.items():
            table = tables.table(group_id)
            if table.slot_mapping.shape[0] != keys.shape[0]:
                problems.append(
                    f"group {group_id}: {table.slot_mapping.shape[0]} slots for "
                    f"{keys.shape[0]} scheduled tokens"
                )
                continue
            cache.write_kv(table.slot_mapping, k, v)
            out = cache.paged_attention(
                q,
                table.block_table,
                seq_lens,
                query_lens,
                row_lengths=table.row_lengths.tolist(),
                sliding_window=window,
            )
            starts = np.concatenate([[0], np.cumsum(query_lens)])
            for i in sample:
                state = states[i]
                assert state is not None
                dense_keys = state.keys_array(seq_lens[i])
                ref = dense_attention(
                    q[starts[i] : starts[i + 1]],
                    content.vectors("k", dense_keys).to(device),
                    content.vectors("v", dense_keys).to(device),
                    sliding_window=window,
                )
                got = out[starts[i] : starts[i + 1]]
                err = float((got - ref).abs().max()) if got.numel() else 0.0
                if not math.isfinite(err) or err > self.args.tolerance:
                    problems.append(
                        f"group {group_id} row {i} ({rows[i][0]}): paged attention differs "
                        f"from dense by {err:.3e}"
                    )
                    err = math.inf if not math.isfinite(err) else err
                max_err = max(max_err, err)
            self.stats.rows_checked += len(sample)
        return max_err

    def sample_rows(self, num_rows: int) -> list[int]:
        if self.args.check:
            return list(range(num_rows))
        count = min(self.args.sample, num_rows)
        step = max(num_rows // max(count, 1), 1)
        return list(range(0, num_rows, step))[:count]

    # -- loops ------------------------------------------------------------------------
    def follow_feed(self, feed: FeedClient) -> None:
        while not self.stop.is_set():
            try:
                message = feed.recv(timeout=0.5)
            except TimeoutError:
                continue
            except FeedClosed:
                log.info("the scheduler closed the feed")
                return
            kind = message.get("type")
            if kind == "end":
                log.info("the scheduler finished")
                return
            if kind != "step":
                continue
            try:
                outcome = self.run_step(message)
            except RingError as exc:
                self.stats.failures += 1
                log.error("step %s: %s", message.get("step_seq"), exc)
                outcome = {"ok": False, "problems": [str(exc)]}
            feed.ack(int(message["step_seq"]), **outcome)

    def follow_tables(self) -> None:
        """No feed: follow published steps and log their tables and latency only."""
        view = self.handle.view
        last = view.latest_step()
        while not self.stop.is_set():
            try:
                step_seq = view.wait_next(last, timeout=0.5)
            except RingError:
                continue
            started = time.perf_counter()
            tables = view.wait(step_seq, timeout=self.args.step_timeout)
            self.stats.steps += 1
            self.stats.rows += tables.num_reqs
            self.stats.wait_ms.append(1e3 * (time.perf_counter() - started))
            if self.stats.steps % self.args.log_every == 0:
                log.info("step %d: %d rows", step_seq, tables.num_reqs)
            last = step_seq


def parse_backends(specs: list[str]) -> dict[int, list[KernelBackend]]:
    """``["0=FLASH_ATTN:16,32", "1=x16"]`` -> backends per group."""
    out: dict[int, list[KernelBackend]] = {}
    for spec in specs:
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            group, _, backend = item.partition("=")
            if not backend:
                raise SystemExit(f"--backend {item!r}: expected GROUP=SPEC, e.g. 0=16,32")
            out.setdefault(int(group), []).append(KernelBackend.parse(backend))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = base_parser("pagekeeper_client.examples.worker", __doc__)
    p.add_argument(
        "--device",
        default=env.get("PAGEKEEPER_WORKER_DEVICE", "cpu"),
        help="where the KV cache and tables live: cpu or cuda:N",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[b] if (b := env.get("PAGEKEEPER_WORKER_BACKENDS")) else [],
        help="GROUP=[NAME:]SIZES, sizes like 16,32 or x16 (multiples); repeatable",
    )
    p.add_argument(
        "--feed-address",
        default=env.get("PAGEKEEPER_FEED_ADDRESS"),
        help="the scheduler's step feed, HOST:PORT (None: follow the tables without one)",
    )
    p.add_argument("--feed-file", help="read the feed address from this file (waits for it)")
    p.add_argument(
        "--feed-timeout",
        type=float,
        default=env.get("PAGEKEEPER_FEED_TIMEOUT", "300"),  # argparse parses it, as a flag
        help="seconds to wait for the scheduler's feed (file and connection)",
    )
    p.add_argument("--check", action="store_true", help="check every row; fail on mismatch")
    p.add_argument("--sample", type=int, default=2, help="rows checked per step otherwise")
    p.add_argument(
        "--tolerance", type=float, default=1e-4, help="largest error against dense attention"
    )
    p.add_argument("--num-kv-heads", type=int, default=2, help="the toy model's KV heads")
    p.add_argument("--num-q-heads", type=int, default=4, help="the toy model's query heads")
    p.add_argument("--head-dim", type=int, default=32, help="the toy model's head size")
    p.add_argument(
        "--max-cache-mb", type=int, default=1024, help="refuse a KV cache larger than this"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the toy model's K/V")
    p.add_argument("--name", default="", help="registration name (default example-worker:PID)")
    p.add_argument(
        "--step-timeout", type=float, default=30.0, help="seconds to wait for a step's tables"
    )
    p.add_argument("--log-every", type=int, default=50, help="log a line every N steps")
    p.add_argument("--summary-json", help="also write the summary here")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    return p.parse_args(argv)


def _feed_address(args: argparse.Namespace) -> str | None:
    if args.feed_address:
        return str(args.feed_address)
    if not args.feed_file:
        return None
    timeout = args.feed_timeout
    deadline = time.monotonic() + timeout
    while not os.path.exists(args.feed_file):
        if time.monotonic() > deadline:
            raise SystemExit(f"no feed address in {args.feed_file} after {timeout:g}s")
        time.sleep(0.05)
    with open(args.feed_file) as f:
        return f.read().strip()


def _connect_feed(address: str, name: str, args: argparse.Namespace) -> FeedClient:
    try:
        return FeedClient(address, name=name, is_check=args.check, timeout=args.feed_timeout)
    except OSError as exc:
        raise SystemExit(
            f"could not reach the scheduler's feed at {address} within {args.feed_timeout:g}s "
            f"({exc}); start the scheduler with the same --feed-address, or raise "
            "--feed-timeout"
        ) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    torch.set_num_threads(1)  # the reference attention is tiny; don't fight the scheduler
    name = args.name or f"example-worker:{os.getpid()}"
    try:
        handle = register_worker(
            args.address,
            args.device,
            parse_backends(args.backend) or None,
            token=args.token,
            name=name,
            # Only a worker that follows a scheduler's feed writes KV; one that only logs
            # the tables must not revoke the running requests or forget the prefix cache.
            fresh_kv_cache=bool(args.feed_address or args.feed_file),
        )
    except PagekeeperError as exc:
        log.error("could not register: %s", exc)
        return 1
    log.info(
        "registered %s on %s: kernel block sizes %s, ring %s (generation %d)",
        handle.client_id,
        handle.device,
        list(handle.kernel_block_sizes),
        handle.view.kind,
        handle.view.descriptor.generation,
    )
    worker = ExampleWorker(handle, args)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    signal.signal(signal.SIGINT, lambda *_: worker.stop.set())
    feed = None
    try:
        address = _feed_address(args)
        if address:
            feed = _connect_feed(address, name, args)
            worker.follow_feed(feed)
        else:
            worker.follow_tables()
    finally:
        if feed is not None:
            feed.close()
        handle.close()
    summary = worker.stats.as_dict()
    summary["name"] = name
    summary["kernel_block_sizes"] = list(handle.kernel_block_sizes)
    summary["ring_reopens"] = handle.view.num_reopens
    print(json.dumps(summary, indent=2))
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if worker.stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
