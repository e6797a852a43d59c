"""The facade: one object that owns the pool, the prefix cache and every request's pages.

A scheduler embeds it in-process, or the service drives it from gRPC. It mirrors vLLM v1's
``KVCacheManager``: on a single full-attention group with prefix caching it hands out the
same page ids, finds the same hits and evicts the same pages for the same operations.

Token regions of a request when it is allocated (``admit`` or ``allocate``)::

    |<------------- token_ids (all tokens known: prompt + output so far) ------------>|
    | computed before | cached hit (admission only) | new: scheduled now | lookahead  |
    0                 c0                            c                    c+n          c+n+l
    |<------ pages already held ----->|<---- pages allocated by this call -------------->|
    |<--- full pages entered into the prefix cache after this call: up to min(c+n, len) ->|

``c`` (``num_computed_tokens``) only grows: each successful call advances it by ``n``.
The prompt's last token is never a cache hit (its logits must be computed).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from math import lcm
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from pagekeeper.core.config import GroupKind, PoolConfig
from pagekeeper.core.errors import (
    AlreadyExists,
    InvalidArgument,
    InvariantViolation,
    NotFound,
)
from pagekeeper.core.events import KVEvent, TokenRun, new_removed, new_stored
from pagekeeper.core.groups import GroupManager, make_group_manager
from pagekeeper.core.hashing import PageHasher, hash_pages, join_hashes
from pagekeeper.core.pool import NULL_PAGE, EventPlace, PagePool, PendingEviction, _ops
from pagekeeper.core.tables import build_batch_tables
from pagekeeper.core.types import (
    NO_EXTRA_KEYS,
    Allocation,
    BatchTables,
    ExtraKeys,
    LookupResult,
    PoolStats,
    RequestInfo,
    RunningRequest,
    RunningRows,
)


class CheckedTokens:
    """Token ids :func:`check_token_ids` passed, widened into a new ``array('Q')``: the
    manager keeps that array as it is (the service checks a step's admissions before
    applying any, then hands these over; one pass over the ids instead of a check there
    and a widening copy here). Build them with that function only; each is used once."""

    __slots__ = ("array",)

    def __init__(self, tokens: array[int]) -> None:
        self.array = tokens

    def __len__(self) -> int:
        return len(self.array)


TokenIds = Sequence[int] | np.ndarray
_TOKEN_IDS = attrgetter("token_ids")
_NUM_COMPUTED = attrgetter("num_computed_tokens")
# Fewer decodes crossing into a page together than this take theirs one by one: the
# batched path's array work costs ~15 us, a page ~2.5 us (they break even at ~8 here).
_MIN_BATCHED_CROSSINGS = 8


@dataclass(slots=True)
class _Request:
    request_id: str
    # Unsigned 64-bit ids in one buffer (8 bytes a token, not a Python int object each):
    # cheap to build from a prompt, to free, to slice for hashing and events.
    token_ids: array[int]
    extra_keys: ExtraKeys
    owner: str
    # Hashes of the request's full pages at the hash page size (the smallest page size).
    hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # The token range of the last allocation: what a published batch writes.
    scheduled_start: int = 0
    num_scheduled: int = 0


@dataclass(slots=True)
class _Deferred:
    """An admission whose prefix-cache work waits for :meth:`PageManager.settle`: the
    hashes of its pages past the lookup's first miss, and entering its full pages up to
    ``num_tokens`` into the index under the ``stored`` event reserved at ``place``."""

    req: _Request
    num_tokens: int
    place: EventPlace | None
    client_hashes: PackedPageHashes | None = None
    """A fresh admission's packed client hashes: ``req.hashes`` holds only the first
    until settle makes the rest."""


def _event_keys(extra_keys: ExtraKeys) -> ExtraKeys | None:
    """What a request's ``stored`` events carry: its extra keys, None when it has none."""
    return None if extra_keys.is_empty else extra_keys


_widen_tokens: Callable[[Any, Any], bool] | None = None if _ops is None else _ops.widen_tokens
# Growth columns that are all decodes, checked and split in one C pass (None: not built);
# see ``_poolops.decode_columns``.
decode_columns: Callable[..., tuple[list[int], dict[str, list[int]], int] | None] | None = (
    None if _ops is None else _ops.decode_columns
)
_ZERO_Q = array("Q", [0])
# What :meth:`PageManager._admit_fresh` returns for an admission it leaves to the general path.
_NOT_FRESH: Final = object()


def non_negative_token_ids(token_ids: np.ndarray) -> bool:
    """Whether every id of a 1-D integer array is >= 0 (one C pass where it is built)."""
    if _widen_tokens is not None:
        try:
            if _widen_tokens(token_ids, None):
                return True
        except ValueError:
            return False
    return not token_ids.size or int(token_ids.min()) >= 0


def _check_token_ndarray(token_ids: np.ndarray, what: str) -> None:
    if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be a 1-D integer array")
    if not non_negative_token_ids(token_ids):
        raise InvalidArgument(f"{what} must be non-negative")


def check_token_ids(token_ids: np.ndarray) -> CheckedTokens:
    """A 1-D integer array's ids as :class:`CheckedTokens`, or InvalidArgument when one is
    negative."""
    return CheckedTokens(_as_token_array(token_ids, "token ids"))


def _as_token_array(token_ids: TokenIds | CheckedTokens, what: str) -> array[int]:
    """A private ``array('Q')`` of non-negative token ids, or InvalidArgument."""
    if isinstance(token_ids, CheckedTokens):
        return token_ids.array
    if isinstance(token_ids, np.ndarray):
        if _widen_tokens is not None and token_ids.ndim == 1:
            # Checked and widened in one C pass (an int32 array off the wire: 2,000
            # tokens in ~2 us, against ~4.5 us for numpy's min and copy).
            widened: array[int] = _ZERO_Q * token_ids.shape[0]
            try:
                if _widen_tokens(token_ids, widened):
                    return widened
            except ValueError:
                raise InvalidArgument(f"{what} must be non-negative") from None
        _check_token_ndarray(token_ids, what)
        # Widened straight into the array's own buffer (one copy, no temporaries).
        out = array("Q", bytes(8 * token_ids.shape[0]))
        np.frombuffer(out, dtype=np.uint64)[:] = token_ids
        return out
    # One C-level pass checks every value: an unsigned 64-bit array refuses negative ints,
    # floats, strings and None, and takes numpy integers through ``__index__``. Five times
    # faster than a Python-level type scan on a 2,000-token prompt.
    try:
        return array("Q", token_ids)
    except OverflowError:
        raise InvalidArgument(f"{what} must be non-negative and below 2**64") from None
    except TypeError as exc:
        raise InvalidArgument(f"{what} must be integers ({exc})") from None


def _as_token_list(token_ids: TokenIds, what: str) -> list[int]:
    """A private list of non-negative int token ids (plain ints), or InvalidArgument."""
    if isinstance(token_ids, np.ndarray):
        _check_token_ndarray(token_ids, what)
        as_list: list[int] = token_ids.tolist()
        return as_list
    tokens: list[int] = _as_token_array(token_ids, what).tolist()
    return tokens


_T = TypeVar("_T")


def first_repeat(items: Sequence[_T]) -> _T:
    """The first item that appears a second time (the caller knows there is one)."""
    seen: set[_T] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    raise AssertionError("no repeated item")  # pragma: no cover - callers check first


class CheckedPageHashes(tuple[bytes, ...]):
    """Client page hashes :func:`check_page_hashes` passed: the manager takes them as they
    are (the service checks a step's admissions before applying any, then hands these
    over). Build them with that function only."""

    __slots__ = ()


def check_page_hashes(page_hashes: Sequence[bytes]) -> CheckedPageHashes:
    """Client page hashes as :class:`CheckedPageHashes`, or InvalidArgument: each
    non-empty bytes (one C-level type pass), none twice."""
    if type(page_hashes) is CheckedPageHashes:
        return page_hashes
    hashes = CheckedPageHashes(page_hashes)
    if set(map(type, hashes)) - {bytes} or not all(hashes):
        raise InvalidArgument("page hashes must be non-empty bytes")
    if len(set(hashes)) != len(hashes):
        # A chain never repeats; a repeat would map one cached page into two table slots.
        raise InvalidArgument(
            f"page hash {first_repeat(hashes).hex()} repeats (each hash covers its whole prefix)"
        )
    return hashes


