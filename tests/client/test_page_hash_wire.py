"""How the client sends an admission's page hashes: packed into one field
(``packed_page_hashes``) when the service says its page-hash size and every hash has it,
else one field each (a service from before the packed field, or hashes of other sizes,
which the service then checks as they are)."""

from __future__ import annotations

import dataclasses

from pagekeeper_client.client import SchedulerState
from pagekeeper_client.types import GroupInfo, GroupKind, PoolConfig

POOL = PoolConfig(
    num_pages=64,
    groups=(GroupInfo(0, GroupKind.FULL, 4),),
    enable_prefix_caching=True,
    hash_algorithm="sha256_cbor",
    max_model_len=256,
    page_hash_size=32,
)


def _message(pool: PoolConfig, hashes: list[bytes]):
    admission = SchedulerState(pool).plan_admission(
        "a",
        list(range(12)),
        num_new_tokens=0,
        extra_keys=None,
        page_hashes=hashes,
        num_lookahead_tokens=0,
        enable_cache_read=True,
    )
    return admission.message


def test_hashes_of_the_pool_size_travel_packed() -> None:
    hashes = [bytes([i]) * 32 for i in range(3)]
    message = _message(POOL, hashes)
    assert message.packed_page_hashes == b"".join(hashes)
    assert list(message.page_hashes) == []


def test_other_hashes_or_an_older_service_get_a_field_each() -> None:
    mixed = [b"\x01" * 32, b"\x02" * 16]
    assert list(_message(POOL, mixed).page_hashes) == mixed
    older = dataclasses.replace(POOL, page_hash_size=0)
    hashes = [bytes([i]) * 32 for i in range(3)]
    message = _message(older, hashes)
    assert list(message.page_hashes) == hashes and message.packed_page_hashes == b""
    assert _message(POOL, []).packed_page_hashes == b""


def test_lookups_send_them_the_same_way() -> None:
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
    from pagekeeper_client.client import put_page_hashes

    hashes = [bytes([i]) * 32 for i in range(3)]
    packed = pb.LookupRequest()
    put_page_hashes(packed, hashes, 32)
    assert packed.packed_page_hashes == b"".join(hashes) and not packed.page_hashes
    one_each = pb.LookupRequest()
    put_page_hashes(one_each, hashes, 0)
    assert list(one_each.page_hashes) == hashes and not one_each.packed_page_hashes
