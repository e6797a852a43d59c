from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_KIND_UNSPECIFIED: _ClassVar[GroupKind]
    GROUP_KIND_FULL: _ClassVar[GroupKind]
    GROUP_KIND_SLIDING_WINDOW: _ClassVar[GroupKind]
    GROUP_KIND_CHUNKED_LOCAL: _ClassVar[GroupKind]
    GROUP_KIND_MAMBA: _ClassVar[GroupKind]

class ClientRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLIENT_ROLE_UNSPECIFIED: _ClassVar[ClientRole]
    CLIENT_ROLE_SCHEDULER: _ClassVar[ClientRole]
    CLIENT_ROLE_WORKER: _ClassVar[ClientRole]

class RingKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RING_KIND_UNSPECIFIED: _ClassVar[RingKind]
    RING_KIND_SHM: _ClassVar[RingKind]
    RING_KIND_CUDA_IPC: _ClassVar[RingKind]
    RING_KIND_CPU_IPC: _ClassVar[RingKind]
    RING_KIND_STREAM: _ClassVar[RingKind]

class AllocationStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATION_STATUS_UNSPECIFIED: _ClassVar[AllocationStatus]
    ALLOCATION_STATUS_OK: _ClassVar[AllocationStatus]
    ALLOCATION_STATUS_NO_CAPACITY: _ClassVar[AllocationStatus]
    ALLOCATION_STATUS_REJECTED: _ClassVar[AllocationStatus]
GROUP_KIND_UNSPECIFIED: GroupKind
GROUP_KIND_FULL: GroupKind
GROUP_KIND_SLIDING_WINDOW: GroupKind
GROUP_KIND_CHUNKED_LOCAL: GroupKind
GROUP_KIND_MAMBA: GroupKind
CLIENT_ROLE_UNSPECIFIED: ClientRole
CLIENT_ROLE_SCHEDULER: ClientRole
CLIENT_ROLE_WORKER: ClientRole
RING_KIND_UNSPECIFIED: RingKind
RING_KIND_SHM: RingKind
RING_KIND_CUDA_IPC: RingKind
RING_KIND_CPU_IPC: RingKind
RING_KIND_STREAM: RingKind
ALLOCATION_STATUS_UNSPECIFIED: AllocationStatus
ALLOCATION_STATUS_OK: AllocationStatus
ALLOCATION_STATUS_NO_CAPACITY: AllocationStatus
ALLOCATION_STATUS_REJECTED: AllocationStatus

class GroupInfo(_message.Message):
    __slots__ = ("group_id", "kind", "page_size", "window", "chunk", "enable_state_caching", "name")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ENABLE_STATE_CACHING_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    kind: GroupKind
    page_size: int
    window: int
    chunk: int
    enable_state_caching: bool
    name: str
    def __init__(self, group_id: _Optional[int] = ..., kind: _Optional[_Union[GroupKind, str]] = ..., page_size: _Optional[int] = ..., window: _Optional[int] = ..., chunk: _Optional[int] = ..., enable_state_caching: _Optional[bool] = ..., name: _Optional[str] = ...) -> None: ...

