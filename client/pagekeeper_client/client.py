"""The synchronous pagekeeper client, and the pieces its asyncio twin shares.

A scheduler drives the service with one ``Step`` per scheduling iteration; this client keeps
the service off the per-request path (DESIGN section 3, "The scheduler's hot path")::

    with PagekeeperClient("127.0.0.1:50051") as client:
        client.register("scheduler", name="engine-0")
        first = client.admit("r1", prompt_ids)                 # one call: lookup + allocate
        ...
        # every scheduling step:
        client.free_later(*finished)                          # batched, no call
        for rid in running:
            got = client.allocate_slots(rid, 1, new_token_ids=[last_token[rid]])
            # got.is_local: the pages already cover the token -- answered without a call
        client.step(batch=running)                            # ONE call: all of the above,
                                                              # and the tables are published

What the client mirrors per request (its own requests only)::

    pages[g]       the request's table in group g (null page 0 where a sliding window or
                   chunk dropped a page), as the service holds it once the queue is applied
    num_tokens     tokens known (prompt + appended output)
    num_computed   tokens whose KV is (being) computed

A growth fits locally when, in every group, ``len(pages[g]) >=
required_pages(num_computed + num_new + num_lookahead)``. It costs no call of its own. A
plain decode that fits, drops no page from a window or chunk and completes no page for the
prefix cache changes nothing in the pool: it is held back (``hold_decodes``, default on;
pools without Mamba groups) and its token travels with the request's next growth -- the
decode that completes a page, drops one or takes a new one -- so a decode step on a pool
of 16-token pages sends ~2 of every 16 decodes. Pages, cache entries and events come out
as if every decode had been sent; the service's token counts trail the client's by the
held-back decodes, and a published batch carries the client's counts for those rows
(``Batch.num_computed_tokens``). Any other growth travels in the next step. A growth that
needs a page is queued for the next ``step()`` -- or, with ``sync=True`` (what vLLM's
``allocate_slots`` needs: new block ids or ``None`` at once), sent at once in a step of its
own together with everything queued before it. A client that is its pool's only
scheduler can skip even that call (``defer_page_ids``): it knows how many pages the pool
surely still has, answers "fits" at once and hands the new page ids out with the step.

Order. A ``Step`` applies frees, then growths, then admissions. The client sends queued
operations in call order within each kind, and sends the queue early (``num_ordering_flushes``)
in the rare case where call order and that apply order would differ for the pool: a free after
a growth that takes or releases pages, a page-taking growth after an admission. So the
service's allocations equal, page for page, those of an in-process manager called in the
same order.

Step ids are strictly increasing per client; a step that fails with UNAVAILABLE is retried
with the same id, which the service answers from memory if it had applied it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import operator
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Generic, TypeVar

import grpc
import numpy as np

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc
from pagekeeper_client.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    NotRegisteredError,
    PagekeeperError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    error_from_rpc,
)
from pagekeeper_client.extra_keys import extra_keys_to_pb
from pagekeeper_client.local import LocalChannel
from pagekeeper_client.local import _Channel as _LocalBase
from pagekeeper_client.ring import RingDescriptor, RingGeometry, StepTables, TableArrays
from pagekeeper_client.token_file import read_tokens
from pagekeeper_client.types import (
    EMPTY_PAGES,
    INT32_MAX,
    Admission,
    AllCleared,
    AllocationResult,
    AllocationStatus,
    BackendSpec,
    BlockTable,
    ClientRole,
    ClientStats,
    EventBatch,
    ExtraKeys,
    GroupInfo,
    GroupKind,
    Growth,
    Int32Array,
    KVEvent,
    Limits,
    LookupResult,
    MultiModalKey,
    PageRemoved,
    PageStored,
    PoolConfig,
    PoolCounters,
    PoolInfo,
    Registration,
    SlotAllocation,
    StepResult,
    TokenIds,
    normalize_backends,
)

log = logging.getLogger("pagekeeper_client")


def _load_clientops() -> ModuleType | None:
    """The mirror's decode-step loops in C (built with the package where a C compiler is;
    the Python loops give the same results). ``PAGEKEEPER_NATIVE_CLIENT=0`` keeps Python."""
    if os.environ.get("PAGEKEEPER_NATIVE_CLIENT", "1") == "0":
        return None
    try:
        return importlib.import_module("pagekeeper_client._clientops")
    except ImportError:
        return None


_clientops = _load_clientops()

DEFAULT_ADDRESS = "127.0.0.1:50051"
ADDRESS_ENV = "PAGEKEEPER_GRPC_ADDRESS"
TOKEN_ENV = "PAGEKEEPER_TOKEN"
TOKEN_FILE_ENV = "PAGEKEEPER_TOKEN_FILE"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_KEEPALIVE_S = 30.0
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRY_S = 10.0
"""How long a step keeps retrying while the service is UNAVAILABLE."""
_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
_REFUSAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,  # a newer registration took the id over (generation fence)
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""The codes with which the service refuses a step whole, changing nothing."""


_REFUSED_BEFORE_THE_STEP = frozenset({grpc.StatusCode.ABORTED, grpc.StatusCode.UNAUTHENTICATED})
"""Refusals a service gives before it looks at the step id (a stale generation, a token it
no longer takes): for a step sent again they do not say whether its first send was
applied. (So is a NOT_FOUND for the client itself, which a heartbeat tells apart from one
for a request.)"""


def resend_was_refused(error: BaseException) -> bool:
    """Whether a refusal of a step sent again (same id) proves that neither send changed
    anything: the service answers a step it applied from memory, after checking only the
    caller (see :data:`_REFUSED_BEFORE_THE_STEP`)."""
    return step_was_refused(error) and error.code not in _REFUSED_BEFORE_THE_STEP  # type: ignore[attr-defined]


def step_was_refused(error: BaseException) -> bool:
    """Whether a failed ``Step`` surely changed nothing (the service refused it). Any other
    failure -- no answer before the deadline, a connection that broke, a cancelled call,
    an internal error -- leaves it unknown whether the service applied the step."""
    return isinstance(error, PagekeeperError) and error.code in _REFUSAL_CODES


# What travels over the same-node socket when there is one: the calls a scheduler waits on.
# Registration, heartbeats (another thread) and streams stay on gRPC.
_RESPONSES: dict[str, Any] = {
    "Step": pb.StepResponse,
    "Lookup": pb.LookupResponse,
    "GetBlockTable": pb.GetBlockTableResponse,
    "GetPoolInfo": pb.GetPoolInfoResponse,
}
_LOCAL_METHODS = frozenset(_RESPONSES)
_LOCAL_RETRY_S = 2.0

T = TypeVar("T")


def local_socket_choice(
    local_socket: str | None, interceptors: Sequence[Any]
) -> tuple[str | None, str]:
    """A client's ``local_socket`` argument as (mode, path): mode ``"auto"`` (the path comes
    with the registration), a named path, or None (gRPC only). Interceptors see gRPC calls
    only, so a client that installs some stays on gRPC unless it names a socket itself."""
    if local_socket is not None and not isinstance(local_socket, str):
        raise TypeError("local_socket must be 'auto', a path or None")
    if not local_socket or (local_socket == "auto" and interceptors):
        return None, ""
    return local_socket, "" if local_socket == "auto" else local_socket


# ---------------------------------------------------------------------------------------------
# Channel
# ---------------------------------------------------------------------------------------------


TLS_CA_FILE_ENV = "PAGEKEEPER_TLS_CA_FILE"
TLS_CLIENT_CERT_FILE_ENV = "PAGEKEEPER_TLS_CLIENT_CERT_FILE"
TLS_CLIENT_KEY_FILE_ENV = "PAGEKEEPER_TLS_CLIENT_KEY_FILE"


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """How a client reaches a service that serves TLS (``server.tls_cert_file``).

    ``ca_file``: PEM CA certificates the service's certificate must be signed by (None: the
    system's roots). ``cert_file`` + ``key_file``: this client's certificate, for a service
    that asks for one (``server.tls_client_ca_file``). ``server_name``: the name to check
    the service's certificate against when it is not the address's host."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both cert_file and key_file")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientTLS | None:
        """TLS as ``$PAGEKEEPER_TLS_CA_FILE`` (and ``$PAGEKEEPER_TLS_CLIENT_CERT_FILE`` +
        ``$PAGEKEEPER_TLS_CLIENT_KEY_FILE``) describe it; None when the CA file is unset."""
        environ = os.environ if environ is None else environ
        ca_file = environ.get(TLS_CA_FILE_ENV) or None
        if ca_file is None:
            return None
        return cls(
            ca_file=ca_file,
            cert_file=environ.get(TLS_CLIENT_CERT_FILE_ENV) or None,
            key_file=environ.get(TLS_CLIENT_KEY_FILE_ENV) or None,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials (the files read now: a missing one raises OSError)."""

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def resolve_tls(tls: ClientTLS | bool | None) -> ClientTLS | None:
    """A client's ``tls`` argument: a :class:`ClientTLS`, True (TLS with the system's
    roots), False (plaintext), or None (``ClientTLS.from_env()``: plaintext unless
    ``$PAGEKEEPER_TLS_CA_FILE`` is set)."""
    if tls is None:
        return ClientTLS.from_env()
    if tls is True:
        return ClientTLS()
    if tls is False:
        return None
    if not isinstance(tls, ClientTLS):
        raise TypeError("tls must be a ClientTLS, True, False or None")
    return tls


def channel_setup(
    tls: ClientTLS | bool | None,
    *,
    max_message_bytes: int,
    keepalive_s: float,
    options: Sequence[tuple[str, Any]],
) -> tuple[ClientTLS | None, list[tuple[str, Any]]]:
    """A client's resolved TLS (:func:`resolve_tls`) and its channel arguments."""
    resolved = resolve_tls(tls)
    extra = [*options, *(resolved.channel_options() if resolved is not None else ())]
    opts = channel_options(
        max_message_bytes=max_message_bytes, keepalive_s=keepalive_s, extra=extra
    )
    return resolved, opts


def resolve_address(address: str | None) -> str:
    """``address``, else ``$PAGEKEEPER_GRPC_ADDRESS``, else ``127.0.0.1:50051``."""
    return address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def channel_options(
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    extra: Sequence[tuple[str, Any]] = (),
) -> list[tuple[str, Any]]:
    """Channel arguments: message size limits both ways, and a keepalive ping every 30 s
    even when idle (the service accepts pings every 10 s; a leased client must notice a dead
    connection before its lease runs out)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after a service restart (the default backoff starts at 1 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    options.extend(extra)
    return options


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def token_source(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """The token a client presents when given none, and the file it came from:
    ``$PAGEKEEPER_TOKEN`` (no file), else the first token listed in the file
    ``$PAGEKEEPER_TOKEN_FILE`` names (the service's format:
    :mod:`pagekeeper_client.token_file`), else
    ``(None, None)``. Raises ValueError when both variables are set, or the file cannot be
    read or lists no token."""
    env = os.environ if environ is None else environ
    token, path = env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV)
    if token and path:
        raise ValueError(f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
    if token:
        return token, None
    if not path:
        return None, None
    return read_first_token(path), path


def read_first_token(path: str) -> str:
    """The first token a token file lists (ValueError naming the variable, the file and the
    problem otherwise)."""
    try:
        return read_tokens(path)[0]
    except ValueError as exc:
        raise ValueError(f"{TOKEN_FILE_ENV}: {exc}") from None


def default_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The token of :func:`token_source`."""
    return token_source(environ)[0]


def reread_token_file(path: str | None, current: str | None) -> str | None:
    """After an UNAUTHENTICATED answer: the first token of the client's token file when it
    differs from ``current`` (the call is then worth one more try with it), else None."""
    if path is None:
        return None
    try:
        token = read_first_token(path)
    except ValueError as exc:
        log.warning("cannot take a new token: %s", exc)
        return None
    if token == current:
        return None
    log.info("using the new first token of %s", path)
    return token


# ---------------------------------------------------------------------------------------------
# Wire conversion (the only place that knows protobuf besides the stubs)
# ---------------------------------------------------------------------------------------------

_LITTLE_ENDIAN = sys.byteorder == "little"
_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")

_GROUP_KIND_FROM_PB = {
    pb.GROUP_KIND_FULL: GroupKind.FULL,
    pb.GROUP_KIND_SLIDING_WINDOW: GroupKind.SLIDING_WINDOW,
    pb.GROUP_KIND_CHUNKED_LOCAL: GroupKind.CHUNKED_LOCAL,
    pb.GROUP_KIND_MAMBA: GroupKind.MAMBA,
}
_ROLE_TO_PB = {
    ClientRole.SCHEDULER: pb.CLIENT_ROLE_SCHEDULER,
    ClientRole.WORKER: pb.CLIENT_ROLE_WORKER,
}
_STATUS_FROM_PB = {
    pb.ALLOCATION_STATUS_OK: AllocationStatus.OK,
    pb.ALLOCATION_STATUS_NO_CAPACITY: AllocationStatus.NO_CAPACITY,
    pb.ALLOCATION_STATUS_REJECTED: AllocationStatus.REJECTED,
}
_RING_KIND_FROM_PB = {
    pb.RING_KIND_SHM: "shm",
    pb.RING_KIND_CUDA_IPC: "cuda_ipc",
    pb.RING_KIND_CPU_IPC: "cpu_ipc",
    pb.RING_KIND_STREAM: "stream",
}


@functools.lru_cache(maxsize=1024)
def _int32s(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}i")


def encode_i32(values: TokenIds | Iterable[int]) -> bytes:
    """Raw little-endian int32 bytes (the wire's array encoding)."""
    if isinstance(values, np.ndarray):
        dtype = values.dtype
        if dtype.kind not in "iu":
            raise InvalidArgumentError(f"token ids must be ints that fit in int32, not {dtype}")
        # A wider array is cast only when every value fits (a cast would wrap silently).
        is_wider = dtype.itemsize > 4 or (dtype.kind == "u" and dtype.itemsize == 4)
        if (
            is_wider
            and values.size
            and not -INT32_MAX - 1 <= values.min() <= values.max() <= INT32_MAX
        ):
            raise InvalidArgumentError("token ids must be ints that fit in int32")
        return values.astype(_I32, copy=False).tobytes()
    if not isinstance(values, list | tuple):
        values = list(values)
    # One struct pack (its format cached per length) converts and range-checks in C:
    # 2.5x cheaper than array.array for a prompt, 5x cheaper than numpy for a list.
    try:
        return _int32s(len(values)).pack(*values)
    except struct.error:
        raise InvalidArgumentError("token ids must be ints that fit in int32") from None


