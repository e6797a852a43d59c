"""Twins: a state that never crashed, fed the same commands, to compare a recovered one with.

Recovery returns the state after some log record ``K``; :func:`twin_at` replays the same
seeded :class:`~tests.reliability.workload.Workload` on a fresh state until it has produced
``K`` records (a counting journal sees exactly what the durable one would have logged), and
returns it with its workload, ready to feed both states the *next* commands too.
"""

from __future__ import annotations

import os
from typing import Any

from pagekeeper.core.config import PoolConfig
from pagekeeper.core.errors import PagekeeperError
from pagekeeper.durability import Durability
from pagekeeper.state import Command, ServiceState
from tests.reliability.workload import FULL_POOL, LIMITS, Workload, new_state


class CountingJournal:
    """Counts what a durable journal would have recorded."""

    def __init__(self) -> None:
        self.num_records = 0

    def record(self, command: Command, result: Any) -> None:
        self.num_records += 1


def twin_at(
    seed: int, num_records: int, pool: PoolConfig = FULL_POOL
) -> tuple[ServiceState, Workload]:
    """A fresh state driven by ``Workload(seed)`` up to exactly ``num_records`` records."""
    state = ServiceState(pool, LIMITS)
    journal = CountingJournal()
    state.journal = journal
    workload = Workload(seed, pool)
    guard = 0
    while journal.num_records < num_records:
        workload.run_one(state)
        guard += 1
        assert guard < 50 * (num_records + 10), "the workload stopped producing records"
    assert journal.num_records == num_records
    state.journal = None
    return state, workload


def answer(state: ServiceState, command: Command) -> Any:
    try:
        return state.apply(command)
    except PagekeeperError as exc:
        return exc


def same_answer(a: Any, b: Any) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    return bool(a == b)


def assert_same_future(
    first: ServiceState, second: ServiceState, workload: Workload, num_commands: int
) -> None:
    """Feed both states the workload's next commands: every answer (pages allocated, hits,
    evictions, errors) must be the same."""
    for _ in range(num_commands):
        command = workload.next_command()
        a, b = answer(first, command), answer(second, command)
        assert same_answer(a, b), f"{command}: {a!r} != {b!r}"
        workload.observe(command, a)
    first.check_invariants()
    second.check_invariants()


def crash(durability: Durability) -> None:
    """Drop a Durability as a dying process would: no snapshot, no checkpoint call (the
    lock goes with the fd, as it does with the process)."""
    log = durability._log
    durability._log = None
    if log is not None:
        # Its checkpoint thread goes with it (the one under way, if any, finishes: a
        # checkpoint cut short is a case the kill -9 campaigns cover).
        log.stop_background_checkpoints()
        log._db.close()
        if log._segment_fd is not None:  # closed as it is: zeros reserved ahead stay
            os.close(log._segment_fd)
            log._segment_fd = None
    if durability._lock_fd is not None:
        os.close(durability._lock_fd)
        durability._lock_fd = None


def recover(
    data_dir: Any, pool: PoolConfig = FULL_POOL, **options: Any
) -> tuple[ServiceState, Durability]:
    state = new_state(pool)
    durability = Durability.open(data_dir, options.pop("level", "process"), **options)
    try:
        durability.recover(state)  # checks the invariants once, at the end
    except BaseException:
        durability.close()
        raise
    return state, durability


__all__ = [
    "CountingJournal",
    "answer",
    "assert_same_future",
    "crash",
    "recover",
    "same_answer",
    "twin_at",
]
