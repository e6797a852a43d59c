"""Unit tests of the ring layout, the seqlock edge cases, the stream packing and the
publisher factory (the cross-process contract is in test_publish_contract.py)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from pagekeeper.core.errors import FailedPrecondition, InvalidArgument
from pagekeeper.core.types import BatchTables
from pagekeeper.publish import RingGeometry, create_publisher
from pagekeeper.publish.shm import ShmPublisher
from pagekeeper.publish.stream import StreamPublisher
from pagekeeper_client.ring import (
    ALIGN,
    PAGE,
    DescriptorError,
    ReaderFellBehind,
    RingClosed,
    RingLayout,
    SlotFormatError,
    StepTimeout,
)
from pagekeeper_client.transports import open_table_view, pack_slot, unpack_slot
from pagekeeper_client.transports.stream import StreamTableView

GEOMETRY = RingGeometry(depth=2, max_num_reqs=5, max_num_tokens=9, tables=((0, 16, 7), (2, 64, 3)))


def batch(step: int, num_reqs: int = 3, geometry: RingGeometry = GEOMETRY) -> list[BatchTables]:
    out = []
    for group_id, kbs, cols in geometry.tables:
        bt = np.arange(num_reqs * cols, dtype=np.int32).reshape(num_reqs, cols) + 100 * step
        out.append(
            BatchTables(
                group_id,
                kbs,
                bt,
                np.full(num_reqs, min(cols, 2), np.int32),
                np.arange(4, dtype=np.int64) + 1000 * step,
                pad_id=-1,
            )
        )
    return out


# -- layout ---------------------------------------------------------------------------------


def test_layout_is_aligned_and_sized_from_the_geometry() -> None:
    layout = RingLayout.for_geometry(GEOMETRY)
    assert layout.control_bytes % PAGE == 0 and layout.slot_data_stride % PAGE == 0
    offsets = []
    for t in layout.tables:
        for offset in (t.block_table_offset, t.row_lengths_offset, t.slot_mapping_offset):
            assert offset % ALIGN == 0
            offsets.append(offset)
    assert offsets == sorted(offsets)
    last = layout.tables[-1]
    assert last.slot_mapping_offset + 8 * GEOMETRY.max_num_tokens <= layout.slot_data_stride
    # table 0's block table: 5 rows x 7 cols int32 = 140 bytes, rounded to 192
    assert layout.tables[0].row_lengths_offset == 192
    assert layout.data_bytes == GEOMETRY.depth * layout.slot_data_stride
    assert layout.embedded_bytes == layout.control_bytes + layout.data_bytes


@pytest.mark.parametrize(
    "geometry",
    [
        RingGeometry(depth=0, tables=((0, 16, 4),)),
        RingGeometry(max_num_reqs=0, tables=((0, 16, 4),)),
        RingGeometry(tables=()),
        RingGeometry(tables=((0, 0, 4),)),
        RingGeometry(tables=((0, 16, 4), (0, 16, 8))),
        RingGeometry(max_num_reqs=1 << 20, tables=((0, 16, 1 << 20),)),
    ],
)
def test_bad_geometry_is_rejected(geometry: RingGeometry) -> None:
    with pytest.raises(DescriptorError):
        RingLayout.for_geometry(geometry)
    with pytest.raises(InvalidArgument):
        create_publisher("shm", geometry)


def test_factory_rejects_unknown_kinds_and_cuda_without_a_gpu() -> None:
    with pytest.raises(InvalidArgument, match="unknown publisher kind"):
        create_publisher("carrier_pigeon", GEOMETRY)
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the cuda_ipc publisher would be built")
    with pytest.raises(FailedPrecondition, match="CUDA is not available"):
        create_publisher("cuda_ipc", GEOMETRY)


def test_corrupt_header_is_refused(tmp_path: Any) -> None:
    with ShmPublisher(GEOMETRY, shm_dir=str(tmp_path)) as publisher:
        descriptor = publisher.descriptor()
        with open(descriptor.path, "r+b") as f:
            f.write(b"NOTARING")
        with pytest.raises(DescriptorError, match="bad magic"):
            open_table_view(descriptor)


# -- seqlock edge cases (in-process shm) ---------------------------------------------------------


def test_a_slot_being_written_is_never_returned(tmp_path: Any, monkeypatch: Any) -> None:
    """The writer stops half-way through step 2 (which overwrites step 0's slot): a reader
    of step 2 gets a timeout, one of step 0 that it fell behind (a later step is out and
    step 0's slot is being rewritten), never the half-written bytes; then step 2 reads."""
    publisher = ShmPublisher(GEOMETRY, shm_dir=str(tmp_path))
    view = open_table_view(publisher.descriptor())
    publisher.publish(0, batch(0))
    publisher.publish(1, batch(1))
    inside, release = threading.Event(), threading.Event()
    original = publisher._write_data

    def paused_write(*args: Any) -> None:
        original(*args)
        inside.set()
        assert release.wait(10)

    monkeypatch.setattr(publisher, "_write_data", paused_write)
    writer = threading.Thread(target=publisher.publish, args=(2, batch(2)))
    writer.start()
    assert inside.wait(10)
    try:
        with pytest.raises(StepTimeout):
            view.wait(2, timeout=0.05)
        with pytest.raises(ReaderFellBehind):
            view.wait(0, timeout=0.05)
        assert view.wait(1, timeout=0.05).step_seq == 1  # the other slot is untouched
    finally:
        release.set()
    assert view.stats.num_busy_polls > 0
    assert view.wait(1, timeout=0.05).step_seq == 1  # the other slot is untouched
    release.set()
    writer.join()
    got = view.wait(2, timeout=1.0)
    np.testing.assert_array_equal(got.table(0).block_table, batch(2)[0].block_table)
    with pytest.raises(ReaderFellBehind):
        view.wait(0, timeout=0.05)
    view.close()
    publisher.close()


def test_overwrite_during_a_copy_raises_fell_behind(tmp_path: Any) -> None:
    """The writer laps the reader between its seq check and its re-check."""
    publisher = ShmPublisher(GEOMETRY, shm_dir=str(tmp_path))
    view: Any = open_table_view(publisher.descriptor())
    publisher.publish(0, batch(0))
    publisher.publish(1, batch(1))
    original = view._read_meta

    def overwrite_after_meta(*next_steps: int) -> Any:
        def read_meta(slot: int) -> Any:
            result = original(slot)
            for step in next_steps:  # the last lands in the slot being read (depth 2)
                publisher.publish(step, batch(step))
            return result

        return read_meta

    view._read_meta = overwrite_after_meta(2)
    with pytest.raises(ReaderFellBehind, match="overwritten while it was being read"):
        view.wait(0, timeout=1.0, copy=True)
    view._read_meta = overwrite_after_meta(3, 4)
    with pytest.raises(ReaderFellBehind, match="overwritten while it was being read"):
        view.wait(2, timeout=1.0, copy=False)
    view._read_meta = original
    assert view.wait(4, timeout=1.0).step_seq == 4
    view.close()
    publisher.close()


def test_zero_copy_views_are_valid_until_step_plus_depth(tmp_path: Any) -> None:
    publisher = ShmPublisher(GEOMETRY, shm_dir=str(tmp_path))
    view = open_table_view(publisher.descriptor())
    publisher.publish(0, batch(0))
    step = view.wait(0, copy=False)
    assert not step.is_copy and not step.table(0).block_table.flags.writeable
    publisher.publish(1, batch(1))
    assert view.is_current(0)
    np.testing.assert_array_equal(step.table(2).block_table, batch(0)[1].block_table)
    publisher.publish(2, batch(2))
    assert not view.is_current(0)
    del step
    view.close()
    publisher.close()


def test_wait_tensors_on_cpu_zero_copy_and_copy(tmp_path: Any) -> None:
    import torch

    publisher = ShmPublisher(GEOMETRY, shm_dir=str(tmp_path))
    view: Any = open_table_view(publisher.descriptor())
    publisher.publish(7, batch(7, num_reqs=5))
    for copy in (True, False):
        tensors = view.wait_tensors(7, timeout=1.0, copy=copy)
        table = tensors.table(2, 64)
        assert table.block_table.dtype == torch.int32 and table.slot_mapping.dtype == torch.int64
        assert tensors.num_reqs == 5 and table.block_table.shape == (5, 3)
        assert torch.equal(table.block_table, torch.from_numpy(batch(7, num_reqs=5)[1].block_table))
    with pytest.raises(ValueError):
        view.wait_tensors(7, device="meta")
    view.close()
    publisher.close()


def test_sleeping_readers_are_woken_by_publish_and_close(tmp_path: Any, monkeypatch: Any) -> None:
    """A reader asleep in the kernel (futex) is woken by the publish of its slot and by
    close, not by its periodic re-check (pushed out to 30 s here)."""
    from pagekeeper_client import _futex
    from pagekeeper_client.transports import _mapped

    if not _futex.AVAILABLE:
        pytest.skip("no futex on this platform: readers poll with backoff")
    monkeypatch.setattr(_mapped, "FUTEX_MAX_WAIT_SECONDS", 30.0)
    publisher = ShmPublisher(GEOMETRY, shm_dir=str(tmp_path))
    view = open_table_view(publisher.descriptor())
    results: list[Any] = []

    def wait(step: int) -> None:
        try:
            results.append(view.wait(step, timeout=60).step_seq)
        except Exception as exc:
            results.append(exc)

    for step, act in ((5, lambda: publisher.publish(5, batch(5))), (6, publisher.close)):
        reader = threading.Thread(target=wait, args=(step,))
        reader.start()
        deadline = time.monotonic() + 10
        while view.stats.num_sleeps == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # well inside the futex sleep now
        sleeps = view.stats.num_sleeps
        started = time.monotonic()
        act()
        reader.join(10)
        assert time.monotonic() - started < 5, "the reader was not woken"
        assert view.stats.num_sleeps - sleeps <= 2
    assert results[0] == 5 and isinstance(results[1], RingClosed)
    view.close()


# -- shm lifetime ---------------------------------------------------------------------------------


def test_an_unrelated_reader_exiting_does_not_remove_the_ring(tmp_path: Any) -> None:
    """The multiprocessing.shared_memory pitfall: a reader process that attaches and exits
    must leave the segment alone."""
    publisher = ShmPublisher(GEOMETRY, shm_dir=str(tmp_path))
    publisher.publish(0, batch(0))
    descriptor = publisher.descriptor()
    code = (
        "import sys, pickle; from pagekeeper_client.transports import open_table_view;"
        "d = pickle.loads(sys.stdin.buffer.read()); v = open_table_view(d);"
        "print(v.wait(0, timeout=5).num_reqs)"
    )
    import pickle

    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=pickle.dumps(descriptor),
            capture_output=True,
            check=True,
            timeout=60,
        )
        assert out.stdout.strip() == b"3"
    assert os.path.exists(descriptor.path)
    view = open_table_view(descriptor)
    assert view.wait(0, timeout=1).num_reqs == 3
    view.close()
    publisher.close()
    assert not os.path.exists(descriptor.path)


def test_garbage_collected_publisher_unlinks_its_file(tmp_path: Any) -> None:
    publisher = ShmPublisher(GEOMETRY, shm_dir=str(tmp_path))
    path = publisher.descriptor().path
    assert os.path.exists(path)
    del publisher
    import gc

    gc.collect()
    assert not os.path.exists(path)


def _export_and_exit(conn: Any, shm_dir: str) -> None:  # runs in a child process
    from pagekeeper.publish.cpu_ipc import CpuIpcPublisher

    publisher = CpuIpcPublisher(GEOMETRY, shm_dir=shm_dir)
    publisher.publish(0, batch(0))
    conn.send(publisher.descriptor())
    conn.recv()  # exit when told, without closing explicitly


def test_cpu_ipc_import_fails_clearly_once_the_exporter_is_gone(tmp_path: Any) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_export_and_exit, args=(child, str(tmp_path)))
    process.start()
    descriptor = parent.recv()
    view = open_table_view(descriptor)  # another process: allowed
    assert view.wait(0, timeout=5).num_reqs == 3
    parent.send("exit")
    process.join(30)
    with pytest.raises(DescriptorError):
        open_table_view(descriptor)
    # The import made while it lived is invalidated by its (finalizer) close.
    with pytest.raises(RingClosed):
        view.wait(0, timeout=1)
    view.close()


