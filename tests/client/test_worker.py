"""Worker registration and table views against the real service, on every transport."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import numpy as np
import pytest
import torch

from pagekeeper_client import (
    AllocationStatus,
    FailedPreconditionError,
    InvalidArgumentError,
    KernelBackend,
    PagekeeperClient,
    register_worker,
)
from pagekeeper_client.ring import RingClosed, RingError
from pagekeeper_client.transports._torch import cuda_available
from tests.client._util import tokens
from tests.helpers.proxy import CuttableProxy
from tests.helpers.server import launch

PAGE = 16
# Generous: a step is published in milliseconds, but a full `make test` beside other work
# once took over 10 s to deliver one to a waiting worker.
WAIT_S = 30.0


def expected_slots(pages: list[int], start: int, stop: int) -> list[int]:
    return [pages[pos // PAGE] * PAGE + pos % PAGE for pos in range(start, stop)]


def expected_kernel_ids(pages: list[int], kbs: int) -> list[int]:
    r = PAGE // kbs
    return [p * r + j for p in pages for j in range(r)]


def check_step(tables, scheduler: PagekeeperClient, rows, kbs: int) -> None:
    """``rows``: (request_id, first scheduled position, seq_len) in batch order."""
    table = tables.table(0)
    assert table.kernel_block_size == kbs
    assert table.block_table.dtype == torch.int32 and table.row_lengths.dtype == torch.int32
    assert table.slot_mapping.dtype == torch.int64
    assert tables.num_reqs == len(rows) == table.block_table.shape[0]
    slots: list[int] = []
    for i, (rid, start, stop) in enumerate(rows):
        pages = scheduler.page_ids(rid).tolist()
        want = expected_kernel_ids(pages, kbs)
        assert int(table.row_lengths[i]) == len(want)
        assert table.block_table[i, : len(want)].tolist() == want
        slots += expected_slots(pages, start, stop)
    assert table.slot_mapping.tolist() == slots


@pytest.mark.parametrize("transport", ["shm", "cpu_ipc", "none"], ids=["shm", "cpu_ipc", "stream"])
def test_worker_reads_each_step_on_every_transport(server_factory, transport):
    server = server_factory("--num-pages", "128", publish_transport=transport)
    with (
        register_worker(server.grpc_address, "cpu", {0: [KernelBackend("REF", (8, 32))]}) as w,
        PagekeeperClient(server.grpc_address) as scheduler,
    ):
        assert w.kernel_block_sizes == (8,)
        assert w.view.kind == ("stream" if transport == "none" else transport)
        scheduler.register("scheduler")
        prefix = tokens(1, 48)
        a, b = prefix + tokens(2, 10), prefix + tokens(3, 20)
        scheduler.admit("w-a", a)
        assert scheduler.admit("w-b", b, sync=False).status is AllocationStatus.PENDING
        first = scheduler.step(batch=["w-a", "w-b"])
        assert first.is_published and first.results[0].num_cached_tokens == 48
        tables = w.view.wait(first.step_id, timeout=WAIT_S)
        # w-a was admitted by its own (synchronous) step: the published batch schedules
        # what each row was last allocated for -- all of w-a, w-b after its cached prefix.
        check_step(tables, scheduler, [("w-a", 0, 58), ("w-b", 48, 68)], 8)
        for n in range(12):  # w-a crosses into its 5th page
            for rid in ("w-a", "w-b"):
                scheduler.allocate_slots(rid, 1, new_token_ids=[n + 1])
            step = scheduler.step(batch=["w-b", "w-a"])
            tables = w.view.wait(step.step_id, timeout=WAIT_S)
            check_step(tables, scheduler, [("w-b", 68 + n, 69 + n), ("w-a", 58 + n, 59 + n)], 8)
        assert len(scheduler.page_ids("w-a")) == 5
        arrays = w.view.wait_arrays(step.step_id, timeout=WAIT_S)
        assert arrays.table(0, 8).slot_mapping.tolist() == tables.table(0).slot_mapping.tolist()


@pytest.mark.parametrize("transport", ["shm", "none"], ids=["shm", "stream"])
def test_worker_follows_a_recreated_ring(server_factory, transport):
    server = server_factory("--num-pages", "64", publish_transport=transport)
    with (
        register_worker(server.grpc_address, "cpu", {0: [16]}) as first,
        PagekeeperClient(server.grpc_address) as scheduler,
    ):
        scheduler.register("scheduler")
        scheduler.admit("rc-a", tokens(5, 40))
        step = scheduler.step(batch=["rc-a"])
        check_step(first.view.wait(step.step_id, timeout=WAIT_S), scheduler, [("rc-a", 0, 40)], 16)
        # A worker with another kernel block size joins: the ring is re-created with a
        # second table; the first worker's next read finds its ring closed and re-maps.
        # (Workers joining mid-run here only read tables: not fresh, or their registration
        # would revoke the running request, as a real replacement worker's does.)
        with register_worker(
            server.grpc_address, "cpu", [[KernelBackend(multiple_of=(4,))]], fresh_kv_cache=False
        ):
            pass  # chooses the page size (16): same tables, the ring is kept
        with register_worker(server.grpc_address, "cpu", {0: [4]}, fresh_kv_cache=False) as second:
            assert second.kernel_block_sizes == (4,)
            scheduler.allocate_slots("rc-a", 1, new_token_ids=[1])
            step = scheduler.step(batch=["rc-a"])
            check_step(
                second.view.wait(step.step_id, timeout=WAIT_S), scheduler, [("rc-a", 40, 41)], 4
            )
            check_step(
                first.view.wait(step.step_id, timeout=WAIT_S), scheduler, [("rc-a", 40, 41)], 16
            )
            assert first.view.num_reopens == 1


@contextlib.contextmanager
def _first_worker_and_step(server, request_id: str):
    """A worker (kernel block 16), a scheduler, and one published step of ``request_id``
    (40 tokens) the worker has seen: ``(worker, scheduler, step id)``."""
    with (
        register_worker(server.grpc_address, "cpu", {0: [16]}) as first,
        PagekeeperClient(server.grpc_address) as scheduler,
    ):
        scheduler.register("scheduler")
        scheduler.admit(request_id, tokens(5, 40))
        one = scheduler.step(batch=[request_id]).step_id
        assert first.view.wait_next(-1, timeout=WAIT_S) == one
        yield first, scheduler, one


@pytest.mark.parametrize("transport", ["shm", "cpu_ipc"])
def test_worker_polling_latest_steps_follows_a_recreated_ring(server_factory, transport):
    """A worker that follows published steps by polling (``wait_next``, as the example
    worker does) re-maps when the ring is re-created, as ``wait`` does; it polled the closed
    ring's last step forever before."""
    server = server_factory("--num-pages", "64", publish_transport=transport)
    with (
        _first_worker_and_step(server, "p-a") as (first, scheduler, one),
        register_worker(server.grpc_address, "cpu", {0: [4]}, fresh_kv_cache=False),
    ):
        scheduler.allocate_slots("p-a", 1, new_token_ids=[1])
        two = scheduler.step(batch=["p-a"]).step_id
        assert first.view.wait_next(one, timeout=WAIT_S) == two
        assert first.view.num_reopens == 1
        check_step(first.view.wait(two, timeout=WAIT_S), scheduler, [("p-a", 40, 41)], 16)


