"""The facade: one object owning the pool, the prefix cache, every request's pages.

SKELETON: signatures are fixed (other modules code against them); bodies land next.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagekeeper.core.config import PoolConfig
from pagekeeper.core.events import KVEvent
from pagekeeper.core.types import (
    Allocation,
    BatchTables,
    ExtraKeys,
    LookupResult,
    PoolStats,
    RequestInfo,
)


class PageManager:
    """Owns physical page allocation and block-table construction for one pool.

    Single writer, deterministic, no I/O. Mirrors vLLM v1's ``KVCacheManager`` on a single
    full-attention group with prefix caching (same page ids, hits and evictions).
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config

    # -- reads ---------------------------------------------------------------------------
    def lookup(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | None = None,
    ) -> LookupResult:
        """Longest cached prefix (all groups agree on it), no side effects."""
        raise NotImplementedError

    def has_request(self, request_id: str) -> bool:
        raise NotImplementedError

    def request_info(self, request_id: str) -> RequestInfo:
        """Raises NotFound."""
        raise NotImplementedError

    def page_table(self, request_id: str, group_id: int = 0) -> np.ndarray:
        """The request's physical table (int32 copy; null page 0 where skipped)."""
        raise NotImplementedError

    def stats(self) -> PoolStats:
        raise NotImplementedError

    # -- mutations -----------------------------------------------------------------------
    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray,
        *,
        num_new_tokens: int | None = None,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | None = None,
        num_lookahead_tokens: int = 0,
        enable_cache_read: bool = True,
        owner: str = "",
    ) -> Allocation | None:
        """Prefix lookup + touch + allocation for a new (or resumed) request, atomically.

        ``token_ids``: every token known (prompt, plus output so far for a resumed request).
        ``num_new_tokens``: tokens to compute now, after the cached prefix (default: all the
        rest). Returns None (and changes nothing but sliding-window releases) when pages
        run out. Raises AlreadyExists / InvalidArgument.
        """
        raise NotImplementedError

    def allocate(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        new_token_ids: Sequence[int] | np.ndarray = (),
        num_computed_tokens: int | None = None,
        num_lookahead_tokens: int = 0,
    ) -> Allocation | None:
        """Grow a running request: append ``new_token_ids`` (tokens generated since its last
        step), then make room for ``num_new_tokens`` more computed tokens (+ lookahead).
        ``num_computed_tokens`` defaults to what the manager tracked. None = no capacity."""
        raise NotImplementedError

    def free(self, request_id: str) -> None:
        """Release every page of the request (groups in order, each last to first)."""
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; refused (False) while any request holds pages."""
        raise NotImplementedError

    def take_events(self) -> list[KVEvent]:
        raise NotImplementedError

    # -- publication ---------------------------------------------------------------------
    def build_batch(
        self,
        request_ids: Sequence[str],
        kernel_block_sizes: Sequence[int] | None = None,
        *,
        num_scheduled_tokens: Sequence[int] | None = None,
        pad_id: int = 0,
    ) -> list[BatchTables]:
        """Per group: the kernel block table of these requests in this order, their row
        lengths, and the slot mapping of the tokens each was last allocated for."""
        raise NotImplementedError

    # -- integrity -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        raise NotImplementedError
