"""The durable command log and its snapshots: one SQLite database in WAL mode, and the
snapshot bodies in files beside it.

Why SQLite (standard library, no server): its write-ahead log gives atomic, ordered commits
that survive a killed process by construction, its own frame checksums drop a torn tail
after a power loss, and one transaction can register a snapshot *and* drop the log records
it covers, so there is no window where both or neither exist. Four tables::

    meta            key TEXT PRIMARY KEY, value TEXT      format version, pool configuration
    log             seq INTEGER PRIMARY KEY, crc INTEGER, body BLOB     one applied command
    snapshot_files  seq INTEGER PRIMARY KEY, crc INTEGER, name TEXT, size INTEGER
                    the state after record seq, in ``snapshots/<name>``
                    (``snapshot-<seq>-<8 random hex digits>.pks``)
    snapshots       seq INTEGER PRIMARY KEY, crc INTEGER, body BLOB
                    the same, inline (format 1; read, no longer written)

A snapshot's body (tens of MB for a large pool) is written to its file, fsync'ed and
renamed into place by :meth:`CommandLog.store_snapshot_file` -- from a worker thread, while
the event loop goes on appending records -- and only then registered (a small row, and the
deletion of the records it covers) by :meth:`CommandLog.commit_snapshot_file`. The file is
fsync'ed at every level: once registered, the records it replaces are gone. A file no row
names (a crash between the two steps) is removed at the next start.

Each record and snapshot carries its own CRC-32 over ``seq`` (8 bytes, little-endian)
followed by the body, so a row or file that was damaged, or moved to another sequence
number, is caught even where SQLite's checks would not see it (bit rot inside a page, a
tool editing the file). Sequence numbers start at 1 and have no gaps;
:meth:`CommandLog.read_after` hands out the rows, :mod:`pagekeeper.durability.recovery`
checks them.

Durability levels map to SQLite's ``synchronous`` setting (the database is always in WAL
mode):

=========  ============  ==============================================================
level      synchronous   what an acknowledged command survives
=========  ============  ==============================================================
process    NORMAL        the service killed at any instant (``kill -9``, OOM, a crash):
                         a commit is a ``write()`` into the WAL, in the OS page cache
                         before the call returns. Power loss may drop the last commits
                         (never corrupt the database: checkpoints still fsync). ``OFF``
                         would be no faster per commit and could corrupt on power loss.
fsync      FULL          also power loss and kernel crashes: the WAL is fsync'ed at every
                         commit before the answer goes out.
=========  ============  ==============================================================

Checkpoints (copying the WAL's frames into the database file, then fsync'ing it) run in a
thread of their own once :meth:`CommandLog.start_background_checkpoints` is called (the
service does): a ``PASSIVE`` checkpoint on its own connection after every
``CHECKPOINT_BYTES`` of records, and every ``CHECKPOINT_INTERVAL_S`` while records came in.
Left to SQLite, the appending connection checkpoints itself every ~4 MB of WAL, inside the
commit that crosses the mark: with the fsync, a 6-14 ms stall of the event loop every ~60
admission steps. ``PASSIVE`` never takes the write lock, so appends go on meanwhile (the
sqlite3 module lets go of the GIL around each SQLite call); the next commit after a
checkpoint that copied every frame starts the WAL over. SQLite's own automatic checkpoint
stays on the appending connection as a backstop, at ``BACKSTOP_AUTOCHECKPOINT_PAGES``
(~64 MB of WAL), for a thread that falls behind or cannot run.

A registered snapshot makes the older snapshot files redundant, but they may go only once a
checkpoint has synced the registration (before that, a power loss may undo it, and the
database would name an older file again). :meth:`CommandLog.commit_snapshot_file` queues
them: the thread's next complete checkpoint removes them (it is woken at once), or, without
the thread, the next :meth:`CommandLog.checkpoint` on the appending connection. With the
thread, the loop never checkpoints after a snapshot (that checkpoint, with its fsync, held
the loop 6-12 ms at every snapshot of a soak run).

The records a registered snapshot covers are deleted by the same thread too, a batch of
~1 ms at a time (``PRUNE_BATCH_SECONDS``), rather than inside the registration: deleting a
record frees its chain of overflow pages, which SQLite reads one by one, so 10,000 records
of 40 KB (admission steps) took 1.4 s, and that transaction held the event loop. The thread
and the appender share a lock around their writes, so an append waits at most for one
batch, never in SQLite's busy handler (whose sleeps are 1 ms and up). Until they are gone,
covered records are simply not read (:meth:`CommandLog.read_after` starts after the
snapshot), and a later commit cannot persist without an earlier one, so a power loss never
keeps a deletion without its registration. A stop before the thread is done leaves the rest
to the next start's thread.
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
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

DB_NAME = "pagekeeper.db"
SNAPSHOT_DIR = "snapshots"
FORMAT_VERSION = "2"
READABLE_FORMATS = ("1", "2")
"""Format 1 kept snapshot bodies inline (table ``snapshots``); 2 keeps them in files."""
_SEQ = struct.Struct("<q")
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

CHECKPOINT_BYTES = 4 << 20
"""Record bytes between two background checkpoints (SQLite's own default is 1,000 pages)."""
CHECKPOINT_INTERVAL_S = 5.0
"""A background checkpoint at least this often while records come in (keeps the WAL, and
so a restart after a crash, short on a quiet service)."""
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
_PAGE_BYTES = 4096  # SQLite's default page: a commit writes at least one

logger = logging.getLogger(__name__)


class LogError(RuntimeError):
    """The database cannot be opened or written (its message is one line for an operator)."""


def record_crc(seq: int, body: bytes | memoryview) -> int:
    """CRC-32 of ``seq`` (8 bytes LE) then ``body``."""
    return zlib.crc32(body, zlib.crc32(_SEQ.pack(seq)))


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


def _fsync_dir(path: Path) -> None:
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
    """Snapshot files unregistered by committed transactions that no checkpoint has synced
    yet, each batch under a ticket (1, 2, ...) taken after its transaction committed: a
    checkpoint that began after ticket ``t`` was taken and then copied every frame covers
    every batch up to ``t``. Used from the loop and the checkpointer's thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._pending: list[tuple[int, tuple[str, ...]]] = []
        self.ticket = 0
        """The latest batch's ticket (read before a checkpoint pass begins)."""

    def add(self, names: tuple[str, ...]) -> None:
        with self._lock:
            self.ticket += 1
            self._pending.append((self.ticket, names))

    @property
    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(name for _, batch in self._pending for name in batch)

    def remove(self, upto: int | None = None) -> None:
        """Unlink the batches up to ticket ``upto`` (all of them when None): best effort,
        a file left behind is an orphan the next start-up removes."""
        with self._lock:
            if upto is None:
                taken, self._pending = self._pending, []
            else:
                taken = [item for item in self._pending if item[0] <= upto]
                self._pending = [item for item in self._pending if item[0] > upto]
        for _, batch in taken:
            for name in batch:
                with contextlib.suppress(OSError):
                    (self.directory / name).unlink()


class _Checkpointer(threading.Thread):
    """Runs ``PRAGMA wal_checkpoint(PASSIVE)`` on its own connection when woken (the
    appender crossed ``CHECKPOINT_BYTES``) or every ``interval_s`` while records came in;
    first deletes, in batches, the records up to ``prune_upto`` (a registered snapshot's)."""

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
        """Set by the appender on every record, cleared here before each checkpoint."""
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
                break  # a reader (or another checkpoint) holds frames back
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
                # The appender crossed its mark meanwhile: keep the WAL short as usual.
                self._wake.clear()
                self.dirty = False
                self._checkpoint(db)
            if took > PRUNE_BATCH_SECONDS:
                self._batch = max(1, self._batch // 2)
            elif took < PRUNE_BATCH_SECONDS / 4:
                self._batch = min(_PRUNE_MAX_BATCH, self._batch * 2)
            time.sleep(_PRUNE_PAUSE_S)

    def _failed(self, exc: sqlite3.Error) -> None:
        # Nothing is lost: the records are in the WAL, and the appending connection's own
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
        self._retired = _RetiredFiles(self.snapshot_dir)
        self._checkpointer: _Checkpointer | None = None
        self._checkpoint_bytes = CHECKPOINT_BYTES
        self._bytes_since_wake = 0
        # Held around each write of the appending connection and each batch of the
        # checkpointer's deletions (see the module docstring).
        self._write_lock = threading.Lock()

    # -- background checkpoints ------------------------------------------------------------
    def start_background_checkpoints(
        self,
        every_bytes: int = CHECKPOINT_BYTES,
        interval_s: float = CHECKPOINT_INTERVAL_S,
        backstop_pages: int = BACKSTOP_AUTOCHECKPOINT_PAGES,
    ) -> None:
        """Checkpoint from a thread from now on (see the module docstring); the appending
        connection's own automatic checkpoint moves back to ``backstop_pages``."""
        if self._checkpointer is not None:
            return
        if every_bytes < 1 or interval_s <= 0 or backstop_pages < 1:
            raise ValueError("checkpoint thresholds must be positive")
        try:
            self._db.execute(f"PRAGMA wal_autocheckpoint={int(backstop_pages)}")
            self._db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
        except sqlite3.Error as exc:
            raise LogError(f"cannot configure checkpoints of {self.path}: {exc}") from None
        self._checkpoint_bytes = every_bytes
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

    # -- records ---------------------------------------------------------------------------
    def append(self, seq: int, body: bytes) -> None:
        """Commit one record; durable at this level once it returns."""
        try:
            with self._write_lock:
                self._db.execute(self._append_sql, (seq, record_crc(seq, body), body))
        except sqlite3.Error as exc:
            raise LogError(f"cannot append record {seq} to {self.path}: {exc}") from None
        checkpointer = self._checkpointer
        if checkpointer is not None:
            checkpointer.dirty = True
            self._bytes_since_wake += len(body) + _PAGE_BYTES  # ~ its WAL frames
            if self._bytes_since_wake >= self._checkpoint_bytes:
                self._bytes_since_wake = 0
                checkpointer.wake()

    def read_after(self, seq: int) -> Iterator[tuple[int, int, bytes]]:
        """``(seq, crc, body)`` of every record after ``seq``, in order."""
        cursor = self._db.execute(
            "SELECT seq, crc, body FROM log WHERE seq > ? ORDER BY seq", (seq,)
        )
        for row_seq, crc, body in cursor:
            yield int(row_seq), int(crc), body if isinstance(body, bytes) else bytes(body)

    def last_seq(self) -> int:
        row = self._db.execute("SELECT MAX(seq) FROM log").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def num_records(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM log").fetchone()[0])

    def delete_from(self, seq: int) -> int:
        """Drop records ``>= seq`` (a damaged tail); returns how many."""
        with self._write_lock:
            cursor = self._db.execute("DELETE FROM log WHERE seq >= ?", (seq,))
        return int(cursor.rowcount)

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
            self.snapshot_dir.mkdir(exist_ok=True)
            with open(partial, "wb") as f:
                f.write(_FILE_HEADER.pack(_FILE_MAGIC, seq, crc, len(body)))
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
            _fsync_dir(self.snapshot_dir)
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
        snapshots, and the records up to its seq: here without the background thread, by
        the thread in batches with it) in one small transaction; returns the names of the
        older files it unregistered. They stay on disk until a checkpoint has synced this
        transaction (before that, a power loss may undo it, and the database would name
        them again): the background checkpointer's next complete one (it is woken now), or
        without it the next :meth:`checkpoint`, which the caller makes. Never waits for
        one."""
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
                    self.set_meta("format_version", FORMAT_VERSION)
                    db.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            raise LogError(
                f"cannot register the snapshot at {snapshot.seq} in {self.path}: {exc}"
            ) from None
        if older:
            self._retired.add(tuple(older))
        if checkpointer is not None:
            # The thread deletes the records it covers now, then checkpoints (which also
            # lets it remove the files this registration replaced).
            checkpointer.prune_upto = max(checkpointer.prune_upto, snapshot.seq)
            checkpointer.dirty = True
            checkpointer.wake()
        return tuple(older)

    @property
    def retired_snapshot_files(self) -> tuple[str, ...]:
        """Files waiting for a checkpoint to be removed."""
        return self._retired.names

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
        with contextlib.suppress(sqlite3.Error):
            self._db.close()


__all__ = [
    "BACKSTOP_AUTOCHECKPOINT_PAGES",
    "CHECKPOINT_BYTES",
    "CHECKPOINT_INTERVAL_S",
    "DB_NAME",
    "SNAPSHOT_DIR",
    "CheckpointStats",
    "CommandLog",
    "DurabilityLevel",
    "LogError",
    "SnapshotFile",
    "record_crc",
]