def test_worker_follows_a_ring_recreated_twice_in_a_row(server_factory):
    """Workers joining one after another: the first worker's client heard of the second
    ring (a heartbeat) when a third replaced it; the view re-maps to the current one."""
    server = server_factory("--num-pages", "64", publish_transport="shm")
    with (
        _first_worker_and_step(server, "t-a") as (first, scheduler, one),
        register_worker(server.grpc_address, "cpu", {0: [4]}, fresh_kv_cache=False),
    ):
        first.client.heartbeat()  # as its lease renewal would
        with register_worker(server.grpc_address, "cpu", {0: [8]}, fresh_kv_cache=False):
            scheduler.allocate_slots("t-a", 1, new_token_ids=[1])
            two = scheduler.step(batch=["t-a"]).step_id
            assert first.view.wait_next(one, timeout=WAIT_S) == two
            check_step(first.view.wait(two, timeout=WAIT_S), scheduler, [("t-a", 40, 41)], 16)


@pytest.mark.parametrize("transport", ["shm", "none"], ids=["shm", "stream"])
def test_a_worker_one_published_step_behind_reads_it_across_steps_that_publish_nothing(
    server_factory, transport
):
    """A synchronous admission is a step of its own that publishes nothing, so published
    step ids come every other id: with slot ``step % depth`` each one overwrote the last
    (depth 2), and a worker one published step behind lost it."""
    server = server_factory("--num-pages", "64", publish_transport=transport)
    with (
        register_worker(server.grpc_address, "cpu", {0: [16]}) as worker,
        PagekeeperClient(server.grpc_address) as scheduler,
    ):
        scheduler.register("scheduler")
        scheduler.admit("gap-a", tokens(9, 40))
        published = []
        for k in range(3):
            step = scheduler.step(batch=["gap-a", *(f"gap-{j}" for j in range(k))])
            assert step.is_published
            published.append(step.step_id)
            scheduler.admit(f"gap-{k}", tokens(20 + k, 20))  # its own step: nothing published
        assert [b - a for a, b in itertools.pairwise(published)] == [2, 2]
        worker.view.wait(published[-1], timeout=WAIT_S)
        older = worker.view.wait(published[-2], timeout=WAIT_S)  # one published step behind
        check_step(older, scheduler, [("gap-a", 0, 40), ("gap-0", 0, 20)], 16)


