"""The pool at a glance."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter

from pagekeeper.auth import BearerTokens
from pagekeeper.core.hashing import native_hashing
from pagekeeper.core.pool import native_pool
from pagekeeper.rest.deps import RuntimeDep
from pagekeeper.rest.schemas import (
    AuthModel,
    DurabilityModel,
    GroupModel,
    KvEventsModel,
    LimitsModel,
    PagesModel,
    PoolConfigModel,
    PoolView,
    PrefixCacheModel,
    StepsModel,
    TlsModel,
    TokensModel,
)
from pagekeeper.runtime import Runtime

router = APIRouter(tags=["pool"])


@router.get("/v1/pool", response_model=PoolView, summary="Configuration, usage and counters.")
async def get_pool(runtime: RuntimeDep) -> PoolView:
    state, settings = runtime.state, runtime.settings
    config = settings.pool
    stats = state.stats()
    counters = state.counters
    percentiles = counters.step_percentiles()
    page_states = state.manager.page_states()
    page_groups, ref_counts = page_states["group"], page_states["ref_count"]
    used_per_group = np.bincount(
        page_groups[(ref_counts > 0) & (page_groups >= 0)].astype(np.int64),
        minlength=len(config.groups),
    )
    return PoolView(
        config=PoolConfigModel(
            num_pages=config.num_pages,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_algorithm=config.hash_algorithm,
            native_hashing=native_hashing(),
            native_pool=native_pool(),
            max_model_len=config.max_model_len,
        ),
        groups=[
            GroupModel(
                group_id=i,
                kind=g.kind.value,
                page_size=g.page_size,
                window=g.window,
                chunk=g.chunk,
                enable_state_caching=g.enable_state_caching,
                name=g.name,
                num_used_pages=int(used_per_group[i]),
            )
            for i, g in enumerate(config.groups)
        ],
        limits=LimitsModel(
            max_requests_per_step=settings.max_requests_per_step,
            max_tokens_per_step=settings.max_tokens_per_step,
            max_clients=settings.max_clients,
            max_message_bytes=settings.max_message_bytes,
            lease_ttl_s=settings.lease_ttl_s,
        ),
        pages=PagesModel(
            num_pages=stats.num_pages,
            num_free_pages=stats.num_free_pages,
            num_used_pages=stats.num_used_pages,
            num_cached_pages=stats.num_cached_pages,
            num_free_cached_pages=stats.num_free_cached_pages,
            usage=stats.usage,
        ),
        prefix_cache=PrefixCacheModel(
            hit_rate=stats.prefix_hit_rate,
            queries_tokens=stats.prefix_queries_tokens,
            hits_tokens=stats.prefix_hits_tokens,
            queries_requests=stats.prefix_queries_requests,
            hits_requests=stats.prefix_hits_requests,
            num_evictions=stats.num_evictions,
            num_forgets=counters.num_prefix_cache_forgets,
            num_kv_loss_revocations=counters.num_kv_loss_revocations,
        ),
        steps=StepsModel(
            num_steps=counters.num_steps,
            num_retries=counters.num_step_retries,
            num_rejected=counters.num_steps_rejected,
            num_published=counters.num_published,
            num_no_capacity=stats.num_no_capacity,
            apply_p50_ms=percentiles["p50"] * 1000,
            apply_p99_ms=percentiles["p99"] * 1000,
        ),
        num_requests=stats.num_requests,
        num_clients=len(state.clients()),
        last_event_seq=state.last_event_seq,
        padding_tokens_per_group=list(stats.padding_tokens_per_group),
        durability=_durability(runtime),
        tls=_tls(runtime),
        kv_events=_kv_events(runtime),
        auth=AuthModel(
            calls=_tokens(runtime.tokens.calls),
            admin=_tokens(runtime.tokens.admin),
            http_read_auth=runtime.settings.http_read_auth,
        ),
    )


def _kv_events(runtime: Runtime) -> KvEventsModel:
    kv, settings = runtime.kv_events, runtime.settings
    return KvEventsModel(
        endpoint=None if kv is None else kv.endpoint,
        replay_endpoint=None if kv is None else kv.replay_endpoint,
        topic=settings.kv_events_topic,
        hash_format="bytes" if settings.kv_events_hash_format == "bytes" else "int",
        num_batches=0 if kv is None else kv.next_seq,
        num_events=0 if kv is None else kv.num_events,
        num_lost_events=0 if kv is None else kv.num_lost_events,
        num_replays=0 if kv is None else kv.num_replays,
        num_reannounced_events=0 if kv is None else kv.num_reannounced,
    )


def _tokens(holder: BearerTokens | None) -> TokensModel:
    if holder is None:
        return TokensModel(source="none", file=None, num_tokens=0, num_reloads=0)
    return TokensModel(
        source="file" if holder.path is not None else "inline",
        file=holder.path,
        num_tokens=holder.count,
        num_reloads=holder.num_reloads,
    )


def _tls(runtime: Runtime) -> TlsModel:
    tls = runtime.tls
    if tls is None:
        return TlsModel(
            enabled=False, client_certificates=False, cert_file=None, expires_at=None, num_reloads=0
        )
    return TlsModel(
        enabled=True,
        client_certificates=tls.requires_client_certificates,
        cert_file=tls.cert_file,
        expires_at=tls.not_after,
        num_reloads=tls.num_reloads,
    )


def _durability(runtime: Runtime) -> DurabilityModel:
    d = runtime.durability
    if d is None:
        return DurabilityModel(
            level="none",
            data_dir=None,
            last_seq=0,
            records_since_snapshot=0,
            latest_snapshot_seq=0,
            num_snapshots=0,
            journal_segments=0,
            journal_bytes=0,
            failure="",
        )
    segments, size = d.journal_usage or (0, 0)
    return DurabilityModel(
        level=d.level.value,
        data_dir=str(d.data_dir),
        last_seq=d.last_seq,
        records_since_snapshot=d.num_records_since_snapshot,
        latest_snapshot_seq=d.latest_snapshot_seq,
        num_snapshots=d.stats.num_snapshots,
        journal_segments=segments,
        journal_bytes=size,
        failure=d.failure,
    )
