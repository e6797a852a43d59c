"""Protobuf <-> domain conversion; pure functions, no I/O.

Arrays travel as raw little-endian bytes: decoding is one ``numpy.frombuffer`` (zero copy),
encoding one ``tobytes``. Malformed input raises :class:`InvalidArgument` so the servicer
answers INVALID_ARGUMENT before anything changes.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Callable, Sequence

import numpy as np

from pagekeeper.core.config import GroupKind, PoolConfig
from pagekeeper.core.errors import InvalidArgument
from pagekeeper.core.events import AllCleared, KVEvent, PageRemoved, PageStored, TokenRun
from pagekeeper.core.hashing import digest_size
from pagekeeper.core.pool import pack_i32_native
from pagekeeper.core.types import BatchTables, ExtraKeys, Int32Array, MultiModalKey, PoolStats
from pagekeeper.publish.api import RingDescriptor
from pagekeeper.state import (
    MIN_COLUMN_GROWTHS,
    Admission,
    AllocationOutcome,
    AllocationStatus,
    Batch,
    ClientRole,
    GroupKernelSupport,
    Growth,
    GrowthColumns,
    GrowthGrants,
    KernelBackend,
    Limits,
    ServiceCounters,
    StepCommand,
    StepResult,
    plain_decodes,
)
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.extra_keys import extra_keys_to_pb

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
_EMPTY_I32: Int32Array = np.empty(0, dtype=np.int32)
_EMPTY_I32.flags.writeable = False
_IS_LITTLE_ENDIAN = sys.byteorder == "little"

GROUP_KIND_TO_PB = {
    GroupKind.FULL: pb.GROUP_KIND_FULL,
    GroupKind.SLIDING_WINDOW: pb.GROUP_KIND_SLIDING_WINDOW,
    GroupKind.CHUNKED_LOCAL: pb.GROUP_KIND_CHUNKED_LOCAL,
    GroupKind.MAMBA: pb.GROUP_KIND_MAMBA,
}
ROLE_FROM_PB = {
    pb.CLIENT_ROLE_SCHEDULER: ClientRole.SCHEDULER,
    pb.CLIENT_ROLE_WORKER: ClientRole.WORKER,
}
STATUS_TO_PB = {
    AllocationStatus.OK: pb.ALLOCATION_STATUS_OK,
    AllocationStatus.NO_CAPACITY: pb.ALLOCATION_STATUS_NO_CAPACITY,
    AllocationStatus.REJECTED: pb.ALLOCATION_STATUS_REJECTED,
}
RING_KIND_TO_PB = {
    "shm": pb.RING_KIND_SHM,
    "cuda_ipc": pb.RING_KIND_CUDA_IPC,
    "cpu_ipc": pb.RING_KIND_CPU_IPC,
    "stream": pb.RING_KIND_STREAM,
}


# -- arrays ---------------------------------------------------------------------------------


def decode_i32(data: bytes, what: str | Callable[[], str]) -> Int32Array:
    """Raw little-endian int32 bytes -> read-only int32 array (no copy on little-endian).
    ``what`` names the field in the error (a callable defers building the name: this runs
    once per request of a step)."""
    if len(data) % 4:
        name = what() if callable(what) else what
        raise InvalidArgument(f"{name}: {len(data)} bytes is not a whole number of int32")
    if not data:
        return _EMPTY_I32
    array = np.frombuffer(data, dtype=I32)
    return array if _IS_LITTLE_ENDIAN else array.astype(np.int32)


def encode_i32(values: Sequence[int] | np.ndarray) -> bytes:
    if isinstance(values, np.ndarray):
        return values.astype(I32, copy=False).tobytes()
    if not values:
        return b""
    if pack_i32_native is not None:
        # An admission's 125 page ids: ~0.4 us, against ~2.9 us through numpy.
        return pack_i32_native(values)
    if _IS_LITTLE_ENDIAN and len(values) < 64:
        # The page ids of one growth: array.array is several times cheaper than numpy.
        return array.array("i", values).tobytes()
    return np.array(values, dtype=I32).tobytes()


def _token_run_i32(token_ids: Sequence[int]) -> bytes:
    """A stored event's tokens as wire int32 (a core ``TokenRun`` converts at C speed)."""
    if isinstance(token_ids, TokenRun):
        return np.frombuffer(token_ids.tobytes(), dtype=np.uint64).astype(I32).tobytes()
    return encode_i32(token_ids)


