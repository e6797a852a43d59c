#!/usr/bin/env python3
"""The headline of issue 3: one scheduling step end to end through the client and a real
service process, against vLLM 0.33's in-process ``KVCacheManager`` doing the same step in
the same run.

The step (the core benchmark's): 256 running requests decode one token each, 4 new
2,000-token prompts whose first 1,024 tokens are cached are admitted, 4 requests are freed
(the population stays at 256; pool of 131,072 pages of 16 tokens). Page hashes are known
before the step (vLLM computes them when a request arrives; pagekeeper's client sends them
as ``page_hashes``); ``--with-hashing`` adds rows where both sides hash inside the step.

pagekeeper rows (``PagekeeperClient`` + ``pagekeeper serve`` subprocess on loopback):

* ``batched, allocate_decodes``: ``free_later`` x4, one ``allocate_decodes`` for the 256
  decodes (no call; the ids that need a page come back, their pages with the step),
  ``admit(sync=False)`` x4, ``step(batch=...)``: one round trip.
* ``batched, allocate_decodes, no held decodes``: the same with ``hold_decodes=False``:
  every decode travels in the step (by default the client holds back the ~14 of every 16
  decodes that need no page and complete none; their tokens go with the request's next
  growth).
* ``batched, allocate_slots x256``: the same with one ``allocate_slots`` per decode
  (answered locally unless a page is needed, then queued).
* ``vLLM-shaped, sync crossings``: what vLLM's scheduler needs from its KV manager -- a
  decode that crosses into a new page asks at once (``allocate_slots(sync=True)``), each
  admission is answered at once (``admit()``), then the step publishes: 1 + crossings +
  admissions round trips.
* ``vLLM-shaped, deferred ids``: the same calls on a client with ``defer_page_ids`` (the
  pool's only scheduler): a crossing is answered "fits" at once from the pool's free-page
  bound and its page ids come with the step: 1 + admissions round trips.
* ``empty step``: a bare ``Step`` round trip (the transport floor).

``--local``: the service also listens on its same-node socket, and every mode runs twice in
the same run, over gRPC and over the socket (``PagekeeperClient``'s default when the
service advertises one), each with its own workload, all interleaved with vLLM.

vLLM runs in a subprocess of its side virtualenv (``/opt/vllm-anchor``, see
shared/VLLM_ANCHOR.md) driven over a pipe, one step per request, interleaved A B B A with
the pagekeeper samples so machine drift hits both alike. Medians; ratio = vLLM / pagekeeper
(> 1: pagekeeper faster).

The service runs with its default durability (``process``: every step journaled to SQLite
before it is answered) unless ``--durability none`` is given (no journal, like vLLM's
in-process manager). ``--no-defer`` runs it with ``--defer-caching=false`` (a step's
admissions cached before its answer, not after).

    .venv/bin/python bench/bench_e2e_step.py [--steps 60] [--with-hashing] [--no-vllm]
                                             [--durability none|process|fsync] [--local]
                                             [--no-defer]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
for _sub in ("client", "service"):
    if str(REPO_ROOT / _sub) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / _sub))

PAGE = 16
POOL_PAGES = 131_072
MAX_MODEL_LEN = 32_768
RUNNING = 256
PROMPT_LEN = 2_000
PREFIX_LEN = 1_024
NEW_PER_STEP = 4
MODES = ("decodes", "decodes_sent", "batched", "sync", "deferred")
MODE_NAMES = {
    "decodes": "batched, allocate_decodes",
    "decodes_sent": "batched, allocate_decodes, no held decodes",
    "batched": "batched, allocate_slots x256",
    "sync": "vLLM-shaped, sync crossings",
    "deferred": "vLLM-shaped, deferred ids",
}
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "/opt/vllm-anchor/bin/python")
VOCAB = 100_000


# ---------------------------------------------------------------------------------------------
# The workload (identical in both processes: everything comes from one seed)
# ---------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """256 initial requests, the shared prefix, ``4 * num_steps`` new prompts and the decode
    tokens of every step."""

    prefix: list[int]
    initial: list[list[int]]
    prompts: list[list[int]]
    decode_tokens: list[list[int]]

    @classmethod
    def make(cls, seed: int, num_steps: int) -> Workload:
        rng = random.Random(seed)

        def toks(n: int) -> list[int]:
            return [rng.randrange(1, VOCAB) for _ in range(n)]

        prefix = toks(PREFIX_LEN)
        initial = [toks(rng.randint(200, 1800)) for _ in range(RUNNING)]
        prompts = [prefix + toks(PROMPT_LEN - PREFIX_LEN) for _ in range(NEW_PER_STEP * num_steps)]
        decode = [toks(RUNNING) for _ in range(num_steps)]
        return cls(prefix, initial, prompts, decode)


# ---------------------------------------------------------------------------------------------
# vLLM side (runs under the side virtualenv's interpreter)
# ---------------------------------------------------------------------------------------------


def vllm_child(seed: int, num_steps: int, with_hashing: bool) -> None:
    """Build vLLM's KVCacheManager, prime it, then run one step per "step" line on stdin
    and answer its seconds on stdout."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import logging

    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    logging.getLogger("vllm").setLevel(logging.ERROR)
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(PAGE, sha256_cbor)
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=8, head_size=128, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=POOL_PAGES,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)],
    )
    manager = KVCacheManager(
        config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=PAGE,
        hash_block_size=PAGE,
        enable_caching=True,
        enable_kv_cache_events=True,
    )

    def request(rid: str, tokens: list[int]) -> Any:
        return Request(rid, tokens, SamplingParams(max_tokens=1 << 20), None, block_hasher=hasher)

    def admit(req: Any) -> None:
        blocks, num_hit, _ = manager.get_computed_blocks(req)
        if manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks) is None:
            raise RuntimeError("vLLM: pool too small")
        req.num_computed_tokens = req.num_tokens

    work = Workload.make(seed, num_steps)
    prime = request("prime", work.prefix + [1])
    admit(prime)
    manager.free(prime)
    running: deque[Any] = deque()
    for i, tokens in enumerate(work.initial):
        req = request(f"init{i}", tokens)
        admit(req)
        running.append(req)
    manager.take_events()
    _freeze_inputs()
    print("ready", flush=True)
    for count, line in enumerate(sys.stdin, start=1):
        if line.strip() != "step":
            break
        s = (count - 1) % num_steps
        new_ids = [f"s{count}_{j}" for j in range(NEW_PER_STEP)]
        prompts = work.prompts[NEW_PER_STEP * s : NEW_PER_STEP * (s + 1)]
        pre = [] if with_hashing else [request(r, t) for r, t in zip(new_ids, prompts, strict=True)]
        allocate_slots, free = manager.allocate_slots, manager.free
        t0 = time.perf_counter()
        for _ in range(NEW_PER_STEP):
            free(running.popleft())
        for req, token in zip(running, work.decode_tokens[s], strict=False):
            req.append_output_token_ids(token)
            if allocate_slots(req, 1) is None:
                raise RuntimeError("vLLM: pool too small")
            req.num_computed_tokens += 1
        for j in range(NEW_PER_STEP):
            req = request(new_ids[j], prompts[j]) if with_hashing else pre[j]
            admit(req)
            running.append(req)
        dt = time.perf_counter() - t0
        manager.take_events()
        print(f"{dt:.9f}", flush=True)