def _check_int32(name: str, value: object, low: int = 0, where: str = "") -> int:
    """``value`` as an int in [``low``, 2**31 - 1] (the wire's int32 fields), else
    InvalidArgumentError naming the field (before anything is queued or mirrored)."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{where}{name} must be an int, got {value!r}") from None
    if not low <= number <= INT32_MAX:
        raise InvalidArgumentError(f"{where}{name} must be in [{low}, 2**31 - 1], got {number}")
    return number


def decode_i32(data: bytes) -> Int32Array:
    """Read-only int32 view of raw little-endian bytes (no copy)."""
    if not data:
        return EMPTY_PAGES
    if len(data) % 4:
        raise InternalError(f"the service sent {len(data)} bytes for an int32 array")
    if _LITTLE_ENDIAN:
        return np.frombuffer(data, dtype=np.int32)  # the wire's own layout: a view
    out: Int32Array = np.frombuffer(data, dtype=_I32).astype(np.int32)
    return out


def pool_from_pb(msg: pb.PoolConfig) -> PoolConfig:
    return PoolConfig(
        num_pages=msg.num_pages,
        groups=tuple(
            GroupInfo(
                group_id=g.group_id,
                kind=_GROUP_KIND_FROM_PB.get(g.kind, GroupKind.FULL),
                page_size=g.page_size,
                window=g.window,
                chunk=g.chunk,
                enable_state_caching=g.enable_state_caching,
                name=g.name,
            )
            for g in msg.groups
        ),
        enable_prefix_caching=msg.enable_prefix_caching,
        hash_algorithm=msg.hash_algorithm,
        max_model_len=msg.max_model_len,
        page_hash_size=msg.page_hash_size,
        accepts_growth_page_hashes=msg.accepts_growth_page_hashes,
    )


def limits_from_pb(msg: pb.Limits) -> Limits:
    return Limits(
        max_requests_per_step=msg.max_requests_per_step,
        max_tokens_per_step=msg.max_tokens_per_step,
        max_clients=msg.max_clients,
        max_message_bytes=msg.max_message_bytes,
        lease_ttl_s=msg.lease_ttl_ms / 1000.0,
    )


def counters_from_pb(msg: pb.PoolCounters) -> PoolCounters:
    return PoolCounters(
        num_free_pages=msg.num_free_pages,
        num_used_pages=msg.num_used_pages,
        num_cached_pages=msg.num_cached_pages,
        num_free_cached_pages=msg.num_free_cached_pages,
        num_requests=msg.num_requests,
        usage=msg.usage,
        prefix_queries_tokens=msg.prefix_queries_tokens,
        prefix_hits_tokens=msg.prefix_hits_tokens,
        prefix_queries_requests=msg.prefix_queries_requests,
        prefix_hits_requests=msg.prefix_hits_requests,
        prefix_hit_rate=msg.prefix_hit_rate,
        num_evictions=msg.num_evictions,
        num_allocated_pages_total=msg.num_allocated_pages_total,
        num_freed_pages_total=msg.num_freed_pages_total,
        num_no_capacity=msg.num_no_capacity,
        num_steps=msg.num_steps,
        num_published=msg.num_published,
        num_clients=msg.num_clients,
        last_event_seq=msg.last_event_seq,
    )


def ring_from_pb(msg: pb.RingDescriptor) -> RingDescriptor:
    """The client-side descriptor a table view opens (validated by the transport)."""
    geometry = msg.geometry
    return RingDescriptor(
        kind=_RING_KIND_FROM_PB.get(msg.kind, "unspecified"),
        generation=msg.generation,
        geometry=RingGeometry(
            depth=geometry.depth,
            max_num_reqs=geometry.max_num_reqs,
            max_num_tokens=geometry.max_num_tokens,
            tables=tuple(
                (t.group_id, t.kernel_block_size, t.max_kernel_blocks_per_row)
                for t in geometry.tables
            ),
        ),
        size_bytes=msg.size_bytes,
        layout_version=msg.layout_version,
        path=msg.path,
        device=msg.device,
        gpu_uuid=msg.gpu_uuid,
        ipc_handle=msg.ipc_handle,
        event_handles=tuple(msg.event_handles),
        offset=msg.offset,
        exporter_pid=msg.exporter_pid,
        dtype=msg.dtype or "uint8",
        ref_counter_handle=msg.ref_counter_handle,
        ref_counter_offset=msg.ref_counter_offset,
    )


def registration_from_pb(msg: pb.RegisterClientResponse) -> Registration:
    return Registration(
        client_id=msg.client_id,
        generation=msg.generation,
        lease_ttl_s=msg.lease_ttl_ms / 1000.0,
        pool=pool_from_pb(msg.pool),
        limits=limits_from_pb(msg.limits),
        last_step_id=msg.last_step_id,
        last_published_step_seq=msg.last_published_step_seq,
        kernel_block_sizes=tuple(
            k.kernel_block_size for k in sorted(msg.kernel_block_sizes, key=lambda k: k.group_id)
        ),
        ring=ring_from_pb(msg.ring) if msg.HasField("ring") else None,
        local_socket=msg.local_socket,
        local_ticket=msg.local_ticket,
        state_id=msg.state_id,
        request_ids=tuple(msg.request_ids),
    )


def local_ticket(registration: Registration | None) -> tuple[str, str] | None:
    """``(client id, ticket)`` for the same-node socket's hello when the registration has
    one (mutual TLS), else None."""
    if registration is None or not registration.local_ticket:
        return None
    return registration.client_id, registration.local_ticket


def extra_keys_from_pb(msg: pb.ExtraKeys) -> ExtraKeys:
    return ExtraKeys(
        lora_name=msg.lora_name if msg.HasField("lora_name") else None,
        lora_path=msg.lora_path if msg.HasField("lora_path") else None,
        mm_inputs=tuple(
            MultiModalKey(identifier=m.identifier, offset=m.offset, length=m.length)
            for m in msg.mm_inputs
        ),
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
    )


def kernel_support_to_pb(
    backends_per_group: Mapping[int, Sequence[BackendSpec]] | Sequence[Sequence[BackendSpec]],
) -> list[pb.GroupKernelSupport]:
    return [
        pb.GroupKernelSupport(
            group_id=group_id,
            backends=[
                pb.KernelBackend(
                    name=b.name, block_sizes=list(b.block_sizes), multiple_of=list(b.multiple_of)
                )
                for b in backends
            ],
        )
        for group_id, backends in sorted(normalize_backends(backends_per_group).items())
    ]


def result_from_pb(msg: pb.AllocationResult) -> AllocationResult:
    return AllocationResult(
        request_id=msg.request_id,
        status=_STATUS_FROM_PB.get(msg.status, AllocationStatus.REJECTED),
        num_cached_tokens=msg.num_cached_tokens,
        new_page_ids=tuple(map(decode_i32, msg.new_page_ids)),
        hit_page_ids=tuple(map(decode_i32, msg.hit_page_ids)),
        reason=msg.reason,
    )


def lookup_from_pb(msg: pb.LookupResponse) -> LookupResult:
    return LookupResult(
        num_hit_tokens=msg.num_hit_tokens,
        page_ids=tuple(decode_i32(b) for b in msg.page_ids),
        page_hashes=tuple(msg.page_hashes),
    )


def block_table_from_pb(msg: pb.GetBlockTableResponse) -> BlockTable:
    return BlockTable(
        request_id=msg.request_id,
        group_id=msg.group_id,
        page_size=msg.page_size,
        kernel_block_size=msg.kernel_block_size,
        page_ids=decode_i32(msg.page_ids),
        kernel_block_ids=decode_i32(msg.kernel_block_ids),
        num_tokens=msg.num_tokens,
        num_computed_tokens=msg.num_computed_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        owner=msg.owner,
    )


def event_from_pb(msg: pb.KVEvent) -> KVEvent:
    which = msg.WhichOneof("event")
    if which == "stored":
        s = msg.stored
        return PageStored(
            seq=msg.seq,
            group_id=s.group_id,
            page_hashes=tuple(s.page_hashes),
            parent_page_hash=s.parent_page_hash if s.HasField("parent_page_hash") else None,
            token_ids=decode_i32(s.token_ids),
            page_size=s.page_size,
            page_ids=decode_i32(s.page_ids),
            lora_name=s.lora_name if s.HasField("lora_name") else None,
            extra_keys=extra_keys_from_pb(s.extra_keys) if s.HasField("extra_keys") else None,
            first_page_index=s.first_page_index,
        )
    if which == "removed":
        r = msg.removed
        return PageRemoved(
            seq=msg.seq,
            group_id=r.group_id,
            page_hashes=tuple(r.page_hashes),
            page_ids=decode_i32(r.page_ids),
        )
    return AllCleared(seq=msg.seq)


def event_batch_from_pb(msg: pb.WatchEventsResponse) -> EventBatch:
    return EventBatch(
        events=tuple(event_from_pb(e) for e in msg.events),
        fell_behind=msg.fell_behind,
        first_retained_seq=msg.first_retained_seq,
        last_event_seq=msg.last_event_seq,
    )


def _role(role: ClientRole | str) -> ClientRole:
    try:
        return ClientRole(role)
    except ValueError:
        raise InvalidArgumentError(f"role must be 'scheduler' or 'worker', got {role!r}") from None


def register_request(
    role: ClientRole | str,
    *,
    name: str,
    client_id: str,
    lease_ttl: float | None,
    device: str,
    kernel_support: Mapping[int, Sequence[BackendSpec]] | Sequence[Sequence[BackendSpec]] | None,
    fresh_kv_cache: bool = False,
) -> pb.RegisterClientRequest:
    role = _role(role)
    if lease_ttl is not None and not lease_ttl >= 0:
        raise InvalidArgumentError(f"lease_ttl must be >= 0 seconds, got {lease_ttl}")
    return pb.RegisterClientRequest(
        role=_ROLE_TO_PB[role],
        name=name,
        client_id=client_id,
        lease_ttl_ms=0 if lease_ttl is None else max(1, round(lease_ttl * 1000)),
        device=device,
        kernel_support=kernel_support_to_pb(kernel_support) if kernel_support else [],
        fresh_kv_cache=fresh_kv_cache,
    )


def default_client_name(role: ClientRole | str) -> str:
    import socket

    return f"{ClientRole(role).value}@{socket.gethostname()}:{os.getpid()}"


# ---------------------------------------------------------------------------------------------
# The scheduler's mirror and queue (no I/O: shared by the sync and asyncio clients)
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Tracked:
    """The client's view of one of its running requests, as the service will hold it once
    the queue is applied."""

    num_tokens: int
    num_computed_tokens: int
    pages: list[list[int]]
    pending: _PendingGrowth | None = None
    held: bytes = b""
    """Tokens of held-back decodes (int32 LE): counted here, not yet sent. Each needed
    nothing from the service; they travel with the request's next growth."""
    is_revoked: bool = False
    """An admin freed it on the service (``revoked_request_ids``): its pages are gone."""


@dataclass(slots=True, eq=False)
class _PendingGrowth:
    request_id: str
    token_bytes: bytes
    num_computed_tokens: int
    num_new_tokens: int
    num_lookahead_tokens: int
    needs_pages: bool
    """Some group needs a page the request does not hold."""
    num_pages_needed: int
    """How many (summed over groups) -- what it takes from the pool's free pages."""
    releases_pages: bool
    """A sliding window / chunk drops pages (they return to the pool when applied)."""
    prev_num_tokens: int
    prev_num_computed_tokens: int
    nulled: list[tuple[int, int, int]]
    """(group, index, page) set to the null page when the growth was planned."""
    tracked: _Tracked | None = None
    """The mirror entry it was planned on."""
    is_local: bool = False
    is_deferred: bool = False
    """Answered OK at once from the capacity bound; its page ids come with the step."""
    is_sync: bool = False
    """Answered to its own caller (not carried into the next explicit step's results)."""
    result: AllocationResult | None = None
    is_computed_given: bool = False
    """The caller named ``num_computed_tokens`` (else the mirror's count was used)."""
    is_plain: bool = False
    """A plain decode: one token, one new slot, the tracked computed count, no lookahead
    (every count column of the wire form takes its default; it may carry page hashes)."""
    is_held: bool = False
    """Held back (not queued): a decode that needs no page and completes none."""
    prev_held: bytes = b""
    """The request's held-back tokens before it (``token_bytes`` starts with them)."""
    page_hashes: tuple[bytes, ...] = ()
    """The caller's hashes of the pages its tokens complete (checked; never held back)."""

    @property
    def mutates_pool(self) -> bool:
        return self.needs_pages or self.releases_pages


@dataclass(slots=True, eq=False)
class _PendingAdmission:
    request_id: str
    message: pb.Admission
    num_tokens: int
    num_new_tokens: int
    num_pages_bound: int = 0
    """Most free pages it can take (every page of its tokens; a hit only takes fewer)."""
    is_sync: bool = False
    result: AllocationResult | None = None


@dataclass(slots=True, eq=False)
class _PendingFree:
    request_id: str
    tracked: _Tracked | None


def _int32_column(values: list[int], default: int) -> bytes:
    """A per-growth column; empty when every value is the column's default."""
    if values.count(default) == len(values):
        return b""
    return encode_i32(values)


_IS_PLAIN = operator.attrgetter("is_plain")

MAX_GROWTH_PAGE_HASH_SIZE = 64
"""Most bytes in one page hash of a growth (the service's limit on a packed hash's size)."""