def test_a_worker_waiting_without_a_timeout_follows_a_restarted_service(server_factory):
    """The service is killed (it never marks its ring closed) and started again on the same
    data dir and address: a worker blocked in ``wait(timeout=None)`` learns the new ring from
    its lease renewal and reads the step there (it waited on the dead ring forever)."""
    args = ("--num-pages", "64", "--lease-ttl-s", "1", "--lease-grace-s", "30")
    server = server_factory(*args, publish_transport="shm")
    with (
        register_worker(server.grpc_address, "cpu", {0: [16]}) as worker,
        PagekeeperClient(server.grpc_address, local_socket=None) as scheduler,
    ):
        scheduler.register("scheduler")
        scheduler.admit("rs-a", tokens(6, 40))
        first = scheduler.step(batch=["rs-a"]).step_id
        worker.view.wait(first, timeout=WAIT_S)
        got: list[object] = []
        waiter = threading.Thread(
            target=lambda: got.append(worker.view.wait(first + 1)), daemon=True
        )
        waiter.start()
        server.process.kill()
        server.process.wait(10)
        again = launch(
            server.workdir, *args, "--grpc-address", server.grpc_address, publish_transport="shm"
        )
        try:
            scheduler.allocate_slots("rs-a", 1, new_token_ids=[7])
            step = scheduler.step(batch=["rs-a"])
            assert step.is_published and step.step_id == first + 1
            waiter.join(WAIT_S)
            assert not waiter.is_alive(), "the worker still waits on the dead service's ring"
            check_step(got[0], scheduler, [("rs-a", 40, 41)], 16)
            assert worker.view.num_reopens == 1
        finally:
            again.stop()


def test_a_waiting_worker_learns_that_a_stopped_service_closed_its_ring(server_factory):
    """A clean stop closes the ring: a worker blocked in ``wait`` gets RingClosed (a
    RingError, what a worker loop catches), not the UnavailableError of asking the stopped
    service which ring follows; the steps already in the ring stay readable."""
    server = server_factory("--num-pages", "64", publish_transport="shm")
    with (
        register_worker(server.grpc_address, "cpu", {0: [16]}) as worker,
        PagekeeperClient(server.grpc_address, local_socket=None) as scheduler,
    ):
        scheduler.register("scheduler")
        scheduler.admit("stop-a", tokens(10, 40))
        first = scheduler.step(batch=["stop-a"]).step_id
        worker.view.wait(first, timeout=WAIT_S)
        errors: list[BaseException] = []

        def wait_next() -> None:
            try:
                worker.view.wait(first + 1)
            except BaseException as exc:
                errors.append(exc)

        waiter = threading.Thread(target=wait_next, daemon=True)
        waiter.start()
        assert server.stop() == 0
        waiter.join(WAIT_S)
        assert not waiter.is_alive()
        assert isinstance(errors[0], RingClosed) and "closed the ring" in str(errors[0])
        assert worker.view.wait(first, timeout=WAIT_S).step_seq == first


@contextlib.contextmanager
def _stream_worker_behind_a_proxy(server_factory):
    """A stream worker (no ring) reaching the service through a proxy the test can cut, and
    a registered scheduler talking to it directly: ``(worker, scheduler, proxy)``."""
    server = server_factory("--num-pages", "64", publish_transport="none")
    proxy = CuttableProxy(server.grpc_address)
    try:
        with (
            register_worker(proxy.address, "cpu", {0: [16]}) as worker,
            PagekeeperClient(server.grpc_address) as scheduler,
        ):
            scheduler.register("scheduler")
            yield worker, scheduler, proxy
    finally:
        proxy.close()


