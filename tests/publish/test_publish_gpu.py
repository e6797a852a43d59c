"""GPU paths of the publication (run by ``scripts/gpu_smoke.sh``; skipped without CUDA):

- a shared-memory ring read onto the device (pinned staging, and cudaHostRegister),
- cuda_ipc views that are the imported ring itself (zero-copy, in place),
- the reference paged attention on the GPU driven by tables read from a cuda_ipc ring.

The cuda_ipc contract (round trip, torn writes, staleness, close, validation) is the
``cuda_ipc`` case of test_publish_contract.py.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from pagekeeper.publish import RingGeometry, create_publisher
from tests.publish._publish_harness import RemoteReader, pattern_arrays
from tests.publish.test_publish_contract import pattern_batch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs torch.cuda.is_available() (no GPU here)"
)

GEOMETRY = RingGeometry(
    depth=2, max_num_reqs=16, max_num_tokens=128, tables=((0, 16, 64), (1, 32, 32))
)


@pytest.fixture(scope="module")
def reader() -> Iterator[RemoteReader]:
    remote = RemoteReader()
    yield remote
    remote.shutdown()


def _check(wire: Any, step: int) -> None:
    step_seq, num_reqs, tables = wire
    assert step_seq == step
    for i, (_, _, bt_dtype, sm_dtype, device, bt, rl, sm) in enumerate(tables):
        max_cols = GEOMETRY.tables[i][2]
        want = pattern_arrays(step, i, GEOMETRY.max_num_reqs, max_cols, GEOMETRY.max_num_tokens)
        assert device == "cuda:0" and (bt_dtype, sm_dtype) == ("torch.int32", "torch.int64")
        assert num_reqs == want[0].shape[0]
        np.testing.assert_array_equal(bt, want[0])
        np.testing.assert_array_equal(rl, want[1])
        np.testing.assert_array_equal(sm, want[2])


@pytest.mark.parametrize("pin", ["staging", "register"])
def test_shm_ring_copied_to_the_device(pin: str, reader: RemoteReader) -> None:
    publisher: Any = create_publisher("shm", GEOMETRY)
    view = reader.open(publisher.descriptor(), pin=pin)
    # More steps than slots: staging buffers and device slots get reused.
    for step in range(5):
        publisher.publish(step, pattern_batch(step, GEOMETRY))
        _check(reader.call("wait_tensors", view, step, 10.0, "cuda:0"), step)
    reader.call("close", view)
    publisher.close()


def test_cuda_ipc_views_are_the_imported_ring(reader: RemoteReader) -> None:
    publisher: Any = create_publisher("cuda_ipc", GEOMETRY, device="cuda:0")
    descriptor = publisher.descriptor()
    view = reader.open(descriptor)
    publisher.publish(0, pattern_batch(0, GEOMETRY))
    publisher.publish(1, pattern_batch(1, GEOMETRY))
    first = reader.call("tensor_storage", view, 0, 10.0)
    second = reader.call("tensor_storage", view, 1, 10.0)
    assert first["device"] == "cuda:0" and first["is_current"]
    # Views of one imported allocation (the whole ring), one slot stride apart.
    assert first["storage_nbytes"] == second["storage_nbytes"] == descriptor.size_bytes
    stride = publisher._layout.slot_data_stride
    assert second["data_ptr"] - first["data_ptr"] == stride
    # The exporter's own device bytes hold what the reader saw.
    slot0 = publisher.device_slot(0)[: 4 * 64].view(torch.int32).cpu().numpy()
    want = pattern_arrays(0, 0, GEOMETRY.max_num_reqs, 64, GEOMETRY.max_num_tokens)[0]
    np.testing.assert_array_equal(slot0[: want.shape[1]], want[0])
    reader.call("close", view)
    publisher.close()


def _gpu_attention_worker(descriptor: Any, step: int, page_size: int, kbs: int, seed: int) -> float:
    """Worker process: the KV cache on the GPU, tables read in place from the cuda_ipc ring."""
    from pagekeeper_client.transports import open_table_view
    from tests.attention._scenario import make_scenario, new_kv, prepare_cache, reference

    scenario = make_scenario(page_size, kbs, seed=seed)
    cache = prepare_cache(scenario)
    cache.k_cache = cache.k_cache.cuda()
    cache.v_cache = cache.v_cache.cuda()
    view = open_table_view(descriptor)
    table = view.wait_tensors(step, timeout=60).table(0)
    assert table.block_table.is_cuda
    k, v = new_kv(scenario)
    cache.write_kv(table.slot_mapping, k, v)
    out = cache.paged_attention(
        scenario.q.cuda(),
        table.block_table,
        scenario.seq_lens,
        scenario.query_lens,
        row_lengths=table.row_lengths.cpu(),
    )
    torch.cuda.synchronize()
    assert view.is_current(step)  # the ring was not rewritten under the kernel
    error = float((out.cpu() - reference(scenario)).abs().max())
    view.close()
    return error


def test_reference_attention_on_the_gpu_from_a_cuda_ipc_ring() -> None:
    from tests.attention._scenario import batch_tables, make_scenario

    page_size, kbs, seed = 544, 32, 8
    tables = batch_tables(make_scenario(page_size, kbs, seed=seed))
    geometry = RingGeometry(
        depth=2, max_num_reqs=8, max_num_tokens=64, tables=((0, kbs, tables.block_table.shape[1]),)
    )
    publisher: Any = create_publisher("cuda_ipc", geometry, device="cuda:0")
    with mp.get_context("spawn").Pool(2) as pool:
        pending = [
            pool.apply_async(
                _gpu_attention_worker, (publisher.descriptor(), 3, page_size, kbs, seed)
            )
            for _ in range(2)
        ]
        publisher.publish(3, [tables])
        errors = [p.get(timeout=300) for p in pending]
    publisher.close()
    assert all(e < 1e-4 for e in errors), errors