def encode_i64(values: np.ndarray) -> bytes:
    return values.astype(I64, copy=False).tobytes()


# -- config and counters --------------------------------------------------------------------


def pool_config_to_pb(config: PoolConfig) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_pages=config.num_pages,
        groups=[
            pb.GroupInfo(
                group_id=i,
                kind=GROUP_KIND_TO_PB[g.kind],
                page_size=g.page_size,
                window=g.window or 0,
                chunk=g.chunk or 0,
                enable_state_caching=g.enable_state_caching,
                name=g.name,
            )
            for i, g in enumerate(config.groups)
        ],
        enable_prefix_caching=config.enable_prefix_caching,
        hash_algorithm=config.hash_algorithm,
        max_model_len=config.max_model_len,
        page_hash_size=digest_size(config.hash_algorithm),
        accepts_growth_page_hashes=True,
    )


def limits_to_pb(limits: Limits, max_message_bytes: int) -> pb.Limits:
    return pb.Limits(
        max_requests_per_step=limits.max_requests_per_step,
        max_tokens_per_step=limits.max_tokens_per_step,
        max_clients=limits.max_clients,
        max_message_bytes=max_message_bytes,
        lease_ttl_ms=round(limits.lease_ttl_s * 1000),
    )


def counters_to_pb(
    stats: PoolStats, counters: ServiceCounters, num_clients: int, last_event_seq: int
) -> pb.PoolCounters:
    return pb.PoolCounters(
        num_free_pages=stats.num_free_pages,
        num_used_pages=stats.num_used_pages,
        num_cached_pages=stats.num_cached_pages,
        num_free_cached_pages=stats.num_free_cached_pages,
        num_requests=stats.num_requests,
        usage=stats.usage,
        prefix_queries_tokens=stats.prefix_queries_tokens,
        prefix_hits_tokens=stats.prefix_hits_tokens,
        prefix_queries_requests=stats.prefix_queries_requests,
        prefix_hits_requests=stats.prefix_hits_requests,
        prefix_hit_rate=stats.prefix_hit_rate,
        num_evictions=stats.num_evictions,
        num_allocated_pages_total=stats.num_allocated_pages_total,
        num_freed_pages_total=stats.num_freed_pages_total,
        num_no_capacity=stats.num_no_capacity,
        num_steps=counters.num_steps,
        num_published=counters.num_published,
        num_clients=num_clients,
        last_event_seq=last_event_seq,
    )


# -- registration ---------------------------------------------------------------------------


def role_from_pb(role: int) -> ClientRole:
    try:
        return ROLE_FROM_PB[role]
    except KeyError:
        raise InvalidArgument("role must be CLIENT_ROLE_SCHEDULER or CLIENT_ROLE_WORKER") from None


def kernel_support_from_pb(
    entries: Sequence[pb.GroupKernelSupport],
) -> tuple[GroupKernelSupport, ...]:
    return tuple(
        GroupKernelSupport(
            group_id=e.group_id,
            backends=tuple(
                KernelBackend(b.name, tuple(b.block_sizes), tuple(b.multiple_of))
                for b in e.backends
            ),
        )
        for e in entries
    )


