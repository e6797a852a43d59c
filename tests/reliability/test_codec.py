"""Log record and snapshot encodings: exact round trips, and damage always detected as such
(never a crash, never a half-built value)."""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekeeper.core.errors import InvalidArgument
from pagekeeper.core.events import AllCleared, PageRemoved, PageStored, TokenRun
from pagekeeper.core.groups import GroupManager, MambaManager, SlidingWindowManager
from pagekeeper.core.manager import PageManager, _Request
from pagekeeper.core.pool import PagePool
from pagekeeper.core.snapshot import events_from_tree, events_to_tree
from pagekeeper.core.tables import PageRows
from pagekeeper.core.types import ExtraKeys, MultiModalKey
from pagekeeper.durability import commands
from pagekeeper.durability.commands import (
    KIND_RESUME_LEASES,
    KIND_STEP_WIRE,
    RecordDecodeError,
    RecordFromNewerVersion,
    decode_command,
    encode_command,
    encode_command_parts,
)
from pagekeeper.durability.log import record_crc
from pagekeeper.durability.snapshot import SnapshotError, decode_snapshot, encode_snapshot
from pagekeeper.durability.values import ValueDecodeError, decode, encode
from pagekeeper.state import (
    STATE_SNAPSHOT_VERSION,
    Admission,
    Batch,
    ClientRecord,
    ClientRole,
    ConfigureLimitsCommand,
    ExpireLeasesCommand,
    ForceFreeCommand,
    GroupKernelSupport,
    Growth,
    GrowthColumns,
    HeartbeatCommand,
    KernelBackend,
    Limits,
    RegisterCommand,
    ResetPrefixCacheCommand,
    ResumeLeasesCommand,
    ServiceState,
    StepCommand,
    StepResult,
    UnregisterCommand,
    limits_from_tree,
    limits_to_tree,
)
from tests.helpers.props import examples
from tests.reliability.workload import HYBRID_POOL, Workload, new_state, tokens

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary()
    | st.lists(st.binary(), min_size=1)
    | st.lists(st.text(), min_size=1)
    | st.lists(st.integers(-(2**31), 2**31 - 1)).map(lambda v: np.array(v, dtype=np.int32))
)
trees = st.recursive(
    leaves,
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=examples(80), deadline=None)
@given(trees)
def test_values_round_trip(tree):
    assert _equal(tree, decode(encode(tree)))


@settings(max_examples=examples(150), deadline=None)
@given(trees, st.data())
def test_damaged_values_never_crash(tree, data):
    """Truncated or flipped encodings raise ValueDecodeError or decode to *some* value;
    nothing else escapes (a CRC catches the rest before decoding ever runs)."""
    encoded = bytearray(encode(tree))
    if data.draw(st.booleans()) and len(encoded) > 1:
        encoded = encoded[: data.draw(st.integers(0, len(encoded) - 1))]
    elif encoded:
        at = data.draw(st.integers(0, len(encoded) - 1))
        encoded[at] ^= data.draw(st.integers(1, 255))
    with contextlib.suppress(ValueDecodeError):
        decode(bytes(encoded))


def test_values_refuse_what_they_cannot_carry():
    for bad in (object(), {1: 2}, 2**64, np.array([object()]), {"a": {3}}):
        with pytest.raises(TypeError):
            encode(bad)
    with pytest.raises(ValueDecodeError, match="dtype"):
        decode(b"a" + (3).to_bytes(4, "little") + b"|O8" + b"\x00" + (0).to_bytes(8, "little"))
    with pytest.raises(ValueDecodeError, match="trailing"):
        decode(encode(1) + b"x")


