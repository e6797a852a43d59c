"""Open a data directory, recover the state it holds, and keep it durable from then on.

:class:`Durability` is the service's :class:`pagekeeper.state.Journal`. Its life::

    open(data_dir)   lock the directory (one service per data dir), remove ring files a
                     crashed predecessor left in /dev/shm, open the log
    recover(state)   latest snapshot (unreadable: start-up fails) + replay of every later
                     record whose sequence number, CRC and decoding check out; the first
                     that does not ends the valid prefix: reported (log line + metric),
                     dropped, and the state is the one after the record before it
    attach(state)    from now on every applied mutation is committed before its answer
                     returns (``state.journal = durability``)
    snapshot(state)  every ``snapshot_every`` records (the server's housekeeping task asks
                     :attr:`snapshot_due` and uses ``snapshot_in_background``, which
                     encodes and writes the file in a worker thread) and at a graceful
                     shutdown: bounds the replay
    close()          checkpoint the WAL, unlock

Layout of a data directory::

    LOCK            flock'ed by the running service; holds its pid
    journal/        the command log's records (segment-<first seq>.pkj)
    pagekeeper.db   (+ -wal, -shm) the format, the pool configuration, the latest
                    snapshot's registration (format 2: the records too, table ``log``)
    snapshots/      the latest snapshot's body (snapshot-<seq>-<nonce>.pks)
    rings.txt       shared-memory files of the rings this data dir's service created
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagekeeper.core.errors import PagekeeperError
from pagekeeper.durability.commands import (
    RecordDecodeError,
    RecordFromNewerVersion,
    decode_command,
    encode_command_parts,
)
from pagekeeper.durability.log import (
    CUT_SHORT,
    FORMAT_VERSION,
    IDENTITY_FORMAT,
    READABLE_FORMATS,
    CheckpointStats,
    CommandLog,
    DurabilityLevel,
    LogError,
    SnapshotFile,
    record_crc,
)
from pagekeeper.durability.snapshot import SnapshotError, decode_snapshot, encode_snapshot
from pagekeeper.state import (
    Command,
    ConfigureLimitsCommand,
    RegisterCommand,
    ServiceState,
    limits_from_tree,
    limits_to_tree,
)

log = logging.getLogger("pagekeeper.durability")

LOCK_NAME = "LOCK"
RINGS_NAME = "rings.txt"
# Ring files the publishers create: pagekeeper-<kind>-<pid>-<generation hex>-<n>.
_RING_FILE = re.compile(r"^pagekeeper-[a-z_]+-(\d+)-[0-9a-f]+-\d+$")


class DurabilityError(RuntimeError):
    """Start-up cannot use the data directory; the message is one line for an operator."""


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What start-up found in the data directory."""

    snapshot_seq: int
    """Record the snapshot was taken after (0: none, replay from an empty pool)."""
    num_replayed: int
    last_seq: int
    """The last record the recovered state includes."""
    num_dropped: int
    """Records after a damaged one, dropped with it (0 when the log was intact)."""
    damage: str
    """Why the valid prefix ended early ("" when it did not)."""
    seconds: float
    stale_ring_files: tuple[str, ...] = ()


@dataclass(slots=True)
class DurabilityStats:
    """Cheap counters, always on (exported as metrics)."""

    num_records: int = 0
    num_bytes: int = 0
    num_snapshots: int = 0
    last_snapshot_seconds: float = 0.0
    last_snapshot_loop_seconds: float = 0.0
    """Of which the event loop was held (all of it for a snapshot taken synchronously)."""
    last_snapshot_bytes: int = 0
    num_write_failures: int = 0
    append_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def append_percentiles(self) -> dict[str, float]:
        if not self.append_seconds:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        arr = np.fromiter(self.append_seconds, dtype=np.float64)
        p50, p99 = np.percentile(arr, [50, 99])
        return {"p50": float(p50), "p99": float(p99), "max": float(arr.max())}


def _store_snapshot_file(
    commands_log: CommandLog,
    seq: int,
    build_tree: Callable[[], dict[str, Any]],
    pause: Callable[[], None] | None = None,
) -> SnapshotFile | None:
    """Build, encode and write the snapshot after record ``seq`` to its file (any thread:
    it touches no database; ``pause`` between chunks of the encoding, as ``build_tree``
    may between chunks of its own); None, said in the log, when the file cannot be
    written."""
    try:
        return commands_log.store_snapshot_file(seq, encode_snapshot(build_tree(), pause))
    except LogError as exc:
        _snapshot_failed(exc)
        return None