def ring_to_pb(ring: RingDescriptor) -> pb.RingDescriptor:
    geometry = ring.geometry
    return pb.RingDescriptor(
        kind=RING_KIND_TO_PB.get(ring.kind, pb.RING_KIND_UNSPECIFIED),
        generation=ring.generation,
        geometry=pb.RingGeometry(
            depth=geometry.depth,
            max_num_reqs=geometry.max_num_reqs,
            max_num_tokens=geometry.max_num_tokens,
            tables=[
                pb.RingTableGeometry(group_id=g, kernel_block_size=k, max_kernel_blocks_per_row=c)
                for g, k, c in geometry.tables
            ],
        ),
        size_bytes=ring.size_bytes,
        layout_version=ring.layout_version,
        path=ring.path,
        device=ring.device,
        gpu_uuid=ring.gpu_uuid,
        ipc_handle=ring.ipc_handle,
        event_handles=list(ring.event_handles),
        offset=ring.offset,
        exporter_pid=ring.exporter_pid,
        dtype=ring.dtype,
        ref_counter_handle=ring.ref_counter_handle,
        ref_counter_offset=ring.ref_counter_offset,
    )


# -- step -----------------------------------------------------------------------------------


def extra_keys_from_pb(msg: pb.ExtraKeys) -> ExtraKeys | None:
    lora_name = msg.lora_name if msg.HasField("lora_name") else None
    lora_path = msg.lora_path if msg.HasField("lora_path") else None
    cache_salt = msg.cache_salt if msg.HasField("cache_salt") else None
    mm = tuple(MultiModalKey(m.identifier, m.offset, m.length) for m in msg.mm_inputs)
    if lora_name is None and lora_path is None and cache_salt is None and not mm:
        return None
    return ExtraKeys(lora_name=lora_name, lora_path=lora_path, mm_inputs=mm, cache_salt=cache_salt)


def _growth_from_pb(g: pb.Growth) -> Growth:
    data = g.new_token_ids
    tokens = _EMPTY_I32
    if data:
        tokens = decode_i32(data, lambda: f"growth {g.request_id!r}: new_token_ids")
    packed = g.packed_page_hashes
    if packed:
        return Growth(
            g.request_id,
            g.num_new_tokens,
            tokens,
            g.num_computed_tokens if g.HasField("num_computed_tokens") else None,
            g.num_lookahead_tokens,
            None,
            packed,
            g.page_hash_size,
        )
    return Growth(
        g.request_id,
        g.num_new_tokens,
        tokens,
        g.num_computed_tokens if g.HasField("num_computed_tokens") else None,
        g.num_lookahead_tokens,
    )


def _admission_from_pb(a: pb.Admission) -> Admission:
    # Positional, as a growth: an admission step's eight cost ~3 us less than keywords.
    rid = a.request_id
    return Admission(
        rid,
        decode_i32(a.token_ids, lambda: f"admission {rid!r}: token_ids"),
        a.num_new_tokens,
        extra_keys_from_pb(a.extra_keys) if a.HasField("extra_keys") else None,
        tuple(a.page_hashes) if a.page_hashes else None,
        a.num_lookahead_tokens,
        a.enable_cache_read if a.HasField("enable_cache_read") else True,
        a.packed_page_hashes or None,
    )


# Read-only int32 columns of one default value each, grown as needed: a column left out
# of the wire is a view of one (a 256-decode step's four: ~5 us less than np.full each time).
_DEFAULT_COLUMNS: dict[int, Int32Array] = {}


def _default_column(n: int, default: int) -> Int32Array:
    base = _DEFAULT_COLUMNS.get(default)
    if base is None or len(base) < n:
        base = np.full(max(n, 1024), default, dtype=np.int32)
        base.flags.writeable = False
        _DEFAULT_COLUMNS[default] = base
    return base[:n]


def _column_from_pb(data: bytes, name: str, n: int, default: int) -> Int32Array:
    if not data:
        return _default_column(n, default)
    return decode_i32(data, f"growth_columns.{name}")