class PoolConfig(_message.Message):
    __slots__ = ("num_pages", "groups", "enable_prefix_caching", "hash_algorithm", "max_model_len", "page_hash_size", "accepts_growth_page_hashes")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_GROWTH_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupInfo]
    enable_prefix_caching: bool
    hash_algorithm: str
    max_model_len: int
    page_hash_size: int
    accepts_growth_page_hashes: bool
    def __init__(self, num_pages: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupInfo, _Mapping]]] = ..., enable_prefix_caching: _Optional[bool] = ..., hash_algorithm: _Optional[str] = ..., max_model_len: _Optional[int] = ..., page_hash_size: _Optional[int] = ..., accepts_growth_page_hashes: _Optional[bool] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_requests_per_step", "max_tokens_per_step", "max_clients", "max_message_bytes", "lease_ttl_ms")
    MAX_REQUESTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    max_requests_per_step: int
    max_tokens_per_step: int
    max_clients: int
    max_message_bytes: int
    lease_ttl_ms: int
    def __init__(self, max_requests_per_step: _Optional[int] = ..., max_tokens_per_step: _Optional[int] = ..., max_clients: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class PoolCounters(_message.Message):
    __slots__ = ("num_free_pages", "num_used_pages", "num_cached_pages", "num_free_cached_pages", "num_requests", "usage", "prefix_queries_tokens", "prefix_hits_tokens", "prefix_queries_requests", "prefix_hits_requests", "prefix_hit_rate", "num_evictions", "num_allocated_pages_total", "num_freed_pages_total", "num_no_capacity", "num_steps", "num_published", "num_clients", "last_event_seq")
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOCATED_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_NO_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
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
    def __init__(self, num_free_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., num_free_cached_pages: _Optional[int] = ..., num_requests: _Optional[int] = ..., usage: _Optional[float] = ..., prefix_queries_tokens: _Optional[int] = ..., prefix_hits_tokens: _Optional[int] = ..., prefix_queries_requests: _Optional[int] = ..., prefix_hits_requests: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., num_evictions: _Optional[int] = ..., num_allocated_pages_total: _Optional[int] = ..., num_freed_pages_total: _Optional[int] = ..., num_no_capacity: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_published: _Optional[int] = ..., num_clients: _Optional[int] = ..., last_event_seq: _Optional[int] = ...) -> None: ...

class ExtraKeys(_message.Message):
    __slots__ = ("lora_name", "lora_path", "mm_inputs", "cache_salt")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    mm_inputs: _containers.RepeatedCompositeFieldContainer[MultiModalKey]
    cache_salt: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., mm_inputs: _Optional[_Iterable[_Union[MultiModalKey, _Mapping]]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class MultiModalKey(_message.Message):
    __slots__ = ("identifier", "offset", "length")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    length: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class GetPoolInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolInfoResponse(_message.Message):
    __slots__ = ("config", "limits", "counters", "server_version")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    config: PoolConfig
    limits: Limits
    counters: PoolCounters
    server_version: str
    def __init__(self, config: _Optional[_Union[PoolConfig, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., counters: _Optional[_Union[PoolCounters, _Mapping]] = ..., server_version: _Optional[str] = ...) -> None: ...

class KernelBackend(_message.Message):
    __slots__ = ("name", "block_sizes", "multiple_of")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    MULTIPLE_OF_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_sizes: _containers.RepeatedScalarFieldContainer[int]
    multiple_of: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., block_sizes: _Optional[_Iterable[int]] = ..., multiple_of: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupKernelSupport(_message.Message):
    __slots__ = ("group_id", "backends")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    backends: _containers.RepeatedCompositeFieldContainer[KernelBackend]
    def __init__(self, group_id: _Optional[int] = ..., backends: _Optional[_Iterable[_Union[KernelBackend, _Mapping]]] = ...) -> None: ...

class RegisterClientRequest(_message.Message):
    __slots__ = ("role", "name", "client_id", "lease_ttl_ms", "device", "kernel_support", "fresh_kv_cache")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    FRESH_KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    role: ClientRole
    name: str
    client_id: str
    lease_ttl_ms: int
    device: str
    kernel_support: _containers.RepeatedCompositeFieldContainer[GroupKernelSupport]
    fresh_kv_cache: bool
    def __init__(self, role: _Optional[_Union[ClientRole, str]] = ..., name: _Optional[str] = ..., client_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., device: _Optional[str] = ..., kernel_support: _Optional[_Iterable[_Union[GroupKernelSupport, _Mapping]]] = ..., fresh_kv_cache: _Optional[bool] = ...) -> None: ...

class RingTableGeometry(_message.Message):
    __slots__ = ("group_id", "kernel_block_size", "max_kernel_blocks_per_row")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_KERNEL_BLOCKS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    kernel_block_size: int
    max_kernel_blocks_per_row: int
    def __init__(self, group_id: _Optional[int] = ..., kernel_block_size: _Optional[int] = ..., max_kernel_blocks_per_row: _Optional[int] = ...) -> None: ...

class RingGeometry(_message.Message):
    __slots__ = ("depth", "max_num_reqs", "max_num_tokens", "tables")
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_REQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    depth: int
    max_num_reqs: int
    max_num_tokens: int
    tables: _containers.RepeatedCompositeFieldContainer[RingTableGeometry]
    def __init__(self, depth: _Optional[int] = ..., max_num_reqs: _Optional[int] = ..., max_num_tokens: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[RingTableGeometry, _Mapping]]] = ...) -> None: ...

class RingDescriptor(_message.Message):
    __slots__ = ("kind", "generation", "geometry", "size_bytes", "layout_version", "path", "device", "gpu_uuid", "ipc_handle", "event_handles", "offset", "exporter_pid", "dtype", "ref_counter_handle", "ref_counter_offset")
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_PID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    kind: RingKind
    generation: int
    geometry: RingGeometry
    size_bytes: int
    layout_version: int
    path: str
    device: str
    gpu_uuid: str
    ipc_handle: bytes
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    offset: int
    exporter_pid: int
    dtype: str
    ref_counter_handle: bytes
    ref_counter_offset: int
    def __init__(self, kind: _Optional[_Union[RingKind, str]] = ..., generation: _Optional[int] = ..., geometry: _Optional[_Union[RingGeometry, _Mapping]] = ..., size_bytes: _Optional[int] = ..., layout_version: _Optional[int] = ..., path: _Optional[str] = ..., device: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., event_handles: _Optional[_Iterable[bytes]] = ..., offset: _Optional[int] = ..., exporter_pid: _Optional[int] = ..., dtype: _Optional[str] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ...) -> None: ...

class KernelBlockSize(_message.Message):
    __slots__ = ("group_id", "kernel_block_size")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    kernel_block_size: int
    def __init__(self, group_id: _Optional[int] = ..., kernel_block_size: _Optional[int] = ...) -> None: ...

class RegisterClientResponse(_message.Message):
    __slots__ = ("client_id", "generation", "lease_ttl_ms", "kernel_block_sizes", "ring", "pool", "limits", "last_step_id", "last_published_step_seq", "local_socket", "local_ticket", "state_id", "request_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_PUBLISHED_STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TICKET_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    generation: int
    lease_ttl_ms: int
    kernel_block_sizes: _containers.RepeatedCompositeFieldContainer[KernelBlockSize]
    ring: RingDescriptor
    pool: PoolConfig
    limits: Limits
    last_step_id: int
    last_published_step_seq: int
    local_socket: str
    local_ticket: str
    state_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., generation: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., kernel_block_sizes: _Optional[_Iterable[_Union[KernelBlockSize, _Mapping]]] = ..., ring: _Optional[_Union[RingDescriptor, _Mapping]] = ..., pool: _Optional[_Union[PoolConfig, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., last_step_id: _Optional[int] = ..., last_published_step_seq: _Optional[int] = ..., local_socket: _Optional[str] = ..., local_ticket: _Optional[str] = ..., state_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("client_id", "generation", "state_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    generation: int
    state_id: str
    def __init__(self, client_id: _Optional[str] = ..., generation: _Optional[int] = ..., state_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "ring", "last_event_seq")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    ring: RingDescriptor
    last_event_seq: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., ring: _Optional[_Union[RingDescriptor, _Mapping]] = ..., last_event_seq: _Optional[int] = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("client_id", "generation", "state_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    generation: int
    state_id: str
    def __init__(self, client_id: _Optional[str] = ..., generation: _Optional[int] = ..., state_id: _Optional[str] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ("num_freed_requests",)
    NUM_FREED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_freed_requests: int
    def __init__(self, num_freed_requests: _Optional[int] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_new_tokens", "extra_keys", "page_hashes", "num_lookahead_tokens", "enable_cache_read", "packed_page_hashes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_CACHE_READ_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: bytes
    num_new_tokens: int
    extra_keys: ExtraKeys
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_lookahead_tokens: int
    enable_cache_read: bool
    packed_page_hashes: bytes
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., num_new_tokens: _Optional[int] = ..., extra_keys: _Optional[_Union[ExtraKeys, _Mapping]] = ..., page_hashes: _Optional[_Iterable[bytes]] = ..., num_lookahead_tokens: _Optional[int] = ..., enable_cache_read: _Optional[bool] = ..., packed_page_hashes: _Optional[bytes] = ...) -> None: ...

class Growth(_message.Message):
    __slots__ = ("request_id", "num_new_tokens", "new_token_ids", "num_computed_tokens", "num_lookahead_tokens", "packed_page_hashes", "page_hash_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASH_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_new_tokens: int
    new_token_ids: bytes
    num_computed_tokens: int
    num_lookahead_tokens: int
    packed_page_hashes: bytes
    page_hash_size: int
    def __init__(self, request_id: _Optional[str] = ..., num_new_tokens: _Optional[int] = ..., new_token_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ..., packed_page_hashes: _Optional[bytes] = ..., page_hash_size: _Optional[int] = ...) -> None: ...

class GrowthColumns(_message.Message):
    __slots__ = ("request_ids", "num_new_tokens", "new_token_ids", "num_new_token_ids", "num_computed_tokens", "num_lookahead_tokens", "packed_page_hashes", "num_page_hashes", "page_hash_size")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASH_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_new_tokens: bytes
    new_token_ids: bytes
    num_new_token_ids: bytes
    num_computed_tokens: bytes
    num_lookahead_tokens: bytes
    packed_page_hashes: bytes
    num_page_hashes: bytes
    page_hash_size: int
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_new_tokens: _Optional[bytes] = ..., new_token_ids: _Optional[bytes] = ..., num_new_token_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[bytes] = ..., num_lookahead_tokens: _Optional[bytes] = ..., packed_page_hashes: _Optional[bytes] = ..., num_page_hashes: _Optional[bytes] = ..., page_hash_size: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("request_ids", "num_scheduled_tokens", "num_computed_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: bytes
    num_computed_tokens: bytes
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[bytes] = ..., num_computed_tokens: _Optional[bytes] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("client_id", "generation", "step_id", "free_request_ids", "growths", "admissions", "growth_columns", "batch", "grants_in_columns", "state_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FREE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    GROWTHS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    GROWTH_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GRANTS_IN_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    generation: int
    step_id: int
    free_request_ids: _containers.RepeatedScalarFieldContainer[str]
    growths: _containers.RepeatedCompositeFieldContainer[Growth]
    admissions: _containers.RepeatedCompositeFieldContainer[Admission]
    growth_columns: GrowthColumns
    batch: Batch
    grants_in_columns: bool
    state_id: str
    def __init__(self, client_id: _Optional[str] = ..., generation: _Optional[int] = ..., step_id: _Optional[int] = ..., free_request_ids: _Optional[_Iterable[str]] = ..., growths: _Optional[_Iterable[_Union[Growth, _Mapping]]] = ..., admissions: _Optional[_Iterable[_Union[Admission, _Mapping]]] = ..., growth_columns: _Optional[_Union[GrowthColumns, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., grants_in_columns: _Optional[bool] = ..., state_id: _Optional[str] = ...) -> None: ...

class AllocationResult(_message.Message):
    __slots__ = ("request_id", "status", "num_cached_tokens", "new_page_ids", "hit_page_ids", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    HIT_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: AllocationStatus
    num_cached_tokens: int
    new_page_ids: _containers.RepeatedScalarFieldContainer[bytes]
    hit_page_ids: _containers.RepeatedScalarFieldContainer[bytes]
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[AllocationStatus, str]] = ..., num_cached_tokens: _Optional[int] = ..., new_page_ids: _Optional[_Iterable[bytes]] = ..., hit_page_ids: _Optional[_Iterable[bytes]] = ..., reason: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "results", "is_published", "published_slot", "unscheduled_request_ids", "num_free_pages", "last_event_seq", "publish_error", "is_retry", "grants", "revoked_request_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_SLOT_FIELD_NUMBER: _ClassVar[int]
    UNSCHEDULED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_ERROR_FIELD_NUMBER: _ClassVar[int]
    IS_RETRY_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    results: _containers.RepeatedCompositeFieldContainer[AllocationResult]
    is_published: bool
    published_slot: int
    unscheduled_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_free_pages: int
    last_event_seq: int
    publish_error: str
    is_retry: bool
    grants: GrowthGrants
    revoked_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[AllocationResult, _Mapping]]] = ..., is_published: _Optional[bool] = ..., published_slot: _Optional[int] = ..., unscheduled_request_ids: _Optional[_Iterable[str]] = ..., num_free_pages: _Optional[int] = ..., last_event_seq: _Optional[int] = ..., publish_error: _Optional[str] = ..., is_retry: _Optional[bool] = ..., grants: _Optional[_Union[GrowthGrants, _Mapping]] = ..., revoked_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GrowthGrants(_message.Message):
    __slots__ = ("growth_index", "num_pages", "page_ids")
    GROWTH_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    growth_index: bytes
    num_pages: bytes
    page_ids: bytes
    def __init__(self, growth_index: _Optional[bytes] = ..., num_pages: _Optional[bytes] = ..., page_ids: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("token_ids", "extra_keys", "page_hashes", "packed_page_hashes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    extra_keys: ExtraKeys
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    packed_page_hashes: bytes
    def __init__(self, token_ids: _Optional[bytes] = ..., extra_keys: _Optional[_Union[ExtraKeys, _Mapping]] = ..., page_hashes: _Optional[_Iterable[bytes]] = ..., packed_page_hashes: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hit_tokens", "page_ids", "page_hashes")
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    num_hit_tokens: int
    page_ids: _containers.RepeatedScalarFieldContainer[bytes]
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, num_hit_tokens: _Optional[int] = ..., page_ids: _Optional[_Iterable[bytes]] = ..., page_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetBlockTableRequest(_message.Message):
    __slots__ = ("request_id", "group_id", "kernel_block_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    group_id: int
    kernel_block_size: int
    def __init__(self, request_id: _Optional[str] = ..., group_id: _Optional[int] = ..., kernel_block_size: _Optional[int] = ...) -> None: ...

class GetBlockTableResponse(_message.Message):
    __slots__ = ("request_id", "group_id", "page_size", "kernel_block_size", "page_ids", "kernel_block_ids", "num_tokens", "num_computed_tokens", "num_cached_tokens", "owner")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    group_id: int
    page_size: int
    kernel_block_size: int
    page_ids: bytes
    kernel_block_ids: bytes
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    owner: str
    def __init__(self, request_id: _Optional[str] = ..., group_id: _Optional[int] = ..., page_size: _Optional[int] = ..., kernel_block_size: _Optional[int] = ..., page_ids: _Optional[bytes] = ..., kernel_block_ids: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class PageStored(_message.Message):
    __slots__ = ("group_id", "page_hashes", "parent_page_hash", "token_ids", "page_size", "page_ids", "lora_name", "extra_keys", "first_page_index")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_PAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_page_hash: bytes
    token_ids: bytes
    page_size: int
    page_ids: bytes
    lora_name: str
    extra_keys: ExtraKeys
    first_page_index: int
    def __init__(self, group_id: _Optional[int] = ..., page_hashes: _Optional[_Iterable[bytes]] = ..., parent_page_hash: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., page_size: _Optional[int] = ..., page_ids: _Optional[bytes] = ..., lora_name: _Optional[str] = ..., extra_keys: _Optional[_Union[ExtraKeys, _Mapping]] = ..., first_page_index: _Optional[int] = ...) -> None: ...

class PageRemoved(_message.Message):
    __slots__ = ("group_id", "page_hashes", "page_ids")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    page_ids: bytes
    def __init__(self, group_id: _Optional[int] = ..., page_hashes: _Optional[_Iterable[bytes]] = ..., page_ids: _Optional[bytes] = ...) -> None: ...

class AllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "all_cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: PageStored
    removed: PageRemoved
    all_cleared: AllCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[PageStored, _Mapping]] = ..., removed: _Optional[_Union[PageRemoved, _Mapping]] = ..., all_cleared: _Optional[_Union[AllCleared, _Mapping]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("since_seq", "max_events_per_message")
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    since_seq: int
    max_events_per_message: int
    def __init__(self, since_seq: _Optional[int] = ..., max_events_per_message: _Optional[int] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("events", "fell_behind", "first_retained_seq", "last_event_seq")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    FELL_BEHIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_RETAINED_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    fell_behind: bool
    first_retained_seq: int
    last_event_seq: int
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., fell_behind: _Optional[bool] = ..., first_retained_seq: _Optional[int] = ..., last_event_seq: _Optional[int] = ...) -> None: ...

class WatchTablesRequest(_message.Message):
    __slots__ = ("client_id", "generation", "since_step_seq", "state_id", "since_exact")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_EXACT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    generation: int
    since_step_seq: int
    state_id: str
    since_exact: bool
    def __init__(self, client_id: _Optional[str] = ..., generation: _Optional[int] = ..., since_step_seq: _Optional[int] = ..., state_id: _Optional[str] = ..., since_exact: _Optional[bool] = ...) -> None: ...

class PublishedTable(_message.Message):
    __slots__ = ("group_id", "kernel_block_size", "block_table", "row_lengths", "slot_mapping", "num_reqs", "num_cols")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    ROW_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_COLS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    kernel_block_size: int
    block_table: bytes
    row_lengths: bytes
    slot_mapping: bytes
    num_reqs: int
    num_cols: int
    def __init__(self, group_id: _Optional[int] = ..., kernel_block_size: _Optional[int] = ..., block_table: _Optional[bytes] = ..., row_lengths: _Optional[bytes] = ..., slot_mapping: _Optional[bytes] = ..., num_reqs: _Optional[int] = ..., num_cols: _Optional[int] = ...) -> None: ...

class WatchTablesResponse(_message.Message):
    __slots__ = ("step_seq", "epoch", "tables", "fell_behind")
    STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    FELL_BEHIND_FIELD_NUMBER: _ClassVar[int]
    step_seq: int
    epoch: int
    tables: _containers.RepeatedCompositeFieldContainer[PublishedTable]
    fell_behind: bool
    def __init__(self, step_seq: _Optional[int] = ..., epoch: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[PublishedTable, _Mapping]]] = ..., fell_behind: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_dropped_pages",)
    NUM_DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_dropped_pages: int
    def __init__(self, num_dropped_pages: _Optional[int] = ...) -> None: ...
