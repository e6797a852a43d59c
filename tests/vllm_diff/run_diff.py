#!/usr/bin/env python3
"""Differential proof: the same random operation sequences through vLLM 0.33's
``KVCacheManager`` and through pagekeeper's ``PageManager``, compared op by op.

Not a pytest module (pytest does not collect ``run_diff.py``): vLLM is never a project
dependency. Run it with the side virtualenv of ``shared/VLLM_ANCHOR.md``; it imports
pagekeeper from this checkout (see ``README.md`` beside this file)::

    VLLM_TARGET_DEVICE=cpu /opt/vllm-anchor/bin/python tests/vllm_diff/run_diff.py

The driver plays vLLM's scheduler: for an admission ``get_computed_blocks`` then
``allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
num_lookahead_tokens)``, then ``request.num_computed_tokens`` advances; output tokens are
appended with ``append_output_token_ids`` (which extends the request's block hashes); a
request that gets no capacity is preempted (freed) and may be resumed later with all its
tokens. vLLM is the reference: the op stream is generated from vLLM's answers, and after
every op the two sides are compared on

* None-ness, the newly allocated page ids per group, the hit page ids, the cached tokens;
* every live request's table per group (null page 0 where vLLM has its null block);
* the free page count, the whole free queue in order, every page's ref count and
  whether it is cached;
* the KV events (stored: group, hashes, parent hash, token ids, page size, LoRA name, and
  the group's ``kv_cache_spec_kind`` / sliding window; removed: group, hash; all-cleared),
  in order — pagekeeper's read back through its ZeroMQ encoding (``pagekeeper.kvevents``)
  with vLLM's own ``KVEventBatch`` decoder, every field checked.

On a mismatch the sequence is shrunk (greedy op removal) to a minimal reproducer, which
is printed and written as JSON (``--repro-dir``); ``--replay FILE`` runs one again.
The last line is a summary: ``ops compared=N mismatches=M``. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# PAGEKEEPER_ROOT points at another checkout (e.g. a patched copy); default: this one.
REPO_ROOT = Path(os.environ.get("PAGEKEEPER_ROOT") or Path(__file__).resolve().parents[2])
for _sub in ("service", "client"):
    _path = str(REPO_ROOT / _sub)
    if _path not in sys.path:
        sys.path.insert(0, _path)

# vLLM derives NONE_HASH from PYTHONHASHSEED when set; pagekeeper (like vLLM's default)
# uses the fixed seed "vllm-none-hash". Both must agree for hashes to be compared.
if "PYTHONHASHSEED" in os.environ:
    sys.exit("run_diff: unset PYTHONHASHSEED (vLLM would derive its NONE_HASH from it)")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# By default vLLM publishes event hashes as the low 64 bits of the digest (an int); ask for
# the raw 32-byte digests so whole hashes are compared.
os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"

# ---------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: kind is "full", "sliding_window", "chunked_local" or "mamba"
    (a state group without state caching: vLLM's ``mamba_cache_mode="none"``, whose block
    is the whole ``max_model_len``, so a request holds one state page)."""

    kind: str
    page_size: int
    window: int | None = None
    chunk: int | None = None


@dataclass(frozen=True)
class DiffConfig:
    name: str
    groups: tuple[GroupSpec, ...]
    num_pages: int
    enable_caching: bool = True
    max_model_len: int = 512

    @property
    def hash_page_size(self) -> int:
        return math.gcd(*(g.page_size for g in self.groups))

    @property
    def scheduler_page_size(self) -> int:
        return math.lcm(*(g.page_size for g in self.groups))


CONFIGS: dict[str, DiffConfig] = {
    c.name: c
    for c in [
        DiffConfig("full", (GroupSpec("full", 16),), num_pages=64),
        DiffConfig("full_tiny", (GroupSpec("full", 4),), num_pages=24, max_model_len=96),
        DiffConfig("full_nocache", (GroupSpec("full", 16),), num_pages=64, enable_caching=False),
        DiffConfig("swa", (GroupSpec("sliding_window", 16, window=40),), num_pages=64),
        DiffConfig(
            "swa_w1", (GroupSpec("sliding_window", 4, window=1),), num_pages=40, max_model_len=128
        ),
        DiffConfig(
            "swa_small",
            (GroupSpec("sliding_window", 4, window=6),),
            num_pages=40,
            max_model_len=128,
        ),
        DiffConfig("chunked", (GroupSpec("chunked_local", 16, chunk=32),), num_pages=64),
        DiffConfig(
            "full+swa",
            (GroupSpec("full", 16), GroupSpec("sliding_window", 16, window=48)),
            num_pages=96,
        ),
        DiffConfig(
            "full+swa_nocache",
            (GroupSpec("full", 16), GroupSpec("sliding_window", 16, window=48)),
            num_pages=96,
            enable_caching=False,
        ),
        DiffConfig(
            "full+chunked",
            (GroupSpec("full", 16), GroupSpec("chunked_local", 16, chunk=64)),
            num_pages=96,
        ),
        DiffConfig(
            "full32+swa16",
            (GroupSpec("full", 32), GroupSpec("sliding_window", 16, window=40)),
            num_pages=96,
        ),
        DiffConfig(
            "full16+swa32",
            (GroupSpec("full", 16), GroupSpec("sliding_window", 32, window=64)),
            num_pages=96,
        ),
        # vLLM caches Mamba states only in its "align" mode (copy-on-write, checkpoints),
        # which pagekeeper does not model; without it prefix caching is off for the model.
        DiffConfig("mamba", (GroupSpec("mamba", 512),), num_pages=6, enable_caching=False),
        DiffConfig(
            "full+mamba",
            (GroupSpec("full", 16), GroupSpec("mamba", 512)),
            num_pages=80,
            enable_caching=False,
        ),
    ]
}
# Everything but "swa_w1": with a one-token window vLLM's reachable-block mask is all False
# (it needs 0 contiguous blocks), so vLLM never caches such a group; pagekeeper does.
DEFAULT_CONFIGS = [name for name in CONFIGS if name != "swa_w1"]