SUPPORT = (GroupKernelSupport(0, (KernelBackend("FA", (16,), (32,)), KernelBackend("x"))),)
COMMANDS = [
    RegisterCommand(
        now=1.5, role=ClientRole.WORKER, name="w", device="cuda:0", kernel_support=SUPPORT
    ),
    RegisterCommand(now=2.0, role=ClientRole.SCHEDULER, client_id="scheduler-3", lease_ttl_s=7.5),
    RegisterCommand(now=2.5, role=ClientRole.SCHEDULER, name="s", identity="engine-a.example"),
    RegisterCommand(now=2.75, role=ClientRole.WORKER, name="fresh", fresh_kv_cache=True),
    RegisterCommand(now=2.875, role=ClientRole.WORKER, identity="worker-9", fresh_kv_cache=True),
    HeartbeatCommand(3.0, "worker-1", 4),
    UnregisterCommand(3.5, "worker-1", 4),
    ExpireLeasesCommand(4.0),
    ResetPrefixCacheCommand(5.0),
    ForceFreeCommand(6.0, "r\x00é"),
    ResumeLeasesCommand(7.0),
    ResumeLeasesCommand(7.5, "exact"),
    ResumeLeasesCommand(7.75, "cap"),
    ResumeLeasesCommand(7.875, "shift", -3_600.25),
    ConfigureLimitsCommand(8.0, Limits(max_clients=3, lease_grace_s=1.25)),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: type(c).__name__)
def test_commands_round_trip(command):
    decoded, publication = decode_command(encode_command(command))
    assert decoded == command and publication is None


def _step_fields(cmd: StepCommand):
    def arr(a):
        return None if a is None else np.asarray(a).tolist()

    return (
        cmd.now,
        cmd.client_id,
        cmd.generation,
        cmd.step_id,
        cmd.frees,
        [
            (
                g.request_id,
                g.num_new_tokens,
                arr(g.new_token_ids),
                g.num_computed_tokens,
                g.num_lookahead_tokens,
            )
            for g in cmd.growths
        ],
        [
            (
                a.request_id,
                arr(a.token_ids),
                a.num_new_tokens,
                a.extra_keys,
                a.page_hashes,
                a.num_lookahead_tokens,
                a.enable_cache_read,
            )
            for a in cmd.admissions
        ],
        None
        if cmd.batch is None
        else (
            cmd.batch.request_ids,
            arr(cmd.batch.num_scheduled_tokens),
            arr(cmd.batch.num_computed_tokens),
        ),
    )


def test_step_round_trips_with_its_publication():
    extra = ExtraKeys("lora", "/p", (MultiModalKey("img", 2, 5),), "salt")
    step = StepCommand(
        9.25,
        "scheduler-1",
        2,
        41,
        frees=("a", "b"),
        growths=(
            Growth("c", 1, tokens(5, 1)),
            Growth("d", 3, tokens(9, 0), num_computed_tokens=17, num_lookahead_tokens=2),
        ),
        admissions=(
            Admission("e", tokens(0, 40), 16, extra, (b"h1", b"h2"), 1, False),
            Admission("f", tokens(3, 7)),
        ),
        batch=Batch(("c", "d", "e"), np.array([1, 3, 16], dtype=np.int32)),
    )
    result = StepResult(41, (), is_published=True, published_slot=1, publish_error="")
    decoded, publication = decode_command(encode_command(step, result))
    assert _step_fields(decoded) == _step_fields(step)
    assert publication == (True, 1, "")
    # A batch with rows running ahead of the service (held-back decodes) keeps its counts.
    ahead = dataclasses.replace(
        step, batch=Batch(("c", "d"), np.array([1, 3], np.int32), np.array([9, -1]))
    )
    assert _step_fields(decode_command(encode_command(ahead))[0]) == _step_fields(ahead)
    for odd in (
        StepCommand(1.0, "s", 1, 1),
        StepCommand(1.0, "s", 1, 1, frees=("a\x00b", "", "c"), batch=Batch(("", "x\x00"))),
        StepCommand(1.0, "s", 1, 1, growths=(Growth("\x00", 2, tokens(0, 2)),), batch=Batch(())),
    ):
        assert _step_fields(decode_command(encode_command(odd))[0]) == _step_fields(odd)


def test_workload_steps_round_trip():
    state, workload = new_state(HYBRID_POOL), Workload(7, HYBRID_POOL)
    for _ in range(300):
        command, _ = workload.run_one(state)
        decoded, _ = decode_command(encode_command(command))
        if isinstance(command, StepCommand):
            assert _step_fields(decoded) == _step_fields(command)
        else:
            assert decoded == command


