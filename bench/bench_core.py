#!/usr/bin/env python3
"""The core's hot paths, side by side with vLLM 0.33's own KV-cache core in the same run.

Rows (issue 2's benchmark list, minus hashing and tables, which have their own scripts):

* allocator micro: allocate + free 1, 16 and 128 pages; a prefix hit's touch + release of
  16 cached pages; allocation of 16 pages that are all cached (the eviction path);
* admission of a 2,000-token prompt whose first 1,024 tokens are cached;
* one scheduling step: 256 decodes (one token each) + 4 such admissions + 4 frees;
* prefix lookup for a 4,096-token prompt with a 50% hit;
* pool start-up time and memory at 64K, 1M and 4M pages (each in a fresh subprocess).

pagekeeper is driven through ``PagePool`` (allocator rows) and ``PageManager`` (the rest);
vLLM through ``BlockPool`` and ``KVCacheManager`` exactly as its scheduler calls them
(``get_computed_blocks`` + ``allocate_slots``, ``append_output_token_ids`` before a decode,
``free``). Both sides collect KV events (pagekeeper always does; vLLM with
``enable_kv_cache_events=True``), drained outside the timed regions. Admission, step and
lookup come in two flavours: with the page hashes already known (vLLM computes them when a
request arrives, before the scheduler sees it; pagekeeper accepts them as ``page_hashes``),
and including hashing the prompt (vLLM's ``Request`` construction vs pagekeeper from tokens).

The two sides run interleaved, A B B A A B …, each sample a batch of operations; the table
shows the median time per operation and ``ratio`` = vLLM / pagekeeper (> 1: pagekeeper is
faster). Only ratios mean anything: these machines drift ±30-50% between runs. Each row
starts from a collected heap and freezes the state both sides built for it (as servers
freeze their start-up heap), so no row pays for garbage collections over an earlier row's
leftovers.

Run with the project venv (pagekeeper rows only)::

    .venv/bin/python bench/bench_core.py

Side by side (vLLM's side virtualenv, shared/VLLM_ANCHOR.md)::

    VLLM_TARGET_DEVICE=cpu /opt/vllm-anchor/bin/python bench/bench_core.py \
        [--write-docs docs/benchmarks.md] [--quick] [--profile step]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
for _sub in ("client", "service"):
    if str(REPO_ROOT / _sub) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / _sub))

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from pagekeeper.core.config import GroupConfig, PoolConfig  # noqa: E402
from pagekeeper.core.hashing import hash_pages  # noqa: E402
from pagekeeper.core.manager import PageManager  # noqa: E402
from pagekeeper.core.pool import PagePool  # noqa: E402

PAGE = 16
POOL_PAGES = 65_536
Sample = Callable[[], float]  # runs one batch, returns seconds per operation


def vllm_available() -> bool:
    if os.environ.get("BENCH_NO_VLLM"):
        return False
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------------------------
# vLLM helpers
# ---------------------------------------------------------------------------------------


class VllmEnv:
    """Imports and builders for vLLM's core, loaded once."""

    def __init__(self) -> None:
        import logging

        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
            make_block_hash_with_group_id,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        logging.getLogger("vllm").setLevel(logging.ERROR)
        init_none_hash(sha256_cbor)
        self.BlockPool = BlockPool
        self.KVCacheManager = KVCacheManager
        self.Request = Request
        self.SamplingParams = SamplingParams
        self.key = make_block_hash_with_group_id
        self.hasher = get_request_block_hasher(PAGE, sha256_cbor)
        self.spec = FullAttentionSpec(
            block_size=PAGE, num_kv_heads=8, head_size=128, dtype=torch.float16
        )
        self.KVCacheConfig = KVCacheConfig
        self.KVCacheGroupSpec = KVCacheGroupSpec

    def block_pool(self, num_pages: int) -> Any:
        return self.BlockPool(num_pages, True, PAGE, enable_kv_cache_events=True)

    def manager(self, num_pages: int = POOL_PAGES, max_model_len: int = 32_768) -> Any:
        cfg = self.KVCacheConfig(
            num_blocks=num_pages,
            kv_cache_tensors=[],
            kv_cache_groups=[self.KVCacheGroupSpec(["layer0"], self.spec)],
        )
        return self.KVCacheManager(
            cfg,
            max_model_len=max_model_len,
            scheduler_block_size=PAGE,
            hash_block_size=PAGE,
            enable_caching=True,
            enable_kv_cache_events=True,
        )

    def request(self, rid: str, tokens: list[int]) -> Any:
        return self.Request(
            rid, tokens, self.SamplingParams(max_tokens=1 << 20), None, block_hasher=self.hasher
        )


