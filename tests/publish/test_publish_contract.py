"""The contract every table transport passes: shm, cpu_ipc (CUDA IPC's CPU stand-in),
stream (pack/unpack), and cuda_ipc where a GPU is present.

Readers always run in another process (``_publish_harness.RemoteReader``): IPC transports
refuse an import in the exporting process, and the shared-memory protocol is only
meaningful across processes anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pagekeeper.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pagekeeper.core.types import BatchTables
from pagekeeper.publish import RingGeometry, create_publisher
from pagekeeper_client.ring import (
    DescriptorError,
    ReaderFellBehind,
    RingClosed,
    StepTimeout,
)
from pagekeeper_client.transports import open_table_view
from tests.publish._publish_harness import (
    PATTERN_PERIOD,
    RemoteReader,
    pattern_arrays,
    pattern_pad_id,
    pattern_shape,
)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_CUDA = _cuda_available()
NEEDS_CUDA = pytest.mark.skipif(
    not HAS_CUDA, reason="cuda_ipc needs torch.cuda.is_available() (no GPU here)"
)
KINDS = [
    "shm",
    "cpu_ipc",
    "stream",
    pytest.param("cuda_ipc", marks=NEEDS_CUDA),
]
# Whether a reader that opened before the publisher closed still gets published steps.
SERVES_AFTER_CLOSE = {"shm": True, "stream": True, "cpu_ipc": False, "cuda_ipc": False}

GEOMETRY = RingGeometry(
    depth=2, max_num_reqs=12, max_num_tokens=64, tables=((0, 16, 40), (1, 32, 20))
)


@pytest.fixture(scope="module")
def readers() -> Iterator[tuple[RemoteReader, RemoteReader]]:
    pair = (RemoteReader(), RemoteReader())
    yield pair
    for reader in pair:
        reader.shutdown()


class Ring:
    """One publisher (here) and views of it in reader processes."""

    def __init__(self, kind: str, geometry: RingGeometry, readers: tuple[RemoteReader, ...]):
        self.kind = kind
        self.geometry = geometry
        options: dict[str, Any] = {"device": "cuda:0"} if kind == "cuda_ipc" else {}
        self.publisher: Any = create_publisher(kind, geometry, **options)
        self.readers = readers
        self.views: list[tuple[RemoteReader, int]] = []
        self._unsubscribe: list[Any] = []

    def open(self, reader: RemoteReader) -> int:
        view_id = reader.open(self.publisher.descriptor())
        self.views.append((reader, view_id))
        if self.kind == "stream":
            # Stand-in for the WatchTables stream: forward every packed step, in order.
            for step in range(self.publisher.last_step + 1):
                payload = self.publisher.message(step)
                if payload is not None:
                    reader.feed(view_id, payload)
            self._unsubscribe.append(
                self.publisher.add_listener(lambda step, payload: reader.feed(view_id, payload))
            )
        return view_id

    def publish(self, step: int, batch: list[BatchTables]) -> int:
        """Publish and, for the stream, wait until every view received it (the rings are
        visible on return; a stream is asynchronous by nature)."""
        slot: int = self.publisher.publish(step, batch)
        if self.kind == "stream":
            for reader, view_id in self.views:
                reader.call("await_latest", view_id, step, 10.0)
        return slot

    def close_publisher(self) -> None:
        self.publisher.close()
        if self.kind == "stream":
            for reader, view_id in self.views:
                reader.feed(view_id, None)  # the stream ends

    def cleanup(self) -> None:
        for reader, view_id in self.views:
            with contextlib.suppress(Exception):
                reader.call("close", view_id)
        self.publisher.close()


@pytest.fixture
def make_ring(readers: tuple[RemoteReader, RemoteReader]) -> Iterator[Any]:
    rings: list[Ring] = []

    def make(kind: str, geometry: RingGeometry = GEOMETRY) -> Ring:
        ring = Ring(kind, geometry, readers)
        rings.append(ring)
        return ring

    yield make
    for ring in rings:
        ring.cleanup()


def random_batch(rng: np.random.Generator, geometry: RingGeometry) -> list[BatchTables]:
    num_reqs = int(rng.integers(0, geometry.max_num_reqs + 1))
    num_tokens = int(rng.integers(0, geometry.max_num_tokens + 1))
    batch = []
    for group_id, kbs, max_cols in geometry.tables:
        num_cols = int(rng.integers(0, max_cols + 1))
        batch.append(
            BatchTables(
                group_id=group_id,
                kernel_block_size=kbs,
                block_table=rng.integers(-1, 2**31 - 1, (num_reqs, num_cols), dtype=np.int32),
                row_lengths=rng.integers(0, num_cols + 1, num_reqs, dtype=np.int32),
                slot_mapping=rng.integers(-1, 2**62, num_tokens, dtype=np.int64),
                pad_id=int(rng.integers(-1, 5)),
            )
        )
    # Tables may arrive in any order; the ring keeps geometry order.
    return batch[::-1] if rng.random() < 0.5 else batch


def pattern_batch(step: int, geometry: RingGeometry) -> list[BatchTables]:
    batch = []
    for i, (group_id, kbs, max_cols) in enumerate(geometry.tables):
        bt, rl, sm = pattern_arrays(
            step, i, geometry.max_num_reqs, max_cols, geometry.max_num_tokens
        )
        batch.append(BatchTables(group_id, kbs, bt, rl, sm, pad_id=pattern_pad_id(step)))
    return batch


def assert_same(wire: Any, step: int, batch: list[BatchTables]) -> None:
    step_seq, _, num_reqs, tables = wire
    assert step_seq == step
    expected = sorted(batch, key=lambda t: (t.group_id, t.kernel_block_size))
    assert num_reqs == expected[0].block_table.shape[0]
    assert len(tables) == len(expected)
    for (group_id, kbs, bt, rl, sm, pad_id), want in zip(tables, expected, strict=True):
        assert (group_id, kbs, pad_id) == (want.group_id, want.kernel_block_size, want.pad_id)
        assert bt.dtype == np.int32 and rl.dtype == np.int32 and sm.dtype == np.int64
        np.testing.assert_array_equal(bt, want.block_table)
        np.testing.assert_array_equal(rl, want.row_lengths)
        np.testing.assert_array_equal(sm, want.slot_mapping)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_random_tables(kind: str, make_ring: Any) -> None:
    rng = np.random.default_rng(1234)
    geometry = RingGeometry(depth=3, max_num_reqs=12, max_num_tokens=64, tables=GEOMETRY.tables)
    ring = make_ring(kind, geometry)
    reader = ring.readers[0]
    view = ring.open(reader)
    step = 0
    for i in range(24):
        step += int(rng.integers(1, 3))  # gaps between steps are allowed
        batch = random_batch(rng, geometry)
        slot = ring.publish(step, batch)
        assert slot == i % geometry.depth  # in turn, whatever the gaps between step ids
        assert_same(reader.call("wait", view, step, 5.0, True), step, batch)
        if i % 3 == 0:
            assert_same(reader.call("wait", view, step, 5.0, False), step, batch)
        if i % 4 == 0:
            _, num_reqs, tensors = reader.call("wait_tensors", view, step, 5.0)
            expected = sorted(batch, key=lambda t: (t.group_id, t.kernel_block_size))
            for (_, _, bt_dtype, sm_dtype, device, bt, rl, sm), want in zip(
                tensors, expected, strict=True
            ):
                assert (bt_dtype, sm_dtype) == ("torch.int32", "torch.int64")
                assert device == ("cuda:0" if kind == "cuda_ipc" else "cpu")
                np.testing.assert_array_equal(bt, want.block_table)
                np.testing.assert_array_equal(rl, want.row_lengths)
                np.testing.assert_array_equal(sm, want.slot_mapping)
            assert num_reqs == expected[0].block_table.shape[0]
    assert reader.call("latest_step", view) == step


@pytest.mark.parametrize("kind", KINDS)
def test_two_reader_processes_read_the_same_slot(kind: str, make_ring: Any) -> None:
    ring = make_ring(kind)
    first, second = ring.readers
    view_a, view_b = ring.open(first), ring.open(second)
    batch = pattern_batch(5, GEOMETRY)
    # Both wait before the step exists, then read it concurrently.
    first.send("wait", view_a, 5, 10.0, True)
    second.send("wait", view_b, 5, 10.0, True)
    ring.publisher.publish(5, batch)
    assert_same(first.result(), 5, batch)
    assert_same(second.result(), 5, batch)
    assert first.pid != second.pid != os.getpid()


@pytest.mark.parametrize("kind", KINDS)
def test_stale_and_overwritten_slots_are_detected(kind: str, make_ring: Any) -> None:
    ring = make_ring(kind)
    reader = ring.readers[0]
    view = ring.open(reader)
    publish = ring.publish
    publish(0, pattern_batch(0, GEOMETRY))
    with pytest.raises(StepTimeout, match="stale"):
        reader.call("wait", view, 1, 0.05, True)
    publish(1, pattern_batch(1, GEOMETRY))
    assert_same(reader.call("wait", view, 0, 1.0, True), 0, pattern_batch(0, GEOMETRY))
    publish(2, pattern_batch(2, GEOMETRY))  # overwrites step 0's slot (depth 2)
    with pytest.raises(ReaderFellBehind, match="fell behind"):
        reader.call("wait", view, 0, 1.0, True)
    assert_same(reader.call("wait", view, 1, 1.0, True), 1, pattern_batch(1, GEOMETRY))
    assert reader.call("is_current", view, 2) is True
    assert reader.call("is_current", view, 0) is False
    publish(5, pattern_batch(5, GEOMETRY))  # skips 3 and 4 (steps that published nothing)
    # The slots go in turn, not by step id: 5 replaced 1, and 2 is still there.
    assert_same(reader.call("wait", view, 2, 1.0, True), 2, pattern_batch(2, GEOMETRY))
    assert_same(reader.call("wait", view, 5, 1.0, True), 5, pattern_batch(5, GEOMETRY))
    for never in (3, 4):  # later steps are out: these will never come
        with pytest.raises(ReaderFellBehind, match="never published"):
            reader.call("wait", view, never, 1.0, True)
    with pytest.raises(StepTimeout, match="stale"):
        reader.call("wait", view, 6, 0.05, True)
    assert reader.call("latest_step", view) == 5


@pytest.mark.parametrize("kind", KINDS)
def test_the_last_depth_published_steps_stay_readable_across_gaps(
    kind: str, make_ring: Any
) -> None:
    """Published step ids have gaps (a scheduler's step that only admits publishes
    nothing): with one every other id, slot ``step % depth`` put every step in one slot,
    and a reader one published step behind lost it. The slots go in turn."""
    ring = make_ring(kind)
    reader = ring.readers[0]
    view = ring.open(reader)
    published = [2, 4, 6, 9, 11, 12, 14]
    for k, step in enumerate(published):
        ring.publish(step, pattern_batch(step, GEOMETRY))
        if k == 0:
            continue
        before = published[k - 1]  # depth 2: the previous published step is still there
        assert reader.call("is_current", view, before) is True
        assert_same(
            reader.call("wait", view, before, 1.0, True), before, pattern_batch(before, GEOMETRY)
        )
        if k >= 2:
            with pytest.raises(ReaderFellBehind):
                reader.call("wait", view, published[k - 2], 1.0, True)


@pytest.mark.parametrize("kind", KINDS)
def test_rejected_batches_write_nothing(kind: str, make_ring: Any) -> None:
    ring = make_ring(kind)
    reader = ring.readers[0]
    view = ring.open(reader)
    publisher = ring.publisher
    good = pattern_batch(0, GEOMETRY)
    ring.publish(0, good)

    def variant(table: int = 0, **changes: Any) -> list[BatchTables]:
        batch = pattern_batch(1, GEOMETRY)
        batch[table] = dataclasses.replace(batch[table], **changes)
        return batch

    r, n = GEOMETRY.max_num_reqs, GEOMETRY.max_num_tokens

    def uniform(rows: int, cols: tuple[int, int]) -> list[BatchTables]:
        return [
            BatchTables(
                g, k, np.zeros((rows, c), np.int32), np.zeros(rows, np.int32), np.zeros(1, np.int64)
            )
            for (g, k, _), c in zip(GEOMETRY.tables, cols, strict=True)
        ]

    exhausted = [
        uniform(r + 1, (1, 1)),  # too many requests
        uniform(1, (40, 21)),  # table 1 allows 20 kernel blocks per row
        variant(0, slot_mapping=np.zeros(n + 1, np.int64)),  # too many tokens
    ]
    for batch in exhausted:
        with pytest.raises(ResourceExhausted):
            publisher.publish(1, batch)
    invalid = [
        variant(0, block_table=pattern_batch(1, GEOMETRY)[0].block_table.astype(np.int64)),
        variant(0, slot_mapping=np.zeros(3, np.int32)),
        variant(0, row_lengths=np.full(pattern_shape(1, r, 40, n)[0], 41, np.int32)),
        variant(0, row_lengths=np.zeros(1, np.int32)),
        pattern_batch(1, GEOMETRY)[:1],  # a table missing
        [pattern_batch(1, GEOMETRY)[0]] * 2,  # a table twice
        variant(1, group_id=7),  # unknown table
    ]
    for batch in invalid:
        with pytest.raises(InvalidArgument):
            publisher.publish(1, batch)
    with pytest.raises(InvalidArgument, match="must exceed"):
        publisher.publish(0, good)
    with pytest.raises(InvalidArgument):
        publisher.publish(-1, good)
    # Nothing of the rejected batches is visible; step 0 is intact.
    assert reader.call("latest_step", view) == 0
    assert_same(reader.call("wait", view, 0, 1.0, True), 0, good)
    with pytest.raises(StepTimeout):
        reader.call("wait", view, 1, 0.05, True)
    ring.publish(1, pattern_batch(1, GEOMETRY))
    assert_same(reader.call("wait", view, 1, 1.0, True), 1, pattern_batch(1, GEOMETRY))


@pytest.mark.parametrize("kind", KINDS)
def test_close_semantics(kind: str, make_ring: Any) -> None:
    ring = make_ring(kind)
    reader = ring.readers[0]
    view = ring.open(reader)
    batch = pattern_batch(3, GEOMETRY)
    ring.publish(3, batch)
    assert_same(reader.call("wait", view, 3, 1.0, True), 3, batch)
    descriptor = ring.publisher.descriptor()
    ring.close_publisher()
    ring.publisher.close()  # idempotent
    with pytest.raises(FailedPrecondition):
        ring.publisher.publish(4, pattern_batch(4, GEOMETRY))
    if SERVES_AFTER_CLOSE[kind]:
        # A reader opened before close keeps its mapping / received steps.
        assert_same(reader.call("wait", view, 3, 1.0, True), 3, batch)
        with pytest.raises(RingClosed):
            reader.call("wait", view, 4, 5.0, True)
    else:
        # IPC: the exporter closing invalidates every import, even a mapped one.
        with pytest.raises(RingClosed, match="exporter"):
            reader.call("wait", view, 3, 1.0, True)
    if kind != "stream":
        with pytest.raises(DescriptorError):
            reader.open(descriptor)
        if kind == "shm":
            assert not os.path.exists(descriptor.path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("copy", [True, False], ids=["copy", "zero_copy"])
def test_torn_write_never_observed(kind: str, copy: bool, make_ring: Any) -> None:
    """A writer hammering the ring while a reader process verifies every byte of every
    step it reads against the step's own pattern."""
    if kind == "stream" and not copy:
        pytest.skip("stream views are immutable messages: zero-copy is the copy case")
    geometry = RingGeometry(
        depth=2, max_num_reqs=64, max_num_tokens=2048, tables=((0, 16, 1024), (1, 64, 256))
    )
    ring = make_ring(kind, geometry)
    reader = ring.readers[0]
    view = ring.open(reader)
    batches = [pattern_batch(step, geometry) for step in range(PATTERN_PERIOD)]
    ring.publisher.publish(0, batches[0])
    seconds = 1.0
    reader.send("hammer", view, seconds, copy)
    # Publish until the reader has answered (it reads for at least `seconds`, longer on a
    # loaded machine until it has verified enough steps; bounded).
    deadline = time.monotonic() + seconds + 20.0
    step = 0
    while time.monotonic() < deadline and not reader.is_done():
        step += 1
        ring.publisher.publish(step, batches[step % PATTERN_PERIOD])
        if step % 32 == 0:
            # Bursts of back-to-back steps (reads race the writer) between short pauses
            # (reads of a slot that holds still). Without the pauses, a fast writer on a
            # many-core machine (an H200 host: 3-17 verified out of ~28,000 cuda_ipc reads)
            # overruns nearly every read, and the test verifies nothing.
            time.sleep(0.001)
    counts = reader.result(timeout=30)
    assert counts["torn"] == 0, counts
    assert counts["verified"] >= 20, counts
    assert counts["distinct_steps"] >= 10, counts


