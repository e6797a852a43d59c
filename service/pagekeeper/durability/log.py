"""The durable command log and its snapshots: one SQLite database in WAL mode.

Why SQLite (standard library, no server): its write-ahead log gives atomic, ordered commits
that survive a killed process by construction, its own frame checksums drop a torn tail
after a power loss, and one transaction can store a snapshot *and* drop the log records it
covers, so there is no window where both or neither exist. Three tables::

    meta       key TEXT PRIMARY KEY, value TEXT      format version, pool configuration
    log        seq INTEGER PRIMARY KEY, crc INTEGER, body BLOB     one applied command
    snapshots  seq INTEGER PRIMARY KEY, crc INTEGER, body BLOB     the state after record seq

Each record and snapshot carries its own CRC-32 over ``seq`` (8 bytes, little-endian)
followed by the body, so a row that was damaged, or moved to another sequence number, is
caught even where SQLite's checks would not see it (bit rot inside a page, a tool editing
the file). Sequence numbers start at 1 and have no gaps; :meth:`CommandLog.read_after`
hands out the rows, :mod:`pagekeeper.durability.recovery` checks them.

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
"""

from __future__ import annotations

import contextlib
import sqlite3
import struct
import zlib
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path

DB_NAME = "pagekeeper.db"
FORMAT_VERSION = "1"
_SEQ = struct.Struct("<q")


class DurabilityLevel(StrEnum):
    NONE = "none"
    """Nothing is written: a restart starts from an empty pool."""
    PROCESS = "process"
    """Survives the process being killed (``kill -9``)."""
    FSYNC = "fsync"
    """Survives power loss (fsync at every commit)."""


_SYNCHRONOUS = {DurabilityLevel.PROCESS: "NORMAL", DurabilityLevel.FSYNC: "FULL"}


class LogError(RuntimeError):
    """The database cannot be opened or written (its message is one line for an operator)."""


def record_crc(seq: int, body: bytes | memoryview) -> int:
    """CRC-32 of ``seq`` (8 bytes LE) then ``body``."""
    return zlib.crc32(body, zlib.crc32(_SEQ.pack(seq)))


class CommandLog:
    """The SQLite file under a data directory. Used from one thread (the event loop)."""

    def __init__(self, directory: str | Path, level: DurabilityLevel) -> None:
        if level is DurabilityLevel.NONE:
            raise ValueError("durability 'none' keeps no log")
        self.path = Path(directory) / DB_NAME
        self.level = level
        try:
            # isolation_level=None: autocommit, so each INSERT is one commit (one durable
            # record); multi-statement transactions are explicit BEGIN/COMMIT.
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
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
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise LogError(f"{self.path} is not a readable pagekeeper database: {exc}") from None
        self._append_sql = "INSERT INTO log (seq, crc, body) VALUES (?, ?, ?)"

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
            self._db.execute(self._append_sql, (seq, record_crc(seq, body), body))
        except sqlite3.Error as exc:
            raise LogError(f"cannot append record {seq} to {self.path}: {exc}") from None

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
        cursor = self._db.execute("DELETE FROM log WHERE seq >= ?", (seq,))
        return int(cursor.rowcount)

    # -- snapshots -------------------------------------------------------------------------
    def write_snapshot(self, seq: int, body: bytes) -> None:
        """Store the state after record ``seq`` and drop what it makes redundant (records
        up to ``seq``, older snapshots) in one transaction."""
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT OR REPLACE INTO snapshots (seq, crc, body) VALUES (?, ?, ?)",
                    (seq, record_crc(seq, body), body),
                )
                db.execute("DELETE FROM log WHERE seq <= ?", (seq,))
                db.execute("DELETE FROM snapshots WHERE seq < ?", (seq,))
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise LogError(f"cannot write the snapshot at {seq} to {self.path}: {exc}") from None

    def latest_snapshot(self) -> tuple[int, int, bytes] | None:
        row = self._db.execute(
            "SELECT seq, crc, body FROM snapshots ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        if row is None:
            return None
        seq, crc, body = row
        return int(seq), int(crc), body if isinstance(body, bytes) else bytes(body)

    # -- housekeeping ----------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Fold the WAL into the database file and truncate it (after a snapshot or at
        shutdown: keeps the WAL, and so start-up, short)."""
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.close()


__all__ = ["DB_NAME", "CommandLog", "DurabilityLevel", "LogError", "record_crc"]
