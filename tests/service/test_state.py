"""The transport-free service state: commands in, results out, deterministic."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    InvariantViolation,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Superseded,
)
from pagekeeper.core.events import PageStored, TokenRun, event_nbytes
from pagekeeper.core.types import ExtraKeys, MultiModalKey
from pagekeeper.publication import PublicationHub
from pagekeeper.publish.api import RingDescriptor, RingGeometry
from pagekeeper.state import (
    Admission,
    AllocationStatus,
    Batch,
    ClientRole,
    ConfigureLimitsCommand,
    ExpireLeasesCommand,
    ForceFreeCommand,
    GroupKernelSupport,
    Growth,
    GrowthColumns,
    HeartbeatCommand,
    KernelBackend,
    Limits,
    PageState,
    RegisterCommand,
    ServiceState,
    StepCommand,
    UnregisterCommand,
)


def tokens(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def make_state(num_pages: int = 64, **limits: object) -> ServiceState:
    return ServiceState(
        PoolConfig(num_pages=num_pages, max_model_len=512),
        Limits(**limits),  # type: ignore[arg-type]
        debug_invariants=True,
    )


def scheduler(state: ServiceState, now: float = 0.0) -> tuple[str, int]:
    result = state.register(RegisterCommand(now=now, role=ClientRole.SCHEDULER))
    return result.client_id, result.generation


def step(state: ServiceState, client: tuple[str, int], step_id: int, now: float = 1.0, **kw):
    return state.step(
        StepCommand(now=now, client_id=client[0], generation=client[1], step_id=step_id, **kw)
    )


def test_step_order_free_grow_admit():
    state = make_state()
    me = scheduler(state)
    r = step(
        state, me, 1, admissions=(Admission("a", tokens(0, 40)), Admission("b", tokens(100, 20)))
    )
    assert [o.status for o in r.results] == [AllocationStatus.OK] * 2
    a_pages = r.results[0].new_page_ids[0]
    assert a_pages == (1, 2, 3)
    # One step: free a, grow b by 13 tokens (20 -> 33: into a 3rd page), re-admit a.
    r = step(
        state,
        me,
        2,
        frees=("a",),
        growths=(Growth("b", 13, tokens(120, 13)),),
        admissions=(Admission("a", tokens(0, 40)),),
    )
    grow, readmit = r.results
    assert grow.request_id == "b" and grow.new_page_ids[0] != ()
    # a's two full pages were cached and freed to the tail; the re-admission hits them.
    assert readmit.num_cached_tokens == 32 and readmit.hit_page_ids[0] == (1, 2)


def test_retry_and_old_step_ids():
    state = make_state()
    me = scheduler(state)
    first = step(state, me, 5, admissions=(Admission("a", tokens(0, 40)),))
    again = step(state, me, 5, admissions=(Admission("zzz", tokens(0, 40)),))
    assert again.is_retry and again.results == first.results
    assert not state.manager.has_request("zzz")
    with pytest.raises(FailedPrecondition, match="older"):
        step(state, me, 4)
    with pytest.raises(InvalidArgument):
        step(state, me, 0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"frees": ("nope",)}, NotFound),
        ({"frees": ("a", "a")}, InvalidArgument),
        (
            {"growths": (Growth("a", 1, tokens(0, 1)), Growth("a", 1, tokens(0, 1)))},
            InvalidArgument,
        ),
        ({"admissions": (Admission("a", tokens(0, 4)),)}, AlreadyExists),
        ({"admissions": (Admission("n", tokens(0, 513)),)}, InvalidArgument),
        ({"admissions": (Admission("n", np.array([], dtype=np.int32)),)}, InvalidArgument),
        ({"admissions": (Admission("n", tokens(0, 4), num_new_tokens=5),)}, InvalidArgument),
        ({"admissions": (Admission("", tokens(0, 4)),)}, InvalidArgument),
        ({"admissions": (Admission("x" * 300, tokens(0, 4)),)}, InvalidArgument),
        ({"growths": (Growth("a", 1, tokens(0, 480)),)}, InvalidArgument),
        ({"growths": (Growth("a", 1, np.array([5, -3], dtype=np.int32)),)}, InvalidArgument),
        ({"growths": (Growth("a", 1, np.array([0.5])),)}, InvalidArgument),
        ({"growths": (Growth("a", 1, tokens(0, 1), num_computed_tokens=100),)}, InvalidArgument),
        ({"batch": Batch(("a", "zz"))}, NotFound),
        ({"batch": Batch(("a",), np.array([1, 2], dtype=np.int32))}, InvalidArgument),
        ({"batch": Batch(("a",), np.array([-1], dtype=np.int32))}, InvalidArgument),
        ({"batch": Batch(("a",), np.array([10**5], dtype=np.int32))}, ResourceExhausted),
        ({"frees": tuple(f"r{i}" for i in range(1025))}, ResourceExhausted),
    ],
)
def test_bad_steps_change_nothing(kwargs, error):
    state = make_state()
    me = scheduler(state)
    step(state, me, 1, admissions=(Admission("a", tokens(0, 40)),))
    before = (
        state.manager.page_table("a").tolist(),
        state.manager.pool.free_queue(),
        state.last_event_seq,
    )
    with pytest.raises(error):
        step(state, me, 2, **kwargs)
    after = (
        state.manager.page_table("a").tolist(),
        state.manager.pool.free_queue(),
        state.last_event_seq,
    )
    assert after == before
    assert state.client(me[0]).last_step_id == 1
    assert state.counters.num_steps_rejected == 1


def test_ownership_roles_generations():
    state = make_state()
    owner, other = scheduler(state), scheduler(state)
    step(state, owner, 1, admissions=(Admission("a", tokens(0, 40)),))
    with pytest.raises(PermissionDenied):
        step(state, other, 1, frees=("a",))
    with pytest.raises(PermissionDenied):  # nor publish it
        step(state, other, 1, batch=Batch(("a",)))
    worker = state.register(RegisterCommand(now=0.0, role=ClientRole.WORKER))
    with pytest.raises(PermissionDenied, match="only schedulers"):
        step(state, (worker.client_id, worker.generation), 1)
    takeover = state.register(
        RegisterCommand(now=0.0, role=ClientRole.SCHEDULER, client_id=owner[0])
    )
    assert takeover.generation == 2 and takeover.last_step_id == 1
    with pytest.raises(Superseded, match="generation"):
        step(state, owner, 2, frees=("a",))
    with pytest.raises(FailedPrecondition, match="registered as scheduler"):
        state.register(RegisterCommand(now=0.0, role=ClientRole.WORKER, client_id=owner[0]))
    with pytest.raises(NotFound):
        state.register(RegisterCommand(now=0.0, role=ClientRole.SCHEDULER, client_id="ghost"))
    assert state.unregister(UnregisterCommand(0.0, owner[0], 2)) == 1
    assert not state.manager.has_request("a")


def test_leases_expire_by_command_time():
    state = ServiceState(PoolConfig(num_pages=64), Limits(lease_ttl_s=5.0, lease_grace_s=2.0))
    me = scheduler(state, now=100.0)
    step(state, me, 1, now=101.0, admissions=(Admission("a", tokens(0, 40)),))  # renews to 106
    state.heartbeat(HeartbeatCommand(104.0, *me))  # renews to 109
    with pytest.raises(FailedPrecondition, match="lease expired"):
        state.heartbeat(HeartbeatCommand(109.5, *me))
    assert state.expire_leases(ExpireLeasesCommand(110.0)).expired_client_ids == ()  # grace
    result = state.expire_leases(ExpireLeasesCommand(111.5))
    assert result.expired_client_ids == (me[0],) and result.num_freed_requests == 1
    assert state.manager.stats().num_used_pages == 0
    with pytest.raises(NotFound):
        state.heartbeat(HeartbeatCommand(112.0, *me))


def test_block_tables_never_split_a_mamba_state_page():
    """Workers get a Mamba group's state pages whole (registration refuses a smaller kernel
    block for it): GetBlockTable refuses to show them split."""
    pool = PoolConfig(
        num_pages=64,
        groups=(GroupConfig(page_size=64), GroupConfig(kind=GroupKind.MAMBA, page_size=64)),
        max_model_len=1024,
    )
    state = ServiceState(pool, Limits())
    me = scheduler(state)
    step(state, me, 1, admissions=(Admission("m", tokens(0, 100)),))
    pages, kernel, kbs = state.block_table("m", 0, 16)
    assert kbs == 16 and len(kernel) == 4 * len(pages)
    pages, kernel, kbs = state.block_table("m", 1, 0)
    assert kbs == 64 and kernel.tolist() == pages.tolist() and len(pages) == 1
    with pytest.raises(InvalidArgument, match="mamba states, whose pages are never split"):
        state.block_table("m", 1, 16)


def test_client_limit_and_kernel_choice():
    pool = PoolConfig(
        num_pages=64,
        groups=(GroupConfig(page_size=64), GroupConfig(kind=GroupKind.MAMBA, page_size=64)),
        max_model_len=1024,
    )
    state = ServiceState(pool, Limits(max_clients=2))
    support = (
        GroupKernelSupport(
            0, (KernelBackend("FLASHINFER", (16, 32)), KernelBackend("FA", (), (16,)))
        ),
    )
    worker = state.register(
        RegisterCommand(now=0.0, role=ClientRole.WORKER, kernel_support=support)
    )
    assert worker.kernel_block_sizes == (32, 64)
    with pytest.raises(FailedPrecondition, match="mamba"):
        state.register(
            RegisterCommand(
                now=0.0,
                role=ClientRole.WORKER,
                kernel_support=(GroupKernelSupport(1, (KernelBackend("X", (16,)),)),),
            )
        )
    with pytest.raises(InvalidArgument, match="group 5"):
        state.register(
            RegisterCommand(
                now=0.0, role=ClientRole.WORKER, kernel_support=(GroupKernelSupport(5, ()),)
            )
        )
    scheduler(state)
    with pytest.raises(ResourceExhausted, match="max_clients"):
        scheduler(state)


class FakePublisher:
    created: list[FakePublisher] = []

    def __init__(self, kind: str, geometry: RingGeometry) -> None:
        self.geometry = geometry
        self.published: list[tuple[int, list]] = []
        self.is_closed = False
        self.generation = 1000 + len(FakePublisher.created)
        FakePublisher.created.append(self)

    def publish(self, step_seq, tables):
        self.published.append((step_seq, list(tables)))
        return step_seq % self.geometry.depth

    def descriptor(self) -> RingDescriptor:
        return RingDescriptor(
            "shm", self.generation, self.geometry, 123, path=f"/dev/shm/{self.generation}"
        )

    def close(self) -> None:
        self.is_closed = True


def test_publication_follows_registered_workers():
    FakePublisher.created.clear()
    pool = PoolConfig(num_pages=64, groups=(GroupConfig(page_size=32),), max_model_len=256)
    hub = PublicationHub(
        pool, transport="shm", depth=2, max_num_reqs=8, max_num_tokens=64, factory=FakePublisher
    )
    state = ServiceState(pool, Limits(), sink=hub, debug_invariants=True)
    me = scheduler(state)
    # No worker: a batch is validated but nothing is built or published.
    r = step(state, me, 1, admissions=(Admission("a", tokens(0, 40)),), batch=Batch(("a",)))
    assert not r.is_published and FakePublisher.created == []

    def worker(size: int):
        support = (GroupKernelSupport(0, (KernelBackend("k", (size,)),)),)
        return state.register(
            RegisterCommand(now=0.0, role=ClientRole.WORKER, kernel_support=support)
        )

    w16 = worker(16)
    assert w16.ring is not None and w16.ring.geometry.tables == ((0, 16, 16),)
    r = step(state, me, 2, growths=(Growth("a", 1, tokens(40, 1)),), batch=Batch(("a",)))
    assert r.is_published and r.published_slot == 0
    ((seq, tables),) = FakePublisher.created[0].published
    assert seq == 2 and [(t.group_id, t.kernel_block_size) for t in tables] == [(0, 16)]
    assert tables[0].slot_mapping.tolist() == [
        r_ for r_ in [state.manager.page_table("a")[1] * 32 + 8]
    ]
    # A second worker with another size: the ring is re-created with both tables.
    w8 = worker(8)
    assert FakePublisher.created[0].is_closed
    assert w8.ring.geometry.tables == ((0, 8, 32), (0, 16, 16))
    r = step(state, me, 3, batch=Batch(("a",), np.array([1], dtype=np.int32)))
    ((_, tables),) = FakePublisher.created[1].published
    assert sorted((t.kernel_block_size, t.block_table.shape[1]) for t in tables) == [
        (8, 8),
        (16, 4),
    ]
    # Publishing ids must increase; the last worker leaving releases the ring.
    other = scheduler(state)
    with pytest.raises(FailedPrecondition, match="last published"):
        step(state, other, 3, batch=Batch(()))
    state.unregister(UnregisterCommand(0.0, w16.client_id, w16.generation))
    state.unregister(UnregisterCommand(0.0, w8.client_id, w8.generation))
    assert FakePublisher.created[-1].is_closed and hub.descriptor() is None


def test_replay_gives_the_same_state():
    """Commands recorded while driving one state, applied to a fresh one, give the same
    pages, free queue, events and answers (what a durable command log relies on)."""
    rng = np.random.default_rng(0)
    live = ServiceState(PoolConfig(num_pages=48, max_model_len=512), debug_invariants=True)
    log: list[object] = [RegisterCommand(now=0.0, role=ClientRole.SCHEDULER)]
    live.apply(log[0])
    running: list[str] = []
    preempted: list[str] = []
    answers = []
    for step_id in range(1, 80):
        # Free what got no capacity last step (preemption), and every third step the oldest.
        frees = tuple(preempted) + (tuple(running[:1]) if step_id % 3 == 0 and running else ())
        running = [r for r in running if r not in frees]
        growths = tuple(Growth(r, 1, tokens(int(rng.integers(0, 99)), 1)) for r in running)
        prefix = int(rng.integers(0, 3)) * 1000
        new = f"r{step_id}"
        prompt = np.concatenate([tokens(prefix, 32), tokens(step_id * 7, 20)])
        command = StepCommand(
            float(step_id),
            "scheduler-1",
            1,
            step_id,
            frees,
            growths,
            (Admission(new, prompt),),
            Batch(tuple(running)),
        )
        log.append(command)
        result = live.apply(command)
        answers.append(result)
        statuses = {o.request_id: o.status for o in result.results}
        preempted = [r for r in running if statuses.get(r) is AllocationStatus.NO_CAPACITY]
        running = [r for r in running if r not in preempted]
        if statuses[new] is AllocationStatus.OK:
            running.append(new)
    assert any(o.status is AllocationStatus.NO_CAPACITY for a in answers for o in a.results)

    replayed = ServiceState(PoolConfig(num_pages=48, max_model_len=512), debug_invariants=True)
    replay_answers = [replayed.apply(c) for c in log][1:]
    assert replay_answers == answers
    assert replayed.request_ids() == live.request_ids()
    for rid in live.request_ids():
        assert replayed.manager.page_table(rid).tolist() == live.manager.page_table(rid).tolist()
    assert replayed.manager.pool.free_queue() == live.manager.pool.free_queue()
    assert replayed.events_since(0, 10**6) == live.events_since(0, 10**6)


def test_force_free_and_pages_view():
    state = make_state()
    me = scheduler(state)
    step(state, me, 1, admissions=(Admission("a", tokens(0, 40)),))
    assert state.page(1).state is PageState.USED and state.page(0).state is PageState.NULL
    used, nxt = state.page_ids_in_state(PageState.USED, 0, 2)
    assert used == [1, 2] and nxt == 3
    assert state.counters.num_force_frees == 0
    state.force_free(ForceFreeCommand(0.0, "a"))
    assert state.page(1).state is PageState.CACHED and state.page(3).state is PageState.FREE
    assert state.client(me[0]).request_ids == set()
    with pytest.raises(NotFound):
        state.force_free(ForceFreeCommand(0.0, "a"))
    with pytest.raises(NotFound):
        state.page(64)
    assert state.counters.num_force_frees == 1  # the refused one is not counted


def test_events_since_a_number_never_given_out_start_over():
    """A watcher holding a sequence number from a state that was reset (durability none):
    told it fell behind, and given the events from the oldest, not silence until the new
    numbers pass its own."""
    state = make_state()
    me = scheduler(state)
    step(state, me, 1, admissions=(Admission("a", tokens(0, 40)),))
    last = state.last_event_seq
    assert last >= 1
    page = state.events_since(last, 100)
    assert page.events == () and not page.fell_behind
    page = state.events_since(last + 500, 100)
    assert page.fell_behind and page.events[0].seq == page.first_retained_seq
    assert page.events[-1].seq == last


def test_force_free_count_survives_a_snapshot_and_older_ones_start_it_at_zero():
    state = make_state()
    me = scheduler(state)
    step(state, me, 1, admissions=(Admission("a", tokens(0, 40)),))
    state.force_free(ForceFreeCommand(0.0, "a"))
    snap = state.snapshot_state()
    twin = make_state()
    twin.restore_state(snap)
    assert twin.counters.num_force_frees == 1
    del snap["counters"]["num_force_frees"]  # a snapshot from before the counter
    older = make_state()
    older.restore_state(snap)
    assert older.counters.num_force_frees == 0
    assert older.counters.num_steps == state.counters.num_steps


def test_owner_of_a_force_freed_request_keeps_stepping():
    """An admin's free leaves its owner's view behind: the owner's next free of it is
    accepted as done, a growth of it gets NO_CAPACITY (the scheduler preempts it), a batch
    listing it leaves it out; nothing refuses the whole step (which the client would resend
    forever). The id can be admitted again; a snapshot and a replay keep the revocation."""
    state = make_state()
    me = scheduler(state)
    other = scheduler(state)
    step(state, me, 1, admissions=(Admission("v", tokens(0, 40)), Admission("o", tokens(500, 20))))
    free_before = state.manager.pool.num_free_pages
    state.force_free(ForceFreeCommand(1.0, "v"))
    assert state.manager.pool.num_free_pages == free_before + 3
    assert state.client(me[0]).revoked == {"v"}
    # Another client naming it learns only that it holds no pages.
    with pytest.raises(NotFound):
        step(state, other, 1, frees=("v",))
    # Named twice (freed and grown; grown and admitted; freed and in the batch): refused
    # whole, as for a running request.
    with pytest.raises(InvalidArgument, match="named twice"):
        step(state, me, 2, frees=("v",), growths=(Growth("v", 1, tokens(40, 1)),))
    with pytest.raises(InvalidArgument, match="both grown and admitted"):
        step(
            state,
            me,
            2,
            growths=(Growth("v", 1, tokens(40, 1)),),
            admissions=(Admission("v", tokens(0, 8)),),
        )
    with pytest.raises(InvalidArgument, match="freed and in the batch"):
        step(state, me, 2, frees=("v",), batch=Batch(("v", "o")))
    assert state.client(me[0]).revoked == {"v"}
    # A growth of it: NO_CAPACITY, the rest of the step applies; the batch leaves it out.
    r = step(
        state,
        me,
        2,
        growths=(Growth("v", 1, tokens(40, 1)), Growth("o", 1, tokens(520, 1))),
        batch=Batch(("v", "o")),
    )
    assert [(o.request_id, o.status) for o in r.results] == [("v", AllocationStatus.NO_CAPACITY)]
    assert r.unscheduled_request_ids == ("v",)
    assert state.manager.requests["o"].num_computed_tokens == 21
    snap = state.snapshot_state()
    twin = ServiceState(PoolConfig(num_pages=64, max_model_len=512), debug_invariants=True)
    twin.restore_state(snap)
    assert twin.client(me[0]).revoked == {"v"}
    # Its free (the preemption) is accepted and ends the revocation; a second one is not.
    free_now = state.manager.pool.num_free_pages
    r = step(state, me, 3, frees=("v",), batch=Batch(("o",)))
    assert r.results == () and state.manager.pool.num_free_pages == free_now
    assert state.client(me[0]).revoked == set()
    with pytest.raises(NotFound):
        step(state, me, 4, frees=("v",))
    # Revoked again, then admitted again under the same id: a fresh request (a step an
    # older reader applies alike: not journaled as one it must refuse).
    step(state, me, 4, admissions=(Admission("w", tokens(900, 20)),))
    assert state.force_free(ForceFreeCommand(2.0, "w")) is True
    r = step(state, me, 5, admissions=(Admission("w", tokens(900, 20)),), batch=Batch(("w", "o")))
    assert r.results[0].status is AllocationStatus.OK and r.unscheduled_request_ids == ()
    assert not r.names_revoked
    assert state.client(me[0]).revoked == set() and "w" in state.client(me[0]).request_ids
    # Leaving drops what is left: nothing outlives its client.
    state.force_free(ForceFreeCommand(3.0, "w"))
    state.unregister(UnregisterCommand(4.0, me[0], me[1]))
    state.check_invariants()


def test_a_revoked_request_among_growth_columns():
    """Decodes in column form (the client's usual step) with one revoked row: that row gets
    NO_CAPACITY, every other row its token, as in message form."""
    state = make_state(num_pages=256)
    me = scheduler(state)
    ids = [f"r{i}" for i in range(12)]
    step(
        state, me, 1, admissions=tuple(Admission(r, tokens(100 * i, 20)) for i, r in enumerate(ids))
    )
    state.force_free(ForceFreeCommand(1.0, "r5"))
    r = step(
        state,
        me,
        2,
        growth_columns=GrowthColumns.decodes(ids, np.arange(12, dtype=np.int32)),
        batch=Batch(tuple(ids)),
    )
    assert [(o.request_id, o.status) for o in r.results] == [("r5", AllocationStatus.NO_CAPACITY)]
    assert r.unscheduled_request_ids == ("r5",)
    assert all(state.manager.requests[x].num_computed_tokens == 21 for x in ids if x != "r5")
    state.check_invariants()


def test_revocations_replay_alike():
    live = make_state()
    me = scheduler(live)
    log = [
        StepCommand(1.0, me[0], me[1], 1, admissions=(Admission("v", tokens(0, 40)),)),
        ForceFreeCommand(2.0, "v"),
        StepCommand(3.0, me[0], me[1], 2, growths=(Growth("v", 1, tokens(40, 1)),)),
        StepCommand(4.0, me[0], me[1], 3, frees=("v",)),
    ]
    answers = [live.apply(c) for c in log]
    replayed = make_state()
    scheduler(replayed)
    assert [replayed.apply(c) for c in log] == answers
    assert replayed.client(me[0]).revoked == live.client(me[0]).revoked == set()


def test_events_buffer_is_bounded_by_bytes_too():
    """Stored events carry their tokens: the buffer stops at event_buffer_bytes as well as
    at event_buffer_size, oldest first; a reader further back is told it fell behind, and a
    restored snapshot holds the same buffer."""
    budget = 3 * event_nbytes(
        PageStored(0, 0, (b"h" * 32,) * 20, None, TokenRun(range(320)), 16, tuple(range(20)))
    )
    state = make_state(num_pages=256, event_buffer_bytes=budget)
    me = scheduler(state)
    for i in range(6):
        step(state, me, i + 1, admissions=(Admission(f"r{i}", tokens(i * 1000, 320)),))
    kept = state.events_since(0, 100)
    assert kept.fell_behind and [e.seq for e in kept.events] == [4, 5, 6]
    assert state._events_nbytes == sum(map(event_nbytes, kept.events)) <= budget
    assert state.event_buffer() == (3, state._events_nbytes, 4)
    twin = make_state(num_pages=256, event_buffer_bytes=budget)
    twin.restore_state(state.snapshot_state())
    assert twin.events_since(0, 100) == kept and twin._events_nbytes == state._events_nbytes
    # Tighter limits drop more at once; the newest event always stays.
    state.configure_limits(
        ConfigureLimitsCommand(2.0, dataclasses.replace(state.limits, event_buffer_bytes=1))
    )
    assert [e.seq for e in state.events_since(0, 100).events] == [6]


def test_events_buffer_reports_falling_behind():
    state = ServiceState(PoolConfig(num_pages=64), Limits(event_buffer_size=3))
    me = scheduler(state)
    for i in range(5):
        step(state, me, i + 1, admissions=(Admission(f"r{i}", tokens(i * 100, 20)),))
    page = state.events_since(0, 100)
    assert page.fell_behind and [e.seq for e in page.events] == [3, 4, 5]
    assert not state.events_since(2, 100).fell_behind
    assert state.events_since(5, 100).events == ()


def _snapshot_bytes(state: ServiceState) -> bytes:
    """The state as a snapshot holds it, its counters aside (a refused step is counted)."""
    from pagekeeper.durability.snapshot import encode_snapshot

    tree = state.snapshot_state()
    tree["counters"] = None
    return encode_snapshot(tree)


def test_inputs_refused_whole_before_anything_changes():
    """Found by an adversarial review: each was accepted, or applied part-way, before."""
    state = make_state()
    me = scheduler(state)
    step(state, me, 1, admissions=(Admission("a", tokens(0, 40)),))
    before = _snapshot_bytes(state)
    h = b"\x11" * 32
    overlapping = ExtraKeys(
        mm_inputs=(MultiModalKey("i1", 0, 4), MultiModalKey("i2", 2, 4)),
    )
    for kw, match in (
        # Step ids the journal, snapshots and ring words (int64) cannot hold.
        ({"admissions": (Admission("b", tokens(0, 8)),)}, "step_id"),
        # A chain never repeats: a repeat mapped one cached page into two table slots.
        ({"admissions": (Admission("b", tokens(0, 40), page_hashes=(h, h)),)}, "repeats"),
        # Placeholders sorted and disjoint, checked up front (the free of "a" was applied
        # and the admission REJECTED before; with caching off it was accepted).
        (
            {
                "frees": ("a",),
                "admissions": (Admission("b", tokens(0, 8), extra_keys=overlapping),),
            },
            "must not overlap",
        ),
        (
            {"admissions": (Admission("b", tokens(0, 8), extra_keys=ExtraKeys(lora_path="/p")),)},
            "lora_path",
        ),
    ):
        step_id = 2**63 if match == "step_id" else 2
        with pytest.raises(InvalidArgument, match=match):
            step(state, me, step_id, **kw)
        assert _snapshot_bytes(state) == before, match
    assert step(state, me, 2**63 - 1, frees=("a",)).step_id == 2**63 - 1
    _snapshot_bytes(state)  # still encodes
    nocache = ServiceState(
        PoolConfig(num_pages=64, max_model_len=512, enable_prefix_caching=False), Limits()
    )
    other = scheduler(nocache)
    with pytest.raises(InvalidArgument, match="must not overlap"):
        step(nocache, other, 1, admissions=(Admission("b", tokens(0, 8), extra_keys=overlapping),))


def test_replay_counts_publications_as_they_were_first_answered():
    """A replay has no sink, but its published and failed publications count as the live
    ones did (a crash must not reset them while the steps stay counted); retries and
    refused steps are not in the journal and count since the process started."""
    pool = PoolConfig(num_pages=64, groups=(GroupConfig(page_size=16),), max_model_len=256)
    hub = PublicationHub(
        pool, transport="shm", depth=2, max_num_reqs=8, max_num_tokens=64, factory=FakePublisher
    )
    live = ServiceState(pool, Limits(max_tokens_per_step=32), sink=hub, debug_invariants=True)
    commands: list[tuple[object, tuple[bool, int, str] | None]] = []
    register = RegisterCommand(now=0.0, role=ClientRole.SCHEDULER)
    worker = RegisterCommand(
        now=0.0,
        role=ClientRole.WORKER,
        kernel_support=(GroupKernelSupport(0, (KernelBackend("k", (16,)),)),),
    )
    me = (live.apply(register).client_id, 1)
    live.apply(worker)
    commands += [(register, None), (worker, None)]
    for step_id, (rid, n) in enumerate((("a", 20), ("b", 40), ("c", 10)), start=1):
        command = StepCommand(
            1.0,
            me[0],
            me[1],
            step_id,
            admissions=(Admission(rid, tokens(step_id, n)),),
            batch=Batch((rid,)),
        )
        result = live.apply(command)
        commands.append(
            (command, (result.is_published, result.published_slot, result.publish_error))
        )
    assert [c[1][0] for c in commands[2:]] == [True, False, True]  # b: 40 tokens > 32
    live.apply(commands[-1][0])  # a retry
    with pytest.raises(AlreadyExists):
        step(live, me, 4, admissions=(Admission("c", tokens(9, 4)),))  # c runs: refused
    counted = live.counters
    assert (counted.num_published, counted.num_publish_errors) == (2, 1)
    assert (counted.num_step_retries, counted.num_steps_rejected) == (1, 1)

    replayed = ServiceState(pool, Limits(max_tokens_per_step=32), debug_invariants=True)
    for command, publication in commands:
        replayed.replay(command, publication)
    restored = ServiceState(pool, Limits(max_tokens_per_step=32))
    restored.restore_state(live.snapshot_state())
    for twin in (replayed, restored):
        assert twin.counters.num_steps == counted.num_steps == 3
        assert (twin.counters.num_published, twin.counters.num_publish_errors) == (2, 1)
        assert (twin.counters.num_step_retries, twin.counters.num_steps_rejected) == (0, 0)


class _BrokenSink(FakePublisher):
    def publish(self, step_seq, tables):  # type: ignore[no-untyped-def]
        raise RuntimeError("the transport broke")


def test_publication_failures_and_token_limits_are_publish_errors():
    """The allocations of a step stand once made: a publication that fails for any reason
    (here a transport raising, or more scheduled tokens than max_tokens_per_step when the
    batch did not count them) is the answer's publish_error, and the step is complete."""
    full = PoolConfig(num_pages=64, groups=(GroupConfig(page_size=32),), max_model_len=256)
    # A Mamba group first: its table maps no slots, the attention group's do.
    hybrid = PoolConfig(
        num_pages=64,
        groups=(GroupConfig(kind=GroupKind.MAMBA, page_size=32), GroupConfig(page_size=32)),
        max_model_len=256,
    )
    for pool, factory, limits, match in (
        (full, _BrokenSink, Limits(), "the transport broke"),
        (full, FakePublisher, Limits(max_tokens_per_step=32), "max_tokens_per_step 32"),
        (hybrid, FakePublisher, Limits(max_tokens_per_step=32), "max_tokens_per_step 32"),
    ):
        hub = PublicationHub(
            pool, transport="shm", depth=2, max_num_reqs=8, max_num_tokens=64, factory=factory
        )
        state = ServiceState(pool, limits, sink=hub, debug_invariants=True)
        me = scheduler(state)
        support = tuple(
            GroupKernelSupport(g, (KernelBackend("k", (16, 32)),)) for g in range(len(pool.groups))
        )
        state.register(RegisterCommand(now=0.0, role=ClientRole.WORKER, kernel_support=support))
        r = step(state, me, 1, admissions=(Admission("a", tokens(0, 40)),), batch=Batch(("a",)))
        assert not r.is_published and match in r.publish_error
        assert state.client(me[0]).last_step_id == 1 and "a" in state.request_ids()


def test_a_fresh_worker_revokes_running_requests_so_none_caches_over_lost_kv():
    """A worker with an empty KV cache lacks the running requests' KV as well as the
    cached pages'. Left running, a request would fill pages over KV that is gone and cache
    them, and once another admission re-cached the earlier pages of its prompt, a third
    prompt would hit those pages. The service frees and revokes them instead: their owner's
    growth is NO_CAPACITY, its free is accepted, and prompts after it hit only pages
    computed since; a snapshot keeps the count."""
    state = make_state()
    me = scheduler(state)
    prompt = tokens(0, 40)
    step(state, me, 1, admissions=(Admission("a", prompt),))
    free_before = state.manager.pool.num_free_pages
    state.register(RegisterCommand(now=1.0, role=ClientRole.WORKER, fresh_kv_cache=True))
    assert "a" not in state.manager.requests and state.client(me[0]).revoked == {"a"}
    assert state.manager.pool.num_free_pages == free_before + 3
    assert state.counters.num_prefix_cache_forgets == 1
    assert state.counters.num_kv_loss_revocations == 1
    r = step(state, me, 2, growths=(Growth("a", 8, tokens(40, 8)),), batch=Batch(("a",)))
    assert [(o.request_id, o.status) for o in r.results] == [("a", AllocationStatus.NO_CAPACITY)]
    step(state, me, 3, frees=("a",))
    assert state.client(me[0]).revoked == set()
    b = step(state, me, 4, admissions=(Admission("b", prompt),)).results[0]
    assert b.num_cached_tokens == 0
    c = step(state, me, 5, admissions=(Admission("c", prompt),)).results[0]
    assert c.num_cached_tokens == 32 and c.hit_page_ids[0] == b.new_page_ids[0][:2]
    twin = make_state()
    twin.restore_state(state.snapshot_state())
    assert twin.counters.num_kv_loss_revocations == 1


def test_deferred_caching_answers_and_ends_as_the_eager_state():
    """A state that leaves its admissions' caching for settle() (as the service does, the
    loop calling it after the reply) gives the same answers, events (seqs included) and
    snapshot as one that caches at once, settled or not between steps."""
    from pagekeeper.durability.snapshot import state_digest

    rng = np.random.default_rng(7)
    config = PoolConfig(num_pages=40, max_model_len=512)
    eager, lazy = ServiceState(config), ServiceState(config)
    scheduled: list[int] = []
    lazy.defer_caching(lambda: scheduled.append(1))
    me = scheduler(eager)
    assert scheduler(lazy) == me
    running: list[str] = []
    preempted: list[str] = []
    num_steps_deferred = 0
    for step_id in range(1, 120):
        frees = tuple(preempted) + (tuple(running[:2]) if step_id % 4 == 0 else ())
        running = [r for r in running if r not in frees]
        growths = tuple(Growth(r, 1, tokens(int(rng.integers(0, 99)), 1)) for r in running)
        admissions = tuple(
            Admission(
                f"r{step_id}.{k}",
                np.concatenate(
                    [
                        tokens(int(rng.integers(0, 3)) * 1000, int(rng.integers(0, 40))),
                        tokens(step_id * 7 + k, int(rng.integers(1, 30))),
                    ]
                ),
            )
            for k in range(int(rng.integers(0, 4)))
        )
        kw = {"frees": frees, "growths": growths, "admissions": admissions}
        answers = [step(s, me, step_id, **kw) for s in (eager, lazy)]
        assert answers[0] == answers[1]
        num_steps_deferred += lazy.manager.has_deferred
        if rng.random() < 0.5:
            lazy.settle()  # the loop's call; otherwise the next step settles first
        statuses = {o.request_id: o.status for o in answers[0].results}
        preempted = [r for r in running if statuses.get(r) is AllocationStatus.NO_CAPACITY]
        running = [r for r in running if r not in preempted]
        ok = AllocationStatus.OK
        running += [a.request_id for a in admissions if statuses[a.request_id] is ok]
    assert num_steps_deferred > 20 and len(scheduled) == num_steps_deferred
    assert lazy.events_since(0, 10**6) == eager.events_since(0, 10**6)
    assert state_digest(lazy) == state_digest(eager)
    lazy.check_invariants()


@pytest.mark.parametrize("reader", ["request_info", "lookup", "page_states", "heartbeat"])
def test_a_read_that_settles_in_the_core_leaves_no_event_behind(reader):
    """A read that reaches the manager (which settles itself) before the loop's settle
    call: the events still reach the buffer, and the numbers are those of caching at once."""
    from pagekeeper.durability.snapshot import state_digest

    config = PoolConfig(num_pages=40, max_model_len=512)
    eager, lazy = ServiceState(config), ServiceState(config)
    lazy.defer_caching(lambda: None)
    me = scheduler(eager)
    scheduler(lazy)
    for s in (eager, lazy):
        step(s, me, 1, admissions=(Admission("a", tokens(0, 40)),))
    assert lazy.manager.has_deferred
    if reader == "request_info":
        lazy.request_info("a")
    elif reader == "lookup":
        lazy.lookup(tokens(0, 40))
    elif reader == "page_states":
        lazy.manager.page_states()  # what /v1/pool and the dashboard call
    else:
        beat = [s.heartbeat(HeartbeatCommand(2.0, *me)) for s in (eager, lazy)]
        assert beat[0] == beat[1] and beat[1].last_event_seq == 1
    lazy.settle()  # the loop's call, after the read
    assert lazy.last_event_seq == eager.last_event_seq == 1
    assert lazy.events_since(0, 100) == eager.events_since(0, 100)
    assert state_digest(lazy) == state_digest(eager)


def test_a_failed_settle_refuses_every_later_change():
    """Deferred caching that fails half done (a bug) fences the state: later changes are
    refused before they touch anything, as after a lost log."""
    config = PoolConfig(num_pages=40, max_model_len=512)
    state = ServiceState(config)
    state.defer_caching(lambda: None)
    me = scheduler(state)
    step(state, me, 1, admissions=(Admission("a", tokens(0, 40)),))
    assert state.manager.has_deferred

    def broken() -> None:
        raise RuntimeError("boom")

    state.manager.settle = broken  # type: ignore[method-assign]
    with pytest.raises(InvariantViolation, match="deferred prefix caching failed"):
        state.settle()
    assert "boom" in state.fenced_reason
    free_before = state.manager.pool.num_free_pages
    with pytest.raises(FailedPrecondition, match="refuses changes until it restarts"):
        step(state, me, 2, admissions=(Admission("b", tokens(100, 20)),))
    assert state.manager.pool.num_free_pages == free_before
