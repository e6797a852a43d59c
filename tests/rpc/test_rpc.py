"""Every RPC against the real server (subprocess, loopback, ephemeral ports)."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from tests.helpers.grpc_util import Scheduler, from_i32, from_i64, i32, status_of

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full pages of 16 + 4 tokens


def _unique_prompt(seed: int, n: int = 100) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 50_000, n)]


def test_get_pool_info(pagekeeper_server):
    stub = pagekeeper_server.stub()
    info = stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=pagekeeper_server.metadata)
    assert info.config.num_pages == 512
    assert info.config.max_model_len == 4096
    assert [g.page_size for g in info.config.groups] == [16]
    assert info.config.groups[0].kind == pb.GROUP_KIND_FULL
    assert info.config.hash_algorithm == "sha256_cbor"
    assert info.limits.max_requests_per_step == 1024
    assert info.limits.max_message_bytes == 64 * 1024 * 1024
    assert info.counters.num_free_pages + info.counters.num_used_pages == 511
    assert info.server_version


def test_every_call_needs_the_token(pagekeeper_server):
    stub = pagekeeper_server.stub()
    assert status_of(stub.GetPoolInfo, pb.GetPoolInfoRequest()) == grpc.StatusCode.UNAUTHENTICATED
    wrong = (("authorization", "Bearer nope"),)
    assert (
        status_of(stub.GetPoolInfo, pb.GetPoolInfoRequest(), metadata=wrong)
        == grpc.StatusCode.UNAUTHENTICATED
    )
    code = status_of(stub.RegisterClient, pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # Streams too.
    stream = stub.WatchEvents(pb.WatchEventsRequest())
    with pytest.raises(grpc.RpcError) as exc:
        next(iter(stream))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection(pagekeeper_server):
    channel = pagekeeper_server.channel()
    health = health_pb2_grpc.HealthStub(channel)
    # Health is open to orchestrators without credentials.
    for service in ("", "pagekeeper.v1.PagekeeperService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
        metadata=pagekeeper_server.metadata,
    )
    names = {s.name for s in next(iter(replies)).list_services_response.service}
    assert "pagekeeper.v1.PagekeeperService" in names
    assert "grpc.health.v1.Health" in names


def test_admission_hit_growth_batch_free(pagekeeper_server):
    sched = Scheduler(pagekeeper_server)
    prompt = _unique_prompt(1)
    first = sched.admit("adm-a", prompt)
    assert first.status == pb.ALLOCATION_STATUS_OK
    assert first.num_cached_tokens == 0
    pages_a = from_i32(first.new_page_ids[0])
    assert len(pages_a) == 7 and 0 not in pages_a
    second = sched.admit("adm-b", prompt)
    assert second.status == pb.ALLOCATION_STATUS_OK
    assert second.num_cached_tokens == 96
    assert from_i32(second.hit_page_ids[0]) == pages_a[:6]
    assert len(from_i32(second.new_page_ids[0])) == 1
    # Decode on a: 101 tokens fit in its 7 pages.
    grow = sched.step(
        growths=[pb.Growth(request_id="adm-a", num_new_tokens=1, new_token_ids=i32([7]))]
    )
    assert list(grow.results) == []  # OK without a new page: not listed
    # 11 more decode tokens fill page 7 (112 tokens); the 13th needs page 8: listed.
    for token in range(11):
        reply = sched.step(
            growths=[pb.Growth(request_id="adm-a", num_new_tokens=1, new_token_ids=i32([token]))]
        )
        assert list(reply.results) == []
    crossing = sched.step(
        growths=[pb.Growth(request_id="adm-a", num_new_tokens=1, new_token_ids=i32([99]))]
    )
    (result,) = crossing.results
    assert result.status == pb.ALLOCATION_STATUS_OK and len(from_i32(result.new_page_ids[0])) == 1
    pages_a += from_i32(result.new_page_ids[0])
    # The block table shows the same pages.
    table = sched.stub.GetBlockTable(
        pb.GetBlockTableRequest(request_id="adm-a", group_id=0, kernel_block_size=4),
        metadata=sched.md,
    )
    assert from_i32(table.page_ids) == pages_a
    assert from_i32(table.kernel_block_ids) == [p * 4 + j for p in pages_a for j in range(4)]
    assert table.num_tokens == 113 and table.num_computed_tokens == 113
    assert table.owner == sched.client_id
    # A batch with no worker registered is accepted and not published.
    reply = sched.step(batch=pb.Batch(request_ids=["adm-a", "adm-b"]))
    assert not reply.is_published
    freed = sched.free("adm-a", "adm-b")
    assert freed.results == []
    assert (
        status_of(
            sched.stub.GetBlockTable, pb.GetBlockTableRequest(request_id="adm-a"), metadata=sched.md
        )
        == grpc.StatusCode.NOT_FOUND
    )


def test_decodes_in_column_form(pagekeeper_server):
    """The same decode steps as growth messages and as columns give the same pages."""
    sched = Scheduler(pagekeeper_server)
    for rid in ("col-a", "col-b"):
        assert sched.admit(rid, _unique_prompt(11, 30)).status == pb.ALLOCATION_STATUS_OK
    # 30 tokens each in 2 pages of 16: two decodes fit, the third needs a page.
    for token in (5, 6):
        reply = sched.step(
            growth_columns=pb.GrowthColumns(
                request_ids=["col-a", "col-b"], new_token_ids=i32([token, token + 1])
            )
        )
        assert list(reply.results) == []
    reply = sched.step(
        growth_columns=pb.GrowthColumns(
            request_ids=["col-a", "col-b"],
            new_token_ids=i32([7, 8, 9, 10]),
            num_new_token_ids=i32([1, 3]),
            num_new_tokens=i32([1, 3]),
        ),
        batch=pb.Batch(request_ids=["col-a", "col-b"]),
    )
    assert [r.request_id for r in reply.results] == ["col-a", "col-b"]
    assert all(r.status == pb.ALLOCATION_STATUS_OK for r in reply.results)
    a_page, b_page = (from_i32(r.new_page_ids[0]) for r in reply.results)
    assert len(a_page) == len(b_page) == 1 and a_page != b_page
    table = sched.stub.GetBlockTable(
        pb.GetBlockTableRequest(request_id="col-b", group_id=0), metadata=sched.md
    )
    assert table.num_tokens == 35 and table.num_computed_tokens == 35
    assert from_i32(table.page_ids)[-1:] == b_page
    sched.free("col-a", "col-b")


def test_packed_page_hashes_are_the_hashes_sent_one_by_one(pagekeeper_server):
    """``packed_page_hashes`` (the pool's page-hash size each, which GetPoolInfo says)
    name the pages as ``page_hashes`` does: a prompt admitted with them is hit by the
    same hashes sent either way, and its ``stored`` event carries them."""
    sched = Scheduler(pagekeeper_server)
    info = sched.stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=sched.md)
    assert info.config.hash_algorithm == "sha256_cbor" and info.config.page_hash_size == 32
    prompt = _unique_prompt(3, 64)  # 4 full pages of 16
    names = [bytes([7, i]) * 16 for i in range(4)]
    first = sched.admit("pk-a", prompt, packed_page_hashes=b"".join(names))
    assert first.status == pb.ALLOCATION_STATUS_OK and first.num_cached_tokens == 0
    sched.free("pk-a")
    # Other tokens, the same names: the hashes decide (the client vouches for them).
    other = _unique_prompt(4, 65)
    assert sched.admit("pk-b", other, page_hashes=names[:2]).num_cached_tokens == 32
    sched.free("pk-b")
    assert (
        sched.admit("pk-c", other, packed_page_hashes=b"".join(names[:3])).num_cached_tokens == 48
    )
    sched.free("pk-c")
    events = next(
        iter(sched.stub.WatchEvents(pb.WatchEventsRequest(since_seq=0), metadata=sched.md))
    )
    stored = [e.stored for e in events.events if e.HasField("stored")]
    assert any(list(s.page_hashes) == names for s in stored)
    # Lookup takes them packed too, and refuses what an admission refuses.
    found = sched.stub.Lookup(
        pb.LookupRequest(token_ids=i32(other), packed_page_hashes=b"".join(names[:2])),
        metadata=sched.md,
    )
    # (pk-b's pages past its two names were hashed on from them: hit as well)
    assert found.num_hit_tokens == 64 and list(found.page_hashes)[:2] == names[:2]
    for fields, reason in (
        ({"packed_page_hashes": names[0] * 2}, "repeats"),
        ({"packed_page_hashes": names[0][:20]}, "not a whole number of 32-byte hashes"),
        ({"packed_page_hashes": names[0], "page_hashes": names[:1]}, "both set"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            sched.stub.Lookup(pb.LookupRequest(token_ids=i32(other), **fields), metadata=sched.md)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason in refused.value.details()


def test_growth_page_hashes_name_the_pages_generated_tokens_complete(pagekeeper_server):
    """A growth's hashes (packed at the pool's size or their own, or in the column form)
    name the pages its new tokens complete, so a prompt holding the same text with the
    same hashes (a chat's next turn, hashed by an engine unlike the service) hits them; too
    many is refused."""
    sched = Scheduler(pagekeeper_server)
    info = sched.stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=sched.md)
    assert info.config.accepts_growth_page_hashes
    names = [bytes([9, i]) * 16 for i in range(8)]
    prompt = _unique_prompt(11, 32)  # 2 full pages of 16
    generated = _unique_prompt(12, 48)
    forms = {
        "packed": lambda rid, toks, hashes: sched.step(
            growths=[
                pb.Growth(
                    request_id=rid,
                    num_new_tokens=len(toks),
                    new_token_ids=i32(toks),
                    packed_page_hashes=b"".join(hashes),
                )
            ]
        ),
        "sized": lambda rid, toks, hashes: sched.step(
            growths=[
                pb.Growth(
                    request_id=rid,
                    num_new_tokens=len(toks),
                    new_token_ids=i32(toks),
                    packed_page_hashes=b"".join(h[:16] for h in hashes),
                    page_hash_size=16,
                )
            ]
        ),
        "columns": lambda rid, toks, hashes: sched.step(
            growth_columns=pb.GrowthColumns(
                request_ids=[rid],
                new_token_ids=i32(toks),
                num_new_token_ids=i32([len(toks)]),
                num_new_tokens=i32([len(toks)]),
                packed_page_hashes=b"".join(hashes),
                num_page_hashes=i32([len(hashes)]),
            )
        ),
    }
    for k, (form, grow) in enumerate(forms.items()):
        rid = f"gh-{form}"
        hashes = [bytes([k]) + n[1:] for n in names]
        if form == "sized":
            hashes = [h[:16] for h in hashes]  # an engine's 16-byte hashes (xxh3-128)
        assert sched.admit(rid, prompt, page_hashes=hashes[:2]).status == pb.ALLOCATION_STATUS_OK
        with pytest.raises(grpc.RpcError) as refused:
            grow(rid, generated[:16], hashes[2:4])  # 16 tokens complete one page
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2 page hashes for the 1 pages" in refused.value.details()
        # Three pages complete; the client names two, the service hashes the third.
        (result,) = grow(rid, generated, hashes[2:4]).results
        assert result.status == pb.ALLOCATION_STATUS_OK
        found = sched.stub.Lookup(
            pb.LookupRequest(token_ids=i32(prompt + generated), page_hashes=hashes[:4]),
            metadata=sched.md,
        )
        # Every page hits: two admitted, two named by the growth, one the service chained on.
        assert found.num_hit_tokens == 80
        assert list(found.page_hashes)[:4] == hashes[:4]
        sched.free(rid)


def test_lookup_has_no_side_effects(pagekeeper_server):
    sched = Scheduler(pagekeeper_server)
    prompt = _unique_prompt(2, 64)
    sched.admit("lk-a", prompt)
    before = sched.stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=sched.md).counters
    found = sched.stub.Lookup(pb.LookupRequest(token_ids=i32(prompt)), metadata=sched.md)
    assert found.num_hit_tokens == 64
    assert len(from_i32(found.page_ids[0])) == 4
    assert len(found.page_hashes) == 4
    after = sched.stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=sched.md).counters
    assert (before.num_free_pages, before.prefix_queries_tokens) == (
        after.num_free_pages,
        after.prefix_queries_tokens,
    )
    miss = sched.stub.Lookup(
        pb.LookupRequest(token_ids=i32(prompt), extra_keys=pb.ExtraKeys(cache_salt="other")),
        metadata=sched.md,
    )
    assert miss.num_hit_tokens == 0
    sched.free("lk-a")


def test_retried_step_is_answered_from_memory(pagekeeper_server):
    sched = Scheduler(pagekeeper_server)
    request = sched.request(
        admissions=[pb.Admission(request_id="retry-a", token_ids=i32(_unique_prompt(3)))]
    )
    first = sched.stub.Step(request, metadata=sched.md)
    again = sched.stub.Step(request, metadata=sched.md)
    assert again.is_retry and not first.is_retry
    assert list(again.results) == list(first.results)
    assert again.num_free_pages == first.num_free_pages
    # Same id, different content: still the stored answer, nothing applied.
    other = pb.StepRequest()
    other.CopyFrom(request)
    other.admissions[0].request_id = "retry-b"
    third = sched.stub.Step(other, metadata=sched.md)
    assert third.is_retry and third.results[0].request_id == "retry-a"
    older = pb.StepRequest(
        client_id=sched.client_id, generation=sched.generation, step_id=request.step_id - 1
    )
    if older.step_id >= 1:
        assert (
            status_of(sched.stub.Step, older, metadata=sched.md)
            == grpc.StatusCode.FAILED_PRECONDITION
        )
    sched.free("retry-a")


def test_no_capacity_changes_nothing(server_factory):
    server = server_factory("--num-pages", "8")
    sched = Scheduler(server)
    ok = sched.admit("nc-a", list(range(64)))  # 4 pages of 7
    assert ok.status == pb.ALLOCATION_STATUS_OK
    free_before = server.stub().GetPoolInfo(pb.GetPoolInfoRequest()).counters.num_free_pages
    reply = sched.step(
        admissions=[pb.Admission(request_id="nc-b", token_ids=i32(range(100, 164)))],
        batch=pb.Batch(request_ids=["nc-a", "nc-b"]),
    )
    assert reply.results[0].status == pb.ALLOCATION_STATUS_NO_CAPACITY
    assert list(reply.unscheduled_request_ids) == ["nc-b"]
    assert reply.num_free_pages == free_before == 3
    requests = server.http().get("/v1/requests").json()["items"]
    assert [r["request_id"] for r in requests] == ["nc-a"]


def test_heartbeat_unregister_and_takeover(pagekeeper_server):
    sched = Scheduler(pagekeeper_server)
    sched.admit("hb-a", _unique_prompt(4))
    beat = sched.stub.Heartbeat(
        pb.HeartbeatRequest(client_id=sched.client_id, generation=sched.generation),
        metadata=sched.md,
    )
    assert beat.lease_ttl_ms == 3_600_000
    # A restarted scheduler takes its id over: new generation, same requests, old one fenced.
    takeover = sched.stub.RegisterClient(
        pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, client_id=sched.client_id),
        metadata=sched.md,
    )
    assert takeover.generation == sched.generation + 1
    assert takeover.last_step_id == sched.step_id
    stale = sched.request(free_request_ids=["hb-a"])
    assert status_of(sched.stub.Step, stale, metadata=sched.md) == grpc.StatusCode.ABORTED
    sched.generation = takeover.generation
    gone = sched.stub.Unregister(
        pb.UnregisterRequest(client_id=sched.client_id, generation=sched.generation),
        metadata=sched.md,
    )
    assert gone.num_freed_requests == 1
    assert (
        status_of(
            sched.stub.Heartbeat,
            pb.HeartbeatRequest(client_id=sched.client_id, generation=sched.generation),
            metadata=sched.md,
        )
        == grpc.StatusCode.NOT_FOUND
    )


def test_reset_prefix_cache(server_factory):
    server = server_factory("--num-pages", "64")
    sched = Scheduler(server)
    sched.admit("rs-a", list(range(40)))
    assert (
        status_of(sched.stub.ResetPrefixCache, pb.ResetPrefixCacheRequest())
        == grpc.StatusCode.FAILED_PRECONDITION
    )
    sched.free("rs-a")
    reply = sched.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    assert reply.num_dropped_pages == 2
    assert sched.stub.Lookup(pb.LookupRequest(token_ids=i32(range(40)))).num_hit_tokens == 0


def test_watch_events_resume_and_fell_behind(server_factory):
    server = server_factory("--num-pages", "64", "--event-buffer-size", "4")
    sched = Scheduler(server)
    stub = server.stub()
    stream = stub.WatchEvents(pb.WatchEventsRequest(since_seq=0))
    messages = iter(stream)
    hello = next(messages)  # sent at once: the watcher knows it is subscribed
    assert list(hello.events) == [] and hello.last_event_seq == 0
    sched.admit("ev-a", list(range(40)))  # 2 full pages cached: one stored event
    got = next(messages)
    assert [e.WhichOneof("event") for e in got.events] == ["stored"]
    stored = got.events[0].stored
    assert from_i32(stored.token_ids) == list(range(32))
    assert len(stored.page_hashes) == 2 and not stored.HasField("parent_page_hash")
    stream.cancel()
    # Six more caching acts overflow a 4-event buffer: a watcher from 0 fell behind.
    for i in range(6):
        sched.admit(f"ev-{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 20)))
    resumed = next(iter(stub.WatchEvents(pb.WatchEventsRequest(since_seq=1))))
    assert resumed.fell_behind
    assert resumed.first_retained_seq == resumed.events[0].seq == resumed.last_event_seq - 3
    # Resuming from a retained seq is exact.
    tail = next(iter(stub.WatchEvents(pb.WatchEventsRequest(since_seq=resumed.last_event_seq - 1))))
    assert not tail.fell_behind and [e.seq for e in tail.events] == [resumed.last_event_seq]


def test_worker_registration_and_watch_tables(server_factory):
    # 64-token pages; the worker's backends take 16/32 exactly or multiples of 16: the page
    # size 64 fails FLASHINFER, so the largest listed divisor all accept wins (32).
    server = server_factory("--num-pages", "64", "--page-size", "64", "--max-model-len", "1024")
    stub = server.stub()
    backends = pb.GroupKernelSupport(
        group_id=0,
        backends=[
            pb.KernelBackend(name="FLASHINFER", block_sizes=[16, 32]),
            pb.KernelBackend(name="FLASH_ATTN", multiple_of=[16]),
        ],
    )
    worker = stub.RegisterClient(
        pb.RegisterClientRequest(
            role=pb.CLIENT_ROLE_WORKER, device="cpu", kernel_support=[backends]
        )
    )
    assert [(k.group_id, k.kernel_block_size) for k in worker.kernel_block_sizes] == [(0, 32)]
    assert worker.ring.kind == pb.RING_KIND_STREAM
    assert [(t.group_id, t.kernel_block_size) for t in worker.ring.geometry.tables] == [(0, 32)]
    assert worker.ring.geometry.tables[0].max_kernel_blocks_per_row == 16 * 2
    assert worker.pool.groups[0].page_size == 64

    stream = stub.WatchTables(
        pb.WatchTablesRequest(client_id=worker.client_id, generation=worker.generation)
    )
    received: list[pb.WatchTablesResponse] = []
    done = threading.Event()

    def read() -> None:
        for message in stream:
            received.append(message)
            done.set()
            return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)  # let the stream subscribe before the step publishes
    sched = Scheduler(server)
    reply = sched.step(
        admissions=[
            pb.Admission(request_id="wt-a", token_ids=i32(range(100))),
            pb.Admission(request_id="wt-b", token_ids=i32(range(500, 530))),
        ],
        batch=pb.Batch(request_ids=["wt-b", "wt-a"]),
    )
    assert reply.is_published, reply.publish_error
    assert done.wait(10)
    stream.cancel()
    message = received[0]
    assert message.step_seq == sched.step_id
    assert message.epoch == worker.ring.generation
    (table,) = message.tables
    assert (table.group_id, table.kernel_block_size, table.num_reqs) == (0, 32, 2)
    block_table = np.frombuffer(table.block_table, dtype="<i4").reshape(
        table.num_reqs, table.num_cols
    )
    lengths = from_i32(table.row_lengths)
    pages_a = from_i32(reply.results[0].new_page_ids[0])
    pages_b = from_i32(reply.results[1].new_page_ids[0])
    assert lengths == [len(pages_b) * 2, len(pages_a) * 2]
    assert block_table[1, : lengths[1]].tolist() == [p * 2 + j for p in pages_a for j in range(2)]
    assert block_table[0, : lengths[0]].tolist() == [p * 2 + j for p in pages_b for j in range(2)]
    slots = from_i64(table.slot_mapping)
    assert len(slots) == 130
    assert slots[:30] == [pages_b[0] * 64 + i for i in range(30)]
    # A worker may not step; a scheduler may not watch tables.
    assert (
        status_of(
            stub.Step,
            pb.StepRequest(client_id=worker.client_id, generation=worker.generation, step_id=1),
        )
        == grpc.StatusCode.PERMISSION_DENIED
    )
    sched_stream = stub.WatchTables(
        pb.WatchTablesRequest(client_id=sched.client_id, generation=sched.generation)
    )
    with pytest.raises(grpc.RpcError) as exc:
        next(iter(sched_stream))
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Publishing steps must increase pool-wide: a second scheduler starting at step 1 with a
    # batch is refused (FAILED_PRECONDITION) and told where to start at registration.
    other = Scheduler(server)
    assert other.registration.last_published_step_seq == sched.step_id
    low = pb.StepRequest(
        client_id=other.client_id, generation=other.generation, step_id=1, batch=pb.Batch()
    )
    assert status_of(other.stub.Step, low) == grpc.StatusCode.FAILED_PRECONDITION
    assert other.step(batch=pb.Batch()).is_published


def test_shared_memory_ring_lifecycle(server_factory):
    """The default transport: the first worker gets a /dev/shm ring, steps are written into
    it, the ring goes away with the last worker (and with the server)."""
    import os

    server = server_factory("--num-pages", "64", publish_transport="shm")
    stub = server.stub()
    worker = stub.RegisterClient(pb.RegisterClientRequest(role=pb.CLIENT_ROLE_WORKER, device="cpu"))
    ring = worker.ring
    assert ring.kind == pb.RING_KIND_SHM and ring.size_bytes > 0
    assert os.path.exists(ring.path)
    assert [(t.group_id, t.kernel_block_size) for t in ring.geometry.tables] == [(0, 16)]
    sched = Scheduler(server)
    reply = sched.step(
        admissions=[pb.Admission(request_id="shm-a", token_ids=i32(range(40)))],
        batch=pb.Batch(request_ids=["shm-a"]),
    )
    # Slots are taken in turn from the first, whatever the step ids.
    assert reply.is_published and reply.published_slot == 0
    again = sched.step(batch=pb.Batch(request_ids=["shm-a"]))
    assert again.is_published and again.published_slot == 1 % ring.geometry.depth
    beat = stub.Heartbeat(
        pb.HeartbeatRequest(client_id=worker.client_id, generation=worker.generation)
    )
    assert beat.ring.generation == ring.generation
    stub.Unregister(pb.UnregisterRequest(client_id=worker.client_id, generation=worker.generation))
    assert not os.path.exists(ring.path)
    assert not sched.step(batch=pb.Batch(request_ids=["shm-a"])).is_published
