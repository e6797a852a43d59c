"""Prefix lookup (no side effects)."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter

from pagekeeper.core.errors import InvalidArgument
from pagekeeper.core.types import ExtraKeys, MultiModalKey
from pagekeeper.rest.deps import StateDep
from pagekeeper.rest.schemas import LookupAnswer, LookupBody, problem_responses

router = APIRouter(tags=["lookup"])


@router.post(
    "/v1/lookup",
    response_model=LookupAnswer,
    summary="Longest cached prefix.",
    responses=problem_responses(400),
)
async def lookup(state: StateDep, body: LookupBody) -> LookupAnswer:
    extra = None
    if body.extra_keys is not None:
        e = body.extra_keys
        extra = ExtraKeys(
            lora_name=e.lora_name,
            lora_path=e.lora_path,
            mm_inputs=tuple(MultiModalKey(m.identifier, m.offset, m.length) for m in e.mm_inputs),
            cache_salt=e.cache_salt,
        )
    hashes = None
    if body.page_hashes is not None:
        if any(len(h) % 2 or not h for h in body.page_hashes):
            raise InvalidArgument("page_hashes must be non-empty hex strings of whole bytes")
        hashes = tuple(bytes.fromhex(h) for h in body.page_hashes)
    result = state.lookup(np.asarray(body.token_ids, dtype=np.int32), extra, hashes)
    return LookupAnswer(
        num_hit_tokens=result.num_hit_tokens,
        page_ids=[list(pages) for pages in result.page_ids],
        page_hashes=[h.hex() for h in result.page_hashes],
    )