_split_digests: Callable[[Any, int], tuple[bytes, ...]] | None = (
    None if _ops is None else getattr(_ops, "split_digests", None)
)
_check_digests: Callable[[Any, int], int] | None = (
    None if _ops is None else getattr(_ops, "check_digests", None)
)
_DigestSet: Callable[[], Any] | None = None if _ops is None else getattr(_ops, "DigestSet", None)


class PackedPageHashes:
    """Client page hashes packed end to end, ``width`` bytes each (the wire's
    ``packed_page_hashes``), that :func:`check_packed_page_hashes` passed: a whole number
    of them, none twice. The manager takes them as they are and makes an object of each
    hash only when it needs one: a fresh admission's deferred caching needs only the
    first before :meth:`PageManager.settle`, which runs after the service has answered.
    Build them with that function only."""

    __slots__ = ("data", "width")

    def __init__(self, data: bytes, width: int) -> None:
        self.data = data
        self.width = width

    def __len__(self) -> int:
        return len(self.data) // self.width

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.split())

    def __repr__(self) -> str:
        return f"PackedPageHashes({len(self)} x {self.width} bytes)"

    def first(self) -> bytes:
        return self.data[: self.width]

    def split(self) -> CheckedPageHashes:
        """Each hash as its own bytes (checked already)."""
        data, width = self.data, self.width
        if _split_digests is not None:
            return CheckedPageHashes(_split_digests(data, width))
        view = memoryview(data)
        return CheckedPageHashes(bytes(view[i : i + width]) for i in range(0, len(data), width))


def check_packed_page_hashes(packed: bytes, width: int) -> PackedPageHashes:
    """Client page hashes packed end to end, ``width`` bytes each, as
    :class:`PackedPageHashes`, or InvalidArgument: a length that is not a whole number of
    hashes, or a hash that repeats. One C pass over the bytes where the pool's accelerator
    is built (~0.7 us for a 2,000-token prompt's 125 hashes, against ~7 us for the same
    hashes as a wire field each, turned into objects and checked)."""
    if type(packed) is not bytes:
        raise InvalidArgument("packed page hashes must be bytes")
    if width <= 0 or len(packed) % width:
        raise InvalidArgument(
            f"packed page hashes: {len(packed)} bytes are not a whole number of {width}-byte hashes"
        )
    if len(packed) == width:
        return PackedPageHashes(packed, width)  # one hash (a decode's page): none repeats
    if _check_digests is not None:
        repeat = _check_digests(packed, width)
        if repeat >= 0:
            raise InvalidArgument(
                f"page hash {packed[repeat * width : (repeat + 1) * width].hex()} repeats "
                "(each hash covers its whole prefix)"
            )
        return PackedPageHashes(packed, width)
    hashes = PackedPageHashes(packed, width)
    check_page_hashes(tuple(hashes.split()))
    return hashes


def _checked_hashes(page_hashes: Sequence[bytes]) -> list[bytes]:
    """A private list of client page hashes, or InvalidArgument."""
    return list(check_page_hashes(page_hashes))


_RELEASING_KINDS = frozenset({GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL})
"""Attention groups whose leading pages go back to the pool (null in the table) once no
later token attends to them."""


def _check_no_released_slots(
    request_ids: Sequence[str],
    table: npt.NDArray[np.int32],
    num_pages: npt.NDArray[np.int32],
    starts: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    group: GroupManager,
) -> None:
    """Refuse a row whose scheduled tokens start in a page its window (or chunk) released:
    their KV would be written into the null page. (Released pages are a prefix of the
    table, so the first scheduled page decides. A row starting past its own pages is left
    to the slot mapping's range check, which says so.)"""
    first = starts // group.page_size
    live = (counts > 0) & (first < num_pages)
    first = np.where(live, first, 0)
    heads = table[np.arange(len(first)), first]
    bad = live & (heads == NULL_PAGE)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidArgument(
            f"request {request_ids[i]!r}: its scheduled tokens start at position "
            f"{int(starts[i])}, in a page group {group.group_id} ({group.config.kind.value}) "
            "already released; only tokens from its last computed window on can be scheduled"
        )


