"""The scheduler-side client against the real service (subprocess, loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import numpy as np
import pytest

from pagekeeper_client import (
    AbortedError,
    AllocationStatus,
    AlreadyExistsError,
    AsyncPagekeeperClient,
    DeadlineExceededError,
    FailedPreconditionError,
    Growth,
    InvalidArgumentError,
    NotFoundError,
    NotRegisteredError,
    PagekeeperClient,
    PagekeeperError,
    PageStored,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.errors import error_from_rpc
from tests.client._util import (
    AsyncCountingInterceptor,
    AsyncHeartbeatsDownUntilAStep,
    CancelStepAfterDelivery,
    CountingInterceptor,
    DropStepReplies,
    HeartbeatsDownUntilAStep,
    LeaseFaults,
    SlowSteps,
    tokens,
)


@pytest.fixture
def connect(pagekeeper_server):
    """``connect(**client_kwargs)`` -> a registered scheduler on the shared server."""
    clients: list[PagekeeperClient] = []

    def make(register: bool = True, **kwargs) -> PagekeeperClient:
        kwargs.setdefault("token", pagekeeper_server.token)
        client = PagekeeperClient(pagekeeper_server.grpc_address, **kwargs)
        clients.append(client)
        if register:
            client.register("scheduler", name="test-client")
        return client

    yield make
    for client in clients:
        client.close()


def test_round_trip_admit_lookup_decode_block_table_free(connect):
    client = connect()
    prompt = tokens(1, 100)  # 6 full pages of 16 + 4 tokens
    a = client.admit("rt-a", prompt)
    assert a.ok and a.num_cached_tokens == 0
    pages_a = a.new_page_ids[0].tolist()
    assert len(pages_a) == 7 and 0 not in pages_a
    assert client.page_ids("rt-a").tolist() == pages_a
    b = client.admit("rt-b", prompt)
    assert b.num_cached_tokens == 96
    assert b.hit_page_ids[0].tolist() == pages_a[:6]
    assert client.page_ids("rt-b").tolist() == pages_a[:6] + b.new_page_ids[0].tolist()

    hit = client.lookup(prompt)
    assert hit.num_hit_tokens == 96 and hit.page_ids[0].tolist() == pages_a[:6]

    for i in range(30):  # crosses into pages 8 and 9 of rt-a
        client.allocate_slots("rt-a", 1, new_token_ids=[7 + i])
        client.step(batch=["rt-a"])
    view = client.request("rt-a")
    table = client.block_table("rt-a", kernel_block_size=4)
    assert table.page_ids.tolist() == view.page_ids[0].tolist() == client.page_ids("rt-a").tolist()
    assert len(table.page_ids) == 9
    assert table.kernel_block_ids.tolist() == [p * 4 + j for p in table.page_ids for j in range(4)]
    # The last decode (token 130) needed no page and completed none: held back, so the
    # service's counts trail the client's by it until the request's next growth or a flush.
    assert (view.num_tokens, view.num_computed_tokens, view.num_held_tokens) == (130, 130, 1)
    assert (table.num_tokens, table.num_computed_tokens) == (129, 129)
    client.flush()
    table = client.block_table("rt-a", kernel_block_size=4)
    assert (table.num_tokens, table.num_computed_tokens) == (130, 130)
    assert client.request("rt-a").num_held_tokens == 0
    assert table.owner == client.client_id

    client.free("rt-a", "rt-b")
    assert not client.has_request("rt-a")
    with pytest.raises(NotFoundError, match="holds no pages"):
        client.block_table("rt-a")
    info = client.pool_info()
    assert info.config.num_pages == 512 and info.counters.num_steps > 0


def test_decodes_that_fit_make_no_call(connect):
    counter = CountingInterceptor()
    client = connect(interceptors=[counter])
    ids = [f"nc-{i}" for i in range(3)]
    for i, rid in enumerate(ids):
        client.admit(rid, tokens(10 + i, 20))  # 2 pages: room up to token 32
    assert counter.calls["Step"] == 3  # one call per synchronous admission

    for step in range(12):  # tokens 21..32: every decode fits in the second page
        before = counter.total
        for rid in ids:
            got = client.allocate_slots(rid, 1, new_token_ids=[100 + step])
            assert got.ok and got.is_local and got.new_page_ids == ()
        assert counter.total == before  # answered locally: no call at all
        result = client.step(batch=ids)
        assert counter.total == before + 1  # the whole step: one round trip
        assert result.num_local_growths == 3 and result.results == ()

    # Token 33 crosses into a third page: sync=True asks at once (one call each) ...
    before = counter.total
    got = client.allocate_slots(ids[0], 1, new_token_ids=[7], sync=True)
    assert counter.total == before + 1
    assert got.ok and not got.is_local and len(got.new_page_ids[0]) == 1
    assert client.block_table(ids[0]).page_ids[-1] == got.new_page_ids[0][0]
    # ... sync=False queues it for the step: no call now, the answer comes with the step.
    before = counter.total
    queued = [client.allocate_slots(rid, 1, new_token_ids=[7]) for rid in ids[1:]]
    assert all(q.is_pending for q in queued) and counter.total == before
    result = client.step(batch=ids)
    assert counter.total == before + 1
    assert [r.request_id for r in result.results] == ids[1:]
    for r in result.results:
        assert r.ok and client.page_ids(r.request_id)[-1] == r.new_page_ids[0][0]
    assert client.stats.num_rpcs == counter.total
    assert client.stats.num_local_answers == 36
    client.free(*ids)


def test_errors_are_typed_with_the_services_reason(connect, pagekeeper_server):
    anonymous = connect(register=False, token="")
    with pytest.raises(UnauthenticatedError) as exc:
        anonymous.pool_info()
    assert exc.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in exc.value.reason and isinstance(exc.value, PagekeeperError)

    owner, other = connect(), connect()
    owner.admit("err-a", tokens(3, 40))
    with pytest.raises(AlreadyExistsError, match="already holds pages"):
        other.admit("err-a", tokens(4, 40))
    # The refused step changed nothing, and the refused admission is not left queued.
    assert not other.has_request("err-a") and other.num_queued == 0
    with pytest.raises(NotFoundError, match="holds no pages") as exc:
        owner.block_table("err-missing")
    assert exc.value.method == "GetBlockTable" and "[NOT_FOUND]" in str(exc.value)
    with pytest.raises(InvalidArgumentError, match="divisor"):
        owner.block_table("err-a", kernel_block_size=5)
    with pytest.raises(FailedPreconditionError, match="hold pages"):
        owner.reset_prefix_cache()
    # Checked before any call: the service would refuse it the same way.
    with pytest.raises(InvalidArgumentError, match="num_new_tokens"):
        owner.allocate_slots("err-a", 0)
    with pytest.raises(NotFoundError):
        owner.allocate_slots("err-unknown", 1)

    # PERMISSION_DENIED: another client's request (the mirror would not even send it, so
    # send the raw message and map the status like the client does).
    stub = pagekeeper_server.stub()
    with pytest.raises(grpc.RpcError) as raw:
        stub.Step(
            pb.StepRequest(
                client_id=other.client_id,
                generation=other.generation,
                step_id=10**6,
                free_request_ids=["err-a"],
            ),
            metadata=pagekeeper_server.metadata,
        )
    mapped = error_from_rpc(raw.value, "Step")
    assert isinstance(mapped, PermissionDeniedError) and "another client" in mapped.reason

    worker = connect(register=False)
    with pytest.raises(FailedPreconditionError, match="group 0"):
        worker.register("worker", device="cpu", kernel_support={0: [24]})
    owner.free("err-a")


def test_limits_are_resource_exhausted(server_factory):
    server = server_factory("--max-requests-per-step", "2", "--num-pages", "64")
    with PagekeeperClient(server.grpc_address) as client:
        client.register("scheduler")
        for i in range(3):
            client.admit(f"lim-{i}", tokens(20 + i, 10))
        with pytest.raises(ResourceExhaustedError, match="max_requests_per_step"):
            client.step(batch=[f"lim-{i}" for i in range(3)])
        client.step(batch=["lim-0", "lim-1"])


def test_lease_is_renewed_in_the_background(server_factory):
    server = server_factory("--lease-ttl-s", "0.6", "--lease-grace-s", "60", "--num-pages", "64")
    with (
        PagekeeperClient(server.grpc_address) as renewed,
        PagekeeperClient(server.grpc_address) as idle,
    ):
        renewed.register("scheduler", lease_ttl=0.6)
        idle.register("scheduler", lease_ttl=0.6, renew=False)
        renewed.admit("lease-a", tokens(30, 20))
        idle.admit("lease-b", tokens(31, 20))
        time.sleep(1.5)
        assert renewed.stats.num_heartbeats >= 2 and renewed.lease_error is None
        renewed.allocate_slots("lease-a", 1, new_token_ids=[5])
        assert renewed.step(batch=["lease-a"]).num_local_growths == 1
        # Without renewal the lease ran out: refused until the client takes its id over.
        idle.allocate_slots("lease-b", 1, new_token_ids=[5])
        with pytest.raises(FailedPreconditionError, match="lease expired"):
            idle.step()
        fresh = idle.reregister()
        assert fresh.generation == 2 and fresh.client_id == idle.client_id
        idle.step(batch=["lease-b"])  # still its request
        idle.flush()  # the held-back decode goes through
        assert idle.block_table("lease-b").num_tokens == 21


def test_a_fenced_client_stops_renewing_instead_of_taking_its_id_back(server_factory):
    """A successor took the id over (register(client_id=...)) while the predecessor still
    runs: the predecessor's heartbeat is ABORTED, and its lease thread stops there. (It
    registered again on the FAILED_PRECONDITION this used to be, fencing its successor
    in turn: the two swapped generations until the zombie's free went through.)"""
    server = server_factory("--lease-ttl-s", "0.6", "--num-pages", "64")
    with (
        PagekeeperClient(server.grpc_address, local_socket=None) as old,
        PagekeeperClient(server.grpc_address, local_socket=None) as new,
    ):
        old.register("scheduler", lease_ttl=0.6)
        old.admit("fence-a", tokens(95, 40))
        new.register("scheduler", lease_ttl=0.6, client_id=old.client_id)
        deadline = time.monotonic() + 10
        while old.lease_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(old.lease_error, AbortedError)
        time.sleep(0.6)  # several renewal periods: nobody takes the id back
        assert old.stats.num_reregistrations == 0 and new.stats.num_reregistrations == 0
        assert new.generation == 2 and new.lease_error is None
        old.free_later("fence-a")
        with pytest.raises(AbortedError, match="newer registration took the id over"):
            old.step()
        assert not old.has_unanswered_step  # refused: nothing to send again
        assert new.block_table("fence-a").num_tokens == 40  # the zombie freed nothing
        old.discard_queued()


