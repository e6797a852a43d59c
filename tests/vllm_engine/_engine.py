"""Run a real vLLM engine (the side virtualenv) on a tiny model and record what its KV-cache
manager answered: tokens, cached-token counts, prefix-cache statistics, and the page ids of
every call. Imported only by ``run_vllm_engine.py`` inside the vLLM side virtualenv.

The same recording proxy wraps vLLM's own ``KVCacheManager`` (run a) and pagekeeper's
(run b), so both logs are taken at the same seam: what the scheduler saw.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MAX_MODEL_LEN = 512
MAX_TOKENS = 24


@dataclass
class EngineConfig:
    """One engine configuration: ``block_size`` is what the engine (and its attention
    kernel) uses; ``num_blocks`` its KV cache in blocks (null block included)."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    hash_algo: str = "sha256_cbor"
    """The engine's ``prefix_caching_hash_algo``: by default the service's, so pages filled
    by generated tokens hash alike on both sides even without growth hashes; vLLM's own
    default "sha256" (pickle) makes the manager send the engine's hashes of those pages."""


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    prefix_stats: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    num_steps: int = 0
    num_preemptions: int = 0
    wall_s: float = 0.0
    """Generation wall time (engine start-up excluded)."""
    start_s: float = 0.0
    num_rpcs: int = 0
    manager_s: float = 0.0
    manager_stats: dict[str, Any] = field(default_factory=dict)
    replays: list[dict[str, float]] = field(default_factory=list)
    """Timed-only passes (``run_engine(replays=...)``)."""


