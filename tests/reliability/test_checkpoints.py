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
import struct
import threading
import time
import zlib

import pytest

from pagekeeper.durability import Durability
from pagekeeper.durability.log import (
    CUT_SHORT,
    DB_NAME,
    JOURNAL_DIR,
    RESERVE_CHUNK,
    RESERVE_FORMAT,
    ROLL_AFTER_SNAPSHOT_BYTES,
    CommandLog,
    DurabilityLevel,
    record_crc,
)
from tests.reliability import journal_files

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


def _register(log: CommandLog, seq: int, body: bytes = b"state") -> None:
    log.commit_snapshot_file(log.store_snapshot_file(seq, body))


def test_record_crc_is_zlibs_crc32_whichever_library_computes_it(monkeypatch):
    """Records and snapshots carry zlib's CRC-32 whether ISA-L (python-isal, the service's
    dependency) or zlib computes it: a data dir reads the same under either. The service's
    own install takes ISA-L's."""
    from pagekeeper.durability import log as log_module

    body = os.urandom(70_000)
    expected = zlib.crc32(body, zlib.crc32(struct.pack("<q", 7)))
    parts = (body[:5], memoryview(body)[5:40_000], body[40_000:])
    assert record_crc(7, body) == record_crc(7, *parts) == expected
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert log_module._crc32 is isal_zlib.crc32
    monkeypatch.setattr(log_module, "_crc32", zlib.crc32)
    assert record_crc(7, body) == record_crc(7, *parts) == expected


def test_records_go_into_zeros_reserved_ahead_and_read_back_alike(tmp_path):
    """reserve_ahead writes zeros past the last record (stamping format 5 first); the next
    records are written into them; a reader stops at the zeros, now and after a crash that
    leaves them (the next log appends to a segment of its own); a closed segment is cut
    to its records. Level fsync reserves nothing."""
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.reserve_bytes = 2 * RESERVE_CHUNK
    log.append(1, _body(1))
    assert log.needs_reserve
    assert log.reserve_ahead() == RESERVE_CHUNK and log.needs_reserve  # a chunk a call
    assert log.reserve_ahead() == RESERVE_CHUNK  # reserve_bytes past the record now
    assert not log.needs_reserve and log.reserve_ahead() == 0
    db = sqlite3.connect(tmp_path / DB_NAME)
    version = db.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()
    assert version == (RESERVE_FORMAT,)
    (segment,) = journal_files.segment_paths(tmp_path)
    reserved = segment.stat().st_size
    for seq in range(2, 81):  # 79 more records of 8 KB: into the zeros, then past them
        log.append(seq, _body(seq))
        if seq == 10:
            assert segment.stat().st_size == reserved  # still inside the reserve
            _assert_records(log, 10)
            # A crash now (no close): the zeros stay; a new log reads exactly the records.
            crashed = CommandLog(tmp_path, DurabilityLevel.PROCESS)
            _assert_records(crashed, 10)
            crashed.close()
    assert segment.stat().st_size > reserved  # past the reserve: the file grew as before
    _assert_records(log, 80)
    log.reserve_ahead()
    assert segment.stat().st_size > log._segment_size
    log.close()
    assert segment.stat().st_size == 16 + 80 * (BODY + 16)  # cut to its records
    reopened = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    _assert_records(reopened, 80)
    reopened.append(81, _body(81))  # a segment of its own, as after any reopen
    _assert_records(reopened, 81)
    reopened.close()
    (tmp_path / "fsync").mkdir()
    synced = CommandLog(tmp_path / "fsync", DurabilityLevel.FSYNC)
    synced.append(1, _body(1))
    assert not synced.needs_reserve and synced.reserve_ahead() == 0
    synced.close()