# ---------------------------------------------------------------------------------------
# Normalised observations (what both backends report after an op)
# ---------------------------------------------------------------------------------------

Event = tuple[Any, ...]


@dataclass
class OpResult:
    """What one op returned. ``ok`` is None for ops without an allocation answer."""

    ok: bool | None = None
    new_pages: tuple[tuple[int, ...], ...] | None = None
    hit_pages: tuple[tuple[int, ...], ...] | None = None
    num_cached_tokens: int | None = None
    value: Any = None  # reset / lookup answers

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "new_pages": self.new_pages,
            "hit_pages": self.hit_pages,
            "num_cached_tokens": self.num_cached_tokens,
            "value": self.value,
        }


@dataclass
class PoolView:
    """Everything about the pool we compare after each op."""

    num_free: int
    free_queue: list[int] | None
    ref_counts: list[int] | None
    cached: list[bool] | None
    tables: dict[str, tuple[tuple[int, ...], ...]]
    events: list[Event]
    usage: float = 0.0
    # Cumulative prefix-cache counters: (admissions, queried tokens, hit tokens).
    prefix_stats: tuple[int, int, int] = (0, 0, 0)


def _norm_hash(h: Any) -> str | None:
    if h is None:
        return None
    if isinstance(h, int):
        return f"int:{h}"
    return bytes(h).hex()


def _norm_keys(keys: Any) -> Any:
    """A BlockStored's ``extra_keys`` (per page: None or a tuple, lists after decoding)."""
    if keys is None:
        return None
    return tuple(
        None if k is None else tuple(tuple(x) if isinstance(x, list | tuple) else x for x in k)
        for k in keys
    )


# ---------------------------------------------------------------------------------------
# vLLM backend
# ---------------------------------------------------------------------------------------