class RecordingManager:
    """Pure delegation to a KV-cache manager, logging what the scheduler got back (page ids
    at ``page_ratio`` kernel blocks per page)."""

    def __init__(self, inner: Any, page_ratio: int, log: list[tuple[Any, ...]]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_ratio", page_ratio)
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "prefix_totals", {})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def _pages(self, blocks: Any) -> list[int]:
        ids = [b.block_id for b in blocks.blocks[0]] if blocks.blocks else []
        r = self._ratio
        pages = [i // r for i in ids[::r]]
        expected = [p * r + j for p in pages for j in range(r)]
        if ids != expected:
            raise AssertionError(f"kernel block ids {ids} are not whole pages of {r}")
        return pages

    def get_computed_blocks(self, request: Any) -> Any:
        blocks, num_hit, boundary = self._inner.get_computed_blocks(request)
        self._log.append(("lookup", request.request_id, self._pages(blocks), num_hit))
        return blocks, num_hit, boundary

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        out = self._inner.allocate_slots(request, num_new_tokens, *args, **kwargs)
        pages = None if out is None else self._pages(out)
        hit = kwargs.get("num_new_computed_tokens", 0)
        self._log.append(("allocate", request.request_id, num_new_tokens, hit, pages))
        return out

    def free(self, request: Any) -> None:
        self._log.append(("free", request.request_id))
        self._inner.free(request)

    def get_blocks(self, request_id: str) -> Any:
        out = self._inner.get_blocks(request_id)
        self._log.append(("get_blocks", request_id, self._pages(out)))
        return out

    def reset_prefix_cache(self) -> bool:
        ok = bool(self._inner.reset_prefix_cache())
        self._log.append(("reset_prefix_cache", ok))
        return ok

    def make_prefix_cache_stats(self) -> Any:
        stats = self._inner.make_prefix_cache_stats()
        if stats is not None:
            totals = self.prefix_totals
            for name in (
                "requests",
                "queries",
                "hits",
                "preempted_requests",
                "preempted_queries",
                "preempted_hits",
            ):
                totals[name] = totals.get(name, 0) + int(getattr(stats, name, 0))
        return stats


def make_recording_scheduler(base: type, page_ratio: int, log: list[tuple[Any, ...]]) -> type:
    """``base`` with its kv_cache_manager wrapped in a :class:`RecordingManager`, counting
    scheduling steps and preemptions."""

    class RecordingScheduler(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.kv_cache_manager = RecordingManager(self.kv_cache_manager, page_ratio, log)
            self.num_steps = 0
            self.num_preemptions = 0

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = super().schedule(*args, **kwargs)
            if out.total_num_scheduled_tokens:
                self.num_steps += 1
            return out

        def _preempt_request(self, *args: Any, **kwargs: Any) -> Any:
            self.num_preemptions += 1
            return super()._preempt_request(*args, **kwargs)

    return RecordingScheduler


def _make_llm(model_dir: str, config: EngineConfig, scheduler_cls: type) -> Any:
    from vllm import LLM

    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        num_gpu_blocks_override=config.num_blocks,
        seed=0,
        prefix_caching_hash_algo=config.hash_algo,
        disable_log_stats=False,  # the engine's prefix-cache statistics
        scheduler_cls=scheduler_cls,
    )


def _generate(
    llm: Any, waves: Sequence[Any], params: Any, result: RunResult | None
) -> dict[str, list[int]]:
    """One pass over the waves (prefix cache reset before the third)."""
    outputs: dict[str, list[int]] = {}
    prompts_by_name: dict[str, list[int]] = {}
    for index, wave in enumerate(waves):
        if index == 2 and not llm.reset_prefix_cache():
            raise AssertionError("reset_prefix_cache refused with no request running")
        named = wave(prompts_by_name, outputs) if callable(wave) else wave
        names = [name for name, _ in named]
        prompts = [{"prompt_token_ids": list(ids)} for _, ids in named]
        for name, ids in named:
            prompts_by_name[name] = list(ids)
        for name, out in zip(names, llm.generate(prompts, params, use_tqdm=False), strict=True):
            outputs[name] = list(out.outputs[0].token_ids)
            if result is not None:
                result.tokens[name] = outputs[name]
                result.num_cached_tokens[name] = int(out.num_cached_tokens or 0)
    return outputs


def run_engine(
    model_dir: str,
    config: EngineConfig,
    waves: Sequence[Any],
    *,
    manager: str,
    page_ratio: int = 1,
    address: str | None = None,
    replays: int = 0,
) -> RunResult:
    """Generate ``waves`` (each a list of ``(name, token_ids)``, or a callable of the prompts
    and outputs so far returning one) one after the other, with ``manager`` "vllm" or
    "pagekeeper"; the prefix cache is reset before the third wave. ``replays`` more passes
    (each after a reset, so each starts from the same empty cache) are timed only."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from pagekeeper_client.vllm import make_scheduler_class

    log: list[tuple[Any, ...]] = []
    if manager == "vllm":
        base: type = Scheduler
    elif manager == "pagekeeper":
        base = make_scheduler_class(address=address, name="vllm-engine-harness")
    else:
        raise ValueError(manager)
    scheduler_cls = make_recording_scheduler(base, page_ratio, log)
    result = RunResult()
    t0 = time.perf_counter()
    llm = _make_llm(model_dir, config, scheduler_cls)
    result.start_s = time.perf_counter() - t0
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    pk = getattr(scheduler, "pagekeeper_manager", None)
    try:
        params = SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False
        )
        t0 = time.perf_counter()
        _generate(llm, waves, params, result)
        result.wall_s = time.perf_counter() - t0
        result.calls = _normalize_ids(log)
        result.num_steps = scheduler.num_steps
        result.num_preemptions = scheduler.num_preemptions
        result.prefix_stats = dict(scheduler.kv_cache_manager.prefix_totals)
        if pk is not None:
            result.num_rpcs = pk.num_rpcs
            result.manager_s = pk.stats.manager_seconds
            result.manager_stats = {
                k: getattr(pk.stats, k) for k in pk.stats.__slots__ if k != "rpcs_at_start"
            }
            result.manager_stats["by_method"] = dict(pk.client.stats.by_method)
            result.manager_stats["num_local_calls"] = pk.client.stats.num_local_calls
            result.manager_stats["transport"] = pk.client.transport
        for _ in range(replays):
            if not llm.reset_prefix_cache():
                raise AssertionError("reset_prefix_cache refused between passes")
            steps0 = scheduler.num_steps
            rpcs0 = pk.num_rpcs if pk is not None else 0
            manager0 = pk.stats.manager_seconds if pk is not None else 0.0
            t0 = time.perf_counter()
            _generate(llm, waves, params, None)
            result.replays.append(
                {
                    "wall_s": time.perf_counter() - t0,
                    "num_steps": scheduler.num_steps - steps0,
                    "num_rpcs": (pk.num_rpcs - rpcs0) if pk is not None else 0,
                    "manager_s": (pk.stats.manager_seconds - manager0) if pk is not None else 0.0,
                }
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm, core, scheduler, pk
        gc.collect()
    return result


def _normalize_ids(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Engine request ids carry a per-process suffix in some vLLM versions: name them by
    order of first appearance so two runs compare."""
    names: dict[str, str] = {}
    out = []
    for entry in log:
        if len(entry) > 1 and isinstance(entry[1], str):
            rid = entry[1]
            name = names.setdefault(rid, f"r{len(names)}")
            entry = (entry[0], name, *entry[2:])
        out.append(entry)
    return out
