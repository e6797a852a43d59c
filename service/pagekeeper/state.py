"""The service's state, free of any transport: the core, the clients, who owns what.

:class:`ServiceState` owns the :class:`~pagekeeper.core.manager.PageManager`, the client
registry (roles, leases, generations, chosen kernel block sizes), request ownership, each
client's last step answer (for idempotent retries), the recent KV events and cheap counters.
The gRPC servicer and the REST routers are thin adapters around it: convert, call, convert.

Every mutation is a method taking one plain *command* dataclass (:class:`StepCommand`,
:class:`RegisterCommand`, ...; :meth:`ServiceState.apply` dispatches any of them). A command
carries everything the mutation depends on, time included (``now``), so the same commands
applied to a fresh state give the same state, page for page: a durable command log can
record them before they are acknowledged and replay them after a crash.

Durability hooks (the state does no I/O itself): a :class:`Journal` attached as
``state.journal`` is handed every command that changed something, with its result, after
it applied and before the caller sees the answer (so before it is acknowledged);
:meth:`ServiceState.snapshot_state` / :meth:`ServiceState.restore_state` turn the whole
state into a tree of plain values and back; :meth:`ServiceState.replay` applies a command
read back from the log. A journal that fails *fences* the state: it is then ahead of its
log, so every later mutation is refused until the process restarts and recovers.

Validation happens before any change: a command that raises a
:class:`~pagekeeper.core.errors.PagekeeperError` changed nothing. Nothing here awaits, so
one call is atomic with respect to every other coroutine of the process.

A step, in the order it is applied::

    validate everything ──▶ frees ──▶ growths ──▶ admissions ──▶ build + publish batch
    (raise: no change)      (owned)   (allocate)   (admit)        (one table per group and
                                                                    per kernel block size)
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import pairwise
from operator import attrgetter, itemgetter
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pagekeeper.core.config import GroupKind, PoolConfig
from pagekeeper.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    InvariantViolation,
    NotFound,
    PagekeeperError,
    PermissionDenied,
    ResourceExhausted,
    Superseded,
    Unavailable,
)
from pagekeeper.core.events import KVEvent, event_nbytes
from pagekeeper.core.hashing import digest_size, validate_extra_keys
from pagekeeper.core.manager import (
    CheckedPageHashes,
    CheckedTokens,
    PackedPageHashes,
    PageManager,
    check_packed_page_hashes,
    check_page_hashes,
    check_token_ids,
    decode_columns,
    first_repeat,
    non_negative_token_ids,
)
from pagekeeper.core.tables import MultipleOf, choose_kernel_block_size, expand_to_kernel_blocks
from pagekeeper.core.types import (
    Allocation,
    BatchTables,
    ExtraKeys,
    Int32Array,
    LookupResult,
    PoolStats,
    RequestInfo,
    RunningRequest,
    RunningRows,
)
from pagekeeper.publish.api import RingDescriptor

MAX_ID_BYTES = 256
"""Longest request or client id accepted (UTF-8 bytes)."""

log = logging.getLogger("pagekeeper.state")


class ClientRole(StrEnum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class AllocationStatus(StrEnum):
    OK = "ok"
    NO_CAPACITY = "no_capacity"
    """Not enough free pages; nothing changed for the request (the scheduler preempts)."""
    REJECTED = "rejected"
    """The core refused the request's arguments at apply time (something only the apply
    order reveals, e.g. ``num_new_tokens`` beyond what the cache hit left); nothing
    changed for it. The reason says why."""


class PageState(StrEnum):
    NULL = "null"
    """Page 0: pads tables, never handed out."""
    FREE = "free"
    """In the free queue with no cached hash."""
    CACHED = "cached"
    """In the free queue, still in the prefix-cache index (a hit can revive it)."""
    USED = "used"
    """Held by at least one request."""


# -- commands ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """One attention backend's supported kernel block sizes (exact, or multiples of)."""

    name: str = ""
    block_sizes: tuple[int, ...] = ()
    multiple_of: tuple[int, ...] = ()

    def specs(self) -> list[int | MultipleOf]:
        return [*self.block_sizes, *(MultipleOf(n) for n in self.multiple_of)]


@dataclass(frozen=True, slots=True)
class GroupKernelSupport:
    group_id: int
    backends: tuple[KernelBackend, ...]


@dataclass(frozen=True, slots=True)
class RegisterCommand:
    now: float
    role: ClientRole
    name: str = ""
    client_id: str = ""
    """Empty: a new id is assigned. A registered id: takeover (generation + 1)."""
    lease_ttl_s: float = 0.0
    """0: the server default."""
    device: str = ""
    kernel_support: tuple[GroupKernelSupport, ...] = ()
    identity: str = ""
    """The TLS certificate subject of the registering connection, where the service asks
    for client certificates ("" otherwise): the registration is bound to it."""
    fresh_kv_cache: bool = False
    """Workers: their KV cache holds nothing yet, so neither the running requests' KV nor
    the cached pages' is there: the running requests are freed and revoked, then the
    prefix cache is forgotten (``PageManager.forget_prefix_cache``)."""


@dataclass(frozen=True, slots=True)
class HeartbeatCommand:
    now: float
    client_id: str
    generation: int


@dataclass(frozen=True, slots=True)
class UnregisterCommand:
    now: float
    client_id: str
    generation: int


@dataclass(slots=True, eq=False)
class Admission:
    """A new (or resumed) request. Not ``frozen`` for the reason :class:`Growth` is not (a
    frozen ``__init__`` costs several times more, per admission of every step); treat it
    as immutable like every command."""

    request_id: str
    token_ids: Int32Array
    num_new_tokens: int = 0
    """0: every token after the cached prefix."""
    extra_keys: ExtraKeys | None = None
    page_hashes: tuple[bytes, ...] | PackedPageHashes | None = None
    num_lookahead_tokens: int = 0
    enable_cache_read: bool = True
    packed_page_hashes: bytes | None = None
    """``page_hashes`` packed end to end, each of the pool's page-hash size (the wire's
    ``packed_page_hashes``); not with ``page_hashes``. The state's check of the step
    leaves them checked in ``page_hashes`` (and clears this)."""
    checked_token_ids: CheckedTokens | None = field(default=None, repr=False)
    """``token_ids`` as the state's check of the step left them, for the manager to keep
    (set by the state; ``None`` until then)."""


@dataclass(slots=True, eq=False)
class Growth:
    """Room for more tokens of a running request. Not ``frozen`` only because a decode step
    builds hundreds of these and a frozen ``__init__`` costs 3-4x more; treat it as
    immutable like every command."""

    request_id: str
    num_new_tokens: int
    new_token_ids: Int32Array
    num_computed_tokens: int | None = None
    num_lookahead_tokens: int = 0
    page_hashes: tuple[bytes, ...] | PackedPageHashes | None = None
    """Client hashes of the pages the new tokens complete, in order from the request's
    first full page without one (at most one per such page; the service hashes the rest)."""
    packed_page_hashes: bytes | None = None
    """``page_hashes`` packed end to end, ``page_hash_size`` bytes each; not with
    ``page_hashes``. The state's check of the step leaves them checked in ``page_hashes``
    (and clears this)."""
    page_hash_size: int = 0
    """Bytes in each of ``packed_page_hashes``; 0: the pool's page-hash size."""


MAX_PAGE_HASH_SIZE = 64
"""Most bytes in one client page hash sent packed with its own size."""


def packed_hash_size(size: int, pool_size: int, what: str) -> int:
    """The width of packed client hashes: ``size``, or the pool's when 0 (InvalidArgument
    outside 0..MAX_PAGE_HASH_SIZE)."""
    if size == 0:
        return pool_size
    if not 0 < size <= MAX_PAGE_HASH_SIZE:
        raise InvalidArgument(f"{what} {size} outside [0, {MAX_PAGE_HASH_SIZE}] (0: the pool's)")
    return size


def plain_decodes(request_ids: Sequence[str], tokens: Int32Array) -> tuple[Growth, ...]:
    """One plain decode (one new token, the tracked computed count) per request:
    ``tokens[i]`` appended to ``request_ids[i]``."""
    return tuple(Growth(rid, 1, tokens[i : i + 1]) for i, rid in enumerate(request_ids))


# Fewer growths than this in column form take the per-growth path (cheaper than the
# column form's fixed cost of a few dozen numpy calls).
MIN_COLUMN_GROWTHS = 8
_NO_IDS: frozenset[str] = frozenset()
MAX_STEP_ID = 2**63 - 1
_REVOKED_REASON = (
    "request {!r} was freed by an admin (DELETE /v1/requests/...); preempt it and free it"
)


@dataclass(frozen=True, slots=True, eq=False)
class GrowthColumns:
    """The same growths as a tuple of :class:`Growth`, column by column (growth ``i`` is
    ``request_ids[i]`` with entry ``i`` of every per-growth column): a decode step of
    hundreds of requests arrives as a few arrays, and its plain decodes (one new token,
    tracked computed count) are applied by the core in one call.

    ``new_token_ids`` holds every growth's new tokens concatenated in growth order,
    ``num_new_token_ids[i]`` of them for growth ``i``; ``num_computed_tokens[i]`` is -1
    for "what the service tracked".

    ``defaults_only``: whoever built the columns vouches that the four count columns hold
    their defaults alone (``num_new_tokens`` and ``num_new_token_ids`` 1, ``num_computed_
    tokens`` -1, ``num_lookahead_tokens`` 0), as the wire conversion knows when they were
    left out: every growth is a plain decode, and the state checks and applies the step
    without reading those columns (the same outcome, ~50 us less for 256 decodes)."""

    request_ids: tuple[str, ...]
    num_new_tokens: Int32Array
    new_token_ids: Int32Array
    num_new_token_ids: Int32Array
    num_computed_tokens: Int32Array
    num_lookahead_tokens: Int32Array
    defaults_only: bool = False
    packed_page_hashes: bytes = b""
    """Every growth's page hashes (see :attr:`Growth.page_hashes`) packed end to end,
    ``page_hash_size`` bytes each, in growth order: ``num_page_hashes[i]`` of them for
    growth ``i``."""
    num_page_hashes: Int32Array | None = None
    """None: no growth carries hashes (``packed_page_hashes`` must be empty)."""
    page_hash_size: int = 0
    """Bytes in each of ``packed_page_hashes``; 0: the pool's page-hash size."""

    def __len__(self) -> int:
        return len(self.request_ids)

    @classmethod
    def decodes(
        cls, request_ids: Sequence[str], token_ids: Any, num_lookahead_tokens: int = 0
    ) -> GrowthColumns:
        """One plain decode per request: ``token_ids[i]`` appended to request ``i``."""
        n = len(request_ids)
        ones = np.ones(n, dtype=np.int32)
        return cls(
            tuple(request_ids),
            ones,
            np.asarray(token_ids, dtype=np.int32),
            ones,
            np.full(n, -1, dtype=np.int32),
            np.full(n, num_lookahead_tokens, dtype=np.int32),
            defaults_only=num_lookahead_tokens == 0,
        )

    def check_shape(self, pool_hash_size: int = 0) -> None:
        """Every per-growth column has one entry per growth, the token counts add up, and
        so do the page hashes, ``page_hash_size`` bytes each (``pool_hash_size`` when 0)
        (InvalidArgument naming the column otherwise)."""
        n = len(self.request_ids)
        columns = {
            "num_new_tokens": self.num_new_tokens,
            "num_new_token_ids": self.num_new_token_ids,
            "num_computed_tokens": self.num_computed_tokens,
            "num_lookahead_tokens": self.num_lookahead_tokens,
        }
        for name, column in columns.items():
            if column.shape != (n,):
                raise InvalidArgument(
                    f"growth_columns.{name} has {column.size} entries for {n} growths"
                )
        counts = self.num_new_token_ids
        if n and int(counts.min()) < 0:
            raise InvalidArgument("growth_columns.num_new_token_ids must be >= 0")
        total = int(counts.sum(dtype=np.int64))
        if total != self.new_token_ids.size:
            raise InvalidArgument(
                f"growth_columns.num_new_token_ids adds up to {total} tokens but "
                f"new_token_ids holds {self.new_token_ids.size}"
            )
        self.check_hash_shape(pool_hash_size)

    def check_hash_shape(self, pool_hash_size: int) -> int:
        """The page-hash columns' part of :meth:`check_shape`; returns the hashes' size."""
        hashes = self.num_page_hashes
        n = len(self.request_ids)
        if hashes is None:
            if self.packed_page_hashes:
                raise InvalidArgument("growth_columns.packed_page_hashes without num_page_hashes")
            return pool_hash_size
        if hashes.shape != (n,):
            raise InvalidArgument(
                f"growth_columns.num_page_hashes has {hashes.size} entries for {n} growths"
            )
        if n and int(hashes.min()) < 0:
            raise InvalidArgument("growth_columns.num_page_hashes must be >= 0")
        num_hashes = int(hashes.sum(dtype=np.int64))
        hash_size = packed_hash_size(
            self.page_hash_size, pool_hash_size, "growth_columns.page_hash_size"
        )
        if num_hashes * hash_size != len(self.packed_page_hashes):
            raise InvalidArgument(
                f"growth_columns.num_page_hashes adds up to {num_hashes} hashes of "
                f"{hash_size} bytes but packed_page_hashes holds "
                f"{len(self.packed_page_hashes)} bytes"
            )
        return hash_size

    def token_offsets(self) -> npt.NDArray[np.int64]:
        """Where each growth's tokens start in ``new_token_ids`` (n + 1 entries)."""
        offsets = np.zeros(len(self.request_ids) + 1, dtype=np.int64)
        np.cumsum(self.num_new_token_ids, out=offsets[1:])
        return offsets

    def hash_offsets(self) -> npt.NDArray[np.int64] | None:
        """Where each growth's page hashes start among the packed ones, in hashes (n + 1
        entries); None when no growth carries any."""
        if self.num_page_hashes is None:
            return None
        offsets = np.zeros(len(self.request_ids) + 1, dtype=np.int64)
        np.cumsum(self.num_page_hashes, out=offsets[1:])
        return offsets

    def growth(
        self,
        i: int,
        offsets: npt.NDArray[np.int64] | None = None,
        hash_offsets: npt.NDArray[np.int64] | None = None,
        pool_hash_size: int = 0,
    ) -> Growth:
        """Growth ``i`` as a :class:`Growth` (its page hashes, if any, packed as they came:
        ``hash_offsets`` from :meth:`hash_offsets`; shape checked)."""
        if offsets is None:
            offsets = self.token_offsets()
        computed = int(self.num_computed_tokens[i])
        packed = None
        hash_size = self.page_hash_size or pool_hash_size
        if hash_offsets is not None and hash_offsets[i + 1] > hash_offsets[i]:
            packed = self.packed_page_hashes[
                int(hash_offsets[i]) * hash_size : int(hash_offsets[i + 1]) * hash_size
            ]
        return Growth(
            self.request_ids[i],
            int(self.num_new_tokens[i]),
            self.new_token_ids[int(offsets[i]) : int(offsets[i + 1])],
            None if computed == -1 else computed,  # < -1 is refused by the validation
            int(self.num_lookahead_tokens[i]),
            None,
            packed,
            self.page_hash_size,
        )

    def growths(self, pool_hash_size: int = 0) -> tuple[Growth, ...]:
        offsets, hash_offsets = self.token_offsets(), self.hash_offsets()
        return tuple(
            self.growth(i, offsets, hash_offsets, pool_hash_size)
            for i in range(len(self.request_ids))
        )

    def checked_growths(self, pool_hash_size: int = 0) -> tuple[Growth, ...]:
        """:meth:`check_shape`, then :meth:`growths`; for plain decodes (``defaults_only``:
        one token each) without numpy's reductions (one decode: ~0.8 us against ~5.8)."""
        if not self.defaults_only or self.num_page_hashes is not None:
            self.check_shape(pool_hash_size)
            return self.growths(pool_hash_size)
        tokens, n = self.new_token_ids, len(self.request_ids)
        if tokens.shape != (n,):
            raise InvalidArgument(
                f"growth_columns.num_new_token_ids adds up to {n} tokens but new_token_ids "
                f"holds {tokens.size}"
            )
        return plain_decodes(self.request_ids, tokens)


