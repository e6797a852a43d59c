"""Restart = snapshot + replay = the same state, page for page (in-process).

Every test compares a recovered state with a twin that never crashed, fed the same
commands: the state digest (pages, free-queue order and layout, index with duplicates,
tables, tokens, hashes, counters, clients, leases, stored step answers, events) must be
equal, and so must every answer to the next commands (the next allocations).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import sqlite3
import stat
import time

import numpy as np
import pytest

from pagekeeper.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    InvariantViolation,
    PagekeeperError,
    Unavailable,
)
from pagekeeper.durability import Durability, DurabilityError, state_digest
from pagekeeper.durability.commands import encode_command
from pagekeeper.durability.log import (
    DB_NAME,
    SNAPSHOT_DIR,
    CommandLog,
    DurabilityLevel,
    record_crc,
)
from pagekeeper.durability.snapshot import digest_tree
from pagekeeper.state import (
    Admission,
    Batch,
    ClientRole,
    ConfigureLimitsCommand,
    RegisterCommand,
    ServiceState,
    StepCommand,
)
from tests.reliability import journal_files
from tests.reliability.twins import (
    CountingJournal,
    assert_same_future,
    crash,
    recover,
    twin_at,
)
from tests.reliability.workload import FULL_POOL, HYBRID_POOL, LIMITS, Workload, new_state, tokens

POOLS = {"full": FULL_POOL, "hybrid": HYBRID_POOL}


def _drive(state: ServiceState, workload: Workload, n: int, durability: Durability | None = None):
    for _ in range(n):
        workload.run_one(state)
        if durability is not None:
            durability.maybe_snapshot(state)


@pytest.mark.parametrize("pool_name", sorted(POOLS))
def test_snapshot_restore_is_exact(pool_name):
    pool = POOLS[pool_name]
    live, workload = new_state(pool), Workload(11, pool)
    _drive(live, workload, 700)
    restored = new_state(pool)
    restored.restore_state(live.snapshot_state())
    restored.check_invariants()
    assert state_digest(restored) == state_digest(live)
    assert restored.manager.pool.free_queue() == live.manager.pool.free_queue()
    for rid in live.request_ids():
        for g in range(len(pool.groups)):
            assert (
                restored.manager.page_table(rid, g).tolist()
                == live.manager.page_table(rid, g).tolist()
            )
    assert_same_future(live, restored, workload, 200)
    assert state_digest(restored) == state_digest(live)


def _as_version_1(state: ServiceState) -> dict:
    """``state``'s snapshot as version 1 wrote it: with its own list of every request's
    owner and counts (the core's tree holds them; version 2 leaves the list out)."""
    tree = copy.deepcopy(state.snapshot_state())
    infos = [state.request_info(rid) for rid in state.request_ids()]
    tree["version"] = 1
    tree["requests"] = {
        "request_ids": [i.request_id for i in infos],
        "owners": [i.owner for i in infos],
        "num_tokens": [i.num_tokens for i in infos],
        "num_computed_tokens": [i.num_computed_tokens for i in infos],
    }
    return tree


def test_a_version_1_snapshot_restores_and_its_request_list_is_checked():
    live, workload = new_state(FULL_POOL), Workload(5, FULL_POOL)
    _drive(live, workload, 300)
    assert live.request_ids(), "the workload leaves requests running"
    old = _as_version_1(live)
    restored = new_state(FULL_POOL)
    restored.restore_state(copy.deepcopy(old))
    restored.check_invariants()
    assert state_digest(restored) == state_digest(live)
    # A list that disagrees with the core's tree is a damaged snapshot: refused.
    old["requests"]["num_computed_tokens"][0] += 1
    with pytest.raises(InvalidArgument, match="disagrees with the core"):
        new_state(FULL_POOL).restore_state(old)
    old["version"] = 3
    with pytest.raises(InvalidArgument, match="version 3"):
        new_state(FULL_POOL).restore_state(old)


def test_invariants_catch_a_client_set_out_of_step_with_the_core():
    live, workload = new_state(FULL_POOL), Workload(5, FULL_POOL)
    _drive(live, workload, 300)
    live.check_invariants()
    client = next(c for c in live._clients.values() if c.request_ids)
    rid = sorted(client.request_ids)[0]
    client.request_ids.discard(rid)
    with pytest.raises(InvariantViolation, match="missing from its owner's set"):
        live.check_invariants()
    client.request_ids.update((rid, "ghost"))
    with pytest.raises(InvariantViolation, match="'ghost', which is not running"):
        live.check_invariants()


def test_workload_exercises_what_recovery_must_keep():
    """The comparisons above mean something only if the workload reaches the hard cases."""
    live, workload = new_state(FULL_POOL), Workload(11, FULL_POOL)
    seen: set[str] = set()
    for _ in range(1500):
        revoked_before = {c.client_id: set(c.revoked) for c in live.clients()}
        command, result = workload.run_one(live)
        name = type(command).__name__
        if isinstance(result, Exception):
            seen.add(f"{name}:{type(result).__name__}")
            continue
        seen.add(name)
        if name == "StepCommand":
            if result.is_retry:
                seen.add("retry")
            if result.revoked_request_ids:
                seen.add("revoked")  # grown or listed by its owner after a force-free
            if set(command.frees) & revoked_before.get(command.client_id, set()):
                seen.add("revoked_freed")  # and its free accepted as done
            for outcome in result.results:
                seen.add(outcome.status.value)
                if outcome.num_cached_tokens:
                    seen.add("cache_hit")
    stats = live.stats()
    assert stats.num_evictions > 0 and stats.num_no_capacity > 0
    assert any(live.manager.pool._dups[0].values()) or stats.num_evictions > 0
    for needed in (
        "RegisterCommand",
        "HeartbeatCommand",
        "UnregisterCommand",
        "ForceFreeCommand",
        "ExpireLeasesCommand",
        "ConfigureLimitsCommand",
        "ResetPrefixCacheCommand",
        "retry",
        "revoked",
        "revoked_freed",
        "no_capacity",
        "cache_hit",
    ):
        assert needed in seen, (needed, sorted(seen))


@pytest.mark.parametrize("pool_name", sorted(POOLS))
def test_crash_at_random_points_recovers_the_twin(tmp_path, pool_name):
    """Crash (no snapshot, no close) at random points, several times on one data dir, with
    snapshots in between: the recovered state is the never-crashed one's, and both make
    the same next allocations."""
    pool = POOLS[pool_name]
    rng = np.random.default_rng(5)
    live, workload = new_state(pool), Workload(21, pool)
    durability = Durability.open(tmp_path, "process", snapshot_every=150)
    durability.recover(live)
    durability.attach(live)
    for _ in range(4):
        _drive(live, workload, int(rng.integers(50, 400)), durability)
        live.journal = None
        crash(durability)
        recovered, durability = recover(tmp_path, pool, snapshot_every=150)
        assert durability.report is not None and durability.report.damage == ""
        assert state_digest(recovered) == state_digest(live)
        durability.attach(recovered)
        # The recovered state journals from here on; the twin keeps going beside it.
        assert_same_future(live, recovered, workload, 40)
        assert state_digest(recovered) == state_digest(live)
        live = recovered
    durability.close(live)
    # A graceful close snapshots: the next start-up replays nothing.
    again, durability = recover(tmp_path, pool)
    assert durability.report.num_replayed == 0
    assert state_digest(again) == state_digest(live)
    durability.close()


def _write_log(tmp_path, seed, n, snapshot_every=10_000):
    state, workload = new_state(), Workload(seed)
    durability = Durability.open(tmp_path, "process", snapshot_every=snapshot_every)
    durability.recover(state)
    durability.attach(state)
    _drive(state, workload, n, durability)
    last = durability.last_seq
    state.journal = None
    crash(durability)
    return last


@pytest.mark.parametrize("damage", ["body", "crc", "gap", "undecodable", "torn", "seq"])
def test_damaged_record_ends_the_valid_prefix(tmp_path, damage, caplog):
    """A damaged record (flipped bytes, bad CRC, a missing record, a known kind whose body
    does not decode) is detected, reported (log line + metric), dropped with everything
    after it, and the state is the twin's just before it; the log then continues from
    there."""
    last = _write_log(tmp_path, 31, 300)
    bad = last - 25
    ((_, crc, body),) = [r for r in journal_files.records(tmp_path) if r[0] == bad]
    if damage == "body":
        flipped = bytearray(body)
        flipped[len(body) // 2] ^= 0x5A
        journal_files.edit_record(tmp_path, bad, body=bytes(flipped))
    elif damage == "crc":
        journal_files.edit_record(tmp_path, bad, crc=(crc + 1) & 0xFFFFFFFF)
    elif damage == "gap":
        journal_files.edit_record(tmp_path, bad, drop=True)
    elif damage == "seq":
        # Its seq field reads as an earlier record's: a gap at ``bad``, and the record
        # itself must go with the tail (left in place, the next start would find the same
        # gap and drop the records appended after this recovery).
        journal_files.edit_record(tmp_path, bad, new_seq=bad - 10)
    elif damage == "torn":
        journal_files.cut_inside(tmp_path, bad)  # the rest of its segment goes with it
    else:
        garbage = bytes(body[:2]) + b"\x99garbage"  # its own kind and version
        journal_files.edit_record(tmp_path, bad, body=garbage, crc=record_crc(bad, garbage))
    with caplog.at_level("ERROR", logger="pagekeeper.durability"):
        recovered, durability = recover(tmp_path)
    report = durability.report
    assert report.last_seq == bad - 1 and report.damage
    assert report.num_dropped == {"gap": 25, "torn": 1}.get(damage, 26)
    if damage == "torn":
        assert "cut short" in report.damage
    assert any("damaged" in r.message for r in caplog.records)
    twin, workload = twin_at(31, bad - 1)
    assert state_digest(recovered) == state_digest(twin)
    durability.attach(recovered)
    assert_same_future(twin, recovered, workload, 30)
    recovered.journal = None
    crash(durability)
    again, durability = recover(tmp_path)
    assert durability.report.damage == "" and state_digest(again) == state_digest(recovered)
    durability.close()


@pytest.mark.parametrize("change", ["kind", "version"])
def test_a_newer_pagekeepers_record_is_refused_not_dropped(tmp_path, change):
    """A whole, CRC-valid record of a kind or version this pagekeeper does not know is a
    newer pagekeeper's, not damage: start-up fails with one line naming it and the journal
    is left as it was (dropping it would lose it and every later acknowledged step)."""
    last = _write_log(tmp_path, 33, 120)
    bad = last - 10
    ((_, _, body),) = [r for r in journal_files.records(tmp_path) if r[0] == bad]
    newer = bytearray(body)
    if change == "kind":
        newer[0] = 0xEE
    else:
        newer[1] = 0x7F
    journal_files.edit_record(tmp_path, bad, body=bytes(newer), crc=record_crc(bad, bytes(newer)))
    before = journal_files.records(tmp_path)
    for _ in range(2):  # refused again the next time: nothing was dropped
        with pytest.raises(DurabilityError, match=f"record {bad} .* newer pagekeeper") as info:
            recover(tmp_path)
        assert "\n" not in str(info.value)
        assert journal_files.records(tmp_path) == before


def _format_of(data_dir) -> str:
    db = sqlite3.connect(data_dir / DB_NAME)
    try:
        return db.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()[0]
    finally:
        db.close()


@pytest.mark.parametrize("snapshot_every", [1_000, 25], ids=["replayed", "snapshotted"])
def test_a_worker_with_an_empty_kv_cache_forgets_the_prefix_cache_and_replays_alike(
    tmp_path, snapshot_every
):
    """A worker registering with ``fresh_kv_cache`` empties the prefix cache and revokes
    the running requests; the record replays to the same state (hashes, free queue,
    counters, revocations) after a crash, as do snapshots taken across it, and is a version
    an older pagekeeper refuses rather than replaying it as a plain registration (which
    would keep the cache and diverge from every later step)."""
    state, workload = new_state(), Workload(36)
    # 1,000: the registration's record is replayed; 25: snapshots before and after it.
    durability = Durability.open(tmp_path, "process", snapshot_every=snapshot_every)
    durability.recover(state)
    durability.attach(state)
    _drive(state, workload, 60, durability)
    assert state.manager.pool.num_cached_pages > 0 and state.manager.requests
    fresh = RegisterCommand(now=1e6, role=ClientRole.WORKER, name="w", fresh_kv_cache=True)
    running = len(state.manager.requests)
    state.apply(fresh)
    assert state.manager.pool.num_cached_pages == 0 and not state.manager.requests
    assert state.counters.num_prefix_cache_forgets == 1
    assert state.counters.num_kv_loss_revocations == running
    _drive(state, workload, 40, durability)
    digest = state_digest(state)
    state.journal = None
    crash(durability)
    again, durability = recover(tmp_path)
    assert state_digest(again) == digest
    assert again.counters.num_prefix_cache_forgets == 1
    assert again.counters.num_kv_loss_revocations == running
    durability.close(again)
    record = encode_command(fresh)
    assert record[1] == 2  # a version of its own
    with pytest.raises(InvalidArgument, match="only workers"):
        new_state().apply(RegisterCommand(now=1.0, role=ClientRole.SCHEDULER, fresh_kv_cache=True))


def test_a_certificate_identity_stamps_format_4_which_older_readers_refuse(tmp_path):
    """Records and snapshots of a pool without client certificates keep format 3 (an
    older pagekeeper still reads the dir); the first registration bound to a certificate
    stamps format 4 before it is written, and the dir stays 4 through snapshots and
    restarts. This pagekeeper reads 4; one that reads 1-3 refuses the dir at start."""
    state, workload = new_state(), Workload(35)
    durability = Durability.open(tmp_path, "process", snapshot_every=40)
    durability.recover(state)
    durability.attach(state)
    _drive(state, workload, 60, durability)
    assert _format_of(tmp_path) == "3"
    bound = RegisterCommand(now=1e6, role=ClientRole.WORKER, name="w", identity="worker-7")
    client = state.apply(bound)
    assert _format_of(tmp_path) == "4"
    _drive(state, workload, 60, durability)  # snapshots in between keep it
    assert durability.latest_snapshot_seq > 0 and _format_of(tmp_path) == "4"
    digest = state_digest(state)
    state.journal = None
    crash(durability)
    again, durability = recover(tmp_path)
    assert state_digest(again) == digest
    assert again.identity_of(client.client_id) == "worker-7"
    durability.close(again)
    assert _format_of(tmp_path) == "4"

    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("UPDATE meta SET value = '6' WHERE key = 'format_version'")
    db.commit()
    db.close()
    with pytest.raises(DurabilityError, match="has format 6; this pagekeeper reads 1, 2, 3, 4, 5"):
        Durability.open(tmp_path, "process")


def _to_format_1(data_dir) -> None:
    """Rewrite a data dir as format 1 kept it: the records in table ``log``, the
    snapshot's body inline in the ``snapshots`` table, no snapshot files."""
    journal_files.to_format_2(data_dir)
    db = sqlite3.connect(data_dir / DB_NAME)
    seq, crc, name = db.execute("SELECT seq, crc, name FROM snapshot_files").fetchone()
    path = data_dir / SNAPSHOT_DIR / name
    body = path.read_bytes()[28:]  # after the file's header
    db.execute("INSERT INTO snapshots (seq, crc, body) VALUES (?, ?, ?)", (seq, crc, body))
    db.execute("DELETE FROM snapshot_files")
    db.execute("UPDATE meta SET value = '1' WHERE key = 'format_version'")
    db.commit()
    db.close()
    path.unlink()


@pytest.mark.parametrize(
    ("form", "damage"),
    [
        ("file", "crc"),
        ("file", "bytes"),
        ("file", "missing"),
        ("file", "short"),
        ("inline", "crc"),
        ("inline", "bytes"),
    ],
)
def test_unreadable_snapshot_fails_loudly(tmp_path, form, damage):
    _write_log(tmp_path, 41, 120, snapshot_every=50)
    if form == "inline":
        _to_format_1(tmp_path)
    db = sqlite3.connect(tmp_path / DB_NAME)
    table = "snapshots" if form == "inline" else "snapshot_files"
    (seq,) = db.execute(f"SELECT seq FROM {table}").fetchone()
    body = b"PKSNAP\x01\x00" + b"\x99" * 40  # a valid CRC over bytes that do not decode
    if damage == "crc":
        db.execute(f"UPDATE {table} SET crc = crc + 1")
    elif form == "inline":
        db.execute("UPDATE snapshots SET body = ?, crc = ?", (body, record_crc(seq, body)))
    else:
        (name,) = db.execute("SELECT name FROM snapshot_files").fetchone()
        path = tmp_path / SNAPSHOT_DIR / name
        if damage == "missing":
            path.unlink()
        elif damage == "short":
            path.write_bytes(path.read_bytes()[:-1])
        else:
            path.unlink()  # a whole file, its header right, its body not a snapshot
            log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
            stored = log.store_snapshot_file(seq, body)
            log.close()
            db.execute(
                "UPDATE snapshot_files SET crc = ?, size = ?, name = ?",
                (stored.crc, stored.size, stored.name),
            )
    db.commit()
    db.close()
    with pytest.raises(DurabilityError, match="unreadable snapshot") as info:
        recover(tmp_path)
    assert "\n" not in str(info.value)


def test_a_format_1_data_dir_recovers_and_moves_on_to_snapshot_files(tmp_path):
    """A data dir written before snapshot files (its snapshot inline) recovers the same
    state; the next snapshot goes to a file and the inline one is dropped."""
    last = _write_log(tmp_path, 43, 160, snapshot_every=50)
    state, durability = recover(tmp_path)
    digest = state_digest(state)
    durability.close()
    _to_format_1(tmp_path)
    state, durability = recover(tmp_path)
    assert state_digest(state) == digest and durability.last_seq == last
    durability.close(state)  # a graceful stop snapshots: to a file
    db = sqlite3.connect(tmp_path / DB_NAME)
    assert db.execute("SELECT COUNT(*) FROM snapshots").fetchone() == (0,)
    assert db.execute("SELECT seq FROM snapshot_files").fetchall() == [(last,)]
    assert db.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone() == ("3",)
    db.close()
    again, durability = recover(tmp_path)
    assert state_digest(again) == digest and durability.report.num_replayed == 0
    durability.close()


def test_a_format_2_data_dir_recovers_and_moves_on_to_journal_segments(tmp_path):
    """A data dir written before journal segments (its records in table ``log``)
    recovers the same state; later records go to a segment, the format becomes 3, and a
    restart reads both: the old rows, then the segment; a snapshot covers the rows."""
    last = _write_log(tmp_path, 45, 160, snapshot_every=50)
    state, durability = recover(tmp_path)
    digest, replayed = state_digest(state), durability.report.num_replayed
    durability.close()
    journal_files.to_format_2(tmp_path)
    assert journal_files.segment_paths(tmp_path) == []
    state, durability = recover(tmp_path)
    assert state_digest(state) == digest and durability.last_seq == last
    assert durability.report.num_replayed == replayed > 0
    _, workload = twin_at(45, last)
    durability.attach(state)
    _drive(state, workload, 20, durability)
    added = durability.last_seq
    assert added > last
    assert state_digest(state) == state_digest(twin_at(45, added)[0])
    assert [r[0] for r in journal_files.records(tmp_path)] == list(range(last + 1, added + 1))
    db = sqlite3.connect(tmp_path / DB_NAME)
    assert db.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone() == ("3",)
    assert db.execute("SELECT MAX(seq) FROM log").fetchone() == (last,)
    db.close()
    live = state_digest(state)
    state.journal = None
    crash(durability)
    again, durability = recover(tmp_path)
    assert state_digest(again) == live and durability.last_seq == added
    durability.close(again)  # snapshots; the thread deletes the covered rows meanwhile
    third, durability = recover(tmp_path)
    assert state_digest(third) == live and durability.report.num_replayed == 0
    durability.close()


def test_snapshot_files_left_unregistered_are_removed_at_start(tmp_path):
    """A stop between writing a snapshot file and registering it leaves a file no row
    names (and maybe a partial one): the next start removes both, and recovery uses the
    registered snapshot and the records, which were all kept."""
    last = _write_log(tmp_path, 47, 130, snapshot_every=50)
    db = sqlite3.connect(tmp_path / DB_NAME)
    registered = [str(row[0]) for row in db.execute("SELECT name FROM snapshot_files")]
    db.close()
    assert len(registered) == 1
    # The crash may also have come before a checkpoint let the replaced file go.
    assert set(registered) <= {p.name for p in (tmp_path / SNAPSHOT_DIR).iterdir()}
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    orphan = log.store_snapshot_file(last, b"not registered")
    log.close()
    partial = tmp_path / SNAPSHOT_DIR / orphan.name.replace(".pks", ".tmp")
    partial.write_bytes(b"half a snapshot")
    unrelated = tmp_path / SNAPSHOT_DIR / "notes.txt"
    unrelated.write_text("not ours")
    _, durability = recover(tmp_path)
    assert durability.last_seq == last and durability.report.num_replayed > 0
    left = sorted(p.name for p in (tmp_path / SNAPSHOT_DIR).iterdir())
    assert left == sorted([*registered, "notes.txt"])
    durability.close()


def _only_file_left(files, timeout: float = 20.0):
    """The one snapshot file left once the background checkpointer has synced the latest
    registration and removed the files it replaced (it runs after the snapshot returns)."""
    deadline = time.monotonic() + timeout
    while len(left := list(files.iterdir())) != 1:
        assert time.monotonic() < deadline, f"still {sorted(p.name for p in left)}"
        time.sleep(0.005)
    return left[0]


def _settled(durability: Durability, timeout: float = 20.0) -> None:
    """Wait until the checkpoint thread has deleted the records the latest snapshot covers
    and then completed a checkpoint: the database file alone holds every commit so far, and
    the thread has nothing left to write (a power-loss image taken after a reader holds
    back later checkpoints is then the database file as it is)."""
    log = durability._log
    stats = durability.checkpoint_stats
    assert log is not None and stats is not None and log._checkpointer is not None
    upto = log.latest_snapshot_seq()
    deadline = time.monotonic() + timeout
    while (low := log._db.execute("SELECT MIN(seq) FROM log").fetchone()[0]) is not None and (
        low <= upto
    ):
        assert time.monotonic() < deadline, "covered records still there"
        time.sleep(0.005)
    done = stats.num_checkpoints
    log._checkpointer.dirty = True
    log._checkpointer.wake()
    while stats.num_checkpoints == done:
        assert time.monotonic() < deadline, "no checkpoint after the deletions"
        time.sleep(0.005)


def test_an_older_snapshot_file_stays_until_a_checkpoint_syncs_its_replacement(tmp_path):
    """Registering a snapshot commits to the WAL, which a power loss may still take back
    until a checkpoint has synced it; the older file the registration replaced must stay
    until then, or a power loss leaves a database naming a deleted file. Here a reader
    (an operator's ``sqlite3`` shell) holds back every checkpoint: the older file stays,
    the power-loss image (the database file alone: no WAL frame was synced) recovers the
    older snapshot's state exactly, and the first checkpoint that completes removes it.
    The service's background checkpointer does the checkpoints; the snapshot never waits
    for one."""
    live, workload = new_state(FULL_POOL), Workload(43, FULL_POOL)
    durability = Durability.open(tmp_path, "process", snapshot_every=10_000)
    durability.recover(live)
    durability.attach(live)
    files = tmp_path / SNAPSHOT_DIR
    _drive(live, workload, 50)
    durability.snapshot(live)
    _drive(live, workload, 10)
    first_seq, first_digest = durability.snapshot(live), state_digest(live)
    # The first file went once a checkpoint synced the second registration.
    first = _only_file_left(files)
    _settled(durability)
    assert first.name.startswith(f"snapshot-{first_seq:020d}-")
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM log").fetchone()
    _drive(live, workload, 40)
    second_seq = durability.snapshot(live)
    assert second_seq > first_seq
    assert durability.stats.num_snapshots == 3
    stats = durability.checkpoint_stats
    assert stats is not None
    deadline = time.monotonic() + 20
    while stats.num_incomplete == 0:  # the thread tried, and the reader held it back
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert first.exists() and len(list(files.iterdir())) == 2

    image = tmp_path / "power-loss"
    image.mkdir()
    (image / DB_NAME).write_bytes((tmp_path / DB_NAME).read_bytes())
    (image / SNAPSHOT_DIR).mkdir()
    for path in files.iterdir():
        (image / SNAPSHOT_DIR / path.name).write_bytes(path.read_bytes())
    again, recovered = recover(image)
    assert recovered.report.snapshot_seq == first_seq == recovered.last_seq
    assert state_digest(again) == first_digest
    assert [p.name for p in (image / SNAPSHOT_DIR).iterdir()] == [first.name]  # orphan gone
    recovered.close()

    reader.execute("COMMIT")
    reader.close()
    _drive(live, workload, 20)
    third_seq = durability.snapshot(live)
    only = _only_file_left(files)
    assert only.name.startswith(f"snapshot-{third_seq:020d}-")
    durability.close()


def test_without_the_checkpointer_the_snapshot_checkpoints_and_removes_the_older_file(
    tmp_path,
):
    """With the background checkpointer stopped (the appending connection checkpoints
    itself), a snapshot folds the WAL in at once and the file it replaced is gone when it
    returns; a reader in the way keeps it until the next checkpoint that completes."""
    live, workload = new_state(FULL_POOL), Workload(44, FULL_POOL)
    durability = Durability.open(tmp_path, "process", snapshot_every=10_000)
    durability.recover(live)
    durability.attach(live)
    durability._require_log().stop_background_checkpoints()
    files = tmp_path / SNAPSHOT_DIR
    _drive(live, workload, 30)
    durability.snapshot(live)
    _drive(live, workload, 30)
    seq = durability.snapshot(live)
    (only,) = files.iterdir()
    assert only.name.startswith(f"snapshot-{seq:020d}-")
    assert (tmp_path / f"{DB_NAME}-wal").stat().st_size == 0  # truncated
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM log").fetchone()
    _drive(live, workload, 30)
    durability.snapshot(live)
    assert len(list(files.iterdir())) == 2
    reader.execute("COMMIT")
    reader.close()
    durability.close()  # its final checkpoint completes and removes the older file
    (only,) = files.iterdir()
    assert only.name.startswith(f"snapshot-{durability.last_seq:020d}-")


def test_a_checkpoint_behind_a_reader_reports_busy_without_waiting(tmp_path):
    """A reader in the way makes the checkpoint report busy at once (the busy timeout
    would hold the event loop for seconds) and leaves that timeout as it was."""
    log = CommandLog(tmp_path, DurabilityLevel.PROCESS)
    log.set_meta("touched", "1")
    assert log.checkpoint()
    reader = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM meta").fetchone()
    log.set_meta("touched", "2")  # a commit the reader holds in the WAL
    started = time.monotonic()
    assert not log.checkpoint()
    # Well under the 5 s busy timeout: it did not wait for the reader.
    assert time.monotonic() - started < 2.5
    assert log._db.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    reader.execute("COMMIT")
    reader.close()
    assert log.checkpoint()
    assert (tmp_path / f"{DB_NAME}-wal").stat().st_size == 0
    log.close()


def test_the_data_dir_is_owner_only_and_an_open_one_is_reported(tmp_path, caplog):
    """The journal and snapshots hold the running requests' token ids: a data dir made
    here is 0700 with its subdirectories, journal segments and snapshot files 0600; one
    that already exists keeps its mode, and a start logs a warning when other users can
    open it."""
    data = tmp_path / "nested" / "data"
    with caplog.at_level("WARNING", logger="pagekeeper.durability"):
        _write_log(data, 47, 120, snapshot_every=50)
    assert not [r for r in caplog.records if "open to other users" in r.message]
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for sub in (data / "journal", data / SNAPSHOT_DIR):
        assert stat.S_IMODE(sub.stat().st_mode) == 0o700, sub
        files = list(sub.iterdir())
        assert files, sub
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

    data.chmod(0o755)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagekeeper.durability"):
        state, durability = recover(data)
    durability.close(state)
    (warning,) = [r.message for r in caplog.records if "open to other users" in r.message]
    assert "mode 0755" in warning and str(data) in warning
    assert stat.S_IMODE(data.stat().st_mode) == 0o755  # an operator's choice: left alone


def test_another_pool_or_a_second_instance_is_refused(tmp_path):
    _write_log(tmp_path, 1, 20)
    other = dataclasses.replace(FULL_POOL, num_pages=FULL_POOL.num_pages + 1)
    with pytest.raises(DurabilityError, match="another pool configuration"):
        recover(tmp_path, other)
    first, durability = recover(tmp_path)
    with pytest.raises(DurabilityError, match="in use by another pagekeeper"):
        Durability.open(tmp_path, "process")
    durability.close(first)


def test_retry_after_restart_returns_the_stored_answer(tmp_path):
    """The step-response cache is durable: a step retried after a restart (even by a
    re-registered client, new generation) gets the first answer, publication included, and
    changes nothing."""

    class Sink:
        def configure(self, tables):
            return None

        def descriptor(self):
            return None

        def publish(self, step_seq, tables):
            return step_seq % 3

    state = ServiceState(FULL_POOL, LIMITS, sink=Sink())
    durability = Durability.open(tmp_path, "fsync")
    durability.recover(state)
    durability.attach(state)
    sched = state.register(RegisterCommand(now=1.0, role=ClientRole.SCHEDULER))
    state.register(RegisterCommand(now=1.0, role=ClientRole.WORKER))
    step = StepCommand(
        2.0,
        sched.client_id,
        sched.generation,
        7,
        admissions=(Admission("a", tokens(0, 50)), Admission("b", tokens(0, 40))),
        batch=Batch(("a", "b")),
    )
    first = state.step(step)
    assert first.is_published and first.published_slot == 7 % 3
    state.journal = None
    crash(durability)

    recovered, durability = recover(tmp_path)
    before = state_digest(recovered)
    takeover = recovered.register(
        RegisterCommand(now=3.0, role=ClientRole.SCHEDULER, client_id=sched.client_id)
    )
    after_register = state_digest(recovered)
    assert before != after_register  # the generation moved on
    retry = recovered.step(dataclasses.replace(step, now=3.5, generation=takeover.generation))
    assert retry.is_retry and dataclasses.replace(retry, is_retry=False) == first
    assert recovered.manager.request_info("a").page_ids == state.manager.request_info("a").page_ids
    durability.close(recovered)


def test_changed_limits_replay_under_the_old_ones(tmp_path):
    """Limits decide how commands apply (a default lease, a grace); records are replayed
    under the limits they were applied under, and a change is a logged command."""
    short = dataclasses.replace(LIMITS, lease_ttl_s=2.0)
    state = ServiceState(FULL_POOL, short)
    durability = Durability.open(tmp_path, "process")
    durability.recover(state)
    durability.attach(state)
    a = state.register(RegisterCommand(now=10.0, role=ClientRole.SCHEDULER))
    assert a.lease_ttl_s == 2.0
    state.journal = None
    crash(durability)

    # Restarted with longer leases: the first registration keeps its 2 s lease.
    longer = dataclasses.replace(LIMITS, lease_ttl_s=30.0)
    recovered = ServiceState(FULL_POOL, longer)
    durability = Durability.open(tmp_path, "process")
    durability.recover(recovered)
    assert recovered.client(a.client_id).expires_at == 12.0
    durability.attach(recovered)
    recovered.configure_limits(ConfigureLimitsCommand(20.0, longer))
    b = recovered.register(RegisterCommand(now=20.0, role=ClientRole.SCHEDULER))
    assert b.lease_ttl_s == 30.0
    recovered.journal = None
    crash(durability)
    again, durability = recover(tmp_path)
    assert state_digest(again) == state_digest(recovered)
    assert again.limits == longer
    durability.close()


def test_a_failed_write_fences_the_state(tmp_path):
    """A change that could not be made durable is not acknowledged, and nothing else is
    accepted: the process must restart and recover the last durable state."""
    failures: list[str] = []
    state = new_state()
    durability = Durability.open(tmp_path, "process", on_failure=failures.append)
    durability.recover(state)
    durability.attach(state)
    sched = state.register(RegisterCommand(now=1.0, role=ClientRole.SCHEDULER))
    journal_files.lose_the_disk(durability._log)
    lost = StepCommand(2.0, sched.client_id, 1, 1, admissions=(Admission("x", tokens(0, 20)),))
    with pytest.raises(PagekeeperError, match="could not be made durable"):
        state.step(lost)
    assert failures and state.fenced_reason
    # Its retry is not answered from memory: that answer never reached the journal. The
    # refusal is UNAVAILABLE, on which a client keeps the step for the restarted service.
    with pytest.raises(Unavailable, match="cannot confirm step 1"):
        state.step(lost)
    with pytest.raises(FailedPrecondition, match="refuses changes"):
        state.register(RegisterCommand(now=3.0, role=ClientRole.SCHEDULER))
    durability._log = None
    crash(durability)
    recovered, durability = recover(tmp_path)
    assert recovered.request_ids() == [] and len(recovered.clients()) == 1
    durability.close()


def test_every_mutation_is_journaled():
    """Each applied command reaches the journal exactly once, with its result; refused
    ones never do."""
    state, workload = new_state(), Workload(3)
    journal = CountingJournal()
    state.journal = journal
    applied = 0
    for _ in range(600):
        before = journal.num_records
        _command, result = workload.run_one(state)
        if isinstance(result, Exception):
            assert journal.num_records == before
        else:
            applied += journal.num_records - before
            # Everything but an expiry or resume with nothing to do is a change.
            assert journal.num_records - before in (0, 1)
    assert applied > 500


def test_a_background_snapshot_covers_its_records_and_keeps_the_later_ones(tmp_path):
    """The server's periodic snapshot encodes in a worker thread while calls go on: it is
    the state as of the record it was taken after, the records appended meanwhile stay in
    the log, and a crash right after recovers the live state (snapshot + those records)."""
    live, workload = new_state(FULL_POOL), Workload(33, FULL_POOL)
    durability = Durability.open(tmp_path, "process", snapshot_every=10_000)
    durability.recover(live)
    durability.attach(live)
    _drive(live, workload, 200)
    taken_after = durability.last_seq
    at_capture = state_digest(live)

    async def snapshot_while_stepping() -> int:
        task = asyncio.create_task(durability.snapshot_in_background(live))
        await asyncio.sleep(0)  # the task takes the tree, then awaits its encoding
        _drive(live, workload, 100)  # calls go on meanwhile
        return await task

    assert asyncio.run(snapshot_while_stepping()) == taken_after
    later = durability.last_seq - taken_after
    assert later >= 100 and durability.num_records_since_snapshot == later
    stats = durability.stats
    assert stats.num_snapshots == 1
    assert 0 < stats.last_snapshot_loop_seconds <= stats.last_snapshot_seconds
    live.journal = None
    crash(durability)
    recovered, durability = recover(tmp_path, FULL_POOL)
    assert durability.report is not None and durability.report.num_replayed == later
    assert state_digest(recovered) == state_digest(live) != at_capture
    durability.close()


def test_background_snapshots_keep_one_file_and_leave_none_when_dropped(tmp_path):
    """Each registered snapshot replaces the previous one's file; a background snapshot
    whose log closed while its file was being written removes that file (nothing
    registers it) and reports 0."""
    live, workload = new_state(FULL_POOL), Workload(35, FULL_POOL)
    durability = Durability.open(tmp_path, "process", snapshot_every=10_000)
    durability.recover(live)
    durability.attach(live)
    files = tmp_path / SNAPSHOT_DIR
    for _ in range(3):
        _drive(live, workload, 60)
        assert asyncio.run(durability.snapshot_in_background(live)) == durability.last_seq
        only = _only_file_left(files)
        assert only.name.startswith(f"snapshot-{durability.last_seq:020d}-")
    kept = sorted(p.name for p in files.iterdir())
    _drive(live, workload, 30)

    async def close_while_writing() -> int:
        task = asyncio.create_task(durability.snapshot_in_background(live))
        await asyncio.sleep(0)  # the tree is taken; the file is written in a thread
        live.journal = None
        durability.close()
        return await task

    assert asyncio.run(close_while_writing()) == 0
    assert sorted(p.name for p in files.iterdir()) == kept


def test_a_stop_while_a_background_snapshot_of_the_same_record_is_written(tmp_path):
    """The graceful stop snapshots the record a periodic snapshot (still being written)
    was taken after: each has its own file; the stop's is registered, the other removed,
    and the next start replays nothing."""
    live, workload = new_state(FULL_POOL), Workload(37, FULL_POOL)
    durability = Durability.open(tmp_path, "process", snapshot_every=10_000)
    durability.recover(live)
    durability.attach(live)
    _drive(live, workload, 80)
    digest = state_digest(live)

    async def stop_meanwhile() -> int:
        task = asyncio.create_task(durability.snapshot_in_background(live))
        await asyncio.sleep(0)
        live.journal = None
        durability.close(live)  # snapshots the same record first
        return await task

    assert asyncio.run(stop_meanwhile()) == 0
    assert len(list((tmp_path / SNAPSHOT_DIR).iterdir())) == 1
    again, durability = recover(tmp_path)
    assert durability.report.num_replayed == 0 and state_digest(again) == digest
    durability.close()


def test_a_snapshot_that_cannot_be_written_keeps_every_record(tmp_path, caplog):
    """A snapshot file that cannot be written (here: ``snapshots`` is a file, not a
    directory) is reported and skipped, in the background or not; the records stay and a
    restart replays them all."""
    live, workload = new_state(FULL_POOL), Workload(39, FULL_POOL)
    durability = Durability.open(tmp_path, "process", snapshot_every=10_000)
    durability.recover(live)
    durability.attach(live)
    _drive(live, workload, 50)
    (tmp_path / SNAPSHOT_DIR).write_text("in the way")
    assert durability.snapshot(live) == 0
    assert asyncio.run(durability.snapshot_in_background(live)) == 0
    assert "snapshot failed (the log keeps every record)" in caplog.text
    assert durability.stats.num_snapshots == 0
    last, digest = durability.last_seq, state_digest(live)
    live.journal = None
    crash(durability)
    (tmp_path / SNAPSHOT_DIR).unlink()
    again, durability = recover(tmp_path)
    assert durability.report.num_replayed == last and state_digest(again) == digest
    durability.close()


def test_a_captured_snapshot_is_the_state_at_capture_whenever_it_is_built(tmp_path):
    """capture_snapshot copies what mutations change; the tree built from it later (in the
    server, in a worker thread while steps go on) is the one snapshot_state gave at the
    capture, event buffer included, however many events came and were trimmed since."""
    live, workload = new_state(FULL_POOL), Workload(41, FULL_POOL)
    _drive(live, workload, 150)
    want = digest_tree(live.snapshot_state())
    build = live.capture_snapshot()
    first_event = live.event_buffer()[2]
    _drive(live, workload, 300)
    assert live.event_buffer()[2] > first_event  # older events were trimmed since
    assert digest_tree(build()) == want != digest_tree(live.snapshot_state())


def test_random_damage_to_a_journal_segment_recovers_a_valid_prefix(tmp_path):
    """Bytes flipped anywhere in the journal (headers, bodies, CRCs, seq fields) or the
    segment cut anywhere: recovery never fails, its state is the never-crashed twin's at the
    record it reports, and after appending on top a second start finds nothing damaged and
    the same state."""
    import shutil

    source = tmp_path / "source"
    last = _write_log(source, 53, 120)
    rng = np.random.default_rng(53)
    twins: dict[int, str] = {}
    for trial in range(32):
        data_dir = tmp_path / f"trial{trial}"
        shutil.copytree(source, data_dir)
        (segment,) = journal_files.segment_paths(data_dir)
        raw = bytearray(segment.read_bytes())
        if trial % 4 == 3:
            raw = raw[: int(rng.integers(0, len(raw)))]
        elif trial % 4 == 2:
            # One record's length, CRC or seq field: the fields the parser trusts (a seq
            # made smaller reads as a gap, and the record must go with the tail).
            offsets = journal_files.record_offsets(segment)
            index = int(rng.integers(1, len(offsets)))
            at, field = offsets[index], int(rng.integers(0, 3))
            if field == 2:
                wrong = int(rng.integers(1, index + 1)) if trial % 8 == 2 else index + 2
                raw[at + 8 : at + 16] = wrong.to_bytes(8, "little")
            else:
                raw[at + 4 * field] ^= int(rng.integers(1, 256))
        else:
            for at in rng.integers(0, len(raw), int(rng.integers(1, 4))):
                raw[at] ^= int(rng.integers(1, 256))
        segment.write_bytes(bytes(raw))
        state, durability = recover(data_dir)
        report = durability.report
        assert report.last_seq <= last
        if report.last_seq not in twins:
            twins[report.last_seq] = state_digest(twin_at(53, report.last_seq)[0])
        assert state_digest(state) == twins[report.last_seq], f"trial {trial}"
        _, workload = twin_at(53, report.last_seq)
        durability.attach(state)
        _drive(state, workload, 10, durability)
        live, added = state_digest(state), durability.last_seq
        state.journal = None
        crash(durability)
        again, durability = recover(data_dir)
        assert durability.report.damage == "", f"trial {trial}: {durability.report.damage}"
        assert durability.last_seq == added and state_digest(again) == live
        durability.close()


def test_a_graceful_stop_leaves_no_journal_behind(tmp_path):
    """The snapshot a graceful stop takes covers every record: its registration ends the
    segment being appended to and retires it with the rest, and the final checkpoint
    removes them. The next start reads the snapshot alone."""
    state, workload = new_state(), Workload(57)
    durability = Durability.open(tmp_path, "process")
    durability.recover(state)
    durability.attach(state)
    _drive(state, workload, 40, durability)
    assert journal_files.segment_paths(tmp_path)
    digest, last = state_digest(state), durability.last_seq
    durability.close(state)
    assert journal_files.segment_paths(tmp_path) == []
    again, durability = recover(tmp_path)
    assert durability.report.num_replayed == 0 and durability.last_seq == last
    assert state_digest(again) == digest
    durability.close()


def test_a_record_torn_inside_the_reserved_zeros_is_dropped_alone(tmp_path):
    """With zeros reserved ahead (format 5), a record cut short in them (its second half
    still zeros, as a write that did not finish leaves it) fails its CRC: recovery keeps
    every record before it and drops it, the zeros after it are no record, and the
    service appends on from there."""
    state, workload = new_state(), Workload(7)
    durability = Durability.open(tmp_path, "process", snapshot_every=10_000)
    durability.recover(state)
    durability.attach(state)
    asked: list[int] = []
    durability.schedule_reserve = lambda: asked.append(1)
    _drive(state, workload, 25, durability)
    assert asked  # the first record asked for zeros ahead
    assert durability.reserve_ahead() > 0
    _drive(state, workload, 25, durability)
    last_seq = journal_files.records(tmp_path)[-1][0]
    kept = state_digest(state)
    while journal_files.records(tmp_path)[-1][0] == last_seq:
        workload.run_one(state)  # until one more record is written
    state.journal = None
    crash(durability)
    (path,) = journal_files.segment_paths(tmp_path)
    size = path.stat().st_size
    offset = journal_files.record_offsets(path)[-1]
    body = journal_files.records(tmp_path)[-1][2]
    with open(path, "r+b") as f:  # the record's second half never written
        f.seek(offset + 16 + len(body) // 2)
        f.write(bytes(len(body) - len(body) // 2))
    assert path.stat().st_size == size > offset + 16 + len(body)  # zeros follow it
    again, durability = recover(tmp_path)
    assert durability.report is not None
    assert durability.report.last_seq == last_seq and durability.report.num_dropped == 1
    assert state_digest(again) == kept
    durability.attach(again)
    while durability.last_seq == last_seq:
        workload.run_one(again)  # appended after the kept records
    assert durability.last_seq == last_seq + 1
    after = state_digest(again)
    again.journal = None
    crash(durability)
    third, durability = recover(tmp_path)
    assert state_digest(third) == after
    durability.close(third)