def test_calls_after_close_say_the_client_is_closed(pagekeeper_server):
    client = PagekeeperClient(pagekeeper_server.grpc_address, token=pagekeeper_server.token)
    client.register("scheduler")
    client.close()
    for call in (
        client.pool_info,
        lambda: client.lookup([1, 2, 3]),
        lambda: client.block_table("x"),
        client.watch_events,
        client.step,
    ):
        with pytest.raises(NotRegisteredError, match="closed"):
            call()

    async def main() -> None:
        aclient = AsyncPagekeeperClient(
            pagekeeper_server.grpc_address, token=pagekeeper_server.token
        )
        await aclient.register("scheduler")
        await aclient.close()
        for call in (aclient.pool_info, lambda: aclient.lookup([1, 2, 3]), aclient.step):
            with pytest.raises(NotRegisteredError, match="closed"):
                await call()
        with pytest.raises(NotRegisteredError, match="closed"):
            aclient.watch_events()

    asyncio.run(main())


def test_a_takeover_adopts_the_requests_its_id_owns(server_factory):
    """A restarted scheduler that takes its id over can grow, publish and free the requests
    the id owns (it could reach none of them: they leaked until it unregistered)."""
    server = server_factory("--num-pages", "64")
    old = PagekeeperClient(server.grpc_address, local_socket=None)
    old.register("scheduler")
    for k, rid in enumerate(("own-a", "own-b")):
        assert old.admit(rid, tokens(110 + k, 40 + k)).ok
    old.allocate_slots("own-a", 1, new_token_ids=[4])  # held back: never sent
    old_id = old.client_id
    old.close(unregister=False)  # the process died
    with PagekeeperClient(server.grpc_address, local_socket=None) as new:
        registration = new.register("scheduler", client_id=old_id)
        assert registration.request_ids == ("own-a", "own-b")
        assert new.request_ids() == ["own-a", "own-b"]
        view = new.request("own-a")
        assert view.num_tokens == view.num_computed_tokens == 40  # the held decode is gone
        assert view.page_ids[0].tolist() == new.block_table("own-a").page_ids.tolist()
        for n in range(10):  # grows across a page boundary, tables published
            new.allocate_slots("own-a", 1, new_token_ids=[n])
            new.step(batch=["own-a"])
        new.flush()
        assert new.block_table("own-a").num_tokens == 50
        assert new.page_ids("own-a").tolist() == new.block_table("own-a").page_ids.tolist()
        new.free("own-a", "own-b")
        with pytest.raises(NotFoundError):
            new.block_table("own-b")


def test_a_scheduler_the_service_dropped_is_told_and_may_register_anew(server_factory):
    """Past its lease and the grace period the service frees a scheduler's requests and
    forgets it: the client says so (not "register first" while register() refused with
    "already registered"), drops the requests it tracked, and registers anew."""
    server = server_factory("--lease-ttl-s", "0.5", "--lease-grace-s", "0.2", "--num-pages", "64")
    with PagekeeperClient(server.grpc_address, local_socket=None) as client:
        client.register("scheduler", lease_ttl=0.5, renew=False)
        first_id = client.client_id
        assert client.admit("drop-a", tokens(99, 40)).ok
        time.sleep(1.6)  # lease + grace + the reaper's tick
        client.allocate_slots("drop-a", 1, new_token_ids=[3])
        with pytest.raises(NotRegisteredError, match=f"registration lost.*{first_id}.*1 request"):
            client.step(batch=["drop-a"])
        with pytest.raises(NotRegisteredError, match="registration lost"):
            client.request_ids()
        client.register("scheduler", lease_ttl=5.0)
        assert client.client_id != first_id and client.request_ids() == []
        assert client.admit("drop-a", tokens(99, 40)).ok  # the id is free again


def test_a_registration_with_a_reset_state_is_refused_not_mistaken(server_factory):
    """A service whose state starts empty again (durability none, a wiped data dir) gives
    out the same client ids and generations: calls carry the registration's state id, so
    the old client is told its state is gone instead of acting as the new one."""
    first = server_factory("--durability", "none", "--num-pages", "64")
    address = first.grpc_address
    with PagekeeperClient(address, local_socket=None) as old:
        old.register("scheduler")
        assert old.registration.state_id
        old.admit("reset-a", tokens(96, 40))
        first.stop()
        again = server_factory(
            "--durability", "none", "--num-pages", "64", "--grpc-address", address
        )
        with PagekeeperClient(again.grpc_address, local_socket=None) as new:
            new.register("scheduler")
            assert (new.client_id, new.generation) == (old.client_id, old.generation)
            assert new.registration.state_id != old.registration.state_id
            new.admit("reset-a", tokens(97, 40))
            old.free_later("reset-a")
            with pytest.raises(NotRegisteredError, match=r"registration lost.*was reset"):
                old.step()
            with pytest.raises(NotRegisteredError, match="registration lost"):
                old.heartbeat()
            assert new.block_table("reset-a").num_tokens == 40  # untouched by the old one
            old.register("scheduler")  # anew, in the new state
            assert old.client_id != new.client_id and old.request_ids() == []
            assert old.admit("reset-b", tokens(98, 20)).ok


@pytest.mark.parametrize("deliver", [True, False], ids=["reply-lost", "request-lost"])
def test_unavailable_step_is_retried_with_the_same_id(connect, deliver):
    dropper = DropStepReplies()
    client = connect(interceptors=[dropper])
    dropper.drops, dropper.deliver = 1, deliver
    rid = f"retry-{deliver}"
    got = client.admit(rid, tokens(40 + deliver, 50))
    assert got.ok and client.stats.num_retries == 1
    assert dropper.step_ids[-1] == dropper.step_ids[-2]  # resent with the same id
    table = client.block_table(rid)
    assert table.page_ids.tolist() == client.page_ids(rid).tolist() == got.new_page_ids[0].tolist()
    assert table.num_tokens == 50  # applied once

    dropper.drops = 1
    client.allocate_slots(rid, 1, new_token_ids=[9])
    result = client.flush()  # the decode fits (held back): flush sends it
    assert result is not None
    assert result.is_retry is deliver  # the service answered the retry from memory
    assert client.block_table(rid).num_tokens == 51
    client.free(rid)