class VllmBackend:
    """vLLM 0.33's KVCacheManager, driven as its scheduler does."""

    name = "vllm"

    def __init__(self, cfg: DiffConfig) -> None:
        import torch
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
            SlidingWindowSpec,
        )

        hash_fn = sha256_cbor
        if ENGINE_HASHES:
            from vllm.utils.hashing import sha256

            hash_fn = sha256  # vLLM's default: pickle, not the service's CBOR
        init_none_hash(hash_fn)
        common = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
        specs = []
        for g in cfg.groups:
            if g.kind == "full":
                specs.append(FullAttentionSpec(block_size=g.page_size, **common))
            elif g.kind == "sliding_window":
                specs.append(
                    SlidingWindowSpec(block_size=g.page_size, sliding_window=g.window, **common)
                )
            elif g.kind == "chunked_local":
                specs.append(
                    ChunkedLocalAttentionSpec(
                        block_size=g.page_size, attention_chunk_size=g.chunk, **common
                    )
                )
            elif g.kind == "mamba":
                assert g.page_size == cfg.max_model_len and not cfg.enable_caching, g
                specs.append(
                    MambaSpec(
                        block_size=g.page_size,
                        shapes=((8,),),
                        dtypes=(torch.float16,),
                        mamba_cache_mode="none",
                    )
                )
            else:
                raise ValueError(g.kind)
        kv_cfg = KVCacheConfig(
            num_blocks=cfg.num_pages,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
        )
        # As vLLM's resolve_kv_cache_block_sizes: one group -> both sizes are the block
        # size; several groups -> lcm for scheduling, gcd for hashing (when caching).
        sched = cfg.scheduler_page_size
        hbs = cfg.hash_page_size if (cfg.enable_caching and len(cfg.groups) > 1) else sched
        self.hash_block_size = hbs
        self.mgr = KVCacheManager(
            kv_cfg,
            max_model_len=cfg.max_model_len,
            scheduler_block_size=sched,
            hash_block_size=hbs,
            enable_caching=cfg.enable_caching,
            enable_kv_cache_events=True,
            log_stats=True,
        )
        self.hasher = get_request_block_hasher(hbs, hash_fn)
        self.requests: dict[str, Any] = {}
        self.made: dict[str, Any] = {}
        """Every request made, by id (``--engine-hashes``: pagekeeper reads its block
        hashes, as the vLLM plugin does)."""
        self.running: set[str] = set()
        self.cfg = cfg
        self.num_empty_stored_events = 0
        self.num_partial_stored_events = 0
        self.prefix_totals = (0, 0, 0)
        self.partial_keys: Counter[tuple[int, bytes]] = Counter()

    def _make_request(
        self,
        rid: str,
        tokens: Sequence[int],
        lora: list[Any] | None,
        salt: str | None,
        mm: list[Any] | None = None,
    ) -> Any:
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        lora_req = LoRARequest(lora[0], lora[1], lora[2]) if lora else None
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for ident, offset, length in mm or ()
        ]
        req = Request(
            rid,
            list(tokens),
            SamplingParams(max_tokens=1 << 20),
            None,
            mm_features=features or None,
            lora_request=lora_req,
            cache_salt=salt,
            block_hasher=self.hasher,
        )
        self.made[rid] = req
        return req

    # -- ops --------------------------------------------------------------------------
    def admit(
        self,
        rid: str,
        tokens: Sequence[int],
        budget: int | None,
        lookahead: int,
        lora: list[Any] | None,
        salt: str | None,
        mm: list[Any] | None = None,
    ) -> tuple[OpResult, int]:
        """New request. Returns (result, num_new_tokens actually scheduled)."""
        req = self._make_request(rid, tokens, lora, salt, mm)
        return self._admit_request(req, budget, lookahead)

    def _admit_request(self, req: Any, budget: int | None, lookahead: int) -> tuple[OpResult, int]:
        blocks, num_hit, _ = self.mgr.get_computed_blocks(req)
        remaining = req.num_tokens - num_hit
        num_new = remaining if budget is None else min(budget, remaining)
        out = self.mgr.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=lookahead,
        )
        hit = tuple(tuple(ids) for ids in blocks.get_block_ids())
        if out is None:
            return OpResult(ok=False, hit_pages=hit, num_cached_tokens=num_hit), num_new
        self.mgr.record_prefix_cache_stats(req, num_hit)
        from vllm.v1.request import RequestStatus

        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit + num_new
        self.requests[req.request_id] = req
        self.running.add(req.request_id)
        new = tuple(tuple(ids) for ids in out.get_block_ids())
        return OpResult(ok=True, new_pages=new, hit_pages=hit, num_cached_tokens=num_hit), num_new

    def resume(self, rid: str, budget: int | None, lookahead: int) -> tuple[OpResult, int]:
        req = self.requests[rid]
        return self._admit_request(req, budget, lookahead)

    def step(
        self, rid: str, new_tokens: Sequence[int], chunk: int | None, lookahead: int
    ) -> tuple[OpResult, int]:
        req = self.requests[rid]
        if new_tokens:
            req.append_output_token_ids(list(new_tokens))
        remaining = req.num_tokens - req.num_computed_tokens
        num_new = remaining if chunk is None else min(chunk, remaining)
        out = self.mgr.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
        if out is None:
            return OpResult(ok=False), num_new
        req.num_computed_tokens += num_new
        new = tuple(tuple(ids) for ids in out.get_block_ids())
        return OpResult(ok=True, new_pages=new), num_new

    def free(self, rid: str, preempted: bool = False) -> OpResult:
        from vllm.v1.request import RequestStatus

        req = self.requests[rid]
        self.mgr.free(req)
        self.running.discard(rid)
        if preempted:
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.num_preemptions += 1
        else:
            del self.requests[rid]
        return OpResult()

    def reset(self) -> OpResult:
        return OpResult(value=bool(self.mgr.reset_prefix_cache()))

    def lookup(
        self,
        tokens: Sequence[int],
        lora: list[Any] | None,
        salt: str | None,
        mm: list[Any] | None = None,
    ) -> OpResult:
        req = self._make_request("__lookup__", tokens, lora, salt, mm)
        # A router's lookup may cover every token (pagekeeper's ``lookup``); admission
        # stops one short (``get_computed_blocks``' default).
        blocks, num_hit, _ = self.mgr.get_computed_blocks(req, req.num_tokens)
        hit = tuple(tuple(ids) for ids in blocks.get_block_ids())
        return OpResult(value=[num_hit, hit])

    # -- observation ------------------------------------------------------------------
    def num_computed(self, rid: str) -> int:
        return int(self.requests[rid].num_computed_tokens)

    def num_tokens(self, rid: str) -> int:
        return int(self.requests[rid].num_tokens)

    def view(self, full: bool) -> PoolView:
        pool = self.mgr.block_pool
        events: list[Event] = []
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        page_sizes = [g.page_size for g in self.cfg.groups]
        for ev in self.mgr.take_events():
            if isinstance(ev, BlockStored):
                if not ev.block_hashes:
                    # vLLM emits a stored event even when every page in range was null.
                    self.num_empty_stored_events += 1
                    continue
                if ev.block_size != page_sizes[ev.group_idx]:
                    # A sub-page "partial tail" entry (FullAttentionManager.
                    # _cache_partial_tail_block, when a group's page is larger than the hash
                    # page): only fine-grained (mamba "align") lookups can hit it.
                    self.num_partial_stored_events += 1
                    # A multiset: several pages may carry the same partial key.
                    self.partial_keys.update((ev.group_idx, bytes(h)) for h in ev.block_hashes)
                    continue
                events.append(
                    (
                        "stored",
                        ev.group_idx,
                        tuple(_norm_hash(h) for h in ev.block_hashes),
                        _norm_hash(ev.parent_block_hash),
                        tuple(ev.token_ids),
                        ev.block_size,
                        ev.lora_name,
                        ev.kv_cache_spec_kind,
                        ev.kv_cache_spec_sliding_window,
                        _norm_keys(ev.extra_keys),
                    )
                )
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if self.partial_keys[(ev.group_idx, bytes(h))] > 0:
                        self.partial_keys[(ev.group_idx, bytes(h))] -= 1
                        continue
                    events.append(("removed", ev.group_idx, _norm_hash(h)))
            elif isinstance(ev, AllBlocksCleared):
                self.partial_keys.clear()
                events.append(("cleared",))
            else:  # pragma: no cover - a new vLLM event type
                events.append(("unknown", type(ev).__name__))
        tables = {
            rid: tuple(tuple(ids) for ids in self.mgr.get_block_ids(rid))
            for rid in sorted(self.running)
        }
        usage = float(self.mgr.usage)
        ps = self.mgr.make_prefix_cache_stats()
        if ps is not None:
            # vLLM splits resumed (preempted) requests out; pagekeeper counts all admissions.
            self.prefix_totals = (
                self.prefix_totals[0] + ps.requests + ps.preempted_requests,
                self.prefix_totals[1] + ps.queries + ps.preempted_queries,
                self.prefix_totals[2] + ps.hits + ps.preempted_hits,
            )
        if not full:
            return PoolView(
                pool.get_num_free_blocks(),
                None,
                None,
                None,
                tables,
                events,
                usage,
                self.prefix_totals,
            )
        queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        refs = [0] + [b.ref_cnt for b in pool.blocks[1:]]
        cached = [b.block_hash is not None for b in pool.blocks]
        return PoolView(
            pool.get_num_free_blocks(),
            queue,
            refs,
            cached,
            tables,
            events,
            usage,
            self.prefix_totals,
        )


# ---------------------------------------------------------------------------------------
# pagekeeper backend
# ---------------------------------------------------------------------------------------


ENGINE_HASHES = False
"""``--engine-hashes``: vLLM hashes with its default ``sha256`` (pickle), unlike the
service's ``sha256_cbor``, and pagekeeper is sent vLLM's own block hashes, as the vLLM
plugin sends them: every admission's and lookup's pages, and the pages a growth's new
tokens complete (``allocate(new_page_hashes=...)``). Every hit, page and event (hashes
included) must still be vLLM's: a page filled by generated tokens is named alike on both
sides, so a prompt holding another request's output hits it."""

DEFER_CACHING = False
"""``--defer-caching``: pagekeeper's manager defers admissions' prefix-cache work and
evictions as the service runs it (``PageManager.defer_caching``); every view settles.
Prompts then go in as the service hands them over (``CheckedTokens``; half of them with
their page hashes packed, as a client sends a scheduler's), so a fresh one
takes the manager's short path (``PageManager._admit_fresh``)."""


