"""pagekeeper as vLLM's KV-cache manager: a ``scheduler_cls`` for the vLLM v1 engine (0.32).

::

    from vllm import LLM
    llm = LLM(model=..., scheduler_cls="pagekeeper_client.vllm.PagekeeperScheduler")
    # the service: $PAGEKEEPER_GRPC_ADDRESS (default 127.0.0.1:50051), token $PAGEKEEPER_TOKEN
    # (or the file $PAGEKEEPER_TOKEN_FILE),
    # TLS $PAGEKEEPER_TLS_CA_FILE (+ _CLIENT_CERT_FILE, _CLIENT_KEY_FILE)

:class:`PagekeeperScheduler` is vLLM's own ``Scheduler`` whose ``kv_cache_manager`` is replaced
by :class:`PagekeeperKVCacheManager` once ``Scheduler.__init__`` has run: every page the
engine uses is allocated, shared, cached and evicted by the pagekeeper service, and vLLM's
scheduling policy (budgets, preemption, chunked prefill) is untouched. vLLM is imported
lazily; it is never a dependency of this package. ``make_scheduler_class(...)`` builds a
variant with an explicit address or another base class.

The hot path (DESIGN section 3) -- per scheduling step::

    schedule() ──▶ running requests: allocate_slots ── pages cover it? ─ yes ─▶ local, no call
               │                                    └─ no: one Step ─▶ new page | None
               ├─▶ waiting requests: get_computed_blocks  (the prefix mirror, no call)
               │                      allocate_slots      (one Step: the admission)
               └─▶ end of schedule(): nothing
    update_from_output() ─▶ free(finished)  (queued, no call; one Step once the engine idles)

A call carries whatever is queued before it: frees, and the local progress of requests whose
decodes filled a page (that page must enter the service's prefix cache, in vLLM's order,
before anything can observe it: an admission that could hit it, a page-taking growth that
could cache a twin under the same hash, a free of the request). So a step costs one call per
admission and one per growth that needs a page -- about 0.3 calls per step in the proof
harness. With ``pregrant`` off (this scheduler never asks for it) the service's page ids are,
call for call, those vLLM's own ``KVCacheManager`` would return.

One pool per engine. A page's KV lives in this engine's memory only, so the engine needs a
pool of its own: at start-up it refuses a pool where another client holds requests and drops
whatever the prefix cache holds (an earlier engine's pages, whose KV died with it).

Prefix lookups cost no call: the manager keeps a mirror of the service's prefix-cache index
for its pages (which page holds which hash, duplicates in insertion order, a hash evicted
when the service hands its page out again), the bookkeeping vLLM's ``BlockPool`` keeps. It
is exact because the pool is the engine's own. Every admission's answer is checked against
the prediction; a difference means another client changed the pool, and the manager stops
with a ``RuntimeError`` rather than generate from pages whose KV it never computed.

Page size and kernel block size. The service's pool decides the page size ``P``; the
engine's ``block_size`` is the kernel block size ``K`` its attention backend and KV tensors
use, and ``P`` must be a multiple of it (``r = P / K``). Page ``p`` becomes the kernel blocks
``p*r .. p*r+r-1`` in every block id handed to the engine, so a token's slot
``kblock*K + pos % K`` equals ``p*P + pos % P`` and the worker needs no change::

    tokens      |0 ............ P-1|P ........... 2P-1|
    pages       |      page p      |      page q      |    what pagekeeper allocates
    kernel ids  |pr |pr+1|...|pr+r-1|qr |qr+1|...|qr+r-1|   what vLLM's worker indexes

Hashes. The engine's ``Request.block_hashes`` (its own chain, one hash every ``K`` tokens)
are sent as the page hashes, never recomputed; a page of ``r`` blocks is named by the last
block hash inside it, as vLLM's ``BlockHashListWithBlockSize`` does. A growth that completes
pages (a report, or the growth that needs a page) sends their hashes too
(``allocate_slots(page_hashes=...)``), so every page is named by the engine's hash whatever
its algorithm and ``r``, and a new prompt that contains another request's generated text (a
chat's next turn) hits the pages that text filled. Not needed (and not sent) with ``r == 1``
and the engine on the service's algorithm (``prefix_caching_hash_algo="sha256_cbor"``, the
default NONE_HASH seed): the service's hashes are then the engine's bit for bit. A service
that predates growth hashes (``PoolConfig.accepts_growth_page_hashes`` false) is sent none:
with vLLM's default pickle-based "sha256" or ``r > 1`` an admission then sends the hashes of
the prompt's pages only and the service extends the chain over generated tokens itself: a
preempted request still hits its own generated pages, but a chat's next turn misses the
pages the previous answer filled.

Not supported (each raises ``NotImplementedError`` naming it): KV connectors (P/D, offload),
speculative decoding, async scheduling (``AsyncScheduler``), pipeline parallelism, models with
several KV-cache groups or non-full attention (sliding window, chunked local, Mamba), LoRA
adapters, multimodal inputs and prompt embeddings, engine-side KV events, the admission
watermark, decode context parallelism, encoder-decoder models.
"""

from __future__ import annotations

import array
import hashlib
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from pagekeeper_client.client import PagekeeperClient, resolve_address
from pagekeeper_client.errors import FailedPreconditionError
from pagekeeper_client.types import AllocationStatus, ClientRole, ExtraKeys, GroupKind, cdiv

log = logging.getLogger("pagekeeper_client.vllm")

__all__ = [
    "ManagerStats",
    "PagekeeperKVCacheManager",
    "PagekeeperScheduler",  # noqa: F822 - built on first access (module __getattr__)
    "make_scheduler_class",
]