def pk_manager(num_pages: int = POOL_PAGES, max_model_len: int = 32_768) -> PageManager:
    return PageManager(
        PoolConfig(
            num_pages=num_pages, groups=(GroupConfig(page_size=PAGE),), max_model_len=max_model_len
        )
    )


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 100_000) for _ in range(n)]


# ---------------------------------------------------------------------------------------
# Benchmarks: each returns (pagekeeper sample, vLLM sample or None)
# ---------------------------------------------------------------------------------------


def bench_alloc_free(n: int, venv: VllmEnv | None) -> tuple[Sample, Sample | None]:
    iters = {1: 4000, 16: 1000, 128: 200}[n]
    pool = PagePool(POOL_PAGES)

    def pk() -> float:
        allocate, free = pool.allocate, pool.free
        t0 = time.perf_counter()
        for _ in range(iters):
            pages = allocate(n)
            free(pages[::-1])
        return (time.perf_counter() - t0) / iters

    if venv is None:
        return pk, None
    bp = venv.block_pool(POOL_PAGES)

    def vl() -> float:
        get, free = bp.get_new_blocks, bp.free_blocks
        t0 = time.perf_counter()
        for _ in range(iters):
            blocks = get(n)
            free(reversed(blocks))
        return (time.perf_counter() - t0) / iters

    return pk, vl


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


def bench_touch(venv: VllmEnv | None) -> tuple[Sample, Sample | None]:
    """A prefix hit on 16 free cached pages (out of the free queue, ref +1), then release."""
    iters = 1000
    pool = PagePool(POOL_PAGES)
    pool.ensure_groups(1)
    pages = pool.allocate(16)
    pool.cache(
        0,
        pages,
        [_hash(i) for i in range(16)],
        parent_hash=None,
        token_ids=[],
        page_size=PAGE,
        lora_name=None,
    )
    pool.free(pages[::-1])
    # Spread them through the queue so touches remove from the middle, as real hits do.
    filler = pool.allocate(1000)
    pool.free(filler[::-1])

    def pk() -> float:
        touch, free = pool.touch, pool.free
        rev = pages[::-1]
        t0 = time.perf_counter()
        for _ in range(iters):
            touch(pages)
            free(rev)
        dt = (time.perf_counter() - t0) / iters
        pool.take_events()
        return dt

    if venv is None:
        return pk, None
    bp = venv.block_pool(POOL_PAGES)
    blocks = bp.get_new_blocks(16)
    for i, b in enumerate(blocks):
        bp._insert_block_hash(venv.key(_hash(i), 0), b, num_tokens=(i + 1) * PAGE)
    bp.free_blocks(reversed(blocks))
    bp.free_blocks(reversed(bp.get_new_blocks(1000)))

    def vl() -> float:
        touch, free = bp.touch, bp.free_blocks
        t0 = time.perf_counter()
        for _ in range(iters):
            touch(blocks)
            free(reversed(blocks))
        dt = (time.perf_counter() - t0) / iters
        bp.take_events()
        return dt

    return pk, vl