def growth_columns(
    growths: Sequence[_PendingGrowth], *, page_hash_size: int | None = None
) -> pb.GrowthColumns:
    """The queued growths in column form: a decode step of hundreds of requests becomes
    their ids and one token array (the service applies its plain decodes in one call).
    ``page_hash_size``: some growth carries page hashes, every one of this size (0: the
    service's own; see :meth:`SchedulerState.prepare_step`); None: none is looked for."""
    request_ids = [g.request_id for g in growths]
    new_token_ids = b"".join([g.token_bytes for g in growths])
    if all(map(_IS_PLAIN, growths)):
        # A decode step: every other count column is its default (one C-level pass to
        # know it); the service applies it as plain decodes, page hashes or not.
        columns = pb.GrowthColumns(request_ids=request_ids, new_token_ids=new_token_ids)
    else:
        columns = pb.GrowthColumns(
            request_ids=request_ids,
            new_token_ids=new_token_ids,
            num_new_token_ids=_int32_column([len(g.token_bytes) // 4 for g in growths], 1),
            num_new_tokens=_int32_column([g.num_new_tokens for g in growths], 1),
            # The mirror's computed count is the service's tracked one; it is sent only
            # when a caller named one (the service treats a count equal to its own as a
            # plain decode).
            num_computed_tokens=(
                _int32_column(
                    [g.num_computed_tokens if g.is_computed_given else -1 for g in growths], -1
                )
            ),
            num_lookahead_tokens=_int32_column([g.num_lookahead_tokens for g in growths], 0),
        )
    if page_hash_size is not None:
        columns.num_page_hashes = _int32_column([len(g.page_hashes) for g in growths], 0)
        columns.packed_page_hashes = b"".join([h for g in growths for h in g.page_hashes])
        columns.page_hash_size = page_hash_size
    return columns


def growth_message(growth: _PendingGrowth, pool_hash_size: int) -> pb.Growth:
    """One queued growth as a ``Growth`` message (in a step whose growths' page hashes are
    not all of one size, which the columns need), its hashes packed with their size (left
    0 when it is the service's own, ``pool_hash_size``)."""
    message = pb.Growth(
        request_id=growth.request_id,
        num_new_tokens=growth.num_new_tokens,
        new_token_ids=growth.token_bytes,
        num_lookahead_tokens=growth.num_lookahead_tokens,
    )
    if growth.is_computed_given:  # as the column's -1: unset is the service's own count
        message.num_computed_tokens = growth.num_computed_tokens
    hashes = growth.page_hashes
    if hashes:
        message.packed_page_hashes = b"".join(hashes)
        if len(hashes[0]) != pool_hash_size:
            message.page_hash_size = len(hashes[0])
    return message


@dataclass(slots=True)
class PreparedStep:
    """A built ``StepRequest`` and the queue entries it carries (for applying the answer)."""

    request: pb.StepRequest
    frees: list[_PendingFree]
    growths: list[_PendingGrowth]
    admissions: list[_PendingAdmission]
    explicit: bool = True
    """Sent by ``step()``/``flush()``/``free()``; otherwise sent early (a synchronous call
    or an ordering flush), and the answers to queued operations are carried over."""


def _carries(step: PreparedStep | None, entry: _PendingAdmission | _PendingGrowth) -> bool:
    """Whether ``step`` carries this very queue entry (by identity)."""
    if step is None:
        return False
    sent: list[Any] = step.admissions if isinstance(entry, _PendingAdmission) else step.growths
    return any(e is entry for e in sent)


@dataclass(slots=True)
class _DecodePlan:
    """A planned decode step: the queue entries, and the held-back decodes (already counted
    in the mirror) that ``unplan_decodes`` takes back."""

    growths: list[_PendingGrowth]
    held: list[_Tracked]
    revoked: list[str] = field(default_factory=list)
    """Rows of requests an admin freed: planned as nothing, answered NO_CAPACITY."""
    has_page_hashes: bool = False
    """Some growth carries page hashes."""


def _unhold(held: Sequence[_Tracked]) -> None:
    """Take back held-back decodes (one token each), newest first."""
    for t in reversed(held):
        t.num_tokens -= 1
        t.num_computed_tokens -= 1
        t.held = t.held[:-4]


@dataclass(frozen=True, slots=True)
class RequestView:
    """One tracked request as the client mirrors it (read-only copies)."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int
    page_ids: tuple[Int32Array, ...]
    is_pending: bool
    """Queued operations for it are not yet applied by the service."""
    num_held_tokens: int = 0
    """Tokens of held-back decodes: counted here, sent with the request's next growth (the
    service's counts trail this view's by as many)."""


def put_page_hashes(
    message: pb.Admission | pb.LookupRequest, page_hashes: Sequence[bytes], width: int
) -> None:
    """Client page hashes into ``message``: packed end to end (``packed_page_hashes``, one
    field the service checks in one pass and keeps packed) when the service said its
    page-hash size (``width``) and every hash has it, else a field each."""
    if width and all(type(h) is bytes and len(h) == width for h in page_hashes):
        message.packed_page_hashes = b"".join(page_hashes)
    else:
        message.page_hashes.extend(page_hashes)


class SchedulerState:
    """Requests the client owns, and the queue of operations for the next step.

    Pure bookkeeping: the clients call ``plan_*`` / ``queue_*`` to decide what needs a call,
    ``prepare_step`` to build the wire message and ``apply_step`` with the answer.
    Not thread-safe: one scheduler thread (or one event loop) drives it.
    """

    def __init__(self, pool: PoolConfig, *, hold_decodes: bool = True) -> None:
        self.pool = pool
        self.groups = pool.groups
        self.max_model_len = pool.max_model_len
        self.page_hash_size = pool.page_hash_size
        """Bytes in one page hash (0: the service takes them one field each)."""
        # The service hashes pages of the smallest page size (a larger page is named by the
        # last such hash inside it): a growth's page hashes count those pages.
        self._hash_page_size = min(g.page_size for g in pool.groups)
        # Whether some queued growth carries page hashes: only then does a step look for
        # them (a decode step with none builds its columns as it always did).
        self._has_growth_hashes = False
        self._is_simple = len(pool.groups) == 1 and pool.groups[0].kind is GroupKind.FULL
        self._page_size0 = pool.groups[0].page_size
        # Hold back plain decodes that change nothing in the pool (no page needed, none
        # released by a window or chunk, none completed for the prefix cache) and send their
        # tokens with the request's next growth: a decode step then carries only the few of
        # its requests that take, drop or complete a page. Pools with Mamba groups send every
        # decode (their state pages follow other rules).
        self.hold_decodes = hold_decodes and all(
            g.kind in (GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL)
            for g in pool.groups
        )
        # The service caches a hybrid request's pages only up to a multiple of every group's
        # page size: a decode completes a page for the cache when it reaches one.
        self._cache_alignment = math.lcm(*(g.page_size for g in pool.groups))
        # Requests with a decode held back since the last answered step, one entry per decode
        # (what discard_queued takes back).
        self._held: list[_Tracked] = []
        self.requests: dict[str, _Tracked] = {}
        self._frees: list[_PendingFree] = []
        self._growths: list[_PendingGrowth] = []
        self._admissions: list[_PendingAdmission] = []
        self._admitting: dict[str, _PendingAdmission] = {}
        self._freeing: set[str] = set()
        self.revoked: set[str] = set()
        """Ids of running requests an admin freed, as the service said
        (``revoked_request_ids``; the mark is the request's own, so a free or a new
        admission under the id ends it): their ``allocate_slots`` is answered NO_CAPACITY
        here until they are freed. A hint: an id may outlive its mark."""
        # Answers to queued operations that a synchronous call's step carried early; they
        # are reported by the next step()/flush() (callers look for them there).
        self._carried: list[AllocationResult] = []
        self.num_free_pages: int | None = None
        """The service's free-page count in the last step's answer."""
        self.free_pages_bound: int | None = None
        """Free pages the pool surely still has once the queue is applied: the service's
        count after the last step, minus the most the queued operations can take (frees
        are not counted back). Exact only while this client is the pool's one scheduler."""

    # -- queries -------------------------------------------------------------------------
    @property
    def has_queued(self) -> bool:
        return bool(self._frees or self._growths or self._admissions)

    @property
    def num_queued(self) -> int:
        return len(self._frees) + len(self._growths) + len(self._admissions)

    def view(self, request_id: str) -> RequestView:
        t = self.requests.get(request_id)
        if t is None:
            raise NotFoundError(self._missing(request_id))
        return RequestView(
            request_id,
            t.num_tokens,
            t.num_computed_tokens,
            tuple(np.array(p, dtype=np.int32) for p in t.pages),
            t.pending is not None,
            len(t.held) // 4,
        )

    def _missing(self, request_id: str) -> str:
        if request_id in self._admitting:
            return (
                f"request {request_id!r} is queued for admission; its pages are known after "
                "the next step()"
            )
        return f"request {request_id!r} is not one of this client's running requests"

    # -- growth -------------------------------------------------------------------------
    def is_revoked(self, request_id: str) -> bool:
        """Whether ``request_id`` is a running request an admin freed."""
        if request_id not in self.revoked:
            return False
        t = self.requests.get(request_id)
        return t is not None and t.is_revoked

    def revoked_answer(self, request_id: str) -> SlotAllocation | None:
        """NO_CAPACITY for a request an admin freed (see :attr:`revoked`), else None."""
        if not self.is_revoked(request_id):
            return None
        return SlotAllocation(
            request_id,
            AllocationStatus.NO_CAPACITY,
            is_local=True,
            reason=f"request {request_id!r} was freed by an admin; preempt it and free it",
        )

    def must_flush_before_growth(self, request_id: str) -> bool:
        """A second growth of the same request, or a growth that may take pages queued after
        an admission (the step would apply it first), needs the queue sent first."""
        t = self.requests.get(request_id)
        if t is not None and t.pending is not None:
            return True
        return request_id in self._admitting

    def plan_growth(
        self,
        request_id: str,
        num_new_tokens: int,
        new_token_ids: TokenIds,
        num_computed_tokens: int | None,
        num_lookahead_tokens: int,
        page_hashes: Sequence[bytes] | None = None,
    ) -> _PendingGrowth:
        """Check a growth like the service would, apply it to the mirror, and return the
        queue entry (not yet queued). ``is_local``: no group needs a new page."""
        t = self.requests.get(request_id)
        if t is None:
            raise NotFoundError(self._missing(request_id))
        if type(num_new_tokens) is not int or num_new_tokens < 1:
            raise InvalidArgumentError(
                f"request {request_id!r}: num_new_tokens must be an int >= 1, got "
                f"{num_new_tokens!r}"
            )
        if type(num_lookahead_tokens) is not int or not 0 <= num_lookahead_tokens <= INT32_MAX:
            # Refused before anything is queued: a value the wire cannot carry would stop
            # every later flush.
            _check_int32(
                "num_lookahead_tokens", num_lookahead_tokens, 0, f"request {request_id!r}: "
            )
        token_bytes = encode_i32(new_token_ids) if len(new_token_ids) else b""
        num_tokens = t.num_tokens + len(token_bytes) // 4
        if num_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"request {request_id!r}: {num_tokens} tokens exceed max_model_len "
                f"{self.max_model_len}"
            )
        computed = t.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if not 0 <= computed <= num_tokens:
            raise InvalidArgumentError(
                f"request {request_id!r}: num_computed_tokens {computed} outside [0, {num_tokens}]"
            )
        if computed + num_new_tokens > num_tokens + num_lookahead_tokens:
            raise InvalidArgumentError(
                f"request {request_id!r}: {computed} computed + {num_new_tokens} new tokens "
                f"exceed its {num_tokens} tokens"
            )
        if computed + num_new_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"request {request_id!r}: {computed} computed + {num_new_tokens} new tokens "
                f"exceed max_model_len {self.max_model_len}"
            )
        hashes = self._growth_hashes(request_id, page_hashes, t, num_tokens) if page_hashes else ()
        num_slots = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        nulled: list[tuple[int, int, int]] = []
        if self._is_simple:
            # The common case, kept cheap: one full-attention group.
            num_needed = -(-num_slots // self._page_size0) - len(t.pages[0])
        else:
            num_needed = 0
            for g, group in enumerate(self.groups):
                pages = t.pages[g]
                num_needed += max(group.num_required_pages(num_slots) - len(pages), 0)
                skipped = group.num_skipped_tokens(computed) // group.page_size
                # The service walks back from the last skipped page to the first null one.
                for i in range(min(skipped, len(pages)) - 1, -1, -1):
                    if pages[i] == 0:
                        break
                    nulled.append((g, i, pages[i]))
                    pages[i] = 0
        needs = num_needed > 0
        is_decode = num_new_tokens == 1 and len(token_bytes) == 4 and num_computed_tokens is None
        is_held = (
            is_decode
            and not needs
            and not nulled
            and self.hold_decodes
            and not self._completes(computed)
            # Hashes name pages its tokens complete: the service must get them now.
            and not hashes
        )
        prev_held = t.held
        if prev_held:
            # The held-back decodes travel with this growth: their tokens first, and the
            # computed count as the mirror has it (theirs included), so the service's
            # last-scheduled tokens are this growth's own.
            token_bytes = prev_held + token_bytes
        growth = _PendingGrowth(
            request_id=request_id,
            token_bytes=token_bytes,
            num_computed_tokens=computed,
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            needs_pages=needs,
            num_pages_needed=max(num_needed, 0),
            releases_pages=bool(nulled),
            prev_num_tokens=t.num_tokens,
            prev_num_computed_tokens=t.num_computed_tokens,
            nulled=nulled,
            tracked=t,
            is_local=not needs,
            is_computed_given=num_computed_tokens is not None or bool(prev_held),
            is_plain=is_decode and not prev_held and num_lookahead_tokens == 0,
            is_held=is_held,
            prev_held=prev_held,
            page_hashes=hashes,
        )
        t.num_tokens = num_tokens
        t.num_computed_tokens = computed + num_new_tokens
        t.pending = growth
        t.held = token_bytes if is_held else b""
        return growth

    def _growth_hashes(
        self, request_id: str, page_hashes: Sequence[bytes], t: _Tracked, num_tokens: int
    ) -> tuple[bytes, ...]:
        """A growth's page hashes, checked as the service checks them: bytes of one size
        (they travel packed) in [1, 64], none twice, at most one per page (of the hash page
        size) its tokens complete -- the pages from the first full one the service has no
        hash for (its token count, which trails the mirror's by the held-back decodes this
        growth carries) up to ``num_tokens``. (That none equals the request's previous
        page's hash, the service checks.)"""
        where = f"request {request_id!r}: "
        if not self.pool.accepts_growth_page_hashes:
            raise UnimplementedError(
                f"{where}this service does not take a growth's page hashes (it predates "
                "them and would hash the pages itself); send none"
            )
        hashes = tuple(page_hashes)
        if not all(isinstance(h, bytes) for h in hashes):
            raise InvalidArgumentError(f"{where}page hashes must be bytes")
        size = len(hashes[0])
        if not 0 < size <= MAX_GROWTH_PAGE_HASH_SIZE or any(len(h) != size for h in hashes):
            raise InvalidArgumentError(
                f"{where}a growth's page hashes must all have one size in "
                f"[1, {MAX_GROWTH_PAGE_HASH_SIZE}] bytes (they travel packed), got "
                f"{sorted({len(h) for h in hashes})}"
            )
        if len(set(hashes)) != len(hashes):
            raise InvalidArgumentError(
                f"{where}a page hash repeats in one growth (each hash covers its whole prefix)"
            )
        page_size = self._hash_page_size
        num_full_before = (t.num_tokens - len(t.held) // 4) // page_size
        num_completed = num_tokens // page_size - num_full_before
        if len(hashes) > num_completed:
            raise InvalidArgumentError(
                f"{where}{len(hashes)} page hashes for the {num_completed} pages of "
                f"{page_size} tokens its new tokens complete (pages {num_full_before} on)"
            )
        return hashes

    def _completes(self, computed: int) -> bool:
        """Whether a decode at ``computed`` completes a page the prefix cache takes."""
        return self.pool.enable_prefix_caching and (computed + 1) % self._cache_alignment == 0

    @property
    def num_held_tokens(self) -> int:
        """Tokens of held-back decodes across every request (not yet sent)."""
        return sum(len(t.held) for t in self.requests.values()) // 4

    def queue_held(self) -> int:
        """Queue the held-back decodes of every request as one growth each (no page: they
        fit), so the next step brings the service's counts level with the mirror's.
        Returns how many requests had some."""
        count = 0
        for request_id, t in self.requests.items():
            held = t.held
            if not held or t.pending is not None:
                continue
            if t.is_revoked:
                # Its pages are gone: the tokens are moot (its free will drop them).
                continue
            # Sent as the last held decode with the others' tokens before it: the service's
            # last-scheduled token is the one the last decode scheduled.
            growth = _PendingGrowth(
                request_id,
                held,
                t.num_computed_tokens - 1,
                1,
                0,
                False,
                0,
                False,
                t.num_tokens,
                t.num_computed_tokens,
                [],
                t,
                True,
                is_computed_given=True,
                prev_held=held,
            )
            # The mirror's counts already include them: only the held tokens move.
            t.held = b""
            t.pending = growth
            self._growths.append(growth)
            count += 1
        return count

    def must_flush_before_decodes(self, request_ids: Sequence[str]) -> bool:
        """``must_flush_before_growth`` for a whole decode step."""
        requests, admitting = self.requests, self._admitting
        for request_id in request_ids:
            t = requests.get(request_id)
            if (t is not None and t.pending is not None) or request_id in admitting:
                return True
        return False

    def _checked_decode_rows(
        self, request_ids: Sequence[str], num_lookahead_tokens: int
    ) -> list[_Tracked]:
        """The requests of a decode step, each with room for one more token, else the error
        that refuses the step."""
        requests = self.requests
        tracked = []
        for request_id in request_ids:
            t = requests.get(request_id)
            if t is None:
                raise NotFoundError(self._missing(request_id))
            if t.num_tokens >= self.max_model_len:
                raise InvalidArgumentError(
                    f"request {request_id!r}: {t.num_tokens + 1} tokens exceed max_model_len "
                    f"{self.max_model_len}"
                )
            if t.num_computed_tokens >= self.max_model_len:
                raise InvalidArgumentError(
                    f"request {request_id!r}: {t.num_computed_tokens} computed + 1 new tokens "
                    f"exceed max_model_len {self.max_model_len}"
                )
            if t.num_computed_tokens > t.num_tokens + num_lookahead_tokens:
                # Computed ran ahead (speculative lookahead) and was not set back: as the
                # service would refuse it, before it is queued.
                raise InvalidArgumentError(
                    f"request {request_id!r}: {t.num_computed_tokens} computed + 1 new tokens "
                    f"exceed its {t.num_tokens + 1} tokens"
                )
            tracked.append(t)
        return tracked

    def plan_decodes(
        self,
        request_ids: Sequence[str],
        token_ids: TokenIds,
        num_lookahead_tokens: int,
        page_hashes: Mapping[str, bytes] | None = None,
    ) -> _DecodePlan:
        """``plan_growth(rid, 1, [token], None, lookahead)`` for every request, checked as a
        whole first (nothing planned when one is bad). ``page_hashes``: request id -> the
        hash of the page its token completes, for the rows that complete one."""
        n = len(request_ids)
        if len(token_ids) != n:
            raise InvalidArgumentError(f"{len(token_ids)} token ids for {n} decoding requests")
        num_lookahead_tokens = _check_int32("num_lookahead_tokens", num_lookahead_tokens)
        if page_hashes and not set(page_hashes).issubset(request_ids):
            stray = sorted(set(page_hashes).difference(request_ids))
            raise InvalidArgumentError(f"page hashes for requests that do not decode: {stray}")
        if self.revoked and not self.revoked.isdisjoint(request_ids):
            revoked = [r for r in request_ids if self.is_revoked(r)]
            if revoked:
                # Their pages are gone: nothing to plan; the next step answers them
                # NO_CAPACITY. The other rows are planned (and checked) as always.
                if len(set(request_ids)) != n:
                    raise InvalidArgumentError("a request decodes twice in one call")
                gone = set(revoked)
                rows = [i for i, r in enumerate(request_ids) if r not in gone]
                kept_tokens = (
                    token_ids[rows]
                    if isinstance(token_ids, np.ndarray)
                    else [token_ids[i] for i in rows]
                )
                kept_hashes = (
                    {r: h for r, h in page_hashes.items() if r not in gone} if page_hashes else None
                )
                plan = self.plan_decodes(
                    [request_ids[i] for i in rows], kept_tokens, num_lookahead_tokens, kept_hashes
                )
                plan.revoked = revoked
                return plan
        token_bytes = encode_i32(token_ids)
        requests = self.requests
        # The C check hands back the requests, or the index of a row the Python check must
        # judge (and refuse, with its reason).
        checked = (
            _clientops.check_decodes(
                request_ids, requests, self.max_model_len, num_lookahead_tokens
            )
            if _clientops is not None and type(request_ids) is list
            else None
        )
        tracked: list[_Tracked] = (
            checked
            if type(checked) is list
            else self._checked_decode_rows(request_ids, num_lookahead_tokens)
        )
        if len(set(request_ids)) != n:
            raise InvalidArgumentError("a request decodes twice in one call")
        if not self._is_simple:
            # Row by row (several groups).
            growths: list[_PendingGrowth] = []
            held_back: list[_Tracked] = []
            has_page_hashes = False
            try:
                for i, request_id in enumerate(request_ids):
                    page_hash = page_hashes.get(request_id) if page_hashes else None
                    growth = self.plan_growth(
                        request_id,
                        1,
                        token_ids[i : i + 1],
                        None,
                        num_lookahead_tokens,
                        None if page_hash is None else (page_hash,),
                    )
                    has_page_hashes = has_page_hashes or bool(growth.page_hashes)
                    if growth.is_held:
                        assert growth.tracked is not None
                        growth.tracked.pending = None
                        held_back.append(growth.tracked)
                    else:
                        growths.append(growth)
            except PagekeeperError:
                # Nothing planned when one is refused.
                self.unplan_decodes(_DecodePlan(growths, held_back))
                raise
            return _DecodePlan(growths, held_back, has_page_hashes=has_page_hashes)
        # One full-attention group: plan_growth's arithmetic inline. A decode that needs no
        # page and completes none is held back (no object, no wire entry); the others get a
        # queue entry carrying the request's held-back tokens.
        page_size, max_len = self._page_size0, self.max_model_len
        plain = num_lookahead_tokens == 0
        named: dict[str, tuple[bytes, ...]] = {}
        if page_hashes:
            # Checked before anything is planned: each names the one page its row's token
            # completes (such a row is never held back: the loop below plans it).
            for k, rid in enumerate(request_ids):
                if rid in page_hashes:
                    t = tracked[k]
                    named[rid] = self._growth_hashes(rid, (page_hashes[rid],), t, t.num_tokens + 1)
        hold = self.hold_decodes
        caching = self.pool.enable_prefix_caching
        alignment = self._cache_alignment  # the page size here: _completes, inline
        growths = []
        append = growths.append
        held_back = []
        # The C loop holds back rows in order and plans the others as this loop body does,
        # up to the first row it leaves here (rows naming a page: the C loop holds back).
        plan_rows = _clientops.plan_decodes if _clientops is not None and not named else None
        hold_rows = _clientops.hold_decodes if hold and _clientops is not None else None
        aligned = alignment if caching else 0
        ids = request_ids if type(request_ids) is list else list(request_ids)
        i = 0
        while i < n:
            if plan_rows is not None:
                i = plan_rows(
                    tracked, ids, token_bytes, i, page_size, max_len, num_lookahead_tokens,
                    aligned, held_back, growths, _PendingGrowth, hold,
                )  # fmt: skip
                if i == n:
                    break
            elif hold_rows is not None:
                i = hold_rows(
                    tracked, token_bytes, i, page_size, max_len, num_lookahead_tokens, aligned,
                    held_back,
                )  # fmt: skip
                if i == n:
                    break
            request_id, t = ids[i], tracked[i]
            token = token_bytes[4 * i : 4 * i + 4]
            i += 1
            num_tokens = t.num_tokens
            computed = t.num_computed_tokens
            num_slots = computed + 1 + num_lookahead_tokens
            if num_slots > max_len:
                num_slots = max_len
            num_needed = -(-num_slots // page_size) - len(t.pages[0])
            needs = num_needed > 0
            held = t.held
            if hold and not needs and not (caching and (computed + 1) % alignment == 0):
                t.held = held + token
                t.num_tokens = num_tokens + 1
                t.num_computed_tokens = computed + 1
                held_back.append(t)
                continue
            growth = _PendingGrowth(
                request_id,
                held + token if held else token,
                computed,
                1,
                num_lookahead_tokens,
                needs,
                num_needed if needs else 0,
                False,
                num_tokens,
                computed,
                [],
                t,
                not needs,
                is_computed_given=bool(held),
                is_plain=plain and not held,
                prev_held=held,
            )
            if named:
                growth.page_hashes = named.get(request_id, ())
            t.num_tokens = num_tokens + 1
            t.num_computed_tokens = computed + 1
            t.pending = growth
            t.held = b""
            append(growth)
        return _DecodePlan(growths, held_back, has_page_hashes=bool(named))

    def decodes_need_ordering_flush(self, plan: _DecodePlan) -> bool:
        """A page-taking decode may not overtake a queued admission."""
        return bool(self._admissions) and any(g.needs_pages for g in plan.growths)

    def unplan_decodes(self, plan: _DecodePlan) -> None:
        for growth in reversed(plan.growths):
            self.unplan_growth(growth)
        _unhold(plan.held)

    def queue_decodes(self, plan: _DecodePlan) -> list[str]:
        """Queue planned decodes; returns the ids that need a new page (and those of
        revoked requests, whose NO_CAPACITY comes with the next step's results)."""
        growths = plan.growths
        self._growths.extend(growths)
        self._held.extend(plan.held)
        if plan.has_page_hashes:
            self._has_growth_hashes = True
        need_pages = [g.request_id for g in growths if not g.is_local]
        for request_id in plan.revoked:
            answer = self.revoked_answer(request_id)
            assert answer is not None
            self._carried.append(
                AllocationResult(request_id, AllocationStatus.NO_CAPACITY, reason=answer.reason)
            )
            need_pages.append(request_id)
        if need_pages and self.free_pages_bound is not None:
            self.free_pages_bound -= sum(g.num_pages_needed for g in growths)
        return need_pages

    def growth_needs_ordering_flush(self, growth: _PendingGrowth) -> bool:
        # Growths apply before admissions: one that changes the pool may not overtake one.
        return growth.mutates_pool and bool(self._admissions)

    def unplan_growth(self, growth: _PendingGrowth) -> None:
        """Undo ``plan_growth`` on the mirror (the growth was not sent)."""
        t = self.requests.get(growth.request_id)
        if t is None:
            return
        t.num_tokens = growth.prev_num_tokens
        t.num_computed_tokens = growth.prev_num_computed_tokens
        t.held = growth.prev_held
        for g, i, page in growth.nulled:
            t.pages[g][i] = page
        if t.pending is growth:
            t.pending = None

    def queue_growth(self, growth: _PendingGrowth) -> None:
        if growth.is_held:
            # Nothing to send: its token waits in the mirror for the request's next growth.
            t = growth.tracked
            assert t is not None
            if t.pending is growth:
                t.pending = None
            self._held.append(t)
            return
        self._growths.append(growth)
        if growth.page_hashes:
            self._has_growth_hashes = True
        if growth.num_pages_needed and self.free_pages_bound is not None:
            self.free_pages_bound -= growth.num_pages_needed

    def can_defer(self, growth: _PendingGrowth) -> bool:
        """Whether the pool surely has the growth's pages (before it is queued)."""
        bound = self.free_pages_bound
        return bound is not None and growth.num_pages_needed <= bound

    # -- admission ----------------------------------------------------------------------
    def plan_admission(
        self,
        request_id: str,
        token_ids: TokenIds,
        *,
        num_new_tokens: int,
        extra_keys: ExtraKeys | None,
        page_hashes: Sequence[bytes] | None,
        num_lookahead_tokens: int,
        enable_cache_read: bool,
    ) -> _PendingAdmission:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string")
        if request_id in self.requests or request_id in self._admitting:
            raise AlreadyExistsError(f"request {request_id!r} already holds (or awaits) pages")
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise InvalidArgumentError(f"request {request_id!r}: token_ids must not be empty")
        if num_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"request {request_id!r}: {num_tokens} tokens exceed max_model_len "
                f"{self.max_model_len}"
            )
        if not 0 <= num_new_tokens <= num_tokens:
            raise InvalidArgumentError(
                f"request {request_id!r}: num_new_tokens {num_new_tokens} outside [0, {num_tokens}]"
            )
        _check_int32("num_lookahead_tokens", num_lookahead_tokens, 0, f"request {request_id!r}: ")
        message = pb.Admission(
            request_id=request_id,
            token_ids=encode_i32(token_ids),
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        if extra_keys is not None:
            message.extra_keys.CopyFrom(extra_keys_to_pb(extra_keys))
        if page_hashes:
            put_page_hashes(message, page_hashes, self.page_hash_size)
        if not enable_cache_read:
            message.enable_cache_read = False
        num_slots = min(num_tokens + num_lookahead_tokens, self.max_model_len)
        bound = sum(g.num_required_pages(num_slots) for g in self.groups)
        return _PendingAdmission(request_id, message, num_tokens, num_new_tokens, bound)

    def queue_admission(self, admission: _PendingAdmission) -> None:
        self._admissions.append(admission)
        self._admitting[admission.request_id] = admission
        if self.free_pages_bound is not None:
            self.free_pages_bound -= admission.num_pages_bound

    # -- free ---------------------------------------------------------------------------
    def must_flush_before_free(self, request_id: str) -> bool:
        """Frees apply first in a step: send the queue first if it holds something the free
        must come after (a growth or admission of this request, or anything that takes or
        releases pages)."""
        t = self.requests.get(request_id)
        if t is not None and t.pending is not None:
            return True
        if self._admissions:
            return True
        return any(g.mutates_pool for g in self._growths)

    def queue_free(self, request_id: str) -> None:
        t = self.requests.pop(request_id, None)
        if t is None:
            if request_id in self._freeing:
                raise InvalidArgumentError(f"request {request_id!r} is already queued for free")
            raise NotFoundError(self._missing(request_id))
        self._frees.append(_PendingFree(request_id, t))
        self._freeing.add(request_id)

    # -- steps --------------------------------------------------------------------------
    def prepare_step(
        self,
        *,
        client_id: str,
        generation: int,
        step_id: int,
        batch: Sequence[str] | None,
        num_scheduled_tokens: TokenIds | None,
        explicit: bool = True,
        state_id: str = "",
    ) -> PreparedStep:
        """The ``StepRequest`` carrying the whole queue (and the batch, if any). The queue
        stays as it is until :meth:`apply_step` accepts the answer."""
        growths = self._growths
        request = pb.StepRequest(
            client_id=client_id,
            generation=generation,
            step_id=step_id,
            state_id=state_id,
            free_request_ids=[f.request_id for f in self._frees],
            admissions=[a.message for a in self._admissions],
            grants_in_columns=True,
        )
        if growths:
            if not self._has_growth_hashes:
                request.growth_columns.CopyFrom(growth_columns(growths))
            else:
                self._put_hashed_growths(request, growths)
        if batch is not None:
            b = request.batch
            b.request_ids.extend(batch)
            if num_scheduled_tokens is not None:
                if len(num_scheduled_tokens) != len(batch):
                    raise InvalidArgumentError(
                        f"num_scheduled_tokens has {len(num_scheduled_tokens)} entries for "
                        f"{len(batch)} batch requests"
                    )
                b.num_scheduled_tokens = encode_i32(num_scheduled_tokens)
            if self.hold_decodes:
                # Rows with held-back decodes run ahead of the service's counts: their slot
                # mapping ends at the client's count (-1: the service's own).
                requests = self.requests
                packed = (
                    _clientops.held_ends(requests, batch)
                    if _clientops is not None
                    else NotImplemented
                )
                if packed is NotImplemented:
                    ends = [
                        t.num_computed_tokens if t is not None and t.held else -1
                        for t in map(requests.get, batch)
                    ]
                    if ends.count(-1) != len(ends):
                        b.num_computed_tokens = encode_i32(ends)
                elif packed is not None:
                    b.num_computed_tokens = packed  # (the same bytes, in one C pass)
        return PreparedStep(
            request, list(self._frees), list(growths), list(self._admissions), explicit
        )

    def _put_hashed_growths(self, request: pb.StepRequest, growths: list[_PendingGrowth]) -> None:
        """Growths some of which carry page hashes: in columns when every hash has one
        size (the columns carry one), else as one message each (each growth's hashes have
        one size: :meth:`_growth_hashes`)."""
        pool_size = self.page_hash_size
        sizes = {len(g.page_hashes[0]) for g in growths if g.page_hashes}
        if len(sizes) == 1:
            (size,) = sizes
            request.growth_columns.CopyFrom(
                growth_columns(growths, page_hash_size=0 if size == pool_size else size)
            )
        else:
            request.growths.extend([growth_message(g, pool_size) for g in growths])

    def _note_growths_left(self) -> None:
        """After growths left the queue: whether the rest still carries page hashes."""
        if self._has_growth_hashes:
            self._has_growth_hashes = any(g.page_hashes for g in self._growths)

    def apply_step(self, prepared: PreparedStep, response: pb.StepResponse) -> StepResult:
        """Accept the service's answer: drop the sent entries from the queue and bring the
        mirror to the service's state.

        The service lists only the growths that got pages or were refused (then every
        admission); a growth it does not list succeeded without a new page.
        """
        results = response.results
        num_admissions = len(prepared.admissions)
        num_growth_results = len(results) - num_admissions
        grants = self._grants(prepared, response)
        if not 0 <= num_growth_results + len(grants) <= len(prepared.growths):
            raise InternalError(
                f"the service answered {len(results)} results and {len(grants)} grants for "
                f"{len(prepared.growths)} growths and {num_admissions} admissions"
            )
        self._frees = self._frees[len(prepared.frees) :]
        self._growths = self._growths[len(prepared.growths) :]
        if self._has_growth_hashes:
            self._note_growths_left()
        num_held = len(self._held)
        self._held = []  # what is held back now stays (discard_queued no longer undoes it)
        self._admissions = self._admissions[num_admissions:]
        for f in prepared.frees:
            self._freeing.discard(f.request_id)
            self.revoked.discard(f.request_id)
        requests = self.requests
        out: list[AllocationResult] = []
        num_local = 0
        for growth in prepared.growths:  # the hot loop: one per decode
            t = growth.tracked
            if t is not None and t.pending is growth:
                t.pending = None
            num_local += growth.is_local
        if num_growth_results or grants or num_local < len(prepared.growths):
            num_local -= self._apply_growth_results(
                prepared, results[:num_growth_results], grants, out
            )
        for admission, msg in zip(prepared.admissions, results[num_growth_results:], strict=True):
            self._admitting.pop(admission.request_id, None)
            result = result_from_pb(msg)
            if result.status is AllocationStatus.OK:
                requests[admission.request_id] = self._admitted(admission, result)
                self.revoked.discard(admission.request_id)
            admission.result = result
            if not admission.is_sync:
                out.append(result)
        # What the service has free now, minus what is still queued (a concurrent caller of
        # the asyncio client may have queued more meanwhile).
        self.num_free_pages = response.num_free_pages
        self.free_pages_bound = (
            response.num_free_pages
            - sum(g.num_pages_needed for g in self._growths)
            - sum(a.num_pages_bound for a in self._admissions)
        )
        revoked = tuple(response.revoked_request_ids)
        for request_id in revoked:
            t = requests.get(request_id)
            if t is not None:
                t.is_revoked = True
                self.revoked.add(request_id)
            elif request_id not in self._freeing and request_id not in self._admitting:
                # Not one of this client's (a scheduler that took the id over from another
                # process): nothing to preempt; its free, queued here, acknowledges it.
                self._frees.append(_PendingFree(request_id, None))
                self._freeing.add(request_id)
        if not prepared.explicit:
            self._carried.extend(out)
            out = []
        elif self._carried:
            out = self._carried + out
            self._carried = []
        return StepResult(
            step_id=response.step_id,
            results=tuple(out),
            is_published=response.is_published,
            published_slot=response.published_slot,
            unscheduled_request_ids=tuple(response.unscheduled_request_ids),
            num_free_pages=response.num_free_pages,
            last_event_seq=response.last_event_seq,
            publish_error=response.publish_error,
            is_retry=response.is_retry,
            num_local_growths=num_local + num_held,
            revoked_request_ids=revoked,
        )

    def _grants(
        self, prepared: PreparedStep, response: pb.StepResponse
    ) -> dict[str, AllocationResult]:
        """The growths granted pages, from the answer's columns (``grants_in_columns``):
        three int32 arrays decoded once, one result per growth sliced from them."""
        if not response.HasField("grants"):
            return {}
        columns = response.grants
        index = decode_i32(columns.growth_index)
        counts = decode_i32(columns.num_pages)
        pages = decode_i32(columns.page_ids)
        n = index.shape[0]
        num_groups = len(self.groups)
        growths = prepared.growths
        if (
            counts.shape[0] != n * num_groups
            or int(counts.sum()) != pages.shape[0]
            or (n and (int(index.min()) < 0 or int(index.max()) >= len(growths)))
        ):
            raise InternalError(
                f"the service's grants do not fit: {n} growths, {counts.shape[0]} counts, "
                f"{pages.shape[0]} pages for {len(growths)} growths in {num_groups} groups"
            )
        ends = np.cumsum(counts).tolist()
        starts = [0, *ends[:-1]]
        ok = AllocationStatus.OK
        out: dict[str, AllocationResult] = {}
        k = 0
        for i in index.tolist():
            per_group = tuple(pages[starts[j] : ends[j]] for j in range(k, k + num_groups))
            k += num_groups
            rid = growths[i].request_id
            out[rid] = AllocationResult(rid, ok, 0, per_group)
        if len(out) != n:
            raise InternalError("the service granted pages to one growth twice")
        return out

    def _apply_growth_results(
        self,
        prepared: PreparedStep,
        results: Sequence[pb.AllocationResult],
        grants: dict[str, AllocationResult],
        out: list[AllocationResult],
    ) -> int:
        """The listed growths (new pages, or refused); returns how many of them had been
        answered locally (a refusal of one is counted against the local answers)."""
        listed = {msg.request_id: result_from_pb(msg) for msg in results}
        if grants:
            listed.update(grants)
        num_local_listed = 0
        for growth in prepared.growths:
            found = listed.get(growth.request_id)
            if found is None:
                if not growth.is_local:
                    log.warning(
                        "request %r: the client expected new pages, the service needed none "
                        "(mirror out of step?)",
                        growth.request_id,
                    )
                continue
            num_local_listed += growth.is_local
            growth.result = found
            if not growth.is_sync:
                out.append(found)
            if growth.is_deferred and found.status is not AllocationStatus.OK:
                log.warning(
                    "request %r: a growth answered OK from the capacity bound got %s (another "
                    "scheduler shares the pool?); it must be preempted",
                    growth.request_id,
                    found.status.value,
                )
            t = growth.tracked
            if t is None:
                continue
            if found.status is AllocationStatus.OK:
                for g, pages in enumerate(found.new_page_ids):
                    if pages.shape[0]:
                        t.pages[g].extend(pages.tolist())
            else:
                # Nothing changed for it on the service, except that sliding-window pages
                # were released before the capacity check (as in vLLM). Held-back tokens it
                # carried are held again: the service did not take them.
                t.num_tokens = growth.prev_num_tokens
                t.num_computed_tokens = growth.prev_num_computed_tokens
                t.held = growth.prev_held
                if found.status is AllocationStatus.REJECTED:
                    for g, i, page in growth.nulled:
                        t.pages[g][i] = page
        return num_local_listed

    def to_adopt(self, request_ids: Sequence[str]) -> list[str]:
        """Of the requests a takeover's registration says the id owns, those this client
        does not know (nor is admitting or freeing)."""
        known = self.requests
        return [
            r
            for r in request_ids
            if r not in known and r not in self._admitting and r not in self._freeing
        ]

    def adopt(self, request_id: str, tables: Sequence[BlockTable]) -> None:
        """Track a request this client id owned before a takeover, from its tables (one per
        group, as ``GetBlockTable`` gives them)."""
        first = tables[0]
        self.requests[request_id] = _Tracked(
            first.num_tokens, first.num_computed_tokens, [t.page_ids.tolist() for t in tables]
        )

    def _admitted(self, admission: _PendingAdmission, result: AllocationResult) -> _Tracked:
        num_hit = result.num_cached_tokens
        pages: list[list[int]] = []
        for g, group in enumerate(self.groups):
            hits = result.hit_page_ids[g].tolist() if g < len(result.hit_page_ids) else []
            new = result.new_page_ids[g].tolist() if g < len(result.new_page_ids) else []
            # As the service's save_hits: pages the window no longer needs become null.
            skipped = group.num_skipped_tokens(num_hit) // group.page_size
            table = [0] * skipped + hits[skipped:] if skipped else hits
            pages.append(table + new)
        # As the service: a chunk larger than what the cache hit left is clamped to it.
        rest = admission.num_tokens - num_hit
        num_new = min(admission.num_new_tokens, rest) if admission.num_new_tokens else rest
        return _Tracked(admission.num_tokens, num_hit + num_new, pages)

    def is_queued(self, entry: _PendingAdmission | _PendingGrowth) -> bool:
        """Whether ``entry`` still waits to be sent (not answered yet)."""
        queue: list[Any] = (
            self._admissions if isinstance(entry, _PendingAdmission) else self._growths
        )
        return any(e is entry for e in queue)

    def carry_answer(self, entry: _PendingAdmission | _PendingGrowth) -> None:
        """Hand out an answered synchronous entry's answer with the next results (its call
        raised before it could return it)."""
        result = entry.result
        if result is None:  # a growth answered without pages: it fitted
            result = AllocationResult(entry.request_id, AllocationStatus.OK)
        self._carried.append(result)

    def release_carried(self, result: StepResult) -> StepResult:
        """``result`` (of a step sent early) with the answers carried so far, which it
        hands out (as the next explicit step's result would)."""
        carried, self._carried = self._carried, []
        return replace(result, results=tuple(carried))

    def withdraw_growth(self, growth: _PendingGrowth) -> None:
        """Take a queued growth back (its synchronous step failed as a whole)."""
        if growth in self._growths:
            self._growths.remove(growth)
            self._note_growths_left()
            self.unplan_growth(growth)
            if self.free_pages_bound is not None:
                self.free_pages_bound += growth.num_pages_needed

    def withdraw_admission(self, admission: _PendingAdmission) -> None:
        """Take a queued admission back (its synchronous step failed as a whole)."""
        if admission in self._admissions:
            self._admissions.remove(admission)
            self._admitting.pop(admission.request_id, None)
            if self.free_pages_bound is not None:
                self.free_pages_bound += admission.num_pages_bound

    def discard_queued(self) -> int:
        """Drop every queued operation and undo what it did to the mirror; returns how many
        were dropped. For a step the service refused as a whole (INVALID_ARGUMENT...)."""
        count = self.num_queued
        for growth in reversed(self._growths):
            self.unplan_growth(growth)
        _unhold(self._held)
        self._held = []
        for f in self._frees:
            if f.tracked is not None:
                self.requests[f.request_id] = f.tracked
        self._frees, self._growths, self._admissions = [], [], []
        self._has_growth_hashes = False
        self._admitting.clear()
        self._freeing.clear()
        self._carried.clear()
        self.free_pages_bound = None  # unknown until the next step's answer
        return count


# ---------------------------------------------------------------------------------------------
# The synchronous client
# ---------------------------------------------------------------------------------------------


class EventStream:
    """A ``WatchEvents`` subscription: iterate for :class:`EventBatch` messages; ``cancel()``
    (or leaving a ``with`` block) ends it. The first message arrives at once."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._is_cancelled = False

    def __iter__(self) -> Iterator[EventBatch]:
        try:
            for msg in self._call:
                yield event_batch_from_pb(msg)
        except grpc.RpcError as exc:
            if self._is_cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(exc, "WatchEvents") from None

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


@dataclass(frozen=True, slots=True)
class StreamedStep:
    """One ``WatchTables`` message: a published step's tables as numpy arrays."""

    tables: StepTables
    fell_behind: bool
    """Batches between the previous message and this one were dropped (slow reader)."""


def step_tables_from_pb(msg: pb.WatchTablesResponse) -> StepTables:
    """Zero-copy numpy views of a ``WatchTablesResponse`` (read-only)."""
    tables = []
    num_reqs = 0
    for t in msg.tables:
        num_reqs = t.num_reqs
        block_table = np.frombuffer(t.block_table, dtype=_I32) if t.block_table else EMPTY_PAGES
        if block_table.shape[0] != t.num_reqs * t.num_cols:
            raise InternalError(
                f"WatchTables: table ({t.group_id}, {t.kernel_block_size}) has "
                f"{block_table.shape[0]} ids for {t.num_reqs} x {t.num_cols}"
            )
        tables.append(
            TableArrays(
                group_id=t.group_id,
                kernel_block_size=t.kernel_block_size,
                block_table=block_table.astype(np.int32, copy=False).reshape(
                    t.num_reqs, t.num_cols
                ),
                row_lengths=decode_i32(t.row_lengths),
                slot_mapping=np.frombuffer(t.slot_mapping, dtype=_I64).astype(np.int64, copy=False),
            )
        )
    return StepTables(msg.step_seq, msg.epoch, num_reqs, tuple(tables), is_copy=False)


class TableStream:
    """A ``WatchTables`` subscription: iterate for :class:`StreamedStep`; ``cancel()`` ends
    it."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._is_cancelled = False

    def __iter__(self) -> Iterator[StreamedStep]:
        try:
            for msg in self._call:
                yield StreamedStep(step_tables_from_pb(msg), msg.fell_behind)
        except grpc.RpcError as exc:
            if self._is_cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(exc, "WatchTables") from None

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()

    def __enter__(self) -> TableStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


_Local = TypeVar("_Local", bound=_LocalBase)


class _ClientCore(Generic[_Local]):
    """What :class:`PagekeeperClient` and the asyncio client share that makes no call: the
    settings, the token, the registration, the ring, the scheduler's mirror of its
    requests, and the same-node channel's bookkeeping (``_Local``: its kind)."""

    _local: _Local | None

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        interceptors: Sequence[Any] = (),
        options: Sequence[tuple[str, Any]] = (),
        defer_page_ids: bool = False,
        hold_decodes: bool = True,
        local_socket: str | None = "auto",
        tls: ClientTLS | bool | None = None,
    ) -> None:
        self.address = resolve_address(address)
        self._token, self._token_file = (token, None) if token is not None else token_source()
        self._metadata = auth_metadata(self._token)
        self.timeout = timeout
        self.retry_s = retry_s
        self.defer_page_ids = defer_page_ids
        self.hold_decodes = hold_decodes
        self.tls, opts = channel_setup(
            tls, max_message_bytes=max_message_bytes, keepalive_s=keepalive_s, options=options
        )
        self.stats = ClientStats()
        self._registration: Registration | None = None
        self._role: ClientRole | None = None
        self._register_args: dict[str, Any] = {}
        self._state: SchedulerState | None = None
        self._next_step_id = 1
        self._num_sync_waiting = 0
        """Synchronous calls (asyncio client) waiting for the step lock: their entries are
        queued, and ``discard_queued`` must not drop them under them."""
        self._in_flight: PreparedStep | None = None
        """The step being sent now (with the asyncio client, other callers may queue and
        wait meanwhile)."""
        self._unanswered: PreparedStep | None = None
        """A step whose outcome is unknown (no answer came: a deadline, a broken connection,
        a cancelled call). It is sent again, with its id and content, before any other
        step: the service answers it from memory if it applied it, else applies it once."""
        self._last_renewal = 0.0
        self._renew_asked = 0
        """Renewals asked for by steps refused FAILED_PRECONDITION (the lease may have run
        out while the client could not renew it): the lease renewal checks at once, with a
        heartbeat, and registers again if the lease ran out; the step waits for it."""
        self._renew_served = 0
        """The last of those asks a finished renewal attempt served (one that started after
        it)."""
        self._lease_alive = False
        """Whether that attempt left a live lease."""
        self._ring: RingDescriptor | None = None
        self._ring_listeners: list[Callable[[RingDescriptor | None], None]] = []
        self.lease_error: PagekeeperError | None = None
        """The last error of the background lease renewal (None while healthy)."""
        self._is_closed = False
        self._lease_epoch = 0
        """Which registration the running lease renewal belongs to (bumped by each new
        registration, an unregister and a dropped one: an older loop ends)."""
        self._forgotten: str | None = None
        """Why the service no longer knows this registration (its lease ran out past the
        grace period, or its state was reset), as a heartbeat or a step learnt it; the
        next call drops the registration (:meth:`_drop_forgotten`)."""
        self._lost_message: str | None = None
        """What calls say once the registration was dropped, until ``register()``."""
        self._local_mode, self._local_path = local_socket_choice(local_socket, interceptors)
        self._local = None
        self._local_retry_at = 0.0
        self._max_message_bytes = max_message_bytes
        self._open_channel(opts, interceptors)

    def _open_channel(self, options: list[tuple[str, Any]], interceptors: Sequence[Any]) -> None:
        """The client's own gRPC channel and stub, and what its kind of I/O needs."""
        raise NotImplementedError

    @property
    def transport(self) -> str:
        """``"local"`` while steps go over the service's same-node socket, else ``"grpc"``."""
        local = self._local
        return "local" if local is not None and local.is_open else "grpc"

    # -- the token ------------------------------------------------------------------------
    def _reread_token(self, used: str | None) -> bool:
        """The service refused ``used``: take a changed token from the token file (the
        same-node channel, which presented the old one in its hello, is reopened). True when
        the refused call is worth one more try: the token is no longer ``used``, whether
        this call or another (a heartbeat) changed it."""
        if self._token != used:
            return True
        token = reread_token_file(self._token_file, used)
        if token is None:
            return False
        self._adopt_token(token)
        return True

    def _adopt_token(self, token: str) -> None:
        self._token, self._metadata = token, auth_metadata(token)
        local, self._local = self._local, None
        if local is not None:
            local.close()  # it presented the old token in its hello
        self._local_retry_at = 0.0

    # -- the registration -----------------------------------------------------------------
    def _require(self) -> Registration:
        if self._forgotten is not None:
            raise self._drop_forgotten()
        registration = self._registration
        if registration is None or self._is_closed:
            if self._is_closed:
                raise NotRegisteredError("closed")
            raise NotRegisteredError(self._lost_message or "register() first")
        return registration

    def _drop_forgotten(self) -> NotRegisteredError:
        """The service forgot this registration: drop it and the requests the client
        tracked (the service freed them), so that ``register()`` may start anew; returns
        the error every call raises until then."""
        registration, state = self._registration, self._state
        reason, self._forgotten = self._forgotten, None
        name = registration.client_id if registration is not None else "?"
        num = len(state.requests) if state is not None else 0
        self._lost_message = (
            f"registration lost: the service no longer knows client {name!r} ({reason}); "
            f"the {num} request(s) it held were freed there. register() again (a new id)"
        )
        log.error("%s", self._lost_message)
        self._registration = None
        self._state = None
        self._unanswered = None
        self._lease_epoch += 1
        return NotRegisteredError(self._lost_message)

    def _forget_if_gone(self, error: BaseException) -> bool:
        """After a NOT_FOUND for this client's own registration: remember it is gone."""
        if isinstance(error, NotFoundError) and self._forgotten is None:
            self._forgotten = error.reason
        return self._forgotten is not None

    def _check_open(self, method: str) -> None:
        """Any call after ``close()``: the channel is gone (gRPC would raise its own
        ValueError or UsageError)."""
        if self._is_closed:
            raise NotRegisteredError("this client is closed", method=method)

    def _scheduler(self) -> SchedulerState:
        self._require()
        if self._state is None:
            raise PermissionDeniedError(
                f"this client registered as a {self._role}; only schedulers step"
            )
        return self._state

    def _accept_registration(self, registration: Registration) -> None:
        current = self._registration
        if (
            current is not None
            and current.client_id == registration.client_id
            and current.generation > registration.generation
        ):
            # Two registrations of this id crossed (the lease renewal's and the caller's):
            # the newer generation stands (the older one is already fenced).
            return
        self._registration = registration
        self._lost_message = None
        self._last_renewal = time.monotonic()
        # Step ids continue above anything this id applied, and a publishing step must
        # exceed every published one (workers wait on increasing sequence numbers).
        self._next_step_id = max(
            self._next_step_id,
            registration.last_step_id + 1,
            registration.last_published_step_seq + 1,
        )
        self._set_ring(registration.ring)

    def _set_ring(self, ring: RingDescriptor | None) -> None:
        old = self._ring
        self._ring = ring
        changed = (old is None) != (ring is None) or (
            old is not None and ring is not None and old.generation != ring.generation
        )
        if changed:
            for listener in list(self._ring_listeners):
                try:
                    listener(ring)
                except Exception:  # a listener's bug must not stop lease renewal
                    log.exception("ring listener failed")

    def add_ring_listener(self, callback: Callable[[RingDescriptor | None], None]) -> None:
        """Workers: call ``callback(descriptor)`` when the service re-creates the ring (a new
        generation, learnt from a heartbeat)."""
        self._ring_listeners.append(callback)

    @property
    def registration_lost(self) -> str | None:
        """Why the service no longer knows this client's registration (its lease ran out
        past the grace period, or its state was reset), as a heartbeat or a call learnt it;
        None while it does (or before ``register()``)."""
        return self._forgotten or self._lost_message

    @property
    def ring(self) -> RingDescriptor | None:
        """Workers: the latest ring descriptor the service sent."""
        return self._ring

    @property
    def registration(self) -> Registration:
        return self._require()

    @property
    def client_id(self) -> str:
        return self._require().client_id

    @property
    def generation(self) -> int:
        return self._require().generation

    @property
    def pool(self) -> PoolConfig:
        return self._require().pool

    @property
    def page_sizes(self) -> tuple[int, ...]:
        return self._require().pool.page_sizes

    # -- the mirror -----------------------------------------------------------------------
    def is_revoked(self, request_id: str) -> bool:
        """Whether an admin freed this running request (the service says so in every step's
        answer until it is freed): its pages are gone; preempt it and free it."""
        return self._scheduler().is_revoked(request_id)

    def discard_queued(self) -> int:
        """Drop the queue (after a step the service refused as a whole) and undo it in the
        client's view; returns how many operations were dropped. Refused
        (:class:`FailedPreconditionError`) while a step is unanswered: its operations may
        have been applied, and ``flush()`` learns whether."""
        state = self._scheduler()
        unanswered = self._unanswered
        if unanswered is not None:
            raise FailedPreconditionError(
                f"step {unanswered.request.step_id} got no answer and may have been applied: "
                "flush() sends it again (with the same id) before the queue can be dropped"
            )
        if self._in_flight is not None:
            raise FailedPreconditionError(
                f"step {self._in_flight.request.step_id} is being sent, carrying queued "
                "operations: wait for it (the service will answer for them)"
            )
        if self._num_sync_waiting:
            raise FailedPreconditionError(
                f"{self._num_sync_waiting} synchronous call(s) wait to send queued "
                "operations: wait for them"
            )
        return state.discard_queued()

    @property
    def has_unanswered_step(self) -> bool:
        """Whether a step got no answer (its outcome is unknown); the next step, or
        ``flush()``, sends it again first."""
        return self._unanswered is not None

    def _keep_unanswered(self, prepared: PreparedStep, error: BaseException) -> None:
        """``prepared`` got no answer: keep it (its operations stay at the head of the
        queue) to send again before anything else; what it answers comes with the results
        of the next step that returns them (a synchronous call that got the error has its
        answer carried there too: :meth:`_keeps_failed_entry`)."""
        prepared.explicit = False
        self._unanswered = prepared
        self.stats.num_unanswered_steps += 1
        step_id = prepared.request.step_id
        log.warning(
            "step %d got no answer (%s); it is sent again, with the same id, before the next step",
            step_id,
            getattr(error, "reason", None) or type(error).__name__,
        )
        error.add_note(
            f"pagekeeper: step {step_id} may or may not have been applied; the client sends it "
            "again, with the same id, before its next step (flush() does it now), and its "
            "answers come with that step's results"
        )

    def _is_unanswered(self, entry: _PendingAdmission | _PendingGrowth) -> bool:
        return _carries(self._unanswered, entry)

    def _keeps_failed_entry(
        self, entry: _PendingAdmission | _PendingGrowth, error: BaseException
    ) -> bool:
        """A synchronous call raised ``error``: whether its entry stays queued, answered
        with the next step's results instead. It does when its step got no answer, and
        when the call was interrupted while the entry rides in another caller's step
        being sent (the asyncio client: the answer must find it as it was sent). An entry
        no step carried, or whose step was refused whole, is withdrawn. (Other callers
        waiting on the same step still get their answers directly.)"""
        in_flight = self._in_flight
        rides = _carries(in_flight, entry)
        state = self._state
        if not rides and not self._is_unanswered(entry):
            if state is None or state.is_queued(entry):
                return False  # no step carried it, or one refused it: withdrawn
            # Answered already (in a step sent before this call's own failed): carried.
            state.carry_answer(entry)
            error.add_note(
                f"pagekeeper: {entry.request_id!r} was answered before this error; the "
                "answer comes with the next step's results"
            )
            return True
        entry.is_sync = False
        if in_flight is not None and rides:
            what = "admission" if isinstance(entry, _PendingAdmission) else "growth"
            error.add_note(
                f"pagekeeper: the {what} of {entry.request_id!r} rides in step "
                f"{in_flight.request.step_id}, being sent: its answer comes with the next "
                "step's results"
            )
        return True

    def _generation_moved(self, registration: Registration) -> bool:
        """Whether this client registered again since ``registration`` (its own renewal)."""
        current = self._registration
        return current is not None and current.generation != registration.generation

    def _refresh_generation(self, request: pb.StepRequest) -> int:
        """Send ``request`` (this client's) under the current generation; returns it."""
        registration = self._registration
        if registration is not None and registration.client_id == request.client_id:
            request.generation = registration.generation
        return int(request.generation)

    def _begin_step(
        self,
        state: SchedulerState,
        registration: Registration,
        batch: Sequence[str] | None,
        num_scheduled_tokens: TokenIds | None,
        explicit: bool,
    ) -> PreparedStep:
        """The next step, built from the queue and marked as being sent."""
        step_id = self._next_step_id
        prepared = state.prepare_step(
            client_id=registration.client_id,
            generation=registration.generation,
            state_id=registration.state_id,
            step_id=step_id,
            batch=batch,
            num_scheduled_tokens=num_scheduled_tokens,
            explicit=explicit,
        )
        # The id is spent whatever happens: a later step must not reuse it for other content.
        self._next_step_id = step_id + 1
        self._in_flight = prepared
        return prepared

    def _step_failed(self, prepared: PreparedStep, error: BaseException) -> bool:
        """The step being sent failed with ``error``: kept when its outcome is unknown.
        Returns whether it was refused NOT_FOUND (an unknown request, or this client:
        the caller asks with a heartbeat)."""
        self._in_flight = None
        if not step_was_refused(error):
            self._keep_unanswered(prepared, error)
            return False
        return isinstance(error, NotFoundError)

    def _step_answered(self, prepared: PreparedStep, response: pb.StepResponse) -> StepResult:
        """Apply the answer to a step sent (the one in flight, or the unanswered one)."""
        self._in_flight = None
        self._last_renewal = time.monotonic()
        self.stats.num_steps += 1
        return self._scheduler().apply_step(prepared, response)

    def _answered(self, response: pb.StepResponse) -> StepResult:
        """Apply the answer to the unanswered step."""
        prepared = self._unanswered
        assert prepared is not None
        self._unanswered = None
        self._next_step_id = max(self._next_step_id, prepared.request.step_id + 1)
        return self._step_answered(prepared, response)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is one of this client's running requests."""
        return request_id in self._scheduler().requests

    def request_ids(self) -> list[str]:
        return list(self._scheduler().requests)

    def request(self, request_id: str) -> RequestView:
        """The client's view of one request (pages per group, token counts)."""
        return self._scheduler().view(request_id)

    def page_ids(self, request_id: str, group_id: int = 0) -> Int32Array:
        """The request's table in one group as the client mirrors it."""
        state = self._scheduler()
        t = state.requests.get(request_id)
        if t is None:
            raise NotFoundError(state._missing(request_id))
        return np.array(t.pages[group_id], dtype=np.int32)

    @property
    def num_queued(self) -> int:
        return self._scheduler().num_queued

    @property
    def num_free_pages(self) -> int | None:
        """The pool's free pages as of the last step's answer (None before any step)."""
        return self._scheduler().num_free_pages


class PagekeeperClient(_ClientCore[LocalChannel]):
    """Synchronous client of a pagekeeper service (thread-safe for reads; one thread drives
    the scheduling API).

    ``address``: ``HOST:PORT`` or ``unix:PATH`` (default ``$PAGEKEEPER_GRPC_ADDRESS`` or
    ``127.0.0.1:50051``). ``token``: the bearer token (default ``$PAGEKEEPER_TOKEN``, else the
    first token in ``$PAGEKEEPER_TOKEN_FILE``, read again when the service refuses it: a
    call refused UNAUTHENTICATED is retried once with the file's new token).
    ``interceptors``: extra ``grpc`` client interceptors (e.g. to count calls).
    ``timeout``: per-call deadline in seconds. ``retry_s``: how long a step is retried while
    the service is UNAVAILABLE.

    ``defer_page_ids``: for a client that is its pool's only scheduler. A synchronous
    growth that needs pages is answered OK at once, without a call, when the pool surely has
    them -- the service's free-page count after the last step minus the most that every
    operation queued since can take -- and its page ids come with the next step. vLLM's
    scheduler needs the yes/no at once but the ids only when it builds its output, so a step
    costs one round trip plus one per admission. The answer is exact while no other client
    takes pages from the pool (a violated bound shows as NO_CAPACITY in the step's results,
    with a warning).

    ``hold_decodes``: hold back plain decodes that need nothing from the service (see the
    module docstring); off: every decode travels in the next step.

    ``local_socket``: where Step, Lookup, GetBlockTable and GetPoolInfo go when the service
    runs on the same host (:mod:`pagekeeper_client.local`: the same messages and answers
    over a unix socket, without gRPC's per-call cost). ``"auto"`` (the default) uses the
    socket the service advertises at registration if this process can connect to it, and
    gRPC otherwise; a path must connect (``register`` raises UnavailableError, before
    registering, if not); ``None``: gRPC only (also what ``"auto"`` means when
    ``interceptors`` are given: they see gRPC calls only). A broken socket falls back to
    gRPC (a step is resent with the same id, so nothing is applied twice) and is reopened a
    few seconds later.
    """

    def _open_channel(self, options: list[tuple[str, Any]], interceptors: Sequence[Any]) -> None:
        self._token_lock = threading.Lock()
        if self.tls is None:
            channel = grpc.insecure_channel(self.address, options=options)
        else:
            channel = grpc.secure_channel(self.address, self.tls.credentials(), options=options)
        self._raw_channel = channel
        if interceptors:
            channel = grpc.intercept_channel(channel, *interceptors)
        self._stub = pb_grpc.PagekeeperServiceStub(channel)  # type: ignore[no-untyped-call]
        self._lock = threading.RLock()
        self._heartbeat_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Ends the lease renewal's wait early: a stop, or a step asking for a renewal."""

    # -- the same-node socket -------------------------------------------------------------
    def _connect_local(self, *, required: bool) -> None:
        """Open the same-node socket if there is one to open (``required``: an explicit path
        that must work). A failure leaves gRPC in charge and is tried again later."""
        path = self._local_path
        if not path or self._is_closed:
            return
        try:
            channel = LocalChannel(
                path,
                token=self._token,
                timeout=self.timeout,
                max_message_bytes=self._max_message_bytes,
                ticket=local_ticket(self._registration),
            )
        except PagekeeperError as exc:
            if required:
                raise
            log.info("staying on gRPC: %s", exc)
            self._local_retry_at = time.monotonic() + _LOCAL_RETRY_S
            return
        old, self._local = self._local, channel
        if old is not None:
            old.close()

    def _local_channel(self, method: str) -> LocalChannel | None:
        """The open same-node channel for ``method``, reconnecting a dropped one at most
        every few seconds; None: use gRPC."""
        if method not in _LOCAL_METHODS:
            return None
        local = self._local
        if local is not None and local.is_open:
            return local
        if self._local_path and time.monotonic() >= self._local_retry_at:
            self._connect_local(required=False)  # a failure sets the next try's time
            local = self._local
            if local is not None and local.is_open:
                return local
        return None

    def _reread_token(self, used: str | None) -> bool:
        # A heartbeat thread may be refused at the same moment as a step.
        with self._token_lock:
            return super()._reread_token(used)

    # -- plumbing -----------------------------------------------------------------------
    def _call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        used = self._token
        try:
            return self._call_once(method, request, timeout)
        except UnauthenticatedError:
            if not self._reread_token(used):
                raise
        return self._call_once(method, request, timeout)

    def _call_once(self, method: str, request: Any, timeout: float | None) -> Any:
        self._check_open(method)
        stats = self.stats
        stats.num_rpcs += 1
        stats.by_method[method] = stats.by_method.get(method, 0) + 1
        local = self._local_channel(method)
        if local is not None:
            stats.num_local_calls += 1
            try:
                return local.call(method, request, _RESPONSES[method], timeout or self.timeout)
            except UnavailableError:
                if self._local is local:
                    raise
                # Swapped under this call (a new token): these reads are safe to send again.
                return self._call_once(method, request, timeout)
        try:
            return getattr(self._stub, method)(
                request, metadata=self._metadata, timeout=timeout or self.timeout
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, method) from None

    def register(
        self,
        role: ClientRole | str = ClientRole.SCHEDULER,
        *,
        name: str = "",
        lease_ttl: float | None = None,
        device: str = "",
        kernel_support: (
            Mapping[int, Sequence[BackendSpec]] | Sequence[Sequence[BackendSpec]] | None
        ) = None,
        client_id: str = "",
        renew: bool = True,
        fresh_kv_cache: bool = False,
    ) -> Registration:
        """Register as a scheduler or a worker and (``renew``) keep the lease alive from a
        background thread until :meth:`close`.

        ``lease_ttl``: seconds (None: the server's default). Workers give ``device``
        ("cpu", "cuda:N") and ``kernel_support`` (per group, the kernel block sizes of each
        attention backend their layers use; see :func:`~pagekeeper_client.types.
        normalize_backends`). ``client_id``: take over an earlier registration (a restarted
        scheduler keeps its requests: the client tracks them again, one GetBlockTable per
        request and group, and may grow, publish and free them). ``fresh_kv_cache``
        (workers): this process's KV cache holds nothing yet, so the service forgets its
        prefix cache, whose pages' KV is not here, and frees and revokes the running
        requests, whose KV is not here either (:func:`~pagekeeper_client.worker.
        register_worker` sends it by default; a re-registration of the same process never
        does). Raises :class:`FailedPreconditionError` when no kernel block size suits a
        worker's backends.
        """
        role = _role(role)
        if self._forgotten is not None:
            self._drop_forgotten()  # forgotten by the service: register anew
        if self._registration is not None:
            raise AlreadyExistsError(f"already registered as {self._registration.client_id}")
        args: dict[str, Any] = {
            "name": name or default_client_name(role),
            "lease_ttl": lease_ttl,
            "device": device,
            "kernel_support": kernel_support,
        }
        request = register_request(role, client_id=client_id, fresh_kv_cache=fresh_kv_cache, **args)
        if self._local_mode not in (None, "auto"):
            self._connect_local(required=True)  # a named socket: before registering
        registration = registration_from_pb(self._call("RegisterClient", request))
        with self._lock:
            self._register_args = args
            self._role = role
            self._accept_registration(registration)
            if role is ClientRole.SCHEDULER:
                self._state = SchedulerState(registration.pool, hold_decodes=self.hold_decodes)
        if self._local_mode == "auto":
            self._local_path = registration.local_socket
            self._connect_local(required=False)
        elif registration.local_ticket and self._local is not None:
            # A named socket opened before registering: reopen it with the ticket a
            # registration bound to a certificate needs there.
            self._connect_local(required=True)
        self._adopt(registration)
        if renew:
            self._start_heartbeat()
        return registration

    def _adopt(self, registration: Registration) -> None:
        """A takeover: track the requests the id owns that this client does not know (a
        restarted scheduler may grow, publish and free them); one GetBlockTable each per
        group."""
        state = self._state
        if state is None or not registration.request_ids:
            return
        groups = range(len(registration.pool.groups))
        for request_id in state.to_adopt(registration.request_ids):
            try:
                tables = [self.block_table(request_id, g) for g in groups]
            except NotFoundError:
                continue  # freed meanwhile (an admin's force-free)
            state.adopt(request_id, tables)

    def heartbeat(self) -> float:
        """Renew the lease now; returns the granted TTL in seconds."""
        registration = self._require()
        reply = self._call(
            "Heartbeat",
            pb.HeartbeatRequest(
                client_id=registration.client_id,
                generation=registration.generation,
                state_id=registration.state_id,
            ),
        )
        self.stats.num_heartbeats += 1
        self._last_renewal = time.monotonic()
        if reply.HasField("ring"):
            self._set_ring(ring_from_pb(reply.ring))
        elif self._role is ClientRole.WORKER:
            self._set_ring(None)
        return float(reply.lease_ttl_ms) / 1000.0

    def reregister(self) -> Registration:
        """Take over this client's own id again (after its lease expired): a new generation,
        the same requests."""
        registration = self._require()
        assert self._role is not None
        request = register_request(
            self._role, client_id=registration.client_id, **self._register_args
        )
        fresh = registration_from_pb(self._call("RegisterClient", request))
        with self._lock:
            self._accept_registration(fresh)
        self._adopt(fresh)
        if self._local_mode == "auto" and fresh.local_socket != self._local_path:
            self._local_path = fresh.local_socket
            self._connect_local(required=False)
        elif fresh.local_ticket != registration.local_ticket and self._local is not None:
            self._connect_local(required=self._local_mode != "auto")
        self.stats.num_reregistrations += 1
        return fresh

    def _start_heartbeat(self) -> None:
        self._lease_epoch += 1
        # Wake the loop of an earlier registration (it ends: another epoch), and give this
        # one an event of its own (an unregister() may have set the old one).
        self._stop.set()
        self._wake.set()
        self._stop = threading.Event()
        thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(self._lease_epoch,),
            name="pagekeeper-lease",
            daemon=True,
        )
        self._heartbeat_thread = thread
        thread.start()

    def _heartbeat_loop(self, epoch: int) -> None:
        """Renew at a third of the TTL (a step renews too, so an active scheduler rarely
        needs a heartbeat; a worker learns of a re-created ring this way), or at once when
        a refused step asks (:meth:`_lease_renewed`). An expired lease is taken over again
        under the same id. Ends with the registration it renews (``epoch``: a later
        registration runs a loop of its own)."""
        must_register = False
        while not self._stop.is_set():
            registration = self._registration
            if registration is None or epoch != self._lease_epoch:
                return
            period = max(registration.lease_ttl_s / 3.0, 0.05)
            wait = self._last_renewal + period - time.monotonic()
            if wait > 0 and not must_register and self._renew_asked == self._renew_served:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            self._wake.clear()
            ticket = self._renew_asked
            alive = False
            backoff = 0.0
            try:
                if must_register:
                    self.reregister()
                    must_register = False
                else:
                    self.heartbeat()
                self.lease_error = None
                alive = True
            except NotRegisteredError:
                return
            except (NotFoundError, AbortedError) as exc:
                # The service forgot this id (restarted, or the lease expired long ago and
                # a scheduler's requests were freed), or another registration took the id
                # over (ABORTED: registering again would fence that one in turn): nothing
                # left to renew. (Unless this client registered again meanwhile.)
                if isinstance(exc, AbortedError) and self._generation_moved(registration):
                    continue
                if not self._stop.is_set():
                    self.lease_error = exc
                    log.error("lease renewal stopped: %s", exc)
                    if not isinstance(exc, AbortedError):
                        self._forget_if_gone(exc)
                return
            except FailedPreconditionError as exc:
                if self._stop.is_set():
                    return
                log.warning("lease lost (%s); registering again", exc.reason)
                try:
                    self.reregister()
                    self.lease_error = None
                    alive = True
                except PagekeeperError as again:
                    self.lease_error = again
                    # No answer: it may have been applied. Register again next (this id's
                    # own takeover, harmless), not a heartbeat, which the registration the
                    # lost answer made would answer ABORTED for good.
                    must_register = not step_was_refused(again)
                    backoff = min(period, 1.0)
            except PagekeeperError as exc:
                if self._stop.is_set():
                    return
                self.lease_error = exc
                log.warning("lease renewal failed: %s", exc)
                backoff = min(period, 1.0)
            finally:
                self._lease_alive = alive
                self._renew_served = ticket
            if backoff:
                self._wake.wait(backoff)

    def _lease_renewed(self, generation: int, deadline: float) -> bool:
        """A step was refused FAILED_PRECONDITION under ``generation``: have the lease
        renewal check the lease now (it registers again if the lease ran out while the
        client could not reach the service or stalled) and wait for that attempt. True when
        the step is worth sending again (the same id: a refused step was not applied): the
        client registered again or the lease is live. False without a running renewal
        (``renew=False``: the caller registers again), when the attempt failed, or past
        ``deadline``."""
        thread = self._heartbeat_thread
        if thread is None or not thread.is_alive() or self._stop.is_set():
            return False
        self._renew_asked += 1
        ticket = self._renew_asked
        self._wake.set()
        while time.monotonic() < deadline:
            registration = self._registration
            if registration is None or self._stop.is_set():
                return False
            if registration.generation != generation:
                return True
            if self._renew_served >= ticket:
                return self._lease_alive
            if not thread.is_alive():
                return False
            time.sleep(0.005)
        return False

    def unregister(self, *, timeout: float | None = None) -> int:
        """End the registration (a scheduler's requests are freed); returns how many
        requests the service freed."""
        registration = self._require()
        self._stop.set()
        self._wake.set()
        reply = self._call(
            "Unregister",
            pb.UnregisterRequest(
                client_id=registration.client_id,
                generation=registration.generation,
                state_id=registration.state_id,
            ),
            timeout=timeout,
        )
        with self._lock:
            self._registration = None
            self._state = None
            self._unanswered = None  # its requests are freed: nothing to learn
            self._forgotten = None
            self._lease_epoch += 1
        return int(reply.num_freed_requests)

    # -- reads --------------------------------------------------------------------------
    def pool_info(self) -> PoolInfo:
        reply = self._call("GetPoolInfo", pb.GetPoolInfoRequest())
        return PoolInfo(
            config=pool_from_pb(reply.config),
            limits=limits_from_pb(reply.limits),
            counters=counters_from_pb(reply.counters),
            server_version=reply.server_version,
        )

    def lookup(
        self,
        token_ids: TokenIds,
        *,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | None = None,
    ) -> LookupResult:
        """Longest cached prefix of ``token_ids`` (no side effects)."""
        request = pb.LookupRequest(token_ids=encode_i32(token_ids))
        if extra_keys is not None:
            request.extra_keys.CopyFrom(extra_keys_to_pb(extra_keys))
        if page_hashes:
            state = self._state
            put_page_hashes(request, page_hashes, 0 if state is None else state.page_hash_size)
        return lookup_from_pb(self._call("Lookup", request))

    def block_table(
        self, request_id: str, group_id: int = 0, kernel_block_size: int = 0
    ) -> BlockTable:
        """One request's physical and kernel tables as the service holds them (queued
        operations not included)."""
        _check_int32("group_id", group_id)
        _check_int32("kernel_block_size", kernel_block_size)
        return block_table_from_pb(
            self._call(
                "GetBlockTable",
                pb.GetBlockTableRequest(
                    request_id=request_id, group_id=group_id, kernel_block_size=kernel_block_size
                ),
            )
        )

    def _token_for_stream(self) -> None:
        """A stream checks its token only as it goes (a revoked one ends it with
        UNAUTHENTICATED): opening one, adopt the token file's current first token."""
        self._check_open("a stream")
        if self._token_file is not None:
            self._reread_token(self._token)

    def watch_events(self, since: int = 0, *, max_events_per_message: int = 0) -> EventStream:
        """Subscribe to KV events with ``seq > since`` (0: from the oldest retained)."""
        self._token_for_stream()
        self.stats.num_rpcs += 1
        call = self._stub.WatchEvents(
            pb.WatchEventsRequest(since_seq=since, max_events_per_message=max_events_per_message),
            metadata=self._metadata,
        )
        return EventStream(call)

    def watch_tables(self, since_step_seq: int = 0, *, exact: bool = False) -> TableStream:
        """Workers: the published batches over ``WatchTables`` (for a worker on another host,
        ring kind "stream"), from the step after ``since_step_seq`` (0: the next one, unless
        ``exact``: every batch the service still keeps)."""
        registration = self._require()
        self._token_for_stream()
        self.stats.num_rpcs += 1
        call = self._stub.WatchTables(
            pb.WatchTablesRequest(
                client_id=registration.client_id,
                generation=registration.generation,
                state_id=registration.state_id,
                since_step_seq=since_step_seq,
                since_exact=exact,
            ),
            metadata=self._metadata,
        )
        return TableStream(call)

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache; returns the number of cached pages dropped. Refused
        (:class:`FailedPreconditionError`) while any request holds pages."""
        reply = self._call("ResetPrefixCache", pb.ResetPrefixCacheRequest())
        return int(reply.num_dropped_pages)

    # -- the scheduler's API ------------------------------------------------------------
    def admit(
        self,
        request_id: str,
        token_ids: TokenIds,
        *,
        num_new_tokens: int = 0,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | None = None,
        num_lookahead_tokens: int = 0,
        enable_cache_read: bool = True,
        sync: bool = True,
    ) -> AllocationResult:
        """Admit a new (or resumed) request: prefix lookup + touch + allocation.

        ``token_ids``: every token known (prompt, plus output so far when resuming).
        ``num_new_tokens``: tokens to compute now after the cached prefix (0: all the rest).
        ``page_hashes``: page hashes the engine already computed (vLLM's
        ``Request.block_hashes``), so the service does not hash the tokens.

        ``sync=True`` (default) sends one step at once (carrying whatever was queued
        before) and returns the answer: ``num_cached_tokens`` and the pages, or
        NO_CAPACITY (nothing changed). ``sync=False`` queues it for the next ``step()`` and
        returns a PENDING result; the answer is in that step's results.
        """
        state = self._scheduler()
        admission = state.plan_admission(
            request_id,
            token_ids,
            num_new_tokens=num_new_tokens,
            extra_keys=extra_keys,
            page_hashes=page_hashes,
            num_lookahead_tokens=num_lookahead_tokens,
            enable_cache_read=enable_cache_read,
        )
        state.queue_admission(admission)
        if not sync:
            return AllocationResult(request_id, AllocationStatus.PENDING)
        self.stats.num_sync_steps += 1
        admission.is_sync = True
        try:
            self._send_step(None, None)
        except BaseException as exc:
            # Refused as a whole: this admission is not left queued (others stay). One
            # whose step got no answer, or whose call was interrupted, stays: its answer
            # comes with the next step's results.
            if not self._keeps_failed_entry(admission, exc):
                state.withdraw_admission(admission)
            raise
        assert admission.result is not None
        return admission.result

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        new_token_ids: TokenIds = (),
        num_computed_tokens: int | None = None,
        num_lookahead_tokens: int = 0,
        sync: bool = False,
        page_hashes: Sequence[bytes] | None = None,
    ) -> SlotAllocation:
        """Make room for ``num_new_tokens`` more tokens of a running request (vLLM's
        ``allocate_slots`` for a running request).

        ``new_token_ids``: tokens generated since the request's last step (for a decode,
        the sampled token); they fill pages, and a page they complete enters the prefix
        cache. ``num_computed_tokens`` defaults to what the client tracked.

        ``page_hashes``: the engine's hashes of the pages ``new_token_ids`` complete (pages
        of the pool's smallest page size, in order, from the request's first full page
        the service has no hash for), as ``admit(page_hashes=...)`` takes them for a
        prompt: a later prompt containing this request's generated text then hits those
        pages. At most one per completed page (fewer: the service hashes the rest,
        chained from the last one given), all of one size (up to 64 bytes; the service's
        own or the engine's), none twice. Needs a service that takes them
        (``pool.accepts_growth_page_hashes``, else :class:`UnimplementedError`). A growth
        answered NO_CAPACITY keeps none of them: send them again with its retry.

        Answered locally (``is_local``, no call) when the request's pages cover
        ``computed + new + lookahead`` tokens in every group. Otherwise the growth is
        queued (PENDING, answered by the next ``step()``), or with ``sync=True`` sent at
        once in a step of its own: OK with the new page ids, or NO_CAPACITY (nothing
        changed: preempt something and try again). With ``defer_page_ids`` (see the class)
        a synchronous growth the pool surely has room for is answered OK at once
        (``is_deferred``) and sent with the next step.
        """
        state = self._scheduler()
        revoked = state.revoked_answer(request_id)
        if revoked is not None:
            return revoked
        if state.must_flush_before_growth(request_id):
            self.stats.num_ordering_flushes += 1
            self._send_step(None, None)
            # The answer may have said an admin freed it.
            revoked = state.revoked_answer(request_id)
            if revoked is not None:
                return revoked

        def plan() -> _PendingGrowth:
            return state.plan_growth(
                request_id,
                num_new_tokens,
                new_token_ids,
                num_computed_tokens,
                num_lookahead_tokens,
                page_hashes,
            )

        growth = plan()
        if state.growth_needs_ordering_flush(growth):
            state.unplan_growth(growth)
            self.stats.num_ordering_flushes += 1
            self._send_step(None, None)
            revoked = state.revoked_answer(request_id)
            if revoked is not None:
                return revoked
            growth = plan()
        defer = sync and self.defer_page_ids and growth.needs_pages and state.can_defer(growth)
        state.queue_growth(growth)
        if growth.is_local:
            self.stats.num_local_answers += 1
            return SlotAllocation(request_id, AllocationStatus.OK, is_local=True)
        if defer:
            # The pool surely has the pages: answer now, hand the ids out with the step.
            growth.is_deferred = True
            self.stats.num_deferred_answers += 1
            return SlotAllocation(request_id, AllocationStatus.OK, is_deferred=True)
        if not sync:
            return SlotAllocation(request_id, AllocationStatus.PENDING)
        self.stats.num_sync_steps += 1
        growth.is_sync = True
        try:
            self._send_step(None, None)
        except BaseException as exc:  # as for an admission
            if not self._keeps_failed_entry(growth, exc):
                state.withdraw_growth(growth)
            raise
        result = growth.result
        if result is None:  # not listed: it fitted after all
            return SlotAllocation(request_id, AllocationStatus.OK)
        return SlotAllocation(request_id, result.status, result.new_page_ids, reason=result.reason)

    def allocate_decodes(
        self,
        request_ids: Sequence[str],
        token_ids: TokenIds,
        *,
        num_lookahead_tokens: int = 0,
        page_hashes: Mapping[str, bytes] | None = None,
    ) -> list[str]:
        """A whole decode step, queued with no call: request ``i`` appends
        ``token_ids[i]`` and needs room for one more token (+ lookahead), exactly as
        ``allocate_slots(rid, 1, new_token_ids=[token])`` for each, at a fraction of the
        cost. Returns the ids whose token needs a new page (PENDING: their pages come with
        the next ``step()``'s results); the rest fit in their pages. Checked as a whole
        first: on a bad id or token nothing is queued.

        ``page_hashes``: request id -> the hash of the page its token completes (see
        ``allocate_slots``), for rows that complete one (checked with the rest before
        anything is queued)."""
        state = self._scheduler()
        if state.must_flush_before_decodes(request_ids):
            self.stats.num_ordering_flushes += 1
            self._send_step(None, None)
        plan = state.plan_decodes(request_ids, token_ids, num_lookahead_tokens, page_hashes)
        if state.decodes_need_ordering_flush(plan):
            state.unplan_decodes(plan)
            self.stats.num_ordering_flushes += 1
            self._send_step(None, None)
            plan = state.plan_decodes(request_ids, token_ids, num_lookahead_tokens, page_hashes)
        need_pages = state.queue_decodes(plan)
        self.stats.num_local_answers += len(request_ids) - len(need_pages)
        return need_pages

    def free_later(self, *request_ids: str) -> None:
        """Queue frees for the next step (no call). The requests leave the client's view at
        once. (If something queued must apply before a free -- the request's own growth, an
        admission, a growth that takes or releases pages -- the queue is sent first.)"""
        state = self._scheduler()
        for request_id in request_ids:
            if state.must_flush_before_free(request_id):
                self.stats.num_ordering_flushes += 1
                self._send_step(None, None)
            state.queue_free(request_id)

    def free(self, *request_ids: str) -> StepResult:
        """Free requests now (one step, carrying whatever was queued before)."""
        self.free_later(*request_ids)
        return self._send_step(None, None, explicit=True)

    def step(
        self,
        batch: Sequence[str] | None = None,
        *,
        num_scheduled_tokens: TokenIds | None = None,
        frees: Sequence[str] = (),
        growths: Sequence[Growth] = (),
        admissions: Sequence[Admission] = (),
    ) -> StepResult:
        """Send one ``Step``: everything queued (frees, growths, admissions, in call order),
        then publish ``batch`` (request ids in row order; ``num_scheduled_tokens`` per row,
        default: what each was last allocated for). Always exactly one round trip when
        nothing is queued out of order.

        ``frees``/``growths``/``admissions`` are the raw form: the same as calling
        ``free_later`` / ``allocate_slots`` / ``admit(sync=False)`` first.
        """
        self._queue_raw(frees, growths, admissions)
        return self._send_step(batch, num_scheduled_tokens, explicit=True)

    def flush(self) -> StepResult | None:
        """Send the queue now (no batch), with every held-back decode, so the service's
        view is the client's; None when there is nothing to send."""
        state = self._scheduler()
        state.queue_held()
        if not state.has_queued and self._unanswered is None:
            return None
        return self._send_step(None, None, explicit=True)

    def _queue_raw(
        self, frees: Sequence[str], growths: Sequence[Growth], admissions: Sequence[Admission]
    ) -> None:
        if frees:
            self.free_later(*frees)
        for g in growths:
            self.allocate_slots(
                g.request_id,
                g.num_new_tokens,
                new_token_ids=g.new_token_ids,
                num_computed_tokens=g.num_computed_tokens,
                num_lookahead_tokens=g.num_lookahead_tokens,
                page_hashes=g.page_hashes,
            )
        for a in admissions:
            self.admit(
                a.request_id,
                a.token_ids,
                num_new_tokens=a.num_new_tokens,
                extra_keys=a.extra_keys,
                page_hashes=a.page_hashes,
                num_lookahead_tokens=a.num_lookahead_tokens,
                enable_cache_read=a.enable_cache_read,
                sync=False,
            )

    def _send_step(
        self,
        batch: Sequence[str] | None,
        num_scheduled_tokens: TokenIds | None,
        *,
        explicit: bool = False,
    ) -> StepResult:
        state = self._scheduler()
        registration = self._require()
        if self._unanswered is not None:
            # First learn what it did (its answers come with this step's results).
            resent = self._send_unanswered()
            if batch is None and not state.has_queued:
                # It was all there was to send (a flush): no second round trip.
                return state.release_carried(resent) if explicit else resent
        prepared = self._begin_step(state, registration, batch, num_scheduled_tokens, explicit)
        try:
            response = self._step_with_retry(prepared.request)
        except BaseException as exc:
            if self._step_failed(prepared, exc) and self._registration_gone():
                raise self._drop_forgotten() from exc
            raise
        return self._step_answered(prepared, response)

    def _registration_gone(self) -> bool:
        """A step was NOT_FOUND: an unknown request, or this client itself? A heartbeat
        tells (one more call, on this error path only)."""
        try:
            self.heartbeat()
        except NotFoundError as exc:
            return self._forget_if_gone(exc)
        except PagekeeperError:
            pass
        return False

    def _send_unanswered(self) -> StepResult:
        """Send the unanswered step again and apply its answer. A refusal that proves it
        changed nothing leaves its operations queued, as after any refused step; one the
        service gives before it looks at the step (a stale generation, a token) keeps it
        for the next try; a NOT_FOUND for the client itself drops the registration."""
        unanswered = self._unanswered
        assert unanswered is not None
        try:
            # The same id and content; each try goes under the current generation (a
            # takeover since keeps the client's last step and answer).
            response = self._step_with_retry(unanswered.request)
        except BaseException as exc:
            if isinstance(exc, NotFoundError) and self._registration_gone():
                raise self._drop_forgotten() from exc
            if resend_was_refused(exc):
                self._unanswered = None
            raise
        return self._answered(response)

    def _step_with_retry(self, request: pb.StepRequest) -> pb.StepResponse:
        """Send a step; on UNAVAILABLE resend the SAME step id with backoff (the service
        answers a step it already applied from memory, so nothing is applied twice)."""
        deadline = time.monotonic() + self.retry_s
        delay = 0.02
        stats = self.stats
        may_reread = True
        num_moved = 0
        may_renew = True
        while True:
            stats.num_rpcs += 1
            stats.by_method["Step"] = stats.by_method.get("Step", 0) + 1
            used = self._token
            # The current generation: the lease renewal may have registered again since
            # the step was built (the same client: its last step and answer are kept).
            generation = self._refresh_generation(request)
            try:
                local = self._local_channel("Step")
                if local is not None:
                    stats.num_local_calls += 1
                    return local.call("Step", request, pb.StepResponse, self.timeout)  # type: ignore[no-any-return]
                response: pb.StepResponse = self._stub.Step(
                    request, metadata=self._metadata, timeout=self.timeout
                )
                return response
            except (
                grpc.RpcError,
                UnavailableError,
                DeadlineExceededError,
                UnauthenticatedError,
                AbortedError,
                FailedPreconditionError,
            ) as exc:
                if isinstance(exc, grpc.RpcError):
                    error = error_from_rpc(exc, "Step")
                else:
                    error = exc  # the same-node socket broke (it is closed now), or refused
                if isinstance(error, UnauthenticatedError) and may_reread:
                    may_reread = False  # once a step: a file that keeps changing ends here
                    if self._reread_token(used):
                        continue  # refused before anything was applied: the same id again
                if isinstance(error, FailedPreconditionError) and may_renew:
                    # The lease may have run out while the client could not renew it (the
                    # service unreachable, the process stalled): the renewal registers
                    # again (its grace period keeps the requests), then the same id goes.
                    may_renew = False
                    if self._lease_renewed(generation, deadline):
                        continue
                    raise error from None
                if isinstance(error, AbortedError) and num_moved < 3:
                    registration = self._registration
                    if registration is not None and registration.generation != generation:
                        num_moved += 1  # registered again meanwhile: under the new one
                        continue
                if error.code not in _RETRY_CODES or self._is_closed:
                    raise error from None
                if time.monotonic() + delay > deadline:
                    raise error from None
                stats.num_retries += 1
                log.info("step %d: %s; retrying with the same id", request.step_id, error.reason)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    # -- life cycle ---------------------------------------------------------------------
    def close(self, *, unregister: bool = True) -> None:
        """Stop lease renewal, unregister (a scheduler's requests are freed; best effort)
        and close the channel."""
        if self._is_closed:
            return
        self._stop.set()
        self._wake.set()
        if unregister and self._registration is not None:
            try:
                self.unregister(timeout=min(self.timeout, 5.0))
            except PagekeeperError as exc:
                log.info("unregister on close failed: %s", exc)
        self._is_closed = True
        thread = self._heartbeat_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        local, self._local = self._local, None
        if local is not None:
            local.close()
        self._raw_channel.close()

    def __enter__(self) -> PagekeeperClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "DEFAULT_ADDRESS",
    "EventStream",
    "PagekeeperClient",
    "PreparedStep",
    "RequestView",
    "SchedulerState",
    "StreamedStep",
    "TableStream",
    "channel_options",
    "decode_i32",
    "encode_i32",
    "ring_from_pb",
]