class PageManager:
    """Owns physical page allocation and block-table construction for one pool.

    Single writer, deterministic, no I/O. Not thread-safe: the service calls it from one
    event loop. Every method either succeeds or raises a :class:`PagekeeperError` having
    changed nothing; running out of pages is not an error but a ``None`` answer.

    Example::

        manager = PageManager(PoolConfig(num_pages=1024))
        first = manager.admit("a", list(range(100)))      # 7 pages of 16 tokens
        second = manager.admit("b", list(range(100)))     # reuses a's 6 full pages
        assert second.num_cached_tokens == 96
        manager.allocate("a", 1, new_token_ids=[42])      # one decode step
        tables = manager.build_batch(["a", "b"], [16])    # what a kernel reads
        manager.free("a")
    """

    def __init__(self, config: PoolConfig) -> None:
        config.validate()
        self.config = config
        self.enable_caching = config.enable_prefix_caching
        self.pool = PagePool(config.num_pages, enable_caching=config.enable_prefix_caching)
        self.pool.ensure_groups(len(config.groups))
        self.groups: list[GroupManager] = [
            make_group_manager(i, g, self.pool, config.max_model_len)
            for i, g in enumerate(config.groups)
        ]
        self.hash_page_size = config.hash_page_size
        # Pages of requests without extra keys (most) are hashed by this shared hasher.
        self._hasher = PageHasher(self.hash_page_size, algorithm=config.hash_algorithm)
        self._hash_factors = [g.page_size // self.hash_page_size for g in config.groups]
        # A hit must end where every group's page ends.
        self._hit_alignment = lcm(*(g.page_size for g in config.groups))
        self._requests: dict[str, _Request] = {}
        # Never rebound: the view stays the live one.
        self.requests: Mapping[str, RunningRequest] = MappingProxyType(self._requests)
        """The running requests by id, read-only and live (no copy)."""
        self._stats = PoolStats(num_pages=config.num_pages)
        self._max_model_len = config.max_model_len
        self._no_new_pages: tuple[tuple[int, ...], ...] = tuple(() for _ in self.groups)
        only = self.groups[0] if len(self.groups) == 1 else None
        self._single_full = (
            only if only is not None and only.config.kind is GroupKind.FULL else None
        )
        self.defer_caching = False
        """Admissions leave their prefix-cache work (hashing past the first miss, entering
        pages into the index, their ``stored`` event) to :meth:`settle`, so a caller can
        answer first (the service settles right after its reply). Only on a single
        full-attention group with caching, for admissions that read the cache and carry no
        extra keys. Their allocations' evictions wait too (the pages are taken at once;
        their index entries and ``removed`` events wait), and a lookup meanwhile stops at
        a hit page that was taken. Every other method settles first, and an admission
        whose lookup would hit a deferred one's pages settles before it looks again:
        answers, pages, index and events (seqs and order) are exactly those of caching at
        once.

        Which lookups would hit a deferred admission's pages: one hashed here knows only
        its first page to cache (this manager's hashes chain, so a chained lookup reaches
        any of its pages through that one); one that sent the client's page hashes knows
        every page (they need not chain: a later lookup may match any of them alone). An
        admission with the client's hashes settles first while a chained one is deferred
        (its hashes could match that one's pages past the first, not yet hashed)."""
        self._deferred: list[_Deferred | PendingEviction] = []
        # Hashes a later lookup that stops on one of them would have hit, had the deferred
        # admissions cached at once: a chained admission's first page to cache, every page
        # to cache of one with the client's hashes.
        self._deferred_hashes: set[bytes] = set()
        # The deferred fresh admissions' packed client hashes, as raw bytes (None without
        # the accelerator: they go into _deferred_hashes as objects then).
        self._deferred_digests: Any = None if _DigestSet is None else _DigestSet()
        # Whether a chained admission (pages past its first to cache unhashed) is deferred.
        self._deferred_chained = False
        # The C hash of one page (``PageHasher.native_page_parts``) of the single
        # full-attention group, when its pages are C's to hash: what a fresh prompt's
        # deferred admission (:meth:`_admit_fresh`) and the C decode loop's filled pages
        # (:meth:`_fill_context`) use; None where neither runs.
        self._page_parts = (
            self._hasher.native_page_parts()
            if self._single_full is not None
            and self.enable_caching
            and self.hash_page_size == self._single_full.page_size
            else None
        )

    # -- helpers -------------------------------------------------------------------------
    def _group_hashes(self, group_id: int, hashes: list[bytes]) -> list[bytes]:
        # A larger page is named by the last small-page hash inside it (the chain already
        # covers the whole prefix), as vLLM's BlockHashListWithBlockSize does.
        factor = self._hash_factors[group_id]
        return hashes if factor == 1 else join_hashes(hashes, factor)

    def _compute_hashes(
        self, tokens: Sequence[int], extra_keys: ExtraKeys, page_hashes: Sequence[bytes] | None
    ) -> list[bytes]:
        if page_hashes is not None:
            hashes = _checked_hashes(page_hashes)
            num_full = len(tokens) // self.hash_page_size
            if len(hashes) > num_full:
                raise InvalidArgument(
                    f"{len(hashes)} page hashes for {len(tokens)} tokens "
                    f"(at most {num_full} full pages of {self.hash_page_size})"
                )
            if len(hashes) < num_full:
                # Complete the chain from the client's last hash.
                start = len(hashes)
                hashes += hash_pages(
                    tokens[start * self.hash_page_size :],
                    self.hash_page_size,
                    extra_keys=extra_keys,
                    algorithm=self.config.hash_algorithm,
                    parent=hashes[-1] if hashes else None,
                    first_page_index=start,
                )
                if start and len(set(hashes)) != len(hashes):
                    # Hashes that do not chain as this manager's can meet the completed
                    # chain again (one page twice in the table if both hit).
                    raise InvalidArgument(
                        f"page hashes repeat once the chain is completed from the client's "
                        f"last one (page {start} on): send every full page's hash, or "
                        "hashes that chain"
                    )
            return hashes
        return hash_pages(
            tokens,
            self.hash_page_size,
            extra_keys=extra_keys,
            algorithm=self.config.hash_algorithm,
        )

    def _hash_to_first_miss(
        self, tokens: array[int], hashes: list[bytes], max_length: int
    ) -> list[int]:
        """Extend ``hashes`` (a prefix of ``tokens``' chain; no extra keys, one
        full-attention group) until it covers the first page past the longest cached run
        within ``max_length`` tokens, or every full page: what the lookup and the first
        page the admission caches need. Returns that run (the group's hit). The first
        page goes alone (a fresh prompt stops there); then chunks grow fourfold, so a long
        hit takes a few rounds, each hashing at most 3x what the hit has reached (pages
        the admission caches after its answer anyway)."""
        group = self._single_full
        assert group is not None
        ps = self.hash_page_size
        limit = min(len(tokens) // ps, max(max_length, 0) // ps + 1)
        hasher = self._hasher
        hit: list[int] | None = None
        while len(hashes) < limit:
            have = len(hashes)
            want = min(limit, max(4 * have, 1))
            if want == have + 1:
                # One page (most often a fresh prompt's first): no chain machinery.
                hashes.append(hasher.hash_page(tokens, have, hashes[-1] if hashes else None))
            else:
                hashes += hasher.hash_pages(
                    tokens[have * ps : want * ps],
                    parent=hashes[-1] if hashes else None,
                    first_page_index=have,
                )
            hit = group.find_cache_hit(hashes, max_length)
            if len(hit) < len(hashes):
                break
        return group.find_cache_hit(hashes, max_length) if hit is None else hit

    def _is_deferred(self, page_hash: bytes) -> bool:
        """Whether a deferred admission caches a page under this hash."""
        return page_hash in self._deferred_hashes or (
            self._deferred_digests is not None and page_hash in self._deferred_digests
        )

    @property
    def has_deferred(self) -> bool:
        """Whether admissions left prefix-cache work for :meth:`settle`."""
        return bool(self._deferred)

    def settle(self) -> None:
        """Do the deferred admissions' evictions and prefix-cache work, in their order, as
        each would have done it (the same index, the same events in their reserved
        places)."""
        deferred, self._deferred = self._deferred, []
        self._deferred_hashes.clear()
        if self._deferred_digests:
            self._deferred_digests.clear()
        self._deferred_chained = False
        evict_pending = self.pool.evict_pending
        for item in deferred:
            if isinstance(item, PendingEviction):
                evict_pending(item)
                continue
            req = item.req
            if self._requests.get(req.request_id) is not req:
                raise InvariantViolation(f"request {req.request_id!r} left before it settled")
            if len(req.token_ids) // self.hash_page_size > len(req.hashes):
                packed = item.client_hashes
                self._extend_hashes(
                    req, None if packed is None else packed.split()[len(req.hashes) :]
                )
            if item.place is not None:
                self._cache(req, item.num_tokens, item.place)

    def _find_common_hit(self, hashes: list[bytes], max_length: int) -> tuple[list[list[int]], int]:
        """The longest prefix every group can reuse (vLLM's hybrid coordinator): shrink the
        candidate length until each group's hit covers it, then trim every group to it."""
        groups = self.groups
        if self._single_full is not None:
            hit = self._single_full.find_cache_hit(hashes, max_length)
            return [hit], len(hit) * self._single_full.page_size
        align = self._hit_alignment
        length = (max_length // align) * align
        group_hashes = [self._group_hashes(g.group_id, hashes) for g in groups]
        while True:
            hits = [
                g.find_cache_hit(gh, length) for g, gh in zip(groups, group_hashes, strict=True)
            ]
            new_length = min(len(h) * g.page_size for h, g in zip(hits, groups, strict=True))
            new_length = (new_length // align) * align
            if new_length == length or len(groups) == 1:
                length = new_length
                break
            length = new_length
        trimmed = [h[: length // g.page_size] for h, g in zip(hits, groups, strict=True)]
        return trimmed, length

    def _check_new_request(self, request_id: str, tokens: Sequence[int]) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument("request_id must be a non-empty string")
        if request_id in self._requests:
            raise AlreadyExists(f"request {request_id!r} already holds pages")
        if not tokens:
            raise InvalidArgument(f"request {request_id!r}: token_ids must not be empty")
        if len(tokens) > self.config.max_model_len:
            raise InvalidArgument(
                f"request {request_id!r}: {len(tokens)} tokens exceed max_model_len "
                f"{self.config.max_model_len}"
            )

    def _get(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise NotFound(f"request {request_id!r} holds no pages")
        return req

    # -- reads ---------------------------------------------------------------------------
    def lookup(
        self,
        token_ids: TokenIds,
        *,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | None = None,
    ) -> LookupResult:
        """Longest cached prefix of ``token_ids`` that every group can reuse, touching
        nothing (for routers). Unlike admission, it may cover every token. When
        ``page_hashes`` cover every full page, the token ids are only counted."""
        if self._deferred:
            self.settle()
        num_tokens = len(token_ids)
        if not self.enable_caching or not num_tokens:
            return LookupResult(0, tuple(() for _ in self.groups), ())
        if page_hashes is not None and len(page_hashes) == num_tokens // self.hash_page_size:
            hashes = _checked_hashes(page_hashes)
        else:
            # An array('Q'), as admissions hash it: the hasher views it, no per-token pass.
            tokens = _as_token_array(token_ids, "token_ids")
            hashes = self._compute_hashes(tokens, extra_keys or NO_EXTRA_KEYS, page_hashes)
        hits, length = self._find_common_hit(hashes, num_tokens)
        return LookupResult(
            num_hit_tokens=length,
            page_ids=tuple(tuple(h) for h in hits),
            page_hashes=tuple(hashes[: length // self.hash_page_size]),
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def running_rows(
        self,
        request_ids: Sequence[str],
        owner: str | None = None,
        lengths: np.ndarray | None = None,
        computed: np.ndarray | None = None,
    ) -> RunningRows | None:
        """The running requests ``request_ids`` name, in order, in one pass (C with the C
        pool loops): None when one is unknown (or not a str), or not ``owner``'s when an
        owner is given -- the caller then goes row by row to name the first. ``lengths``
        and ``computed`` (int64 arrays of at least ``len(request_ids)``, or None) receive
        each row's token count and computed count."""
        ops = self.pool._ops
        if ops is not None:
            found = ops.gather_rows(self._requests, request_ids, owner, lengths, computed)
            return None if found is None else RunningRows(*found)
        requests = self._requests
        reqs: list[RunningRequest] = []
        for rid in request_ids:
            req = requests.get(rid) if type(rid) is str else None
            if req is None or (owner is not None and req.owner != owner):
                return None
            reqs.append(req)
        num_tokens = [len(r.token_ids) for r in reqs]
        counts = [r.num_computed_tokens for r in reqs]
        if lengths is not None:
            lengths[: len(reqs)] = num_tokens
        if computed is not None:
            computed[: len(reqs)] = counts
        return RunningRows(
            reqs,
            max(num_tokens, default=0),
            max(counts, default=0),
            max((c - t for c, t in zip(counts, num_tokens, strict=True)), default=0),
        )

    def request_info(self, request_id: str) -> RequestInfo:
        if self._deferred:
            self.settle()
        req = self._get(request_id)
        return RequestInfo(
            request_id=request_id,
            num_tokens=len(req.token_ids),
            num_computed_tokens=req.num_computed_tokens,
            num_cached_tokens=req.num_cached_tokens,
            page_ids=tuple(tuple(g.pages(request_id)) for g in self.groups),
            owner=req.owner,
        )

    def page_table(self, request_id: str, group_id: int = 0) -> np.ndarray:
        self._get(request_id)
        if not 0 <= group_id < len(self.groups):
            raise InvalidArgument(f"group_id {group_id} out of range [0, {len(self.groups)})")
        group = self.groups[group_id]
        return group.rows.row(group.request_rows[request_id]).copy()

    def stats(self) -> PoolStats:
        if self._deferred:
            self.settle()
        s = self._stats
        pool = self.pool
        s.num_free_pages = pool.num_free_pages
        s.num_used_pages = pool.num_used_pages
        s.num_cached_pages = pool.num_cached_pages
        s.num_free_cached_pages = pool.num_free_cached_pages
        s.num_requests = len(self._requests)
        s.usage = pool.usage()
        s.num_evictions = pool.num_evictions
        s.num_allocated_pages_total = pool.num_allocated_total
        s.num_freed_pages_total = pool.num_freed_total
        s.padding_tokens_per_group = self._padding_tokens()
        return PoolStats(**{k: getattr(s, k) for k in s.__slots__})  # a copy

    def _padding_tokens(self) -> list[int]:
        out = []
        for g in self.groups:
            waste = 0
            for rid in g.request_rows:
                req = self._requests[rid]
                n = max(len(req.token_ids), req.num_computed_tokens)
                held = g.num_pages(rid) * g.page_size
                waste += max(held - n, 0) if g.config.kind is not GroupKind.MAMBA else 0
            out.append(waste)
        return out

    def page_states(self) -> dict[str, np.ndarray]:
        """Per-page arrays for introspection: ``ref_count`` (int32), ``is_cached`` (bool),
        ``is_free`` (bool) and ``group`` (int16, -1 when no group holds or caches it)."""
        if self._deferred:
            self.settle()
        pool = self.pool
        group = np.full(pool.num_pages, -1, dtype=np.int16)
        for g in self.groups:
            for row in g.request_rows.values():
                pages = g.rows.row(row)
                group[pages[pages != NULL_PAGE]] = g.group_id
        cached_pages = np.flatnonzero(pool._cached_np)
        group[cached_pages] = pool._cached_np[cached_pages].astype(np.int16) - 1
        return {
            "ref_count": pool.ref_count_array(),
            "is_cached": pool._cached_np.astype(bool),
            "is_free": pool.free_mask(),
            "group": group,
        }

    # -- mutations -----------------------------------------------------------------------
    def admit(
        self,
        request_id: str,
        token_ids: TokenIds | CheckedTokens,
        *,
        num_new_tokens: int | None = None,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | PackedPageHashes | None = None,
        num_lookahead_tokens: int = 0,
        enable_cache_read: bool = True,
        owner: str = "",
    ) -> Allocation | None:
        """Prefix lookup + touch + allocation for a new (or resumed) request, atomically.

        ``token_ids``: every token known (prompt, plus output so far for a resumed request;
        :class:`CheckedTokens` are kept as they are).
        ``num_new_tokens``: tokens to compute now after the cached prefix (default, or more
        than the hit leaves: all the rest; fewer for a chunked prefill). Returns None,
        changing nothing, when pages run out. Raises AlreadyExists, InvalidArgument.
        """
        if (
            type(token_ids) is CheckedTokens
            and self.defer_caching
            and self._page_parts is not None
            and num_new_tokens is None
            and (
                page_hashes is None
                or type(page_hashes) is CheckedPageHashes
                or type(page_hashes) is PackedPageHashes
            )
            and (extra_keys is None or extra_keys is NO_EXTRA_KEYS or extra_keys == NO_EXTRA_KEYS)
            and enable_cache_read
        ):
            fresh = self._admit_fresh(
                request_id, token_ids.array, num_lookahead_tokens, owner, page_hashes
            )
            if fresh is not _NOT_FRESH:
                return fresh  # type: ignore[return-value]
        client_hashes: Sequence[bytes] | None = (
            page_hashes.split() if isinstance(page_hashes, PackedPageHashes) else page_hashes
        )
        tokens = _as_token_array(token_ids, "token_ids")
        self._check_new_request(request_id, tokens)
        if num_lookahead_tokens < 0:
            raise InvalidArgument("num_lookahead_tokens must be >= 0")
        extra = extra_keys or NO_EXTRA_KEYS
        # Only an admission that reads the cache: its pages to cache start at its first
        # miss, where a later lookup that would hit them stops (one that skips the read
        # may cache pages whose hashes other pages hold, and an eviction could hand one
        # of those entries to it).
        defer = (
            self.defer_caching
            and enable_cache_read
            and self._single_full is not None
            and self.enable_caching
            and (extra is NO_EXTRA_KEYS or extra == NO_EXTRA_KEYS)
        )
        chained = client_hashes is None
        if self._deferred and (not defer or (self._deferred_chained and not chained)):
            self.settle()
        read_cache = self.enable_caching and enable_cache_read
        max_hit = len(tokens) - 1 if read_cache else 0
        if defer:
            # One full-attention group (the service's common admission): its lookup and
            # page count without the per-group machinery.
            group = self._single_full
            assert group is not None
            if chained:
                hashes: list[bytes] = []
                hit = self._hash_to_first_miss(tokens, hashes, max_hit)
            else:
                hashes = self._compute_hashes(tokens, extra, client_hashes)
                hit = group.find_cache_hit(hashes, max_hit)
            k = len(hit)
            if k < len(hashes) and self._is_deferred(hashes[k]):
                # Its lookup stops on a page a deferred admission caches: it would have
                # hit it. Cache them first, then look again.
                self.settle()
                if chained:
                    hit = self._hash_to_first_miss(tokens, hashes, max_hit)
                else:
                    hit = group.find_cache_hit(hashes, max_hit)
            page_size = group.page_size
            hits, num_hit = [hit], len(hit) * page_size
        else:
            if self.enable_caching:
                hashes = self._compute_hashes(tokens, extra, client_hashes)
            else:
                hashes = []
            if read_cache:
                hits, num_hit = self._find_common_hit(hashes, max_hit)
            else:
                hits, num_hit = [[] for _ in self.groups], 0
        # A chunked prefill asks for at most ``num_new_tokens``; the cache hit may leave fewer
        # (the scheduler cannot know the hit before asking), so the chunk is clamped.
        rest = len(tokens) - num_hit
        if num_new_tokens is None or num_new_tokens > rest:
            num_new_tokens = rest
        if num_new_tokens < 1:
            raise InvalidArgument(
                f"request {request_id!r}: num_new_tokens must be >= 1, got {num_new_tokens}"
            )
        num_slots = min(num_hit + num_new_tokens + num_lookahead_tokens, self.config.max_model_len)
        if defer:
            # A new request on a full-attention group: its new pages, plus the hit pages
            # that sit in the free queue (they count against the same free pages).
            needed = max(-(-num_slots // page_size) - len(hit), 0)
            if hit:
                needed += self.pool.count_free(hit)
        else:
            needed = sum(
                g.num_pages_to_allocate(request_id, num_slots, h, num_hit)
                for g, h in zip(self.groups, hits, strict=True)
            )
        if needed > self.pool.num_free_pages:
            self._stats.num_no_capacity += 1
            return None
        if read_cache:
            # Counted per admission, as vLLM's scheduler records them (not per attempt).
            stats = self._stats
            stats.prefix_queries_requests += 1
            stats.prefix_queries_tokens += len(tokens)
            stats.prefix_hits_tokens += num_hit
            stats.prefix_hits_requests += num_hit > 0
        req = _Request(request_id, tokens, extra, owner, hashes)
        self._requests[request_id] = req
        if defer:
            # Its evictions wait too (their index entries and ``removed`` event), in the
            # same list, so settling replays evictions and cachings in their order.
            assert group is not None
            pool = self.pool
            pool.evict_later = self._deferred
            try:
                new_pages: tuple[tuple[int, ...], ...] = (
                    tuple(group.admit_full(request_id, hit, num_slots)),
                )
            finally:
                pool.evict_later = None
            self._defer_cache(req, num_hit + num_new_tokens, len(hit), chained)
        else:
            for g, h in zip(self.groups, hits, strict=True):
                g.save_hits(request_id, h, num_hit)
            new_pages = tuple(tuple(g.allocate_new(request_id, num_slots)) for g in self.groups)
            self._cache(req, num_hit + num_new_tokens)
        req.num_computed_tokens = num_hit + num_new_tokens
        req.num_cached_tokens = num_hit
        req.scheduled_start, req.num_scheduled = num_hit, num_new_tokens
        return Allocation(
            request_id=request_id,
            num_cached_tokens=num_hit,
            new_page_ids=new_pages,
            hit_page_ids=tuple(map(tuple, hits)),
        )

    def _admit_fresh(
        self,
        request_id: str,
        tokens: array[int],
        num_lookahead_tokens: int,
        owner: str,
        page_hashes: CheckedPageHashes | PackedPageHashes | None = None,
    ) -> Allocation | object | None:
        """:meth:`admit` of the service's most common admissions, without its general
        machinery: a whole prompt (checked ids, no extra keys; no client hashes, or checked
        ones covering every full page) whose first page misses the cache, deferred, on the
        single full-attention group. The same answer, pages, stats, events and deferred
        work as the general path; returns ``_NOT_FRESH``, having changed nothing, for
        anything else (a hit, a first page a deferred admission caches, a prompt of at
        most one page, client hashes that do not cover every page or follow admissions
        whose caching waits on this manager's own hashes, a bad argument), which the
        general path then decides (and refuses) as always."""
        group = self._single_full
        assert group is not None and self._page_parts is not None
        page_size = group.page_size
        n = len(tokens)
        max_len = self._max_model_len
        if (
            type(request_id) is not str
            or not request_id
            or request_id in self._requests
            or not page_size < n <= max_len
            or num_lookahead_tokens < 0
        ):
            return _NOT_FRESH
        packed = None
        if page_hashes is None:
            sha256_page, head, array_head, extra, none_hash = self._page_parts
            first: bytes = sha256_page(head, none_hash, array_head, tokens, 0, page_size, extra)
            hashes = [first]
        elif len(page_hashes) != n // page_size or (self._deferred and self._deferred_chained):
            return _NOT_FRESH  # (the general path completes the chain, or settles first)
        elif type(page_hashes) is PackedPageHashes and self._deferred_digests is not None:
            packed = page_hashes
            first = packed.first()
            hashes = [first]  # (the rest made by settle)
        else:
            hashes = list(page_hashes)
            first = hashes[0]
        pool = self.pool
        if self._is_deferred(first) or pool.lookup(group.group_id, first) is not None:
            return _NOT_FRESH
        num_slots = min(n + num_lookahead_tokens, max_len)
        stats = self._stats
        if -(-num_slots // page_size) > pool.num_free_pages:
            stats.num_no_capacity += 1
            return None
        stats.prefix_queries_requests += 1
        stats.prefix_queries_tokens += n
        req = _Request(request_id, tokens, NO_EXTRA_KEYS, owner, hashes)
        self._requests[request_id] = req
        pool.evict_later = self._deferred
        try:
            pages = group.admit_full(request_id, [], num_slots)
        finally:
            pool.evict_later = None
        self._defer_cache(req, n, 0, page_hashes is None, packed)
        req.num_computed_tokens = n
        req.scheduled_start, req.num_scheduled = 0, n
        return Allocation(request_id, 0, (tuple(pages),), ((),))

    def allocate(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        new_token_ids: TokenIds = (),
        num_computed_tokens: int | None = None,
        num_lookahead_tokens: int = 0,
        new_page_hashes: Sequence[bytes] | PackedPageHashes | None = None,
    ) -> Allocation | None:
        """Grow a running request: append ``new_token_ids`` (tokens generated since its last
        step), then make room for ``num_new_tokens`` more computed tokens (+ lookahead).
        ``num_computed_tokens`` defaults to what the manager tracked. Returns None when pages
        run out; then only sliding-window releases have happened (as in vLLM) and the tokens
        are not appended.

        ``new_page_hashes``: the client's hashes of the pages (hash page size) the new
        tokens complete, in order from the request's first full page without one: at most
        one per such page (the manager hashes the rest, chaining from the client's last),
        none repeated, none the request's previous page's. Their pages enter the prefix
        cache under them, so a later prompt the client hashes alike hits them."""
        if self._deferred:
            self.settle()
        req = self._requests.get(request_id)
        if req is None:
            raise NotFound(f"request {request_id!r} holds no pages")
        # Decodes append one or two plain ints: check them inline, not via the general path.
        if (type(new_token_ids) is list or type(new_token_ids) is tuple) and len(
            new_token_ids
        ) <= 4:
            for t in new_token_ids:
                if type(t) is not int or t < 0:
                    new_tokens = _as_token_list(new_token_ids, "new_token_ids")
                    break
            else:
                new_tokens = list(new_token_ids)
        else:
            new_tokens = _as_token_list(new_token_ids, "new_token_ids")
        if num_new_tokens < 1:
            raise InvalidArgument(f"request {request_id!r}: num_new_tokens must be >= 1")
        if num_lookahead_tokens < 0:
            raise InvalidArgument("num_lookahead_tokens must be >= 0")
        max_len = self._max_model_len
        num_tokens = len(req.token_ids) + len(new_tokens)
        if num_tokens > max_len:
            raise InvalidArgument(
                f"request {request_id!r}: {num_tokens} tokens exceed max_model_len {max_len}"
            )
        computed = req.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if not 0 <= computed <= num_tokens:
            raise InvalidArgument(
                f"request {request_id!r}: num_computed_tokens {computed} outside [0, {num_tokens}]"
            )
        if computed + num_new_tokens > num_tokens + num_lookahead_tokens:
            raise InvalidArgument(
                f"request {request_id!r}: {computed} computed + {num_new_tokens} new tokens "
                f"exceed its {num_tokens} tokens"
            )
        if computed + num_new_tokens > max_len:
            # Lookahead may run past the tokens (speculative ones), never past the longest
            # request: slots stop at max_model_len, and a computed token needs one.
            raise InvalidArgument(
                f"request {request_id!r}: {computed} computed + {num_new_tokens} new tokens "
                f"exceed max_model_len {max_len}"
            )
        if new_page_hashes is not None:
            new_page_hashes = self._check_growth_hashes(req, new_page_hashes, len(new_tokens))
        num_slots = computed + num_new_tokens + num_lookahead_tokens
        if num_slots > max_len:
            num_slots = max_len
        groups = self.groups
        if self._single_full is not None:
            # One full-attention group (the common case): nothing is ever skipped.
            group = self._single_full
            needed = -(-num_slots // group.page_size) - group.page_counts[request_id]
            if needed < 0:
                needed = 0
        else:
            for g in groups:
                g.remove_skipped(request_id, computed)
            needed = sum(
                g.num_pages_to_allocate(request_id, num_slots, (), computed) for g in groups
            )
        if needed > self.pool._num_free:
            self._stats.num_no_capacity += 1
            return None
        if new_tokens:
            req.token_ids.extend(new_tokens)
            if self.enable_caching and len(req.token_ids) // self.hash_page_size > len(req.hashes):
                self._extend_hashes(req, new_page_hashes)
        if needed:
            new_pages = tuple(tuple(g.allocate_new(request_id, num_slots)) for g in groups)
        else:
            new_pages = self._no_new_pages
        end = computed + num_new_tokens
        if self.enable_caching:
            if self._single_full is not None:
                group = self._single_full
                if (
                    min(end, len(req.token_ids)) // group.page_size
                    > group.num_cached_pages[request_id]
                ):
                    self._cache(req, end)
            else:
                self._cache(req, end)
        req.num_computed_tokens = end
        req.scheduled_start = computed
        req.num_scheduled = num_new_tokens
        return Allocation(request_id, 0, new_pages)

    def allocate_decodes(
        self,
        request_ids: Sequence[str],
        new_token_ids: TokenIds,
        *,
        num_lookahead_tokens: int = 0,
        held_token_ids: Mapping[str, TokenIds] | None = None,
        crossed: tuple[list[int], list[int]] | None = None,
        page_hashes: Mapping[str, Sequence[bytes] | PackedPageHashes] | None = None,
        checked_rows: RunningRows | None = None,
    ) -> dict[str, Allocation | None]:
        """One decode step for many running requests at once: request ``i`` appends
        ``new_token_ids[i]`` and is given room for one more computed token (+ lookahead).

        The same outcome as ``allocate(rid, 1, new_token_ids=[tok], num_lookahead_tokens=l)``
        for each request in order -- the same page ids, hashes, events, and the same
        requests left without pages when the pool runs out midway -- at a fraction of the
        cost per request. The whole batch is checked before anything changes (unknown or
        repeated ids, bad tokens, ``max_model_len``), so an error leaves it untouched.

        ``held_token_ids[rid]``: tokens of earlier decodes a scheduler held back (they
        needed no page and completed none), appended and counted as computed before the
        request's token: ``allocate(rid, 1, new_token_ids=[*held, tok],
        num_computed_tokens=computed + len(held))``.

        Returns only the exceptions: ``{request_id: Allocation}`` for requests that were
        handed new pages, ``{request_id: None}`` for those the pool could not serve (nothing
        changed for them; preempt them). A request not in the answer fits in its pages.

        ``crossed``: two lists ``(rows, pages)`` to extend instead of answering the
        requests that took their one new page together with others in one pool call
        (single full-attention group only): request ``request_ids[rows[k]]`` was handed
        page ``pages[k]``, and it is left out of the answer (no object per request).

        ``page_hashes[rid]``: the client's hashes of the pages the request's decode (and
        its held tokens) complete, as ``allocate(..., new_page_hashes=...)`` takes them.

        ``checked_rows``: what :meth:`running_rows` gave for ``request_ids``, which the
        caller checked are unique, with nothing changed since, and whose ``page_hashes``
        it checked as this method would, with ``held_token_ids`` (a dict) holding lists
        of non-negative ints for requests among them (the service's step checks its
        decode columns so, then applies them): neither gathered nor checked again.
        """
        if self._deferred:
            self.settle()
        tokens = _as_token_list(new_token_ids, "new_token_ids")
        if len(tokens) != len(request_ids):
            raise InvalidArgument(
                f"{len(tokens)} new token ids for {len(request_ids)} decoding requests"
            )
        if num_lookahead_tokens < 0:
            raise InvalidArgument("num_lookahead_tokens must be >= 0")
        requests = self._requests
        rows = checked_rows
        if rows is None:
            rows = self.running_rows(request_ids)
            if rows is None:
                missing = next(
                    r for r in request_ids if not isinstance(r, str) or r not in requests
                )
                raise NotFound(f"request {missing!r} holds no pages")
            if len(set(request_ids)) != len(request_ids):
                raise InvalidArgument("a request decodes twice in one call")
        elif len(rows.requests) != len(request_ids):
            raise InvalidArgument("checked_rows are not the rows of request_ids")
        reqs: list[_Request] = rows.requests  # type: ignore[assignment]
        decoding: Collection[str] = request_ids
        if len(request_ids) > 8 and (held_token_ids or page_hashes):
            decoding = set(request_ids)
        extras: dict[str, list[int]] = {}
        if held_token_ids and checked_rows is not None and type(held_token_ids) is dict:
            extras = held_token_ids  # lists of checked ints (the caller vouches)
        elif held_token_ids:
            for rid, given in held_token_ids.items():
                if rid not in decoding:
                    raise InvalidArgument(f"held tokens for {rid!r}, which does not decode here")
                extras[rid] = _as_token_list(given, f"request {rid!r}: held token ids")
        max_len = self._max_model_len
        held_most = max(map(len, extras.values()), default=0)
        named: dict[str, Sequence[bytes]] = {}
        if page_hashes and checked_rows is not None:
            named = {
                rid: hashes.split() if isinstance(hashes, PackedPageHashes) else hashes
                for rid, hashes in page_hashes.items()
            }
        elif page_hashes:
            for rid, given_hashes in page_hashes.items():
                if rid not in decoding:
                    raise InvalidArgument(f"page hashes for {rid!r}, which does not decode here")
                num_new = len(extras.get(rid, ())) + 1
                named[rid] = self._check_growth_hashes(requests[rid], given_hashes, num_new)

        def first_past(counts: list[int]) -> int | None:
            """The first request whose count, with its held tokens and this decode's, passes
            max_model_len (None: none)."""
            held = [len(extras.get(r.request_id, ())) for r in reqs]
            return next((i for i, c in enumerate(counts) if c + held[i] + 1 > max_len), None)

        # The tokens after this decode, and the computed ones (a count that can run ahead
        # of the tokens after speculative lookahead): both within max_model_len (row by
        # row only when the largest might not be).
        if rows.max_tokens + held_most + 1 > max_len:
            lengths = list(map(len, map(_TOKEN_IDS, reqs)))
            if (i := first_past(lengths)) is not None:
                num_held = len(extras.get(reqs[i].request_id, ()))
                raise InvalidArgument(
                    f"request {reqs[i].request_id!r}: {lengths[i] + num_held + 1} tokens "
                    f"exceed max_model_len {max_len}"
                )
        if rows.max_computed + held_most + 1 > max_len:
            computed_counts = list(map(_NUM_COMPUTED, reqs))
            if (i := first_past(computed_counts)) is not None:
                num_held = len(extras.get(reqs[i].request_id, ()))
                raise InvalidArgument(
                    f"request {reqs[i].request_id!r}: {computed_counts[i] + num_held} "
                    f"computed + 1 new tokens exceed max_model_len {max_len}"
                )
        out: dict[str, Allocation | None] = {}
        group = self._single_full
        if group is None:
            # Hybrid groups: the general path, one request at a time (already checked).
            for rid, token in zip(request_ids, tokens, strict=True):
                extra = extras.get(rid)
                if extra:
                    allocation = self.allocate(
                        rid,
                        1,
                        new_token_ids=[*extra, token],
                        num_computed_tokens=requests[rid].num_computed_tokens + len(extra),
                        num_lookahead_tokens=num_lookahead_tokens,
                        new_page_hashes=named.get(rid),
                    )
                else:
                    allocation = self.allocate(
                        rid,
                        1,
                        new_token_ids=(token,),
                        num_lookahead_tokens=num_lookahead_tokens,
                        new_page_hashes=named.get(rid),
                    )
                if allocation is None or any(allocation.new_page_ids):
                    out[rid] = allocation
            return out
        # One full-attention group: inline what allocate() does for a single new token.
        # Requests crossing into one new page wait in ``crossing`` and take their pages in
        # one pool call (the same pages and events: nothing else touches the pool between
        # them, as they are served before any page is cached or taken otherwise, and before
        # a refusal, which keeps the answer in request order).
        pool = self.pool
        num_free = pool._num_free
        ps = group.page_size
        page_counts = group.page_counts
        num_cached_pages = group.num_cached_pages
        caching = self.enable_caching
        hps = self.hash_page_size
        crossing: list[str] = []
        crossing_held: list[int] = []
        crossing_rows: list[int] = []

        # Pages the C pass took (evicting) for the first crossings, in order, before a fill
        # (the fill's ``stored`` event follows their ``removed`` ones); placed here.
        pretaken: list[int] = []

        def take_crossing_pages() -> None:
            taken: list[int] | None = None
            if pretaken:  # the C pass took the first ones' pages; the rest take theirs now
                num_rest = len(crossing) - len(pretaken)
                taken = pretaken + pool.allocate_each(num_rest) if num_rest else pretaken
            if len(crossing) < _MIN_BATCHED_CROSSINGS:
                if taken is not None:
                    append_page, request_rows = group.rows.append_page, group.request_rows
                    for rid, held, page in zip(crossing, crossing_held, taken, strict=True):
                        append_page(request_rows[rid], held, page)
                        page_counts[rid] = held + 1
                        out[rid] = Allocation(rid, 0, ((page,),))
                else:
                    for rid, held in zip(crossing, crossing_held, strict=True):
                        new_pages = group.allocate_new(rid, (held + 1) * ps)
                        out[rid] = Allocation(rid, 0, (tuple(new_pages),))
            else:
                if taken is not None:
                    pages = taken
                    group.place_next_pages(crossing, crossing_held, pages)
                else:
                    pages = group.allocate_next_pages(crossing, crossing_held)
                if crossed is not None:
                    crossed[0].extend(crossing_rows)
                    crossed[1].extend(pages)
                else:
                    for rid, page in zip(crossing, pages, strict=True):
                        out[rid] = Allocation(rid, 0, ((page,),))
            pretaken.clear()
            crossing.clear()
            crossing_held.clear()
            crossing_rows.clear()

        ops = pool._ops
        # With the C loops, a row whose token fills its page (and takes none) is theirs
        # too: hashed, indexed and announced as cache_next would; so are rows carrying
        # held-back tokens (``extras``, appended before the row's own).
        fill = self._fill_context(group) if caching and ops is not None else None
        n = len(reqs)
        # The client's hash of the one page a row fills, for the C loop (a row completing
        # more pages is the loop body's below).
        named_first = {rid: hashes[0] for rid, hashes in named.items() if hashes} or None
        i = 0
        while i < n:
            if ops is not None:
                # The rows that need no Python (most decodes: no page filled to cache, at
                # most one new page while pages are free) are applied in C, in order, up
                # to the next one that does, which the loop body below handles.
                i, num_free = ops.decode_rows(
                    reqs,
                    tokens,
                    i,
                    num_free,
                    page_counts,
                    num_cached_pages,
                    ps,
                    hps,
                    max_len,
                    num_lookahead_tokens,
                    caching,
                    crossing,
                    crossing_held,
                    crossing_rows,
                    fill,
                    extras or None,
                    named_first,
                    # A fill after crossings that evict: their pages first, then the fill,
                    # still in C (as this loop would take them before caching it): taken
                    # there while the pool evicts plainly, else by this callback.
                    take_crossing_pages,
                    pretaken if fill is not None and pool.evicts_plainly(group.group_id) else None,
                )
                if i == n:
                    break
            row = i
            i += 1
            req, token = reqs[row], tokens[row]
            rid = req.request_id
            computed = req.num_computed_tokens
            extra = extras.get(rid) if extras else None
            if extra:
                computed += len(extra)
            end = computed + 1
            num_slots = end + num_lookahead_tokens
            if num_slots > max_len:
                num_slots = max_len
            held = page_counts[rid]
            num_new = -(-num_slots // ps) - held
            if num_new > num_free:
                if crossing:
                    take_crossing_pages()  # the answer lists requests in order
                self._stats.num_no_capacity += 1
                out[rid] = None
                continue
            ids = req.token_ids
            if extra:
                ids.extend(extra)
            ids.append(token)
            if caching and len(ids) // hps > len(req.hashes):
                self._extend_hashes(req, named.get(rid) if named else None)
            if num_new > 0:
                num_free -= num_new
                if num_new == 1:
                    crossing.append(rid)
                    crossing_held.append(held)
                    crossing_rows.append(row)
                else:
                    if crossing:
                        take_crossing_pages()
                    out[rid] = Allocation(rid, 0, (tuple(group.allocate_new(rid, num_slots)),))
            if caching:
                num_full = min(end, len(ids)) // ps
                num_done = num_cached_pages[rid]
                if num_full > num_done:
                    if crossing:
                        take_crossing_pages()
                    if num_full == num_done + 1:
                        # The page this token filled (ids checked, hashes already extended).
                        group.cache_next(rid, req.hashes, ids, _event_keys(req.extra_keys))
                    else:
                        self._cache(req, end)
            req.num_computed_tokens = end
            req.scheduled_start = computed
            req.num_scheduled = 1
        if crossing:
            take_crossing_pages()
        return out

    def _fill_context(self, group: GroupManager) -> tuple[Any, ...] | None:
        """``_poolops.decode_rows``' fill tuple for the single full-attention group (None:
        the hasher's pages are not C's; the Python loop caches them)."""
        parts = self._page_parts
        if parts is None:
            return None
        return (
            *self.pool.fill_parts(group.group_id),
            group.rows.storage(),
            group.request_rows,
            NO_EXTRA_KEYS,
            *parts,
            new_stored,
            TokenRun.adopt,
            group.group_id,
            new_removed,
        )

    def _check_growth_hashes(
        self, req: _Request, hashes: Sequence[bytes] | PackedPageHashes, num_new: int
    ) -> Sequence[bytes]:
        """A growth's client page hashes as a checked sequence, or InvalidArgument."""
        if type(hashes) is PackedPageHashes:
            checked: Sequence[bytes] = (
                (hashes.data,) if len(hashes.data) == hashes.width else hashes.split()
            )
        else:
            checked = check_page_hashes(hashes)  # type: ignore[arg-type]
        hps = self.hash_page_size
        num_tokens = len(req.token_ids)
        num_completed = (num_tokens + num_new) // hps - num_tokens // hps
        if len(checked) > num_completed:
            raise InvalidArgument(
                f"request {req.request_id!r}: {len(checked)} page hashes for the "
                f"{num_completed} pages its {num_new} new tokens complete"
            )
        if req.hashes and req.hashes[-1] in checked:
            raise InvalidArgument(
                f"request {req.request_id!r}: page hash {req.hashes[-1].hex()} repeats its "
                "previous page's (each hash covers its whole prefix)"
            )
        return checked

    def check_growth_hashes(
        self, request_id: str, hashes: Sequence[bytes] | PackedPageHashes, num_new: int
    ) -> Sequence[bytes]:
        """What :meth:`allocate` checks of ``new_page_hashes`` for a growth of ``num_new``
        tokens of this running request, before it changes anything (InvalidArgument: more
        hashes than pages the tokens complete, or one equal to the previous page's); the
        hashes as a checked sequence."""
        return self._check_growth_hashes(self._get(request_id), hashes, num_new)

    def last_page_hash(self, request_id: str) -> bytes | None:
        """The hash of the request's last full page (None: no full page, or no caching)."""
        hashes = self._get(request_id).hashes
        return hashes[-1] if hashes else None

    def _extend_hashes(self, req: _Request, new_page_hashes: Sequence[bytes] | None) -> None:
        """Hash the request's newly full pages (the client's hashes first, if it sent any)."""
        tokens = req.token_ids
        ps = self.hash_page_size
        num_full = len(tokens) // ps
        have = len(req.hashes)
        if (
            num_full == have + 1
            and not new_page_hashes
            and (req.extra_keys is NO_EXTRA_KEYS or req.extra_keys == NO_EXTRA_KEYS)
        ):
            # A decode filled one page: hash just that page (its ids are checked ints).
            self._hasher.hash_next(req.hashes, tokens)
            return
        if new_page_hashes:
            extra = list(new_page_hashes)[: num_full - have]
            req.hashes.extend(extra)
            have += len(extra)
        if num_full > have:
            req.hashes.extend(
                hash_pages(
                    tokens[have * ps : num_full * ps],
                    ps,
                    extra_keys=req.extra_keys,
                    algorithm=self.config.hash_algorithm,
                    parent=req.hashes[-1] if req.hashes else None,
                    first_page_index=have,
                )
            )

    def _defer_cache(
        self,
        req: _Request,
        num_computed: int,
        num_hit_pages: int,
        chained: bool,
        packed: PackedPageHashes | None = None,
    ) -> None:
        """Leave an admission's caching to :meth:`settle`, holding its ``stored`` event's
        place now (after the evictions of its own allocation, as :meth:`_cache` would).
        ``chained``: its hashes are this manager's, known up to the first miss (else the
        client's, completed: every one known). ``packed``: a fresh admission's client
        hashes, every page's, of which ``req.hashes`` holds the first: remembered as raw
        bytes, made objects by settle."""
        ps = self.hash_page_size
        num_full = len(req.token_ids) // ps
        place = None
        end = min(num_computed, len(req.token_ids)) // ps
        if end > num_hit_pages:
            if len(req.hashes) <= num_hit_pages:
                self._extend_hashes(req, None)
            place = self.pool.reserve_event()
            if chained:
                self._deferred_hashes.add(req.hashes[num_hit_pages])
                self._deferred_chained = True
            elif packed is not None:
                self._deferred_digests.add(packed.data, packed.width)
            else:
                self._deferred_hashes.update(req.hashes[num_hit_pages:end])
        if place is not None or len(req.hashes) < num_full:
            self._deferred.append(_Deferred(req, num_computed, place, packed))

    def _cache(self, req: _Request, num_computed: int, place: EventPlace | None = None) -> None:
        if not self.enable_caching:
            return
        num_tokens = min(num_computed, len(req.token_ids))
        if len(self.groups) > 1:
            # Hybrid: cache only up to where every group's pages end.
            num_tokens -= num_tokens % self._hit_alignment
        for g in self.groups:
            if num_tokens // g.page_size > g.num_cached_pages.get(req.request_id, 0):
                g.cache(
                    req.request_id,
                    num_tokens,
                    self._group_hashes(g.group_id, req.hashes),
                    req.token_ids,
                    _event_keys(req.extra_keys),
                    place,
                )

    def free(self, request_id: str) -> None:
        """Release every page of the request: groups in order, each last page first."""
        if self._deferred:
            self.settle()
        self._get(request_id)
        for g in self.groups:
            g.free(request_id)
        del self._requests[request_id]

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; refused (False) while any request holds pages."""
        if self._deferred:
            self.settle()
        if self._requests:
            return False
        return self.pool.reset_prefix_cache()

    def forget_prefix_cache(self) -> int:
        """Drop the whole prefix cache even while requests hold pages. The requests keep
        their pages; none of them is hit again, and pages they fill from now on are cached
        as usual, so a caller whose reason is lost KV (a worker whose KV cache holds
        nothing joined) frees the running requests first, as the service does. Returns how
        many pages lost their hash."""
        if self._deferred:
            self.settle()
        return self.pool.forget_hashes()

    def take_events(self) -> list[KVEvent]:
        """Every KV event since the last call, oldest first."""
        if self._deferred:
            self.settle()
        return self.pool.take_events()

    # -- publication ---------------------------------------------------------------------
    def build_batch(
        self,
        request_ids: Sequence[str],
        kernel_block_sizes: Sequence[int] | None = None,
        *,
        num_scheduled_tokens: Sequence[int] | None = None,
        num_computed_tokens: Sequence[int] | None = None,
        pad_id: int = 0,
    ) -> list[BatchTables]:
        """Per group: the kernel block table of these requests in this order, their row
        lengths, and the slot mapping of the tokens each was last allocated for (or the
        last ``num_scheduled_tokens[i]`` of them). ``kernel_block_sizes[g]`` defaults to
        the group's page size. Mamba groups without state caching publish one state page
        per row and no slots.

        ``num_computed_tokens[i]`` (-1: the request's own count) ends row ``i``'s slots
        there instead: a scheduler that holds back decodes needing no page runs ahead of
        the manager's count by those decodes. It may not fall behind it, and the slots must
        lie in the request's pages. A row running ahead defaults to one scheduled token
        (a held-back decode)."""
        if kernel_block_sizes is None:
            kernel_block_sizes = [g.page_size for g in self.groups]
        if len(kernel_block_sizes) != len(self.groups):
            raise InvalidArgument(
                f"{len(kernel_block_sizes)} kernel block sizes for {len(self.groups)} groups"
            )
        if len(set(request_ids)) != len(request_ids):
            raise InvalidArgument("a request appears twice in the batch")
        reqs = [self._get(rid) for rid in request_ids]
        n = len(reqs)
        own = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, n)
        ends = own
        ahead = None
        if num_computed_tokens is not None:
            given = np.asarray(num_computed_tokens, dtype=np.int64)
            if given.shape != own.shape:
                raise InvalidArgument("num_computed_tokens must match request_ids")
            ends = np.where(given < 0, own, given)
            if (ends < own).any():
                i = int(np.flatnonzero(ends < own)[0])
                raise InvalidArgument(
                    f"request {request_ids[i]!r}: num_computed_tokens {int(ends[i])} is "
                    f"behind the manager's {int(own[i])}"
                )
            ahead = ends > own
        if num_scheduled_tokens is None:
            starts = np.fromiter((r.scheduled_start for r in reqs), np.int64, n)
            counts = np.fromiter((r.num_scheduled for r in reqs), np.int64, n)
            if ahead is not None:
                counts = np.where(ahead, 1, counts)
                starts = np.where(ahead, ends - 1, starts)
        else:
            if len(num_scheduled_tokens) != n:
                raise InvalidArgument("num_scheduled_tokens must match request_ids")
            counts = np.asarray(num_scheduled_tokens, dtype=np.int64)
            if (counts < 0).any() or (counts > ends).any():
                raise InvalidArgument("num_scheduled_tokens outside [0, num_computed_tokens]")
            starts = ends - counts
        out = []
        for g, kbs in zip(self.groups, kernel_block_sizes, strict=True):
            rows = np.fromiter((g.request_rows[r] for r in request_ids), np.int64, len(reqs))
            table, num_pages = g.rows.gather(rows)
            if g.config.kind in _RELEASING_KINDS and n:
                _check_no_released_slots(request_ids, table, num_pages, starts, counts, g)
            is_stateful = g.config.kind is GroupKind.MAMBA and not g.config.enable_state_caching
            out.append(
                build_batch_tables(
                    table,
                    num_pages,
                    starts if not is_stateful else np.zeros_like(starts),
                    counts if not is_stateful else np.zeros_like(counts),
                    page_size=g.page_size,
                    kernel_block_size=int(kbs),
                    group_id=g.group_id,
                    pad_id=pad_id,
                )
            )
        return out

    # -- snapshots -----------------------------------------------------------------------
    def snapshot_state(self) -> dict[str, Any]:
        """The whole state as a tree of plain values and numpy arrays (no I/O; see
        :mod:`pagekeeper.core.snapshot`). :meth:`restore_state` gives it back exactly."""
        from pagekeeper.core.snapshot import snapshot_manager

        if self._deferred:
            self.settle()

        tree: dict[str, Any] = snapshot_manager(self)
        return tree

    @classmethod
    def restore_state(cls, config: PoolConfig, tree: dict[str, Any]) -> PageManager:
        """A manager in exactly the state :meth:`snapshot_state` recorded (InvalidArgument
        when the tree does not fit ``config``)."""
        from pagekeeper.core.snapshot import restore_manager

        manager: PageManager = restore_manager(config, tree)
        return manager

    # -- integrity -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute everything from scratch; raise :class:`InvariantViolation` listing
        every breach: pages conserved, a page is free exactly when its ref count is 0,
        per-request references sum to the ref counts, every index entry points at a page
        with that hash, tables never exceed the request's needs."""
        if self._deferred:
            self.settle()
        problems: list[str] = []
        expected = np.zeros(self.pool.num_pages, dtype=np.int64)
        for g in self.groups:
            if set(g.request_rows) != set(self._requests):
                problems.append(f"group {g.group_id} tracks other requests than the manager")
            if set(g.num_cached_pages) != set(g.request_rows):
                problems.append(f"group {g.group_id}: cached-page counters out of step")
            for rid, row in g.request_rows.items():
                if g.page_counts.get(rid) != g.rows.num_pages(row):
                    problems.append(f"group {g.group_id}: page count of {rid} != its row")
            for rid, row in g.request_rows.items():
                pages = g.rows.row(row)
                real = pages[pages != NULL_PAGE]
                counts = Counter(real.tolist())
                dup = [p for p, c in counts.items() if c > 1]
                if dup:
                    problems.append(f"request {rid} holds pages {dup} twice in group {g.group_id}")
                np.add.at(expected, real, 1)
                if g.num_cached_pages.get(rid, 0) > len(pages):
                    problems.append(f"request {rid}: more pages cached than held")
        problems += self.pool.check_invariants(expected)
        used = self.pool.num_used_pages
        if used + self.pool.num_free_pages != self.pool.num_pages - 1:
            problems.append("pages not conserved: used + free != num_pages - 1")
        if problems:
            raise InvariantViolation("; ".join(problems))