# -- stream packing -------------------------------------------------------------------------------


def test_pack_unpack_round_trip_and_zero_copy() -> None:
    tables = batch(3)
    payload = pack_slot(3, 42, tables)
    step = unpack_slot(payload)
    assert (step.step_seq, step.epoch, step.num_reqs) == (3, 42, 3)
    for got, want in zip(step.tables, tables, strict=True):
        assert (got.group_id, got.kernel_block_size, got.pad_id) == (
            want.group_id,
            want.kernel_block_size,
            want.pad_id,
        )
        np.testing.assert_array_equal(got.block_table, want.block_table)
        np.testing.assert_array_equal(got.row_lengths, want.row_lengths)
        np.testing.assert_array_equal(got.slot_mapping, want.slot_mapping)
        assert not got.block_table.flags.writeable  # a view of the immutable message
    empty = unpack_slot(pack_slot(4, 42, batch(4, num_reqs=0)))
    assert empty.num_reqs == 0 and empty.table(0).block_table.shape == (0, 7)


def test_pack_rejects_wrong_dtypes_and_shapes() -> None:
    tables = batch(1)
    with pytest.raises(ValueError, match="dtypes"):
        pack_slot(1, 1, [dataclasses.replace(tables[0], slot_mapping=np.zeros(2, np.int32))])
    with pytest.raises(ValueError, match="shapes"):
        pack_slot(
            1, 1, [tables[0], dataclasses.replace(tables[1], row_lengths=np.zeros(9, np.int32))]
        )
    with pytest.raises(ValueError):
        pack_slot(1, 1, [])


