"""Background WAL checkpoints: the log's checkpoints (and their fsync) run in a thread of
their own, not inside the commit that crosses SQLite's mark on the event loop.

What must hold: every record stays readable, in order, whatever the checkpointer does; the
WAL starts over once a checkpoint has copied it (it does not grow while the thread keeps
up); a reader holding the WAL back makes checkpoints incomplete, never blocks an append,
and the first checkpoint after it leaves copies everything; the appending connection keeps
SQLite's own checkpoint only as a backstop; the service starts the thread and stops it;
the snapshot files a registration replaced go only after a checkpoint that synced it.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time

from pagekeeper.durability import Durability
from pagekeeper.durability.log import (
    BACKSTOP_AUTOCHECKPOINT_PAGES,
    DB_NAME,
    CommandLog,
    DurabilityLevel,
    record_crc,
)

BODY = 8_000


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _body(seq: int) -> bytes:
    return seq.to_bytes(8, "little") * (BODY // 8)


def _assert_records(log: CommandLog, last: int) -> None:
    rows = list(log.read_after(0))
    assert [seq for seq, _, _ in rows] == list(range(1, last + 1))
    for seq, crc, body in rows:
        assert body == _body(seq) and crc == record_crc(seq, body)


def _wal_bytes(directory) -> int:
    path = directory / f"{DB_NAME}-wal"
    return path.stat().st_size if path.exists() else 0


def test_the_thread_checkpoints_and_the_wal_starts_over(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(every_bytes=64 * 1024, interval_s=60.0)
    stats = log.checkpoint_stats
    assert stats is not None
    assert log._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == (
        BACKSTOP_AUTOCHECKPOINT_PAGES
    )
    largest = 0
    for seq in range(1, 1201):
        log.append(seq, _body(seq))
        if seq % 4 == 0:
            # A pause as between steps: the thread's checkpoint finishes in it, so the
            # next commit finds the WAL copied and starts it over.
            time.sleep(0.002)
        largest = max(largest, _wal_bytes(tmp_path))
    _wait_for(lambda: stats.num_checkpoints >= 3)
    # 1,200 records of 8 KB (~3 WAL pages each): ~14 MB written. Without the restarts
    # the WAL would hold all of it (the backstop is at ~64 MB); with them it stays near
    # the 64 KB trigger plus what a checkpoint's own duration lets in (0.2-2.7 MB seen).
    assert largest < 7 * 1024 * 1024, largest
    assert stats.num_failures == 0 and stats.last_error == ""
    _assert_records(log, 1200)
    log.close()
    assert not any(t.name == "pagekeeper-checkpoint" for t in threading.enumerate())
    reopened = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    _assert_records(reopened, 1200)
    reopened.close()


def test_records_that_arrive_slowly_are_checkpointed_on_the_interval(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(every_bytes=1 << 40, interval_s=0.05)
    stats = log.checkpoint_stats
    assert stats is not None
    log.append(1, _body(1))
    _wait_for(lambda: stats.num_checkpoints >= 1)
    checkpoints = stats.num_checkpoints
    time.sleep(0.3)  # nothing new: no more checkpoints
    assert stats.num_checkpoints == checkpoints
    # The database file alone (the WAL set aside) holds the record.
    copy = tmp_path / "copy.db"
    copy.write_bytes((tmp_path / DB_NAME).read_bytes())
    db = sqlite3.connect(copy)
    assert db.execute("SELECT seq FROM log").fetchall() == [(1,)]
    db.close()
    log.close()


def test_a_reader_holds_checkpoints_back_but_never_an_append(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.append(1, _body(1))
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM log").fetchone() == (1,)
    log.start_background_checkpoints(every_bytes=16 * 1024, interval_s=60.0)
    stats = log.checkpoint_stats
    assert stats is not None
    started = time.monotonic()
    for seq in range(2, 41):
        log.append(seq, _body(seq))
    assert time.monotonic() - started < 2.5  # no append waited on the reader
    _wait_for(lambda: stats.num_incomplete >= 1)
    reader.execute("COMMIT")
    reader.close()
    before = stats.num_checkpoints
    log.append(41, _body(41))
    for seq in range(42, 45):  # wake it: crosses the 16 KB mark
        log.append(seq, _body(seq))
    _wait_for(lambda: stats.num_checkpoints > before)
    _assert_records(log, 44)
    log.close()


def test_stopping_hands_checkpoints_back_to_sqlite(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints()
    log.start_background_checkpoints()  # once only
    assert sum(t.name == "pagekeeper-checkpoint" for t in threading.enumerate()) == 1
    log.stop_background_checkpoints()
    assert log.checkpoint_stats is None
    assert log._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    assert not any(t.name == "pagekeeper-checkpoint" for t in threading.enumerate())
    log.append(1, _body(1))
    _assert_records(log, 1)
    log.close()


def test_the_service_durability_runs_the_checkpointer_and_stops_it(tmp_path):
    durability = Durability.open(tmp_path, "process")
    try:
        assert durability.checkpoint_stats is not None
        assert any(t.name == "pagekeeper-checkpoint" for t in threading.enumerate())
    finally:
        durability.close()
    assert durability.checkpoint_stats is None
    assert not any(t.name == "pagekeeper-checkpoint" for t in threading.enumerate())
    # A graceful close leaves the WAL empty (its final checkpoint is not held back by
    # the thread's).
    assert _wal_bytes(tmp_path) == 0
    assert os.path.exists(tmp_path / DB_NAME)


def test_replaced_snapshot_files_go_once_the_thread_syncs_their_replacement(tmp_path):
    """A registration queues the files it replaced; the thread removes them after a
    checkpoint that began after the registration committed and copied every frame. One
    held back by a reader removes nothing."""
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(interval_s=0.05)
    stats = log.checkpoint_stats
    assert stats is not None
    log.append(1, _body(1))
    first = log.store_snapshot_file(1, b"first")
    assert log.commit_snapshot_file(first) == ()
    log.append(2, _body(2))
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM log").fetchone()
    incomplete = stats.num_incomplete
    second = log.store_snapshot_file(2, b"second")
    assert log.commit_snapshot_file(second) == (first.name,)
    _wait_for(lambda: stats.num_incomplete > incomplete)  # it tried, at once
    assert (log.snapshot_dir / first.name).exists()
    assert log.retired_snapshot_files == (first.name,)
    reader.execute("COMMIT")
    reader.close()
    log.append(3, _body(3))  # records came in: the next interval checkpoints
    _wait_for(lambda: not (log.snapshot_dir / first.name).exists())
    assert log.retired_snapshot_files == ()
    assert (log.snapshot_dir / second.name).exists()
    assert [seq for seq, _, _ in log.read_after(0)] == [3]  # the snapshot covers 1-2
    log.close()


def test_files_the_stopped_thread_left_go_with_the_next_checkpoint(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(interval_s=60.0)
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    log.append(1, _body(1))
    first = log.store_snapshot_file(1, b"first")
    log.commit_snapshot_file(first)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM log").fetchone()
    second = log.store_snapshot_file(1, b"second")
    log.commit_snapshot_file(second)
    log.stop_background_checkpoints()
    assert log.retired_snapshot_files == (first.name,)
    assert not log.checkpoint()  # the reader is still there
    assert (log.snapshot_dir / first.name).exists()
    reader.execute("COMMIT")
    reader.close()
    assert log.checkpoint()
    assert not (log.snapshot_dir / first.name).exists()
    assert log.retired_snapshot_files == ()
    log.close()


def test_the_thread_deletes_the_covered_records_in_batches(tmp_path, monkeypatch):
    """Registering a snapshot deletes nothing itself (freeing 10,000 records of 40 KB took
    1.4 s in that transaction, on the event loop); the thread deletes the covered records
    a few at a time while appends go on, and keeps every record after the snapshot."""
    from pagekeeper.durability import log as log_module

    monkeypatch.setattr(log_module, "_PRUNE_MAX_BATCH", 4)  # many batches
    monkeypatch.setattr(log_module, "_PRUNE_PAUSE_S", 0.0005)
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(interval_s=60.0)
    stats = log.checkpoint_stats
    assert stats is not None
    for seq in range(1, 301):
        log.append(seq, _body(seq))
    snapshot = log.store_snapshot_file(250, b"state after 250")
    log.commit_snapshot_file(snapshot)
    for seq in range(301, 401):  # while the thread deletes
        log.append(seq, _body(seq))
    _wait_for(lambda: stats.num_pruned == 250)
    assert [seq for seq, _, _ in log.read_after(0)] == list(range(251, 401))
    assert stats.num_failures == 0
    log.close()
    # Reopened, everything after the snapshot is there.
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    assert log.latest_snapshot_seq() == 250
    assert [seq for seq, _, _ in log.read_after(250)] == list(range(251, 401))
    log.close()


def test_records_a_stop_left_behind_go_at_the_next_start(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    for seq in range(1, 21):
        log.append(seq, _body(seq))
    log.commit_snapshot_file(log.store_snapshot_file(20, b"state"))  # no thread: inline
    assert list(log.read_after(0)) == []
    # A stop while the thread was deleting leaves covered records; recovery reads past
    # them, and the next start's thread deletes them.
    for seq in range(5, 11):
        log._db.execute(
            "INSERT INTO log (seq, crc, body) VALUES (?, ?, ?)",
            (seq, record_crc(seq, _body(seq)), _body(seq)),
        )
    log.append(21, _body(21))
    assert [seq for seq, _, _ in log.read_after(log.latest_snapshot_seq())] == [21]
    log.start_background_checkpoints(interval_s=60.0)
    _wait_for(lambda: [seq for seq, _, _ in log.read_after(0)] == [21])
    log.close()
