"""Recent KV events (the same buffer WatchEvents streams from)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from pagekeeper.core.events import AllCleared, KVEvent, PageRemoved, PageStored
from pagekeeper.core.types import ExtraKeys
from pagekeeper.rest.deps import StateDep
from pagekeeper.rest.schemas import EventList, EventModel, ExtraKeysModel, MultiModalKeyModel

router = APIRouter(tags=["events"])

MAX_LIMIT = 10000


def extra_keys_model(extra: ExtraKeys) -> ExtraKeysModel:
    return ExtraKeysModel(
        lora_name=extra.lora_name,
        lora_path=extra.lora_path,
        mm_inputs=[
            MultiModalKeyModel(identifier=m.identifier, offset=m.offset, length=m.length)
            for m in extra.mm_inputs
        ],
        cache_salt=extra.cache_salt,
    )


def event_model(event: KVEvent) -> EventModel:
    if isinstance(event, PageStored):
        return EventModel(
            seq=event.seq,
            type="stored",
            group_id=event.group_id,
            page_hashes=[h.hex() for h in event.page_hashes],
            parent_page_hash=event.parent_page_hash.hex() if event.parent_page_hash else None,
            token_ids=list(event.token_ids),
            page_size=event.page_size,
            page_ids=list(event.page_ids),
            lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None else extra_keys_model(event.extra_keys),
            first_page_index=event.first_page,
        )
    if isinstance(event, PageRemoved):
        return EventModel(
            seq=event.seq,
            type="removed",
            group_id=event.group_id,
            page_hashes=[h.hex() for h in event.page_hashes],
            page_ids=list(event.page_ids),
        )
    assert isinstance(event, AllCleared)
    return EventModel(seq=event.seq, type="all_cleared")


@router.get("/v1/events", response_model=EventList, summary="KV events after a sequence number.")
async def list_events(
    state: StateDep,
    since: Annotated[int, Query(ge=0, lt=2**63, description="Return events with seq > since.")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Most events returned.")] = 1000,
) -> EventList:
    page = state.events_since(since, limit)
    return EventList(
        events=[event_model(e) for e in page.events],
        fell_behind=page.fell_behind,
        first_retained_seq=page.first_retained_seq,
        last_event_seq=page.last_event_seq,
    )
