"""Typed inputs and results of the pagekeeper client (plain dataclasses, numpy for ids).

Nothing here knows protobuf: :mod:`pagekeeper_client.client` converts between these and the
wire messages. Page ids are ``numpy.int32`` arrays decoded zero-copy from the wire's raw
little-endian bytes; treat them as read-only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pagekeeper_client.errors import InvalidArgumentError
from pagekeeper_client.ring import RingDescriptor

Int32Array = npt.NDArray[np.int32]
INT32_MAX = 2**31 - 1
"""The largest value of the wire's int32 fields and arrays."""

EMPTY_PAGES: Int32Array = np.empty(0, dtype=np.int32)
EMPTY_PAGES.flags.writeable = False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- roles, kinds, statuses ----------------------------------------------------------------


class ClientRole(enum.StrEnum):
    SCHEDULER = "scheduler"
    """Drives steps: owns requests, grows and frees them, publishes batches."""
    WORKER = "worker"
    """Reads published tables; gets a kernel block size per group."""


class GroupKind(enum.StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"


class AllocationStatus(enum.StrEnum):
    OK = "ok"
    """Pages allocated (or none needed)."""
    NO_CAPACITY = "no_capacity"
    """Not enough free pages: nothing changed for the request; the scheduler must preempt."""
    REJECTED = "rejected"
    """Refused when applied for a reason only the apply order reveals; ``reason`` says why."""
    PENDING = "pending"
    """Client side only: queued, answered by the next ``step()``/``flush()``."""


# -- pool ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One KV-cache group: layers sharing one table layout; all groups share one pool."""

    group_id: int
    kind: GroupKind
    page_size: int
    window: int = 0
    """Sliding-window groups: the window in tokens."""
    chunk: int = 0
    """Chunked-local groups: the chunk in tokens."""
    enable_state_caching: bool = False
    """Mamba groups: whether per-page states are cached."""
    name: str = ""

    def num_required_pages(self, num_tokens: int) -> int:
        """Table length (pages, null ones included) a request needs for ``num_tokens``
        tokens -- the service's rule, so the client can answer without asking."""
        if self.kind is GroupKind.MAMBA and not self.enable_state_caching:
            return 1 if num_tokens > 0 else 0
        return cdiv(num_tokens, self.page_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose pages the group no longer reads (they become the null page)."""
        if self.kind is GroupKind.SLIDING_WINDOW:
            return max(0, num_computed_tokens - self.window + 1)
        if self.kind is GroupKind.CHUNKED_LOCAL:
            return (num_computed_tokens // self.chunk) * self.chunk
        if self.kind is GroupKind.MAMBA and self.enable_state_caching:
            return max(0, num_computed_tokens - 1)
        return 0


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The pool's fixed configuration."""

    num_pages: int
    """Pages including the null page 0."""
    groups: tuple[GroupInfo, ...]
    enable_prefix_caching: bool
    hash_algorithm: str
    max_model_len: int
    page_hash_size: int = 0
    """Bytes in one page hash; 0 from a service that takes page hashes only one field
    each (before ``packed_page_hashes``)."""
    accepts_growth_page_hashes: bool = False
    """The service takes a growth's page hashes (``allocate_slots(page_hashes=...)``);
    False from one that predates them (it would ignore them and hash generated pages
    itself, so the client refuses to send them)."""

    @property
    def page_sizes(self) -> tuple[int, ...]:
        return tuple(g.page_size for g in self.groups)


@dataclass(frozen=True, slots=True)
class Limits:
    max_requests_per_step: int
    max_tokens_per_step: int
    max_clients: int
    max_message_bytes: int
    lease_ttl_s: float
    """The server's default lease."""


@dataclass(frozen=True, slots=True)
class PoolCounters:
    num_free_pages: int
    num_used_pages: int
    num_cached_pages: int
    num_free_cached_pages: int
    num_requests: int
    usage: float
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    prefix_queries_requests: int
    prefix_hits_requests: int
    prefix_hit_rate: float
    num_evictions: int
    num_allocated_pages_total: int
    num_freed_pages_total: int
    num_no_capacity: int
    num_steps: int
    num_published: int
    num_clients: int
    last_event_seq: int


@dataclass(frozen=True, slots=True)
class PoolInfo:
    config: PoolConfig
    limits: Limits
    counters: PoolCounters
    server_version: str


# -- registration --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """Kernel block sizes one attention backend supports: any of ``block_sizes``, or any
    multiple of one of ``multiple_of`` (vLLM's ``int | MultipleOf``)."""

    name: str = ""
    block_sizes: tuple[int, ...] = ()
    multiple_of: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.block_sizes and not self.multiple_of:
            raise ValueError(f"backend {self.name!r}: give block_sizes or multiple_of")

    @classmethod
    def parse(cls, spec: str) -> KernelBackend:
        """``"FLASH_ATTN:16,32,64"``, ``"CPU:x32"`` (multiples of 32) or ``"16,32"``."""
        name, _, sizes = spec.rpartition(":")
        exact: list[int] = []
        multiples: list[int] = []
        for item in filter(None, (s.strip() for s in sizes.split(","))):
            try:
                if item[0] in "xX*":
                    multiples.append(int(item[1:]))
                else:
                    exact.append(int(item))
            except ValueError:
                raise InvalidArgumentError(
                    f"backend spec {spec!r}: {item!r} is not a block size (16) or a multiple (x16)"
                ) from None
        return cls(name=name, block_sizes=tuple(exact), multiple_of=tuple(multiples))


BackendSpec = KernelBackend | int | Sequence[int]
"""A backend: a :class:`KernelBackend`, one exact size, or a list of exact sizes."""


def normalize_backends(
    backends_per_group: Mapping[int, Sequence[BackendSpec]] | Sequence[Sequence[BackendSpec]],
) -> dict[int, tuple[KernelBackend, ...]]:
    """``{group_id: [backend, ...]}`` (or a list indexed by group id) with every backend as
    a :class:`KernelBackend`. A group's list holds one entry per attention backend its layers
    use; the chosen size must suit all of them."""
    items = (
        backends_per_group.items()
        if isinstance(backends_per_group, Mapping)
        else enumerate(backends_per_group)
    )
    out: dict[int, tuple[KernelBackend, ...]] = {}
    for group_id, backends in items:
        converted = []
        for spec in backends:
            if isinstance(spec, KernelBackend):
                converted.append(spec)
            elif isinstance(spec, int):
                converted.append(KernelBackend(block_sizes=(spec,)))
            else:
                converted.append(KernelBackend(block_sizes=tuple(int(s) for s in spec)))
        # Checked here, with the field named, rather than by protobuf ("Value out of range").
        if not 0 <= int(group_id) <= INT32_MAX:
            raise InvalidArgumentError(f"group id {group_id} is not in [0, 2**31 - 1]")
        for backend in converted:
            for size in (*backend.block_sizes, *backend.multiple_of):
                if not 1 <= size <= INT32_MAX:
                    raise InvalidArgumentError(
                        f"group {group_id}: backend {backend.name!r}: kernel block size {size} "
                        "is not in [1, 2**31 - 1]"
                    )
        out[int(group_id)] = tuple(converted)
    return out


@dataclass(frozen=True, slots=True)
class Registration:
    """What ``RegisterClient`` answered."""

    client_id: str
    generation: int
    lease_ttl_s: float
    pool: PoolConfig
    limits: Limits
    last_step_id: int
    last_published_step_seq: int
    kernel_block_sizes: tuple[int, ...] = ()
    """Workers: the chosen kernel block size per group."""
    ring: RingDescriptor | None = None
    """Workers: where published tables land (None: nothing is published)."""
    local_socket: str = ""
    """The service's same-node socket ("": none), see :mod:`pagekeeper_client.local`."""
    local_ticket: str = ""
    """With mutual TLS: what a same-node socket connection presents to act for this client
    ("": none needed)."""
    state_id: str = ""
    """The service's state this registration belongs to; sent back with every call for the
    client, so a service whose state was reset refuses the old registration (NOT_FOUND)."""
    request_ids: tuple[str, ...] = ()
    """A takeover: the running requests the id owns (the client adopts them)."""


# -- step inputs ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MultiModalKey:
    """A multimodal input's content hash and the token range its placeholder occupies."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What besides token ids enters a page hash (vLLM's extra keys)."""

    lora_name: str | None = None
    lora_path: str | None = None
    mm_inputs: tuple[MultiModalKey, ...] = ()
    cache_salt: str | None = None


TokenIds = Sequence[int] | npt.NDArray[np.integer]


@dataclass(frozen=True, slots=True, eq=False)
class Admission:
    """A new (or resumed) request for :meth:`PagekeeperClient.step`'s raw form."""

    request_id: str
    token_ids: TokenIds
    num_new_tokens: int = 0
    """Tokens to compute now after the cached prefix; 0: all the rest."""
    extra_keys: ExtraKeys | None = None
    page_hashes: Sequence[bytes] | None = None
    """Client-computed page hashes (e.g. vLLM's ``Request.block_hashes``)."""
    num_lookahead_tokens: int = 0
    enable_cache_read: bool = True


@dataclass(frozen=True, slots=True, eq=False)
class Growth:
    """Room for more tokens of a running request, for the raw form of ``step``."""

    request_id: str
    num_new_tokens: int
    new_token_ids: TokenIds = ()
    num_computed_tokens: int | None = None
    num_lookahead_tokens: int = 0
    page_hashes: Sequence[bytes] | None = None
    """Client-computed hashes of the pages ``new_token_ids`` complete (see
    ``PagekeeperClient.allocate_slots``)."""


# -- step results ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AllocationResult:
    """The outcome of one growth or admission."""

    request_id: str
    status: AllocationStatus
    num_cached_tokens: int = 0
    """Admissions: prompt tokens served from the prefix cache."""
    new_page_ids: tuple[Int32Array, ...] = ()
    """Per group: pages newly handed to the request, in table order."""
    hit_page_ids: tuple[Int32Array, ...] = ()
    """Per group (admissions): cached pages reused (null pages stand for skipped ones)."""
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status is AllocationStatus.OK

    @property
    def num_new_pages(self) -> int:
        return sum(int(p.shape[0]) for p in self.new_page_ids)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one ``Step`` answered."""

    step_id: int
    results: tuple[AllocationResult, ...]
    """Answers to the operations queued since the previous ``step()``/``flush()``,
    including those a synchronous call sent early (first): the growths that got pages or
    were refused (in call order), then the admissions. A growth not listed succeeded
    without needing a page. A synchronous call's own answer is returned to it, not repeated
    here. Decodes of revoked requests (``allocate_decodes``) are answered NO_CAPACITY by
    the client itself, among the early answers."""
    is_published: bool = False
    published_slot: int = -1
    unscheduled_request_ids: tuple[str, ...] = ()
    """Batch requests left out of the published tables (their allocation failed, or they
    are revoked)."""
    num_free_pages: int = 0
    last_event_seq: int = 0
    publish_error: str = ""
    is_retry: bool = False
    """The stored answer to a retried step id (nothing was applied twice)."""
    num_local_growths: int = 0
    """Client side: growths answered locally (no new page) that this step carries, and the
    decodes held back since the previous step (their tokens travel later)."""
    revoked_request_ids: tuple[str, ...] = ()
    """This client's requests an admin freed (``DELETE /v1/requests/{id}``) that it has not
    freed since, in every answer until it does: their pages are gone. The client answers
    their ``allocate_slots`` NO_CAPACITY; preempt and free them (the free is accepted)."""

    def by_request(self) -> dict[str, AllocationResult]:
        return {r.request_id: r for r in self.results}

    def result(self, request_id: str) -> AllocationResult:
        """The listed result of one request (KeyError: a growth that needed no page)."""
        for r in self.results:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)

    @property
    def no_capacity(self) -> tuple[str, ...]:
        """Requests that got NO_CAPACITY this step (the scheduler preempts them)."""
        return tuple(r.request_id for r in self.results if r.status is AllocationStatus.NO_CAPACITY)


@dataclass(frozen=True, slots=True)
class SlotAllocation:
    """The answer to :meth:`PagekeeperClient.allocate_slots` (vLLM's ``allocate_slots``).

    - ``OK`` with ``is_local``: the request's pages already cover the tokens in every group;
      answered by the client without a call. The growth travels in the next step, or, a
      plain decode that drops and completes no page, is held back and travels with the
      request's next growth (``hold_decodes``).
    - ``OK`` not local: the service handed ``new_page_ids`` (``sync=True``), or, with
      ``is_deferred``, the pool surely has them and they come with the next step.
    - ``PENDING``: pages are needed; the growth is queued for the next ``step()``.
    - ``NO_CAPACITY``: out of pages; nothing changed; preempt something (vLLM: ``None``).
    - ``REJECTED``: refused at apply time; ``reason`` says why.
    """

    request_id: str
    status: AllocationStatus
    new_page_ids: tuple[Int32Array, ...] = ()
    is_local: bool = False
    is_deferred: bool = False
    """OK with ``sync=True`` and ``defer_page_ids``: the pool surely has the pages, so the
    answer came without a call; the ids come with the next step (its results and the
    client's view of the request)."""
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status is AllocationStatus.OK

    @property
    def is_pending(self) -> bool:
        return self.status is AllocationStatus.PENDING


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest cached prefix (no side effects)."""

    num_hit_tokens: int
    page_ids: tuple[Int32Array, ...]
    """Per group: the pages that prefix maps to."""
    page_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockTable:
    """One request's physical and kernel tables in one group."""

    request_id: str
    group_id: int
    page_size: int
    kernel_block_size: int
    page_ids: Int32Array
    kernel_block_ids: Int32Array
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    owner: str


# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PageStored:
    """Full pages entered the prefix-cache index."""

    seq: int
    group_id: int
    page_hashes: tuple[bytes, ...]
    parent_page_hash: bytes | None
    token_ids: Int32Array
    page_size: int
    page_ids: Int32Array
    lora_name: str | None = None
    extra_keys: ExtraKeys | None = None
    """The storing request's extra keys that fall on these pages, when any do."""
    first_page_index: int = 0
    """Page ``i`` of the event is page ``first_page_index + i`` of its request's table."""


@dataclass(frozen=True, slots=True)
class PageRemoved:
    """Cached pages left the index (evicted on reuse, or dropped)."""

    seq: int
    group_id: int
    page_hashes: tuple[bytes, ...]
    page_ids: Int32Array


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The whole prefix cache was reset."""

    seq: int


KVEvent = PageStored | PageRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One ``WatchEvents`` message."""

    events: tuple[KVEvent, ...]
    fell_behind: bool
    """Events after the requested sequence were already dropped by the server: resync."""
    first_retained_seq: int
    last_event_seq: int


# -- client-side bookkeeping --------------------------------------------------------------


@dataclass(slots=True)
class ClientStats:
    """Cheap counters every client keeps (tests and benchmarks read them)."""

    num_rpcs: int = 0
    """Unary calls sent, retries included."""
    num_steps: int = 0
    """Step calls that were applied (retries not counted)."""
    num_sync_steps: int = 0
    """Steps sent to answer one call at once (``sync=True`` growth or admission)."""
    num_ordering_flushes: int = 0
    """Steps sent early to keep the service's apply order equal to the call order."""
    num_local_answers: int = 0
    """``allocate_slots`` calls answered without a call (no page needed)."""
    num_deferred_answers: int = 0
    """``allocate_slots(sync=True)`` calls that needed a page, answered without a call from
    the capacity bound (``defer_page_ids``)."""
    num_retries: int = 0
    num_unanswered_steps: int = 0
    """Steps that got no answer (outcome unknown), each sent again before the next step."""
    num_local_calls: int = 0
    """Unary calls that went over the same-node socket (counted in ``num_rpcs`` too)."""
    num_heartbeats: int = 0
    num_reregistrations: int = 0
    by_method: dict[str, int] = field(default_factory=dict)