def test_a_chunk_past_the_cache_hit_is_clamped_in_the_clients_view_too(connect):
    """A chunked admission asks for up to ``num_new_tokens``; a cache hit that leaves fewer
    clamps the chunk on the service, and the client's counts must follow."""
    client = connect()
    prompt = tokens(90, 100)
    assert client.admit("clamp-a", prompt).ok
    got = client.admit("clamp-b", prompt, num_new_tokens=48)
    assert got.ok and got.num_cached_tokens == 96  # six full pages hit, 4 tokens left
    view = client.request("clamp-b")
    table = client.block_table("clamp-b")
    assert view.num_tokens == table.num_tokens == 100
    assert view.num_computed_tokens == table.num_computed_tokens == 100
    grown = client.allocate_slots("clamp-b", 1, new_token_ids=[7], sync=True)  # decodes on
    assert grown.ok
    client.flush()
    assert client.block_table("clamp-b").num_tokens == 101
    client.free("clamp-a", "clamp-b")


@contextlib.asynccontextmanager
async def slow_scheduler(server, delay: float = 0.3):
    """An asyncio scheduler whose every Step waits ``delay`` before it is sent (so other
    tasks queue behind it), with no lease renewal: ``(client, its SlowSteps)``."""
    slow = SlowSteps(delay)
    async with AsyncPagekeeperClient(
        server.grpc_address, token=server.token, interceptors=[slow], local_socket=None
    ) as client:
        await client.register("scheduler", renew=False)
        yield client, slow


def _service_view(client, rid):
    table = client.block_table(rid)
    return table.page_ids.tolist(), table.num_tokens


@pytest.mark.parametrize("deliver", [True, False], ids=["applied", "never-arrived"])
def test_a_step_without_an_answer_is_sent_again_before_the_next(connect, deliver):
    """A step that got no answer (a deadline, a connection broken past the retries) may or
    may not have been applied: the client sends it again, with its id and content, before
    anything else, so nothing is applied twice and nothing is lost."""
    dropper = DropStepReplies()
    dropper.code = grpc.StatusCode.DEADLINE_EXCEEDED
    client = connect(interceptors=[dropper])
    rid = f"unanswered-{deliver}"
    assert client.admit(rid, tokens(80, 40)).ok  # 3 pages, 48 slots
    got = client.allocate_slots(rid, 10, new_token_ids=list(range(100, 110)))  # a 4th page
    assert got.status is AllocationStatus.PENDING
    dropper.drops, dropper.deliver = 1, deliver
    with pytest.raises(DeadlineExceededError) as failed:
        client.step(batch=[rid])
    assert any("again, with the same id" in note for note in failed.value.__notes__)
    assert client.has_unanswered_step and client.stats.num_unanswered_steps == 1
    with pytest.raises(FailedPreconditionError, match="flush"):
        client.discard_queued()  # its operations may be applied: not undone blindly
    lost_id = dropper.step_ids[-1]
    result = client.step(batch=[rid])
    assert dropper.step_ids[-2:] == [lost_id, lost_id + 1]  # the same step first, then this one
    assert not client.has_unanswered_step
    [grown] = result.results  # the growth's answer comes with this step's results
    assert grown.request_id == rid and grown.ok and len(grown.new_page_ids[0]) == 1
    pages, num_tokens = _service_view(client, rid)
    assert num_tokens == 50 and pages == client.page_ids(rid).tolist()  # applied once

    # A synchronous admission: the caller hears of the failure; the admission is sent
    # again and its answer comes with the next step's results.
    other = f"{rid}-b"
    dropper.drops = 1
    with pytest.raises(DeadlineExceededError):
        client.admit(other, tokens(81, 20))
    flushed = client.flush()
    assert flushed is not None and [r.request_id for r in flushed.results] == [other]
    assert flushed.results[0].ok and client.has_request(other)
    assert _service_view(client, other)[0] == client.page_ids(other).tolist()

    # A free: the next step neither frees it twice (NOT_FOUND forever) nor loses it.
    dropper.drops = 1
    client.free_later(rid)
    with pytest.raises(DeadlineExceededError):
        client.step()
    client.step()
    with pytest.raises(NotFoundError):
        client.block_table(rid)
    assert not client.has_request(rid)
    client.free(other)


def test_an_unanswered_step_is_applied_once_across_a_lease_that_ran_out(server_factory):
    """The resend comes after the lease ran out: the service answers a step it applied
    from memory before it looks at the lease (a refusal there would not say whether the
    first send was applied, and the queue went again under a new id: applied twice)."""
    server = server_factory("--lease-ttl-s", "0.5", "--lease-grace-s", "30", "--num-pages", "64")
    dropper = DropStepReplies()
    dropper.code = grpc.StatusCode.DEADLINE_EXCEEDED
    with PagekeeperClient(server.grpc_address, interceptors=[dropper]) as client:
        client.register("scheduler", lease_ttl=0.5, renew=False)
        assert client.admit("once-a", tokens(120, 40)).ok
        client.allocate_slots("once-a", 10, new_token_ids=list(range(10)))  # a 4th page
        dropper.drops = 1
        with pytest.raises(DeadlineExceededError):
            client.step(batch=["once-a"])
        time.sleep(0.8)  # the lease runs out (the grace keeps the requests)
        flushed = client.flush()  # the resend: answered from memory, lease or not
        assert flushed is not None and [r.request_id for r in flushed.results] == ["once-a"]
        assert not client.has_unanswered_step
        with pytest.raises(FailedPreconditionError, match="lease expired"):
            client.step()  # a new step does need a live lease
        client.reregister()
        client.step()
        table = client.block_table("once-a")
        assert (
            table.num_tokens == 50 and table.page_ids.tolist() == client.page_ids("once-a").tolist()
        )


def test_a_lost_answer_to_the_lease_renewals_registration_is_registered_again(server_factory):
    """The lease renewal registers again after the lease ran out; the service applies it
    and the answer is lost. A heartbeat under the old generation would then be ABORTED,
    and the loop would stop for good (fenced by its own registration): it registers again
    instead (its own id: the newest generation stands)."""
    server = server_factory("--lease-ttl-s", "0.6", "--lease-grace-s", "30", "--num-pages", "64")
    faults = LeaseFaults()
    with PagekeeperClient(server.grpc_address, interceptors=[faults]) as client:
        client.register("scheduler", lease_ttl=0.6)
        assert client.admit("lost-reg", tokens(160, 20)).ok
        faults.block_heartbeats = True
        time.sleep(1.2)  # the lease runs out (the grace keeps the request)
        faults.lose_registers = 1
        faults.block_heartbeats = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            client.generation < 3 or client.lease_error is not None
        ):
            time.sleep(0.05)
        assert client.generation == 3 and client.lease_error is None
        client.allocate_slots("lost-reg", 1, new_token_ids=[1])
        client.step(batch=["lost-reg"])
        client.flush()
        assert client.block_table("lost-reg").num_tokens == 21


def test_a_step_after_the_lease_ran_out_registers_again_and_goes(server_factory):
    """The service was out of reach (or the process stalled) for longer than the lease, not
    the grace period: the first step back is refused FAILED_PRECONDITION before the lease
    renewal learns it. The step has the renewal register again (its requests kept), waits
    for it and goes again under the same id, applied once: the caller sees no error."""
    server = server_factory("--lease-ttl-s", "0.6", "--lease-grace-s", "30", "--num-pages", "64")
    faults = HeartbeatsDownUntilAStep()
    with PagekeeperClient(server.grpc_address, interceptors=[faults]) as client:
        client.register("scheduler", lease_ttl=0.6)
        assert client.admit("stall-a", tokens(170, 20)).ok
        faults.down = True
        time.sleep(1.2)  # the lease runs out; the renewal's heartbeats fail meanwhile
        assert client.generation == 1
        client.allocate_slots("stall-a", 13, new_token_ids=list(range(13)))  # a 3rd page
        faults.step_codes.clear()
        result = client.step(batch=["stall-a"])
        assert faults.step_codes == [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OK]
        assert client.generation == 2 and client.stats.num_reregistrations == 1
        assert [r.request_id for r in result.results] == ["stall-a"]
        table = client.block_table("stall-a")
        assert table.num_tokens == 33 and len(table.page_ids) == 3
        assert table.page_ids.tolist() == client.page_ids("stall-a").tolist()