def test_damaged_records_are_refused():
    body = encode_command(HeartbeatCommand(3.0, "worker-1", 4))
    for bad in (b"", b"\x02", b"\x63\x01" + body[2:], b"\x02\x09" + body[2:], body[:-3]):
        with pytest.raises(RecordDecodeError):
            decode_command(bad)
    assert record_crc(5, body) != record_crc(6, body)  # a record moved to another seq


def test_snapshot_header_and_body_are_checked():
    state = new_state()
    Workload(2).run_one(state)
    body = encode_snapshot(state.snapshot_state())
    assert decode_snapshot(body)["version"] == STATE_SNAPSHOT_VERSION
    for bad in (body[:4], b"XXSNAP" + body[6:], body[:6] + b"\x07\x00" + body[8:], body[:-9]):
        with pytest.raises(SnapshotError):
            decode_snapshot(bad)


# Every attribute that holds state must be in the snapshot. When a class gains one, this
# fails: add it to pagekeeper.core.snapshot / ServiceState.snapshot_state, then here.
KNOWN_ATTRIBUTES = {
    PagePool: {
        "num_pages", "enable_caching", "_state", "_pos", "_pos_np", "_cached",
        "_cached_np", "_buf", "_buf_np", "_head", "_tail", "_indexed", "_num_free", "_index",
        "_dups", "_page_hash", "_events", "_event_seq", "num_evictions",
        "num_allocated_total", "_num_taken_by_hits",
        "_num_free_cached",  # derived from _state: recounted when a snapshot is restored
        "_ops",  # which loops run (C or Python): the restoring process's choice, not state
        "_num_reserved",  # places held for deferred events: 0 once settled, as snapshots are
        "_num_pending_evictions",  # likewise: 0 once settled
        "evict_later",  # set only inside a deferred admission's allocation
    },
    PageRows: {
        "_max_pages", "_table", "_num_pages", "_is_live", "_num_fresh", "_free_rows", "_num_live",
        "_bytes",  # a cache of _table's bytes, not state
    },
    GroupManager: {
        "group_id", "config", "page_size", "pool", "max_pages_per_request", "rows",
        "request_rows", "page_counts", "num_cached_pages",
    },
    SlidingWindowManager: {"window", "contiguous_pages"},
    MambaManager: {"is_state_cached"},
    PageManager: {
        "config", "enable_caching", "pool", "groups", "hash_page_size", "_hash_factors",
        "_hit_alignment", "_requests", "_stats", "_max_model_len", "_no_new_pages",
        "_single_full", "_hasher",
        "_page_parts",  # derived from the config: the C hash of one page, or None
        "requests",  # a read-only view of _requests
        # Deferred caching: a switch of the running service, and work that a snapshot
        # settles first (so it is recorded done).
        "defer_caching", "_deferred", "_deferred_hashes", "_deferred_chained",
        "_deferred_digests",
    },
    ServiceState: {
        "pool_config", "limits", "manager", "sink", "debug_invariants", "clock", "journal",
        "_fenced_reason", "counters", "_clients", "_requests", "_next_client_number",
        "_last_published_step_seq", "_kernel_sets", "_events", "_last_event_seq",
        "_events_nbytes", "_event_sizes",  # derived from _events: recomputed on restore
        "_listeners", "_page_sizes",
        "_schedule_settle",  # the running loop's hook (deferred caching), not state
        "_column_rows", "_column_hashes", "_column_tracked", "_column_plan",  # check -> apply
        "_hash_page_size", "page_hash_size",  # derived from the pool config
    },
}  # fmt: skip