def _freeze_inputs() -> None:
    """Move everything built so far (the workload: millions of token ids in lists) out of
    the garbage collector's sight, in both processes alike. Otherwise each full collection
    the step's own allocations trigger walks the benchmark's inputs, which is not a cost of
    either KV manager (vLLM's engine freezes its start-up heap the same way)."""
    gc.collect()
    gc.freeze()


class VllmProcess:
    """The vLLM half, one step per call."""

    def __init__(self, seed: int, num_steps: int, with_hashing: bool) -> None:
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
        env.pop("PYTHONPATH", None)
        args = [VLLM_PYTHON, __file__, "--vllm-child", str(seed), str(num_steps)]
        if with_hashing:
            args.append("--with-hashing")
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"vLLM child failed to start ({line!r})")

    def step(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def vllm_available() -> bool:
    if os.environ.get("BENCH_NO_VLLM") or not Path(VLLM_PYTHON).exists():
        return False
    probe = subprocess.run(
        [VLLM_PYTHON, "-c", "import vllm.v1.core.kv_cache_manager"],
        capture_output=True,
        env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"),
        timeout=120,
    )
    return probe.returncode == 0


# ---------------------------------------------------------------------------------------------
# pagekeeper side
# ---------------------------------------------------------------------------------------------


class Server:
    """``pagekeeper serve`` on ephemeral loopback ports."""

    def __init__(
        self,
        durability: str | None = None,
        unix: bool = False,
        local: bool = False,
        num_sides: int = 1,
        defer: bool = True,
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="pk-bench-e2e-"))
        self.num_pages = POOL_PAGES * -(-num_sides // 6)
        grpc_address = f"unix:{self.workdir / 'grpc.sock'}" if unix else "127.0.0.1:0"
        ready = self.workdir / "ready.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEKEEPER_")}
        env["PAGEKEEPER_DATA_DIR"] = str(self.workdir / "data")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "service"), str(REPO_ROOT / "client")])
        self.log = open(self.workdir / "server.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "pagekeeper", "serve",
                "--grpc-address", grpc_address,
                "--http-address", "127.0.0.1:0",
                "--ready-file", str(ready),
                # Every pagekeeper side keeps ~16K pages running in the one pool: up to six
                # sides share vLLM's size (131,072 pages, its one side); more (every mode
                # over both transports: ten) get another 131,072 per six. A larger pool
                # than needed would slow pagekeeper's side (bigger index, colder caches).
                "--num-pages", str(self.num_pages),
                "--max-model-len", str(MAX_MODEL_LEN),
                "--publish-transport", "none",
                "--lease-ttl-s", "300",
                "--log-level", "warning",
                *(["--durability", durability] if durability else []),
                *([] if defer else ["--defer-caching=false"]),
                *(["--local-socket", str(self.workdir / "step.sock")] if local else []),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError((self.workdir / "server.log").read_text())
            time.sleep(0.02)
        self.address = json.loads(ready.read_text())["grpc_address"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class PkSide:
    """One client driving the step in one mode ("batched" or "sync")."""

    client: Any
    work: Workload
    mode: str
    with_hashing: bool
    hashes: list[list[bytes]]
    running: deque[str] = field(default_factory=deque)
    pending: dict[str, list[int]] = field(default_factory=dict)
    count: int = 0
    rpcs: list[int] = field(default_factory=list)
    crossings: list[int] = field(default_factory=list)

    def setup(self, tag: str) -> None:
        client = self.client
        client.admit(f"{tag}-prime", self.work.prefix + [1])
        client.free(f"{tag}-prime")
        for i, tokens in enumerate(self.work.initial):
            rid = f"{tag}-init{i}"
            client.admit(rid, tokens, sync=False)
            self.running.append(rid)
        client.step()
        self.tag = tag

    def step(self) -> float:
        client, work = self.client, self.work
        num_steps = len(work.decode_tokens)
        s = self.count % num_steps
        self.count += 1
        new_ids = [f"{self.tag}-s{self.count}_{j}" for j in range(NEW_PER_STEP)]
        prompts = work.prompts[NEW_PER_STEP * s : NEW_PER_STEP * (s + 1)]
        hashes = self.hashes[NEW_PER_STEP * s : NEW_PER_STEP * (s + 1)]
        sync = self.mode not in ("batched", "decodes", "decodes_sent")
        rpcs0 = client.stats.num_rpcs
        allocate_slots, admit = client.allocate_slots, client.admit
        crossings = 0
        t0 = time.perf_counter()
        client.free_later(*(self.running.popleft() for _ in range(NEW_PER_STEP)))
        if self.mode in ("decodes", "decodes_sent"):
            # The whole decode step in one call (no RPC): the ids that need a page come back.
            crossings = len(
                client.allocate_decodes(
                    list(self.running), work.decode_tokens[s][: len(self.running)]
                )
            )
        for rid, token in zip(
            self.running if self.mode in ("batched", "sync", "deferred") else (),
            work.decode_tokens[s],
            strict=False,
        ):
            got = allocate_slots(rid, 1, new_token_ids=(token,), sync=sync)
            if not got.is_local:
                crossings += 1
                if got.is_deferred:
                    continue
                if got.status.value == "no_capacity":
                    raise RuntimeError("pool too small")
        for j in range(NEW_PER_STEP):
            got = admit(
                new_ids[j],
                prompts[j],
                page_hashes=None if self.with_hashing else hashes[j],
                sync=sync,
            )
            if sync and not got.ok:
                raise RuntimeError(f"admission failed: {got}")
        batch = list(self.running) + new_ids
        result = client.step(batch=batch)
        dt = time.perf_counter() - t0
        if result.no_capacity:
            raise RuntimeError(f"no capacity: {result.no_capacity}")
        self.running.extend(new_ids)
        self.rpcs.append(client.stats.num_rpcs - rpcs0)
        self.crossings.append(crossings)
        return dt


def empty_step_sample(client: Any) -> Callable[[], float]:
    def sample() -> float:
        t0 = time.perf_counter()
        client.step()
        return time.perf_counter() - t0

    return sample


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="samples per row")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--with-hashing", action="store_true")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--durability", help="the service's durability (default: its own)")
    parser.add_argument(
        "--no-defer", action="store_true", help="cache admissions before answering (the A/B)"
    )
    parser.add_argument(
        "--unix", action="store_true", help="gRPC over a unix socket (same-node schedulers)"
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="the service's same-node socket (the client's unary calls skip gRPC)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}"
    )
    parser.add_argument("--json", help="write the raw medians here")
    parser.add_argument("--vllm-child", nargs=2, type=int, metavar=("SEED", "STEPS"))
    args = parser.parse_args(argv)
    if args.vllm_child:
        vllm_child(args.vllm_child[0], args.vllm_child[1], args.with_hashing)
        return 0

    from pagekeeper.core.hashing import hash_pages
    from pagekeeper_client import PagekeeperClient

    total = args.steps + args.warmup
    # Each pagekeeper side gets a workload of the same shape but its own tokens (the two
    # share one pool: identical prompts would hit each other's pages); vLLM gets the first.
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: choose from {','.join(MODES)}")
    # With --local every mode runs twice in the same run, over gRPC and over the socket.
    keys = [
        (f"{m}@{t}", m, t) for m in modes for t in (("grpc", "local") if args.local else ("grpc",))
    ]
    seeds = {m: args.seed + k for k, m in enumerate(MODES)}
    works = {
        key: Workload.make(seeds[mode] + (len(MODES) if transport == "local" else 0), total)
        for key, mode, transport in keys
    }
    hashes = {key: [hash_pages(p, PAGE) for p in w.prompts] for key, w in works.items()}
    _freeze_inputs()
    have_vllm = not args.no_vllm and vllm_available()
    flavours = [False, True] if args.with_hashing else [False]

    server = Server(
        args.durability, args.unix, args.local, num_sides=len(keys), defer=not args.no_defer
    )
    clients: list[Any] = []
    results: dict[str, Any] = {}
    try:
        rows: list[tuple[str, list[float], list[float] | None, PkSide | None]] = []
        for with_hashing in flavours:
            vllm = VllmProcess(args.seed, total, with_hashing) if have_vllm else None
            sides = {}
            for client in clients:  # the previous flavour's requests leave the pool
                client.close()
            for key, mode, transport in keys:
                client = PagekeeperClient(
                    server.address,
                    timeout=60,
                    defer_page_ids=mode == "deferred",
                    hold_decodes=mode != "decodes_sent",
                    local_socket="auto" if transport == "local" else None,
                )
                clients.append(client)
                client.register("scheduler", name=f"bench-{mode}-{transport}")
                assert client.transport == transport, (client.transport, transport)
                side = PkSide(client, works[key], mode, with_hashing, hashes[key])
                side.setup(f"{mode}{transport}{int(with_hashing)}")
                sides[key] = side
            samples: dict[str, list[float]] = {key: [] for key, _, _ in keys}
            samples["vllm"] = []
            for r in range(total):
                order = [key for key, _, _ in keys] + ["vllm"]
                if r % 2:
                    order.reverse()  # A B C C B A: drift hits every side alike
                for name in order:
                    if name == "vllm":
                        if vllm is not None:
                            samples["vllm"].append(vllm.step())
                    else:
                        samples[name].append(sides[name].step())
            if vllm is not None:
                vllm.close()
            cut = args.warmup
            suffix = " + hashing" if with_hashing else ""
            vl = samples["vllm"][cut:] or None
            for key, mode, transport in keys:
                label = f" ({'same-node socket' if transport == 'local' else 'gRPC'})"
                name = MODE_NAMES[mode] + suffix + (label if args.local else "")
                rows.append((name, samples[key][cut:], vl, sides[key]))
        floors = {}
        for client in clients[-len(keys) :]:
            if client.transport not in floors:
                floors[client.transport] = [empty_step_sample(client)() for _ in range(args.steps)]
    finally:
        for client in clients:
            client.close()
        server.close()

    print(
        f"One scheduling step: {RUNNING} decodes + {NEW_PER_STEP} admissions of {PROMPT_LEN} "
        f"tokens ({PREFIX_LEN} cached) + {NEW_PER_STEP} frees; pool "
        f"{server.num_pages:,} pages of "
        f"{PAGE}; medians of {args.steps} interleaved steps; service durability: "
        f"{args.durability or 'default (process)'}"
        f"{'; admissions cached before the answer' if args.no_defer else ''}; "
        + (
            "each mode over gRPC (TCP loopback) and over the same-node socket "
            "(`--local-socket`), interleaved.\n"
            if args.local
            else f"gRPC over {'a unix socket' if args.unix else 'TCP loopback'}.\n"
        )
    )
    print("| pagekeeper mode | pagekeeper e2e | RPCs / step | vLLM in-process | ratio (vLLM/pk) |")
    print("|---|---:|---:|---:|---:|")
    for name, pk, vl, side in rows:
        pk_med = statistics.median(pk)
        vl_med = statistics.median(vl) if vl else None
        rpcs = statistics.mean(side.rpcs[args.warmup :]) if side else 0.0
        ratio = f"{vl_med / pk_med:.2f}x" if vl_med else "—"
        print(
            f"| {name} | {fmt(pk_med)} | {rpcs:.1f} | {fmt(vl_med) if vl_med else '—'} | {ratio} |"
        )
        results[name] = {
            "pk_median_s": pk_med,
            "vllm_median_s": vl_med,
            "rpcs_per_step": rpcs,
            "crossings_per_step": statistics.mean(side.crossings[args.warmup :]) if side else 0,
        }
    for transport, floor in floors.items():
        floor_med = statistics.median(floor)
        label = "same-node socket" if transport == "local" else "gRPC"
        print(f"| empty step (transport floor, {label}) | {fmt(floor_med)} | 1.0 | — | — |")
        results[f"empty_step_s_{transport}"] = floor_med
    crossings = results[rows[0][0]]["crossings_per_step"]
    print(
        f"\nDecodes crossing into a new page per step: {crossings:.1f} of {RUNNING} "
        "(the only ones that need the service; the rest are answered locally)."
    )
    if not have_vllm:
        print("(vLLM not available: pagekeeper rows only.)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