def test_appends_go_to_segments_and_never_touch_the_database(tmp_path):
    """Records go to the journal's segment files, a new one past ``segment_bytes``; the
    database's WAL does not grow with them; every record reads back in order, after a
    reopen too."""
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(interval_s=60.0)
    log.segment_bytes = 256 * 1024
    wal_before = _wal_bytes(tmp_path)
    for seq in range(1, 1201):
        body = _body(seq)
        if seq % 2:
            log.append(seq, body)
        else:  # a body in parts (as a step's record is) is written as their concatenation
            log.append(seq, body[:2], memoryview(body)[2:100], body[100:])
    # 1,200 records of 8 KB: ~9.6 MB in segments of ~256 KB (one record past the mark).
    segments = sorted((tmp_path / JOURNAL_DIR).iterdir())
    per_segment = -(-(256 * 1024 - 16) // (BODY + 16))  # after the header; 16 B a record
    assert len(segments) == -(-1200 // per_segment)
    assert all(p.stat().st_size <= 256 * 1024 + BODY + 64 for p in segments)
    # Plain data files (0o666 less the umask, as the database and snapshot files are).
    assert all(p.stat().st_mode & 0o111 == 0 for p in segments)
    # The first segment's first commit set the format: one small write, nothing per record.
    assert _wal_bytes(tmp_path) - wal_before < 64 * 1024
    _assert_records(log, 1200)
    assert log.last_seq() == 1200 and log.num_records() == 1200
    log.close()
    assert not any(t.name == "pagekeeper-checkpoint" for t in threading.enumerate())
    reopened = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    _assert_records(reopened, 1200)
    # A reopened log starts its appends in a segment of its own.
    reopened.append(1201, _body(1201))
    assert (tmp_path / JOURNAL_DIR / f"segment-{1201:020d}.pkj").exists()
    _assert_records(reopened, 1201)
    reopened.close()


def test_a_covered_segment_goes_once_a_checkpoint_syncs_the_snapshot(tmp_path):
    """A snapshot registration retires the segments it covers whole (never the one being
    appended to); they are unlinked after the thread's next complete checkpoint, and the
    records after the snapshot all stay readable."""
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(interval_s=0.05)
    log.segment_bytes = 64 * 1024
    for seq in range(1, 101):
        log.append(seq, _body(seq))
    segments = sorted(p.name for p in (tmp_path / JOURNAL_DIR).iterdir())
    first_seqs = [journal_files.first_seq(tmp_path / JOURNAL_DIR / name) for name in segments]
    assert len(first_seqs) > 3
    snapshot_seq = first_seqs[2] + 1  # covers the first two segments whole, not the third
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM meta").fetchone()
    _register(log, snapshot_seq)
    assert log.retired_segments == tuple(segments[:2])
    time.sleep(0.3)  # held back by the reader: still there
    assert all((tmp_path / JOURNAL_DIR / name).exists() for name in segments[:2])
    reader.execute("COMMIT")
    reader.close()
    _wait_for(lambda: not (tmp_path / JOURNAL_DIR / segments[0]).exists())
    _wait_for(lambda: log.retired_segments == ())
    assert sorted(p.name for p in (tmp_path / JOURNAL_DIR).iterdir()) == segments[2:]
    after = [seq for seq, _, _ in log.read_after(snapshot_seq)]
    assert after == list(range(snapshot_seq + 1, 101))
    # A snapshot of everything but the last record keeps the segment being appended to;
    # one of everything (an idle service's, a graceful stop's) ends it, and it goes too.
    _register(log, 99)
    _wait_for(lambda: log.retired_segments == ())
    assert sorted(p.name for p in (tmp_path / JOURNAL_DIR).iterdir()) == segments[-1:]
    _register(log, 100)
    _wait_for(lambda: not any((tmp_path / JOURNAL_DIR).iterdir()))
    assert log.retired_segments == () and log.journal_usage() == (0, 0)
    log.append(101, _body(101))
    assert [seq for seq, _, _ in log.read_after(100)] == [101]
    assert [p.name for p in (tmp_path / JOURNAL_DIR).iterdir()] == [f"segment-{101:020d}.pkj"]
    log.close()


def test_a_registration_is_checkpointed_on_the_interval(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(interval_s=0.05)
    stats = log.checkpoint_stats
    assert stats is not None
    log.append(1, _body(1))
    _register(log, 1)
    _wait_for(lambda: stats.num_checkpoints >= 1)
    time.sleep(0.2)  # (the first segment's format commit may have had its own)
    checkpoints = stats.num_checkpoints
    time.sleep(0.3)  # nothing new: no more checkpoints
    assert stats.num_checkpoints == checkpoints
    # The database file alone (the WAL set aside) holds the registration.
    copy = tmp_path / "copy.db"
    copy.write_bytes((tmp_path / DB_NAME).read_bytes())
    db = sqlite3.connect(copy)
    assert db.execute("SELECT seq FROM snapshot_files").fetchall() == [(1,)]
    db.close()
    log.close()


def test_a_reader_holds_checkpoints_back_but_never_an_append(tmp_path):
    """A reader keeps the thread's checkpoints incomplete (retried on the interval) and
    never makes an append or a registration wait; once it leaves, the next try copies
    everything."""
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.append(1, _body(1))
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM meta").fetchone() == (1,)
    log.start_background_checkpoints(interval_s=0.05)
    stats = log.checkpoint_stats
    assert stats is not None
    started = time.monotonic()
    for seq in range(2, 41):
        log.append(seq, _body(seq))
        if seq % 10 == 0:
            _register(log, seq - 1)  # the last record stays uncovered: its segment too
    assert time.monotonic() - started < 2.5  # nothing waited on the reader
    _wait_for(lambda: stats.num_incomplete >= 1)
    before = stats.num_checkpoints
    reader.execute("COMMIT")
    reader.close()
    _wait_for(lambda: stats.num_checkpoints > before)  # the retry, with nothing new
    assert _wal_bytes(tmp_path) == 0 or log.set_meta("x", "y") is None
    _assert_records(log, 40)
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
    reader.execute("SELECT COUNT(*) FROM meta").fetchone()
    incomplete = stats.num_incomplete
    second = log.store_snapshot_file(2, b"second")
    assert log.commit_snapshot_file(second) == (first.name,)
    _wait_for(lambda: stats.num_incomplete > incomplete)  # it tried, at once
    assert (log.snapshot_dir / first.name).exists()
    assert log.retired_snapshot_files == (first.name,)
    reader.execute("COMMIT")
    reader.close()
    log.append(3, _body(3))  # the incomplete checkpoint is retried on the next interval
    _wait_for(lambda: not (log.snapshot_dir / first.name).exists())
    assert log.retired_snapshot_files == ()
    assert (log.snapshot_dir / second.name).exists()
    assert [seq for seq, _, _ in log.read_after(log.latest_snapshot_seq())] == [3]
    log.close()


def test_files_the_stopped_thread_left_go_with_the_next_checkpoint(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(interval_s=60.0)
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    log.append(1, _body(1))
    first = log.store_snapshot_file(1, b"first")
    log.commit_snapshot_file(first)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM meta").fetchone()
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


def _insert_rows(log: CommandLog, seqs) -> None:
    journal_files.insert_rows(
        log._db, ((seq, record_crc(seq, _body(seq)), _body(seq)) for seq in seqs)
    )


def test_the_thread_deletes_the_covered_rows_in_batches(tmp_path, monkeypatch):
    """A format-2 data dir's records are rows; registering a snapshot deletes none itself
    (freeing 10,000 rows of 40 KB took 1.4 s in that transaction, on the event loop): the
    thread deletes the covered ones a few at a time while appends (to segments) go on,
    and every record after the snapshot stays, rows first, then segments."""
    from pagekeeper.durability import log as log_module

    monkeypatch.setattr(log_module, "_PRUNE_MAX_BATCH", 4)  # many batches
    monkeypatch.setattr(log_module, "_PRUNE_PAUSE_S", 0.0005)
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    _insert_rows(log, range(1, 301))
    log.start_background_checkpoints(interval_s=60.0)
    stats = log.checkpoint_stats
    assert stats is not None
    _register(log, 250)
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


def test_rows_a_stop_left_behind_go_at_the_next_start(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    _insert_rows(log, range(1, 21))
    _register(log, 20)  # no thread: deleted inline
    assert list(log.read_after(0)) == []
    # A stop while the thread was deleting leaves covered rows; recovery reads past
    # them, and the next start's thread deletes them.
    _insert_rows(log, range(5, 11))
    log.append(21, _body(21))
    assert [seq for seq, _, _ in log.read_after(log.latest_snapshot_seq())] == [21]
    log.start_background_checkpoints(interval_s=60.0)
    _wait_for(lambda: [seq for seq, _, _ in log.read_after(0)] == [21])
    log.close()


def test_a_segment_that_is_not_whole_ends_the_records_and_is_cut_away(tmp_path):
    """A segment whose header is not its own (damage, another file under its name), or a
    record cut short, reads as ``CUT_SHORT`` at the seq expected there and ends the
    records; ``delete_from`` that seq cuts it and everything after it away, and appends
    go on after what is kept."""
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.segment_bytes = 32 * 1024
    for seq in range(1, 31):
        log.append(seq, _body(seq))
    log.close()
    segments = sorted((tmp_path / JOURNAL_DIR).iterdir())
    assert len(segments) >= 4
    second_first = journal_files.first_seq(segments[1])
    data = bytearray(segments[1].read_bytes())
    data[0] ^= 0xFF  # its magic
    segments[1].write_bytes(bytes(data))
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    rows = list(log.read_after(0))
    assert [seq for seq, _, _ in rows] == list(range(1, second_first + 1))
    assert rows[-1][1] == CUT_SHORT and rows[-1][2] == b""
    assert log.last_seq() == second_first - 1
    dropped = log.delete_from(second_first)
    third_first = journal_files.first_seq(segments[2])
    assert dropped == 1 + (30 - third_first + 1)  # the unreadable segment counts as one
    assert [p.name for p in sorted((tmp_path / JOURNAL_DIR).iterdir())] == [segments[0].name]
    log.append(second_first, _body(second_first))
    _assert_records(log, second_first)
    # A record cut short in the middle of its body.
    path = tmp_path / JOURNAL_DIR / f"segment-{second_first:020d}.pkj"
    os.truncate(path, path.stat().st_size - 100)
    rows = list(log.read_after(second_first - 1))
    assert [(seq, crc) for seq, crc, _ in rows] == [(second_first, CUT_SHORT)]
    assert log.delete_from(second_first) == 1
    assert not path.exists()
    log.close()


def test_a_registration_ends_a_large_segment_so_the_next_one_covers_it(tmp_path):
    """Past ``ROLL_AFTER_SNAPSHOT_BYTES`` a registration closes the segment being appended
    to: the next record starts a new one, and the next registration covers the old one
    whole, so covered records do not pile up to ``SEGMENT_BYTES``. A small one stays."""
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.start_background_checkpoints(interval_s=0.05)
    per_mb = -(-ROLL_AFTER_SNAPSHOT_BYTES // (BODY + 16))
    for seq in range(1, 4):
        log.append(seq, _body(seq))
    _register(log, 2)  # small, and not the last record: appends go on in the same segment
    log.append(4, _body(4))
    assert len(list((tmp_path / JOURNAL_DIR).iterdir())) == 1
    last = 4
    for seq in range(5, per_mb + 5):
        log.append(seq, _body(seq))
        last = seq
    _register(log, last - 2)  # records after it stay, in the same segment
    log.append(last + 1, _body(last + 1))
    names = sorted(p.name for p in (tmp_path / JOURNAL_DIR).iterdir())
    assert names[-1] == f"segment-{last + 1:020d}.pkj" and len(names) == 2
    assert [s for s, _, _ in log.read_after(last - 2)] == [last - 1, last, last + 1]
    _register(log, last)
    _wait_for(lambda: len(list((tmp_path / JOURNAL_DIR).iterdir())) == 1)
    assert sorted(p.name for p in (tmp_path / JOURNAL_DIR).iterdir()) == names[-1:]
    log.close()


def test_journal_usage_counts_the_segments_in_use_and_those_waiting_to_go(tmp_path):
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    assert log.journal_usage() == (0, 0)
    log.segment_bytes = 32 * 1024
    for seq in range(1, 21):
        log.append(seq, _body(seq))
    on_disk = sorted((tmp_path / JOURNAL_DIR).iterdir())
    assert log.journal_usage() == (len(on_disk), sum(p.stat().st_size for p in on_disk))
    _register(log, 19)  # no thread: the covered ones wait for the next checkpoint
    assert log.retired_segments and log.journal_usage()[0] == len(on_disk)
    assert log.checkpoint()
    left = sorted((tmp_path / JOURNAL_DIR).iterdir())
    assert len(left) == 1 and log.journal_usage() == (1, left[0].stat().st_size)
    _register(log, 20)  # everything: the last segment goes as well
    assert log.checkpoint()
    assert log.journal_usage() == (0, 0) and not any((tmp_path / JOURNAL_DIR).iterdir())
    log.close()


def test_a_segment_left_with_its_header_alone_is_made_anew(tmp_path):
    """A kill between a segment's creation and its first record (or a power loss that
    kept only its header) leaves a segment with no record. The next start recovers up to
    the record before it; its first append made the same segment again and failed (the file
    exists): the service refused every change, after every restart (found by `make crash`).
    Now that segment is made anew; one that holds a record is never written over."""
    from pagekeeper.durability.log import _SEGMENT_HEADER, _SEGMENT_MAGIC, LogError

    for level in (DurabilityLevel.PROCESS, DurabilityLevel.FSYNC):
        directory = tmp_path / level.value
        directory.mkdir()
        log = CommandLog(directory, level)
        for seq in range(1, 11):
            log.append(seq, _body(seq))
        log.close()
        empty = directory / JOURNAL_DIR / f"segment-{11:020d}.pkj"
        empty.write_bytes(_SEGMENT_HEADER.pack(_SEGMENT_MAGIC, 11))
        log = CommandLog(directory, level)
        assert log.last_seq() == 10
        log.append(11, _body(11))
        log.append(12, _body(12))
        _assert_records(log, 12)
        log.close()
        reopened = CommandLog(directory, level)
        _assert_records(reopened, 12)
        # A segment that holds records under the name a new one would take: refused.
        reopened._close_segment()
        try:
            reopened._start_segment(11)
        except LogError as exc:
            assert "already holds records" in str(exc)
        else:
            raise AssertionError("a segment holding records was replaced")
        _assert_records(reopened, 12)
        reopened.close()