def test_snapshot_knows_every_attribute():
    manager = PageManager(HYBRID_POOL)
    state = ServiceState(HYBRID_POOL)
    objects = [manager.pool, manager.groups[0].rows, state, manager, *manager.groups]
    for obj in objects:
        expected = set()
        for cls, names in KNOWN_ATTRIBUTES.items():
            if isinstance(obj, cls):
                expected |= names
        assert set(vars(obj)) == expected, type(obj).__name__
    slots = {f.name for f in dataclasses.fields(_Request)}
    assert slots == {
        "request_id", "token_ids", "extra_keys", "owner", "hashes", "num_computed_tokens",
        "num_cached_tokens", "scheduled_start", "num_scheduled",
    }  # fmt: skip
    assert {f.name for f in dataclasses.fields(ClientRecord)} == {
        "client_id", "role", "name", "device", "generation", "lease_ttl_s", "registered_at",
        "expires_at", "kernel_support", "kernel_block_sizes", "request_ids", "last_step_id",
        "last_step_result", "num_steps", "identity", "revoked",
    }  # fmt: skip


def test_a_capping_or_exact_lease_resume_is_a_version_an_older_reader_refuses(monkeypatch):
    plain = encode_command(ResumeLeasesCommand(7.0))
    exact = encode_command(ResumeLeasesCommand(7.0, "exact"))
    assert plain == bytes((KIND_RESUME_LEASES, 1)) + encode([7.0])  # as every version wrote
    assert exact == bytes((KIND_RESUME_LEASES, 2)) + encode([7.0, 2])
    # One day's development build wrote a cap as version 1 [now, 1]: read as the cap.
    assert decode_command(bytes((KIND_RESUME_LEASES, 1)) + encode([7.0, 1]))[0] == (
        ResumeLeasesCommand(7.0, "cap")
    )
    shift = encode_command(ResumeLeasesCommand(7.0, "shift", -5.5))
    assert shift == bytes((KIND_RESUME_LEASES, 3)) + encode([7.0, -5.5])
    # What two development builds of the day wrote under version 2 reads back.
    assert decode_command(bytes((KIND_RESUME_LEASES, 2)) + encode([7.0]))[0] == (
        ResumeLeasesCommand(7.0, "exact")
    )
    assert decode_command(bytes((KIND_RESUME_LEASES, 2)) + encode([7.0, 3, -5.5]))[0] == (
        ResumeLeasesCommand(7.0, "shift", -5.5)
    )
    # A mode a newer version adds is refused as newer (the dir, not dropped as damage).
    with pytest.raises(RecordFromNewerVersion):
        decode_command(bytes((KIND_RESUME_LEASES, 2)) + encode([7.0, 9]))
    # Anything else that is not one of the shapes is damage, never a silent resume.
    for version, tree in (
        (1, [7.0, 2]), (1, [7.0, True]), (1, [7.0, 1.0]), (1, [7.0, "x"]), (1, []),
        (2, [7.0, True]), (2, [7.0, 2.0]), (2, [7.0, 2, 0]), (2, [7.0, 3, "x"]),
        (3, [7.0]), (3, [7.0, float("nan")]), (3, [7.0, float("inf")]), (3, [7.0, "-5"]),
        (3, [7.0, True]), (3, [7.0, 1.0, 2]), (3, [float("nan"), 1.0]),
    ):  # fmt: skip
        with pytest.raises(RecordDecodeError):
            decode_command(bytes((KIND_RESUME_LEASES, version)) + encode(tree))
    # A reader from before version 2 (it knew version 1 only) refuses the data dir rather
    # than apply a plain resume and replay the records after it into another state; one
    # that knew versions 1 and 2 refuses the shift (version 3) alike.
    monkeypatch.setattr(commands, "READABLE_VERSIONS", {KIND_STEP_WIRE: (1, 2)})
    assert decode_command(plain)[0] == ResumeLeasesCommand(7.0)
    with pytest.raises(RecordFromNewerVersion, match="resume_leases record version 2"):
        decode_command(exact)
    monkeypatch.setattr(
        commands, "READABLE_VERSIONS", {KIND_STEP_WIRE: (1, 2), KIND_RESUME_LEASES: (1, 2)}
    )
    with pytest.raises(RecordFromNewerVersion, match="resume_leases record version 3"):
        decode_command(shift)


def test_a_registration_without_identity_encodes_as_before_one_with_it_adds_a_field():
    plain = RegisterCommand(now=1.0, role=ClientRole.SCHEDULER, name="s")
    bound = dataclasses.replace(plain, identity="engine-a")
    assert len(encode_command(bound)) > len(encode_command(plain))
    # A record from before identities (7 fields) reads back unbound.
    assert decode_command(encode_command(plain))[0].identity == ""


