"""A process that writes a durable state as fast as it can until it is killed.

    python -m tests.reliability.crash_driver DATA_DIR --seed 3 [--pool full|hybrid]
        [--level process|fsync] [--snapshot-every 40] [--max-commands N]

It recovers whatever ``DATA_DIR`` holds, brings a :class:`~tests.reliability.workload.
Workload` to the same point (a twin replayed up to the recovered record), prints
``ready <last_seq>``, then applies commands with the durable journal attached and prints
``acked <seq>`` after each record is committed: a line the parent has read names a
record that must survive a ``kill -9`` arriving at any moment after it.
"""

from __future__ import annotations

import argparse
import sys

from pagekeeper.durability import Durability
from tests.reliability.twins import twin_at
from tests.reliability.workload import FULL_POOL, HYBRID_POOL, new_state

POOLS = {"full": FULL_POOL, "hybrid": HYBRID_POOL}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--pool", choices=sorted(POOLS), default="full")
    parser.add_argument("--level", choices=("process", "fsync"), default="process")
    parser.add_argument("--snapshot-every", type=int, default=40)
    parser.add_argument("--max-commands", type=int, default=1_000_000)
    args = parser.parse_args()
    pool = POOLS[args.pool]

    state = new_state(pool)
    durability = Durability.open(args.data_dir, args.level, snapshot_every=args.snapshot_every)
    report = durability.recover(state)
    _, workload = twin_at(args.seed, report.last_seq, pool)
    durability.attach(state)
    # Zeros written ahead of the records as the service writes them (after the command
    # that asked), so kills land in them and in their writing too.
    asked: list[bool] = []
    durability.schedule_reserve = lambda: asked.append(True)
    out = sys.stdout
    out.write(f"ready {report.last_seq}\n")
    out.flush()
    last = durability.last_seq
    for _ in range(args.max_commands):
        workload.run_one(state)
        if durability.last_seq != last:
            last = durability.last_seq
            out.write(f"acked {last}\n")
            out.flush()
        if asked:
            asked.clear()
            durability.reserve_ahead()
        durability.maybe_snapshot(state)
    state.journal = None
    durability.close(state)
    out.write("done\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
