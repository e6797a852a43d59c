"""Kill -9 campaigns against :mod:`tests.reliability.crash_driver` (shared by the test suite
and ``make crash``).

One round: start the driver on the data dir, let it acknowledge a random number of records,
``SIGKILL`` it (it is mid-write, mid-snapshot or between the two: wherever it happens to
be), then recover the data dir here and check

* every record the driver acknowledged is in the recovered state (``last_seq`` >= the last
  ``acked`` line read, before or after the kill);
* the recovered state is, digest for digest, a twin that never crashed fed the same
  commands up to that record; invariants hold (recovery checks them);
* optionally (``tear``), the newest journal segment and the WAL are first cut at a random
  byte, as a power loss would leave them without fsync: the state is then the twin at
  whatever prefix survived.

The last round also feeds the recovered state and the twin the same next commands: every
answer (the next allocations) must match.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagekeeper.durability import state_digest
from pagekeeper.durability.log import _SEGMENT_HEADER, DB_NAME, JOURNAL_DIR
from tests.reliability.twins import assert_same_future, recover, twin_at
from tests.reliability.workload import FULL_POOL, HYBRID_POOL

ROOT = Path(__file__).resolve().parents[2]
SEGMENT_HEADER_BYTES = _SEGMENT_HEADER.size
POOLS = {"full": FULL_POOL, "hybrid": HYBRID_POOL}


@dataclass
class CampaignResult:
    crashes: int = 0
    records: int = 0
    torn: int = 0
    lost_acked: int = 0
    seconds: float = 0.0
    mid_snapshot_kills: int = 0
    rounds: list[tuple[int, int, int]] = field(default_factory=list)
    """(last acked, recovered last_seq, replayed) per crash."""


def _is_sound(data_dir: Path) -> bool:
    """Whether SQLite reads the database + WAL of ``data_dir`` without finding corruption
    (checked on a copy: opening the real files would recover and rewrite them)."""
    with tempfile.TemporaryDirectory() as tmp:
        for suffix in ("", "-wal"):
            source = data_dir / f"{DB_NAME}{suffix}"
            if source.exists():
                shutil.copyfile(source, Path(tmp) / f"{DB_NAME}{suffix}")
        try:
            db = sqlite3.connect(Path(tmp) / DB_NAME)
            try:
                return db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            finally:
                db.close()
        except sqlite3.DatabaseError:
            return False


def tear_wal(data_dir: Path, rng: np.random.Generator, attempts: int = 8) -> bool:
    """Cut the WAL at a random byte, as a power loss without fsync may leave it, and drop
    the wal-index (memory SQLite rebuilds on open). A power loss cannot take frames SQLite
    had already synced: it syncs the WAL before copying frames into the database, so a cut
    below frames that a checkpoint (under way at the kill) had copied leaves a state no
    power loss produces, and SQLite reports it as corrupt. Such a cut is undone and a later
    one drawn. Returns whether the WAL was torn."""
    wal = data_dir / f"{DB_NAME}-wal"
    original = wal.read_bytes()
    low = 32
    for _ in range(attempts):
        if low >= len(original):
            break
        with open(wal, "r+b") as f:
            f.truncate(int(rng.integers(low, len(original))))
        (data_dir / f"{DB_NAME}-shm").unlink(missing_ok=True)
        if _is_sound(data_dir):
            return True
        low = wal.stat().st_size + 1
        wal.write_bytes(original)
    return False


def tear_journal(data_dir: Path, rng: np.random.Generator) -> bool:
    """Cut the newest journal segment at a random byte after its header, as a power loss
    leaves a file written without fsync (the records of level ``process``). Returns
    whether there was a record to cut."""
    segments = sorted((data_dir / JOURNAL_DIR).glob("segment-*.pkj"))
    if not segments:
        return False
    newest = segments[-1]
    size = newest.stat().st_size
    if size <= SEGMENT_HEADER_BYTES:
        return False
    os.truncate(newest, int(rng.integers(SEGMENT_HEADER_BYTES, size)))
    return True


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError("the crash driver went quiet")
    return proc.stdout.readline().decode()


def run_campaign(
    data_dir: Path,
    *,
    seed: int,
    crashes: int,
    pool: str = "full",
    level: str = "process",
    tear_every: int = 0,
    max_acks: int = 300,
    snapshot_every: int = 40,
    future: int = 40,
) -> CampaignResult:
    rng = np.random.default_rng(seed)
    result = CampaignResult()
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEKEEPER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    recovered = twin = workload = None
    for round_number in range(crashes):
        command = [
            sys.executable,
            "-m",
            "tests.reliability.crash_driver",
            str(data_dir),
            "--seed",
            str(seed),
            "--pool",
            pool,
            "--level",
            level,
            "--snapshot-every",
            str(snapshot_every),
        ]
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            line = _read_line(proc, 60)
            if not line.startswith("ready"):
                proc.kill()
                raise AssertionError(f"driver failed: {line}{proc.stderr.read().decode()}")
            acked = int(line.split()[1])
            target = int(rng.integers(1, max_acks))
            for _ in range(target):
                acked = int(_read_line(proc, 30).split()[1])
            # Let it run on a random little while: the kill lands anywhere in its loop.
            time.sleep(float(rng.random()) * 0.05)
            proc.send_signal(signal.SIGKILL)
            tail, err = proc.communicate(timeout=30)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
        assert proc.returncode == -signal.SIGKILL, err.decode()
        for extra in tail.decode().split():
            if extra.isdigit():
                acked = max(acked, int(extra))
        torn = bool(tear_every) and round_number % tear_every == tear_every - 1
        wal = data_dir / f"{DB_NAME}-wal"
        if torn:
            # A power loss may take the unsynced tail of both files.
            cut = tear_journal(data_dir, rng)
            if wal.exists() and wal.stat().st_size > 32 and tear_wal(data_dir, rng):
                cut = True
            result.torn += cut
        recovered, durability = recover(data_dir, POOLS[pool])
        report = durability.report
        assert report is not None
        if not torn and report.last_seq < acked:
            result.lost_acked += acked - report.last_seq
        twin, workload = twin_at(seed, report.last_seq, POOLS[pool])
        assert state_digest(recovered) == state_digest(twin), f"round {round_number}"
        if report.num_replayed == 0 and report.snapshot_seq == report.last_seq:
            result.mid_snapshot_kills += 1
        result.rounds.append((acked, report.last_seq, report.num_replayed))
        result.crashes += 1
        result.records = report.last_seq
        if round_number < crashes - 1:
            durability.close()
    assert recovered is not None and twin is not None and workload is not None
    durability.attach(recovered)
    assert_same_future(twin, recovered, workload, future)
    recovered.journal = None
    durability.close()
    result.seconds = time.monotonic() - started
    return result


__all__ = ["CampaignResult", "run_campaign"]