def test_events_round_trip():
    events = [
        PageStored(1, 0, (b"a" * 32, b"b" * 32), None, (1, 2, 3), 16, (5, 6), "lora"),
        PageRemoved(2, 1, (b"c",), (7,)),
        AllCleared(3),
        PageStored(4, 2, (b"d",), b"parent", (2**40,), 16, (9,), None),
        PageStored(5, 0, (b"e",), None, TokenRun([2**64 - 1, 0, 7]), 16, (3,), None),
    ]
    assert events_from_tree(decode(encode(events_to_tree(events)))) == events
    assert events_to_tree(events)["event_extra_keys"] is None  # no column without keys
    keys = ExtraKeys(lora_name="l", mm_inputs=(MultiModalKey("img", 3, 30),), cache_salt="s")
    keyed = [
        *events,
        PageStored(6, 0, (b"f",), b"e", TokenRun(range(16)), 16, (4,), "l", keys, 7),
        PageStored(7, 0, (b"g",), b"f", TokenRun(range(16)), 16, (5,), None, None, 8),
    ]
    assert events_from_tree(decode(encode(events_to_tree(keyed)))) == keyed
    # A snapshot from before events kept their keys (no such column) reads back without.
    old_tree = {
        k: v
        for k, v in events_to_tree(events).items()
        if k not in ("event_extra_keys", "first_pages")
    }
    assert events_from_tree(decode(encode(old_tree))) == events
    # One day's development build: [first page, keys] pairs under "extra_keys".
    dev = {k: v for k, v in events_to_tree(keyed).items() if k != "first_pages"}
    pairs = dev.pop("event_extra_keys")
    dev["extra_keys"] = [None if t is None else [e.first_page, t] for e, t in zip(
        [e for e in keyed if isinstance(e, PageStored)], pairs, strict=True
    )]  # fmt: skip
    assert events_from_tree(decode(encode(dev)))[-2:] == [
        keyed[-2],
        dataclasses.replace(keyed[-1], first_page=0),  # pairs only for events with keys
    ]
    # The next one's: the keys themselves under "extra_keys", beside "first_pages".
    later = events_to_tree(keyed)
    later["extra_keys"] = later.pop("event_extra_keys")
    assert events_from_tree(decode(encode(later))) == keyed
    small = [PageStored(1, 0, (b"a",), None, TokenRun(range(16)), 16, (1,), None)]
    assert events_to_tree(small)["tokens"].dtype == np.int32  # narrowed when ids fit
    assert events_from_tree(decode(encode(events_to_tree([])))) == []
    with pytest.raises(InvalidArgument):
        events_from_tree({**events_to_tree(events), "kinds": "srcx"})


def test_chunked_events_and_encoding_with_pauses_give_the_same_bytes():
    """A snapshot built and encoded in a worker thread pauses between chunks so the event
    loop can run; the chunks change nothing in the tree or the bytes."""
    rng = np.random.default_rng(5)
    events: list = []
    for seq in range(1, 10_001):  # more than two chunks of events
        kind = seq % 7
        if kind == 0:
            events.append(AllCleared(seq))
        elif kind in (1, 2):
            events.append(PageRemoved(seq, kind - 1, (bytes([seq % 251]) * 32,), (seq % 500,)))
        else:
            n = int(rng.integers(1, 4))
            hashes = tuple(bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(n))
            tokens = TokenRun(rng.integers(0, 2**31 - 1, 16 * n).tolist())
            lora = "lora" if seq == 9_999 else None
            pages = tuple(range(seq % 400, seq % 400 + n))
            parent = None if n == 1 else b"p"
            events.append(PageStored(seq, 0, hashes, parent, tokens, 16, pages, lora))
    pauses: list[int] = []
    whole = events_to_tree(events)
    chunked = events_to_tree(events, lambda: pauses.append(1))
    assert len(pauses) == 3  # 10,000 events, 4,096 a chunk
    assert encode(chunked) == encode(whole)
    assert events_from_tree(decode(encode(chunked))) == events

    encode_pauses: list[int] = []
    tree = {
        "hashes": [bytes([i % 256]) * (i % 5) for i in range(20_000)],
        "ids": ["x"] * 9000,
        "few": [b"a", b"b"],
        "none": [],
        "mixed": [1, "a", b"b"] * 5000,
        "events": whole,
    }
    paused = encode(tree, lambda: encode_pauses.append(1))
    assert paused == encode(tree)
    assert len(encode_pauses) >= 6  # the long lists' type and length passes, in chunks
    back = decode(paused)
    assert {k: v for k, v in back.items() if k != "events"} == {
        k: v for k, v in tree.items() if k != "events"
    }