_BUILD_PAUSE_S = 0.0003


def _let_the_loop_run() -> None:
    """Between chunks of a snapshot's tree built in a worker thread: a real sleep, so the
    GIL goes to the event loop if it waits for it (``sleep(0)`` may take it straight back,
    and the interpreter's own switch waits 5 ms, longer inside a C call). For a full event
    buffer (65,536 events, an 8 MB snapshot) the thread takes ~80 ms instead of ~65, and
    the loop's longest wait for the GIL falls from 5-12 ms to 4-5 ms."""
    time.sleep(_BUILD_PAUSE_S)


def _snapshot_failed(exc: LogError) -> None:
    # A failed snapshot loses nothing (the records stay); say so and go on.
    log.error("snapshot failed (the log keeps every record): %s", exc)


class Durability:
    """The durable command log of one data directory (see the module docstring)."""

    def __init__(
        self,
        data_dir: str | Path,
        level: DurabilityLevel | str,
        *,
        snapshot_every: int = 10_000,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """Prefer :meth:`open`, which also locks the directory and cleans stale rings."""
        self.level = DurabilityLevel(level)
        if self.level is DurabilityLevel.NONE:
            raise ValueError("durability 'none' has no data directory to open")
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1")
        self.data_dir = Path(data_dir)
        self.snapshot_every = snapshot_every
        self.on_failure = on_failure
        self.stats = DurabilityStats()
        self.report: RecoveryReport | None = None
        self.failure = ""
        self.stale_ring_files: tuple[str, ...] = ()
        self._lock_fd: int | None = None
        self._log: CommandLog | None = None
        self._seq = 0
        self._since_snapshot = 0
        self._identity_format = False  # the dir is stamped IDENTITY_FORMAT
        self.schedule_reserve: Callable[[], None] | None = None
        """Asks for :meth:`reserve_ahead` to run soon, off the answer's path (the server
        sets it; without it a segment grows record by record)."""
        self._reserve_asked = False

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        data_dir: str | Path,
        level: DurabilityLevel | str,
        *,
        snapshot_every: int = 10_000,
        on_failure: Callable[[str], None] | None = None,
    ) -> Durability:
        """Create/lock the directory, remove stale ring files, open the log. Raises
        :class:`DurabilityError` (one line) when any of it is impossible."""
        self = cls(data_dir, level, snapshot_every=snapshot_every, on_failure=on_failure)
        try:
            # Owner-only when made here: the journal and snapshots hold every running
            # request's token ids (its prompt). Its parents get the usual mode.
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
            self.data_dir.mkdir(mode=0o700, exist_ok=True)
            mode = stat.S_IMODE(self.data_dir.stat().st_mode)
        except OSError as exc:
            raise DurabilityError(
                f"cannot create data dir {self.data_dir}: {exc.strerror or exc}"
            ) from None
        if mode & 0o007:
            log.warning(
                "data dir %s is open to other users (mode %04o): its journal and snapshots "
                "hold the running requests' token ids; consider chmod o-rwx %s",
                self.data_dir,
                mode,
                self.data_dir,
            )
        self._lock()
        try:
            self.stale_ring_files = self._remove_stale_rings()
            self._log = CommandLog(self.data_dir, self.level)
            version = self._log.get_meta("format_version")
            if version is not None and version not in READABLE_FORMATS:
                raise DurabilityError(
                    f"{self._log.path} has format {version}; this pagekeeper reads "
                    f"{', '.join(READABLE_FORMATS)} (a newer pagekeeper wrote it: start that "
                    "version on it, or give this one another --data-dir)"
                )
            orphans = self._log.remove_orphan_snapshot_files()
            if orphans:
                log.warning(
                    "removed %d snapshot file(s) no record registers (a stop between "
                    "writing and registering one): %s",
                    len(orphans),
                    ", ".join(orphans),
                )
            # Checkpoints (and their fsync) from a thread of their own, not inside the
            # commit that crosses SQLite's mark on the event loop.
            self._log.start_background_checkpoints()
        except LogError as exc:
            self.close()
            raise DurabilityError(str(exc)) from None
        except BaseException:
            self.close()
            raise
        return self

    def _lock(self) -> None:
        path = self.data_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise DurabilityError(f"cannot open {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise DurabilityError(
                    f"data dir {self.data_dir} is in use by another pagekeeper (pid {holder})"
                ) from None
            raise DurabilityError(f"cannot lock {path}: {exc.strerror or exc}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _remove_stale_rings(self) -> tuple[str, ...]:
        """Unlink the ring files a previous service on this data dir left behind (a killed
        process never unlinks them). Only names the publishers create are touched."""
        registry = self.data_dir / RINGS_NAME
        try:
            paths = registry.read_text().split()
        except FileNotFoundError:
            return ()
        removed = []
        for raw in dict.fromkeys(paths):
            path = Path(raw)
            match = _RING_FILE.match(path.name)
            if match is None or int(match.group(1)) == os.getpid():
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(raw)
        registry.write_text("")
        if removed:
            log.warning(
                "removed %d ring file(s) a previous instance left behind: %s",
                len(removed),
                ", ".join(removed),
            )
        return tuple(removed)

    def track_ring(self, path: str) -> None:
        """Remember a ring file this service created, so that a successor can remove it
        if this process dies without unlinking it."""
        if not path:
            return
        with open(self.data_dir / RINGS_NAME, "a") as f:
            f.write(path + "\n")

    # -- recovery --------------------------------------------------------------------------
    def recover(self, state: ServiceState) -> RecoveryReport:
        """Bring a fresh ``state`` (no journal, no sink) to the last valid record.

        Raises :class:`DurabilityError` when the data directory belongs to another pool
        configuration, when the snapshot is unreadable, or when the recovered state fails
        its invariants."""
        started = time.perf_counter()
        commands_log = self._require_log()
        if state.journal is not None:
            raise DurabilityError("recover() needs a state without a journal")
        config = json.dumps(state.pool_config.to_dict(), sort_keys=True)
        stored_config = commands_log.get_meta("pool_config")
        if stored_config is None:
            # A new data dir: remember what the first records will be applied under.
            commands_log.set_meta("format_version", FORMAT_VERSION)
            commands_log.set_meta("pool_config", config)
            commands_log.set_meta("initial_limits", json.dumps(limits_to_tree(state.limits)))
        elif stored_config != config:
            raise DurabilityError(
                f"data dir {self.data_dir} holds the state of another pool configuration "
                f"({stored_config}); use another data_dir or remove it"
            )
        else:
            initial = commands_log.get_meta("initial_limits")
            if initial is not None:
                # Replay the first records under the limits they were applied under.
                state.configure_limits(
                    ConfigureLimitsCommand(0.0, limits_from_tree(json.loads(initial)))
                )

        snapshot_seq = 0
        try:
            latest = commands_log.latest_snapshot()
        except LogError as exc:
            raise DurabilityError(f"unreadable snapshot: {exc}") from None
        if latest is not None:
            snapshot_seq, crc, body = latest
            where = f"{commands_log.path} (snapshot after record {snapshot_seq})"
            if crc != record_crc(snapshot_seq, body):
                raise DurabilityError(f"unreadable snapshot in {where}: CRC mismatch")
            try:
                state.restore_state(decode_snapshot(body))
            except SnapshotError as exc:
                raise DurabilityError(f"unreadable snapshot in {where}: {exc}") from None
            except PagekeeperError as exc:
                raise DurabilityError(f"unusable snapshot in {where}: {exc.message}") from None

        expected = snapshot_seq + 1
        damage = ""
        num_replayed = 0
        for seq, crc, body in commands_log.read_after(snapshot_seq):
            if seq != expected:
                damage = f"record {expected} is missing (next is {seq})"
                break
            if crc == CUT_SHORT:
                damage = f"record {seq} is cut short (a torn write)"
                break
            if crc != record_crc(seq, body):
                damage = f"record {seq} fails its CRC"
                break
            try:
                command, publication = decode_command(body)
            except RecordFromNewerVersion as exc:
                # Whole and CRC-valid, so not a torn write: a newer pagekeeper's record.
                # Dropping it and what follows would lose acknowledged steps; refuse.
                raise DurabilityError(
                    f"record {seq} of {commands_log.journal_dir} is not one this "
                    f"pagekeeper reads ({exc}): most likely a newer pagekeeper wrote "
                    "it. Nothing was changed: start that version on this data dir, or "
                    "give this one another --data-dir"
                ) from None
            except RecordDecodeError as exc:
                damage = f"record {seq} does not decode: {exc}"
                break
            try:
                state.replay(command, publication)
            except PagekeeperError as exc:
                # A refused command changed nothing: the state is the one after seq - 1.
                damage = f"record {seq} does not replay: {exc.message}"
                break
            except Exception as exc:
                raise DurabilityError(
                    f"replaying record {seq} of {commands_log.journal_dir} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            num_replayed += 1
            expected += 1
        last_seq = expected - 1
        num_dropped = 0
        if damage:
            num_dropped = commands_log.delete_from(expected)
            log.error(
                "command log %s damaged: %s; recovered the valid prefix up to record %d "
                "and dropped %d record(s) after it",
                commands_log.journal_dir,
                damage,
                last_seq,
                num_dropped,
            )
        try:
            state.check_invariants()
        except PagekeeperError as exc:
            raise DurabilityError(
                f"the state recovered from {self.data_dir} breaks its invariants: {exc.message}"
            ) from None
        self._seq = last_seq
        self._since_snapshot = num_replayed
        report = RecoveryReport(
            snapshot_seq=snapshot_seq,
            num_replayed=num_replayed,
            last_seq=last_seq,
            num_dropped=num_dropped,
            damage=damage,
            seconds=time.perf_counter() - started,
            stale_ring_files=self.stale_ring_files,
        )
        self.report = report
        log.info(
            "recovered %s: snapshot after record %d + %d replayed = record %d, "
            "%d request(s), %d client(s) in %.3fs",
            self.data_dir,
            snapshot_seq,
            num_replayed,
            last_seq,
            len(state.request_ids()),
            len(state.clients()),
            report.seconds,
        )
        return report

    def secret(self, name: str) -> bytes:
        """32 random bytes kept in the data dir under ``name`` (made on first use): a key
        that must outlive restarts as the state does (the same-node socket's tickets)."""
        commands_log = self._require_log()
        try:
            stored = commands_log.setdefault_meta(f"secret.{name}", os.urandom(32).hex())
        except LogError as exc:
            raise DurabilityError(str(exc)) from None
        return bytes.fromhex(stored)

    def attach(self, state: ServiceState) -> None:
        """Journal every later mutation of ``state`` here."""
        state.journal = self

    # -- the journal -----------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def latest_snapshot_seq(self) -> int:
        """The record the newest registered snapshot is after (0: none, or log closed)."""
        return 0 if self._log is None else self._log.latest_snapshot_seq()

    @property
    def journal_usage(self) -> tuple[int, int] | None:
        """``(segment files, bytes)`` of the journal on disk (None while the log is closed)."""
        return None if self._log is None else self._log.journal_usage()

    @property
    def checkpoint_stats(self) -> CheckpointStats | None:
        """The background checkpointer's counters (None while the log is closed)."""
        return None if self._log is None else self._log.checkpoint_stats

    def record(self, command: Command, result: Any) -> None:
        """Commit one applied command (before its answer goes out)."""
        if self.failure:
            raise LogError(f"the log failed earlier: {self.failure}")
        commands_log = self._require_log()
        body = encode_command_parts(command, result)
        seq = self._seq + 1
        started = time.perf_counter()
        try:
            if not self._identity_format and type(command) is RegisterCommand and command.identity:
                # A pagekeeper reading formats 1-3 would drop this record (and every
                # later one) as damage: make it refuse the dir instead.
                commands_log.require_format(IDENTITY_FORMAT)
                self._identity_format = True
            commands_log.append(seq, *body)
        except LogError as exc:
            self._fail(str(exc))
            raise
        stats = self.stats
        stats.append_seconds.append(time.perf_counter() - started)
        stats.num_records += 1
        stats.num_bytes += sum(map(len, body))
        self._seq = seq
        self._since_snapshot += 1
        if (
            not self._reserve_asked
            and self.schedule_reserve is not None
            and commands_log.needs_reserve
        ):
            self._reserve_asked = True
            self.schedule_reserve()

    def reserve_ahead(self) -> int:
        """Write zeros ahead of the journal's last record (see
        :meth:`CommandLog.reserve_ahead`); returns the bytes written."""
        self._reserve_asked = False
        if self.failure or self._log is None:
            return 0
        try:
            return self._log.reserve_ahead()
        except LogError as exc:  # the format stamp could not be written
            log.warning("journal space not reserved: %s", exc)
            return 0

    def _fail(self, reason: str) -> None:
        self.failure = reason
        self.stats.num_write_failures += 1
        log.critical("durable log write failed: %s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    # -- snapshots -------------------------------------------------------------------------
    @property
    def snapshot_due(self) -> bool:
        return self._since_snapshot >= self.snapshot_every and not self.failure

    @property
    def num_records_since_snapshot(self) -> int:
        return self._since_snapshot

    def snapshot(self, state: ServiceState) -> int:
        """Store the state as of the last record and drop the records it covers; returns
        that record's sequence number. Call between mutations (from the loop)."""
        commands_log = self._require_log()
        started = time.perf_counter()
        seq, covered = self._seq, self._since_snapshot
        stored = _store_snapshot_file(commands_log, seq, state.capture_snapshot())
        if stored is None:
            return 0
        return self._register_snapshot(stored, covered, started, time.perf_counter() - started)

    async def snapshot_in_background(self, state: ServiceState) -> int:
        """``snapshot`` with the work off the event loop: the state is captured between
        mutations (a copy that shares nothing mutable with it), turned into its tree,
        encoded and written to its file in a worker thread while calls go on, and
        registered back on the loop (a small transaction), covering the records up to the
        one it was taken after (later records stay in the log). Returns 0 when nothing was
        stored (a failed write, or the log failed or closed meanwhile)."""
        commands_log = self._require_log()
        started = time.perf_counter()
        seq, covered = self._seq, self._since_snapshot
        build_tree = state.capture_snapshot(pause=_let_the_loop_run)
        on_loop = time.perf_counter() - started  # the state's capture
        stored = await asyncio.to_thread(
            _store_snapshot_file, commands_log, seq, build_tree, _let_the_loop_run
        )
        if stored is None:
            return 0
        if self.failure or self._log is not commands_log:
            commands_log.discard_snapshot_file(stored)
            return 0
        return self._register_snapshot(stored, covered, started, on_loop)

    def _register_snapshot(
        self, stored: SnapshotFile, covered: int, started: float, on_loop: float
    ) -> int:
        """Register the stored snapshot file, which covers ``covered`` records; ``on_loop``:
        seconds the loop has already spent on it (this step adds its own)."""
        registering = time.perf_counter()
        commands_log = self._require_log()
        try:
            commands_log.commit_snapshot_file(stored)
        except LogError as exc:
            commands_log.discard_snapshot_file(stored)
            _snapshot_failed(exc)
            return 0
        if not commands_log.checkpoints_in_background:
            # No background checkpointer: fold the WAL in here (it also removes them).
            commands_log.checkpoint()
        seq, size = stored.seq, stored.size
        self._since_snapshot = max(self._since_snapshot - covered, 0)
        stats = self.stats
        stats.num_snapshots += 1
        now = time.perf_counter()
        stats.last_snapshot_seconds = now - started
        stats.last_snapshot_loop_seconds = on_loop + (now - registering)
        stats.last_snapshot_bytes = size
        log.info(
            "snapshot after record %d: %d bytes in %.3fs (%.3fs of it on the event loop)",
            seq,
            size,
            stats.last_snapshot_seconds,
            stats.last_snapshot_loop_seconds,
        )
        return seq

    def maybe_snapshot(self, state: ServiceState) -> int:
        return self.snapshot(state) if self.snapshot_due else 0

    # -- closing ---------------------------------------------------------------------------
    def close(self, state: ServiceState | None = None) -> None:
        """Snapshot ``state`` if records were added since the last one (a graceful stop
        makes the next start-up replay nothing), checkpoint, close, unlock."""
        if self._log is not None:
            # No background checkpoint under way to make the final one report busy.
            self._log.stop_background_checkpoints()
            if state is not None and self._since_snapshot and not self.failure:
                self.snapshot(state)
            self._log.checkpoint()  # also removes the retired snapshot files
            self._log.close()
            self._log = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # closing the fd releases the flock
            self._lock_fd = None

    def _require_log(self) -> CommandLog:
        if self._log is None:
            raise DurabilityError("the data directory is not open")
        return self._log


__all__ = [
    "Durability",
    "DurabilityError",
    "DurabilityLevel",
    "DurabilityStats",
    "RecoveryReport",
]