_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""The seed vLLM derives NONE_HASH from for sha256_cbor without PYTHONHASHSEED (and the one
the service always uses)."""
_ARRAY_INT_CODE = "i" if array.array("i").itemsize == 4 else "l"


def unsupported(feature: str) -> NotImplementedError:
    """The error every unsupported engine feature raises."""
    return NotImplementedError(
        f"pagekeeper's vLLM scheduler does not support {feature} (see docs/vllm.md)"
    )


# ---------------------------------------------------------------------------------------------
# The prefix-cache mirror
# ---------------------------------------------------------------------------------------------


class PrefixMirror:
    """The client's copy of the service's prefix-cache index (one full-attention group).

    Exact as long as this engine is the only scheduler of the pool: every page enters the
    index because one of its requests filled it, and leaves when the service hands it out
    again (it is then in some answer this client reads). Duplicates are kept as the service
    keeps them: a hash names its first cached page; later pages with the same hash wait in
    insertion order and take over when the first is evicted.
    """

    __slots__ = ("_dups", "_first", "_page_key")

    def __init__(self) -> None:
        self._first: dict[bytes, int] = {}
        self._dups: dict[bytes, list[int]] = {}
        self._page_key: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._page_key)

    def lookup(self, keys: Sequence[bytes], max_pages: int) -> list[int]:
        """Pages of the longest cached prefix, at most ``max_pages`` long."""
        first = self._first
        hit: list[int] = []
        for key in keys[:max_pages]:
            page = first.get(key)
            if page is None:
                break
            hit.append(page)
        return hit

    def key_of(self, page: int) -> bytes | None:
        return self._page_key.get(page)

    def insert(self, page: int, key: bytes) -> None:
        if page in self._page_key:
            self.evict(page)
        if key in self._first:
            self._dups.setdefault(key, []).append(page)
        else:
            self._first[key] = page
        self._page_key[page] = key

    def evict(self, page: int) -> bool:
        """Forget ``page``'s hash (it was handed out again); False when it had none."""
        key = self._page_key.pop(page, None)
        if key is None:
            return False
        waiting = self._dups.get(key)
        if self._first.get(key) == page:
            if waiting:
                self._first[key] = waiting.pop(0)
                if not waiting:
                    del self._dups[key]
            else:
                del self._first[key]
        elif waiting is not None:
            waiting.remove(page)
            if not waiting:
                del self._dups[key]
        return True

    def forget_key(self, key: bytes) -> None:
        """Drop every page cached under ``key`` (the service showed it does not hold it)."""
        for page in [self._first.get(key), *self._dups.get(key, ())]:
            if page is not None:
                self.evict(page)

    def clear(self) -> None:
        self._first.clear()
        self._dups.clear()
        self._page_key.clear()


# ---------------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ManagerStats:
    """Counters of one :class:`PagekeeperKVCacheManager` (cheap, always on)."""

    num_steps: int = 0
    """``schedule()`` calls (scheduling steps)."""
    num_admissions: int = 0
    """Admissions sent (one call each)."""
    num_local_growths: int = 0
    """``allocate_slots`` calls of running requests answered without a call."""
    num_sync_growths: int = 0
    """Growths that needed a page (one call each)."""
    num_no_capacity: int = 0
    """``allocate_slots`` answered ``None`` (the engine preempts)."""
    num_mispredicted: int = 0
    """Admissions whose cache hit differed from the mirror's prediction (fatal: another
    client changed the pool)."""
    num_reports: int = 0
    """Local progress reported in a later call (a decode that filled a page)."""
    num_frees: int = 0
    manager_seconds: float = 0.0
    """Wall time spent inside the manager's methods (calls included)."""
    rpcs_at_start: int = 0
    """The client's call count once registered (registration itself excluded)."""


@dataclass(slots=True, eq=False)
class _Pages:
    """One running request as the engine sees it through this manager.

    The service learns a request's progress lazily: ``num_computed`` runs ahead of
    ``num_computed_sent`` while decodes fit in the request's pages, and the difference
    travels in the request's next growth (a report, or the growth that needs a page).
    """

    request: Any
    """vLLM's ``Request`` (its token ids, for reports)."""
    page_ids: list[int]
    keys: list[bytes]
    """Mirror keys of the request's full pages, in order (grows with its tokens)."""
    num_client_hashed_pages: int
    """Pages named by the engine's hashes, which the admission and growths send (the
    service hashes the rest itself); ``sys.maxsize``: every page."""
    num_cached_pages: int = 0
    num_computed: int = 0
    """Tokens computed once this step's forward pass ran (the engine's view)."""
    num_computed_sent: int = 0
    """... as the service knows it."""
    num_tokens_sent: int = 0
    """Tokens the service has been told about."""


@dataclass(slots=True)
class _Lookup:
    """What ``get_computed_blocks`` predicted for a waiting request."""

    pages: list[int]
    keys: list[bytes]
    num_client_hashed_pages: int


@dataclass(slots=True)
class _Config:
    address: str | None = None
    token: str | None = None
    name: str = ""
    lease_ttl: float | None = None
    client_factory: Callable[[str | None, str | None], PagekeeperClient] | None = None


class _CoordinatorView:
    """What the engine reads of ``kv_cache_manager.coordinator`` at start-up (the group's
    block size and spec); anything else it would call on a coordinator is unsupported."""

    def __init__(self, single_type_managers: Sequence[Any]) -> None:
        self.single_type_managers = tuple(single_type_managers)

    def __getattr__(self, name: str) -> Any:
        raise unsupported(f"kv_cache_manager.coordinator.{name} (KV connectors)")