def test_limits_from_before_the_event_byte_budget_read_with_its_default():
    tree = limits_to_tree(Limits(event_buffer_bytes=4096))
    assert limits_from_tree(tree).event_buffer_bytes == 4096
    del tree["event_buffer_bytes"]  # a record or snapshot written before the field
    assert limits_from_tree(tree) == Limits()


def test_a_step_read_over_grpc_is_journaled_as_its_request_bytes():
    from pagekeeper.rpc.convert import step_from_pb
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

    def i32(values: list[int]) -> bytes:
        return np.asarray(values, dtype="<i4").tobytes()

    request = pb.StepRequest(
        client_id="scheduler-1",
        generation=2,
        step_id=41,
        free_request_ids=["a"],
        admissions=[
            pb.Admission(request_id="e", token_ids=i32(list(range(40))), page_hashes=[b"h1", b"h2"])
        ],
        batch=pb.Batch(
            request_ids=["c", "e"],
            num_scheduled_tokens=i32([1, 16]),
            num_computed_tokens=i32([9, -1]),
        ),
    )
    request.growth_columns.request_ids.extend(["c", "d"])
    request.growth_columns.new_token_ids = i32([5, 6, 7])
    request.growth_columns.num_new_token_ids = i32([1, 2])
    request.growth_columns.num_computed_tokens = i32([-1, 8])
    step = step_from_pb(request, 9.25)
    result = StepResult(41, (), is_published=True, published_slot=1, publish_error="")
    body = encode_command(step, result)
    assert body[0] == 10 and request.SerializeToString() in body  # the request's own bytes
    decoded, publication = decode_command(body)
    assert _step_fields(decoded) == _step_fields(step)
    assert publication == (True, 1, "")
    cols, want = decoded.growth_columns, step.growth_columns
    assert cols is not None and want is not None and cols.request_ids == want.request_ids
    for name in ("new_token_ids", "num_new_token_ids", "num_computed_tokens", "num_new_tokens"):
        assert getattr(cols, name).tolist() == getattr(want, name).tolist(), name
    # (Damage inside the bytes is the record CRC's to catch; a cut record cannot parse.)
    with pytest.raises(RecordDecodeError):
        decode_command(body[:-5])
    # With the bytes the request came in, the record's last part is that very object (no
    # serialization, no copy); its body is the same and reads back the same.
    data = request.SerializeToString()
    received = step_from_pb(pb.StepRequest.FromString(data), 9.25, memoryview(data))
    parts = encode_command_parts(received, result)
    assert parts[-1] is received.wire_bytes and b"".join(parts) == body
    assert _step_fields(decode_command(b"".join(parts))[0]) == _step_fields(step)
    # Version 2 has a fixed header; a version-1 record (a tree) of the same step, as data
    # dirs before 2026-12-06 hold them, reads back the same; so do other publications.
    assert body[1] == 2
    for pub in ([True, 1, ""], [False, 0, "ring full: é"], None):
        v1 = bytes((10, 1)) + encode([9.25, pub, request.SerializeToString()])
        old_step, old_publication = decode_command(v1)
        assert _step_fields(old_step) == _step_fields(step)
        assert old_publication == (None if pub is None else tuple(pub))
        if pub is not None:
            result = StepResult(
                41, (), is_published=pub[0], published_slot=pub[1], publish_error=pub[2]
            )
        v2 = encode_command(step, None if pub is None else result)
        assert v2[1] == 2 and decode_command(v2)[1] == old_publication
    # A header that does not fit, unknown flags, an error past the end, bad UTF-8.
    header = struct.Struct("<dBqI")
    wire = request.SerializeToString()
    for bad in (
        b"\x0a\x02" + b"\x00" * 10,
        b"\x0a\x02" + header.pack(1.0, 8, 0, 0) + wire,
        b"\x0a\x02" + header.pack(1.0, 1, 0, 1 << 30) + wire,
        b"\x0a\x02" + header.pack(1.0, 1, 0, 2) + b"\xff\xfe" + wire,
        b"\x0a\x05" + header.pack(1.0, 1, 0, 0) + wire,  # 3: revoked ids, 4: growth hashes
    ):
        with pytest.raises(RecordDecodeError):
            decode_command(bad)
    # Bytes flipped or cut anywhere: refused or read, never another exception.
    rng = np.random.default_rng(5)
    for _ in range(300):
        damaged = bytearray(body)
        for at in rng.integers(0, len(damaged), int(rng.integers(1, 4))):
            damaged[at] = int(rng.integers(0, 256))
        cut = bytes(damaged[: int(rng.integers(2, len(damaged) + 1))])
        for candidate in (bytes(damaged), cut):
            with contextlib.suppress(RecordDecodeError):
                decode_command(candidate)