def test_a_stream_worker_resumes_after_its_connection_is_reset(server_factory):
    """A network blip resets a stream worker's connection while the service runs on: its
    ``WatchTables`` stream resumes after the last step it delivered (the ring is the same),
    keeping that step readable, and every later step arrives."""
    with _stream_worker_behind_a_proxy(server_factory) as (worker, scheduler, proxy):
        assert worker.view.kind == "stream"
        scheduler.admit("blip-a", tokens(8, 40))
        before = scheduler.step(batch=["blip-a"]).step_id
        worker.view.wait(before, timeout=WAIT_S)
        proxy.cut()
        for n in range(4):
            scheduler.allocate_slots("blip-a", 1, new_token_ids=[n])
            step = scheduler.step(batch=["blip-a"])
            tables = worker.view.wait(step.step_id, timeout=WAIT_S)
            check_step(tables, scheduler, [("blip-a", 40 + n, 41 + n)], 16)
        assert worker.view.num_reopens >= 1
        assert worker.view.descriptor.generation == tables.epoch


def test_a_stream_cut_before_its_first_step_gets_the_steps_published_meanwhile(
    server_factory,
):
    """A stream worker whose connection is reset before any step reached it resumes after
    the last step published when it registered, not "from now": the step published while
    it was cut off arrives (it was lost before, the resume asking for step 0)."""
    with _stream_worker_behind_a_proxy(server_factory) as (worker, scheduler, proxy):
        scheduler.admit("cut-a", tokens(8, 40))
        time.sleep(0.5)  # the worker's WatchTables is open
        proxy.cut()
        time.sleep(0.3)  # its stream saw the reset
        step = scheduler.step(batch=["cut-a"])
        assert step.is_published
        tables = worker.view.wait(step.step_id, timeout=WAIT_S)
        check_step(tables, scheduler, [("cut-a", 0, 40)], 16)
        assert worker.view.num_reopens >= 1


def test_a_fresh_worker_forgets_the_prefix_cache_and_its_own_reregistration_does_not(
    server_factory,
):
    """A worker that just started holds no KV: prefix hits on pages an earlier worker
    computed would read pages it never wrote (the example pair failed with NaN on its second
    run against one service). ``register_worker`` says so, and the service forgets the
    prefix cache; the same worker taking its id over again (its KV intact) does not."""
    server = server_factory("--num-pages", "64", publish_transport="shm")
    with PagekeeperClient(server.grpc_address) as scheduler:
        scheduler.register("scheduler")
        prompt = tokens(11, 40)
        scheduler.admit("fresh-a", prompt)
        scheduler.free("fresh-a")
        assert scheduler.lookup(prompt).num_hit_tokens == 32
        with register_worker(server.grpc_address, "cpu", {0: [16]}) as worker:
            assert scheduler.lookup(prompt).num_hit_tokens == 0
            assert scheduler.admit("fresh-b", prompt).num_cached_tokens == 0
            assert scheduler.lookup(prompt).num_hit_tokens == 32  # this worker computes it
            worker.client.reregister()
            assert scheduler.lookup(prompt).num_hit_tokens == 32
            with register_worker(server.grpc_address, "cpu", {0: [16]}, fresh_kv_cache=False):
                assert scheduler.lookup(prompt).num_hit_tokens == 32
        metrics = server.http().get("/metrics").text
        assert "pagekeeper_prefix_cache_forgets_total 1.0" in metrics
        cache = server.http().get("/v1/pool").json()["prefix_cache"]
        assert cache["num_forgets"] == 1 and cache["num_kv_loss_revocations"] == 0
        with (
            PagekeeperClient(server.grpc_address) as other,
            pytest.raises(InvalidArgumentError, match="only workers"),
        ):
            other.register("scheduler", fresh_kv_cache=True)