class PagekeeperKVCacheManager:
    """Every method vLLM 0.32's ``Scheduler`` calls on its ``KVCacheManager``, backed by the
    pagekeeper service through :class:`~pagekeeper_client.client.PagekeeperClient`.

    One full-attention KV-cache group; the pool's page size is a multiple ``r`` of the
    engine's block size (see the module docstring). Built by :class:`PagekeeperScheduler`;
    ``client`` must be registered as a scheduler.
    """

    def __init__(
        self,
        client: PagekeeperClient,
        *,
        kv_cache_config: Any,
        original: Any,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        log_stats: bool,
        hash_algorithm: str = "sha256",
    ) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.metrics.stats import PrefixCacheStats

        self._KVCacheBlocks = KVCacheBlocks
        self._PrefixCacheStats = PrefixCacheStats
        self.client = client
        pool = client.pool
        if len(pool.groups) != 1 or pool.groups[0].kind is not GroupKind.FULL:
            raise unsupported("a pagekeeper pool with several or non-full-attention groups")
        page_size = pool.groups[0].page_size
        if page_size % block_size:
            raise ValueError(
                f"the pool's page size {page_size} is not a multiple of the engine's "
                f"block_size {block_size} (the kernel block size)"
            )
        self.page_size = page_size
        self.kernel_block_size = block_size
        self.ratio = page_size // block_size
        self.num_pages = pool.num_pages
        num_kernel_blocks = int(kv_cache_config.num_blocks)
        if self.num_pages * self.ratio > num_kernel_blocks:
            raise ValueError(
                f"the pool's {self.num_pages} pages of {page_size} tokens need "
                f"{self.num_pages * self.ratio} kernel blocks of {block_size}; the engine's KV "
                f"cache has {num_kernel_blocks} (num_gpu_blocks_override)"
            )
        if pool.max_model_len < max_model_len:
            raise ValueError(
                f"the pool's max_model_len {pool.max_model_len} is below the engine's "
                f"{max_model_len}"
            )
        if enable_caching != pool.enable_prefix_caching:
            log.warning(
                "prefix caching is %s in the engine but %s in the pagekeeper pool; "
                "hits only where both enable it",
                "on" if enable_caching else "off",
                "on" if pool.enable_prefix_caching else "off",
            )
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching and pool.enable_prefix_caching
        self.log_stats = log_stats
        self.prefix_cache_stats: Any = PrefixCacheStats() if log_stats else None
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = 1
        self.enable_kv_cache_events = False
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.coordinator = _CoordinatorView(original.coordinator.single_type_managers)
        self.empty_kv_cache_blocks = KVCacheBlocks(((),))
        # The service extends a request's hash chain over the tokens growths append; those
        # are the engine's own block hashes only when a page is one engine block and both
        # hash alike (algorithm and NONE_HASH seed).
        self._service_hashes_like_engine = self.ratio == 1 and _engine_hashing_matches(
            pool.hash_algorithm, hash_algorithm
        )
        # Otherwise a service that takes a growth's page hashes gets the engine's for the
        # pages generated tokens complete too: every page is named by the engine's hash, so
        # a prompt containing another request's generated text (a chat's next turn) hits.
        self._sends_growth_hashes = (
            self.enable_caching
            and pool.accepts_growth_page_hashes
            and not self._service_hashes_like_engine
        )
        # One vLLM KVCacheBlock per kernel block id, shared by every request holding it (as
        # vLLM's pool shares its block objects), created on first use.
        self._block_objects: list[Any] = [None] * (self.num_pages * self.ratio)
        self._KVCacheBlock = KVCacheBlock
        self._mirror = PrefixMirror()
        self._requests: dict[str, _Pages] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._dirty: dict[str, None] = {}
        """Requests whose local decodes filled a page the service does not know about yet,
        in the order they filled it."""
        self._page_refs: Counter[int] = Counter()
        self.stats = ManagerStats(rpcs_at_start=client.stats.num_rpcs)

    # -- helpers -------------------------------------------------------------------------
    def _blocks(self, pages: Iterable[int]) -> list[Any]:
        """The kernel blocks (vLLM block objects) of these pages, in order."""
        objects = self._block_objects
        r = self.ratio
        out: list[Any] = []
        for page in pages:
            base = page * r
            for kid in range(base, base + r):
                block = objects[kid]
                if block is None:
                    block = objects[kid] = self._KVCacheBlock(block_id=kid)
                out.append(block)
        return out

    def _set_block_hash(self, page: int, key: bytes | None, num_tokens: int | None) -> None:
        # The scheduler (and estimate_cached_tokens) read a block's hash and the prefix
        # length it covers; vLLM's key is the hash with the group id appended.
        value = None if key is None else key + b"\x00\x00\x00\x00"
        for block in self._blocks((page,)):
            block._block_hash = value
            block._block_hash_num_tokens = num_tokens

    def _take_new_pages(self, pages: Sequence[int]) -> None:
        """Pages the service just handed out: any hash they held is evicted."""
        for page in pages:
            if self._mirror.evict(page):
                self._set_block_hash(page, None, None)
            self._page_refs[page] += 1

    def _page_keys(self, request: Any, keys: list[bytes], num_client_pages: int) -> list[bytes]:
        """Extend ``keys`` to every full page of the request's known tokens."""
        num_full = request.num_tokens // self.page_size
        if len(keys) >= num_full:
            return keys
        r = self.ratio
        block_hashes = request.block_hashes
        for i in range(len(keys), num_full):
            if i < num_client_pages:
                # A page of r engine blocks is named by the last block hash inside it.
                keys.append(bytes(block_hashes[(i + 1) * r - 1]))
            else:
                keys.append(self._service_key(request, keys[i - 1] if i else None, i))
        return keys

    def _service_key(self, request: Any, parent: bytes | None, index: int) -> bytes:
        """A mirror key for a page the service hashed itself (parent hash + tokens): equal
        inputs give equal keys, as they give the service equal hashes. Local only, never
        sent."""
        ps = self.page_size
        tokens = array.array(_ARRAY_INT_CODE, request.all_token_ids[index * ps : (index + 1) * ps])
        digest = hashlib.blake2b(digest_size=24)
        digest.update(parent or b"root:" + (request.cache_salt or "").encode())
        digest.update(tokens.tobytes())
        return b"svc:" + digest.digest()

    def _num_client_hashed_pages(self, request: Any) -> int:
        if self._sends_growth_hashes:
            return self._engine_hashed(request, sys.maxsize)
        if self._service_hashes_like_engine:
            return sys.maxsize
        # The prompt's full pages; the service extends the chain over the output.
        return int(request.num_prompt_tokens) // self.page_size

    def _engine_hashed(self, request: Any, num_client_pages: int) -> int:
        """``num_client_pages``, or fewer when growths send the engine's hashes and the
        engine has not hashed every full page of the request within it: pages from the
        first one without an engine hash on are then the service's to hash (and the mirror
        keys them so), for good. (vLLM hashes a block as soon as its tokens are known; this
        keeps the mirror right should it not.)"""
        if not self._sends_growth_hashes:
            return num_client_pages
        num_hashed = len(request.block_hashes) // self.ratio
        if num_hashed >= num_client_pages or num_hashed >= request.num_tokens // self.page_size:
            return num_client_pages
        log.warning(
            "request %r: the engine hashed %d of its %d full pages; the service hashes the rest",
            request.request_id,
            num_hashed,
            request.num_tokens // self.page_size,
        )
        return num_hashed

    def _growth_hashes(self, state: _Pages, request: Any, num_tokens: int) -> list[bytes] | None:
        """The engine's hashes of the pages a growth to ``num_tokens`` tokens completes
        (from the first full page the service has no hash for), when this manager sends
        them; the mirror's keys of those pages, which the service then uses too."""
        if not self._sends_growth_hashes:
            return None
        ps = self.page_size
        first = state.num_tokens_sent // ps
        if num_tokens // ps <= first:
            return None  # completes no page
        keys = self._keys(state, request)
        end = min(num_tokens // ps, state.num_client_hashed_pages)
        return keys[first:end] if end > first else None

    def _keys(self, state: _Pages, request: Any) -> list[bytes]:
        """The mirror keys of every full page of a running request (:meth:`_page_keys`),
        the engine's hashes as far as it has hashed them."""
        state.num_client_hashed_pages = self._engine_hashed(request, state.num_client_hashed_pages)
        return self._page_keys(request, state.keys, state.num_client_hashed_pages)

    def _cache(self, state: _Pages, request: Any, num_tokens: int) -> bool:
        """Enter the request's newly full pages (up to ``num_tokens``) into the mirror, as
        the service does when it applies the same call; True when some page was full."""
        if not self.enable_caching:
            return False
        ps = self.page_size
        num_full = min(num_tokens, request.num_tokens) // ps
        if num_full <= state.num_cached_pages:
            return False
        keys = self._keys(state, request)
        for i in range(state.num_cached_pages, num_full):
            page = state.page_ids[i]
            self._mirror.insert(page, keys[i])
            self._set_block_hash(page, keys[i], (i + 1) * ps)
        state.num_cached_pages = num_full
        return True

    def _forget_unreported(self, request_id: str, state: _Pages) -> None:
        """An admin freed the request on the service: the pages it filled here since its
        last report were never cached there, so they leave the mirror (a prefix hit on them
        would be predicted that the service does not answer), and there is nothing left to
        report."""
        self._dirty.pop(request_id, None)
        kept = state.num_computed_sent // self.page_size
        for page in state.page_ids[kept : state.num_cached_pages]:
            if self._mirror.evict(page):
                self._set_block_hash(page, None, None)
        state.num_cached_pages = min(state.num_cached_pages, kept)

    def _report(self, upto: str | None = None, *, including: bool = False) -> None:
        """Queue (no call) the growths of requests whose local decodes filled a page, in the
        order they filled them, so the service caches those pages in vLLM's order before
        anything that can observe it: an admission (a hit), a page-taking growth (another
        page with the same hash), a free of the request (cached pages are freed to the tail).
        Stops before ``upto`` (its own growth carries its report) or after it
        (``including``)."""
        dirty = self._dirty
        while dirty:
            request_id = next(iter(dirty))
            if request_id == upto and not including:
                del dirty[request_id]
                return
            del dirty[request_id]
            state = self._requests[request_id]
            request = state.request
            if self.client.is_revoked(request_id):
                self._forget_unreported(request_id, state)
                continue
            self.stats.num_reports += 1
            num_tokens = request.num_tokens
            got = self.client.allocate_slots(
                request_id,
                state.num_computed - state.num_computed_sent,
                new_token_ids=request.all_token_ids[state.num_tokens_sent : num_tokens],
                num_computed_tokens=state.num_computed_sent,
                page_hashes=self._growth_hashes(state, request, num_tokens),
            )
            if got.status is AllocationStatus.NO_CAPACITY and self.client.is_revoked(request_id):
                self._forget_unreported(request_id, state)  # learnt from a flush just now
                continue
            state.num_computed_sent = state.num_computed
            state.num_tokens_sent = num_tokens
            if request_id == upto:
                return

    def _check_request(self, request: Any) -> None:
        if request.lora_request is not None:
            raise unsupported("LoRA adapters")
        if request.mm_features:
            raise unsupported("multimodal inputs")
        if getattr(request, "prompt_embeds", None) is not None:
            raise unsupported("prompt embeddings")
        if getattr(request, "num_output_placeholders", 0):
            raise unsupported("async scheduling (output placeholders)")

    def _wrap(self, pages: Sequence[int]) -> Any:
        if not pages:
            return self.empty_kv_cache_blocks
        return self._KVCacheBlocks((self._blocks(pages),))

    # -- prefix cache ----------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of allocatable pages in use (vLLM: ``1 - free / (num_pages - 1)``)."""
        return len(self._page_refs) / (self.num_pages - 1) if self.num_pages > 1 else 0.0

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Any) -> tuple[Any, int, int]:
        """The cached prefix of a waiting request, from the mirror (no call, no side
        effect). The prompt's last token is never a hit."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        start = time.perf_counter()
        self._check_request(request)
        num_client_pages = self._num_client_hashed_pages(request)
        keys = self._page_keys(request, [], num_client_pages)
        pages = self._mirror.lookup(keys, (request.num_tokens - 1) // self.page_size)
        self._lookups[request.request_id] = _Lookup(pages, keys, num_client_pages)
        self.stats.manager_seconds += time.perf_counter() - start
        return self._wrap(pages), len(pages) * self.page_size, 0

    def get_computed_blocks_for_connector(self, request: Any) -> tuple[Any, int, int, bool]:
        # Only hybrid Mamba models diverge here; a single group answers as usual.
        return (*self.get_computed_blocks(request), False)

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        if num_computed_tokens % self.page_size:
            raise ValueError(
                f"{num_computed_tokens} computed tokens do not end on a page of {self.page_size}"
            )
        kept = (num_computed_tokens // self.page_size) * self.ratio
        return (
            self._KVCacheBlocks((list(blocks.blocks[0][:kept]),))
            if kept
            else (self.empty_kv_cache_blocks)
        )

    # -- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        """Pages for ``num_new_tokens`` more tokens (+ lookahead): only the newly allocated
        blocks, the shared empty blocks when none were needed, or None when the pool is
        out of pages (nothing changed; the engine preempts)."""
        del has_scheduled_reqs, skip_zeroing_group_ids  # no watermark, nothing to zero
        if num_external_computed_tokens or delay_cache_blocks or reserved_blocks:
            raise unsupported("KV connectors (external or asynchronously loaded tokens)")
        if num_encoder_tokens:
            raise unsupported("encoder-decoder models (cross-attention pages)")
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        start = time.perf_counter()
        try:
            state = self._requests.get(request.request_id)
            if state is None:
                return self._admit(
                    request,
                    num_new_tokens,
                    num_new_computed_tokens,
                    new_computed_blocks,
                    num_lookahead_tokens,
                    full_sequence_must_fit,
                )
            if num_new_computed_tokens or (
                new_computed_blocks is not None and any(new_computed_blocks.blocks)
            ):
                raise unsupported("cache hits for a running request (KV connectors)")
            return self._grow(state, request, num_new_tokens, num_lookahead_tokens)
        finally:
            self.stats.manager_seconds += time.perf_counter() - start

    def _admit(
        self,
        request: Any,
        num_new_tokens: int,
        num_hit_tokens: int,
        hit_blocks: Any,
        num_lookahead_tokens: int,
        full_sequence_must_fit: bool,
    ) -> Any:
        self._check_request(request)
        request_id = request.request_id
        if request.num_computed_tokens:
            raise unsupported("admitting a request with computed tokens (KV connectors)")
        lookup = self._lookups.pop(request_id, None)
        ps, r = self.page_size, self.ratio
        if num_hit_tokens % ps:
            raise ValueError(f"a cache hit of {num_hit_tokens} tokens is not whole pages of {ps}")
        hit_pages: list[int] = []
        if num_hit_tokens:
            hit_pages = [b.block_id // r for b in hit_blocks.blocks[0][::r]]
            if len(hit_pages) * ps != num_hit_tokens:
                raise ValueError(
                    f"request {request_id!r}: {len(hit_pages)} hit pages for {num_hit_tokens} "
                    "hit tokens"
                )
        if full_sequence_must_fit and not self._full_sequence_fits(request, hit_pages):
            self.stats.num_no_capacity += 1
            return None
        num_client_pages = (
            lookup.num_client_hashed_pages
            if lookup is not None
            else self._num_client_hashed_pages(request)
        )
        page_hashes: list[bytes] | None = None
        if self.enable_caching:
            block_hashes = request.block_hashes
            num_pages = min(len(block_hashes) // r, num_client_pages)
            page_hashes = [bytes(block_hashes[(i + 1) * r - 1]) for i in range(num_pages)]
        self._report()
        self.stats.num_admissions += 1
        result = self.client.admit(
            request_id,
            request.all_token_ids,
            num_new_tokens=num_new_tokens,
            page_hashes=page_hashes,
            extra_keys=ExtraKeys(cache_salt=request.cache_salt) if request.cache_salt else None,
            num_lookahead_tokens=num_lookahead_tokens,
            # Read the cache whenever the engine looked it up and kept what it found (the
            # answer is checked against the prediction below).
            enable_cache_read=lookup is not None and num_hit_tokens == len(lookup.pages) * ps,
        )
        if result.status is AllocationStatus.NO_CAPACITY:
            self.stats.num_no_capacity += 1
            return None
        got_hits = result.hit_page_ids[0].tolist() if result.hit_page_ids else []
        if result.status is AllocationStatus.REJECTED or got_hits != hit_pages:
            self._foreign_change(request, hit_pages, result.status, got_hits)
        new_pages = result.new_page_ids[0].tolist() if result.new_page_ids else []
        keys = lookup.keys if lookup is not None else []
        computed = num_hit_tokens + num_new_tokens
        state = _Pages(
            request,
            hit_pages + new_pages,
            keys,
            num_client_pages,
            num_cached_pages=len(hit_pages),
            num_computed=computed,
            num_computed_sent=computed,
        )
        for page in hit_pages:
            self._page_refs[page] += 1
        self._take_new_pages(new_pages)
        self._requests[request_id] = state
        self._cache(state, request, num_hit_tokens + num_new_tokens)
        state.num_tokens_sent = request.num_tokens
        return self._wrap(new_pages)

    def _full_sequence_fits(self, request: Any, hit_pages: Sequence[int]) -> bool:
        """vLLM's admission gate (``scheduler_reserve_full_isl``, on by default): the whole
        prompt, not just its first chunk, must fit in the free pages; hit pages that sit in
        the free queue count against them. Checked locally, without a call: this engine
        owns every page of the pool that is in use, so it knows the free count exactly."""
        num_tokens = min(int(request.num_tokens), self.max_model_len)
        refs = self._page_refs
        num_evictable_hits = sum(1 for page in hit_pages if page not in refs)
        needed = cdiv(num_tokens, self.page_size) - len(hit_pages) + num_evictable_hits
        return needed <= self.num_pages - 1 - len(refs)

    def _foreign_change(
        self, request: Any, predicted: list[int], status: AllocationStatus, got: list[int]
    ) -> NoReturn:
        """The service's hit differs from the mirror's prediction: something other than this
        engine changed the pool. Its pages hold no KV in this engine's memory, and the
        admission may already have entered pages into the prefix cache that the engine
        would never compute; going on could generate from garbage, so stop loudly."""
        self.stats.num_mispredicted += 1
        if status is AllocationStatus.OK:
            self.client.free_later(request.request_id)
            self.client.flush()
        raise RuntimeError(
            f"request {request.request_id!r}: the pagekeeper pool answered a prefix hit on "
            f"pages {got} where this engine expected {predicted} ({status.value}): another "
            "client changed the pool. A vLLM engine needs a pagekeeper pool of its own (its KV "
            "memory is its own); give it a dedicated `pagekeeper serve`."
        )

    def _grow(
        self, state: _Pages, request: Any, num_new_tokens: int, num_lookahead_tokens: int
    ) -> Any:
        self._check_request(request)
        request_id = request.request_id
        target = request.num_computed_tokens + num_new_tokens
        num_slots = min(target + num_lookahead_tokens, self.max_model_len)
        if self.client.is_revoked(request_id):
            # An admin freed it on the service (its pages may be another's now): no room,
            # so the engine preempts it and frees it, which the service takes as done.
            self._forget_unreported(request_id, state)
            self.stats.num_no_capacity += 1
            return None
        if cdiv(num_slots, self.page_size) <= len(state.page_ids):
            # The request's pages cover it: answered here, reported later (no call).
            self.stats.num_local_growths += 1
            state.num_computed = target
            if self._cache(state, request, target):
                self._dirty.setdefault(request_id)
            return self.empty_kv_cache_blocks
        # A page is needed: one call, carrying the reports due before it and the request's
        # own progress since its last call.
        self._report(upto=request_id)
        num_tokens = request.num_tokens
        got = self.client.allocate_slots(
            request_id,
            target - state.num_computed_sent,
            new_token_ids=request.all_token_ids[state.num_tokens_sent : num_tokens],
            num_computed_tokens=state.num_computed_sent,
            num_lookahead_tokens=num_lookahead_tokens,
            sync=True,
            page_hashes=self._growth_hashes(state, request, num_tokens),
        )
        if got.status is AllocationStatus.NO_CAPACITY:
            self.stats.num_no_capacity += 1
            if self.client.is_revoked(request_id):
                self._forget_unreported(request_id, state)
            elif state.num_cached_pages > state.num_computed_sent // self.page_size:
                # Nothing changed for it on the service: its report is still due, first.
                self._dirty = {request_id: None, **self._dirty}
            return None
        if got.status is not AllocationStatus.OK or got.is_local:
            raise RuntimeError(
                f"request {request_id!r}: the service answered {got.status.value} "
                f"(local={got.is_local}) to a growth that needs a page: {got.reason}"
            )
        self.stats.num_sync_growths += 1
        state.num_computed = state.num_computed_sent = target
        state.num_tokens_sent = num_tokens
        new_pages = got.new_page_ids[0].tolist() if got.new_page_ids else []
        self._take_new_pages(new_pages)
        state.page_ids.extend(new_pages)
        self._cache(state, request, target)
        return self._wrap(new_pages)

    def free(self, request: Any) -> None:
        """Release the request's pages (queued: sent with the next call)."""
        request_id = request.request_id
        self._lookups.pop(request_id, None)
        if request_id not in self._requests:
            return
        start = time.perf_counter()
        self.stats.num_frees += 1
        if request_id in self._dirty:
            # Its filled pages must be cached before it is freed (they go to the tail).
            self._report(upto=request_id, including=True)
        state = self._requests.pop(request_id)
        self.client.free_later(request_id)
        refs = self._page_refs
        for page in state.page_ids:
            refs[page] -= 1
            if refs[page] <= 0:
                del refs[page]
        self.stats.manager_seconds += time.perf_counter() - start

    def end_step(self) -> None:
        """End of ``schedule()``. Nothing is sent: frees and reports wait for the next call
        that needs them (or for :meth:`flush` when the engine goes idle)."""
        self.stats.num_steps += 1

    def flush(self) -> None:
        """Send every report and queued free now (the engine went idle: the service's view
        should not wait for a next step that may be far away)."""
        start = time.perf_counter()
        self._report()
        self.client.flush()
        self.stats.manager_seconds += time.perf_counter() - start

    # -- reads ---------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> Any:
        state = self._requests.get(request_id)
        return self._wrap(state.page_ids) if state is not None else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        ids: tuple[list[int], ...] = self.get_blocks(request_id).get_block_ids()
        return ids

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        (ids,) = self.get_block_ids(request_id)
        return (ids[: cdiv(num_computed_tokens, self.kernel_block_size)],)

    def get_page_ids(self, request_id: str) -> list[int]:
        """The request's pages (not kernel blocks), for tests and tools."""
        state = self._requests.get(request_id)
        return list(state.page_ids) if state is not None else []

    def estimate_cached_tokens(self, request: Any) -> int:
        """Prefix tokens the request's pages hold in the prefix cache (its hits and the
        pages it filled)."""
        state = self._requests.get(request.request_id)
        return state.num_cached_pages * self.page_size if state is not None else 0

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        del running_request_id  # cascade attention is gone from vLLM; kept for its callers
        return [0]

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> Any:
        return self._KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # -- per-step drains (nothing of the kind with one full-attention group) ---------------
    def new_step_starts(self) -> None:
        pass

    def take_events(self) -> list[Any]:
        # Engine-side KV events are refused at start-up; the service streams its own
        # (WatchEvents).
        return []

    def take_new_block_ids(self) -> list[int]:
        return []  # only Mamba / zeroing-backend pools record new blocks

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []  # copy-on-write is for Mamba partial hits

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}  # Mamba "align" boundary states only

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        del request
        return []  # Mamba "align" partial tails only

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        # Full attention never drops pages (vLLM's FullAttentionManager: a no-op too).
        del request_id, processed_computed_tokens, num_prompt_tokens

    # -- admin ---------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop the service's prefix cache; refused (False) while any request holds pages."""
        if self._requests:
            return False
        self.flush()
        try:
            self.client.reset_prefix_cache()
        except FailedPreconditionError as exc:
            log.warning("reset_prefix_cache refused: %s", exc)
            return False
        for page in list(range(1, self.num_pages)):
            if self._mirror.key_of(page) is not None:
                self._set_block_hash(page, None, None)
        self._mirror.clear()
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    # -- connector / deferred-free paths ---------------------------------------------------
    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        del request, num_computed_tokens
        raise unsupported("cache_blocks (async scheduling, KV connectors)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        del block_ids
        raise unsupported("evict_blocks (KV connectors with invalid blocks)")

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        del request
        raise unsupported("deferred block frees (KV connectors)")

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        del request_id, start_token
        raise unsupported("record_blocks_for_zeroing (failed async KV loads)")

    @property
    def block_pool(self) -> Any:
        raise unsupported("direct block-pool access (deferred frees, copy-on-write)")

    # -- life cycle ----------------------------------------------------------------------
    @property
    def num_rpcs(self) -> int:
        """Calls made since the manager started (registration excluded)."""
        return self.client.stats.num_rpcs - self.stats.rpcs_at_start

    def close(self) -> None:
        """Send what is queued, unregister (the service frees what is left) and close."""
        try:
            self.flush()
        finally:
            self.client.close()


def _engine_hashing_matches(pool_algorithm: str, engine_algorithm: str) -> bool:
    """Whether the service hashes appended pages exactly as this engine hashes blocks: the
    same CBOR algorithm (vLLM's default "sha256" pickles, the service cannot match it) and
    the same NONE_HASH seed."""
    if engine_algorithm != pool_algorithm or pool_algorithm not in ("sha256_cbor", "xxhash_cbor"):
        return False
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:  # pragma: no cover - only inside a vLLM engine
        return False
    getter = getattr(kv_cache_utils, "get_none_hash_seed", None)
    seed = getter() if getter is not None else getattr(kv_cache_utils, "_NONE_HASH_SEED", None)
    return seed == _DEFAULT_NONE_HASH_SEED


# ---------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------


def _check_engine(scheduler: Any, vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse, by name, every engine feature the manager does not implement."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if getattr(scheduler, "connector", None) is not None:
        raise unsupported("KV connectors (kv_transfer_config)")
    if getattr(scheduler, "ec_connector", None) is not None:
        raise unsupported("encoder-cache connectors (ec_transfer_config)")
    if vllm_config.speculative_config is not None:
        raise unsupported("speculative decoding")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise unsupported("async scheduling")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise unsupported("pipeline parallelism")
    if getattr(scheduler, "dcp_world_size", 1) > 1:
        raise unsupported("decode context parallelism")
    if getattr(scheduler, "is_encoder_decoder", False):
        raise unsupported("encoder-decoder models")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise unsupported(f"models with {len(groups)} KV-cache groups (hybrid models)")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
        raise unsupported(f"{type(spec).__name__} layers (only full attention)")
    if getattr(vllm_config.scheduler_config, "watermark", 0.0):
        raise unsupported("the admission watermark (scheduler_config.watermark)")
    if getattr(scheduler, "enable_kv_cache_events", False):
        raise unsupported(
            "engine-side KV cache events (the service publishes the pool's, in the same "
            "format: pagekeeper serve --kv-events-endpoint)"
        )
    if getattr(scheduler, "needs_kv_cache_zeroing", False):
        raise unsupported("backends that need new KV blocks zeroed")
    if scheduler.hash_block_size != scheduler.block_size:
        raise unsupported("a hash block size other than the block size")


def _install(scheduler: Any, config: _Config) -> None:
    """Replace the scheduler's ``kv_cache_manager`` (built by ``Scheduler.__init__``)."""
    vllm_config = scheduler.vllm_config
    kv_cache_config = scheduler.kv_cache_config
    _check_engine(scheduler, vllm_config, kv_cache_config)
    address = resolve_address(config.address)
    if config.client_factory is not None:
        client = config.client_factory(address, config.token)
    else:
        client = PagekeeperClient(address, token=config.token)
    try:
        client.register(ClientRole.SCHEDULER, name=config.name, lease_ttl=config.lease_ttl)
        _claim_pool(client, address)
        manager = PagekeeperKVCacheManager(
            client,
            kv_cache_config=kv_cache_config,
            original=scheduler.kv_cache_manager,
            block_size=scheduler.block_size,
            max_model_len=scheduler.max_model_len,
            enable_caching=bool(scheduler.cache_config.enable_prefix_caching),
            log_stats=bool(scheduler.log_stats),
            hash_algorithm=str(scheduler.cache_config.prefix_caching_hash_algo),
        )
    except BaseException:
        client.close()
        raise
    scheduler.pagekeeper_manager = manager
    log.info(
        "pagekeeper at %s: pages of %d tokens = %d kernel blocks of %d, %d pages",
        address,
        manager.page_size,
        manager.ratio,
        manager.kernel_block_size,
        manager.num_pages,
    )
    scheduler.kv_cache_manager = manager


def _claim_pool(client: PagekeeperClient, address: str) -> None:
    """A vLLM engine's pages hold KV only in its own memory: the pool must be its own. No
    other scheduler may hold requests in it, and whatever the prefix cache holds (a previous
    engine's pages, whose KV died with it) must go before the first lookup."""
    counters = client.pool_info().counters
    if counters.num_requests:
        raise RuntimeError(
            f"the pagekeeper pool at {address} holds {counters.num_requests} requests of "
            "another client; a vLLM engine needs a pool of its own"
        )
    try:
        num_dropped = client.reset_prefix_cache()
    except FailedPreconditionError as exc:
        raise RuntimeError(
            f"the pagekeeper pool at {address} is in use by another client ({exc.reason}); "
            "a vLLM engine needs a pool of its own"
        ) from None
    if num_dropped:
        log.info("dropped %d cached pages of an earlier engine (their KV is gone)", num_dropped)


def make_scheduler_class(
    base: type | None = None,
    *,
    address: str | None = None,
    token: str | None = None,
    name: str = "",
    lease_ttl: float | None = None,
    client_factory: Callable[[str | None, str | None], PagekeeperClient] | None = None,
) -> type:
    """A ``scheduler_cls`` for vLLM whose KV pages come from pagekeeper.

    ``base``: the vLLM scheduler class to extend (default ``vllm.v1.core.sched.scheduler.
    Scheduler``; ``AsyncScheduler`` is not supported). ``address``: the service
    (default ``$PAGEKEEPER_GRPC_ADDRESS``, else ``127.0.0.1:50051``); ``token``: its bearer
    token (default ``$PAGEKEEPER_TOKEN``, else ``$PAGEKEEPER_TOKEN_FILE``).
    ``client_factory(address, token)`` builds the client instead (tests count calls with it).
    """
    if base is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        base = Scheduler
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    except ImportError:  # pragma: no cover - older vLLM
        AsyncScheduler = None
    if AsyncScheduler is not None and issubclass(base, AsyncScheduler):
        raise unsupported("async scheduling (AsyncScheduler)")
    config = _Config(address, token, name, lease_ttl, client_factory)

    class _PagekeeperScheduler(base):  # type: ignore[valid-type,misc]
        """vLLM's scheduler with its KV pages allocated by the pagekeeper service."""

        pagekeeper_config = config

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _install(self, self.pagekeeper_config)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            output = super().schedule(*args, **kwargs)
            self.pagekeeper_manager.end_step()
            return output

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            outputs = super().update_from_output(*args, **kwargs)
            if not self.has_unfinished_requests():
                self.pagekeeper_manager.flush()  # idle now: release the last pages
            return outputs

        def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
            finished = super().finish_requests(*args, **kwargs)
            if not self.has_unfinished_requests():
                self.pagekeeper_manager.flush()
            return finished

        def shutdown(self) -> None:
            try:
                super().shutdown()
            finally:
                # The manager, even when something wraps kv_cache_manager (a recorder).
                manager = getattr(self, "pagekeeper_manager", None)
                if manager is not None:
                    manager.close()

    _PagekeeperScheduler.__name__ = _PagekeeperScheduler.__qualname__ = "PagekeeperScheduler"
    _PagekeeperScheduler.__module__ = __name__
    return _PagekeeperScheduler


def __getattr__(name: str) -> Any:
    # ``scheduler_cls="pagekeeper_client.vllm.PagekeeperScheduler"`` resolves here: the class
    # (and vLLM with it) is built on first use, so importing this module needs no vLLM.
    if name == "PagekeeperScheduler":
        cls = make_scheduler_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