def test_a_step_refused_for_another_reason_is_not_retried_for_long(server_factory):
    """A FAILED_PRECONDITION that is not about the lease (here: a step id older than the
    last one the service applied) is raised after one renewal check and one resend, not
    waited on until the retry deadline."""
    server = server_factory("--lease-ttl-s", "30", "--num-pages", "64")
    faults = HeartbeatsDownUntilAStep()
    with PagekeeperClient(server.grpc_address, interceptors=[faults]) as client:
        client.register("scheduler")
        assert client.admit("stale-a", tokens(171, 20)).ok
        assert client.admit("stale-b", tokens(173, 20)).ok  # step 2
        client._next_step_id = 1  # older than the service's last step for this client
        client.allocate_slots("stale-a", 13, new_token_ids=list(range(13)))
        started = time.monotonic()
        with pytest.raises(FailedPreconditionError, match="older than"):
            client.step(batch=["stale-a"])
        assert time.monotonic() - started < 3.0
        assert client.generation == 1 and client.stats.num_heartbeats >= 1


def test_async_step_after_the_lease_ran_out_registers_again_and_goes(server_factory):
    server = server_factory("--lease-ttl-s", "0.6", "--lease-grace-s", "30", "--num-pages", "64")

    async def main() -> None:
        faults = AsyncHeartbeatsDownUntilAStep()
        async with AsyncPagekeeperClient(server.grpc_address, interceptors=[faults]) as client:
            await client.register("scheduler", lease_ttl=0.6)
            assert (await client.admit("astall-a", tokens(172, 20))).ok
            faults.down = True
            await asyncio.sleep(1.2)
            assert client.generation == 1
            await client.allocate_slots("astall-a", 13, new_token_ids=list(range(13)))
            faults.step_codes.clear()
            result = await client.step(batch=["astall-a"])
            assert faults.step_codes == [
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.OK,
            ]
            assert client.generation == 2
            assert [r.request_id for r in result.results] == ["astall-a"]
            table = await client.block_table("astall-a")
            assert table.num_tokens == 33
            assert table.page_ids.tolist() == client.page_ids("astall-a").tolist()

    asyncio.run(main())


def test_unregister_drops_an_unanswered_step(connect):
    dropper = DropStepReplies()
    dropper.code = grpc.StatusCode.DEADLINE_EXCEEDED
    client = connect(interceptors=[dropper])
    dropper.drops = 1
    with pytest.raises(DeadlineExceededError):
        client.admit("unreg-a", tokens(121, 20))
    assert client.has_unanswered_step
    client.unregister()  # frees everything the id held: nothing left to learn
    assert not client.has_unanswered_step
    client.register("scheduler")
    assert client.admit("unreg-b", tokens(122, 20)).ok


def test_registrations_that_cross_keep_the_newest_generation(connect):
    """The lease renewal and the caller may both register again; an answer arriving late
    with an older generation must not replace the newer one (every call would then be
    refused as superseded, and the lease run out)."""
    client = connect()
    older = client.reregister()
    newer = client.reregister()
    assert newer.generation == older.generation + 1
    client._accept_registration(older)  # the slower of two crossing answers
    assert client.generation == newer.generation
    client.step()


def test_a_dropped_registration_ends_its_lease_thread(server_factory):
    first = server_factory("--durability", "none", "--num-pages", "64")
    address = first.grpc_address

    def lease_threads() -> int:
        return sum(t.name == "pagekeeper-lease" and t.is_alive() for t in threading.enumerate())

    before = lease_threads()
    with PagekeeperClient(address, local_socket=None) as client:
        client.register("scheduler", lease_ttl=30.0)  # its thread sleeps ~10 s
        first.stop()
        server_factory("--durability", "none", "--num-pages", "64", "--grpc-address", address)
        with pytest.raises(NotRegisteredError, match="registration lost"):
            client.step()  # the step's probe drops it before the lease thread wakes
        client.register("scheduler", lease_ttl=0.6)
        time.sleep(0.5)  # the old loop wakes (the stop event) and must end
        assert lease_threads() == before + 1


def test_async_caller_cancelled_while_its_entry_rides_in_another_step(pagekeeper_server):
    """A synchronous admit() cancelled while it waits for the step lock, its admission
    already in another caller's step in flight: the entry stays, its answer comes with the
    next results (withdrawn, the answer's slicing dropped a later, never-sent admission)."""

    async def main() -> None:
        async with slow_scheduler(pagekeeper_server) as (client, _slow):
            await client.admit("ride-a", tokens(130, 20), sync=False)
            first = asyncio.create_task(client.flush())  # in flight
            await asyncio.sleep(0.05)
            waiter = asyncio.create_task(client.flush())  # waits for the lock
            await asyncio.sleep(0.01)
            cancelled = asyncio.create_task(client.admit("ride-y", tokens(131, 20)))
            await asyncio.sleep(0.35)  # the waiter's step, carrying ride-y, is in flight
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            await client.admit("ride-z", tokens(132, 20), sync=False)  # queued meanwhile
            await first
            carried = await waiter
            assert carried is not None
            assert [r.request_id for r in carried.results] == ["ride-y"]  # its answer
            last = await client.flush()  # ride-z goes now
            assert last is not None and [r.request_id for r in last.results] == ["ride-z"]
            for rid in ("ride-a", "ride-y", "ride-z"):
                table = await client.block_table(rid)
                assert table.page_ids.tolist() == client.page_ids(rid).tolist()
            await client.free("ride-a", "ride-y", "ride-z")

    asyncio.run(main())


def test_async_sync_calls_and_a_step_in_flight(pagekeeper_server):
    """With another caller's step in flight: a synchronous growth timed out before any step
    carried it is withdrawn (a retry grows once, not twice); a synchronous admission the
    in-flight step answered returns that answer without a step of its own; the queue is
    not dropped under a step being sent."""

    async def main() -> None:
        async with slow_scheduler(pagekeeper_server) as (client, slow):
            assert (await client.admit("fl-r", tokens(140, 32))).ok  # 2 full pages
            await client.admit("fl-a", tokens(141, 20), sync=False)
            in_flight = asyncio.create_task(client.flush())
            await asyncio.sleep(0.05)
            with pytest.raises(FailedPreconditionError, match="being sent"):
                client.discard_queued()
            with pytest.raises(TimeoutError):  # waits for the lock; no step carried it
                await asyncio.wait_for(
                    client.allocate_slots("fl-r", 16, new_token_ids=list(range(16)), sync=True),
                    0.1,
                )
            # Queued behind the step in flight; the waiter's own step carries it.
            waiter = asyncio.create_task(client.flush())
            await asyncio.sleep(0.01)
            answered = asyncio.create_task(client.admit("fl-y", tokens(142, 20)))
            await in_flight
            await waiter
            sent = len(slow.step_ids)
            got = await answered  # rode in the waiter's step: no step of its own
            assert got.ok and len(slow.step_ids) == sent
            grown = await client.allocate_slots(
                "fl-r", 16, new_token_ids=list(range(16)), sync=True
            )
            assert grown.ok
            table = await client.block_table("fl-r")
            assert table.num_tokens == 48 == client.request("fl-r").num_tokens  # once
            await client.free("fl-r", "fl-a", "fl-y")

    asyncio.run(main())


def test_async_growth_planned_again_after_an_ordering_flush_checks_again(pagekeeper_server):
    """allocate_slots waits for an ordering flush; meanwhile another task's flush queues
    the request's held-back decode as a growth. Planned again without checking, two
    growths of one request were queued and every later step was refused ("grown twice")."""

    async def main() -> None:
        async with slow_scheduler(pagekeeper_server) as (client, _slow):
            await client.admit("re-r", tokens(150, 20))  # 2 pages, 32 slots
            assert await client.allocate_decodes(["re-r"], [11]) == []  # held back
            await client.admit("re-x", tokens(151, 20), sync=False)  # queued admission
            grow = asyncio.create_task(
                client.allocate_slots("re-r", 16, new_token_ids=tokens(152, 16))
            )
            await asyncio.sleep(0.05)
            other = asyncio.create_task(client.flush())  # queues re-r's held decode
            assert (await grow).status in (AllocationStatus.PENDING, AllocationStatus.OK)
            await other
            await client.flush()
            await client.step()
            table = await client.block_table("re-r")
            assert table.num_tokens == 37 == client.request("re-r").num_tokens
            assert table.page_ids.tolist() == client.page_ids("re-r").tolist()
            await client.free("re-r", "re-x")

    asyncio.run(main())