def test_worker_registration_errors(server_factory):
    server = server_factory("--num-pages", "32", publish_transport="shm")
    with pytest.raises(FailedPreconditionError, match="group 0") as exc:
        register_worker(server.grpc_address, "cpu", {0: [KernelBackend("FLASH_MLA", (64,))]})
    assert exc.value.reason  # the service's words
    if not cuda_available():
        with pytest.raises(RingError, match="CUDA"):
            register_worker(server.grpc_address, "cuda:0", {0: [16]})
    # Sizes and group ids the wire cannot carry, and specs that do not parse: the client
    # names the field (protobuf's "Value out of range" or int()'s message before).
    for backends, match in (
        ({0: [KernelBackend("x", (2**40,))]}, "kernel block size 1099511627776"),
        ({0: [KernelBackend("x", (0,))]}, "kernel block size 0"),
        ({2**40: [16]}, "group id 1099511627776"),
        ({-1: [16]}, "group id -1"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            register_worker(server.grpc_address, "cpu", backends)
    with pytest.raises(InvalidArgumentError, match="'abc' is not a block size"):
        KernelBackend.parse("FLASH_ATTN:x16,abc")
    assert KernelBackend.parse("FLASH_ATTN:16,x32") == KernelBackend("FLASH_ATTN", (16,), (32,))


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_gpu_worker_gets_device_tensors(server_factory):  # pragma: no cover - GPU only
    server = server_factory("--num-pages", "64", publish_transport="shm")
    with (
        register_worker(server.grpc_address, "cuda:0", {0: [16]}) as worker,
        PagekeeperClient(server.grpc_address) as scheduler,
    ):
        scheduler.register("scheduler")
        scheduler.admit("gpu-a", tokens(6, 33))
        step = scheduler.step(batch=["gpu-a"])
        tables = worker.view.wait(step.step_id, timeout=WAIT_S)
        assert tables.table(0).block_table.device.type == "cuda"
        torch.cuda.synchronize()
        pages = scheduler.page_ids("gpu-a").tolist()
        assert tables.table(0).block_table[0, :3].cpu().tolist() == pages
        assert tables.table(0).slot_mapping.cpu().tolist() == expected_slots(pages, 0, 33)
        assert np.array_equal(tables.table(0).row_lengths.cpu().numpy(), [3])


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_gpu_workers_read_the_services_cuda_ipc_ring(server_factory):  # pragma: no cover
    """The service process owns a device ring (``cuda_ipc``); two workers on cuda:0 read each
    step's tables in place (views of the one imported allocation), a third with another
    kernel block size makes the service re-create the ring and the first worker re-maps."""
    server = server_factory(
        "--num-pages", "128", "--publish-device", "cuda:0", publish_transport="cuda_ipc"
    )
    with (
        register_worker(server.grpc_address, "cuda:0", {0: [KernelBackend("REF", (8,))]}) as w1,
        register_worker(server.grpc_address, "cuda:0", {0: [8]}) as w2,
        PagekeeperClient(server.grpc_address) as scheduler,
    ):
        assert w1.view.kind == w2.view.kind == "cuda_ipc"
        scheduler.register("scheduler")
        prefix = tokens(1, 48)
        scheduler.admit("g-a", prefix + tokens(2, 10))
        scheduler.admit("g-b", prefix + tokens(3, 20))
        first = scheduler.step(batch=["g-a", "g-b"])
        for w in (w1, w2):
            tables = w.wait(first.step_id, timeout=WAIT_S)
            assert tables.table(0).block_table.device == torch.device("cuda:0")
            torch.cuda.current_stream().synchronize()
            check_step(tables, scheduler, [("g-a", 0, 58), ("g-b", 48, 68)], 8)
        ptrs = set()
        for n in range(20):  # more steps than ring slots; both cross into new pages
            for rid in ("g-a", "g-b"):
                scheduler.allocate_slots(rid, 1, new_token_ids=[n + 1])
            step = scheduler.step(batch=["g-b", "g-a"])
            for w in (w1, w2):
                tables = w.wait(step.step_id, timeout=WAIT_S)
                ptrs.add(tables.table(0).block_table.data_ptr())
                torch.cuda.current_stream().synchronize()
                rows = [("g-b", 68 + n, 69 + n), ("g-a", 58 + n, 59 + n)]
                check_step(tables, scheduler, rows, 8)
        # Views of the ring's slots, not fresh copies: a handful of addresses over 40 reads.
        assert len(ptrs) <= 2 * 4
        with register_worker(server.grpc_address, "cuda:0", {0: [4]}, fresh_kv_cache=False) as w3:
            assert w3.kernel_block_sizes == (4,)
            scheduler.allocate_slots("g-a", 1, new_token_ids=[7])
            step = scheduler.step(batch=["g-a"])
            for w, kbs in ((w3, 4), (w1, 8)):
                tables = w.wait(step.step_id, timeout=WAIT_S)
                torch.cuda.current_stream().synchronize()
                check_step(tables, scheduler, [("g-a", 78, 79)], kbs)
            assert w1.view.num_reopens == 1