@pytest.mark.parametrize(
    "mangle",
    [
        lambda p: p[:10],
        lambda p: b"XXXXXXXX" + p[8:],
        lambda p: p[:8] + (9).to_bytes(4, "little") + p[12:],
        lambda p: p[:-8],
        lambda p: p + b"\0" * 8,
        lambda p: p[:12] + (0).to_bytes(4, "little") + p[16:],
    ],
    ids=["short", "magic", "version", "truncated", "trailing", "no tables"],
)
def test_unpack_rejects_malformed_payloads(mangle: Any) -> None:
    with pytest.raises(SlotFormatError):
        unpack_slot(mangle(pack_slot(1, 1, batch(1))))


def test_stream_view_rules() -> None:
    publisher = StreamPublisher(GEOMETRY)
    view = StreamTableView(publisher.descriptor())
    received: list[int] = []
    unsubscribe = publisher.add_listener(lambda step, payload: received.append(view.feed(payload)))
    publisher.publish(0, batch(0))
    publisher.publish(1, batch(1))
    assert received == [0, 1] and view.latest_step() == 1
    with pytest.raises(SlotFormatError, match="arrived after"):
        view.feed(publisher.message(1) or b"")
    with pytest.raises(SlotFormatError, match="generation"):
        view.feed(pack_slot(5, publisher.generation + 1, batch(5)))
    with pytest.raises(SlotFormatError, match="exceeds the geometry"):
        wide = batch(5)
        wide[1] = dataclasses.replace(wide[1], block_table=np.zeros((3, 4), np.int32))
        view.feed(pack_slot(5, publisher.generation, wide))
    with pytest.raises(SlotFormatError, match="tables"):
        view.feed(pack_slot(5, publisher.generation, batch(5)[:1]))
    publisher.publish(2, batch(2))
    with pytest.raises(ReaderFellBehind):
        view.wait(0, timeout=0)
    assert view.wait(1, timeout=0).step_seq == 1
    got = view.wait(2, timeout=0, copy=True)
    assert got.table(0).block_table.flags.writeable
    assert publisher.wait_message(1, timeout=0) == (2, publisher.message(2))
    assert publisher.wait_message(2, timeout=0.01) is None
    unsubscribe()
    threading.Timer(0.05, view.mark_closed).start()
    with pytest.raises(RingClosed, match="stream ended"):
        view.wait(3, timeout=5)
    publisher.close()
    with pytest.raises(FailedPrecondition):
        publisher.wait_message(0, timeout=0)


def test_cuda_memory_handles_torch_would_misread_are_refused() -> None:
    """torch copies a handle out of its bytes without checking their length (a truncated one
    opened on an H200); the importer checks the forms it knows, without needing a GPU."""
    from pagekeeper_client.transports.cuda_ipc import check_memory_handle

    raw = bytes(range(1, 65))  # a cudaIpcMemHandle_t (64 bytes)
    for version in (1, 2):  # torch's versioned form of a cudaMalloc block (2 in torch 2.11)
        check_memory_handle(bytes([version]) + b"c" + raw)
    check_memory_handle(b"\x02e" + raw * 3)  # an expandable segment's: left to torch
    for bad, match in (
        (b"", "0 bytes is not"),
        (b"\x02c", "2 bytes is not"),
        (b"\x02c" + raw[:-1], "is 66 bytes, got 65"),
        (b"\x02c" + raw + b"\0", "is 66 bytes, got 67"),
    ):
        with pytest.raises(DescriptorError, match=match):
            check_memory_handle(bad)