@pytest.mark.parametrize("deliver", [True, False], ids=["applied", "never-arrived"])
def test_async_step_cancelled_in_flight_is_sent_again(pagekeeper_server, deliver):
    async def main() -> None:
        canceller = CancelStepAfterDelivery()
        async with AsyncPagekeeperClient(
            pagekeeper_server.grpc_address,
            token=pagekeeper_server.token,
            interceptors=[canceller],
        ) as client:
            await client.register("scheduler", name="async-cancel")
            rid = f"aio-cancel-{deliver}"
            canceller.drops, canceller.deliver = 1, deliver
            with pytest.raises(asyncio.CancelledError):
                await client.admit(rid, tokens(82, 40))
            assert client.has_unanswered_step
            result = await client.step()
            assert [r.request_id for r in result.results] == [rid] and result.results[0].ok
            table = await client.block_table(rid)
            assert table.page_ids.tolist() == client.page_ids(rid).tolist()
            assert table.num_tokens == 40
            assert canceller.step_ids[0] == canceller.step_ids[1]
            await client.free(rid)

    asyncio.run(main())


def test_watch_events_streams_stored_pages(connect):
    client = connect()
    since = client.pool_info().counters.last_event_seq
    got = client.admit("ev-a", tokens(50, 64))  # 4 full pages, all new
    stored: list[PageStored] = []
    with client.watch_events(since=since) as stream:
        for batch in stream:
            stored += [e for e in batch.events if isinstance(e, PageStored)]
            if any(e.page_ids.tolist() == got.new_page_ids[0].tolist() for e in stored):
                break
    event = next(e for e in stored if e.page_ids.tolist() == got.new_page_ids[0].tolist())
    assert event.seq > since and len(event.page_hashes) == 4 and event.page_size == 16
    assert event.token_ids.tolist() == tokens(50, 64)
    client.free("ev-a")


def test_async_client_has_the_same_api(pagekeeper_server):
    async def main() -> None:
        counter = AsyncCountingInterceptor()
        async with AsyncPagekeeperClient(
            pagekeeper_server.grpc_address,
            token=pagekeeper_server.token,
            interceptors=[counter],
        ) as client:
            registration = await client.register("scheduler", name="async-test")
            assert registration.pool.page_sizes == (16,)
            prompt = tokens(60, 31)
            admitted = await client.admit("aio-a", prompt)
            assert admitted.ok and len(admitted.new_page_ids[0]) == 2
            local = await client.allocate_slots("aio-a", 1, new_token_ids=[1])
            assert local.is_local  # token 32 still fits in the second page
            await client.step(batch=["aio-a"])
            assert counter.calls == {"RegisterClient": 1, "Step": 2}  # admission + this step
            crossed = await client.allocate_slots("aio-a", 1, new_token_ids=[2], sync=True)
            assert crossed.ok and len(crossed.new_page_ids[0]) == 1
            table = await client.block_table("aio-a")
            assert table.page_ids.tolist() == client.page_ids("aio-a").tolist()
            assert table.num_tokens == 33
            hit = await client.lookup(prompt)
            assert hit.num_hit_tokens == 16
            stream = client.watch_events()
            async for batch in stream:
                assert batch.last_event_seq >= 1
                break
            stream.cancel()
            info = await client.pool_info()
            assert info.counters.num_requests >= 1
            await client.free("aio-a")
            assert not client.has_request("aio-a")

    asyncio.run(main())


def test_async_allocate_decodes(pagekeeper_server):
    async def main() -> None:
        async with AsyncPagekeeperClient(
            pagekeeper_server.grpc_address, token=pagekeeper_server.token
        ) as client:
            await client.register("scheduler", name="async-decodes")
            for rid in ("ad-a", "ad-b"):
                assert (await client.admit(rid, tokens(700, 31))).ok  # 2 pages, 1 slot left
            await client.admit("ad-c", tokens(800, 5), sync=False)  # queued before decodes
            assert await client.allocate_decodes(["ad-a", "ad-b"], [1, 2]) == []
            need = await client.allocate_decodes(["ad-a", "ad-b"], [3, 4])  # token 33
            assert need == ["ad-a", "ad-b"] and client.stats.num_ordering_flushes >= 1
            result = await client.step(batch=["ad-a", "ad-b"])
            # The admission sent early by the ordering flush is reported here too.
            by_id = result.by_request()
            assert sorted(by_id) == ["ad-a", "ad-b", "ad-c"]
            assert all(r.ok for r in by_id.values())
            assert len(by_id["ad-a"].new_page_ids[0]) == len(by_id["ad-b"].new_page_ids[0]) == 1
            for rid in ("ad-a", "ad-b"):
                table = await client.block_table(rid)
                assert table.num_tokens == 33
                assert table.page_ids.tolist() == client.page_ids(rid).tolist()
            with pytest.raises(InvalidArgumentError, match="kernel_block_size"):
                await client.block_table("ad-a", kernel_block_size=2**40)
            with pytest.raises(InvalidArgumentError, match="num_lookahead_tokens"):
                await client.allocate_decodes(["ad-a"], [5], num_lookahead_tokens=2**40)
            assert client.num_queued == 0
            await client.free("ad-a", "ad-b", "ad-c")

    asyncio.run(main())


HYBRID_CONFIG = """
[pool]
num_pages = 40
max_model_len = 512
[[pool.groups]]
kind = "full"
page_size = 16
[[pool.groups]]
kind = "sliding_window"
page_size = 16
window = 40
"""


@pytest.mark.parametrize("defer", [False, True], ids=["sync", "deferred-ids"])
def test_mirror_and_allocations_match_an_in_process_manager(server_factory, tmp_path, defer):
    """Random admissions, decodes (answered locally, queued or sync), frees and preemptions
    on a full + sliding-window pool: every answer and every table equals the core's when it
    is called in the same order, one call at a time -- the client's batching and ordering
    flushes never change an allocation."""
    import tomllib

    from pagekeeper.core.config import PoolConfig
    from pagekeeper.core.manager import PageManager
    from pagekeeper.settings import from_tree

    config = tmp_path / "hybrid.toml"
    config.write_text(HYBRID_CONFIG)
    pool: PoolConfig = from_tree(tomllib.loads(HYBRID_CONFIG)).pool
    server = server_factory("--config", str(config))
    reference = PageManager(pool)
    rng = np.random.default_rng(7)
    prefix = tokens(70, 40)
    running: list[str] = []
    counter = 0
    saw_window_nulls = False
    num_preempted = 0

    def check_same(rid: str) -> None:
        for g in range(2):
            assert client.page_ids(rid, g).tolist() == reference.page_table(rid, g).tolist(), (
                rid,
                g,
            )

    with PagekeeperClient(server.grpc_address, defer_page_ids=defer) as client:
        client.register("scheduler")
        for step in range(120):
            pending: dict[str, object] = {}
            for rid in list(running):
                if rng.random() < 0.08:
                    running.remove(rid)
                    client.free_later(rid)
                    reference.free(rid)
            aborted: set[str] = set()
            for rid in list(running):
                if rid in aborted:
                    continue
                if rng.random() < 0.1:
                    # Abort a request mid-step, after queued growths (some taking pages):
                    # the client must send them first to keep the service's order.
                    victim = running[int(rng.integers(len(running)))]
                    aborted.add(victim)
                    running.remove(victim)
                    client.free_later(victim)
                    reference.free(victim)
                    if victim == rid:
                        continue
                token = int(rng.integers(1, 50_000))
                sync = bool(rng.random() < 0.3)
                got = client.allocate_slots(rid, 1, new_token_ids=[token], sync=sync)
                expected = reference.allocate(rid, 1, new_token_ids=[token])
                if got.is_local:
                    assert expected is not None and not any(expected.new_page_ids)
                elif got.is_deferred:
                    assert expected is not None  # "surely fits" must be true
                    pending[rid] = expected
                elif got.is_pending:
                    pending[rid] = expected
                elif expected is None:
                    assert got.status is AllocationStatus.NO_CAPACITY
                    num_preempted += 1
                    running.remove(rid)
                    client.free_later(rid)
                    reference.free(rid)
                else:
                    assert got.ok
                    assert [p.tolist() for p in got.new_page_ids] == [
                        list(p) for p in expected.new_page_ids
                    ]
            for _ in range(int(rng.integers(0, 3))):
                counter += 1
                rid = f"mirror-{counter}"
                prompt = prefix + tokens(1000 + counter, int(rng.integers(5, 60)))
                sync = bool(rng.random() < 0.5)
                got = client.admit(rid, prompt, sync=sync)
                expected = reference.admit(rid, prompt)
                if sync:
                    assert (got.status is AllocationStatus.NO_CAPACITY) == (expected is None)
                    if expected is not None:
                        assert got.num_cached_tokens == expected.num_cached_tokens
                        running.append(rid)
                else:
                    pending[rid] = expected
            result = client.step()
            listed = result.by_request()
            for rid, expected in pending.items():
                got_result = listed.get(rid)
                if expected is None:
                    assert got_result is not None
                    assert got_result.status is AllocationStatus.NO_CAPACITY
                    if rid in running and rid not in aborted:  # a growth: preempt it
                        num_preempted += 1
                        running.remove(rid)
                        client.free_later(rid)
                        reference.free(rid)
                    continue
                assert got_result is not None and got_result.ok, (rid, got_result)
                assert [p.tolist() for p in got_result.new_page_ids] == [
                    list(p) for p in expected.new_page_ids
                ]
                if rid not in running and rid not in aborted:
                    running.append(rid)
            for rid in running:
                check_same(rid)
                saw_window_nulls |= 0 in client.page_ids(rid, 1).tolist()
            if step % 30 == 29:
                client.flush()
                for rid in running:
                    for g in range(2):
                        table = client.block_table(rid, g)
                        assert table.page_ids.tolist() == client.page_ids(rid, g).tolist()
        stats = client.stats
        assert stats.num_local_answers > 100 and stats.num_sync_steps > 10
        assert stats.num_ordering_flushes > 0
        assert (stats.num_deferred_answers > 0) is defer
        assert saw_window_nulls and num_preempted > 0
        client.flush()
        assert client.pool_info().counters.num_free_pages == reference.pool.num_free_pages