def _with_growth_count(body: bytes, count: int, ids: object = None) -> bytes:
    """The step record ``body`` with its growths' count (and, given, their ids) replaced."""
    tree = decode(memoryview(body)[2:])
    tree[5][0] = count
    if ids is not None:
        tree[5][1] = ids
    return body[:2] + encode(tree)


@pytest.mark.parametrize("form", ["growths", "columns"])
def test_a_damaged_growth_count_is_refused_before_it_sizes_anything(form):
    """A count that disagrees with the ids it counts is refused as a damaged record, and
    nothing is allocated by it first (`make fuzz` found a count of ~2**60 raising
    MemoryError out of the decoder)."""
    ids = ("a", "b", "c")
    if form == "growths":
        growths = tuple(Growth(r, 1, tokens(i, 1)) for i, r in enumerate(ids))
        step = StepCommand(1.0, "s", 1, 1, growths=growths)
    else:
        ones = np.ones(3, dtype=np.int32)
        columns = GrowthColumns(ids, ones, np.arange(3, dtype=np.int32), ones, -ones, 0 * ones)
        step = StepCommand(1.0, "s", 1, 1, growth_columns=columns)
    body = encode_command(step)
    assert _step_fields(decode_command(body)[0]) == _step_fields(step)
    for count in (2**60, 10**7, 4, 2, -1):
        tracemalloc.start()
        try:
            with pytest.raises(RecordDecodeError, match="wrong shape"):
                decode_command(_with_growth_count(body, count))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"count {count}: {peak} bytes allocated before the refusal"
    # No growths counted, but ids there: damaged too (not read as a step without growths).
    with pytest.raises(RecordDecodeError, match="count says none"):
        decode_command(_with_growth_count(body, 0))