class PagekeeperBackend:
    """pagekeeper's PageManager through its public API (plus the pool for the queue)."""

    name = "pagekeeper"

    def __init__(self, cfg: DiffConfig) -> None:
        from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
        from pagekeeper.core.manager import PageManager

        kinds = {
            "full": GroupKind.FULL,
            "sliding_window": GroupKind.SLIDING_WINDOW,
            "chunked_local": GroupKind.CHUNKED_LOCAL,
            "mamba": GroupKind.MAMBA,
        }
        groups = tuple(
            GroupConfig(kind=kinds[g.kind], page_size=g.page_size, window=g.window, chunk=g.chunk)
            for g in cfg.groups
        )
        self.pm = PageManager(
            PoolConfig(
                num_pages=cfg.num_pages,
                groups=groups,
                enable_prefix_caching=cfg.enable_caching,
                hash_algorithm="sha256_cbor",
                max_model_len=cfg.max_model_len,
            )
        )
        self.pm.defer_caching = DEFER_CACHING
        self.engine: Any = None
        """The vLLM backend run beside (``--engine-hashes`` reads its requests' hashes)."""
        self.running: set[str] = set()
        self.tokens: dict[str, list[int]] = {}
        self.extra: dict[str, Any] = {}
        self.cfg = cfg

    def _wire_events(self, raw: list[Any]) -> list[tuple[Any, Any, Any]]:
        """Each event through pagekeeper's ZeroMQ encoding (``pagekeeper.kvevents``) and
        vLLM's ``KVEventBatch`` decoder; checks every field the decoder returns against
        the event, and gives back each stored event's spec kind and window (else Nones)."""
        import msgspec
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.distributed.kv_events import KVEventBatch as VllmBatch

        from pagekeeper.core.events import PageRemoved, PageStored
        from pagekeeper.kvevents import KVEventBatch, group_specs, to_vllm_events

        if not raw:
            return []
        specs = group_specs(self.pm.config)
        payload = msgspec.msgpack.encode(
            KVEventBatch(ts=0.0, events=to_vllm_events(raw, "bytes", specs), data_parallel_rank=0)
        )
        decoded = msgspec.msgpack.Decoder(VllmBatch).decode(payload).events
        out: list[tuple[Any, Any, Any]] = []
        for ev, got in zip(raw, decoded, strict=True):
            if isinstance(ev, PageStored):
                assert isinstance(got, BlockStored), got
                assert [bytes(h) for h in got.block_hashes] == list(ev.page_hashes)
                assert got.parent_block_hash == ev.parent_page_hash
                assert list(got.token_ids) == [int(t) for t in ev.token_ids]
                assert (got.block_size, got.group_idx) == (ev.page_size, ev.group_id)
                assert got.lora_name == ev.lora_name and got.medium == "GPU"
                out.append(
                    (
                        got.kv_cache_spec_kind,
                        got.kv_cache_spec_sliding_window,
                        _norm_keys(got.extra_keys),
                    )
                )
                continue
            if isinstance(ev, PageRemoved):
                assert isinstance(got, BlockRemoved), got
                assert [bytes(h) for h in got.block_hashes] == list(ev.page_hashes)
                assert got.group_idx == ev.group_id
            out.append((None, None, None))
        return out

    @staticmethod
    def _extra(lora: list[Any] | None, salt: str | None, mm: list[Any] | None = None) -> Any:
        from pagekeeper.core.types import ExtraKeys, MultiModalKey

        return ExtraKeys(
            lora_name=lora[0] if lora else None,
            lora_path=lora[2] if lora else None,
            mm_inputs=tuple(MultiModalKey(i, o, n) for i, o, n in mm or ()),
            cache_salt=salt,
        )

    @staticmethod
    def _alloc_result(alloc: Any) -> OpResult:
        if alloc is None:
            return OpResult(ok=False)
        return OpResult(
            ok=True,
            new_pages=tuple(tuple(int(p) for p in g) for g in alloc.new_page_ids),
            hit_pages=tuple(tuple(int(p) for p in g) for g in alloc.hit_page_ids) or None,
            num_cached_tokens=int(alloc.num_cached_tokens),
        )

    def _admit(
        self, rid: str, tokens: Sequence[int], num_new: int | None, lookahead: int, extra: Any
    ) -> OpResult:
        given: Any = list(tokens)
        hashes: Any = None
        if ENGINE_HASHES and self.cfg.enable_caching:
            hashes = [bytes(h) for h in self.engine.made[rid].block_hashes]
        elif DEFER_CACHING:
            import zlib

            import numpy as np

            from pagekeeper.core.hashing import digest_size, hash_pages
            from pagekeeper.core.manager import check_packed_page_hashes, check_token_ids

            given = check_token_ids(np.asarray(given, dtype=np.int64))
            if zlib.crc32(f"{rid}/{len(tokens)}".encode()) % 2:
                # Half the admissions with their page hashes packed, as the client sends
                # a scheduler's hashes (the service checks them, the short path keeps them
                # packed until settle): the same pages, hits and events as vLLM's.
                config = self.pm.config
                hashes = check_packed_page_hashes(
                    b"".join(
                        hash_pages(
                            list(tokens),
                            self.pm.hash_page_size,
                            extra_keys=extra,
                            algorithm=config.hash_algorithm,
                        )
                    ),
                    digest_size(config.hash_algorithm),
                )
        alloc = self.pm.admit(
            rid,
            given,
            num_new_tokens=num_new,
            extra_keys=extra,
            num_lookahead_tokens=lookahead,
            page_hashes=hashes,
        )
        res = self._alloc_result(alloc)
        if alloc is not None:
            self.running.add(rid)
        return res

    def admit(
        self,
        rid: str,
        tokens: Sequence[int],
        num_new: int | None,
        lookahead: int,
        lora: list[Any] | None,
        salt: str | None,
        mm: list[Any] | None = None,
    ) -> OpResult:
        self.tokens[rid] = list(tokens)
        self.extra[rid] = self._extra(lora, salt, mm)
        return self._admit(rid, tokens, num_new, lookahead, self.extra[rid])

    def resume(self, rid: str, num_new: int | None, lookahead: int) -> OpResult:
        return self._admit(rid, self.tokens[rid], num_new, lookahead, self.extra[rid])

    def step(self, rid: str, new_tokens: Sequence[int], num_new: int, lookahead: int) -> OpResult:
        before = len(self.tokens[rid])
        self.tokens[rid].extend(new_tokens)
        page_hashes = None
        if ENGINE_HASHES and self.cfg.enable_caching:
            # The pages the new tokens complete, by the engine's hashes (vLLM hashed them as
            # the tokens were appended on its side, just before).
            hps = self.pm.hash_page_size
            block_hashes = self.engine.requests[rid].block_hashes
            page_hashes = [
                bytes(h) for h in block_hashes[before // hps : len(self.tokens[rid]) // hps]
            ]
        if len(new_tokens) == 1 and num_new == 1 and not page_hashes:
            # A plain decode: through the batched decode path (the service's hot path).
            answers = self.pm.allocate_decodes(
                [rid], list(new_tokens), num_lookahead_tokens=lookahead
            )
            if rid in answers:
                res = self._alloc_result(answers[rid])
            else:
                res = OpResult(ok=True, new_pages=tuple(() for _ in self.pm.groups))
        else:
            alloc = self.pm.allocate(
                rid,
                num_new,
                new_token_ids=list(new_tokens),
                num_lookahead_tokens=lookahead,
                new_page_hashes=page_hashes or None,
            )
            res = self._alloc_result(alloc)
        res.hit_pages = None
        res.num_cached_tokens = None
        return res

    def free(self, rid: str, preempted: bool = False) -> OpResult:
        self.pm.free(rid)
        self.running.discard(rid)
        if not preempted:
            self.tokens.pop(rid, None)
            self.extra.pop(rid, None)
        return OpResult()

    def reset(self) -> OpResult:
        return OpResult(value=bool(self.pm.reset_prefix_cache()))

    def lookup(
        self,
        tokens: Sequence[int],
        lora: list[Any] | None,
        salt: str | None,
        mm: list[Any] | None = None,
    ) -> OpResult:
        page_hashes = None
        if ENGINE_HASHES:
            page_hashes = [bytes(h) for h in self.engine.made["__lookup__"].block_hashes]
        res = self.pm.lookup(
            list(tokens), extra_keys=self._extra(lora, salt, mm), page_hashes=page_hashes
        )
        hit = tuple(tuple(int(p) for p in g) for g in res.page_ids)
        return OpResult(value=[int(res.num_hit_tokens), hit])

    def _pool(self) -> Any:
        for attr in ("pool", "_pool"):
            pool = getattr(self.pm, attr, None)
            if pool is not None:
                return pool
        return None

    def view(self, full: bool) -> PoolView:
        from pagekeeper.core.events import AllCleared, PageRemoved, PageStored

        events: list[Event] = []
        raw = self.pm.take_events()
        # The events as pagekeeper's ZeroMQ publisher sends them to routers, read back with
        # vLLM's own decoder: what a router built for vLLM would see.
        wire = self._wire_events(raw)
        for ev, (kind, window, keys) in zip(raw, wire, strict=True):
            if isinstance(ev, PageStored):
                if not ev.page_hashes:
                    continue
                events.append(
                    (
                        "stored",
                        ev.group_id,
                        tuple(_norm_hash(h) for h in ev.page_hashes),
                        _norm_hash(ev.parent_page_hash),
                        tuple(int(t) for t in ev.token_ids),
                        ev.page_size,
                        ev.lora_name,
                        kind,
                        window,
                        keys,
                    )
                )
            elif isinstance(ev, PageRemoved):
                for h in ev.page_hashes:
                    events.append(("removed", ev.group_id, _norm_hash(h)))
            elif isinstance(ev, AllCleared):
                events.append(("cleared",))
            else:  # pragma: no cover
                events.append(("unknown", type(ev).__name__))
        num_groups = len(self.cfg.groups)
        tables = {
            rid: tuple(tuple(int(p) for p in self.pm.page_table(rid, g)) for g in range(num_groups))
            for rid in sorted(self.running)
        }
        stats = self.pm.stats()
        num_free = int(stats.num_free_pages)
        usage = float(stats.usage)
        prefix = (
            int(stats.prefix_queries_requests),
            int(stats.prefix_queries_tokens),
            int(stats.prefix_hits_tokens),
        )
        pool = self._pool()
        if not full or pool is None:
            return PoolView(num_free, None, None, None, tables, events, usage, prefix)
        n = self.cfg.num_pages
        queue = [int(p) for p in pool.free_queue()]
        refs = [0] + [int(pool.ref_count(p)) for p in range(1, n)]
        cached = [bool(pool.is_cached(p)) for p in range(n)]
        return PoolView(num_free, queue, refs, cached, tables, events, usage, prefix)


# ---------------------------------------------------------------------------------------
# Op stream: generated from the reference (vLLM) answers, replayable as JSON
# ---------------------------------------------------------------------------------------
#
#   ["admit",  rid, tokens, budget|None, lookahead, lora|None, salt|None]
#   ["resume", rid, budget|None, lookahead]          re-admit a preempted request (all tokens)
#   ["step",   rid, new_tokens, chunk|None, lookahead]  append tokens, schedule the rest
#                                                    (or `chunk` of it); None -> preempt
#   ["free",   rid]
#   ["reset"]
#   ["lookup", tokens, lora|None, salt|None]


class Mismatch(Exception):
    def __init__(self, op_index: int, op: list[Any], what: str, ref: Any, got: Any) -> None:
        super().__init__(f"op #{op_index} {op[0]}: {what}")
        self.op_index = op_index
        self.op = op
        self.what = what
        self.ref = ref
        self.got = got


@dataclass
class RunStats:
    ops: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    none_answers: int = 0
    evictions: int = 0
    hits: int = 0
    empty_stored_events: int = 0
    partial_stored_events: int = 0


def _cmp(i: int, op: list[Any], what: str, ref: Any, got: Any) -> None:
    if ref != got:
        raise Mismatch(i, op, what, ref, got)


def _cmp_alloc(i: int, op: list[Any], ref: OpResult, got: OpResult, admission: bool) -> None:
    _cmp(i, op, "None-ness (ok)", ref.ok, got.ok)
    if not ref.ok:
        return
    _cmp(i, op, "new page ids", ref.new_pages, got.new_pages)
    if admission:
        _cmp(i, op, "num cached tokens", ref.num_cached_tokens, got.num_cached_tokens)
        if got.hit_pages is not None:
            ref_hit = ref.hit_pages
            # vLLM's lookup result may have no list for a group that had no lookup.
            _cmp(i, op, "hit page ids", ref_hit, got.hit_pages)


def _cmp_view(i: int, op: list[Any], ref: PoolView, got: PoolView) -> None:
    _cmp(i, op, "KV events", ref.events, got.events)
    _cmp(i, op, "num free pages", ref.num_free, got.num_free)
    if abs(ref.usage - got.usage) > 1e-12:
        raise Mismatch(i, op, "usage", ref.usage, got.usage)
    _cmp(
        i, op, "prefix stats (admissions, queried, hit tokens)", ref.prefix_stats, got.prefix_stats
    )
    _cmp(i, op, "request tables", ref.tables, got.tables)
    if ref.free_queue is not None and got.free_queue is not None:
        _cmp(i, op, "free queue order", ref.free_queue, got.free_queue)
        _cmp(i, op, "ref counts", ref.ref_counts, got.ref_counts)
        _cmp(i, op, "cached flags", ref.cached, got.cached)


def apply_op(
    i: int, op: list[Any], ref: Any, other: Any | None, stats: RunStats, full_view: bool
) -> None:
    """Apply one op to the reference and (if given) the other backend, comparing."""
    kind = op[0]
    stats.by_kind[kind] = stats.by_kind.get(kind, 0) + 1
    if kind == "admit":
        _, rid, tokens, budget, lookahead, lora, salt, *rest = op
        mm = rest[0] if rest else None
        r, num_new = ref.admit(rid, tokens, budget, lookahead, lora, salt, mm)
        if r.num_cached_tokens:
            stats.hits += 1
        if other is not None:
            # pagekeeper schedules `num_new_tokens` after its own hit; the default (None)
            # means "all the rest", like the unchunked reference.
            g = other.admit(
                rid, tokens, None if budget is None else num_new, lookahead, lora, salt, mm
            )
            _cmp_alloc(i, op, r, g, admission=True)
        if not r.ok:
            stats.none_answers += 1
    elif kind == "resume":
        _, rid, budget, lookahead = op
        r, num_new = ref.resume(rid, budget, lookahead)
        if other is not None:
            g = other.resume(rid, None if budget is None else num_new, lookahead)
            _cmp_alloc(i, op, r, g, admission=True)
        if not r.ok:
            stats.none_answers += 1
    elif kind == "step":
        _, rid, new_tokens, chunk, lookahead = op
        r, num_new = ref.step(rid, new_tokens, chunk, lookahead)
        if other is not None:
            g = other.step(rid, new_tokens, num_new, lookahead)
            _cmp_alloc(i, op, r, g, admission=False)
        if not r.ok:
            # No capacity for a running request: the scheduler preempts it.
            stats.none_answers += 1
            ref.free(rid, preempted=True)
            if other is not None:
                other.free(rid, preempted=True)
    elif kind == "free":
        ref.free(op[1])
        if other is not None:
            other.free(op[1])
    elif kind == "reset":
        r = ref.reset()
        if other is not None:
            _cmp(i, op, "reset_prefix_cache answer", r.value, other.reset().value)
    elif kind == "lookup":
        _, tokens, lora, salt, *rest = op
        mm = rest[0] if rest else None
        r = ref.lookup(tokens, lora, salt, mm)
        if other is not None:
            g = other.lookup(tokens, lora, salt, mm)
            _cmp(i, op, "lookup (hit tokens, page ids)", r.value, g.value)
    else:
        raise ValueError(f"unknown op {kind!r}")
    rv = ref.view(full_view)
    stats.evictions += sum(1 for e in rv.events if e[0] == "removed")
    if other is not None:
        _cmp_view(i, op, rv, other.view(full_view))
    stats.ops += 1


class Generator:
    """Random scheduler-like op stream, answered by the reference backend as it goes."""

    def __init__(self, cfg: DiffConfig, seed: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.next_id = 0
        ps = cfg.scheduler_page_size
        rng = self.rng
        # A few prompt families whose prefixes requests share (system prompts, few-shot).
        self.families = [
            [rng.randrange(1, 50_000) for _ in range(cfg.max_model_len)] for _ in range(4)
        ]
        # Page-aligned prompts at the scheduler's page when two fit (not with a Mamba
        # group's max_model_len-sized block: then at the smallest page).
        limit = cfg.max_model_len - 8
        self.page = ps if 2 * ps <= limit else min(g.page_size for g in cfg.groups)
        self.preempted: list[str] = []
        self.pending: list[list[Any]] = []

    def prompt(self) -> list[int]:
        rng, cfg = self.rng, self.cfg
        limit = cfg.max_model_len - 8
        mode = rng.random()
        if mode < 0.25:
            # Exactly page-aligned prompt (the last token is never a hit).
            n = self.page * rng.randint(1, max(1, limit // self.page // 2))
        else:
            n = rng.randint(1, limit // 2)
        fam = rng.choice(self.families)
        shared = rng.choice([0, n // 4, n // 2, n - 1, n, n]) if rng.random() < 0.85 else 0
        shared = min(shared, n)
        tail = [rng.randrange(1, 50_000) for _ in range(n - shared)]
        return fam[:shared] + tail

    def next_op(self, ref: VllmBackend) -> list[Any]:
        if self.pending:
            return self.pending.pop(0)
        rng, cfg = self.rng, self.cfg
        running = sorted(ref.running)
        lookahead = rng.choice([0, 0, 0, 0, 1, 2, 4, 7])
        weights = {
            "step": 55 if running else 0,
            "free": 14 if running else 0,
            "admit": 20,
            "resume": 5 if self.preempted else 0,
            "lookup": 4,
            "reset": 1,
            "drain": 1,
        }
        kind = rng.choices(list(weights), weights=list(weights.values()))[0]
        if kind == "step":
            rid = rng.choice(running)
            computed, total = ref.num_computed(rid), ref.num_tokens(rid)
            if computed < total:  # chunked prefill in progress
                return ["step", rid, [], rng.choice([None, rng.randint(1, 64)]), lookahead]
            if total >= cfg.max_model_len:
                return ["free", rid]
            k = 1 if rng.random() < 0.85 else rng.randint(2, 5)
            k = min(k, cfg.max_model_len - total)
            new_tokens = [rng.randrange(1, 50_000) for _ in range(k)]
            return ["step", rid, new_tokens, None, lookahead]
        if kind == "free":
            return ["free", rng.choice(running)]
        if kind == "reset":
            return ["reset"]
        if kind == "drain":
            # A quiet moment: every request finishes, then the cache is reset (so that
            # reset_prefix_cache also succeeds, not only refuses).
            self.pending = [["free", rid] for rid in running] + [["reset"]]
            return self.pending.pop(0)
        if kind == "lookup":
            prompt = self.prompt()
            return ["lookup", prompt, self.lora(), self.salt(), self.mm(len(prompt))]
        if kind == "resume":
            rid = self.preempted.pop(rng.randrange(len(self.preempted)))
            budget = None if rng.random() < 0.7 else rng.randint(1, 96)
            return ["resume", rid, budget, lookahead]
        rid = f"r{self.next_id}"
        self.next_id += 1
        budget = None if rng.random() < 0.7 else rng.randint(1, 96)
        prompt = self.prompt()
        return [
            "admit", rid, prompt, budget, lookahead, self.lora(), self.salt(), self.mm(len(prompt))
        ]  # fmt: skip

    def lora(self) -> list[Any] | None:
        r = self.rng.random()
        if r < 0.08:
            return ["adapter-a", 1, "/lora/a"]
        if r < 0.12:
            return ["adapter-b", 2, "/lora/b"]
        if r < 0.14:
            return ["adapter-a", 3, "/lora/a-v2"]  # same name, other path: other hashes
        return None

    def salt(self) -> str | None:
        return "salt-x" if self.rng.random() < 0.08 else None

    def mm(self, num_tokens: int) -> list[Any] | None:
        """Now and then one or two images' placeholders, from a few fixed positions (so
        that prompts sharing a prefix share them, and hit)."""
        rng = self.rng
        if rng.random() >= 0.1:
            return None
        spots = [(5, 20), (30, 16), (60, 40)]  # not overlapping: sorted, as vLLM keeps them
        chosen = sorted(rng.sample(spots, rng.choice([1, 1, 2])))
        ident = rng.choice(["img-a", "img-b"])
        placed = [[f"{ident}-{o}", o, n] for o, n in chosen if o + n <= num_tokens]
        return placed or None

    def observe(self, op: list[Any], ref: VllmBackend) -> None:
        """Track preempted requests (resumable) from the reference's state after an op."""
        if op[0] == "step" and op[1] not in ref.running and op[1] in ref.requests:
            self.preempted.append(op[1])
        if op[0] == "resume" and op[1] not in ref.running:
            self.preempted.append(op[1])


# ---------------------------------------------------------------------------------------
# Running, replaying, shrinking
# ---------------------------------------------------------------------------------------


class VllmAsOther(VllmBackend):
    """A second vLLM manager behind the pagekeeper-side interface (driver self-check)."""

    name = "vllm-self"

    def admit(self, rid, tokens, num_new, lookahead, lora, salt, mm=None):  # type: ignore[override]
        return super().admit(rid, tokens, num_new, lookahead, lora, salt, mm)[0]

    def resume(self, rid, num_new, lookahead):  # type: ignore[override]
        return super().resume(rid, num_new, lookahead)[0]

    def step(self, rid, new_tokens, num_new, lookahead):  # type: ignore[override]
        res = super().step(rid, new_tokens, num_new, lookahead)[0]
        return res


def make_backend(name: str, cfg: DiffConfig) -> Any:
    if name == "vllm":
        return VllmAsOther(cfg)
    if name == "pagekeeper":
        return PagekeeperBackend(cfg)
    raise ValueError(name)


def generate_and_compare(
    cfg: DiffConfig, seed: int, num_ops: int, other_name: str | None, full_view: bool
) -> tuple[list[list[Any]], RunStats, Mismatch | Exception | None]:
    ref = VllmBackend(cfg)
    other = make_backend(other_name, cfg) if other_name else None
    if other is not None:
        other.engine = ref
    gen = Generator(cfg, seed)
    ops: list[list[Any]] = []
    stats = RunStats()
    for i in range(num_ops):
        op = gen.next_op(ref)
        ops.append(op)
        try:
            apply_op(i, op, ref, other, stats, full_view)
        except Mismatch as exc:
            return ops, stats, exc
        except NotImplementedError as exc:
            return ops, stats, exc
        except Exception as exc:  # a crash on one side is a finding too
            return ops, stats, exc
        gen.observe(op, ref)
    stats.empty_stored_events = ref.num_empty_stored_events
    stats.partial_stored_events = ref.num_partial_stored_events
    return ops, stats, None


def replay(
    cfg: DiffConfig, ops: list[list[Any]], other_name: str, full_view: bool = True
) -> Exception | None:
    """Run a recorded op list; ops that no longer apply (after shrinking) are skipped."""
    ref = VllmBackend(cfg)
    other = make_backend(other_name, cfg)
    other.engine = ref
    stats = RunStats()
    for i, op in enumerate(ops):
        kind = op[0]
        if kind in ("step", "free") and op[1] not in ref.running:
            continue
        if kind == "resume" and (op[1] not in ref.requests or op[1] in ref.running):
            continue
        if kind == "admit" and op[1] in ref.requests:
            continue
        if kind == "step":
            rid = op[1]
            computed, total = ref.num_computed(rid), ref.num_tokens(rid)
            if op[2] and computed < total:
                continue  # decode tokens while a prefill is unfinished: not a scheduler move
            if not op[2] and computed >= total:
                continue
            if total + len(op[2]) > cfg.max_model_len:
                continue
        try:
            apply_op(i, op, ref, other, stats, full_view)
        except Exception as exc:
            return exc
    return None


def shrink(
    cfg: DiffConfig, ops: list[list[Any]], other_name: str, budget_s: float = 60.0
) -> list[list[Any]]:
    """Greedy one-op-at-a-time removal while the replay still fails the same way."""
    first = replay(cfg, ops, other_name)
    if first is None:
        return ops
    signature = type(first).__name__ + ":" + (first.what if isinstance(first, Mismatch) else "")

    def fails(candidate: list[list[Any]]) -> bool:
        exc = replay(cfg, candidate, other_name)
        if exc is None:
            return False
        sig = type(exc).__name__ + ":" + (exc.what if isinstance(exc, Mismatch) else "")
        return sig == signature

    deadline = time.monotonic() + budget_s
    current = ops
    # Cut everything after the failing op first.
    if isinstance(first, Mismatch):
        current = ops[: first.op_index + 1]
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        chunk = max(1, len(current) // 4)
        while chunk >= 1 and time.monotonic() < deadline:
            i = 0
            while i < len(current) and time.monotonic() < deadline:
                candidate = current[:i] + current[i + chunk :]
                if candidate and fails(candidate):
                    current = candidate
                    changed = True
                else:
                    i += chunk
            chunk //= 2
    return current


def _describe(exc: BaseException) -> str:
    if isinstance(exc, Mismatch):
        return (
            f"{exc}\n    op:   {json.dumps(exc.op)[:400]}\n"
            f"    vllm: {str(exc.ref)[:600]}\n    pk:   {str(exc.got)[:600]}"
        )
    return f"{type(exc).__name__}: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {list(CONFIGS)}")
    ap.add_argument("--seeds", type=int, default=20, help="seeds per config")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--ops", type=int, default=300, help="ops per seed")
    ap.add_argument(
        "--against",
        default="pagekeeper",
        choices=["pagekeeper", "vllm", "none"],
        help="what to compare vLLM with (vllm = self-check of the driver, none = vLLM alone)",
    )
    ap.add_argument("--light", action="store_true", help="skip free-queue/ref-count checks")
    ap.add_argument("--repro-dir", default="/tmp/vllm_diff_repros")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--replay", help="a reproducer JSON written by an earlier run")
    ap.add_argument("--max-failures", type=int, default=3, help="per config, then move on")
    ap.add_argument(
        "--defer-caching",
        action="store_true",
        help="pagekeeper defers admissions' caching and evictions as the service does",
    )
    ap.add_argument(
        "--engine-hashes",
        action="store_true",
        help="vLLM hashes with pickle sha256; pagekeeper is sent vLLM's hashes (admissions, "
        "lookups, growths)",
    )
    args = ap.parse_args(argv)
    global DEFER_CACHING, ENGINE_HASHES
    DEFER_CACHING = args.defer_caching
    ENGINE_HASHES = args.engine_hashes

    try:
        import vllm  # noqa: F401
    except ImportError:
        print(
            "run_diff: vLLM is not importable here; run with the side virtualenv "
            "(see tests/vllm_diff/README.md)",
            file=sys.stderr,
        )
        return 2

    if args.replay:
        data = json.loads(Path(args.replay).read_text())
        cfg = CONFIGS[data["config"]]
        exc = replay(cfg, data["ops"], "pagekeeper")
        print(_describe(exc) if exc else "replay: no mismatch")
        return 1 if exc else 0

    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    other = None if args.against == "none" else args.against
    total_ops = 0
    total_mismatches = 0
    repro_dir = Path(args.repro_dir)
    t0 = time.monotonic()
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        cfg_ops = 0
        failures = 0
        agg = RunStats()
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            ops, stats, exc = generate_and_compare(cfg, seed, args.ops, other, not args.light)
            cfg_ops += stats.ops
            agg.none_answers += stats.none_answers
            agg.evictions += stats.evictions
            agg.hits += stats.hits
            agg.empty_stored_events += stats.empty_stored_events
            agg.partial_stored_events += stats.partial_stored_events
            for k, v in stats.by_kind.items():
                agg.by_kind[k] = agg.by_kind.get(k, 0) + v
            if exc is None:
                continue
            total_mismatches += 1
            failures += 1
            print(f"[{name} seed={seed}] MISMATCH after {stats.ops} ops: {_describe(exc)}")
            if isinstance(exc, NotImplementedError):
                print(f"[{name}] pagekeeper core not implemented yet; skipping the config")
                break
            if other == "pagekeeper" and not args.no_shrink:
                small = shrink(cfg, ops, "pagekeeper")
                repro_dir.mkdir(parents=True, exist_ok=True)
                path = repro_dir / f"{name.replace('+', '_')}_seed{seed}.json"
                path.write_text(json.dumps({"config": name, "seed": seed, "ops": small}))
                again = replay(cfg, small, "pagekeeper")
                print(f"    minimal reproducer: {len(small)} ops -> {path}")
                for op in small:
                    print("     ", json.dumps(op)[:300])
                if again is not None:
                    print("    replayed:", _describe(again).replace("\n", "\n    "))
            if failures >= args.max_failures:
                print(f"[{name}] {failures} failures; moving on")
                break
        total_ops += cfg_ops
        kinds = " ".join(f"{k}={v}" for k, v in sorted(agg.by_kind.items()))
        print(
            f"[{name}] ops={cfg_ops} failures={failures} ({kinds}; None={agg.none_answers} "
            f"hits={agg.hits} evicted_hashes={agg.evictions} "
            f"filtered vLLM events: empty_stored={agg.empty_stored_events} "
            f"partial_tail_stored={agg.partial_stored_events})",
            flush=True,
        )
    print(
        f"vllm_diff: against={args.against} ops compared={total_ops} "
        f"mismatches={total_mismatches} ({time.monotonic() - t0:.1f}s)"
    )
    return 1 if total_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