@dataclass(frozen=True, slots=True, eq=False)
class Batch:
    request_ids: tuple[str, ...]
    num_scheduled_tokens: Int32Array | None = None
    num_computed_tokens: Int32Array | None = None
    """Per row, its computed count after this step as the client counts it (a client that
    holds back decodes needing nothing from the service runs ahead of the service's count);
    None: the service's own."""


@dataclass(frozen=True, slots=True, eq=False)
class StepCommand:
    now: float
    client_id: str
    generation: int
    step_id: int
    frees: tuple[str, ...] = ()
    growths: tuple[Growth, ...] = ()
    admissions: tuple[Admission, ...] = ()
    batch: Batch | None = None
    growth_columns: GrowthColumns | None = None
    """The growths in column form, instead of ``growths`` (not both)."""
    wire: Any = field(default=None, repr=False)
    """The ``StepRequest`` message this command was read from, when it came over gRPC or
    the same-node socket: the journal stores its bytes instead of encoding the command."""
    wire_bytes: bytes | memoryview | None = field(default=None, repr=False)
    """The bytes ``wire`` was parsed from, when the transport kept them: the journal writes
    them as they are (``None``: it serializes ``wire``)."""


@dataclass(frozen=True, slots=True)
class ExpireLeasesCommand:
    now: float


@dataclass(frozen=True, slots=True)
class ResetPrefixCacheCommand:
    now: float


@dataclass(frozen=True, slots=True)
class ForceFreeCommand:
    """Admin: free a request whoever owns it."""

    now: float
    request_id: str


@dataclass(frozen=True, slots=True)
class ResumeLeasesCommand:
    """Leases set again at ``now``, by ``mode``: ``extend`` (after a restart or a stall:
    every client gets at least one full lease; the service not answering is not the
    client's fault), ``exact`` (the same when some lease ran past one full lease, the wall
    clock having gone back: every lease is exactly one), ``shift`` (the wall clock stepped
    by ``by`` seconds while no time passed for the clients: every lease moves with it,
    keeping the time it had left), ``cap`` (leases past one full lease end there: what one
    development build wrote for a step back). :meth:`ServiceState.resume_command` picks
    between the first two."""

    now: float
    mode: str = "extend"
    by: float = 0.0


RESUME_MODES = ("extend", "cap", "exact", "shift")


@dataclass(frozen=True, slots=True)
class ConfigureLimitsCommand:
    """Limits changed between two runs over the same durable state (they decide how later
    commands apply, so the change is itself a logged command)."""

    now: float
    limits: Limits


Command = (
    RegisterCommand
    | HeartbeatCommand
    | UnregisterCommand
    | StepCommand
    | ExpireLeasesCommand
    | ResetPrefixCacheCommand
    | ForceFreeCommand
    | ResumeLeasesCommand
    | ConfigureLimitsCommand
)

STATE_SNAPSHOT_VERSION = 2
"""Version of :meth:`ServiceState.snapshot_state`'s tree (the core's has its own). Version
1 also listed each request's owner and counts, which the core's tree holds: still read."""

# -- results -------------------------------------------------------------------------------


