"""Pydantic models of the REST API (every field documented: they make /openapi.json)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagekeeper.errors_map import PROBLEM_CONTENT_TYPE
from pagekeeper.state import ClientRole, PageState

PageIdList = list[int]
HexHash = Annotated[str, Field(description="A page hash, lowercase hex.", pattern=r"^[0-9a-f]*$")]


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Problem(Model):
    """An RFC 9457 problem body; every 4xx/5xx answer carries one."""

    type: str = Field(description="URI naming the error kind, e.g. .../problems/not_found.")
    title: str = Field(description="Short human summary of the error kind.")
    status: int = Field(description="The HTTP status code.")
    detail: str = Field(description="What exactly went wrong, for this request.")


class Status(Model):
    status: str = Field(description="'ok' for liveness, 'ready' once the pool serves.")


# -- pool ---------------------------------------------------------------------------------


class GroupModel(Model):
    group_id: int = Field(description="Position of the group; per-group lists use it.")
    kind: Literal["full", "sliding_window", "chunked_local", "mamba"] = Field(
        description="How the group lays out a request's pages."
    )
    page_size: int = Field(description="Tokens per page.")
    window: int | None = Field(description="Sliding-window size in tokens, else null.")
    chunk: int | None = Field(description="Chunked-local chunk size in tokens, else null.")
    enable_state_caching: bool = Field(description="Mamba groups: per-page states cached.")
    name: str = Field(description="Free-form label.")
    num_used_pages: int = Field(description="Pages this group's requests hold now.")


class PoolConfigModel(Model):
    num_pages: int = Field(description="Pages in the pool, null page 0 included.")
    enable_prefix_caching: bool = Field(description="Whether full pages are cached by hash.")
    hash_algorithm: str = Field(description="Page hash function.")
    native_hashing: bool = Field(
        description="Whether page hashing runs its C loops (pagekeeper.core._native, built "
        "where a C compiler and OpenSSL's headers were); else pure Python, same hashes."
    )
    native_pool: bool = Field(
        description="Whether the page pool runs its per-page loops in C (pagekeeper.core."
        "_poolops, built where a C compiler was); else pure Python, same pages and events."
    )
    max_model_len: int = Field(description="Most tokens one request may hold.")


class LimitsModel(Model):
    max_requests_per_step: int = Field(description="Most frees+growths+admissions per Step.")
    max_tokens_per_step: int = Field(description="Most scheduled tokens per published batch.")
    max_clients: int = Field(description="Most registered clients.")
    max_message_bytes: int = Field(description="Largest gRPC message.")
    lease_ttl_s: float = Field(description="Default lease TTL in seconds.")


class PagesModel(Model):
    num_pages: int = Field(description="All pages, null page included.")
    num_free_pages: int = Field(description="Pages in the free queue (cached or not).")
    num_used_pages: int = Field(description="Pages held by requests.")
    num_cached_pages: int = Field(description="Pages in the prefix-cache index.")
    num_free_cached_pages: int = Field(description="Free pages still in the index.")
    usage: float = Field(description="Fraction of the pool in use, 0..1.")


class PrefixCacheModel(Model):
    hit_rate: float = Field(description="Hit tokens / queried tokens (0 when none queried).")
    queries_tokens: int = Field(description="Tokens looked up at admission.")
    hits_tokens: int = Field(description="Tokens served from the cache.")
    queries_requests: int = Field(description="Admissions that looked up the cache.")
    hits_requests: int = Field(description="Admissions with a non-empty hit.")
    num_evictions: int = Field(description="Cached pages evicted on reuse.")
    num_forgets: int = Field(
        default=0,
        description="Times a worker with an empty KV cache registered, emptying the cache.",
    )
    num_kv_loss_revocations: int = Field(
        default=0,
        description="Running requests freed and revoked by those registrations (their KV "
        "was not in the new worker).",
    )


class StepsModel(Model):
    num_steps: int = Field(description="Steps applied.")
    num_retries: int = Field(
        description="Retried steps answered from memory, since the process started."
    )
    num_rejected: int = Field(
        description="Steps rejected by validation (changed nothing), since the process started."
    )
    num_published: int = Field(description="Batches published to workers.")
    num_no_capacity: int = Field(description="Allocations answered no-capacity.")
    apply_p50_ms: float = Field(description="Median time to apply a step (recent steps), ms.")
    apply_p99_ms: float = Field(description="99th percentile of the same, ms.")


class DurabilityModel(Model):
    level: str = Field(description="none, process or fsync (see docs/reliability.md).")
    data_dir: str | None = Field(description="Where the durable state lives; null: none.")
    last_seq: int = Field(description="Sequence number of the last committed record.")
    records_since_snapshot: int = Field(description="Records a restart would replay.")
    latest_snapshot_seq: int = Field(description="The record the newest snapshot is after.")
    num_snapshots: int = Field(description="Snapshots taken since start-up.")
    journal_segments: int = Field(
        description="Journal segment files on disk (in use, or retired and not yet removed)."
    )
    journal_bytes: int = Field(description="Bytes of those files.")
    failure: str = Field(description="Why the log stopped taking writes; empty: it did not.")


class TlsModel(Model):
    enabled: bool = Field(description="Whether gRPC and HTTP are served over TLS.")
    client_certificates: bool = Field(
        description="Whether gRPC clients must present a certificate (mutual TLS)."
    )
    cert_file: str | None = Field(description="The served certificate's file; null: no TLS.")
    expires_at: float | None = Field(
        description="When the served certificate expires (Unix time); null: no TLS, or unread."
    )
    num_reloads: int = Field(description="Rotated certificate files loaded since start-up.")


class TokensModel(Model):
    source: Literal["none", "inline", "file"] = Field(
        description="Where the accepted tokens come from: none (no check), inline (the "
        "token setting) or file (a token file, re-read when it changes)."
    )
    file: str | None = Field(description="The token file; null unless source is file.")
    num_tokens: int = Field(description="Tokens accepted now (never the tokens themselves).")
    num_reloads: int = Field(description="Changed token files loaded since start-up.")


class AuthModel(Model):
    calls: TokensModel = Field(
        description="The bearer token every gRPC call and same-node connection presents."
    )
    admin: TokensModel = Field(description="The bearer token of the HTTP admin endpoints.")
    http_read_auth: bool = Field(
        description="Whether HTTP reads (/v1/...) need the service or admin token too."
    )


class KvEventsModel(Model):
    endpoint: str | None = Field(
        description="The ZeroMQ PUB endpoint KV events are published on in vLLM's format; "
        "null: not published there (WatchEvents and /v1/events serve them either way)."
    )
    replay_endpoint: str | None = Field(description="The ROUTER endpoint answering replays.")
    topic: str = Field(description="The topic frame of each batch.")
    hash_format: Literal["int", "bytes"] = Field(
        description="Page hashes as the low 64 bits (int, vLLM's default) or whole digests."
    )
    num_batches: int = Field(description="Batches published since start-up.")
    num_events: int = Field(description="KV events in those batches.")
    num_lost_events: int = Field(
        description="Events the event buffer dropped before the publisher sent them."
    )
    num_replays: int = Field(description="Replay requests answered.")
    num_reannounced_events: int = Field(
        description="Stored events sent at start-up for the cache a recovered pool's event "
        "buffer tells of (its pages still cached)."
    )


class PoolView(Model):
    """The pool at a glance."""

    config: PoolConfigModel
    groups: list[GroupModel] = Field(description="KV-cache groups, in group order.")
    limits: LimitsModel
    pages: PagesModel
    prefix_cache: PrefixCacheModel
    steps: StepsModel
    num_requests: int = Field(description="Running requests.")
    num_clients: int = Field(description="Registered clients.")
    last_event_seq: int = Field(description="Sequence number of the latest KV event.")
    padding_tokens_per_group: list[int] = Field(
        description="Allocated but unused token slots (last-page tails), per group."
    )
    durability: DurabilityModel = Field(description="The durable command log and snapshots.")
    tls: TlsModel = Field(description="Transport security of the two listeners.")
    auth: AuthModel = Field(description="Which bearer tokens are checked, and from where.")
    kv_events: KvEventsModel = Field(description="KV events for routers over ZeroMQ.")


# -- pages --------------------------------------------------------------------------------


class PageModel(Model):
    page_id: int = Field(description="Page id, 0 … num_pages-1.")
    state: PageState = Field(
        description="null (page 0), free, cached (free but hittable) or used (held)."
    )
    ref_count: int = Field(description="Requests holding the page.")
    is_cached: bool = Field(description="Whether the page is in the prefix-cache index.")
    group_id: int | None = Field(description="Group whose request holds or cached it.")
    page_hash: HexHash | None = Field(description="Its cached hash, if any.")


class PageList(Model):
    items: list[PageModel] = Field(description="Pages in id order.")
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null: end.")


# -- requests -----------------------------------------------------------------------------


class RequestSummary(Model):
    request_id: str = Field(description="The scheduler's request id.")
    owner: str = Field(description="Client id that admitted it.")
    num_tokens: int = Field(description="Tokens known (prompt + output so far).")
    num_computed_tokens: int = Field(description="Tokens whose KV is computed or scheduled.")
    num_cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")
    num_pages: list[int] = Field(description="Pages held, per group (null pages included).")


class RequestList(Model):
    items: list[RequestSummary] = Field(description="Running requests in admission order.")
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null: end.")


class RequestDetail(RequestSummary):
    page_ids: list[PageIdList] = Field(description="Physical table per group (0 = null page).")
    kernel_block_size: int | None = Field(
        description="The kernel block size asked for (?kernel_block_size=N), else null."
    )
    kernel_block_ids: list[PageIdList] | None = Field(
        description=(
            "Kernel table per group for that size (page p -> p*r … p*r+r-1); a Mamba "
            "group's state pages are never split and are shown whole."
        )
    )


class FreedRequest(Model):
    request_id: str = Field(description="The request whose pages were released.")
    owner: str = Field(description="The client that owned it.")


# -- clients ------------------------------------------------------------------------------


class ClientModel(Model):
    client_id: str = Field(description="Assigned at registration.")
    role: ClientRole = Field(description="scheduler or worker.")
    name: str = Field(description="The client's own label.")
    device: str = Field(description="Workers: cpu or cuda:N.")
    generation: int = Field(description="Registration generation (increases on takeover).")
    lease_ttl_s: float = Field(description="Granted lease TTL, seconds.")
    lease_remaining_s: float = Field(description="Seconds until the lease runs out (<0: expired).")
    kernel_block_sizes: list[int] = Field(
        description="Workers: chosen kernel block size per group."
    )
    num_requests: int = Field(description="Schedulers: running requests it owns.")
    revoked_request_ids: list[str] = Field(
        description="Schedulers: its requests an admin freed that it has not freed since "
        "(every step's answer lists them; a free of one is accepted as done)."
    )
    last_step_id: int = Field(description="Schedulers: last step id applied.")
    num_steps: int = Field(description="Schedulers: steps applied.")
    identity: str = Field(
        description="The TLS certificate subject the registration is bound to (mutual TLS); "
        "empty: none."
    )


# -- events -------------------------------------------------------------------------------
# (the extra keys' models first: lookups take them, stored events carry them)


class MultiModalKeyModel(Model):
    identifier: str = Field(min_length=1, description="Content hash of the input.")
    offset: int = Field(ge=0, description="First token of its placeholder.")
    length: int = Field(ge=1, description="Tokens its placeholder spans.")


class ExtraKeysModel(Model):
    lora_name: str | None = Field(default=None, description="LoRA adapter name.")
    lora_path: str | None = Field(default=None, description="LoRA adapter path.")
    mm_inputs: list[MultiModalKeyModel] = Field(
        default_factory=list, description="Multimodal inputs."
    )
    cache_salt: str | None = Field(default=None, description="Cache salt (first page only).")


class EventModel(Model):
    seq: int = Field(description="Sequence number, increasing from 1.")
    type: Literal["stored", "removed", "all_cleared"] = Field(description="Event kind.")
    group_id: int | None = Field(default=None, description="KV-cache group (stored/removed).")
    page_hashes: list[HexHash] = Field(default_factory=list, description="Hashes, hex.")
    parent_page_hash: HexHash | None = Field(default=None, description="stored: the chain parent.")
    token_ids: list[int] = Field(default_factory=list, description="stored: the pages' tokens.")
    page_size: int | None = Field(default=None, description="stored: tokens per page.")
    page_ids: list[int] = Field(default_factory=list, description="Pages concerned.")
    lora_name: str | None = Field(default=None, description="stored: the LoRA adapter, if any.")
    extra_keys: ExtraKeysModel | None = Field(
        default=None,
        description="stored: the storing request's extra keys that fall on these pages, when "
        "any do (each page hashed those that fall on it: the LoRA on every page, multimodal "
        "inputs overlapping it, the salt on page 0).",
    )
    first_page_index: int | None = Field(
        default=None,
        description="stored: page i of the event is page first_page_index + i of its "
        "request's table.",
    )


class EventList(Model):
    events: list[EventModel] = Field(description="Events with seq > since, oldest first.")
    fell_behind: bool = Field(
        description=(
            "Events after `since` were already dropped, or `since` is past every sequence "
            "number given out (the state was reset since): resynchronise; the events "
            "returned start at the oldest retained."
        )
    )
    first_retained_seq: int = Field(description="Oldest seq still held.")
    last_event_seq: int = Field(description="Latest seq.")


# -- lookup and admin ---------------------------------------------------------------------


class LookupBody(Model):
    token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(
        description="Token ids to look up (at most max_model_len)."
    )
    extra_keys: ExtraKeysModel | None = Field(default=None, description="Hash extra keys.")
    page_hashes: list[HexHash] | None = Field(
        default=None, description="Client-computed page hashes (hex), instead of hashing."
    )


class LookupAnswer(Model):
    num_hit_tokens: int = Field(
        description=(
            "Longest cached prefix, tokens (it may cover every token, unlike an admission's hit)."
        )
    )
    page_ids: list[PageIdList] = Field(description="The pages of that prefix, per group.")
    page_hashes: list[HexHash] = Field(description="Their hashes (hash page size), hex.")


class ResetAnswer(Model):
    num_dropped_pages: int = Field(description="Cached pages dropped from the index.")


_PROBLEM_DESCRIPTIONS = {
    400: "Invalid argument.",
    401: "Missing or wrong bearer token.",
    403: "Admin endpoints disabled (no admin token configured).",
    404: "No such resource.",
    409: "The state refuses it now (failed precondition).",
    429: "A configured limit would be exceeded.",
    503: "Not ready.",
}


def problem_responses(*statuses: int) -> dict[int | str, dict[str, object]]:
    """OpenAPI ``responses`` entries for the problem bodies a route can answer."""
    content = {PROBLEM_CONTENT_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}
    return {
        s: {"model": Problem, "description": _PROBLEM_DESCRIPTIONS[s], "content": content}
        for s in statuses
    }