def _few_plain_decodes(c: pb.GrowthColumns) -> tuple[Growth, ...] | None:
    """A few plain decodes in column form (every count column left out, one token per id)
    as growths, which the state takes for so few anyway, without building the columns;
    None for anything else (:func:`growth_columns_from_pb` then, and the state's checks)."""
    ids = c.request_ids
    n = len(ids)
    if (
        not n
        or n >= MIN_COLUMN_GROWTHS
        or c.num_new_tokens
        or c.num_new_token_ids
        or c.num_computed_tokens
        or c.num_lookahead_tokens
        or c.num_page_hashes
        or c.packed_page_hashes
        or len(c.new_token_ids) != 4 * n
    ):
        return None
    return plain_decodes(ids, decode_i32(c.new_token_ids, "growth_columns.new_token_ids"))


def growth_columns_from_pb(c: pb.GrowthColumns) -> GrowthColumns:
    """Column form -> :class:`GrowthColumns` (empty columns filled with their default;
    lengths are checked by the state with the rest of the step)."""
    n = len(c.request_ids)
    counts = (c.num_new_tokens, c.num_new_token_ids, c.num_computed_tokens, c.num_lookahead_tokens)
    num_hashes, packed = c.num_page_hashes, c.packed_page_hashes
    has_hashes = bool(num_hashes or packed)
    return GrowthColumns(
        request_ids=tuple(c.request_ids),
        num_new_tokens=_column_from_pb(counts[0], "num_new_tokens", n, 1),
        new_token_ids=decode_i32(c.new_token_ids, "growth_columns.new_token_ids"),
        num_new_token_ids=_column_from_pb(counts[1], "num_new_token_ids", n, 1),
        num_computed_tokens=_column_from_pb(counts[2], "num_computed_tokens", n, -1),
        num_lookahead_tokens=_column_from_pb(counts[3], "num_lookahead_tokens", n, 0),
        # All four left out: plain decodes, which the state checks by the rows' maxima
        # (and applies in one run, page hashes or not).
        defaults_only=not any(counts),
        packed_page_hashes=packed,
        num_page_hashes=(
            _column_from_pb(num_hashes, "num_page_hashes", n, 0) if has_hashes else None
        ),
        page_hash_size=c.page_hash_size if has_hashes else 0,
    )


def step_from_pb(
    request: pb.StepRequest, now: float, data: bytes | memoryview | None = None
) -> StepCommand:
    """``data``: the bytes ``request`` was parsed from (the journal writes them as they
    are), or ``None``."""
    # The hot part of a decode step: up to hundreds of growths, so one plain call each
    # (or a few arrays in column form).
    growths = tuple(map(_growth_from_pb, request.growths))
    columns = None
    if request.HasField("growth_columns"):
        wire_columns = request.growth_columns
        plain = None if growths else _few_plain_decodes(wire_columns)
        if plain is not None:
            growths = plain
        else:
            columns = growth_columns_from_pb(wire_columns)
    admissions = tuple(map(_admission_from_pb, request.admissions))
    batch = None
    if request.HasField("batch"):
        b = request.batch
        counts, ends = b.num_scheduled_tokens, b.num_computed_tokens
        batch = Batch(
            request_ids=tuple(b.request_ids),
            num_scheduled_tokens=decode_i32(counts, "batch.num_scheduled_tokens")
            if counts
            else None,
            num_computed_tokens=decode_i32(ends, "batch.num_computed_tokens") if ends else None,
        )
    return StepCommand(
        now=now,
        client_id=request.client_id,
        generation=request.generation,
        step_id=request.step_id,
        frees=tuple(request.free_request_ids),
        growths=growths,
        admissions=admissions,
        batch=batch,
        growth_columns=columns,
        wire=request,
        wire_bytes=data,
    )


def _pages_to_pb(per_group: tuple[tuple[int, ...], ...]) -> list[bytes]:
    if pack_i32_native is not None:
        # The core's tuples of ints go to C directly (8 admissions: ~1.3 us less a step).
        pack = pack_i32_native
        return [pack(p) if type(p) is tuple else encode_i32(p) for p in per_group]
    return [encode_i32(pages) for pages in per_group]