def _leaf_paths(tree: object, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Paths (list indices) to every leaf of a decoded record tree."""
    if isinstance(tree, list):
        return [p for i, item in enumerate(tree) for p in _leaf_paths(item, (*path, i))]
    return [path]


def test_records_with_a_leaf_replaced_are_refused_or_decoded_never_crash():
    """Every kind of record the workload writes, with one leaf of its tree replaced by an
    odd value (huge, negative, another type), re-encoded with a valid frame: the decoder
    refuses it with RecordDecodeError or reads some command, and allocates nothing sized
    by the odd value. Byte-level damage rarely lands on a count; this always does."""
    rng = np.random.default_rng(11)
    odd_values = [2**60, -(2**62), 10**7, -1, 0, 1, 3, "", "x\x00y", None, [], [1, 2], 1.5]
    state, workload = new_state(HYBRID_POOL), Workload(5, HYBRID_POOL)
    bodies = []
    for _ in range(150):
        command, result = workload.run_one(state)
        if not isinstance(result, Exception):
            bodies.append(encode_command(command, result))
    decoded = refused = 0
    tracemalloc.start()
    try:
        for body in bodies:
            tree = decode(memoryview(body)[2:])
            paths = _leaf_paths(tree)
            for _ in range(12):
                path = paths[int(rng.integers(len(paths)))]
                damaged = decode(memoryview(body)[2:])
                parent = damaged
                for i in path[:-1]:
                    parent = parent[i]
                if path:
                    parent[path[-1]] = odd_values[int(rng.integers(len(odd_values)))]
                tracemalloc.reset_peak()
                try:
                    decode_command(body[:2] + encode(damaged))
                    decoded += 1
                except RecordDecodeError:
                    refused += 1
                peak = tracemalloc.get_traced_memory()[1]
                assert peak < 8 << 20, f"{peak} bytes for a record with {path} replaced"
    finally:
        tracemalloc.stop()
    assert refused > 100 and decoded + refused == 12 * len(bodies)


def test_a_step_naming_a_revoked_request_is_a_version_an_older_reader_refuses(monkeypatch):
    """A pagekeeper from before revocations would refuse such a step on replay (NOT_FOUND),
    take the record for damage and drop it with every record after it: the step is written
    as a version of its kind that reader does not know, so it refuses the data dir instead.
    Steps that name no revoked request stay as every version wrote them."""
    from pagekeeper.durability.commands import KIND_STEP
    from pagekeeper.rpc import convert
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

    state = new_state(HYBRID_POOL)
    reg = state.register(RegisterCommand(now=0.0, role=ClientRole.SCHEDULER))
    me = {"client_id": reg.client_id, "generation": reg.generation}

    def wire_step(step_id: int, **fields: object) -> tuple[StepCommand, StepResult]:
        request = pb.StepRequest(step_id=step_id, **me, **fields)  # type: ignore[arg-type]
        command = convert.step_from_pb(pb.StepRequest.FromString(request.SerializeToString()), 1.0)
        return command, state.step(command)

    ids = np.arange(40, dtype="<i4").tobytes()
    admit = wire_step(1, admissions=[pb.Admission(request_id="v", token_ids=ids)])
    assert encode_command(*admit)[:2] == bytes((KIND_STEP_WIRE, 2))
    state.force_free(ForceFreeCommand(2.0, "v"))
    wire = wire_step(2, free_request_ids=["v"])
    assert wire[1].names_revoked and wire[1].results == ()
    body = encode_command(*wire)
    assert body[:2] == bytes((KIND_STEP_WIRE, 3))
    assert decode_command(body)[0].frees == ("v",)
    tree_command = dataclasses.replace(wire[0], wire=None)
    tree_body = encode_command(tree_command, wire[1])
    assert tree_body[:2] == bytes((KIND_STEP, 2))
    assert decode_command(tree_body)[0].frees == ("v",)
    assert encode_command(tree_command, dataclasses.replace(wire[1], names_revoked=False))[
        :2
    ] == bytes((KIND_STEP, 1))
    # The force-free that left the revocation is a version of its own too.
    assert encode_command(ForceFreeCommand(2.0, "v"), True)[:2] == bytes((7, 2))
    assert encode_command(ForceFreeCommand(2.0, "v"), False)[:2] == bytes((7, 1))
    assert decode_command(encode_command(ForceFreeCommand(2.0, "v"), True))[0] == (
        ForceFreeCommand(2.0, "v")
    )
    # What the readers before revocations knew: step_wire 1 and 2, step 1, force_free 1.
    monkeypatch.setattr(
        commands, "READABLE_VERSIONS", {KIND_STEP_WIRE: (1, 2), KIND_RESUME_LEASES: (1, 2, 3)}
    )
    assert decode_command(encode_command(*admit))[0].admissions[0].request_id == "v"
    with pytest.raises(RecordFromNewerVersion, match="step_wire record version 3"):
        decode_command(body)
    with pytest.raises(RecordFromNewerVersion, match="step record version 2"):
        decode_command(tree_body)
    with pytest.raises(RecordFromNewerVersion, match="force_free record version 2"):
        decode_command(encode_command(ForceFreeCommand(2.0, "v"), True))