def test_deferred_page_ids_answer_sync_growths_without_a_call(server_factory):
    server = server_factory("--num-pages", "8")  # 7 usable pages
    counter = CountingInterceptor()
    with PagekeeperClient(
        server.grpc_address, interceptors=[counter], defer_page_ids=True
    ) as client:
        client.register("scheduler")
        client.admit("d-a", tokens(80, 48))  # 3 full pages each: 1 page left
        client.admit("d-b", tokens(81, 48))
        before = counter.total
        got = client.allocate_slots("d-a", 1, new_token_ids=[1], sync=True)
        assert got.ok and got.is_deferred and got.new_page_ids == ()
        assert counter.total == before  # answered from the capacity bound
        # The last free page is promised to d-a: d-b must ask, and gets NO_CAPACITY.
        refused = client.allocate_slots("d-b", 1, new_token_ids=[2], sync=True)
        assert refused.status is AllocationStatus.NO_CAPACITY and not refused.is_deferred
        assert counter.total == before + 1
        result = client.step(batch=["d-a"])
        assert [r.request_id for r in result.results] == ["d-a"]  # carried from the sync step
        new_page = result.results[0].new_page_ids[0].tolist()
        assert len(new_page) == 1 and client.page_ids("d-a").tolist()[-1] == new_page[0]
        assert client.block_table("d-a").page_ids.tolist() == client.page_ids("d-a").tolist()
        assert client.stats.num_deferred_answers == 1


FULL_SMALL_CONFIG = """
[pool]
num_pages = 24
max_model_len = 512
"""


@pytest.mark.parametrize("config_text", [FULL_SMALL_CONFIG, HYBRID_CONFIG], ids=["full", "hybrid"])
def test_allocate_decodes_matches_an_in_process_manager(server_factory, tmp_path, config_text):
    """Whole decode steps queued with allocate_decodes (mixed with queued admissions, frees
    and preemptions): every page equals the core's allocate_decodes in the same order, and
    a decode step costs no call of its own."""
    import tomllib

    from pagekeeper.core.manager import PageManager
    from pagekeeper.settings import from_tree

    config = tmp_path / "pool.toml"
    config.write_text(config_text)
    server = server_factory("--config", str(config))
    reference = PageManager(from_tree(tomllib.loads(config_text)).pool)
    rng = np.random.default_rng(11)
    counter = CountingInterceptor()
    running: list[str] = []
    num_preempted = num_crossings = 0
    with PagekeeperClient(server.grpc_address, interceptors=[counter]) as client:
        client.register("scheduler")
        for step in range(80):
            for rid in [r for r in running if rng.random() < 0.05]:
                running.remove(rid)
                client.free_later(rid)
                reference.free(rid)
            expected: dict[str, object] = {}
            admitted = []
            if rng.random() < 0.5:  # an admission queued *before* the decodes
                rid = f"dec-{step}"
                prompt = tokens(500 + step, int(rng.integers(5, 40)))
                client.admit(rid, prompt, sync=False)
                expected[rid] = reference.admit(rid, prompt)
                admitted.append(rid)
            toks = rng.integers(0, 50_000, len(running)).tolist()
            before = counter.total
            need_pages = client.allocate_decodes(running, toks)
            flushed = counter.total - before
            assert flushed <= 1  # at most the ordering flush for the admission
            answers = reference.allocate_decodes(running, toks)
            assert sorted(need_pages) == sorted(answers)  # the same requests need pages
            num_crossings += len(need_pages)
            expected.update(answers)
            result = client.step(batch=running)
            listed = result.by_request()
            for rid, want in expected.items():
                got = listed.get(rid)
                if want is None:
                    assert got is not None and got.status is AllocationStatus.NO_CAPACITY
                    if rid in running:
                        num_preempted += 1
                        running.remove(rid)
                        client.free_later(rid)
                        reference.free(rid)
                    continue
                if got is None:  # an earlier ordering flush carried it
                    continue
                assert got.ok
                assert [p.tolist() for p in got.new_page_ids] == [
                    list(p) for p in want.new_page_ids
                ]
            running += [r for r in admitted if expected[r] is not None]
            for rid in running:
                for g in range(len(reference.groups)):
                    assert client.page_ids(rid, g).tolist() == reference.page_table(rid, g).tolist()
        assert num_crossings > 10 and num_preempted > 0
        client.flush()
        assert client.pool_info().counters.num_free_pages == reference.pool.num_free_pages


def test_computed_tokens_past_max_model_len_are_refused_before_any_call(connect):
    """As the service does: lookahead may take ``computed + new`` past the tokens, never
    past max_model_len (checked by the mirror first, so nothing is queued)."""
    client = connect()
    max_len = client.pool.max_model_len
    client.admit("ml-a", tokens(700, 10))
    client.admit("ml-b", tokens(800, 10))
    client.flush()
    before = client.stats.num_rpcs
    past = max_len - 9
    with pytest.raises(InvalidArgumentError, match=f"10 computed \\+ {past} new tokens exceed"):
        client.allocate_slots("ml-a", past, num_lookahead_tokens=past)
    assert client.stats.num_rpcs == before and client.num_queued == 0
    # Exactly up to max_model_len is accepted; then nothing more can be computed.
    client.allocate_slots("ml-a", max_len - 10, num_lookahead_tokens=max_len - 10)
    client.flush()
    assert client.request("ml-a").num_computed_tokens == max_len
    with pytest.raises(InvalidArgumentError, match=f"{max_len} computed \\+ 1 new tokens"):
        client.allocate_decodes(["ml-b", "ml-a"], [1, 2])
    assert client.request("ml-b").num_tokens == 10 and client.num_queued == 0
    client.free_later("ml-a", "ml-b")
    client.step()