def outcome_to_pb(outcome: AllocationOutcome) -> pb.AllocationResult:
    msg = pb.AllocationResult()
    _fill_outcome(msg, outcome)
    return msg


def _fill_outcome(msg: pb.AllocationResult, outcome: AllocationOutcome) -> None:
    # Hundreds per step when many decodes cross into a page: unset fields stay unset.
    msg.request_id = outcome.request_id
    msg.status = STATUS_TO_PB[outcome.status]
    msg.new_page_ids.extend(_pages_to_pb(outcome.new_page_ids))
    if outcome.num_cached_tokens:
        msg.num_cached_tokens = outcome.num_cached_tokens
    if outcome.hit_page_ids:
        msg.hit_page_ids.extend(_pages_to_pb(outcome.hit_page_ids))
    if outcome.reason:
        msg.reason = outcome.reason


def step_result_to_pb(
    result: StepResult, request: pb.StepRequest | None = None, command: StepCommand | None = None
) -> pb.StepResponse:
    """The answer to ``request``; with ``request.grants_in_columns`` the growths granted
    new pages go into ``grants`` (three int32 columns) instead of ``results``. ``command``:
    what :func:`step_from_pb` made of ``request`` (its request ids are Python strings
    already; reading them again from the message builds each anew)."""
    response = pb.StepResponse(
        step_id=result.step_id,
        published_slot=result.published_slot,
        num_free_pages=result.num_free_pages,
        last_event_seq=result.last_event_seq,
    )
    # The rest only when set (their defaults are what the wire leaves out anyway): ~0.7 us
    # of a step's answer.
    if result.is_published:
        response.is_published = True
    if result.unscheduled_request_ids:
        response.unscheduled_request_ids.extend(result.unscheduled_request_ids)
    if result.publish_error:
        response.publish_error = result.publish_error
    if result.is_retry:
        response.is_retry = True
    if result.revoked_request_ids:
        response.revoked_request_ids.extend(result.revoked_request_ids)
    add = response.results.add  # built in place: no copy of each result into the response
    outcomes: Sequence[AllocationOutcome] = result.listed
    granted = result.grants
    if request is not None and request.grants_in_columns:
        listed = _fill_grants(response.grants, outcomes, request, command, granted)
        if listed is not None:
            outcomes = listed
        elif granted is not None:
            outcomes = result.results
    elif granted is not None:
        outcomes = result.results
    for outcome in outcomes:
        _fill_outcome(add(), outcome)
    return response