def bench_evict(venv: VllmEnv | None) -> tuple[Sample, Sample | None]:
    """Allocate 16 pages that are all cached: each is evicted (index + removed event)."""
    iters = 256
    num_pages = 16_385

    def fill_pk() -> PagePool:
        pool = PagePool(num_pages)
        pool.ensure_groups(1)
        pages = pool.allocate(num_pages - 1)
        pool.cache(
            0,
            pages,
            [_hash(i) for i in range(len(pages))],
            parent_hash=None,
            token_ids=[],
            page_size=PAGE,
            lora_name=None,
        )
        pool.free(pages[::-1])
        pool.take_events()
        return pool

    state: dict[str, Any] = {"pk": fill_pk()}

    def pk() -> float:
        pool = state["pk"]
        if pool.num_free_pages < iters * 16:
            pool = state["pk"] = fill_pk()
        allocate = pool.allocate
        t0 = time.perf_counter()
        for _ in range(iters):
            allocate(16)
        dt = (time.perf_counter() - t0) / iters
        pool.take_events()
        return dt

    if venv is None:
        return pk, None

    def fill_vl() -> Any:
        bp = venv.block_pool(num_pages)
        blocks = bp.get_new_blocks(num_pages - 1)
        for i, b in enumerate(blocks):
            bp._insert_block_hash(venv.key(_hash(i), 0), b, num_tokens=PAGE)
        bp.free_blocks(reversed(blocks))
        bp.take_events()
        return bp

    state["vl"] = fill_vl()

    def vl() -> float:
        bp = state["vl"]
        if bp.get_num_free_blocks() < iters * 16:
            bp = state["vl"] = fill_vl()
        get = bp.get_new_blocks
        t0 = time.perf_counter()
        for _ in range(iters):
            get(16)
        dt = (time.perf_counter() - t0) / iters
        bp.take_events()
        return dt

    return pk, vl


@dataclass
class Prompts:
    """Prompts sharing one cached prefix, with their page hashes precomputed."""

    prefix: list[int]
    tokens: list[list[int]] = field(default_factory=list)
    hashes: list[list[bytes]] = field(default_factory=list)


def make_prompts(seed: int, prefix_len: int, total_len: int, count: int) -> Prompts:
    rng = random.Random(seed)
    p = Prompts(prefix=rand_tokens(rng, prefix_len))
    for _ in range(count):
        toks = p.prefix + rand_tokens(rng, total_len - prefix_len)
        p.tokens.append(toks)
        p.hashes.append(hash_pages(toks, PAGE))
    return p


def _prime_pk(pm: PageManager, prefix: list[int]) -> None:
    pm.admit("prime", prefix + [1])  # caches the prefix's full pages
    pm.free("prime")
    pm.take_events()


def _prime_vl(venv: VllmEnv, mgr: Any, prefix: list[int]) -> None:
    req = venv.request("prime", prefix + [1])
    blocks, n, _ = mgr.get_computed_blocks(req)
    mgr.allocate_slots(req, req.num_tokens - n, n, blocks)
    mgr.free(req)
    mgr.take_events()