def _mutations(kind: str, descriptor: Any, reader_pid: int) -> list[tuple[str, Any, type]]:
    d = descriptor
    g = d.geometry
    common: list[tuple[str, Any, type]] = [
        ("unknown kind", dataclasses.replace(d, kind="carrier_pigeon"), DescriptorError),
        ("layout version", dataclasses.replace(d, layout_version=99), DescriptorError),
        ("generation 0", dataclasses.replace(d, generation=0), DescriptorError),
        ("dtype", dataclasses.replace(d, dtype="float16"), DescriptorError),
        ("negative offset", dataclasses.replace(d, offset=-4096), DescriptorError),
        (
            "depth 0",
            dataclasses.replace(d, geometry=dataclasses.replace(g, depth=0)),
            DescriptorError,
        ),
        (
            "duplicate table",
            dataclasses.replace(
                d, geometry=dataclasses.replace(g, tables=(g.tables[0], g.tables[0]))
            ),
            DescriptorError,
        ),
    ]
    if kind == "stream":
        return common
    mapped = [
        ("size", dataclasses.replace(d, size_bytes=d.size_bytes + 4096), DescriptorError),
        ("missing path", dataclasses.replace(d, path=d.path + "-gone"), DescriptorError),
        ("empty path", dataclasses.replace(d, path=""), DescriptorError),
        ("stale generation", dataclasses.replace(d, generation=d.generation + 1), DescriptorError),
    ]
    if kind == "shm":
        return common + mapped
    ipc = [
        ("no handle", dataclasses.replace(d, ipc_handle=b""), DescriptorError),
        ("short handle", dataclasses.replace(d, ipc_handle=d.ipc_handle[:-1]), DescriptorError),
        ("events", dataclasses.replace(d, event_handles=d.event_handles[:-1]), DescriptorError),
        ("own export", dataclasses.replace(d, exporter_pid=reader_pid), DescriptorError),
        ("no exporter", dataclasses.replace(d, exporter_pid=0), DescriptorError),
    ]
    if kind == "cpu_ipc":
        from pagekeeper_client.transports.cpu_ipc import MemfdHandle

        handle = MemfdHandle.unpack(d.ipc_handle)
        ipc += [
            (
                "other inode",
                dataclasses.replace(
                    d, ipc_handle=dataclasses.replace(handle, st_ino=handle.st_ino + 1).pack()
                ),
                DescriptorError,
            ),
            (
                "other fd",
                dataclasses.replace(
                    d, ipc_handle=dataclasses.replace(handle, fd=handle.fd + 100).pack()
                ),
                DescriptorError,
            ),
            (
                "event of another slot",
                dataclasses.replace(d, event_handles=d.event_handles[::-1]),
                DescriptorError,
            ),
        ]
    if kind == "cuda_ipc":
        if d.ipc_handle[1:2] == b"c":  # torch's handle of a cudaMalloc block
            ipc.append(
                (
                    "long handle",
                    dataclasses.replace(d, ipc_handle=d.ipc_handle + b"\0"),
                    DescriptorError,
                )
            )
        ipc += [
            (
                "gpu uuid",
                dataclasses.replace(d, gpu_uuid="GPU-00000000-0000-0000-0000-000000000000"),
                DescriptorError,
            ),
            (
                "event size",
                dataclasses.replace(d, event_handles=(b"x",) * g.depth),
                DescriptorError,
            ),
        ]
    return common + mapped + ipc


@pytest.mark.parametrize("kind", KINDS)
def test_descriptor_validation(kind: str, make_ring: Any) -> None:
    ring = make_ring(kind)
    reader = ring.readers[0]
    ring.publish(0, pattern_batch(0, GEOMETRY))
    descriptor = ring.publisher.descriptor()
    for name, bad, error in _mutations(kind, descriptor, reader.pid):
        with pytest.raises(error):
            reader.open(bad)
            pytest.fail(f"{kind}: the descriptor with a bad {name} was accepted")
    # The untouched descriptor still opens and reads.
    view = ring.open(reader)
    assert_same(reader.call("wait", view, 0, 1.0, True), 0, pattern_batch(0, GEOMETRY))


@pytest.mark.parametrize("kind", ["cpu_ipc", pytest.param("cuda_ipc", marks=NEEDS_CUDA)])
def test_importer_never_opens_its_own_export(kind: str, make_ring: Any) -> None:
    ring = make_ring(kind)
    with pytest.raises(DescriptorError, match="own export"):
        open_table_view(ring.publisher.descriptor())
