"""The durable command log and its snapshots: records appended to segment files, and one
SQLite database in WAL mode that registers the snapshots (their bodies in files beside it).

Records (one applied command each) go to the journal, ``journal/segment-<first seq>.pkj``:
a header (magic, the seq of its first record), then each record as its length, CRC and seq
followed by its body, written with one ``pwritev`` at its offset. A segment takes records
until it holds ``SEGMENT_BYTES``; a reopened log starts a segment of its own at its first
append. An append is one system call where a SQLite commit was a B-tree insert, a 4 KiB WAL
frame and the wal-index (12-14 µs warm, 35-60 µs between steps; ~3-10 µs now). At level
``process`` the records go into zeros written ahead of them off the answer's path
(:meth:`CommandLog.reserve_ahead`, format 5): a header of zeros ends a segment's records.

Why SQLite for the rest (standard library, no server): one transaction registers a
snapshot and drops what it covers, its WAL survives a killed process by construction, and
its own frame checksums drop a torn tail after a power loss. Four tables::

    meta            key TEXT PRIMARY KEY, value TEXT      format version, pool configuration
    log             seq INTEGER PRIMARY KEY, crc INTEGER, body BLOB     one applied command
                    (format 2; read before the segments, no longer written)
    snapshot_files  seq INTEGER PRIMARY KEY, crc INTEGER, name TEXT, size INTEGER
                    the state after record seq, in ``snapshots/<name>``
                    (``snapshot-<seq>-<8 random hex digits>.pks``)
    snapshots       seq INTEGER PRIMARY KEY, crc INTEGER, body BLOB
                    the same, inline (format 1; read, no longer written)

A snapshot's body (tens of MB for a large pool) is written to its file, fsync'ed and
renamed into place by :meth:`CommandLog.store_snapshot_file` -- from a worker thread, while
the event loop goes on appending records -- and only then registered (a small row) by
:meth:`CommandLog.commit_snapshot_file`. The file is fsync'ed at every level: once
registered, the records it replaces may go. A file no row names (a crash between the two
steps) is removed at the next start.

Each record and snapshot carries its own CRC-32 over ``seq`` (8 bytes, little-endian)
followed by the body, so a record or file that was damaged, or moved to another sequence
number, is caught. Sequence numbers start at 1 and have no gaps;
:meth:`CommandLog.read_after` hands the records out (a record it cannot read whole, a torn
tail, with the CRC ``CUT_SHORT``), :mod:`pagekeeper.durability.recovery` checks them and
cuts a damaged tail away with :meth:`CommandLog.delete_from`.

=========  ==================================================================================
level      what an acknowledged command survives
=========  ==================================================================================
process    the service killed at any instant (``kill -9``, OOM, a crash): an append is a
           ``write()`` into the segment, in the OS page cache before the call returns.
           Power loss may drop the last records (the valid prefix is recovered); SQLite
           runs at ``synchronous=NORMAL`` (its checkpoints fsync).
fsync      also power loss and kernel crashes: each record is ``fdatasync``'ed before the
           answer goes out (a new segment, its header and its directory entry, first);
           SQLite at ``synchronous=FULL``.
=========  ==================================================================================

Checkpoints (copying the WAL's frames into the database file, then fsync'ing it) run in a
thread of their own once :meth:`CommandLog.start_background_checkpoints` is called (the
service does): a ``PASSIVE`` checkpoint on its own connection when a registration wakes it,
and every ``CHECKPOINT_INTERVAL_S`` while commits came in (one held back by a reader is
retried on the next interval). Records no longer pass through the WAL, so it only ever
holds registrations, the format's meta row and the deletions of old rows. ``PASSIVE``
never takes the write lock, so the loop's commits go on meanwhile (the sqlite3 module lets
go of the GIL around each SQLite call). SQLite's own automatic checkpoint stays on the
appending connection as a backstop, at ``BACKSTOP_AUTOCHECKPOINT_PAGES`` (~64 MB of WAL),
for a thread that cannot run.

A registered snapshot makes the older snapshot files redundant, but they may go only once a
checkpoint has synced the registration (before that, a power loss may undo it, and the
database would name an older file again). :meth:`CommandLog.commit_snapshot_file` queues
them: the thread's next complete checkpoint removes them (it is woken at once), or, without
the thread, the next :meth:`CommandLog.checkpoint` on the appending connection. With the
thread, the loop never checkpoints after a snapshot (that checkpoint, with its fsync, held
the loop 6-12 ms at every snapshot of a soak run).

A registration also retires the segments every record of which it covers, under the same
rule: they are unlinked after the next complete checkpoint, so a power loss that undoes the
registration finds them still there. The segment being appended to goes only when the
snapshot covers this log's last append (an idle service's, a graceful stop's): it is ended
first, and the next record starts a new one; past ``ROLL_AFTER_SNAPSHOT_BYTES`` it is ended
anyway, for the next registration to cover. Records a registration covers inside a kept
segment are skipped by :meth:`CommandLog.read_after`'s callers (recovery reads after the
snapshot).

The rows of table ``log`` (format 2) a registered snapshot covers are deleted by the thread,
a batch of ~1 ms at a time (``PRUNE_BATCH_SECONDS``), rather than inside the registration:
deleting a record frees its chain of overflow pages, which SQLite reads one by one, so
10,000 records of 40 KB (admission steps) took 1.4 s, and that transaction held the event
loop. The thread and the loop share a lock around their writes, so a commit waits at most
for one batch, never in SQLite's busy handler (whose sleeps are 1 ms and up). Until they
are gone, covered rows are simply not read (recovery reads after the snapshot), and a later
commit cannot persist without an earlier one, so a power loss never keeps a deletion
without its registration. A stop before the thread is done leaves the rest to the next
start's thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

DB_NAME = "pagekeeper.db"
SNAPSHOT_DIR = "snapshots"
JOURNAL_DIR = "journal"
FORMAT_VERSION = "3"
IDENTITY_FORMAT = "4"
RESERVE_FORMAT = "5"
READABLE_FORMATS = ("1", "2", "3", "4", "5")
"""Format 1 kept snapshot bodies inline (table ``snapshots``); 2 keeps them in files; 3
appends records to segment files (older records stay in table ``log`` and are read first);
4 is 3 whose records and snapshots may bind a client to a certificate's subject (mutual
TLS), which a pagekeeper reading 1-3 would take for damage. A data dir is stamped 4 before
its first such record, and stays 4; without client certificates it stays 3. 5 is 4 whose
segments may end in zeros written ahead of the next record (:meth:`CommandLog.reserve_ahead`):
a record header of zeros ends a segment's records. A dir is stamped 5 before its first
reserve."""
_SEQ = struct.Struct("<q")

try:
    # The same CRC-32 as zlib's (every record and snapshot reads alike either way), with
    # ISA-L's carry-less-multiply loops: 64 KB (an admission step's record) in ~1 us
    # against ~9 us; a 64 MB snapshot in ~1 ms against ~9 ms.
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # an install without python-isal (a platform it has no wheel for)
    _crc32 = zlib.crc32

RESERVE_BYTES = 1 << 20
"""How far past its last record :meth:`CommandLog.reserve_ahead` keeps a segment written
with zeros (level ``process``), at most :data:`RESERVE_CHUNK` a call."""
RESERVE_CHUNK = 256 << 10
"""The most zeros one :meth:`CommandLog.reserve_ahead` writes (~40 us of the loop)."""
_ZEROS = bytes(RESERVE_CHUNK)
SEGMENT_BYTES = 64 << 20
"""A segment file takes records until it holds this many bytes; the next record starts a
new one."""
ROLL_AFTER_SNAPSHOT_BYTES = 1 << 20
"""A snapshot's registration ends the segment being appended to once it holds this many
bytes (the next record starts a new one)."""
# A segment file: magic, the seq of its first record; then records, each its header
# (body length, CRC as a row's, seq) and body.
_SEGMENT_HEADER = struct.Struct("<8sq")
_SEGMENT_MAGIC = b"PKJRNL01"
_RECORD_HEADER = struct.Struct("<IIq")
_SEGMENT_FILE = re.compile(r"segment-(\d{20})\.pkj")
CUT_SHORT = -1
"""The CRC :meth:`CommandLog.read_after` gives a record it could not read whole (a torn
tail, a damaged segment header): never a real CRC-32."""
# A snapshot file: magic, seq, CRC (of seq + body, as a record's), body length, body.
_FILE_HEADER = struct.Struct("<8sqIq")
_FILE_MAGIC = b"PKSNAPF1"
_SNAPSHOT_FILE = re.compile(r"snapshot-\d{20}-[0-9a-f]{8}\.(pks|tmp)")


class DurabilityLevel(StrEnum):
    NONE = "none"
    """Nothing is written: a restart starts from an empty pool."""
    PROCESS = "process"
    """Survives the process being killed (``kill -9``)."""
    FSYNC = "fsync"
    """Survives power loss (fsync at every commit)."""


# The connection's busy timeout (sqlite3.connect's default of 5 s, said out loud).
_BUSY_TIMEOUT_MS = 5000
_SYNCHRONOUS = {DurabilityLevel.PROCESS: "NORMAL", DurabilityLevel.FSYNC: "FULL"}

CHECKPOINT_INTERVAL_S = 5.0
"""A background checkpoint at least this often while commits come in (registrations, the
format row, deleted rows: keeps the WAL, and so a restart after a crash, short)."""
BACKSTOP_AUTOCHECKPOINT_PAGES = 16_384
"""SQLite's automatic checkpoint on the appending connection while the background one runs
(4 KiB pages: ~64 MB of WAL)."""

WAL_SIZE_LIMIT_BYTES = 32 << 20
"""A WAL file that grew past this (a backstop checkpoint, a long reader) is cut back to it
when the WAL next starts over (SQLite's ``journal_size_limit``)."""
_CATCH_UP_PASSES = 8
PRUNE_BATCH_SECONDS = 0.001
"""Aim of one batch of the thread's deletion of covered records (it holds the write lock)."""
_PRUNE_PAUSE_S = 0.002  # between two batches: appends waiting for the lock go first
_PRUNE_MAX_BATCH = 4096

logger = logging.getLogger(__name__)


class LogError(RuntimeError):
    """The database cannot be opened or written (its message is one line for an operator)."""


def record_crc(seq: int, *body: bytes | memoryview) -> int:
    """CRC-32 of ``seq`` (8 bytes LE) then ``body`` (its parts in order: the CRC of their
    concatenation)."""
    crc = _crc32(_SEQ.pack(seq))
    for part in body:
        crc = _crc32(part, crc)
    return crc


class SnapshotFile(NamedTuple):
    """A snapshot body stored in its file, not yet registered in the database."""

    seq: int
    name: str
    crc: int
    size: int


def snapshot_file_name(seq: int) -> str:
    """A fresh name for a snapshot after record ``seq``: unique, so that two snapshots of
    the same record (a periodic one still being written when the graceful stop takes its
    own) never share a file, and discarding one never touches the other."""
    return f"snapshot-{seq:020d}-{os.urandom(4).hex()}.pks"


# The data alone (and the size), not the inode's times; macOS has only fsync.
_fdatasync = getattr(os, "fdatasync", os.fsync)


def _seek_writev(fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
    os.lseek(fd, offset, os.SEEK_SET)
    return os.writev(fd, buffers)


# One write of a record's parts at its offset (a platform without pwritev seeks first).
_pwritev = getattr(os, "pwritev", _seek_writev)


def _fsync_path(path: Path) -> None:
    """fsync a file, or a directory (its entries: a created, renamed or removed name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStats:
    """What the background checkpointer has done (written by its thread, read anywhere)."""

    __slots__ = (
        "last_error",
        "last_seconds",
        "num_checkpoints",
        "num_failures",
        "num_incomplete",
        "num_pruned",
    )

    def __init__(self) -> None:
        self.num_checkpoints = 0
        """Checkpoints that copied every frame of the WAL they found."""
        self.num_incomplete = 0
        """Checkpoints that could not (a reader in the way, another checkpoint under way,
        or frames committed meanwhile); the next one goes on from there."""
        self.num_failures = 0
        self.num_pruned = 0
        """Records a registered snapshot covered, deleted by the thread."""
        self.last_seconds = 0.0
        self.last_error = ""


class _RetiredFiles:
    """Files (older snapshot files, covered journal segments) made redundant by committed
    transactions that no checkpoint has synced yet, each batch under a ticket (1, 2, ...)
    taken after its transaction committed: a checkpoint that began after ticket ``t`` was
    taken and then copied every frame covers every batch up to ``t``. Used from the loop
    and the checkpointer's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[int, tuple[Path, ...]]] = []
        self.ticket = 0
        """The latest batch's ticket (read before a checkpoint pass begins)."""

    def add(self, paths: tuple[Path, ...]) -> None:
        with self._lock:
            self.ticket += 1
            self._pending.append((self.ticket, paths))

    @property
    def paths(self) -> tuple[Path, ...]:
        with self._lock:
            return tuple(path for _, batch in self._pending for path in batch)

    def remove(self, upto: int | None = None) -> None:
        """Unlink the batches up to ticket ``upto`` (all of them when None): best effort,
        a file left behind is removed at a later start (an orphan snapshot file) or by a
        later snapshot (a covered segment)."""
        with self._lock:
            if upto is None:
                taken, self._pending = self._pending, []
            else:
                taken = [item for item in self._pending if item[0] <= upto]
                self._pending = [item for item in self._pending if item[0] > upto]
        for _, batch in taken:
            for path in batch:
                with contextlib.suppress(OSError):
                    path.unlink()


class _Checkpointer(threading.Thread):
    """Runs ``PRAGMA wal_checkpoint(PASSIVE)`` on its own connection when woken (a
    registration) or every ``interval_s`` while commits came in; first deletes, in batches,
    the rows up to ``prune_upto`` (a registered snapshot's)."""

    def __init__(
        self,
        path: Path,
        interval_s: float,
        retired: _RetiredFiles,
        write_lock: threading.Lock,
        prune_upto: int,
    ) -> None:
        super().__init__(name="pagekeeper-checkpoint", daemon=True)
        self.path = path
        self.retired = retired
        self.write_lock = write_lock
        self.prune_upto = prune_upto
        """Records up to here are covered by a registered snapshot (set by the loop)."""
        self._batch = 8
        self.interval_s = interval_s
        self.stats = CheckpointStats()
        self.dirty = False
        """Set on every commit of the loop's connection (and by an incomplete checkpoint),
        cleared here before each checkpoint."""
        self._wake = threading.Event()
        self._stopping = False

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Finish the checkpoint under way (if any) and end the thread."""
        self._stopping = True
        self._wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    def run(self) -> None:
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
            # Its deletions commit too: no checkpoint inside them (under the write lock),
            # and no fsync at the end of each even at level fsync. Losing a deletion is
            # harmless (covered records are never read, the next start deletes them) and
            # the appender's next synced commit syncs the WAL before it. Its checkpoints
            # sync the WAL and the database file at any level but OFF.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA wal_autocheckpoint=0")
        except sqlite3.Error as exc:
            self._failed(exc)
            return
        try:
            while True:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if self._stopping:
                    return
                self._prune(db)
                if self.dirty:
                    self.dirty = False
                    self._checkpoint(db)
        finally:
            db.close()

    def _checkpoint(self, db: sqlite3.Connection) -> None:
        """Checkpoint until a pass finds no frame committed since the previous one (then
        every frame is in the database file, and the next commit starts the WAL over: a
        writer does so only when it begins on a fully copied WAL), at most
        ``_CATCH_UP_PASSES`` passes; whatever is left waits for the next wake."""
        started = time.perf_counter()
        stats = self.stats
        previous = -1
        for _ in range(_CATCH_UP_PASSES):
            ticket = self.retired.ticket  # batches retired before this pass begins
            try:
                # (busy, frames in the WAL, frames copied): PASSIVE never waits on anyone.
                busy, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as exc:
                self._failed(exc)
                return
            if busy or frames != copied:
                # A reader (or another checkpoint) holds frames back: try again on the
                # next interval (nothing else may come to dirty it).
                self.dirty = True
                break
            if frames == previous or frames == 0:
                stats.num_checkpoints += 1
                stats.last_seconds = time.perf_counter() - started
                self.retired.remove(ticket)
                return
            previous = frames  # commits came in while it ran: copy those too
        stats.num_incomplete += 1
        stats.last_seconds = time.perf_counter() - started

    def _prune(self, db: sqlite3.Connection) -> None:
        """Delete the records up to ``prune_upto``, oldest first, in batches sized to take
        ~``PRUNE_BATCH_SECONDS`` each, pausing between them; until stopped or done."""
        while not self._stopping:
            try:
                row = db.execute("SELECT MIN(seq) FROM log").fetchone()
            except sqlite3.Error as exc:
                self._failed(exc)
                return
            low, upto = row[0], self.prune_upto
            if low is None or low > upto:
                return
            high = min(upto, low + self._batch - 1)
            started = time.perf_counter()
            with self.write_lock:
                try:
                    deleted = db.execute(
                        "DELETE FROM log WHERE seq BETWEEN ? AND ?", (low, high)
                    ).rowcount
                except sqlite3.Error as exc:
                    self._failed(exc)
                    return
            took = time.perf_counter() - started
            self.stats.num_pruned += max(0, deleted)
            self.dirty = True  # the freed pages are in the WAL: checkpoint them
            if self._wake.is_set():
                # A registration woke it meanwhile: sync it now (its retired files wait).
                self._wake.clear()
                self.dirty = False
                self._checkpoint(db)
            if took > PRUNE_BATCH_SECONDS:
                self._batch = max(1, self._batch // 2)
            elif took < PRUNE_BATCH_SECONDS / 4:
                self._batch = min(_PRUNE_MAX_BATCH, self._batch * 2)
            time.sleep(_PRUNE_PAUSE_S)

    def _failed(self, exc: sqlite3.Error) -> None:
        # Nothing is lost: the commits are in the WAL, and the appending connection's own
        # (backstop) checkpoint folds them in if this thread cannot.
        self.stats.num_failures += 1
        self.stats.last_error = str(exc)
        logger.error("background checkpoint of %s failed: %s", self.path, exc)


class CommandLog:
    """The SQLite file under a data directory. Used from one thread (the event loop), apart
    from the background checkpointer's own connection."""

    def __init__(self, directory: str | Path, level: DurabilityLevel) -> None:
        if level is DurabilityLevel.NONE:
            raise ValueError("durability 'none' keeps no log")
        self.path = Path(directory) / DB_NAME
        self.level = level
        try:
            # isolation_level=None: autocommit, so each INSERT is one commit (one durable
            # record); multi-statement transactions are explicit BEGIN/COMMIT.
            self._db = sqlite3.connect(
                self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=_BUSY_TIMEOUT_MS / 1000,
            )
        except sqlite3.Error as exc:
            raise LogError(f"cannot open {self.path}: {exc}") from None
        try:
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise LogError(f"{self.path}: cannot switch to WAL mode (got {mode!r})")
            self._db.execute(f"PRAGMA synchronous={_SYNCHRONOUS[level]}")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS log "
                "(seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, body BLOB NOT NULL)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS snapshots "
                "(seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, body BLOB NOT NULL)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS snapshot_files (seq INTEGER PRIMARY KEY, "
                "crc INTEGER NOT NULL, name TEXT NOT NULL, size INTEGER NOT NULL)"
            )
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise LogError(f"{self.path} is not a readable pagekeeper database: {exc}") from None
        self._append_sql = "INSERT INTO log (seq, crc, body) VALUES (?, ?, ?)"
        self.snapshot_dir = Path(directory) / SNAPSHOT_DIR
        self.journal_dir = Path(directory) / JOURNAL_DIR
        self._retired = _RetiredFiles()
        self._checkpointer: _Checkpointer | None = None
        # The segment files (first seq, path), oldest first; the last one may be open for
        # appends (``_segment_fd``, its size so far in ``_segment_size``).
        self._segments: list[tuple[int, Path]] = self._scan_segments()
        self._segment_fd: int | None = None
        self._segment_size = 0
        # Zeros are written up to here in the segment appended to (an offset; at or below
        # ``_segment_size`` when nothing is reserved ahead).
        self._reserved_end = 0
        self.reserve_bytes = RESERVE_BYTES
        self._last_appended = 0  # the seq of this log's last append (0: none yet)
        self.segment_bytes = SEGMENT_BYTES
        # Held around each write of the appending connection and each batch of the
        # checkpointer's deletions (see the module docstring).
        self._write_lock = threading.Lock()

    # -- background checkpoints ------------------------------------------------------------
    def start_background_checkpoints(
        self,
        interval_s: float = CHECKPOINT_INTERVAL_S,
        backstop_pages: int = BACKSTOP_AUTOCHECKPOINT_PAGES,
    ) -> None:
        """Checkpoint from a thread from now on (see the module docstring); the appending
        connection's own automatic checkpoint moves back to ``backstop_pages``."""
        if self._checkpointer is not None:
            return
        if interval_s <= 0 or backstop_pages < 1:
            raise ValueError("checkpoint thresholds must be positive")
        try:
            self._db.execute(f"PRAGMA wal_autocheckpoint={int(backstop_pages)}")
            self._db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
        except sqlite3.Error as exc:
            raise LogError(f"cannot configure checkpoints of {self.path}: {exc}") from None
        self._checkpointer = _Checkpointer(
            self.path,
            interval_s,
            self._retired,
            self._write_lock,
            self.latest_snapshot_seq(),  # what a stop left of the last one's records
        )
        self._checkpointer.start()
        self._checkpointer.wake()

    @property
    def checkpoints_in_background(self) -> bool:
        """Whether the background checkpointer runs (started and not stopped)."""
        return self._checkpointer is not None

    @property
    def checkpoint_stats(self) -> CheckpointStats | None:
        """The background checkpointer's counters (None when it was never started)."""
        return None if self._checkpointer is None else self._checkpointer.stats

    def stop_background_checkpoints(self) -> None:
        """Let the checkpoint under way finish and end the thread (the appending connection
        checkpoints itself again, at SQLite's default)."""
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.stop()
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("PRAGMA wal_autocheckpoint=1000")

    # -- meta ------------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def setdefault_meta(self, key: str, value: str) -> str:
        """The meta row ``key``, set to ``value`` (a small commit) when there is none."""
        try:
            with self._write_lock:
                stored = self.get_meta(key)
                if stored is not None:
                    return stored
                self.set_meta(key, value)
        except sqlite3.Error as exc:
            raise LogError(f"cannot update {self.path}: {exc}") from None
        if self._checkpointer is not None:
            self._checkpointer.dirty = True
        return value

    # -- records ---------------------------------------------------------------------------
    def _stamp_format(self, version: str) -> bool:
        """Set the format row to ``version`` unless it already says that or later (a
        format is never lowered: a dir that holds format-4 records stays 4); returns
        whether it wrote. Inside the caller's transaction, if any."""
        current = self.get_meta("format_version")
        if current is not None and int(current) >= int(version):
            return False
        self.set_meta("format_version", version)
        return True

    def require_format(self, version: str) -> None:
        """Make the format row at least ``version`` (a small commit when it changes)
        before a record that needs it is appended."""
        try:
            with self._write_lock:
                wrote = self._stamp_format(version)
        except sqlite3.Error as exc:
            raise LogError(f"cannot update {self.path}: {exc}") from None
        if wrote and self._checkpointer is not None:
            self._checkpointer.dirty = True

    def append(self, seq: int, *body: bytes | memoryview) -> None:
        """Write one record (after the last one) to the journal; durable at this level once
        it returns: in the OS page cache (``process``) or on the disk (``fsync``). The
        record's body is ``body``'s parts in order (written as they are, not joined first:
        a step's part is the request as it came, tens of KB)."""
        try:
            if self._segment_fd is None or self._segment_size >= self.segment_bytes:
                self._start_segment(seq)
            fd = self._segment_fd
            assert fd is not None
            size = sum(map(len, body))
            header = _RECORD_HEADER.pack(size, record_crc(seq, *body), seq)
            at = self._segment_size
            written = _pwritev(fd, (header, *body), at)
            if written != len(header) + size:
                # A short write (a full disk, a signal): finish it, or fail with the reason.
                rest = memoryview(b"".join((header, *body)))[written:]
                while rest:
                    n = os.pwrite(fd, rest, at + written)
                    rest, written = rest[n:], written + n
            if self.level is DurabilityLevel.FSYNC:
                _fdatasync(fd)
        except OSError as exc:
            raise LogError(
                f"cannot append record {seq} to {self.journal_dir}: {exc.strerror or exc}"
            ) from None
        self._segment_size += written
        self._last_appended = seq

    def _start_segment(self, seq: int) -> None:
        """Close the segment being appended to and create the one that starts at ``seq``
        (at level ``fsync``, its header and its name in the directory synced before any
        record goes in)."""
        self._close_segment()
        if not self._segments:
            # An older pagekeeper would not see records in segment files: make it refuse
            # the directory (a small commit, once, before the first segment).
            self.require_format(FORMAT_VERSION)
        synced = self.level is DurabilityLevel.FSYNC  # a killed process loses no write()
        created = not self.journal_dir.exists()
        self.journal_dir.mkdir(mode=0o700, exist_ok=True)
        if created and synced:
            _fsync_path(self.journal_dir.parent)
        path = self.journal_dir / f"segment-{seq:020d}.pkj"
        if path.exists():
            self._drop_empty_segment(seq, path)
        # Owner-only: the records hold every admitted prompt's token ids. Written at
        # explicit offsets (not O_APPEND): the file may extend past the last record (zeros
        # reserved ahead).
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.pwrite(fd, _SEGMENT_HEADER.pack(_SEGMENT_MAGIC, seq), 0)
            if synced:
                os.fsync(fd)
                _fsync_path(self.journal_dir)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        self._segments.append((seq, path))
        self._segment_fd = fd
        self._segment_size = self._reserved_end = _SEGMENT_HEADER.size

    @property
    def needs_reserve(self) -> bool:
        """Whether :meth:`reserve_ahead` would write: level ``process``, a segment open,
        and a chunk or more missing from ``reserve_bytes`` of zeros past its last record."""
        return (
            self.level is DurabilityLevel.PROCESS
            and self._segment_fd is not None
            and self._reserved_end - self._segment_size <= self.reserve_bytes - RESERVE_CHUNK
            and self._segment_size < self.segment_bytes
        )

    def reserve_ahead(self) -> int:
        """Write zeros past the open segment's last record (a chunk at most, toward
        ``reserve_bytes`` past it, not past ``segment_bytes``): the next appends then
        rewrite pages the OS holds already instead of growing the file (an admission
        step's 62 KB record: ~13 us against ~27 us after idle). For the caller to run off
        the answer's path. The dir is stamped :data:`RESERVE_FORMAT` first. Returns the
        bytes written; a failed write stops the reserve there (appends go on past it,
        growing the file as before)."""
        fd = self._segment_fd
        if not self.needs_reserve or fd is None:
            return 0
        start = max(self._reserved_end, self._segment_size)
        end = min(
            start + RESERVE_CHUNK, self._segment_size + self.reserve_bytes, self.segment_bytes
        )
        if end <= start:
            return 0
        self.require_format(RESERVE_FORMAT)
        at = start
        try:
            while at < end:
                n = os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), end - at)], at)
                at += n
        except OSError as exc:
            logger.warning("cannot reserve journal space in %s: %s", self.journal_dir, exc)
        self._reserved_end = at
        return at - start

    def _drop_empty_segment(self, seq: int, path: Path) -> None:
        """A kill between a segment's creation and its first record leaves the segment
        holding its header alone (found, and kept, at the next start): it is made anew
        (creating it again would fail, and every append after a restart with it). One
        that holds a record is never replaced: appending there would fork the journal."""
        if any(True for _ in self._segment_records(seq, path)):
            raise LogError(f"journal segment {path} already holds records from {seq}")
        path.unlink(missing_ok=True)
        self._segments = [(first, p) for first, p in self._segments if p != path]

    def _close_segment(self) -> None:
        fd, self._segment_fd = self._segment_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                if self._reserved_end > self._segment_size:
                    os.ftruncate(fd, self._segment_size)  # the zeros no record took
            with contextlib.suppress(OSError):
                os.close(fd)
        self._reserved_end = 0

    def _scan_segments(self) -> list[tuple[int, Path]]:
        try:
            names = os.listdir(self.journal_dir)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _SEGMENT_FILE.fullmatch(name)
            if match is not None:
                found.append((int(match.group(1)), self.journal_dir / name))
        return sorted(found)

    @staticmethod
    def _segment_records(first: int, path: Path) -> Iterator[tuple[int, int, int, memoryview]]:
        """``(offset, seq, crc, body)`` of each record of one segment, in file order; a
        record that is not whole (a torn tail), or a header that is not this segment's,
        comes out as ``CUT_SHORT`` (its seq: the one expected there) and ends it."""
        try:
            data = memoryview(path.read_bytes())
        except FileNotFoundError:
            return
        except OSError as exc:
            raise LogError(f"cannot read journal segment {path}: {exc.strerror or exc}") from None
        size = len(data)
        if size < _SEGMENT_HEADER.size or _SEGMENT_HEADER.unpack_from(data) != (
            _SEGMENT_MAGIC,
            first,
        ):
            yield 0, first, CUT_SHORT, data[:0]
            return
        offset, expected = _SEGMENT_HEADER.size, first
        while offset < size:
            if size - offset < _RECORD_HEADER.size:
                yield offset, expected, CUT_SHORT, data[:0]
                return
            length, crc, seq = _RECORD_HEADER.unpack_from(data, offset)
            if not length and not seq and not crc:
                return  # the zeros reserved ahead of the next record (format 5): no more
            start = offset + _RECORD_HEADER.size
            if size - start < length:
                yield offset, seq, CUT_SHORT, data[start:]
                return
            yield offset, seq, crc, data[start : start + length]
            offset, expected = start + length, seq + 1

    def read_after(self, seq: int) -> Iterator[tuple[int, int, bytes]]:
        """``(seq, crc, body)`` of every record after ``seq``, in order: the rows of table
        ``log`` (format 2), then the segment files'. A record that could not be read whole
        has the crc ``CUT_SHORT`` and is the last one."""
        cursor = self._db.execute(
            "SELECT seq, crc, body FROM log WHERE seq > ? ORDER BY seq", (seq,)
        )
        for row_seq, crc, body in cursor:
            yield int(row_seq), int(crc), body if isinstance(body, bytes) else bytes(body)
        segments = list(self._segments)
        for i, (first, path) in enumerate(segments):
            if i + 1 < len(segments) and segments[i + 1][0] <= seq + 1:
                continue  # every record of it is at or before ``seq``
            for _, record_seq, crc, body in self._segment_records(first, path):
                if crc == CUT_SHORT:
                    if record_seq > seq:
                        yield record_seq, crc, bytes(body)
                        return
                    break  # damage among covered records: the next segment goes on
                if record_seq > seq:
                    yield record_seq, crc, bytes(body)

    def last_seq(self) -> int:
        """The seq of the last record :meth:`read_after` gives whole (0: none)."""
        last = 0
        for seq, crc, _ in self.read_after(0):
            if crc == CUT_SHORT:
                break
            last = seq
        return last

    def num_records(self) -> int:
        """Records stored (covered ones not yet removed included; a torn one excluded)."""
        count = int(self._db.execute("SELECT COUNT(*) FROM log").fetchone()[0])
        for first, path in self._segments:
            count += sum(crc != CUT_SHORT for _, _, crc, _ in self._segment_records(first, path))
        return count

    def delete_from(self, seq: int) -> int:
        """Drop records ``>= seq`` (a damaged tail) and whatever follows them in their
        segment; returns how many records went (a torn one counted)."""
        with self._write_lock:
            cursor = self._db.execute("DELETE FROM log WHERE seq >= ?", (seq,))
        dropped = int(cursor.rowcount)
        self._close_segment()  # the next append starts a segment after what is kept
        try:
            for first, path in list(self._segments):
                if first >= seq:
                    dropped += sum(1 for _ in self._segment_records(first, path))
                    path.unlink(missing_ok=True)
                    continue
                # Cut at the first record at or past ``seq``, or the first that is not the
                # next of the segment's run (a damaged seq field: it must go too, or the
                # next start would find the same gap and drop what was appended since).
                cut, expected = None, first
                for offset, record_seq, crc, _ in self._segment_records(first, path):
                    if cut is None and (
                        crc == CUT_SHORT or record_seq >= seq or record_seq != expected
                    ):
                        cut = offset
                    if cut is not None:
                        dropped += 1
                    expected += 1
                if cut is not None:
                    os.truncate(path, max(cut, _SEGMENT_HEADER.size))
                    if self.level is DurabilityLevel.FSYNC:
                        _fsync_path(path)
            if self.level is DurabilityLevel.FSYNC:
                _fsync_path(self.journal_dir)
        except OSError as exc:
            raise LogError(
                f"cannot drop records from {seq} in {self.journal_dir}: {exc.strerror or exc}"
            ) from None
        finally:
            self._segments = self._scan_segments()
        return dropped

    def journal_usage(self) -> tuple[int, int]:
        """``(segment files, bytes)`` on disk: the segments in use and those retired but not
        yet removed (for the metrics; one ``stat`` each)."""
        paths = {path for _, path in self._segments}
        paths.update(p for p in self._retired.paths if p.parent == self.journal_dir)
        count = size = 0
        for path in paths:
            with contextlib.suppress(OSError):
                size += path.stat().st_size
                count += 1
        return count, size

    def _covered_segments(self, seq: int) -> tuple[Path, ...]:
        """Take the segments every record of which is at or before ``seq`` (the next one
        starts at or before ``seq + 1``) out of the list. The one appended to stays, unless
        ``seq`` is this log's last append (an idle service's snapshot, the one a graceful
        stop takes): then it is ended and goes too, and the next record starts a segment."""
        segments = self._segments
        covered = []
        while len(segments) > 1 and segments[1][0] <= seq + 1:
            covered.append(segments.pop(0)[1])
        if self._segment_fd is not None and seq >= self._last_appended and segments:
            self._close_segment()
            covered.append(segments.pop()[1])
        return tuple(covered)

    # -- snapshots -------------------------------------------------------------------------
    def store_snapshot_file(self, seq: int, body: bytes) -> SnapshotFile:
        """Write ``body`` as the snapshot after record ``seq`` to its file, fsync'ed and
        renamed into place (so it is whole or absent), not yet registered. Touches no
        database: safe to call from a worker thread while records are appended."""
        crc = record_crc(seq, body)
        name = snapshot_file_name(seq)
        path = self.snapshot_dir / name
        partial = path.with_suffix(".tmp")
        try:
            self.snapshot_dir.mkdir(mode=0o700, exist_ok=True)
            # Owner-only, as the journal: a snapshot holds the running requests' tokens.
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.write(_FILE_HEADER.pack(_FILE_MAGIC, seq, crc, len(body)))
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
            _fsync_path(self.snapshot_dir)
        except OSError as exc:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise LogError(f"cannot write snapshot file {path}: {exc.strerror or exc}") from None
        return SnapshotFile(seq, name, crc, len(body))

    def latest_snapshot_seq(self) -> int:
        """The seq of the newest registered snapshot, file or inline (0: none)."""
        seqs = [
            self._db.execute(f"SELECT MAX(seq) FROM {table}").fetchone()[0]
            for table in ("snapshot_files", "snapshots")
        ]
        return max((int(seq) for seq in seqs if seq is not None), default=0)

    def commit_snapshot_file(self, snapshot: SnapshotFile) -> tuple[str, ...]:
        """Register a stored snapshot file and drop what it makes redundant (older
        snapshots, and format-2 rows up to its seq: here without the background thread, by
        the thread in batches with it) in one small transaction; returns the names of the
        older files it unregistered. Those files and the journal segments it covers whole
        stay on disk until a checkpoint has synced this transaction (before that, a power
        loss may undo it, and the database would name them again): the background
        checkpointer's next complete one (it is woken now), or without it the next
        :meth:`checkpoint`, which the caller makes. Never waits for one."""
        db = self._db
        checkpointer = self._checkpointer
        try:
            with self._write_lock:
                db.execute("BEGIN IMMEDIATE")
                try:
                    older = [
                        str(row[0])
                        for row in db.execute(
                            "SELECT name FROM snapshot_files WHERE seq <= ? AND name != ?",
                            (snapshot.seq, snapshot.name),
                        )
                    ]
                    db.execute("DELETE FROM snapshot_files WHERE seq <= ?", (snapshot.seq,))
                    db.execute(
                        "INSERT INTO snapshot_files (seq, crc, name, size) VALUES (?, ?, ?, ?)",
                        (snapshot.seq, snapshot.crc, snapshot.name, snapshot.size),
                    )
                    if checkpointer is None:
                        db.execute("DELETE FROM log WHERE seq <= ?", (snapshot.seq,))
                    db.execute("DELETE FROM snapshots")  # inline ones (format 1) are older
                    self._stamp_format(FORMAT_VERSION)
                    db.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            raise LogError(
                f"cannot register the snapshot at {snapshot.seq} in {self.path}: {exc}"
            ) from None
        covered = self._covered_segments(snapshot.seq)
        if self._segment_fd is not None and self._segment_size >= ROLL_AFTER_SNAPSHOT_BYTES:
            # The next record starts a segment, so the next registration covers this one
            # whole: the journal holds about two snapshot intervals, not up to 64 MB more.
            self._close_segment()
        if older or covered:
            self._retired.add(tuple(self.snapshot_dir / name for name in older) + covered)
        if checkpointer is not None:
            # The thread deletes the records it covers now, then checkpoints (which also
            # lets it remove the files this registration replaced).
            checkpointer.prune_upto = max(checkpointer.prune_upto, snapshot.seq)
            checkpointer.dirty = True
            checkpointer.wake()
        return tuple(older)

    @property
    def retired_snapshot_files(self) -> tuple[str, ...]:
        """Snapshot files waiting for a checkpoint to be removed."""
        return tuple(p.name for p in self._retired.paths if p.parent == self.snapshot_dir)

    @property
    def retired_segments(self) -> tuple[str, ...]:
        """Journal segments (covered by a registered snapshot) waiting for a checkpoint to
        be removed."""
        return tuple(p.name for p in self._retired.paths if p.parent == self.journal_dir)

    def discard_snapshot_file(self, snapshot: SnapshotFile) -> None:
        """Remove a stored file that will not be registered."""
        with contextlib.suppress(OSError):
            (self.snapshot_dir / snapshot.name).unlink()

    def remove_orphan_snapshot_files(self) -> tuple[str, ...]:
        """Unlink snapshot files no row names (a crash between storing and registering
        one) and partial ones; returns their names. Only this module's names are touched."""
        named = {str(row[0]) for row in self._db.execute("SELECT name FROM snapshot_files")}
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(os.listdir(self.snapshot_dir)):
                if _SNAPSHOT_FILE.fullmatch(entry) is None or entry in named:
                    continue
                with contextlib.suppress(OSError):
                    (self.snapshot_dir / entry).unlink()
                    removed.append(entry)
        return tuple(removed)

    def latest_snapshot(self) -> tuple[int, int, bytes] | None:
        """``(seq, crc, body)`` of the newest snapshot, file or inline (the caller checks
        the CRC). Raises LogError when the file a row names cannot be read whole."""
        row = self._db.execute(
            "SELECT seq, crc, name, size FROM snapshot_files ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        inline = self._db.execute(
            "SELECT seq, crc, body FROM snapshots ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        if inline is not None and (row is None or int(inline[0]) > int(row[0])):
            seq, crc, body = inline
            return int(seq), int(crc), body if isinstance(body, bytes) else bytes(body)
        if row is None:
            return None
        seq, crc, name, size = int(row[0]), int(row[1]), str(row[2]), int(row[3])
        path = self.snapshot_dir / name
        try:
            with open(path, "rb") as f:
                header = f.read(_FILE_HEADER.size)
                body = f.read()  # the body alone: no second copy of tens of MB
        except OSError as exc:
            raise LogError(f"cannot read snapshot file {path}: {exc.strerror or exc}") from None
        if len(header) < _FILE_HEADER.size:
            raise LogError(f"snapshot file {path} is shorter than its header")
        magic, file_seq, file_crc, length = _FILE_HEADER.unpack(header)
        if magic != _FILE_MAGIC or (file_seq, file_crc, length) != (seq, crc, size):
            raise LogError(f"snapshot file {path} does not match its registration")
        if len(body) != size:
            raise LogError(f"snapshot file {path} holds {len(body)} body bytes, not {size}")
        return seq, crc, body

    # -- housekeeping ----------------------------------------------------------------------
    def checkpoint(self) -> bool:
        """Fold the WAL into the database file and truncate it (at shutdown, and after a
        snapshot when no background checkpointer runs: keeps the WAL, and so start-up,
        short), then remove the retired snapshot files. Returns whether it completed:
        then every committed transaction is in the database file, synced (SQLite syncs
        the WAL before and the database after a checkpoint unless ``synchronous=OFF``),
        so no power loss can undo it. It never waits: a reader in the way (an operator's
        ``sqlite3`` shell, a backup) makes it report busy at once, where the connection's
        busy timeout would hold the event loop for seconds; the next one catches up."""
        db = self._db
        try:
            db.execute("PRAGMA busy_timeout=0")
            try:
                row = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                db.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        except sqlite3.Error:
            return False
        if row is None or int(row[0]) != 0:
            return False
        self._retired.remove()  # every commit so far is synced
        return True

    def close(self) -> None:
        self.stop_background_checkpoints()
        self._close_segment()
        with contextlib.suppress(sqlite3.Error):
            self._db.close()


__all__ = [
    "BACKSTOP_AUTOCHECKPOINT_PAGES",
    "CHECKPOINT_INTERVAL_S",
    "CUT_SHORT",
    "DB_NAME",
    "JOURNAL_DIR",
    "RESERVE_BYTES",
    "RESERVE_CHUNK",
    "RESERVE_FORMAT",
    "ROLL_AFTER_SNAPSHOT_BYTES",
    "SEGMENT_BYTES",
    "SNAPSHOT_DIR",
    "CheckpointStats",
    "CommandLog",
    "DurabilityLevel",
    "LogError",
    "SnapshotFile",
    "record_crc",
]