def bench_admit(venv: VllmEnv | None, with_hashing: bool) -> tuple[Sample, Sample | None]:
    iters = 10
    prompts = make_prompts(1, 1024, 2000, 400)
    pm = pk_manager()
    _prime_pk(pm, prompts.prefix)
    counter = {"pk": 0, "vl": 0}

    def pk() -> float:
        total = 0.0
        for _ in range(iters):
            i = counter["pk"] % len(prompts.tokens)
            counter["pk"] += 1
            toks = prompts.tokens[i]
            rid = f"a{counter['pk']}"
            if with_hashing:
                t0 = time.perf_counter()
                out = pm.admit(rid, toks)
                total += time.perf_counter() - t0
            else:
                h = prompts.hashes[i]
                t0 = time.perf_counter()
                out = pm.admit(rid, toks, page_hashes=h)
                total += time.perf_counter() - t0
            assert out is not None and out.num_cached_tokens >= 1024, out
            pm.free(rid)
        pm.take_events()
        return total / iters

    if venv is None:
        return pk, None
    mgr = venv.manager()
    _prime_vl(venv, mgr, prompts.prefix)

    def vl() -> float:
        total = 0.0
        for _ in range(iters):
            i = counter["vl"] % len(prompts.tokens)
            counter["vl"] += 1
            toks = prompts.tokens[i]
            rid = f"a{counter['vl']}"
            if with_hashing:
                t0 = time.perf_counter()
                req = venv.request(rid, toks)
                blocks, n, _ = mgr.get_computed_blocks(req)
                out = mgr.allocate_slots(req, req.num_tokens - n, n, blocks)
                total += time.perf_counter() - t0
            else:
                req = venv.request(rid, toks)
                t0 = time.perf_counter()
                blocks, n, _ = mgr.get_computed_blocks(req)
                out = mgr.allocate_slots(req, req.num_tokens - n, n, blocks)
                total += time.perf_counter() - t0
            assert out is not None and n >= 1024
            mgr.free(req)
        mgr.take_events()
        return total / iters

    return pk, vl


class StepWorkload:
    """256 running decodes; each step decodes all, admits 4 prompts (2,000 tokens, 1,024
    cached) and frees the 4 oldest requests, so the population stays at 256."""

    RUNNING = 256

    def __init__(self, seed: int, num_steps: int) -> None:
        rng = random.Random(seed)
        self.initial = [rand_tokens(rng, rng.randint(200, 1800)) for _ in range(self.RUNNING)]
        self.prompts = make_prompts(seed + 1, 1024, 2000, 4 * num_steps)
        self.decode_tokens = [
            [rng.randrange(1, 100_000) for _ in range(self.RUNNING)] for _ in range(num_steps)
        ]


def bench_step(
    venv: VllmEnv | None, with_hashing: bool, num_steps: int
) -> tuple[Sample, Sample | None]:
    work = StepWorkload(7, num_steps)
    pm = pk_manager(num_pages=131_072)
    _prime_pk(pm, work.prompts.prefix)
    pk_running: deque[str] = deque()
    for i, toks in enumerate(work.initial):
        pm.admit(f"init{i}", toks)
        pk_running.append(f"init{i}")
    pm.take_events()
    st = {"pk": 0, "vl": 0}

    def pk() -> float:
        s = st["pk"] % num_steps
        st["pk"] += 1
        toks = work.decode_tokens[s]
        allocate_decodes, admit, free = pm.allocate_decodes, pm.admit, pm.free
        running = list(pk_running)
        new_ids = [f"s{st['pk']}_{j}" for j in range(4)]
        new_toks = work.prompts.tokens[4 * s : 4 * s + 4]
        new_hashes = work.prompts.hashes[4 * s : 4 * s + 4]
        t0 = time.perf_counter()
        # The 256 decodes in one call (what the service does with a step's decodes).
        if None in allocate_decodes(running, toks).values():
            raise RuntimeError("pool too small")
        for j in range(4):
            if with_hashing:
                admit(new_ids[j], new_toks[j])
            else:
                admit(new_ids[j], new_toks[j], page_hashes=new_hashes[j])
        for _ in range(4):
            free(pk_running.popleft())
        dt = time.perf_counter() - t0
        pk_running.extend(new_ids)
        pm.take_events()
        return dt

    if venv is None:
        return pk, None
    mgr = venv.manager(num_pages=131_072)
    _prime_vl(venv, mgr, work.prompts.prefix)
    vl_running: deque[Any] = deque()
    for i, toks in enumerate(work.initial):
        req = venv.request(f"init{i}", toks)
        blocks, n, _ = mgr.get_computed_blocks(req)
        mgr.allocate_slots(req, req.num_tokens - n, n, blocks)
        req.num_computed_tokens = req.num_tokens
        vl_running.append(req)
    mgr.take_events()

    def vl() -> float:
        s = st["vl"] % num_steps
        st["vl"] += 1
        toks = work.decode_tokens[s]
        allocate_slots, get_computed, free = (
            mgr.allocate_slots,
            mgr.get_computed_blocks,
            mgr.free,
        )
        running = list(vl_running)
        new_ids = [f"s{st['vl']}_{j}" for j in range(4)]
        new_toks = work.prompts.tokens[4 * s : 4 * s + 4]
        pre = [] if with_hashing else [venv.request(new_ids[j], new_toks[j]) for j in range(4)]
        admitted = []
        t0 = time.perf_counter()
        for req, tok in zip(running, toks, strict=True):
            # update_from_output appends the sampled token (hashing a filled page) ...
            req.append_output_token_ids(tok)
            # ... and the next schedule() allocates its slot.
            if allocate_slots(req, 1) is None:
                raise RuntimeError("pool too small")
            req.num_computed_tokens += 1
        for j in range(4):
            req = venv.request(new_ids[j], new_toks[j]) if with_hashing else pre[j]
            blocks, n, _ = get_computed(req)
            allocate_slots(req, req.num_tokens - n, n, blocks)
            req.num_computed_tokens = req.num_tokens
            admitted.append(req)
        for _ in range(4):
            free(vl_running.popleft())
        dt = time.perf_counter() - t0
        vl_running.extend(admitted)
        mgr.take_events()
        return dt

    return pk, vl