def test_values_the_wire_cannot_carry_are_refused_before_anything_is_queued(connect):
    """A lookahead or kernel block size past int32, or a decode after speculative tokens
    that were not set back: refused by the client with a clear error and nothing queued
    (a lookahead of 2**40 used to be queued and then stop every later flush: the column
    could not be encoded)."""
    client = connect()
    client.admit("wc-a", tokens(600, 40))
    client.flush()
    before = client.stats.num_rpcs
    with pytest.raises(InvalidArgumentError, match=r"num_lookahead_tokens must be in \[0"):
        client.allocate_slots("wc-a", 1, num_lookahead_tokens=2**40)
    with pytest.raises(InvalidArgumentError, match="num_lookahead_tokens must be an int"):
        client.allocate_slots("wc-a", 1, num_lookahead_tokens=1.5)
    with pytest.raises(InvalidArgumentError, match="num_lookahead_tokens"):
        client.allocate_decodes(["wc-a"], [1], num_lookahead_tokens=2**40)
    with pytest.raises(InvalidArgumentError, match="num_lookahead_tokens"):
        client.admit("wc-b", tokens(0, 8), num_lookahead_tokens=2**40)
    with pytest.raises(InvalidArgumentError, match="int32"):
        client.admit("wc-b", np.array([5, 2**33], dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="kernel_block_size"):
        client.block_table("wc-a", kernel_block_size=2**40)
    assert client.stats.num_rpcs == before and client.num_queued == 0
    assert not client.has_request("wc-b")
    # One token computed ahead with room for it (speculative), not set back: the next
    # plain decode is refused here, as the service would refuse it, and nothing queues.
    client.allocate_slots("wc-a", 1, num_lookahead_tokens=2)
    client.flush()
    assert client.request("wc-a").num_computed_tokens == 41
    with pytest.raises(InvalidArgumentError, match="41 computed \\+ 1 new tokens exceed its 41"):
        client.allocate_decodes(["wc-a"], [9])
    assert client.num_queued == 0
    client.allocate_slots("wc-a", 1, new_token_ids=[9], num_computed_tokens=40)
    client.free_later("wc-a")
    client.step()  # the queue still flushes


def test_allocate_decodes_bad_input_queues_nothing(connect):
    client = connect()
    for rid in ("bd-a", "bd-b"):
        client.admit(rid, tokens(900, 10))
    before = client.stats.num_rpcs
    with pytest.raises(NotFoundError):
        client.allocate_decodes(["bd-a", "nope"], [1, 2])
    with pytest.raises(InvalidArgumentError, match="twice"):
        client.allocate_decodes(["bd-a", "bd-a"], [1, 2])
    with pytest.raises(InvalidArgumentError, match="1 token ids for 2"):
        client.allocate_decodes(["bd-a", "bd-b"], [1])
    assert client.stats.num_rpcs == before
    assert client.request("bd-a").num_tokens == 10 and not client.request("bd-a").is_pending
    assert client.allocate_decodes(["bd-a", "bd-b"], [1, 2]) == []  # 11 tokens fit a page
    assert client.step(batch=["bd-a", "bd-b"]).results == ()
    assert client.request("bd-b").num_held_tokens == 1  # held back: changes nothing
    assert client.block_table("bd-b").num_tokens == 10
    client.flush()
    assert client.block_table("bd-b").num_tokens == 11
    client.free("bd-a", "bd-b")


def _event_key(event: object) -> tuple[object, ...]:
    """An event as plain values (the client's numpy arrays and the core's tuples alike)."""
    out: list[object] = [type(event).__name__]
    for name in ("seq", "group_id", "page_hashes", "parent_page_hash", "token_ids", "page_ids"):
        value = getattr(event, name, None)
        out.append(list(value) if isinstance(value, tuple | np.ndarray) else value)
    return tuple(out)


def _service_events(client: PagekeeperClient, since: int) -> list[object]:
    with client.watch_events(since) as stream:
        return list(next(iter(stream)).events)


HOLD_CONFIGS = {
    "full": "[pool]\nnum_pages = 40\nmax_model_len = 512\n",
    "full+swa": HYBRID_CONFIG,
    "full16+chunked32": """
[pool]
num_pages = 80
max_model_len = 512
[[pool.groups]]
kind = "full"
page_size = 16
[[pool.groups]]
kind = "chunked_local"
page_size = 32
chunk = 64
""",
}


@pytest.mark.parametrize("config_name", list(HOLD_CONFIGS))
def test_held_decodes_leave_the_service_as_if_every_decode_was_sent(
    server_factory, tmp_path, config_name
):
    """A client holding back decodes that need no page: after every step the service's
    tables and KV events (page ids, hashes, token ids, order) equal an in-process manager's
    that got every decode in its own step; its token counts trail by the held decodes until
    a flush brings them level."""
    import tomllib

    from pagekeeper.core.manager import PageManager
    from pagekeeper.settings import from_tree

    config_text = HOLD_CONFIGS[config_name]
    config = tmp_path / "pool.toml"
    config.write_text(config_text)
    server = server_factory("--config", str(config))
    reference = PageManager(from_tree(tomllib.loads(config_text)).pool)
    rng = np.random.default_rng(5)
    running: list[str] = []
    seq = 0
    num_held_seen = num_stored = 0
    with PagekeeperClient(server.grpc_address) as client:
        client.register("scheduler")
        for step in range(70):
            for rid in [r for r in running if rng.random() < 0.04]:
                running.remove(rid)
                client.free_later(rid)
                reference.free(rid)
            expected = {}
            toks = rng.integers(0, 50, len(running)).tolist()  # few values: repeated pages
            if step % 3:
                need = client.allocate_decodes(running, toks)
                answers = reference.allocate_decodes(running, toks)
            elif step % 2:  # the per-request call holds back the same way
                need = [
                    rid
                    for rid, tok in zip(running, toks, strict=True)
                    if not client.allocate_slots(rid, 1, new_token_ids=[tok]).is_local
                ]
                answers = reference.allocate_decodes(running, toks)
            else:  # two tokens at once (e.g. an accepted draft): carries any held tokens
                need, answers = [], {}
                for rid, tok in zip(running, toks, strict=True):
                    pair = [tok, (tok + 1) % 50]
                    if not client.allocate_slots(rid, 2, new_token_ids=pair).is_local:
                        need.append(rid)
                    got = reference.allocate(rid, 2, new_token_ids=pair)
                    if got is None or any(got.new_page_ids):
                        answers[rid] = got
            assert sorted(need) == sorted(answers)
            expected.update(answers)
            admitted = None
            if rng.random() < 0.4:  # after the decodes, as vLLM schedules running requests first
                rid = admitted = f"hd-{step}"
                # Prompts share prefixes, so held-then-sent decode pages can be hit later.
                prompt = tokens(7, int(rng.integers(5, 30))) + tokens(step, 3)
                client.admit(rid, prompt, sync=False)
                expected[rid] = reference.admit(rid, prompt)
            result = client.step(batch=running)
            for rid, want in expected.items():
                if want is None:
                    assert result.by_request()[rid].status is AllocationStatus.NO_CAPACITY
                    if rid in running:
                        running.remove(rid)
                        client.free_later(rid)
                        reference.free(rid)
                elif rid == admitted:
                    running.append(rid)
            num_held_seen += sum(client.request(r).num_held_tokens for r in running)
            for rid in running:
                for g in range(len(reference.groups)):
                    assert client.block_table(rid, g).page_ids.tolist() == (
                        reference.page_table(rid, g).tolist()
                    )
            got = [_event_key(e) for e in _service_events(client, seq)]
            want_events = [_event_key(e) for e in reference.take_events()]
            assert got == want_events
            num_stored += sum(k[0] == "PageStored" for k in want_events)
            seq = client.pool_info().counters.last_event_seq
        assert num_held_seen > 100 and num_stored > 20  # the test exercised both
        lagging = [r for r in running if client.request(r).num_held_tokens]
        assert lagging
        for rid in lagging:
            assert client.block_table(rid).num_tokens < reference.request_info(rid).num_tokens
        client.flush()
        for rid in running:
            table = client.block_table(rid)
            info = reference.request_info(rid)
            assert (table.num_tokens, table.num_computed_tokens) == (
                info.num_tokens,
                info.num_computed_tokens,
            )
            assert client.request(rid).num_held_tokens == 0


def test_discarded_step_takes_back_held_decodes(connect):
    client = connect()
    client.admit("dq-a", tokens(60, 10))
    client.allocate_decodes(["dq-a"], [1])  # token 11: held back
    assert client.request("dq-a").num_held_tokens == 1
    # More page hashes than full pages: only the service can tell, and refuses the step.
    client.admit("dq-b", tokens(61, 5), page_hashes=[b"h" * 32], sync=False)
    with pytest.raises(InvalidArgumentError, match="page hashes"):
        client.step()
    assert client.discard_queued() == 1
    view = client.request("dq-a")
    assert (view.num_tokens, view.num_held_tokens) == (10, 0)  # the decode is taken back too
    client.allocate_decodes(["dq-a"], [2])
    client.flush()
    assert client.block_table("dq-a").num_tokens == 11
    client.free("dq-a")


def test_a_refused_carrier_holds_its_tokens_again(server_factory, tmp_path):
    """NO_CAPACITY for a decode that carried held-back tokens: nothing changed on the
    service, so the client holds them again, and a retry after another request is
    preempted sends them (the service's counts end level with the client's). Without
    prefix caching a decode that completes a page is held too, so the decode that needs
    the next page carries the whole page's tokens."""
    config = tmp_path / "pool.toml"
    config.write_text(
        "[pool]\nnum_pages = 5\nmax_model_len = 512\nenable_prefix_caching = false\n"
    )  # pages 1..4
    server = server_factory("--config", str(config))
    with PagekeeperClient(server.grpc_address) as client:
        client.register("scheduler")
        client.admit("rc-a", tokens(70, 20))  # 2 pages, 12 slots left in the second
        client.admit("rc-b", tokens(71, 32))  # 2 full pages: the pool is now dry
        for i in range(12):  # tokens 21..32: fit, nothing to cache: all held
            assert client.allocate_decodes(["rc-a"], [i]) == []
            client.step(batch=["rc-a"])
        assert client.request("rc-a").num_held_tokens == 12
        assert client.block_table("rc-a").num_tokens == 20
        # Token 33 needs a page: its growth carries the 12 held tokens; the pool is dry.
        assert client.allocate_decodes(["rc-a"], [60]) == ["rc-a"]
        result = client.step(batch=["rc-a"])
        assert result.by_request()["rc-a"].status is AllocationStatus.NO_CAPACITY
        view = client.request("rc-a")
        assert (view.num_tokens, view.num_held_tokens) == (32, 12)  # held again
        assert client.block_table("rc-a").num_tokens == 20  # nothing changed there
        client.free("rc-b")  # preempt the other request, then retry the decode
        assert client.allocate_decodes(["rc-a"], [60]) == ["rc-a"]
        assert client.step(batch=["rc-a"]).by_request()["rc-a"].ok
        table = client.block_table("rc-a")
        assert (table.num_tokens, table.num_computed_tokens) == (33, 33)
        assert client.request("rc-a").num_held_tokens == 0
        assert len(table.page_ids) == 3


# -- a growth's page hashes ----------------------------------------------------------------


def _engine_chain(label: str, n: int, width: int = 32) -> list[bytes]:
    """``n`` page hashes of an engine's own chain: not what the service makes of the tokens."""
    import hashlib

    out, parent = [], label.encode()
    for _ in range(n):
        parent = hashlib.sha256(parent).digest()[:width]
        out.append(parent)
    return out


def _stored_hashes(client: PagekeeperClient, since: int) -> set[bytes]:
    return {
        h
        for e in _service_events(client, since)
        if isinstance(e, PageStored)
        for h in e.page_hashes
    }


@pytest.mark.parametrize(
    "widths",
    [(32, 32), (16, 16), (32, 16)],
    ids=["columns-service-size", "columns-own-size", "growth-messages"],
)
def test_growth_page_hashes_name_the_pages_generated_tokens_complete(connect, widths):
    """The engine's hashes of the pages generated tokens complete, sent with the growths
    that complete them (decodes held back in between, a raw chunk), are those pages'
    hashes on the service: a lookup by them hits every page, the stored events name them,
    and the service's own hash of the tokens misses. Two requests decode side by side:
    hashes of one size ride in the growth columns, of two sizes in Growth messages."""
    client = connect()
    assert client.pool.accepts_growth_page_hashes and client.pool.page_hash_size == 32
    since = client.pool_info().counters.last_event_seq
    rids = [f"gh-{'-'.join(map(str, widths))}-{i}" for i in range(2)]
    chains = {rid: _engine_chain(rid, 5, width) for rid, width in zip(rids, widths, strict=True)}
    everything = {rid: tokens(900 + i, 20) for i, rid in enumerate(rids)}  # page 1 partial
    for rid in rids:
        assert client.admit(rid, everything[rid], page_hashes=chains[rid][:1]).ok
    for num_tokens in range(21, 65):  # decodes to 64 tokens: pages 1, 2, 3 complete
        for rid in rids:
            token = 1000 + num_tokens
            named = [chains[rid][num_tokens // 16 - 1]] if num_tokens % 16 == 0 else None
            client.allocate_slots(rid, 1, new_token_ids=[token], page_hashes=named)
            everything[rid].append(token)
        if num_tokens % 5 == 0:
            client.step(batch=rids)
    chunk = tokens(990, 16)  # page 4, by the raw form
    client.step(
        growths=[Growth(rid, 16, new_token_ids=chunk, page_hashes=chains[rid][4:]) for rid in rids],
        batch=rids,
    )
    stored = _stored_hashes(client, since)
    for rid in rids:
        everything[rid] += chunk
        hit = client.lookup(everything[rid], page_hashes=chains[rid])
        assert hit.num_hit_tokens == 80 and list(hit.page_hashes) == chains[rid]
        assert client.lookup(everything[rid]).num_hit_tokens == 0  # the service's own chain
        assert set(chains[rid]) <= stored
        assert client.block_table(rid).num_tokens == 80
    client.free(*rids)


def test_a_growth_refused_no_capacity_keeps_no_hash_and_its_retry_sends_them(server_factory):
    server = server_factory("--num-pages", "5")  # pages 1..4
    with PagekeeperClient(server.grpc_address, local_socket=None) as client:
        client.register("scheduler")
        hashes = _engine_chain("nc", 3)
        assert client.admit("nc-a", tokens(80, 20), page_hashes=hashes[:1]).ok  # 2 pages
        assert client.admit("nc-b", tokens(81, 32)).ok  # 2 pages: the pool is dry
        chunk = tokens(82, 28)  # to 48 tokens: pages 1 and 2 complete, one more page
        got = client.allocate_slots(
            "nc-a", 28, new_token_ids=chunk, page_hashes=hashes[1:], sync=True
        )
        assert got.status is AllocationStatus.NO_CAPACITY
        assert client.request("nc-a").num_tokens == 20
        assert client.block_table("nc-a").num_tokens == 20
        client.free("nc-b")
        got = client.allocate_slots(
            "nc-a", 28, new_token_ids=chunk, page_hashes=hashes[1:], sync=True
        )
        assert got.ok and len(got.new_page_ids[0]) == 1
        everything = tokens(80, 20) + chunk
        assert client.lookup(everything, page_hashes=hashes).num_hit_tokens == 48


def test_growth_page_hashes_the_client_or_service_refuse_change_nothing(connect):
    client = connect()
    hashes = _engine_chain("bad", 2)
    assert client.admit("gb-a", tokens(85, 31), page_hashes=hashes[:1]).ok
    with pytest.raises(InvalidArgumentError, match="2 page hashes for the 1 pages"):
        client.allocate_slots("gb-a", 1, new_token_ids=[5], page_hashes=hashes)
    with pytest.raises(InvalidArgumentError, match="repeats"):
        client.allocate_slots("gb-a", 1, new_token_ids=[5], page_hashes=[hashes[1]] * 2)
    assert client.num_queued == 0 and client.request("gb-a").num_tokens == 31
    # The previous page's own hash: only the service knows it, and refuses the step whole
    # (the growth fits, so it rides in the next step); dropping the queue undoes it here.
    assert client.allocate_slots("gb-a", 1, new_token_ids=[5], page_hashes=hashes[:1]).is_local
    with pytest.raises(InvalidArgumentError, match="previous page"):
        client.step()
    assert client.discard_queued() == 1
    assert client.request("gb-a").num_tokens == 31
    assert client.block_table("gb-a").num_tokens == 31
    assert client.allocate_slots("gb-a", 1, new_token_ids=[5], page_hashes=hashes[1:]).ok
    client.step()
    assert client.lookup(tokens(85, 31) + [5], page_hashes=hashes).num_hit_tokens == 32
    client.free("gb-a")


def test_async_growth_and_decode_page_hashes(pagekeeper_server):
    async def main() -> None:
        async with AsyncPagekeeperClient(
            pagekeeper_server.grpc_address, token=pagekeeper_server.token
        ) as client:
            await client.register("scheduler", name="async-growth-hashes")
            a, b = _engine_chain("agh-a", 2), _engine_chain("agh-b", 2)
            for rid, seed, chain in (("agh-a", 86, a), ("agh-b", 87, b)):
                assert (await client.admit(rid, tokens(seed, 31), page_hashes=chain[:1])).ok
            with pytest.raises(InvalidArgumentError, match="do not decode"):
                await client.allocate_decodes(["agh-a"], [1], page_hashes={"agh-c": a[1]})
            # Both complete page 1: a names it in the decode step, b by allocate_slots.
            await client.allocate_decodes(["agh-a"], [1], page_hashes={"agh-a": a[1]})
            await client.allocate_slots("agh-b", 1, new_token_ids=[2], page_hashes=b[1:])
            await client.step()
            for seed, token, chain in ((86, 1, a), (87, 2, b)):
                hit = await client.lookup(tokens(seed, 31) + [token], page_hashes=chain)
                assert hit.num_hit_tokens == 32
            await client.free("agh-a", "agh-b")

    asyncio.run(main())


def test_an_older_service_is_not_sent_growth_hashes_it_would_ignore(connect):
    import dataclasses

    from pagekeeper_client import UnimplementedError

    client = connect()
    assert client.admit("old-a", tokens(88, 31)).ok
    state = client._scheduler()
    state.pool = dataclasses.replace(state.pool, accepts_growth_page_hashes=False)
    with pytest.raises(UnimplementedError, match="does not take a growth's page hashes"):
        client.allocate_slots("old-a", 1, new_token_ids=[1], page_hashes=_engine_chain("o", 1))
    assert client.num_queued == 0 and client.request("old-a").num_tokens == 31
    client.free("old-a")
