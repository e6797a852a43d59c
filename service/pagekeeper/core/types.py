"""Plain value types of the core's public API."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class MultiModalKey:
    """One multimodal input of a request: its content hash (identifier) and the token range
    ``[offset, offset + length)`` its placeholder occupies. Pages that overlap the range
    carry the identifier in their hash."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What besides token ids goes into a page hash (vLLM's ``extra_keys``)."""

    lora_name: str | None = None
    lora_path: str | None = None
    mm_inputs: tuple[MultiModalKey, ...] = ()
    cache_salt: str | None = None

    @property
    def is_empty(self) -> bool:
        return self.lora_name is None and not self.mm_inputs and self.cache_salt is None


NO_EXTRA_KEYS = ExtraKeys()


@dataclass(slots=True)
class Allocation:
    """The answer to a successful admission or growth.

    ``new_page_ids[g]`` are the pages newly handed to the request in group ``g`` this call,
    in table order (what vLLM's ``allocate_slots`` returns). ``hit_page_ids[g]`` are the
    cached pages an admission reused (empty for growth). ``num_cached_tokens`` is the prefix
    length served from the cache (0 for growth).
    """

    request_id: str
    num_cached_tokens: int
    new_page_ids: tuple[tuple[int, ...], ...]
    hit_page_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest cached prefix for some tokens, found without touching anything."""

    num_hit_tokens: int
    page_ids: tuple[tuple[int, ...], ...]
    page_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    page_ids: tuple[tuple[int, ...], ...]
    owner: str = ""


class RunningRequest(Protocol):
    """A running request as the core tracks it (:attr:`PageManager.requests`), for a
    caller that checks a whole step against the core's own numbers before applying it.
    Read it, never change it: the core alone does."""

    @property
    def owner(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]:
        """Every token so far (its length is the request's token count)."""
        ...

    @property
    def num_computed_tokens(self) -> int: ...


class RunningRows(NamedTuple):
    """:meth:`PageManager.running_rows`' answer: a batch of running requests, in order,
    with the maxima a caller checks a step's limits against."""

    requests: list[RunningRequest]
    max_tokens: int
    """The most tokens any of them has (0 for none)."""
    max_computed: int
    """The highest ``num_computed_tokens`` (0 for none)."""
    max_ahead: int
    """The most ``num_computed_tokens - len(token_ids)`` (computed past the tokens after
    speculative lookahead; 0 for none)."""


@dataclass(frozen=True, slots=True)
class BatchTables:
    """One group's tables for a published batch (rows in batch order).

    ``block_table[i, :row_lengths[i]]`` are request i's kernel block ids; the rest of the row
    is padding (``pad_id``, by default 0: the null page's first kernel block, which kernels
    never read past a row's length). ``slot_mapping`` holds one slot per scheduled token,
    in batch order; slots do not depend on the kernel block size.
    """

    group_id: int
    kernel_block_size: int
    block_table: Int32Array
    row_lengths: Int32Array
    slot_mapping: Int64Array
    pad_id: int = 0


@dataclass(slots=True)
class PoolStats:
    """Cheap counters, always on."""

    num_pages: int = 0
    num_free_pages: int = 0
    num_used_pages: int = 0
    num_cached_pages: int = 0
    num_free_cached_pages: int = 0
    num_requests: int = 0
    usage: float = 0.0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    prefix_queries_requests: int = 0
    prefix_hits_requests: int = 0
    num_evictions: int = 0
    num_allocated_pages_total: int = 0
    num_freed_pages_total: int = 0
    num_no_capacity: int = 0
    padding_tokens_per_group: list[int] = field(default_factory=list)

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queries_tokens == 0:
            return 0.0
        return self.prefix_hits_tokens / self.prefix_queries_tokens