def bench_lookup(venv: VllmEnv | None, with_hashing: bool) -> tuple[Sample, Sample | None]:
    iters = 20
    prompts = make_prompts(3, 2048, 4096, 50)
    pm = pk_manager()
    _prime_pk(pm, prompts.prefix)
    counter = {"pk": 0, "vl": 0}

    def pk() -> float:
        lookup = pm.lookup
        total = 0.0
        for _ in range(iters):
            i = counter["pk"] % len(prompts.tokens)
            counter["pk"] += 1
            toks = prompts.tokens[i]
            if with_hashing:
                t0 = time.perf_counter()
                res = lookup(toks)
            else:
                h = prompts.hashes[i]
                t0 = time.perf_counter()
                res = lookup(toks, page_hashes=h)
            total += time.perf_counter() - t0
            assert res.num_hit_tokens == 2048, res.num_hit_tokens
        return total / iters

    if venv is None:
        return pk, None
    mgr = venv.manager()
    _prime_vl(venv, mgr, prompts.prefix)
    reqs = [venv.request(f"l{i}", t) for i, t in enumerate(prompts.tokens)]

    def vl() -> float:
        get = mgr.get_computed_blocks
        total = 0.0
        for _ in range(iters):
            i = counter["vl"] % len(prompts.tokens)
            counter["vl"] += 1
            if with_hashing:
                t0 = time.perf_counter()
                req = venv.request(f"l{i}", prompts.tokens[i])
                _, n, _ = get(req)
            else:
                req = reqs[i]
                t0 = time.perf_counter()
                _, n, _ = get(req)
            total += time.perf_counter() - t0
            assert n == 2048, n
        return total / iters

    return pk, vl


# ---------------------------------------------------------------------------------------
# Start-up and memory, one fresh interpreter per measurement
# ---------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child_startup(side: str, num_pages: int) -> dict[str, float]:
    """Runs in a subprocess: build the pool, report seconds, RSS delta, traced bytes."""
    if side == "vllm":
        venv = VllmEnv()

        def build() -> Any:
            return venv.BlockPool(num_pages, True, PAGE, enable_kv_cache_events=True)
    elif side == "pk-pool":

        def build() -> Any:
            return PagePool(num_pages)
    else:

        def build() -> Any:
            return pk_manager(num_pages=num_pages, max_model_len=8192)

    gc.collect()
    gc.disable()  # vLLM's 4M objects would otherwise trigger many full collections
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    obj = build()
    seconds = time.perf_counter() - t0
    rss = _rss_bytes() - rss0
    gc.enable()
    del obj
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = build()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del obj
    return {"seconds": seconds, "rss": float(rss), "traced": float(traced)}