def _fill_grants(
    grants: pb.GrowthGrants,
    outcomes: Sequence[AllocationOutcome],
    request: pb.StepRequest,
    command: StepCommand | None,
    granted: GrowthGrants | None = None,
) -> list[AllocationOutcome] | None:
    """Put the OK growth outcomes (and ``granted``, the growths the state kept as columns)
    in ``grants``; returns the outcomes ``results`` still lists (refused growths, then the
    admissions), or None when the outcomes do not line up with ``request`` (then every
    outcome goes to ``results``, which is always right)."""
    num_growths = len(outcomes) - len(request.admissions)
    if granted is not None:
        if num_growths != granted.num_listed_growths:
            return None
    elif num_growths <= 0:
        return None
    growth_ids: Sequence[str]
    if command is not None:
        columns = command.growth_columns
        if columns is not None:
            growth_ids = columns.request_ids
        else:
            growth_ids = [g.request_id for g in command.growths]
    elif request.HasField("growth_columns"):
        growth_ids = request.growth_columns.request_ids
    else:
        growth_ids = [g.request_id for g in request.growths]
    if (
        granted is not None
        and growth_ids is not granted.growth_ids
        and list(growth_ids) != list(granted.growth_ids)
    ):
        return None  # a retry naming other growths than the step it repeats
    ok = AllocationStatus.OK
    index: list[int] = []
    counts: list[int] = []
    pages: list[int] = []
    listed: list[AllocationOutcome] = []
    num_groups = -1
    if num_growths > 0:
        position = {rid: i for i, rid in enumerate(growth_ids)}
        for outcome in outcomes[:num_growths]:
            if outcome.status is not ok:
                listed.append(outcome)
                continue
            i = position.get(outcome.request_id)
            per_group = outcome.new_page_ids
            if i is None or (num_groups >= 0 and len(per_group) != num_groups):
                return None
            num_groups = len(per_group)
            index.append(i)
            for group_pages in per_group:
                counts.append(len(group_pages))
                pages.extend(group_pages)
    if granted is not None:
        if index and num_groups != 1:
            return None  # the state grants columns for one group only
        if not index:
            grants.growth_index = encode_i32(granted.growth_index)
            grants.num_pages = np.ones(len(granted.page_ids), I32).tobytes()
            grants.page_ids = encode_i32(granted.page_ids)
        else:
            # Both kinds, one growth each per entry: merged into growth order, each
            # entry's pages moved with it.
            all_index = np.array(index + granted.growth_index, np.int64)
            all_counts = np.array(counts + [1] * len(granted.page_ids), np.int64)
            all_pages = np.array(pages + granted.page_ids, np.int64)
            order = np.argsort(all_index, kind="stable")
            starts = np.cumsum(all_counts) - all_counts
            sorted_counts = all_counts[order]
            firsts = np.repeat(starts[order], sorted_counts)
            within = np.arange(len(all_pages)) - np.repeat(
                np.cumsum(sorted_counts) - sorted_counts, sorted_counts
            )
            grants.growth_index = encode_i32(all_index[order])
            grants.num_pages = encode_i32(sorted_counts)
            grants.page_ids = encode_i32(all_pages[firsts + within])
    elif index:
        grants.growth_index = encode_i32(index)
        grants.num_pages = encode_i32(counts)
        grants.page_ids = encode_i32(pages)
    listed.extend(outcomes[num_growths:])
    return listed


# -- events and tables ----------------------------------------------------------------------


def event_to_pb(event: KVEvent) -> pb.KVEvent:
    if isinstance(event, PageStored):
        stored = pb.PageStored(
            group_id=event.group_id,
            page_hashes=list(event.page_hashes),
            token_ids=_token_run_i32(event.token_ids),
            page_size=event.page_size,
            page_ids=encode_i32(event.page_ids),
        )
        if event.parent_page_hash is not None:
            stored.parent_page_hash = event.parent_page_hash
        if event.lora_name is not None:
            stored.lora_name = event.lora_name
        if event.extra_keys is not None:
            stored.extra_keys.CopyFrom(extra_keys_to_pb(event.extra_keys))
        stored.first_page_index = event.first_page
        return pb.KVEvent(seq=event.seq, stored=stored)
    if isinstance(event, PageRemoved):
        return pb.KVEvent(
            seq=event.seq,
            removed=pb.PageRemoved(
                group_id=event.group_id,
                page_hashes=list(event.page_hashes),
                page_ids=encode_i32(event.page_ids),
            ),
        )
    if isinstance(event, AllCleared):
        return pb.KVEvent(seq=event.seq, all_cleared=pb.AllCleared())
    raise TypeError(f"unknown event {type(event).__name__}")


def table_to_pb(table: BatchTables) -> pb.PublishedTable:
    block_table = table.block_table
    num_reqs, num_cols = block_table.shape
    return pb.PublishedTable(
        group_id=table.group_id,
        kernel_block_size=table.kernel_block_size,
        block_table=np.ascontiguousarray(block_table).astype(I32, copy=False).tobytes(),
        row_lengths=encode_i32(table.row_lengths),
        slot_mapping=encode_i64(table.slot_mapping),
        num_reqs=num_reqs,
        num_cols=num_cols,
    )