@dataclass(slots=True)
class AllocationOutcome:
    """One growth's or admission's answer. Not frozen (a frozen dataclass's ``__init__``
    costs 3-4x more, and a step where every decode takes a page builds hundreds); never
    changed once built."""

    request_id: str
    status: AllocationStatus
    num_cached_tokens: int = 0
    new_page_ids: tuple[tuple[int, ...], ...] = ()
    hit_page_ids: tuple[tuple[int, ...], ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class GrowthGrants:
    """Growths of the column form that took one new page each together with others (a
    single full-attention group), kept as columns rather than an outcome apiece."""

    growth_ids: Sequence[str]
    """Every growth's request id, in the order of the step's growth columns."""
    growth_index: list[int]
    """Each granted growth's position in ``growth_ids``, ascending."""
    page_ids: list[int]
    """The page each was handed."""
    num_listed_growths: int
    """How many of the step result's ``listed`` outcomes are growths (the rest: admissions)."""

    def merge(self, listed: tuple[AllocationOutcome, ...]) -> tuple[AllocationOutcome, ...]:
        """``listed`` with these growths' outcomes put in their places (growth order)."""
        n = self.num_listed_growths
        position = {rid: i for i, rid in enumerate(self.growth_ids)}
        ok = AllocationStatus.OK
        ids = self.growth_ids
        keyed = [(position[o.request_id], o) for o in listed[:n]]
        keyed += [
            (i, AllocationOutcome(ids[i], ok, 0, ((page,),)))
            for i, page in zip(self.growth_index, self.page_ids, strict=True)
        ]
        keyed.sort(key=_FIRST)
        return tuple(o for _, o in keyed) + listed[n:]


_FIRST = itemgetter(0)


@dataclass(frozen=True, slots=True, eq=False)
class StepResult:
    step_id: int
    listed: tuple[AllocationOutcome, ...]
    """The outcomes not in ``grants``: growths that got pages or were refused (in order),
    then every admission (in order)."""
    is_published: bool = False
    published_slot: int = -1
    unscheduled_request_ids: tuple[str, ...] = ()
    num_free_pages: int = 0
    last_event_seq: int = 0
    publish_error: str = ""
    is_retry: bool = False
    """True when answered from memory (a retried step id)."""
    grants: GrowthGrants | None = None
    """Growths granted one page each, as columns (None: every outcome is in ``listed``)."""
    revoked_request_ids: tuple[str, ...] = ()
    """The client's requests an admin freed that it has not freed since (sorted), on every
    answer until it frees them: a growth of one gets NO_CAPACITY, a batch leaves it out,
    and freeing it is accepted as done."""
    names_revoked: bool = False
    """The step named (freed, grew or batched) a request an admin freed: a version that
    does not know revocations would refuse it, so its journal record is of a version such
    a reader refuses whole. Only on the applied answer (not compared, not stored)."""

    @property
    def results(self) -> tuple[AllocationOutcome, ...]:
        """Every growth that got pages or was refused (in order), then every admission (in
        order). A growth not listed succeeded without needing a new page."""
        if self.grants is None:
            return self.listed
        return self.grants.merge(self.listed)

    def _key(self) -> tuple[Any, ...]:
        return (
            self.step_id,
            self.results,
            self.is_published,
            self.published_slot,
            self.unscheduled_request_ids,
            self.num_free_pages,
            self.last_event_seq,
            self.publish_error,
            self.is_retry,
            self.revoked_request_ids,
        )

    def __eq__(self, other: object) -> bool:
        """The same answer, however its grants are held."""
        if not isinstance(other, StepResult):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class RegisterResult:
    client_id: str
    generation: int
    lease_ttl_s: float
    kernel_block_sizes: tuple[int, ...]
    ring: RingDescriptor | None
    last_step_id: int
    last_published_step_seq: int
    request_ids: tuple[str, ...] = ()
    """A takeover: the running requests the id owns (sorted)."""


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    lease_ttl_s: float
    ring: RingDescriptor | None
    last_event_seq: int


@dataclass(frozen=True, slots=True)
class ExpireResult:
    expired_client_ids: tuple[str, ...]
    num_freed_requests: int


@dataclass(frozen=True, slots=True)
class PageView:
    page_id: int
    state: PageState
    ref_count: int
    is_cached: bool
    group_id: int | None
    page_hash: bytes | None


@dataclass(frozen=True, slots=True)
class EventsPage:
    events: tuple[KVEvent, ...]
    fell_behind: bool
    first_retained_seq: int
    last_event_seq: int


@dataclass(slots=True)
class ClientRecord:
    """One registration (mutable: the registry's own record)."""

    client_id: str
    role: ClientRole
    name: str
    device: str
    generation: int
    lease_ttl_s: float
    registered_at: float
    expires_at: float
    kernel_support: tuple[GroupKernelSupport, ...] = ()
    kernel_block_sizes: tuple[int, ...] = ()
    request_ids: set[str] = field(default_factory=set)
    last_step_id: int = 0
    last_step_result: StepResult | None = None
    num_steps: int = 0
    identity: str = ""
    """The certificate subject this registration is bound to ("": none)."""
    revoked: set[str] = field(default_factory=set)
    """This scheduler's requests an admin freed (``ForceFreeCommand``) that its steps have
    not named since: the next step that frees one has that free accepted as done, one that
    grows it gets NO_CAPACITY (the scheduler preempts it), one whose batch lists it has it
    left out; an admission of the id, or a free, ends it."""


# A step is validated whole, up front, against the core's own running requests (its
# read-only view): the state keeps no copy of their counts to update per row.
_TOKEN_IDS = attrgetter("token_ids")
_NUM_COMPUTED_TOKENS = attrgetter("num_computed_tokens")


@dataclass(slots=True)
class ServiceCounters:
    num_steps: int = 0
    num_step_retries: int = 0
    num_steps_rejected: int = 0
    num_published: int = 0
    num_publish_errors: int = 0
    num_registrations: int = 0
    num_expired_clients: int = 0
    num_force_frees: int = 0
    """Requests freed by an operator (``DELETE /v1/requests/{id}``), whoever owned them."""
    num_prefix_cache_forgets: int = 0
    """Workers that registered with an empty KV cache, each emptying the prefix cache."""
    num_kv_loss_revocations: int = 0
    """Running requests freed and revoked because a worker with an empty KV cache joined."""
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    """Apply time of the most recent steps (not including transport), for percentiles."""

    def step_percentiles(self) -> dict[str, float]:
        if not self.step_seconds:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        arr = np.fromiter(self.step_seconds, dtype=np.float64)
        p50, p99 = np.percentile(arr, [50, 99])
        return {"p50": float(p50), "p99": float(p99), "max": float(arr.max())}


DEFAULT_EVENT_BUFFER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    max_requests_per_step: int = 1024
    max_tokens_per_step: int = 16384
    max_clients: int = 64
    lease_ttl_s: float = 10.0
    max_lease_ttl_s: float = 300.0
    lease_grace_s: float = 0.0
    event_buffer_size: int = 65536
    event_buffer_bytes: int = DEFAULT_EVENT_BUFFER_BYTES
    """The KV-event buffer also stops at about this many bytes (``event_nbytes``): stored
    events carry their tokens, so 65,536 admissions' worth would hold gigabytes and make
    every snapshot (and a graceful stop) take tens of seconds."""


class Journal(Protocol):
    """Where mutations go before they are acknowledged (the durable command log)."""

    def record(self, command: Command, result: Any) -> None:
        """Make ``command`` (applied, with ``result``) durable, or raise."""
        ...


class TableSink(Protocol):
    """Where published batches go (the publication hub: a ring plus stream subscribers).
    Absent while replaying a log: replay rebuilds state, it does not republish."""

    def configure(self, tables: tuple[tuple[int, int], ...]) -> RingDescriptor | None:
        """(Re)create the ring for these (group_id, kernel_block_size) tables; an empty
        tuple releases it. Returns the current descriptor (None: no ring)."""
        ...

    def descriptor(self) -> RingDescriptor | None: ...

    def publish(self, step_seq: int, tables: Sequence[BatchTables]) -> int:
        """Publish one batch; returns the ring slot written (-1 without a ring)."""
        ...


_I32 = np.dtype(np.int32)


def _as_int32(array: Any, what: str) -> Int32Array:
    if type(array) is np.ndarray and array.dtype == _I32 and array.ndim == 1:
        return array  # what the wire decodes to: nothing to check or convert
    out = np.asarray(array)
    if out.ndim != 1 or out.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be a 1-D integer array")
    return out.astype(np.int32, copy=False)


def _check_id(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a non-empty string")
    # (A character is at most 4 bytes of UTF-8: a short id needs no encoding.)
    if (
        len(value) > MAX_ID_BYTES // 4
        and len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES
    ):
        raise InvalidArgument(f"{what} is longer than {MAX_ID_BYTES} bytes")
    return value


class ServiceState:
    """The single writer over one pool. Not thread-safe: one event loop calls it."""

    def __init__(
        self,
        pool_config: PoolConfig,
        limits: Limits | None = None,
        *,
        sink: TableSink | None = None,
        debug_invariants: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pool_config = pool_config
        self._hash_page_size = pool_config.hash_page_size
        self.page_hash_size = digest_size(pool_config.hash_algorithm)
        """Bytes in one page hash: the width of an admission's ``packed_page_hashes``."""
        self.limits = limits or Limits()
        self.manager = PageManager(pool_config)
        self.sink = sink
        self.debug_invariants = debug_invariants
        self.clock = clock
        """Adapters stamp commands with ``clock()``; the state itself never reads it."""
        self.journal: Journal | None = None
        """Receives every applied mutation before its answer returns (None: not durable)."""
        self._fenced_reason = ""
        self.counters = ServiceCounters()
        self._clients: dict[str, ClientRecord] = {}
        self._requests: Mapping[str, RunningRequest] = self.manager.requests
        self._next_client_number = 1
        self._last_published_step_seq = 0
        # Distinct per-group kernel block size tuples of registered workers -> how many use
        # each; a published batch carries one table per group and per distinct size.
        self._kernel_sets: dict[tuple[int, ...], int] = {}
        # Recent KV events for resumption, oldest first; bounded by count and by bytes.
        self._events: deque[KVEvent] = deque()
        # Each kept event's event_nbytes, in the same order: a trimmed event's size is
        # taken from here, not figured again (~0.15 us an event, every event once trimmed).
        self._event_sizes: deque[int] = deque()
        self._events_nbytes = 0
        self._last_event_seq = 0
        self._listeners: list[Callable[[], None]] = []
        self._page_sizes = tuple(g.page_size for g in pool_config.groups)
        # Called when a step leaves prefix-cache work for settle() (None: none is left).
        self._schedule_settle: Callable[[], None] | None = None
        # The rows the step being checked gathered for its decode columns and, for plain
        # decodes, their checked page hashes by request (handed to the core with them;
        # None outside a step's check and apply).
        self._column_rows: RunningRows | None = None
        self._column_hashes: dict[str, tuple[bytes, ...]] | None = None
        self._column_tracked: npt.NDArray[np.int64] | None = None
        # decode_columns' split of columns that are all decodes (tokens, held, lookahead).
        self._column_plan: tuple[list[int], dict[str, list[int]], int] | None = None

    # -- deferred caching --------------------------------------------------------------
    def defer_caching(self, schedule: Callable[[], None]) -> None:
        """Let steps leave their admissions' prefix-cache work (hashing past the lookup's
        first miss, entering the pages into the index, their ``stored`` events; dropping
        the cached pages their allocations took, their ``removed`` events) until after
        the answer: a step that leaves some calls ``schedule()``, which must get
        :meth:`settle` called soon (the service: a timer, ``SETTLE_DELAY_S``). Every other
        method settles first, so nothing reads the state half done; the events keep their
        seqs and order. See :attr:`PageManager.defer_caching`."""
        self._schedule_settle = schedule
        self.manager.defer_caching = True

    def settle(self) -> None:
        """Do the evictions and prefix-cache work steps left (nothing when none is left),
        and take the events it made into the buffer (also when a manager read settled it)."""
        manager = self.manager
        if manager.has_deferred:
            try:
                manager.settle()
            except Exception as exc:
                # A bug, with the index half done: refuse every change from now on (the
                # restart replays the log, which caches at once).
                self._fenced_reason = f"deferred prefix caching failed: {type(exc).__name__}: {exc}"
                raise InvariantViolation(self._fenced_reason) from exc
        if manager.pool.has_events:
            self._take_events()
            if self.debug_invariants:
                self.check_invariants()

    # -- listeners ---------------------------------------------------------------------
    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every mutation (e.g. to wake event streams)."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.remove(callback)

    def _take_events(self) -> None:
        if self.manager.has_deferred:
            return  # settle() takes them, in order, once the deferred ones are made
        events = self.manager.take_events()
        if events:
            self._events.extend(events)
            sizes = list(map(event_nbytes, events))
            self._event_sizes.extend(sizes)
            self._events_nbytes += sum(sizes)
            self._trim_events()
            self._last_event_seq = events[-1].seq

    def _trim_events(self) -> None:
        """Drop the oldest events past either limit (the newest one always stays)."""
        events, limits = self._events, self.limits
        while len(events) > limits.event_buffer_size or (
            self._events_nbytes > limits.event_buffer_bytes and len(events) > 1
        ):
            events.popleft()
            self._events_nbytes -= self._event_sizes.popleft()

    def _after_mutation(self, command: Command, result: Any = None) -> None:
        """Collect events, check (debug), journal, then wake listeners: a watcher never
        sees an event whose command is not yet durable."""
        self._take_events()
        if self.debug_invariants and not self.manager.has_deferred:
            self.check_invariants()  # (else once settled: checking would settle now)
        self._record(command, result)
        for callback in self._listeners:
            callback()

    def _record(self, command: Command, result: Any) -> None:
        journal = self.journal
        if journal is None:
            return
        try:
            journal.record(command, result)
        except Exception as exc:
            # The change is applied in memory but not durable: refuse everything from now
            # on (the process must restart and recover the log's state).
            self._fenced_reason = f"its durable log failed: {type(exc).__name__}: {exc}"
            raise PagekeeperError(
                f"the change could not be made durable ({self._fenced_reason}); the "
                "service refuses further changes until it restarts"
            ) from exc

    def _check_writable(self) -> None:
        if self._fenced_reason:
            raise FailedPrecondition(
                f"the service refuses changes until it restarts ({self._fenced_reason})"
            )

    @property
    def fenced_reason(self) -> str:
        """Why mutations are refused ("" while they are not)."""
        return self._fenced_reason

    # -- dispatch ----------------------------------------------------------------------
    def apply(self, command: Command) -> Any:
        """Apply any command (what a log replay calls)."""
        if isinstance(command, StepCommand):
            return self.step(command)
        if isinstance(command, RegisterCommand):
            return self.register(command)
        if isinstance(command, HeartbeatCommand):
            return self.heartbeat(command)
        if isinstance(command, UnregisterCommand):
            return self.unregister(command)
        if isinstance(command, ExpireLeasesCommand):
            return self.expire_leases(command)
        if isinstance(command, ResetPrefixCacheCommand):
            return self.reset_prefix_cache(command)
        if isinstance(command, ForceFreeCommand):
            return self.force_free(command)
        if isinstance(command, ResumeLeasesCommand):
            return self.resume_leases(command)
        if isinstance(command, ConfigureLimitsCommand):
            return self.configure_limits(command)
        raise InvalidArgument(f"unknown command {type(command).__name__}")

    def replay(self, command: Command, publication: tuple[bool, int, str] | None = None) -> Any:
        """Apply a command read back from the durable log (no journal, no sink attached).

        A replayed step does not republish; ``publication`` (``is_published``,
        ``published_slot``, ``publish_error`` as first answered) goes into the stored
        answer, so a retry after a restart gets exactly the answer the first call got."""
        if self.journal is not None:
            raise FailedPrecondition("replay needs the journal detached")
        result = self.apply(command)
        if isinstance(command, StepCommand) and publication is not None:
            client = self._clients[command.client_id]
            published, slot, error = publication
            # Counted as when it was first applied (the replay has no sink to publish to).
            if published:
                self.counters.num_published += 1
            elif error:
                self.counters.num_publish_errors += 1
            stored = replace(
                result, is_published=published, published_slot=slot, publish_error=error
            )
            client.last_step_result = stored
            result = stored
        return result

    # -- clients -----------------------------------------------------------------------
    def _client(self, client_id: str, generation: int, now: float) -> ClientRecord:
        client = self._registered(client_id, generation)
        self._check_lease(client, now)
        return client

    def _check_lease(self, client: ClientRecord, now: float) -> None:
        if now > client.expires_at:
            raise FailedPrecondition(
                f"client {client.client_id!r}: lease expired {now - client.expires_at:.3f}s "
                "ago; register again with this client_id to resume"
            )

    def _registered(self, client_id: str, generation: int) -> ClientRecord:
        client = self._clients.get(client_id)
        if client is None:
            raise NotFound(f"client {client_id!r} is not registered (register first)")
        if generation != client.generation:
            why = (
                "a newer registration took the id over"
                if generation < client.generation
                else "that generation was never issued here: was the service's state reset?"
            )
            raise Superseded(
                f"client {client_id!r}: generation {generation} is not the current "
                f"registration {client.generation} ({why}); this registration is fenced off"
            )
        return client

    def _kernel_block_sizes(self, support: Sequence[GroupKernelSupport]) -> tuple[int, ...]:
        """The chosen kernel block size per group for one worker (raises before change)."""
        groups = self.pool_config.groups
        by_group: dict[int, GroupKernelSupport] = {}
        for entry in support:
            if not 0 <= entry.group_id < len(groups):
                raise InvalidArgument(
                    f"kernel_support names group {entry.group_id}; the pool has "
                    f"{len(groups)} group(s)"
                )
            if entry.group_id in by_group:
                raise InvalidArgument(f"kernel_support lists group {entry.group_id} twice")
            by_group[entry.group_id] = entry
        sizes = []
        for group_id, group in enumerate(groups):
            chosen = by_group.get(group_id)
            backends = [b.specs() for b in chosen.backends] if chosen else []
            try:
                size = choose_kernel_block_size(
                    group.page_size, backends, is_mamba=group.kind is GroupKind.MAMBA
                )
            except PagekeeperError as exc:
                raise type(exc)(f"group {group_id}: {exc.message}") from None
            sizes.append(size)
        return tuple(sizes)

    def _published_tables(
        self, kernel_sets: Iterable[tuple[int, ...]]
    ) -> tuple[tuple[int, int], ...]:
        return tuple(sorted({(g, k) for sizes in kernel_sets for g, k in enumerate(sizes)}))

    def _reconfigure_sink(self, kernel_sets: dict[tuple[int, ...], int]) -> RingDescriptor | None:
        """Point the sink at the tables ``kernel_sets`` needs; called *before* the registry
        changes, so a failure (e.g. no memory for the ring) leaves everything as it was."""
        if self.sink is None:
            return None
        wanted = self._published_tables(kernel_sets)
        if wanted == self._published_tables(self._kernel_sets):
            return self.sink.descriptor()
        return self.sink.configure(wanted)

    def register(self, cmd: RegisterCommand) -> RegisterResult:
        self._check_writable()
        if not isinstance(cmd.role, ClientRole):
            raise InvalidArgument("role must be SCHEDULER or WORKER")
        lease = cmd.lease_ttl_s
        if not lease >= 0:  # also catches NaN
            raise InvalidArgument(f"lease_ttl_ms must be >= 0, got {lease}")
        lease = self.limits.lease_ttl_s if lease == 0 else min(lease, self.limits.max_lease_ttl_s)
        if cmd.role is ClientRole.WORKER:
            sizes = self._kernel_block_sizes(cmd.kernel_support)
        else:
            if cmd.kernel_support:
                raise InvalidArgument("only workers send kernel_support")
            if cmd.fresh_kv_cache:
                raise InvalidArgument("only workers send fresh_kv_cache")
            sizes = ()
        existing = self._clients.get(cmd.client_id) if cmd.client_id else None
        if cmd.client_id:
            _check_id(cmd.client_id, "client_id")
            if existing is None:
                raise NotFound(
                    f"client {cmd.client_id!r} is not registered (leave client_id empty to "
                    "get a new one)"
                )
            if existing.role is not cmd.role:
                raise FailedPrecondition(
                    f"client {cmd.client_id!r} registered as {existing.role.value}, not "
                    f"{cmd.role.value}"
                )
            if existing.identity and cmd.identity and cmd.identity != existing.identity:
                raise PermissionDenied(
                    f"client {cmd.client_id!r} is bound to certificate {existing.identity!r}, "
                    f"not {cmd.identity!r}"
                )
        elif len(self._clients) >= self.limits.max_clients:
            raise ResourceExhausted(f"max_clients {self.limits.max_clients} already registered")

        kernel_sets = dict(self._kernel_sets)
        if existing is not None and existing.kernel_block_sizes:
            _release(kernel_sets, existing.kernel_block_sizes)
        if sizes:
            kernel_sets[sizes] = kernel_sets.get(sizes, 0) + 1
        ring = self._reconfigure_sink(kernel_sets)

        # -- no failure past this point --
        self._kernel_sets = kernel_sets
        if existing is not None:
            client = existing
            client.generation += 1
            client.name = cmd.name or client.name
            client.device = cmd.device
        else:
            client_id = f"{cmd.role.value}-{self._next_client_number}"
            self._next_client_number += 1
            client = ClientRecord(
                client_id=client_id,
                role=cmd.role,
                name=cmd.name,
                device=cmd.device,
                generation=1,
                lease_ttl_s=lease,
                registered_at=cmd.now,
                expires_at=cmd.now + lease,
            )
            self._clients[client_id] = client
        client.lease_ttl_s = lease
        client.expires_at = cmd.now + lease
        client.kernel_support = cmd.kernel_support
        client.kernel_block_sizes = sizes
        if cmd.identity:
            client.identity = cmd.identity
        self.counters.num_registrations += 1
        if cmd.fresh_kv_cache:
            self._forget_prefix_cache(client)
        self._after_mutation(cmd)
        return RegisterResult(
            client_id=client.client_id,
            generation=client.generation,
            lease_ttl_s=lease,
            kernel_block_sizes=sizes,
            ring=ring if cmd.role is ClientRole.WORKER else None,
            last_step_id=client.last_step_id,
            last_published_step_seq=self._last_published_step_seq,
            request_ids=tuple(sorted(client.request_ids)),
        )

    def _forget_prefix_cache(self, worker: ClientRecord) -> None:
        """A worker whose KV cache holds nothing registered: neither the cached pages' KV
        nor the running requests' is in it. The running requests are freed and revoked
        (their schedulers learn it as from a force-free, and compute them again): left
        running they would go on filling pages over KV the worker lacks, and cache them
        for later prompts to hit. Then every hash is forgotten."""
        running = [(request_id, record.owner) for request_id, record in self._requests.items()]
        for request_id, owner_id in running:
            self._free_under_owner(request_id, owner_id)
        revoked = len(running)
        forgotten = self.manager.forget_prefix_cache()
        self.counters.num_prefix_cache_forgets += 1
        self.counters.num_kv_loss_revocations += revoked
        log.warning(
            "worker %s (%s) registered with an empty KV cache: the prefix cache forgot %d "
            "page(s)%s",
            worker.client_id,
            worker.name or "unnamed",
            forgotten,
            (
                f"; {revoked} running request(s), whose KV it lacks, were freed and revoked "
                "(their schedulers must compute them again)"
                if revoked
                else ""
            ),
        )

    def heartbeat(self, cmd: HeartbeatCommand) -> HeartbeatResult:
        self._check_writable()
        client = self._client(cmd.client_id, cmd.generation, cmd.now)
        client.expires_at = cmd.now + client.lease_ttl_s
        # A lease renewal is a mutation (it decides when the client expires).
        self._record(cmd, None)
        ring = None
        if client.role is ClientRole.WORKER and self.sink is not None:
            ring = self.sink.descriptor()
        return HeartbeatResult(client.lease_ttl_s, ring, self.last_event_seq)

    def _remove_client(self, client: ClientRecord) -> int:
        """Free the client's requests and drop it; returns how many requests were freed."""
        kernel_sets = dict(self._kernel_sets)
        if client.kernel_block_sizes:
            _release(kernel_sets, client.kernel_block_sizes)
            # Releasing a ring cannot be refused; a failure here is a bug worth surfacing.
            self._reconfigure_sink(kernel_sets)
        self._kernel_sets = kernel_sets
        freed = 0
        # Sorted: the free order decides the free queue, so it must not depend on set order.
        for request_id in sorted(client.request_ids):
            self.manager.free(request_id)
            freed += 1
        del self._clients[client.client_id]
        return freed

    def unregister(self, cmd: UnregisterCommand) -> int:
        self._check_writable()
        client = self._client(cmd.client_id, cmd.generation, cmd.now)
        freed = self._remove_client(client)
        self._after_mutation(cmd)
        return freed

    def expire_leases(self, cmd: ExpireLeasesCommand) -> ExpireResult:
        """Drop every client whose lease ran out (schedulers after ``lease_grace_s``)."""
        self._check_writable()
        expired = []
        for client in list(self._clients.values()):
            grace = self.limits.lease_grace_s if client.role is ClientRole.SCHEDULER else 0.0
            if cmd.now > client.expires_at + grace:
                expired.append(client)
        if not expired:
            return ExpireResult((), 0)
        freed = sum(self._remove_client(c) for c in expired)
        self.counters.num_expired_clients += len(expired)
        self._after_mutation(cmd)
        return ExpireResult(tuple(c.client_id for c in expired), freed)

    # -- steps -------------------------------------------------------------------------
    def step(self, cmd: StepCommand) -> StepResult:
        started = time.perf_counter()
        client = self._registered(cmd.client_id, cmd.generation)
        if client.role is not ClientRole.SCHEDULER:
            raise PermissionDenied(f"client {client.client_id!r} is a worker; only schedulers step")
        if not isinstance(cmd.step_id, int) or not 1 <= cmd.step_id <= MAX_STEP_ID:
            # The wire's uint64 goes further; the journal, snapshots and ring slots hold
            # signed 64-bit words.
            raise InvalidArgument(f"step_id must be in [1, 2**63 - 1], got {cmd.step_id!r}")
        if cmd.step_id <= client.last_step_id:
            # A retry is answered before the lease and the log are checked: a refusal
            # there would not tell the client whether its first send was applied.
            stored = client.last_step_result
            if cmd.step_id == client.last_step_id and stored is not None:
                if self._fenced_reason:
                    # Its record may be the one that failed to be written: not vouched
                    # for. The client keeps the step and sends it to the restarted service.
                    raise Unavailable(
                        f"the service refuses changes ({self._fenced_reason}) and cannot "
                        f"confirm step {cmd.step_id}; send it again once it has restarted"
                    )
                self.counters.num_step_retries += 1
                if cmd.now <= client.expires_at:
                    client.expires_at = cmd.now + client.lease_ttl_s
                    # Its one effect is the lease renewal: logged as the heartbeat it is.
                    # (An expired lease is not renewed: registering again is the way back.)
                    self._record(HeartbeatCommand(cmd.now, cmd.client_id, cmd.generation), None)
                return _as_retry(stored)
            raise FailedPrecondition(
                f"step_id {cmd.step_id} is older than client {client.client_id!r}'s last "
                f"step {client.last_step_id}"
            )
        self._check_writable()
        self._check_lease(client, cmd.now)
        self.settle()  # the last steps' deferred caching, before anything of this one
        frees = cmd.frees
        revoked: set[str] = set()
        revoked_frees: tuple[str, ...] = ()
        revoked_growths: tuple[Growth, ...] = ()
        try:
            if cmd.growth_columns is not None and cmd.growths:
                raise InvalidArgument("a step carries growths or growth_columns, not both")
            growths, columns = cmd.growths, cmd.growth_columns
            if columns is not None and len(columns) < MIN_COLUMN_GROWTHS:
                # A handful of growths: the per-growth path costs less than the arrays.
                growths, columns = columns.checked_growths(self.page_hash_size), None
            if client.revoked:
                revoked = _named_revoked(client.revoked, cmd, growths, columns)
                if revoked:
                    if columns is not None:
                        growths, columns = columns.checked_growths(self.page_hash_size), None
                    revoked_frees = tuple(r for r in frees if r in revoked)
                    frees = tuple(r for r in frees if r not in revoked)
                    revoked_growths = tuple(g for g in growths if g.request_id in revoked)
                    growths = tuple(g for g in growths if g.request_id not in revoked)
            will_publish = self._validate_step(
                client, cmd, frees, growths, columns, revoked, revoked_frees, revoked_growths
            )
        except PagekeeperError:
            self.counters.num_steps_rejected += 1
            self._column_rows = self._column_hashes = self._column_tracked = None
            self._column_plan = None
            raise

        # -- mutations: nothing below raises a PagekeeperError for this step as a whole --
        manager = self.manager
        for request_id in frees:
            manager.free(request_id)
            client.request_ids.discard(request_id)
        outcomes: list[AllocationOutcome] = []
        left_out: set[str] = set()
        if revoked:
            # Requests an admin freed: a free is done already; a growth cannot have pages.
            for growth in revoked_growths:
                outcomes.append(
                    AllocationOutcome(
                        growth.request_id,
                        AllocationStatus.NO_CAPACITY,
                        reason=_REVOKED_REASON.format(growth.request_id),
                    )
                )
            left_out |= revoked
            client.revoked.difference_update(revoked_frees)
        for growth in growths:
            outcome = self._apply_growth(growth)
            if outcome is None:
                continue  # OK with no new page: the common decode, not listed
            if outcome.status is not AllocationStatus.OK:
                left_out.add(growth.request_id)
            outcomes.append(outcome)
        grants: GrowthGrants | None = None
        if columns is not None:
            granted: tuple[list[int], list[int]] = ([], [])
            self._apply_growth_columns(
                columns, outcomes, left_out, granted, self._column_rows, self._column_hashes
            )
            if granted[0]:
                grants = GrowthGrants(columns.request_ids, *granted, len(outcomes))
        self._column_rows = self._column_hashes = self._column_tracked = None
        self._column_plan = None
        for admission in cmd.admissions:
            client.revoked.discard(admission.request_id)
            outcome = self._apply_admission(client, admission)
            if outcome.status is not AllocationStatus.OK:
                left_out.add(admission.request_id)
            else:
                left_out.discard(admission.request_id)
            outcomes.append(outcome)

        is_published, slot, publish_error = False, -1, ""
        unscheduled: tuple[str, ...] = ()
        if cmd.batch is not None:
            if left_out:  # (most steps leave no request out: no pass over the batch)
                unscheduled = tuple(r for r in cmd.batch.request_ids if r in left_out)
            if will_publish and self.sink is not None:
                is_published, slot, publish_error = self._publish(cmd.step_id, cmd.batch, left_out)
        if will_publish:
            # Decided by the state, not by the sink's outcome, so a replay (no sink) keeps
            # the same ordering constraint on later steps.
            self._last_published_step_seq = cmd.step_id

        still_revoked = tuple(sorted(client.revoked)) if client.revoked else ()
        # What a reader without revocations would refuse: a revoked request freed, grown,
        # or batched without being admitted again in this step.
        names_revoked = bool(
            revoked_growths
            or revoked_frees
            or (revoked and revoked.difference(a.request_id for a in cmd.admissions))
        )
        client.last_step_id = cmd.step_id
        client.expires_at = cmd.now + client.lease_ttl_s
        client.num_steps += 1
        self.counters.num_steps += 1
        self._take_events()
        deferred = manager.has_deferred
        result = StepResult(
            step_id=cmd.step_id,
            listed=tuple(outcomes),
            grants=grants,
            is_published=is_published,
            published_slot=slot,
            unscheduled_request_ids=unscheduled,
            num_free_pages=manager.pool.num_free_pages,
            # Deferred events have their seqs already: the pool's count is the last one.
            last_event_seq=manager.pool.last_event_seq if deferred else self._last_event_seq,
            publish_error=publish_error,
            revoked_request_ids=still_revoked,
            names_revoked=names_revoked,
        )
        client.last_step_result = result
        self._after_mutation(cmd, result)
        self.counters.step_seconds.append(time.perf_counter() - started)
        if deferred and self._schedule_settle is not None:
            self._schedule_settle()
        return result

    def _validate_step(
        self,
        client: ClientRecord,
        cmd: StepCommand,
        frees: tuple[str, ...],
        growths: tuple[Growth, ...],
        columns: GrowthColumns | None,
        revoked: set[str],
        revoked_frees: tuple[str, ...],
        revoked_growths: tuple[Growth, ...],
    ) -> bool:
        """Check the whole step against the state as it will be when each part applies;
        raise on the first problem. Returns whether the batch will be published.
        ``revoked``: the client's requests an admin freed that the step names; ``frees``
        and ``growths`` leave out theirs (``revoked_frees``, ``revoked_growths``), which
        follow a running request's rules: each named at most once, not both freed and
        grown, grown then not admitted, freed then not in the batch (unless admitted); in
        the batch they are left out."""
        limits = self.limits
        max_len = self.pool_config.max_model_len
        num_growths = len(growths) if columns is None else len(columns)
        num_items = (
            len(frees)
            + num_growths
            + len(cmd.admissions)
            + len(revoked_frees)
            + len(revoked_growths)
        )
        revoked_freed: AbstractSet[str] = _NO_IDS
        revoked_grown: AbstractSet[str] = _NO_IDS
        if revoked:
            revoked_freed = set(revoked_frees)
            revoked_grown = {g.request_id for g in revoked_growths}
            named = [*revoked_frees, *(g.request_id for g in revoked_growths)]
            if len(set(named)) != len(named):
                raise InvalidArgument(
                    f"request {first_repeat(named)!r} is named twice (freed or grown) in one step"
                )
        if num_items > limits.max_requests_per_step:
            raise ResourceExhausted(
                f"{num_items} frees + growths + admissions exceed max_requests_per_step "
                f"{limits.max_requests_per_step}"
            )
        requests = self._requests
        owner = client.client_id
        freed: set[str] = set()
        for request_id in frees:
            self._check_owned(request_id, owner)
            if request_id in freed:
                raise InvalidArgument(f"request {request_id!r} is freed twice in one step")
            freed.add(request_id)
        grown: set[str] = set()
        for growth in growths:
            request_id = growth.request_id
            record = self._check_owned(request_id, owner)
            if request_id in freed:
                raise InvalidArgument(f"request {request_id!r} is both freed and grown")
            if request_id in grown:
                raise InvalidArgument(f"request {request_id!r} is grown twice in one step")
            grown.add(request_id)
            self._validate_growth(growth, record, max_len)
        if growths:
            _check_growth_tokens(growths)
        if columns is not None:
            grown = self._validate_growth_columns(columns, owner, freed, max_len)
        admitted: set[str] = set()
        for admission in cmd.admissions:
            request_id = _check_id(admission.request_id, "request_id")
            if request_id in admitted:
                raise InvalidArgument(f"request {request_id!r} is admitted twice in one step")
            if request_id in grown or request_id in revoked_grown:
                raise InvalidArgument(f"request {request_id!r} is both grown and admitted")
            if request_id in requests and request_id not in freed:
                raise AlreadyExists(f"request {request_id!r} already holds pages")
            admitted.add(request_id)
            self._validate_admission(admission, max_len)

        batch = cmd.batch
        if batch is None:
            return False
        if len(batch.request_ids) > limits.max_requests_per_step:
            raise ResourceExhausted(
                f"batch of {len(batch.request_ids)} requests exceeds max_requests_per_step "
                f"{limits.max_requests_per_step}"
            )
        batch_ids = batch.request_ids
        in_batch = set(batch_ids)
        if len(in_batch) != len(batch_ids):
            dup = first_repeat(batch_ids)
            raise InvalidArgument(f"request {dup!r} appears twice in the batch")
        freed_listed = (in_batch & revoked_freed) - admitted
        if freed_listed:
            raise InvalidArgument(f"request {min(freed_listed)!r} is freed and in the batch")
        # Grown and admitted requests were checked above (owned, not freed); the rest must be
        # the client's and stay (set operations; the loop only names the first problem).
        if freed or admitted or revoked:
            rest = in_batch - grown - admitted - revoked
            fine = not rest & freed and rest <= client.request_ids
        else:
            fine = in_batch <= client.request_ids  # (grown requests are the client's)
        if not fine:
            for request_id in batch_ids:
                if request_id in grown or request_id in admitted or request_id in revoked:
                    continue
                if request_id in freed:
                    raise InvalidArgument(f"request {request_id!r} is freed and in the batch")
                self._check_owned(request_id, owner)
        counts = batch.num_scheduled_tokens
        if counts is not None:
            counts = _as_int32(counts, "num_scheduled_tokens")
            if counts.shape[0] != len(batch.request_ids):
                raise InvalidArgument(
                    f"num_scheduled_tokens has {counts.shape[0]} entries for "
                    f"{len(batch.request_ids)} batch requests"
                )
            if counts.size and int(counts.min()) < 0:
                raise InvalidArgument("num_scheduled_tokens must be >= 0")
            total = int(counts.sum(dtype=np.int64))
            if total > limits.max_tokens_per_step:
                raise ResourceExhausted(
                    f"{total} scheduled tokens exceed max_tokens_per_step "
                    f"{limits.max_tokens_per_step}"
                )
        ends = batch.num_computed_tokens
        if ends is not None:
            # Checked against the pages at publication (this step's allocations come first).
            ends = _as_int32(ends, "num_computed_tokens")
            if ends.shape[0] != len(batch_ids):
                raise InvalidArgument(
                    f"num_computed_tokens has {ends.shape[0]} entries for "
                    f"{len(batch_ids)} batch requests"
                )
            bad = (ends < -1) | (ends > max_len)
            if counts is not None:
                bad |= (ends >= 0) & (ends < counts)
            if bad.any():
                i = _first_true(bad)
                low = -1 if counts is None or ends[i] < 0 else int(counts[i])
                raise InvalidArgument(
                    f"request {batch_ids[i]!r}: batch num_computed_tokens {int(ends[i])} "
                    f"outside [{low}, max_model_len {max_len}]"
                )
        will_publish = bool(self._kernel_sets)
        if will_publish and cmd.step_id <= self._last_published_step_seq:
            raise FailedPrecondition(
                f"step_id {cmd.step_id} must exceed the last published step "
                f"{self._last_published_step_seq} (workers wait on increasing step ids)"
            )
        return will_publish

    def _validate_growth_columns(
        self, cols: GrowthColumns, owner: str, freed: set[str], max_len: int
    ) -> set[str]:
        """``_validate_growth`` for a whole column form at once (same checks, same
        messages); returns the grown request ids."""
        ids = cols.request_ids
        n = len(ids)
        self._column_rows = self._column_hashes = self._column_tracked = None
        self._column_plan = None
        if cols.defaults_only and n and cols.new_token_ids.shape == (n,):
            # Plain decodes (one token each, tracked counts): the checks below reduce to
            # the rows' maxima and the tokens' minimum (computed <= tokens < max_len also
            # keeps computed + 1 within it); any doubt, and they run in full.
            rows = self.manager.running_rows(ids, owner)
            if (
                rows is not None
                and rows.max_tokens + 1 <= max_len
                and rows.max_ahead <= 0
                and non_negative_token_ids(cols.new_token_ids)  # (one C pass)
            ):
                grown = set(ids)
                if len(grown) == n and not grown & freed:
                    if cols.num_page_hashes is not None:
                        self._column_hashes = self._check_decode_hashes(cols, rows)
                    self._column_rows = rows
                    return grown
        if n == 0:
            cols.check_shape(self.page_hash_size)
            return set()
        # One pass for the common case (each row's counts gathered as it goes); any
        # unknown or foreign request: row by row (below), so the first bad row names the
        # error.
        lengths = np.empty(n, dtype=np.int64)
        tracked = np.empty(n, dtype=np.int64)
        rows = self.manager.running_rows(ids, owner, lengths, tracked)
        if (
            rows is not None
            and decode_columns is not None
            and (cols.num_page_hashes is not None or not cols.packed_page_hashes)
        ):
            # Every growth a decode, held-back tokens riding with some (what a client
            # holding back decodes sends): every check below but the page hashes' and the
            # split for the core in one C pass. Any doubt, and the checks run in full.
            plan = decode_columns(
                ids,
                cols.num_new_tokens,
                cols.num_new_token_ids,
                cols.num_computed_tokens,
                cols.num_lookahead_tokens,
                cols.new_token_ids,
                lengths,
                tracked,
                max_len,
            )
            if plan is not None:
                grown = set(ids)
                if len(grown) == n and not grown & freed:
                    if cols.num_page_hashes is not None:
                        # (The count columns passed: the shape check's only other errors
                        # are the hashes', which this checks first.)
                        self._column_hashes = self._check_decode_hashes(
                            cols, rows, cols.num_new_token_ids
                        )
                    self._column_rows = rows
                    self._column_plan = plan
                    return grown
        cols.check_shape(self.page_hash_size)
        counts = cols.num_new_token_ids
        if rows is None:
            recs = [self._check_owned(rid, owner) for rid in ids]
            lengths[:] = list(map(len, map(_TOKEN_IDS, recs)))
            tracked[:] = list(map(_NUM_COMPUTED_TOKENS, recs))
        grown = set(ids)
        if len(grown) != n:
            raise InvalidArgument(f"request {first_repeat(ids)!r} is grown twice in one step")
        both = grown & freed
        if both:
            raise InvalidArgument(f"request {min(both)!r} is both freed and grown")
        num_new = cols.num_new_tokens.astype(np.int64)
        lookahead = cols.num_lookahead_tokens.astype(np.int64)
        explicit = cols.num_computed_tokens.astype(np.int64)
        if (num_new < 1).any():
            i = _first_true(num_new < 1)
            raise InvalidArgument(f"request {ids[i]!r}: num_new_tokens must be >= 1")
        if (lookahead < 0).any():
            i = _first_true(lookahead < 0)
            raise InvalidArgument(f"request {ids[i]!r}: num_lookahead_tokens must be >= 0")
        if cols.new_token_ids.size and int(cols.new_token_ids.min()) < 0:
            owner_of = np.repeat(np.arange(n), counts)
            i = int(owner_of[_first_true(cols.new_token_ids < 0)])
            raise InvalidArgument(f"request {ids[i]!r}: token ids must be >= 0")
        num_tokens = lengths + counts
        if (num_tokens > max_len).any():
            i = _first_true(num_tokens > max_len)
            raise InvalidArgument(
                f"request {ids[i]!r}: {int(num_tokens[i])} tokens exceed max_model_len {max_len}"
            )
        bad = (explicit < -1) | (explicit > num_tokens)
        if bad.any():
            i = _first_true(bad)
            raise InvalidArgument(
                f"request {ids[i]!r}: num_computed_tokens {int(explicit[i])} outside "
                f"[0, {int(num_tokens[i])}] (-1: tracked)"
            )
        computed = np.where(explicit < 0, tracked, explicit)
        over = computed + num_new > num_tokens + lookahead
        if over.any():
            i = _first_true(over)
            raise InvalidArgument(
                f"request {ids[i]!r}: {int(computed[i])} computed + {int(num_new[i])} new "
                f"tokens exceed its {int(num_tokens[i])} tokens"
            )
        past = computed + num_new > max_len
        if past.any():
            i = _first_true(past)
            raise InvalidArgument(
                f"request {ids[i]!r}: {int(computed[i])} computed + {int(num_new[i])} new "
                f"tokens exceed max_model_len {max_len}"
            )
        self._check_column_hashes(cols)
        self._column_rows = rows
        self._column_tracked = tracked
        return grown

    def _check_column_hashes(self, cols: GrowthColumns) -> None:
        """Each growth's page hashes in columns whose shape is checked: the rules of
        ``_growth_hashes`` (count, repeats, the previous page's hash)."""
        hash_offsets = cols.hash_offsets()
        if hash_offsets is None:
            return
        size = cols.page_hash_size or self.page_hash_size  # (checked with the shape)
        counts = cols.num_new_token_ids
        for i in np.flatnonzero(np.diff(hash_offsets)).tolist():
            packed = cols.packed_page_hashes[
                int(hash_offsets[i]) * size : int(hash_offsets[i + 1]) * size
            ]
            self._growth_hashes(cols.request_ids[i], None, packed, size, int(counts[i]))

    def _apply_growth_columns(
        self,
        cols: GrowthColumns,
        outcomes: list[AllocationOutcome],
        left_out: set[str],
        granted: tuple[list[int], list[int]],
        rows: RunningRows | None = None,
        checked_hashes: dict[str, tuple[bytes, ...]] | None = None,
    ) -> None:
        """Apply the growths in order; each run of plain decodes (one new token, tracked
        computed count, the same lookahead) goes to the core in one call. Growths that took
        one page each together go to ``granted`` (positions among the columns, pages)
        instead of ``outcomes``. ``rows``: the columns' rows as their check gathered them
        (a run of every row takes them as they are), and ``checked_hashes`` the page hashes
        it checked (plain decodes)."""
        n = len(cols)
        if n == 0:
            return
        ids = cols.request_ids
        explicit = cols.num_computed_tokens
        num_ids = cols.num_new_token_ids
        lookahead = cols.num_lookahead_tokens
        plain: Sequence[bool] | npt.NDArray[np.bool_]
        # (Plain decodes' hashes come checked, by request: no offsets needed for them.)
        hash_offsets = cols.hash_offsets() if checked_hashes is None else None
        hash_size = cols.page_hash_size or self.page_hash_size
        plan = self._column_plan  # all decodes, split by their check
        if cols.defaults_only or plan is not None:
            plain, bounds = (True,), [0, n]  # one run of plain decodes
        else:
            one_new = cols.num_new_tokens == 1
            # A decode with a computed count is a plain one too when the count is the
            # tracked one plus the tokens before its own: a client's held-back decodes
            # riding with it (or a client that always sends its mirror's count).
            tracked = self._column_tracked  # the counts the check gathered (int64)
            if tracked is None or tracked.shape != (n,):
                raise InvariantViolation("growth columns applied without their check's counts")
            plain = one_new & (
                ((num_ids == 1) & (explicit == -1))
                | ((num_ids >= 1) & (explicit >= 0) & (explicit == tracked + num_ids - 1))
            )
            changes = (plain[1:] != plain[:-1]) | (lookahead[1:] != lookahead[:-1])
            bounds = [0, *(np.flatnonzero(changes) + 1).tolist(), n]
        offsets: npt.NDArray[np.int64] | None = None
        manager = self.manager
        for start, stop in pairwise(bounds):
            if plain[start]:
                run = ids[start:stop]
                held: dict[str, list[int]] = {}
                named: Mapping[str, Sequence[bytes] | PackedPageHashes] | None = None
                whole = start == 0 and stop == n
                if whole and rows is not None and checked_hashes is not None:
                    named = checked_hashes
                elif hash_offsets is not None:
                    # The client's hashes of the pages these decodes complete (checked
                    # with the step; this cannot fail).
                    named = {
                        run[k]: check_packed_page_hashes(
                            cols.packed_page_hashes[
                                int(hash_offsets[start + k]) * hash_size : int(
                                    hash_offsets[start + k + 1]
                                )
                                * hash_size
                            ],
                            hash_size,
                        )
                        for k in np.flatnonzero(np.diff(hash_offsets[start : stop + 1])).tolist()
                    }
                ahead = int(lookahead[start])
                if plan is not None:
                    tokens, held, ahead = plan
                elif cols.defaults_only:
                    tokens = cols.new_token_ids
                else:
                    offsets = cols.token_offsets() if offsets is None else offsets
                    # Each growth's own token is its last; any before it are held-back
                    # decodes'.
                    tokens = cols.new_token_ids[offsets[start + 1 : stop + 1] - 1]
                    carriers = np.flatnonzero(num_ids[start:stop] > 1).tolist()
                    if carriers:
                        # Lists of checked ints, as allocate_decodes takes them with rows.
                        all_tokens = cols.new_token_ids.tolist()
                        bounds_of = offsets[start : stop + 1].tolist()
                        held = {
                            run[k]: all_tokens[bounds_of[k] : bounds_of[k + 1] - 1]
                            for k in carriers
                        }
                crossed: tuple[list[int], list[int]] = ([], [])
                try:
                    answers = manager.allocate_decodes(
                        run,
                        tokens,
                        num_lookahead_tokens=ahead,
                        held_token_ids=held,
                        crossed=crossed,
                        page_hashes=named,
                        checked_rows=rows if whole else None,
                    )
                except PagekeeperError:
                    answers = None  # checked up front; if not, the general path says why
                if answers is not None:
                    rows, pages = crossed
                    if rows:
                        granted[0].extend(rows if start == 0 else [start + r for r in rows])
                        granted[1].extend(pages)
                    for rid, allocation in answers.items():
                        if allocation is None:
                            left_out.add(rid)
                            outcomes.append(AllocationOutcome(rid, AllocationStatus.NO_CAPACITY))
                        else:
                            outcomes.append(_outcome(allocation))
                    continue
            offsets = cols.token_offsets() if offsets is None else offsets
            if hash_offsets is None:
                hash_offsets = cols.hash_offsets()
            for i in range(start, stop):
                growth = cols.growth(i, offsets, hash_offsets, self.page_hash_size)
                outcome = self._apply_growth(growth)
                if outcome is None:
                    continue
                if outcome.status is not AllocationStatus.OK:
                    left_out.add(outcome.request_id)
                outcomes.append(outcome)

    def _check_owned(self, request_id: str, owner: str) -> RunningRequest:
        record = self._requests.get(request_id)
        if record is None:
            raise NotFound(f"request {request_id!r} holds no pages")
        if record.owner != owner:
            raise PermissionDenied(f"request {request_id!r} belongs to another client")
        return record

    def _validate_growth(self, growth: Growth, record: RunningRequest, max_len: int) -> None:
        """The core's own checks, done up front so a bad growth cannot stop a step halfway."""
        rid = growth.request_id
        new_tokens = growth.new_token_ids
        # Token values are checked for the whole step at once (_check_growth_tokens).
        if not isinstance(new_tokens, np.ndarray) or new_tokens.ndim != 1:
            raise InvalidArgument(f"request {rid!r}: new_token_ids must be a 1-D integer array")
        if growth.num_new_tokens < 1:
            raise InvalidArgument(f"request {rid!r}: num_new_tokens must be >= 1")
        if growth.num_lookahead_tokens < 0:
            raise InvalidArgument(f"request {rid!r}: num_lookahead_tokens must be >= 0")
        num_tokens = len(record.token_ids) + len(new_tokens)
        if num_tokens > max_len:
            raise InvalidArgument(
                f"request {rid!r}: {num_tokens} tokens exceed max_model_len {max_len}"
            )
        computed = growth.num_computed_tokens
        if computed is None:
            computed = record.num_computed_tokens
        elif not 0 <= computed <= num_tokens:
            raise InvalidArgument(
                f"request {rid!r}: num_computed_tokens {computed} outside [0, {num_tokens}]"
            )
        if computed + growth.num_new_tokens > num_tokens + growth.num_lookahead_tokens:
            raise InvalidArgument(
                f"request {rid!r}: {computed} computed + {growth.num_new_tokens} new tokens "
                f"exceed its {num_tokens} tokens"
            )
        if computed + growth.num_new_tokens > max_len:
            raise InvalidArgument(
                f"request {rid!r}: {computed} computed + {growth.num_new_tokens} new tokens "
                f"exceed max_model_len {max_len}"
            )
        if growth.page_hashes is not None or growth.packed_page_hashes is not None:
            growth.page_hashes = self._growth_hashes(
                rid,
                growth.page_hashes,
                growth.packed_page_hashes,
                growth.page_hash_size,
                len(new_tokens),
            )
            growth.packed_page_hashes = None

    def _check_decode_hashes(
        self, cols: GrowthColumns, rows: RunningRows, token_counts: Int32Array | None = None
    ) -> dict[str, tuple[bytes, ...]]:
        """The page hashes of decodes in column form (one token each, or ``token_counts``:
        with held-back ones), checked as :meth:`_growth_hashes` checks a growth's, by
        request: the common case (one hash for a page the row's tokens fill, not its
        previous page's) in one cheap pass; any other row through :meth:`_growth_hashes`,
        which says what is wrong."""
        size = cols.check_hash_shape(self.page_hash_size)
        counts = cols.num_page_hashes
        assert counts is not None
        hashed = np.flatnonzero(counts).tolist()
        packed = cols.packed_page_hashes
        ids = cols.request_ids
        hps = self._hash_page_size
        last_page_hash = self.manager.last_page_hash
        single = len(hashed) * size == len(packed)  # one hash a row
        named: dict[str, tuple[bytes, ...]] = {}
        at = 0
        for k, i in enumerate(hashed):
            rid = ids[i]
            num_tokens = len(rows.requests[i].token_ids)
            count = 1 if token_counts is None else int(token_counts[i])
            if single:
                h = packed[k * size : (k + 1) * size]
                if (num_tokens + count) // hps > num_tokens // hps and h != last_page_hash(rid):
                    named[rid] = (h,)
                    continue
                self._growth_hashes(rid, None, h, size, count)  # raises
                raise InvariantViolation(f"request {rid!r}: a page hash passed both checks")
            num = int(counts[i])
            checked = self._growth_hashes(rid, None, packed[at : at + num * size], size, count)
            assert checked is not None
            named[rid] = tuple(checked)
            at += num * size
        return named

    def _growth_hashes(
        self,
        rid: str,
        page_hashes: Sequence[bytes] | None,
        packed: bytes | None,
        size: int,
        num_new_token_ids: int,
    ) -> CheckedPageHashes | PackedPageHashes | None:
        """A growth's page hashes, checked: well formed (``packed``: ``size`` bytes each,
        0: the pool's size), and as the core checks them before the growth (at most one
        per page its ``num_new_token_ids`` tokens complete, none the request's last page
        hash); InvalidArgument naming the request otherwise."""
        try:
            if packed is not None:
                hashes: CheckedPageHashes | PackedPageHashes | None = self._packed_hashes(
                    packed,
                    page_hashes,
                    packed_hash_size(size, self.page_hash_size, "page_hash_size"),
                )
            else:
                hashes = None if page_hashes is None else check_page_hashes(page_hashes)
        except InvalidArgument as exc:
            raise InvalidArgument(f"request {rid!r}: {exc.message}") from None
        if hashes is not None:
            self.manager.check_growth_hashes(rid, hashes, num_new_token_ids)
        return hashes

    def _validate_admission(self, admission: Admission, max_len: int) -> None:
        rid = admission.request_id
        tokens = _as_int32(admission.token_ids, f"request {rid!r}: token_ids")
        if tokens.size == 0:
            raise InvalidArgument(f"request {rid!r}: token_ids must not be empty")
        if tokens.shape[0] > max_len:
            raise InvalidArgument(
                f"request {rid!r}: {tokens.shape[0]} tokens exceed max_model_len {max_len}"
            )
        try:
            # Checked and widened in one pass: the manager keeps the result as it is.
            admission.checked_token_ids = check_token_ids(tokens)
        except InvalidArgument:
            raise InvalidArgument(f"request {rid!r}: token ids must be >= 0") from None
        if not 0 <= admission.num_new_tokens <= tokens.shape[0]:
            raise InvalidArgument(
                f"request {rid!r}: num_new_tokens {admission.num_new_tokens} outside "
                f"[0, {tokens.shape[0]}]"
            )
        if admission.num_lookahead_tokens < 0:
            raise InvalidArgument(f"request {rid!r}: num_lookahead_tokens must be >= 0")
        hashes = admission.page_hashes
        packed = admission.packed_page_hashes
        if packed is not None:
            try:
                hashes = self._packed_hashes(packed, hashes)
            except InvalidArgument as exc:
                raise InvalidArgument(f"request {rid!r}: {exc.message}") from None
            admission.page_hashes, admission.packed_page_hashes = hashes, None
        if hashes is not None:
            num_full = tokens.shape[0] // self._hash_page_size
            if len(hashes) > num_full:
                raise InvalidArgument(
                    f"request {rid!r}: {len(hashes)} page hashes for {tokens.shape[0]} tokens "
                    f"(at most {num_full})"
                )
            try:
                # Checked once: the manager takes the checked tuple as it is.
                if type(hashes) is not PackedPageHashes:
                    admission.page_hashes = check_page_hashes(hashes)
            except InvalidArgument as exc:
                raise InvalidArgument(f"request {rid!r}: {exc.message}") from None
        _validate_extra_keys(admission.extra_keys, rid, tokens.shape[0])

    def _packed_hashes(self, packed: bytes, page_hashes: object, size: int = 0) -> PackedPageHashes:
        """A request's packed client hashes, ``size`` bytes each (0: the pool's), checked
        (``page_hashes``: the same request's hashes a field each, which must be absent), or
        InvalidArgument naming the size."""
        if page_hashes is not None:
            raise InvalidArgument("page_hashes and packed_page_hashes both set (send one)")
        try:
            return check_packed_page_hashes(packed, size or self.page_hash_size)
        except InvalidArgument as exc:
            if size and size != self.page_hash_size:
                raise InvalidArgument(f"{exc.message} (page_hash_size {size})") from None
            raise InvalidArgument(
                f"{exc.message} ({self.pool_config.hash_algorithm} page hashes are "
                f"{self.page_hash_size} bytes)"
            ) from None

    def _apply_growth(self, growth: Growth) -> AllocationOutcome | None:
        """The growth's outcome; None when it succeeded without a new page (most decodes:
        answering nothing keeps a 256-decode step's reply small)."""
        rid = growth.request_id
        try:
            hashes = growth.page_hashes
            if growth.packed_page_hashes is not None:
                # A column form's row (checked with the step; this cannot fail).
                hashes = check_packed_page_hashes(
                    growth.packed_page_hashes, growth.page_hash_size or self.page_hash_size
                )
            allocation = self.manager.allocate(
                rid,
                growth.num_new_tokens,
                # Already checked for the whole step: plain ints take the core's fast path.
                new_token_ids=growth.new_token_ids.tolist(),
                num_computed_tokens=growth.num_computed_tokens,
                num_lookahead_tokens=growth.num_lookahead_tokens,
                new_page_hashes=hashes,
            )
        except PagekeeperError as exc:
            return AllocationOutcome(rid, AllocationStatus.REJECTED, reason=exc.message)
        if allocation is None:
            return AllocationOutcome(rid, AllocationStatus.NO_CAPACITY)
        if not any(allocation.new_page_ids):
            return None
        return _outcome(allocation)

    def _apply_admission(self, client: ClientRecord, admission: Admission) -> AllocationOutcome:
        rid = admission.request_id
        num_new = admission.num_new_tokens or None
        try:
            checked = admission.checked_token_ids
            admission.checked_token_ids = None  # the manager keeps it: used once
            allocation = self.manager.admit(
                rid,
                admission.token_ids if checked is None else checked,
                num_new_tokens=num_new,
                extra_keys=admission.extra_keys,
                page_hashes=admission.page_hashes,
                num_lookahead_tokens=admission.num_lookahead_tokens,
                enable_cache_read=admission.enable_cache_read,
                owner=client.client_id,
            )
        except PagekeeperError as exc:
            return AllocationOutcome(rid, AllocationStatus.REJECTED, reason=exc.message)
        if allocation is None:
            return AllocationOutcome(rid, AllocationStatus.NO_CAPACITY)
        client.request_ids.add(rid)
        return _outcome(allocation)

    def _publish(self, step_id: int, batch: Batch, left_out: set[str]) -> tuple[bool, int, str]:
        """Build one table per group and per distinct kernel block size, then publish."""
        assert self.sink is not None
        ends = batch.num_computed_tokens
        if left_out:
            keep = [i for i, r in enumerate(batch.request_ids) if r not in left_out]
            request_ids: Sequence[str] = [batch.request_ids[i] for i in keep]
            counts = (
                None if batch.num_scheduled_tokens is None else batch.num_scheduled_tokens[keep]
            )
            ends = None if ends is None else ends[keep]
        else:
            request_ids, counts = batch.request_ids, batch.num_scheduled_tokens
        tables: list[BatchTables] = []
        seen: set[tuple[int, int]] = set()
        try:
            for sizes in sorted(self._kernel_sets):
                built = self.manager.build_batch(
                    request_ids,
                    sizes,
                    num_scheduled_tokens=None if counts is None else counts.tolist(),
                    num_computed_tokens=None if ends is None else ends.tolist(),
                )
                for table in built:
                    key = (table.group_id, table.kernel_block_size)
                    if key not in seen:
                        seen.add(key)
                        tables.append(table)
            # Counted here when the batch did not say its scheduled tokens (a Mamba group's
            # table maps no slots: the attention groups' do).
            num_tokens = max((len(t.slot_mapping) for t in tables), default=0)
            if num_tokens > self.limits.max_tokens_per_step:
                raise ResourceExhausted(
                    f"{num_tokens} scheduled tokens exceed max_tokens_per_step "
                    f"{self.limits.max_tokens_per_step}"
                )
            slot = self.sink.publish(step_id, tables)
        except PagekeeperError as exc:
            # The allocations stand (they were answered); only the publication failed.
            self.counters.num_publish_errors += 1
            return False, -1, exc.message
        except Exception as exc:
            # Not expected (a bug, or a transport's own failure): the step's changes are
            # made and must be answered and journaled whole, so it is reported, not raised.
            log.exception("publishing step %d failed", step_id)
            self.counters.num_publish_errors += 1
            return False, -1, f"internal error while publishing: {type(exc).__name__}: {exc}"
        self.counters.num_published += 1
        return True, slot, ""

    # -- admin -------------------------------------------------------------------------
    def reset_prefix_cache(self, cmd: ResetPrefixCacheCommand) -> int:
        """Drop the prefix cache; returns how many cached pages were dropped."""
        self._check_writable()
        self.settle()
        before = self.manager.pool.num_cached_pages
        if not self.manager.reset_prefix_cache():
            num = len(self._requests)
            raise FailedPrecondition(
                f"{num} running request(s) hold pages; the prefix cache can only be reset "
                "when none do"
            )
        self._after_mutation(cmd)
        return before

    def force_free(self, cmd: ForceFreeCommand) -> bool:
        """Free a request whoever owns it; returns whether its owner (a scheduler) now has
        a revocation to acknowledge (see :attr:`ClientRecord.revoked`)."""
        self._check_writable()
        record = self._requests.get(cmd.request_id)
        if record is None:
            raise NotFound(f"request {cmd.request_id!r} holds no pages")
        revoked = self._free_under_owner(cmd.request_id, record.owner)
        self.counters.num_force_frees += 1
        self._after_mutation(cmd, revoked)
        return revoked

    def _free_under_owner(self, request_id: str, owner_id: str) -> bool:
        """Free a running request without its owner's step; returns whether the owner (a
        scheduler) now has a revocation to acknowledge (see :attr:`ClientRecord.revoked`)."""
        self.manager.free(request_id)
        owner = self._clients.get(owner_id)
        revoked = owner is not None and owner.role is ClientRole.SCHEDULER
        if owner is not None:
            owner.request_ids.discard(request_id)
            if revoked:
                owner.revoked.add(request_id)
        return revoked

    # -- recovery ----------------------------------------------------------------------
    def resume_command(self, now: float) -> ResumeLeasesCommand:
        """The resume after a restart or a stall at ``now``: ``exact`` when some lease runs
        past one full lease from ``now`` (the wall clock went back meanwhile), else
        ``extend`` (which then gives the same leases, and which every version reads)."""
        past = any(c.expires_at > now + c.lease_ttl_s for c in self._clients.values())
        return ResumeLeasesCommand(now, "exact" if past else "extend")

    def resume_leases(self, cmd: ResumeLeasesCommand) -> int:
        """Set every client's lease against one full lease from ``cmd.now`` (see
        :class:`ResumeLeasesCommand`); returns how many clients there are (nothing is
        logged when there are none)."""
        self._check_writable()
        if cmd.mode not in RESUME_MODES:
            raise InvalidArgument(f"resume mode must be one of {RESUME_MODES}, got {cmd.mode!r}")
        if not math.isfinite(cmd.by):
            raise InvalidArgument(f"a lease shift must be finite, got {cmd.by}")
        if not self._clients:
            return 0
        for client in self._clients.values():
            full = cmd.now + client.lease_ttl_s
            if cmd.mode == "shift":
                client.expires_at += cmd.by
            elif cmd.mode == "exact":
                client.expires_at = full
            elif cmd.mode == "cap":
                client.expires_at = min(client.expires_at, full)
            else:
                client.expires_at = max(client.expires_at, full)
        self._after_mutation(cmd)
        return len(self._clients)

    def configure_limits(self, cmd: ConfigureLimitsCommand) -> None:
        """Switch to new limits (later commands apply under them)."""
        self._check_writable()
        if not isinstance(cmd.limits, Limits):
            raise InvalidArgument("limits must be a Limits")
        self.limits = cmd.limits
        self._trim_events()
        self._after_mutation(cmd)

    def attach_sink(self, sink: TableSink | None) -> RingDescriptor | None:
        """Publish into ``sink`` from now on, configured for the workers registered now
        (after a recovery, which replays without a sink)."""
        self.sink = sink
        if sink is None:
            return None
        wanted = self._published_tables(self._kernel_sets)
        return sink.configure(wanted) if wanted else None

    def snapshot_state(self) -> dict[str, Any]:
        """The whole state as a tree of plain values and numpy arrays: the core's tree plus
        clients, leases, generations, ownership, each client's stored step answer, the
        event buffer and the counters. :meth:`restore_state` gives it back exactly."""
        return self.capture_snapshot()()

    def capture_snapshot(
        self, pause: Callable[[], None] | None = None
    ) -> Callable[[], dict[str, Any]]:
        """:meth:`snapshot_state` in two parts: this call copies what later mutations would
        change (between mutations, on the loop); the function it returns builds the tree
        from that copy, and may run anywhere, while the state goes on (a worker thread).
        The event buffer's events are immutable: the copy is of the buffer, and turning
        them into columns, most of the work, is left to the function, as is the pool's
        per-page work (:func:`~pagekeeper.core.snapshot.capture_manager`); it calls
        ``pause()`` between chunks of both."""
        from pagekeeper.core.snapshot import capture_manager, events_to_tree

        self.settle()
        build_manager = capture_manager(self.manager, pause)
        tree = self._snapshot_without_events()
        events = list(self._events)

        def build() -> dict[str, Any]:
            tree["manager"] = build_manager()
            tree["events"] = events_to_tree(events, pause)
            return tree

        return build

    def _snapshot_without_events(self) -> dict[str, Any]:
        return {
            "version": STATE_SNAPSHOT_VERSION,
            "pool_config": self.pool_config.to_dict(),
            "limits": limits_to_tree(self.limits),
            "manager": None,  # filled by capture_snapshot's function
            "clients": [_client_to_tree(c) for c in self._clients.values()],
            "next_client_number": self._next_client_number,
            "last_published_step_seq": self._last_published_step_seq,
            "kernel_sets": [[list(k), n] for k, n in self._kernel_sets.items()],
            "events": None,  # filled by capture_snapshot's function
            "last_event_seq": self._last_event_seq,
            "counters": {name: getattr(self.counters, name) for name in _COUNTER_FIELDS},
        }

    def restore_state(self, tree: dict[str, Any]) -> None:
        """Become exactly the state ``tree`` records (on a state fresh from the constructor,
        with no journal). Raises :class:`InvalidArgument` when the tree does not fit this
        pool's configuration or is malformed."""
        from pagekeeper.core.snapshot import events_from_tree

        if self.journal is not None or self._clients or self._requests:
            raise FailedPrecondition("restore_state needs a fresh state without a journal")
        version = tree.get("version") if isinstance(tree, dict) else None
        if version not in (1, STATE_SNAPSHOT_VERSION):
            raise InvalidArgument(
                f"state snapshot version {version!r} is not the supported {STATE_SNAPSHOT_VERSION}"
            )
        if tree["pool_config"] != self.pool_config.to_dict():
            raise InvalidArgument(
                "the durable state belongs to a pool with another configuration: "
                f"{tree['pool_config']} (configured: {self.pool_config.to_dict()})"
            )
        try:
            manager = PageManager.restore_state(self.pool_config, tree["manager"])
            limits = limits_from_tree(tree["limits"])
            clients = [_client_from_tree(t) for t in tree["clients"]]
            if version == 1:
                _check_v1_requests(tree["requests"], manager)
            kernel_sets = {tuple(int(k) for k in sizes): int(n) for sizes, n in tree["kernel_sets"]}
            events = events_from_tree(tree["events"])
            counters = {
                name: int(
                    tree["counters"].get(name, 0)
                    if name in _COUNTERS_ADDED_LATER
                    else tree["counters"][name]
                )
                for name in _COUNTER_FIELDS
                if name not in _PROCESS_COUNTERS
            }
            next_number = int(tree["next_client_number"])
            last_published = int(tree["last_published_step_seq"])
            last_event_seq = int(tree["last_event_seq"])
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            raise InvalidArgument(
                f"state snapshot is malformed: {type(exc).__name__}: {exc}"
            ) from None
        manager.defer_caching = self.manager.defer_caching
        self.manager = manager
        self.limits = limits
        self._clients = {c.client_id: c for c in clients}
        self._requests = manager.requests
        self._kernel_sets = kernel_sets
        self._events = deque(events)
        self._event_sizes = deque(map(event_nbytes, events))
        self._events_nbytes = sum(self._event_sizes)
        self._trim_events()  # a snapshot from before the byte limit may hold more
        self._last_event_seq = last_event_seq
        self._next_client_number = next_number
        self._last_published_step_seq = last_published
        for name, value in counters.items():
            setattr(self.counters, name, value)

    # -- reads -------------------------------------------------------------------------
    @property
    def last_event_seq(self) -> int:
        self.settle()
        return self._last_event_seq

    def event_buffer(self) -> tuple[int, int, int]:
        """``(events, bytes, first seq)`` of the KV-event buffer kept for resumption (the
        first seq is the next event's when the buffer is empty): a watcher behind the first
        seq has fallen behind."""
        self.settle()
        return len(self._events), self._events_nbytes, self._first_event_seq()

    def _first_event_seq(self) -> int:
        """The oldest event kept, or the next one's seq when none is."""
        return self._events[0].seq if self._events else self._last_event_seq + 1

    @property
    def last_published_step_seq(self) -> int:
        return self._last_published_step_seq

    @property
    def num_workers(self) -> int:
        return sum(self._kernel_sets.values())

    def stats(self) -> PoolStats:
        self.settle()
        return self.manager.stats()

    def clients(self) -> list[ClientRecord]:
        return list(self._clients.values())

    def client(self, client_id: str) -> ClientRecord:
        record = self._clients.get(client_id)
        if record is None:
            raise NotFound(f"client {client_id!r} is not registered")
        return record

    def identity_of(self, client_id: str) -> str:
        """The certificate subject ``client_id`` is bound to ("": none, or not registered)."""
        record = self._clients.get(client_id)
        return "" if record is None else record.identity

    def check_client(self, client_id: str, generation: int, now: float) -> ClientRecord:
        """A registered client with this generation and a live lease (for streams)."""
        return self._client(client_id, generation, now)

    def request_ids(self) -> list[str]:
        """Running requests, in admission order."""
        return list(self._requests)

    def request_info(self, request_id: str) -> RequestInfo:
        self.settle()
        return self.manager.request_info(request_id)

    def lookup(
        self,
        token_ids: Int32Array,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | None = None,
        packed_page_hashes: bytes | None = None,
    ) -> LookupResult:
        """Longest cached prefix (no side effects); ``packed_page_hashes``: the client's
        hashes packed end to end, as an admission's."""
        tokens = _as_int32(token_ids, "token_ids")
        if tokens.shape[0] > self.pool_config.max_model_len:
            raise InvalidArgument(
                f"{tokens.shape[0]} tokens exceed max_model_len {self.pool_config.max_model_len}"
            )
        if not non_negative_token_ids(tokens):
            raise InvalidArgument("token ids must be >= 0")
        _validate_extra_keys(extra_keys, "lookup", tokens.shape[0])
        if packed_page_hashes is not None:
            page_hashes = self._packed_hashes(packed_page_hashes, page_hashes).split()
        self.settle()
        return self.manager.lookup(tokens, extra_keys=extra_keys, page_hashes=page_hashes)

    def block_table(
        self, request_id: str, group_id: int, kernel_block_size: int = 0
    ) -> tuple[Int32Array, Int32Array, int]:
        """(physical table, kernel table, kernel block size) of one request in one group."""
        if not 0 <= group_id < len(self._page_sizes):
            raise InvalidArgument(f"group_id {group_id} out of range [0, {len(self._page_sizes)})")
        page_size = self._page_sizes[group_id]
        kbs = kernel_block_size or page_size
        if kbs < 1 or page_size % kbs != 0:
            raise InvalidArgument(
                f"kernel_block_size {kbs} must be a positive divisor of page size {page_size}"
            )
        if kbs != page_size and self.pool_config.groups[group_id].kind is GroupKind.MAMBA:
            raise InvalidArgument(
                f"group {group_id} holds mamba states, whose pages are never split: its "
                f"kernel_block_size is the page size {page_size}, not {kbs}"
            )
        pages = self.manager.page_table(request_id, group_id)
        return pages, expand_to_kernel_blocks(pages, page_size // kbs), kbs

    def page(self, page_id: int) -> PageView:
        self.settle()
        pool = self.manager.pool
        if not 0 <= page_id < self.pool_config.num_pages:
            raise NotFound(f"page {page_id} does not exist (pool has {self.pool_config.num_pages})")
        key = pool.page_hash(page_id)
        ref = pool.ref_count(page_id)
        is_cached = pool.is_cached(page_id)
        if page_id == 0:
            state = PageState.NULL
        elif ref > 0:
            state = PageState.USED
        elif is_cached:
            state = PageState.CACHED
        else:
            state = PageState.FREE
        group_id = key[0] if key is not None else None
        if group_id is None and ref > 0:
            group_id = int(self.manager.page_states()["group"][page_id])
        return PageView(page_id, state, ref, is_cached, group_id, key[1] if key else None)

    def page_ids_in_state(
        self, state: PageState | None, start: int, limit: int
    ) -> tuple[list[int], int | None]:
        """Page ids ``>= start`` in ``state`` (all when None), at most ``limit``, and the next
        start (None at the end)."""
        self.settle()
        states = self.manager.page_states()
        ref, cached = states["ref_count"], states["is_cached"]
        ids = np.arange(self.pool_config.num_pages)
        if state is None:
            mask = np.ones_like(ref, dtype=bool)
        elif state is PageState.USED:
            mask = ref > 0
        elif state is PageState.CACHED:
            mask = (ref == 0) & cached & (ids != 0)
        elif state is PageState.FREE:
            mask = (ref == 0) & ~cached & (ids != 0)
        else:
            mask = ids == 0
        mask[: max(start, 0)] = False
        chosen = np.flatnonzero(mask)
        page = chosen[:limit].tolist()
        next_start = int(chosen[limit]) if chosen.shape[0] > limit else None
        return page, next_start

    def is_cached(self, group_id: int, page_hash: bytes) -> bool:
        """Whether a page of group ``group_id`` is in the prefix cache under ``page_hash``."""
        self.settle()
        return self.manager.pool.lookup(group_id, page_hash) is not None

    def events_since(self, since_seq: int, limit: int) -> EventsPage:
        """Events with ``seq > since_seq``, oldest first, at most ``limit``; ``fell_behind``
        when some after ``since_seq`` were already dropped from the buffer, or when
        ``since_seq`` is past every number given out (the watcher followed another state:
        one reset since, durability none or a wiped data dir), which starts it over from
        the oldest retained event."""
        self.settle()
        events = self._events
        first = self._first_event_seq()
        fell_behind = since_seq < first - 1
        if since_seq > self._last_event_seq:
            since_seq, fell_behind = 0, True
        start = bisect.bisect_right(events, since_seq, key=lambda e: e.seq)
        chunk = tuple(events[i] for i in range(start, min(start + limit, len(events))))
        return EventsPage(chunk, fell_behind, first, self._last_event_seq)

    # -- integrity ---------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The core's invariants, plus: every running request is in its owner's set, and
        every client's set names running requests of its own."""
        self.settle()

        self.manager.check_invariants()
        problems = []
        requests = self._requests
        for rid, record in requests.items():
            owner = self._clients.get(record.owner)
            if owner is not None and rid not in owner.request_ids:
                problems.append(f"request {rid!r} missing from its owner's set")
        for client in self._clients.values():
            for rid in sorted(client.request_ids):
                listed = requests.get(rid)
                if listed is None or listed.owner != client.client_id:
                    problems.append(
                        f"client {client.client_id!r} lists request {rid!r}, which "
                        + ("is not running" if listed is None else f"{listed.owner!r} owns")
                    )
        if list(self._event_sizes) != list(map(event_nbytes, self._events)):
            problems.append("the KV-event buffer's kept sizes are not its events'")
        elif sum(self._event_sizes) != self._events_nbytes:
            problems.append(
                f"the KV-event buffer counts {self._events_nbytes} bytes, its events "
                f"{sum(self._event_sizes)}"
            )
        if problems:
            raise InvariantViolation("; ".join(problems))


def _check_v1_requests(tree: dict[str, Any], manager: PageManager) -> None:
    """A version-1 snapshot's own request list must agree with its core tree's."""
    listed = {
        str(rid): (str(owner), int(n), int(c))
        for rid, owner, n, c in zip(
            tree["request_ids"],
            tree["owners"],
            tree["num_tokens"],
            tree["num_computed_tokens"],
            strict=True,
        )
    }
    core = {
        rid: (r.owner, len(r.token_ids), r.num_computed_tokens)
        for rid, r in manager.requests.items()
    }
    if listed != core:
        raise ValueError("its request list disagrees with the core's")


def _first_true(mask: npt.NDArray[np.bool_]) -> int:
    """Index of the first True of a mask that has one."""
    return int(np.flatnonzero(mask)[0])


def _check_growth_tokens(growths: Sequence[Growth]) -> None:
    """Every growth's new token ids are integers >= 0: one vectorised pass over the step
    (a per-growth ``min()`` would cost a few microseconds each, hundreds of times)."""
    arrays = [g.new_token_ids for g in growths if len(g.new_token_ids)]
    if not arrays:
        return
    if len(arrays) < MIN_COLUMN_GROWTHS:
        # A few: each checked in one C pass, without joining them (one decode's token:
        # ~0.5 us against ~3.5 us for the join and numpy's min).
        for growth in growths:
            ids = growth.new_token_ids
            if not len(ids):
                continue
            if ids.dtype.kind not in "iu":
                raise InvalidArgument("new_token_ids must hold integers")
            if not non_negative_token_ids(ids):
                raise InvalidArgument(f"request {growth.request_id!r}: token ids must be >= 0")
        return
    tokens = np.concatenate(arrays)
    if tokens.dtype.kind not in "iu":
        raise InvalidArgument("new_token_ids must hold integers")
    if int(tokens.min()) < 0:
        bad = next(g for g in growths if len(g.new_token_ids) and g.new_token_ids.min() < 0)
        raise InvalidArgument(f"request {bad.request_id!r}: token ids must be >= 0")


def _release(kernel_sets: dict[tuple[int, ...], int], sizes: tuple[int, ...]) -> None:
    count = kernel_sets[sizes] - 1
    if count:
        kernel_sets[sizes] = count
    else:
        del kernel_sets[sizes]


def _validate_extra_keys(extra: ExtraKeys | None, rid: str, num_tokens: int) -> None:
    if extra is None:
        return
    try:
        validate_extra_keys(extra)  # what hashing requires, whether or not it hashes
    except InvalidArgument as exc:
        raise InvalidArgument(f"request {rid!r}: {exc.message}") from None
    # Identifiers, offsets >= 0 and lengths >= 1 are hashing's checks above.
    for mm in extra.mm_inputs:
        if mm.offset + mm.length > num_tokens:
            raise InvalidArgument(
                f"request {rid!r}: multimodal range [{mm.offset}, {mm.offset + mm.length}) "
                f"outside the request's {num_tokens} tokens"
            )


def _outcome(allocation: Allocation) -> AllocationOutcome:
    # Positional: hundreds per step when many decodes cross into a page.
    return AllocationOutcome(
        allocation.request_id,
        AllocationStatus.OK,
        allocation.num_cached_tokens,
        allocation.new_page_ids,
        allocation.hit_page_ids,
    )


def _as_retry(result: StepResult) -> StepResult:
    return replace(result, is_retry=True)


# -- snapshot trees ------------------------------------------------------------------------

_COUNTER_FIELDS = (
    "num_steps",
    "num_step_retries",
    "num_steps_rejected",
    "num_published",
    "num_publish_errors",
    "num_registrations",
    "num_expired_clients",
    "num_force_frees",
    "num_prefix_cache_forgets",
    "num_kv_loss_revocations",
)
_COUNTERS_ADDED_LATER = frozenset(
    {"num_force_frees", "num_prefix_cache_forgets", "num_kv_loss_revocations"}
)
"""Counters a snapshot from before them lacks: they restore as 0 (readers before them
ignore the extra entry)."""
_PROCESS_COUNTERS = frozenset({"num_step_retries", "num_steps_rejected"})
"""Counted since the process started: neither a retry (journaled as the lease renewal it
is) nor a refused step (which changes nothing) is in the journal, so a restart could
not count them alike after a clean stop and after a crash. Snapshots still hold them,
for readers from before; a restore starts them at 0."""


def limits_to_tree(limits: Limits) -> dict[str, Any]:
    return {
        "max_requests_per_step": limits.max_requests_per_step,
        "max_tokens_per_step": limits.max_tokens_per_step,
        "max_clients": limits.max_clients,
        "lease_ttl_s": float(limits.lease_ttl_s),
        "max_lease_ttl_s": float(limits.max_lease_ttl_s),
        "lease_grace_s": float(limits.lease_grace_s),
        "event_buffer_size": limits.event_buffer_size,
        "event_buffer_bytes": limits.event_buffer_bytes,
    }


def limits_from_tree(tree: dict[str, Any]) -> Limits:
    return Limits(
        max_requests_per_step=int(tree["max_requests_per_step"]),
        max_tokens_per_step=int(tree["max_tokens_per_step"]),
        max_clients=int(tree["max_clients"]),
        lease_ttl_s=float(tree["lease_ttl_s"]),
        max_lease_ttl_s=float(tree["max_lease_ttl_s"]),
        lease_grace_s=float(tree["lease_grace_s"]),
        event_buffer_size=int(tree["event_buffer_size"]),
        # Records and snapshots from before the byte limit carry none: the default.
        event_buffer_bytes=int(tree.get("event_buffer_bytes", DEFAULT_EVENT_BUFFER_BYTES)),
    )


def kernel_support_to_tree(support: Sequence[GroupKernelSupport]) -> list[Any]:
    return [
        [
            entry.group_id,
            [[b.name, list(b.block_sizes), list(b.multiple_of)] for b in entry.backends],
        ]
        for entry in support
    ]


def kernel_support_from_tree(tree: list[Any]) -> tuple[GroupKernelSupport, ...]:
    return tuple(
        GroupKernelSupport(
            int(group_id),
            tuple(
                KernelBackend(str(name), tuple(map(int, sizes)), tuple(map(int, multiples)))
                for name, sizes, multiples in backends
            ),
        )
        for group_id, backends in tree
    )


def step_result_to_tree(result: StepResult) -> list[Any]:
    return [
        result.step_id,
        [
            [
                o.request_id,
                o.status.value,
                o.num_cached_tokens,
                [list(pages) for pages in o.new_page_ids],
                [list(pages) for pages in o.hit_page_ids],
                o.reason,
            ]
            for o in result.results
        ],
        result.is_published,
        result.published_slot,
        list(result.unscheduled_request_ids),
        result.num_free_pages,
        result.last_event_seq,
        result.publish_error,
        result.is_retry,
        # Only when set: step results without them stay as they were.
        *([list(result.revoked_request_ids)] if result.revoked_request_ids else []),
    ]


def step_result_from_tree(tree: list[Any]) -> StepResult:
    revoked: list[Any] = []
    if isinstance(tree, list) and len(tree) == 10:
        *tree, revoked = tree
    (
        step_id,
        outcomes,
        is_published,
        slot,
        unscheduled,
        num_free,
        last_event_seq,
        publish_error,
        is_retry,
    ) = tree
    return StepResult(
        step_id=int(step_id),
        listed=tuple(
            AllocationOutcome(
                request_id=str(rid),
                status=AllocationStatus(status),
                num_cached_tokens=int(cached),
                new_page_ids=tuple(tuple(int(p) for p in pages) for pages in new),
                hit_page_ids=tuple(tuple(int(p) for p in pages) for pages in hit),
                reason=str(reason),
            )
            for rid, status, cached, new, hit, reason in outcomes
        ),
        is_published=bool(is_published),
        published_slot=int(slot),
        unscheduled_request_ids=tuple(str(r) for r in unscheduled),
        num_free_pages=int(num_free),
        last_event_seq=int(last_event_seq),
        publish_error=str(publish_error),
        is_retry=bool(is_retry),
        revoked_request_ids=tuple(str(r) for r in revoked),
    )


def _named_revoked(
    revoked: set[str],
    cmd: StepCommand,
    growths: tuple[Growth, ...],
    columns: GrowthColumns | None,
) -> set[str]:
    """The ids of ``revoked`` that ``cmd`` frees, grows or lists in its batch."""
    named = revoked.intersection(cmd.frees)
    named.update(g.request_id for g in growths if g.request_id in revoked)
    if columns is not None:
        named |= revoked.intersection(columns.request_ids)
    if cmd.batch is not None:
        named |= revoked.intersection(cmd.batch.request_ids)
    return named


def _client_to_tree(c: ClientRecord) -> list[Any]:
    return [
        c.client_id,
        c.role.value,
        c.name,
        c.device,
        c.generation,
        float(c.lease_ttl_s),
        float(c.registered_at),
        float(c.expires_at),
        kernel_support_to_tree(c.kernel_support),
        list(c.kernel_block_sizes),
        sorted(c.request_ids),
        c.last_step_id,
        None if c.last_step_result is None else step_result_to_tree(c.last_step_result),
        c.num_steps,
        # Only when set: snapshots without them stay as they were (an identity may be "").
        *([c.identity, sorted(c.revoked)] if c.revoked else [c.identity] if c.identity else []),
    ]


def _client_from_tree(tree: list[Any]) -> ClientRecord:
    identity, revoked = "", []
    if isinstance(tree, list) and len(tree) == 16:
        *tree, identity, revoked = tree
    elif isinstance(tree, list) and len(tree) == 15:
        *tree, identity = tree
    (
        client_id,
        role,
        name,
        device,
        generation,
        lease_ttl_s,
        registered_at,
        expires_at,
        support,
        sizes,
        request_ids,
        last_step_id,
        last_result,
        num_steps,
    ) = tree
    return ClientRecord(
        client_id=str(client_id),
        role=ClientRole(role),
        name=str(name),
        device=str(device),
        generation=int(generation),
        lease_ttl_s=float(lease_ttl_s),
        registered_at=float(registered_at),
        expires_at=float(expires_at),
        kernel_support=kernel_support_from_tree(support),
        kernel_block_sizes=tuple(int(k) for k in sizes),
        request_ids={str(r) for r in request_ids},
        last_step_id=int(last_step_id),
        last_step_result=None if last_result is None else step_result_from_tree(last_result),
        num_steps=int(num_steps),
        identity=str(identity),
        revoked={str(r) for r in revoked},
    )