def run_startup(side: str, num_pages: int) -> dict[str, float]:
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, __file__, "--child-startup", side, str(num_pages)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    unit: str
    pk: float
    vllm: float | None
    target: str
    pk_all: list[float] = field(default_factory=list)
    vllm_all: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.vllm is None else self.vllm / self.pk


def interleave(
    pk: Sample, vl: Sample | None, rounds: int, warmup: int = 1
) -> tuple[list[float], list[float]]:
    for _ in range(warmup):
        pk()
        if vl is not None:
            vl()
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)  # A B B A: drift hits both alike
        for side in order:
            if side == 0:
                a.append(pk())
            elif vl is not None:
                b.append(vl())
    return a, b


def fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    if us < 10:
        return f"{us:.2f} µs"
    if us < 1000:
        return f"{us:.1f} µs"
    if us < 1e6:
        return f"{us / 1000:.2f} ms"
    return f"{us / 1e6:.2f} s"


def render(rows: list[Row], startup: list[dict[str, Any]], have_vllm: bool) -> str:
    lines = [
        "| benchmark | pagekeeper | vLLM 0.33 | ratio (vLLM / pk) | target |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        v = fmt_time(r.vllm) if r.vllm is not None else "—"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "—"
        lines.append(f"| {r.name} | {fmt_time(r.pk)} | {v} | {ratio} | {r.target} |")
    if startup:
        lines += [
            "",
            "| pool start-up | pagekeeper `PageManager` | pagekeeper `PagePool` "
            "| vLLM `BlockPool` | ratio (vLLM / PageManager) "
            "| pk bytes/page (traced, RSS) | vLLM bytes/page (traced, RSS) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for s in startup:
            n = s["num_pages"]
            v = s.get("vllm")
            ratio = f"{v['seconds'] / s['pk']['seconds']:.0f}x" if v else "—"
            vt = fmt_time(v["seconds"]) if v else "—"
            vb = f"{v['traced'] / n:.0f}, {v['rss'] / n:.0f}" if v else "—"
            pk, pool = s["pk"], s["pk-pool"]
            lines.append(
                f"| {n:,} pages | {fmt_time(pk['seconds'])} | {fmt_time(pool['seconds'])} "
                f"| {vt} | {ratio} | {pk['traced'] / n:.1f}, {pk['rss'] / n:.1f} | {vb} |"
            )
    if not have_vllm:
        lines.append("")
        lines.append("(vLLM not importable here: pagekeeper rows only.)")
    else:
        lines.append("")
        lines.append(target_summary(rows, startup))
    return "\n".join(lines)


def target_summary(rows: list[Row], startup: list[dict[str, Any]]) -> str:
    """One line per target of issue 2: met or missed, with the numbers."""
    missed = [r for r in rows if r.ratio is not None and r.ratio < 2.0]
    met = [r for r in rows if r.ratio is not None and r.ratio >= 2.0]
    out = [f"Targets: {len(met)} of {len(met) + len(missed)} rows at least 2x faster than vLLM"]
    if missed:
        out[0] += "; missed: " + ", ".join(f"{r.name} ({r.ratio:.2f}x)" for r in missed)
    big = [s for s in startup if s["num_pages"] >= 4_194_304 and s.get("vllm")]
    for s in big:
        ratio = s["vllm"]["seconds"] / s["pk"]["seconds"]
        out.append(
            f"{s['num_pages']:,}-page start-up {ratio:.0f}x faster than vLLM's BlockPool "
            f"(target >= 10x: {'met' if ratio >= 10 else 'MISSED'})"
        )
    for s in startup:
        per_page = s["pk"]["traced"] / s["num_pages"]
        out.append(
            f"{s['num_pages']:,} pages: {per_page:.1f} bytes/page traced "
            f"(target <= 32: {'met' if per_page <= 32 else 'MISSED'})"
        )
    return ".  \n".join(out) + "."


DOC_START = "<!-- bench_core:start -->"
DOC_END = "<!-- bench_core:end -->"
DOC_HEADER = """# Benchmarks

Each section below is written by one script in `bench/` (run it to refresh its section).
Numbers are **medians** of interleaved samples (A B B A …: pagekeeper and its baseline take
turns, so machine drift hits both alike). A **ratio** is baseline time / pagekeeper time
measured in the same run (> 1: pagekeeper is faster); absolute times on these shared 2-core
machines drift ±30-50% between runs, ratios much less. The vLLM baseline is vLLM 0.33.0's
own pure-Python core imported from a side virtualenv (`shared/VLLM_ANCHOR.md`), never a
project dependency.
"""


def write_docs(path: Path, body: str) -> None:
    text = path.read_text() if path.exists() else DOC_HEADER
    section = f"{DOC_START}\n{body}\n{DOC_END}"
    if DOC_START in text and DOC_END in text:
        pre, rest = text.split(DOC_START, 1)
        _, post = rest.split(DOC_END, 1)
        text = pre + section + post
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def profile_pk(name: str, rows_fn: dict[str, Callable[[], tuple[Sample, Sample | None]]]) -> str:
    pk, _ = rows_fn[name]()
    pk()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        pk()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="samples per side and row")
    ap.add_argument("--quick", action="store_true", help="fewer rounds, no 4M-page start-up")
    ap.add_argument("--only", help="comma-separated row keys (see --list)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--no-startup", action="store_true")
    ap.add_argument("--startup-sizes", default="65536,1048576,4194304")
    ap.add_argument("--profile", help="cProfile the pagekeeper side of one row key")
    ap.add_argument("--write-docs", help="replace this script's section in a markdown file")
    ap.add_argument("--json", help="also dump raw samples here")
    ap.add_argument("--child-startup", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child_startup:
        side, n = args.child_startup
        print(json.dumps(child_startup(side, int(n))))
        return 0

    have_vllm = vllm_available()
    venv = VllmEnv() if have_vllm else None
    rounds = 7 if args.quick else args.rounds
    steps = 2 * rounds + 4

    spec: dict[str, tuple[str, str, Callable[[], tuple[Sample, Sample | None]]]] = {
        "alloc1": ("allocate + free 1 page", "≥2x", lambda: bench_alloc_free(1, venv)),
        "alloc16": ("allocate + free 16 pages", "≥2x", lambda: bench_alloc_free(16, venv)),
        "alloc128": ("allocate + free 128 pages", "≥2x", lambda: bench_alloc_free(128, venv)),
        "touch": ("touch + release 16 cached pages (a hit)", "≥2x", lambda: bench_touch(venv)),
        "evict": ("allocate 16 cached pages (eviction path)", "≥2x", lambda: bench_evict(venv)),
        "admit": (
            "admit 2,000 tokens, 1,024 cached (hashes known)",
            "≥2x",
            lambda: bench_admit(venv, with_hashing=False),
        ),
        "admit_hash": (
            "admit 2,000 tokens, 1,024 cached (incl. hashing)",
            "≥2x",
            lambda: bench_admit(venv, with_hashing=True),
        ),
        "step": (
            "step: 256 decodes + 4 admissions + 4 frees (hashes known)",
            "≥2x",
            lambda: bench_step(venv, with_hashing=False, num_steps=steps),
        ),
        "step_hash": (
            "step: 256 decodes + 4 admissions + 4 frees (incl. hashing)",
            "≥2x",
            lambda: bench_step(venv, with_hashing=True, num_steps=steps),
        ),
        "lookup": (
            "prefix lookup 4,096 tokens, 50% hit (hashes known)",
            "≥2x",
            lambda: bench_lookup(venv, with_hashing=False),
        ),
        "lookup_hash": (
            "prefix lookup 4,096 tokens, 50% hit (incl. hashing)",
            "≥2x",
            lambda: bench_lookup(venv, with_hashing=True),
        ),
    }
    if args.list:
        for k, (name, _, _) in spec.items():
            print(f"{k:12s} {name}")
        return 0
    if args.profile:
        print(profile_pk(args.profile, {k: v[2] for k, v in spec.items()}))
        return 0

    keys = args.only.split(",") if args.only else list(spec)
    rows: list[Row] = []
    for key in keys:
        name, target, make = spec[key]
        # Each row starts from a clean heap and freezes what it built (both sides' pools,
        # managers, workloads), as a server freezes its start-up heap (vLLM's EngineCore,
        # pagekeeper serve): otherwise the collections a row's allocations trigger walk the
        # leftovers of earlier rows (vLLM's blocks form reference cycles and linger until a
        # full collection), which charges one side or the other at random.
        gc.collect()
        pk, vl = make()
        gc.freeze()
        a, b = interleave(pk, vl, rounds)
        gc.unfreeze()
        row = Row(
            name,
            "s",
            statistics.median(a),
            statistics.median(b) if b else None,
            target,
            a,
            b,
        )
        rows.append(row)
        ratio = f"{row.ratio:.2f}x" if row.ratio else "-"
        v = fmt_time(row.vllm) if row.vllm is not None else "-"
        print(f"{name:60s} pk {fmt_time(row.pk):>10s}  vllm {v:>10s}  ratio {ratio}", flush=True)

    startup: list[dict[str, Any]] = []
    if not args.no_startup and not args.only:
        sizes = [int(s) for s in args.startup_sizes.split(",")]
        if args.quick:
            sizes = [s for s in sizes if s <= 1_048_576]
        for n in sizes:
            reps = 3 if n <= 1_048_576 else 2
            got: dict[str, list[dict[str, float]]] = {"pk": [], "pk-pool": [], "vllm": []}
            for _ in range(reps):
                for side in ("pk", "vllm", "pk-pool") if have_vllm else ("pk", "pk-pool"):
                    got[side].append(run_startup(side, n))
            entry: dict[str, Any] = {"num_pages": n}
            for side, samples in got.items():
                if samples:
                    entry[side] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            startup.append(entry)
            v = entry.get("vllm")
            print(
                f"start-up {n:>9,} pages: pk {fmt_time(entry['pk']['seconds'])} "
                f"({entry['pk']['traced'] / n:.1f} B/page traced)"
                + (
                    f"  vllm {fmt_time(v['seconds'])} ({v['traced'] / n:.0f} B/page)"
                    f"  ratio {v['seconds'] / entry['pk']['seconds']:.0f}x"
                    if v
                    else ""
                ),
                flush=True,
            )

    table = render(rows, startup, have_vllm)
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    body = (
        "## Core: allocator, admission, scheduling step, lookup, start-up "
        "(`bench/bench_core.py`)\n\n"
        f"Machine: {machine}; {rounds} interleaved samples per side. vLLM side: "
        "`BlockPool` / `KVCacheManager` with prefix caching and KV events on, driven as its "
        'scheduler does. "hashes known": the prompt\'s page hashes were computed earlier '
        "(vLLM does it when the request arrives, pagekeeper takes them as `page_hashes`); "
        '"incl. hashing": vLLM\'s `Request` construction vs pagekeeper from token ids.\n\n' + table
    )
    print()
    print(table)
    if args.write_docs:
        write_docs(Path(args.write_docs), body)
        print(f"\nwrote {args.write_docs}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": [r.__dict__ for r in rows],
                    "startup": startup,
                },
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
