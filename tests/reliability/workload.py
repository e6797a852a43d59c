"""A deterministic stream of service commands for durability tests.

:class:`Workload` plays several schedulers and workers against a
:class:`~pagekeeper.state.ServiceState`: admissions with shared prefixes (cache hits),
decodes that cross pages, chunked prefills, frees, preemption on no-capacity, retried steps,
heartbeats, scheduler takeovers, worker churn, admin force-frees, lease expiry, prefix-cache
resets, limit changes. Every choice comes from a seeded generator and from the answers the
state gave, so two states fed by two workloads with the same seed (a live one and a
never-crashed twin, or a recovered one) receive the same commands exactly as long as they
give the same answers. ``now`` advances by ``tick`` per command.

    workload = Workload(seed=3)
    for _ in range(500):
        workload.run_one(state)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.errors import PagekeeperError
from pagekeeper.state import (
    Admission,
    AllocationStatus,
    Batch,
    ClientRole,
    Command,
    ConfigureLimitsCommand,
    ExpireLeasesCommand,
    ForceFreeCommand,
    GroupKernelSupport,
    Growth,
    HeartbeatCommand,
    KernelBackend,
    Limits,
    RegisterCommand,
    ResetPrefixCacheCommand,
    ServiceState,
    StepCommand,
    StepResult,
    UnregisterCommand,
)

FULL_POOL = PoolConfig(num_pages=96, max_model_len=512)
HYBRID_POOL = PoolConfig(
    num_pages=160,
    max_model_len=512,
    groups=(
        GroupConfig(GroupKind.FULL, 16),
        GroupConfig(GroupKind.SLIDING_WINDOW, 16, window=40),
        GroupConfig(GroupKind.MAMBA, 32, enable_state_caching=True),
    ),
)
LIMITS = Limits(lease_ttl_s=5.0, max_lease_ttl_s=60.0, lease_grace_s=1.0, event_buffer_size=512)


def tokens(start: int, n: int) -> np.ndarray:
    return (np.arange(start, start + n) % 30_000).astype(np.int32)


@dataclass
class _Scheduler:
    client_id: str = ""
    generation: int = 0
    running: dict[str, int] = field(default_factory=dict)
    """request id -> tokens known (its context length)."""
    preempted: list[str] = field(default_factory=list)
    last: StepCommand | None = None


@dataclass
class _Worker:
    client_id: str = ""
    generation: int = 0


class Workload:
    """Commands for one state (see the module docstring)."""

    def __init__(
        self,
        seed: int,
        pool: PoolConfig = FULL_POOL,
        *,
        num_schedulers: int = 2,
        tick: float = 0.01,
        start: float = 1000.0,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.pool = pool
        self.tick = tick
        self.now = start
        self.schedulers = [_Scheduler() for _ in range(num_schedulers)]
        self.workers = [_Worker(), _Worker()]
        self.next_request = 0
        self.next_step_id = 0
        self.draining = False
        self.num_commands = 0
        self.num_applied = 0
        self.num_refused = 0
        self.last_result: Any = None

    # -- choosing --------------------------------------------------------------------------
    def next_command(self) -> Command:
        self.now += self.tick
        now = self.now
        rng = self.rng
        for sched in self.schedulers:
            if not sched.client_id:
                return RegisterCommand(now=now, role=ClientRole.SCHEDULER, name="sched")
        if not self.workers[0].client_id:
            return self._register_worker(0, now)
        roll = float(rng.random())
        if roll < 0.04:
            return self._worker_churn(now)
        if roll < 0.06:
            sched = self._pick()
            return HeartbeatCommand(now, sched.client_id, sched.generation)
        if roll < 0.075:
            # A restarted scheduler takes its id over (generation + 1), keeping its requests.
            sched = self._pick()
            return RegisterCommand(
                now=now, role=ClientRole.SCHEDULER, name="sched", client_id=sched.client_id
            )
        if roll < 0.085:
            owned = [(s, r) for s in self.schedulers for r in s.running]
            if owned:
                _, rid = owned[int(rng.integers(len(owned)))]
                return ForceFreeCommand(now, rid)
        if roll < 0.09 or self.draining:
            # Drain every scheduler, one step each, then reset the prefix cache (refused
            # while any request holds pages).
            busy = [s for s in self.schedulers if s.running]
            if not busy:
                self.draining = False
                return ResetPrefixCacheCommand(now)
            self.draining = True
            sched = busy[0]
            self.next_step_id += 1
            return StepCommand(
                now, sched.client_id, sched.generation, self.next_step_id, tuple(sched.running)
            )
        if roll < 0.10:
            return ExpireLeasesCommand(now)
        if roll < 0.105:
            size = int(rng.choice([256, 512, 1024]))
            return ConfigureLimitsCommand(now, dataclasses.replace(LIMITS, event_buffer_size=size))
        if roll < 0.14:
            sched = self._pick()
            if sched.last is not None:
                # A client retrying its last step (same id): the stored answer, no change.
                return dataclasses.replace(sched.last, now=now, generation=sched.generation)
        return self._step(self._pick(), now)

    def _pick(self) -> _Scheduler:
        return self.schedulers[int(self.rng.integers(len(self.schedulers)))]

    def _register_worker(self, index: int, now: float) -> RegisterCommand:
        rng = self.rng
        support = []
        for group_id, group in enumerate(self.pool.groups):
            if group.kind is GroupKind.MAMBA:
                continue
            sizes = [s for s in (8, 16) if group.page_size % s == 0]
            chosen = sizes[int(rng.integers(len(sizes)))]
            support.append(GroupKernelSupport(group_id, (KernelBackend("ref", (chosen,)),)))
        worker = self.workers[index]
        return RegisterCommand(
            now=now,
            role=ClientRole.WORKER,
            name=f"worker-{index}",
            client_id=worker.client_id,
            device="cpu",
            kernel_support=tuple(support),
        )

    def _worker_churn(self, now: float) -> Command:
        index = int(self.rng.integers(len(self.workers)))
        worker = self.workers[index]
        if worker.client_id and self.rng.random() < 0.5:
            return UnregisterCommand(now, worker.client_id, worker.generation)
        return self._register_worker(index, now)

    def _step(self, sched: _Scheduler, now: float) -> StepCommand:
        rng = self.rng
        frees = list(sched.preempted)
        running = [r for r in sched.running if r not in frees]
        if running and rng.random() < 0.25:
            victim = running[int(rng.integers(len(running)))]
            frees.append(victim)
            running.remove(victim)
        growths = []
        max_len = self.pool.max_model_len
        for rid in running:
            known = sched.running[rid]
            if known + 4 > max_len:
                frees.append(rid)
                continue
            n = 1 if rng.random() < 0.9 else int(rng.integers(2, 4))
            growths.append(Growth(rid, n, tokens(int(rng.integers(0, 500)), n)))
        running = [g.request_id for g in growths]
        admissions = []
        for _ in range(int(rng.integers(0, 3))):
            rid = f"q{self.next_request}"
            self.next_request += 1
            prefix = int(rng.integers(0, 4)) * 7000
            prompt = np.concatenate(
                [tokens(prefix, int(rng.integers(16, 80))), tokens(self.next_request * 13, 20)]
            )
            chunk = int(rng.integers(8, len(prompt))) if rng.random() < 0.2 else 0
            admissions.append(Admission(rid, prompt, num_new_tokens=chunk))
        batch_ids = tuple(running + [a.request_id for a in admissions])
        # One counter for every scheduler: published step ids increase across the pool.
        self.next_step_id += 1
        return StepCommand(
            now=now,
            client_id=sched.client_id,
            generation=sched.generation,
            step_id=self.next_step_id,
            frees=tuple(frees),
            growths=tuple(growths),
            admissions=tuple(admissions),
            batch=Batch(batch_ids) if rng.random() < 0.8 else None,
        )

    # -- observing ---------------------------------------------------------------------------
    def observe(self, command: Command, result: Any) -> None:
        """Update the model from an answer (``result`` is the exception when refused)."""
        self.num_commands += 1
        self.last_result = result
        if isinstance(result, Exception):
            self.num_refused += 1
            return
        self.num_applied += 1
        if isinstance(command, RegisterCommand):
            if command.role is ClientRole.SCHEDULER:
                sched = self._by_id(result.client_id) or next(
                    s for s in self.schedulers if not s.client_id
                )
                sched.client_id, sched.generation = result.client_id, result.generation
            else:
                worker = next(
                    (w for w in self.workers if w.client_id == result.client_id),
                    None,
                ) or next(w for w in self.workers if not w.client_id)
                worker.client_id, worker.generation = result.client_id, result.generation
        elif isinstance(command, UnregisterCommand):
            for worker in self.workers:
                if worker.client_id == command.client_id:
                    worker.client_id, worker.generation = "", 0
        elif isinstance(command, ForceFreeCommand):
            # Half the time the owner's view stays stale: it grows the request on (answered
            # NO_CAPACITY), preempts and frees it (accepted as done), as a scheduler would.
            if self.rng.random() < 0.5:
                for sched in self.schedulers:
                    sched.running.pop(command.request_id, None)
        elif isinstance(command, ExpireLeasesCommand):
            for cid in result.expired_client_ids:
                self._forget(cid)
        elif isinstance(command, StepCommand):
            self._observe_step(command, result)

    def _observe_step(self, command: StepCommand, result: StepResult) -> None:
        sched = self._by_id(command.client_id)
        if sched is None or result.is_retry:
            return
        sched.last = command
        for rid in command.frees:
            sched.running.pop(rid, None)
        sched.preempted = []
        statuses = {o.request_id: o.status for o in result.results}
        for growth in command.growths:
            status = statuses.get(growth.request_id, AllocationStatus.OK)
            if status is AllocationStatus.OK:
                sched.running[growth.request_id] += len(growth.new_token_ids)
            else:
                sched.preempted.append(growth.request_id)
        for admission in command.admissions:
            if statuses[admission.request_id] is AllocationStatus.OK:
                sched.running[admission.request_id] = len(admission.token_ids)

    def _by_id(self, client_id: str) -> _Scheduler | None:
        return next((s for s in self.schedulers if s.client_id == client_id), None)

    def _forget(self, client_id: str) -> None:
        for sched in self.schedulers:
            if sched.client_id == client_id:
                sched.client_id, sched.generation = "", 0
                sched.running.clear()
                sched.preempted.clear()
                sched.last = None
        for worker in self.workers:
            if worker.client_id == client_id:
                worker.client_id, worker.generation = "", 0

    # -- driving -----------------------------------------------------------------------------
    def run_one(self, state: ServiceState) -> tuple[Command, Any]:
        """Choose, apply, observe; returns the command and its answer (or exception)."""
        command = self.next_command()
        try:
            result: Any = state.apply(command)
        except PagekeeperError as exc:
            result = exc
        self.observe(command, result)
        return command, result


def new_state(pool: PoolConfig = FULL_POOL, limits: Limits = LIMITS) -> ServiceState:
    """A state for the workload (invariants are checked where tests compare states: after
    every command they would dominate the run time)."""
    return ServiceState(pool, limits)


__all__ = ["FULL_POOL", "HYBRID_POOL", "LIMITS", "Workload", "new_state", "tokens"]
