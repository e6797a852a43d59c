"""Reference paged attention through kernel block tables equals dense attention over each
request's contiguous K/V, and a wrong table makes it differ."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from typing import Any

import numpy as np
import pytest
import torch

from pagekeeper.core.tables import expand_to_kernel_blocks, slot_mapping
from pagekeeper.publish import RingGeometry, create_publisher
from pagekeeper_client.attention import ReferencePagedAttention, dense_attention
from pagekeeper_client.transports import open_table_view, pack_slot, unpack_slot
from tests.attention._scenario import (
    HEAD_DIM,
    NUM_KV_HEADS,
    batch_tables,
    make_scenario,
    max_error,
    prepare_cache,
    reference,
    run_step,
)

TOLERANCE = 1e-5
# (page_size, kernel_block_size): every kernel block size a backend may ask for (16/32/64),
# page sizes from 16 up to 1056 (a hybrid-model page: 1056 = 66 x 16 = 33 x 32).
CONFIGS = [
    (16, 16),
    (32, 16),
    (32, 32),
    (64, 16),
    (64, 32),
    (64, 64),
    (128, 64),
    (272, 16),
    (544, 32),
    (576, 64),
    (1056, 16),
    (1056, 32),
]


@pytest.mark.parametrize(("page_size", "kernel_block_size"), CONFIGS)
def test_paged_equals_dense_with_shared_prefix(page_size: int, kernel_block_size: int) -> None:
    scenario = make_scenario(page_size, kernel_block_size, seed=page_size * 7 + kernel_block_size)
    a, b = scenario.requests[0], scenario.requests[1]
    assert a.page_ids[:2] == b.page_ids[:2]  # two requests read the same pages
    assert max_error(scenario, batch_tables(scenario)) < TOLERANCE


@pytest.mark.parametrize(
    ("page_size", "kernel_block_size", "window"),
    [(16, 16, 27), (32, 16, 51), (64, 32, 100), (128, 64, 200), (1056, 32, 1500)],
)
def test_sliding_window_with_null_pages(
    page_size: int, kernel_block_size: int, window: int
) -> None:
    scenario = make_scenario(page_size, kernel_block_size, seed=window, window=window)
    assert 0 in scenario.requests[0].page_ids  # pages before the window are the null page
    tables = batch_tables(scenario)
    assert max_error(scenario, tables) < TOLERANCE
    # Without the window the early (null, never written) pages would be needed.
    full = dataclasses.replace(scenario, window=None)
    assert not max_error(full, tables) < TOLERANCE


@pytest.mark.parametrize(("page_size", "kernel_block_size"), CONFIGS)
def test_wrong_expansion_ratio_is_caught(page_size: int, kernel_block_size: int) -> None:
    """Expanding with r+1 (or r-1) instead of r reads the wrong kernel blocks: the comparison
    must fail, or the too-short table must be refused."""
    scenario = make_scenario(page_size, kernel_block_size, seed=page_size + kernel_block_size)
    r = scenario.ratio
    assert max_error(scenario, batch_tables(scenario)) < TOLERANCE  # the control
    error = max_error(scenario, batch_tables(scenario, ratio=r + 1))
    assert not error < TOLERANCE, f"ratio {r + 1} instead of {r} went unnoticed"
    if r > 1:
        try:
            error = max_error(scenario, batch_tables(scenario, ratio=r - 1))
        except ValueError as exc:
            assert "kernel blocks" in str(exc)
        else:
            assert not error < TOLERANCE, f"ratio {r - 1} instead of {r} went unnoticed"


def test_preemption_and_readmission() -> None:
    """A is preempted; D reuses one of A's freed pages (overwriting it); A is re-admitted
    with its still-cached prefix pages and a new page, and recomputes. The new tables are
    right; A's stale pre-preemption table is caught."""
    page_size, kbs = 64, 16
    scenario = make_scenario(page_size, kbs, seed=99)
    a = scenario.requests[0]
    old_pages = list(a.page_ids)
    # D (not in this batch) took A's last page and wrote its own tokens there.
    d_k, d_v = (
        torch.randn(page_size, NUM_KV_HEADS, HEAD_DIM),
        torch.randn(page_size, NUM_KV_HEADS, HEAD_DIM),
    )
    scenario.extra_writes.append(([old_pages[-1]], page_size, d_k, d_v))
    # A comes back: prefix hit on its first two pages, a fresh page for the rest.
    fresh = scenario.num_pages // 2 - 1
    assert fresh not in {p for r in scenario.requests for p in r.page_ids}
    a.page_ids[-1] = fresh
    assert max_error(scenario, batch_tables(scenario)) < TOLERANCE
    stale = batch_tables(scenario)
    ratio = scenario.ratio
    stale.block_table[0, : len(old_pages) * ratio] = expand_to_kernel_blocks(
        np.array(old_pages, np.int32), ratio
    )
    # The new tokens still go to A's current page; the stale table reads D's page.
    assert not max_error(scenario, stale) < TOLERANCE


def test_write_kv_and_attention_validate_their_inputs() -> None:
    cache = ReferencePagedAttention.for_pages(
        num_pages=4, page_size=32, kernel_block_size=16, num_kv_heads=1, head_dim=4
    )
    k = torch.zeros(2, 1, 4)
    with pytest.raises(IndexError):
        cache.write_kv(torch.tensor([0, 4 * 32]), k, k)
    cache.write_kv(torch.tensor([-1, 5]), torch.ones(2, 1, 4), torch.ones(2, 1, 4))
    assert torch.isnan(cache.k_cache.view(-1, 1, 4)[4]).all()  # untouched
    assert (cache.k_cache.view(-1, 1, 4)[5] == 1).all()
    with pytest.raises(ValueError, match="kernel blocks"):
        cache.paged_attention(
            torch.zeros(1, 1, 4), torch.tensor([[2, 3]]), [40], [1], row_lengths=[2]
        )
    with pytest.raises(ValueError):
        ReferencePagedAttention.for_pages(
            num_pages=4, page_size=24, kernel_block_size=16, num_kv_heads=1, head_dim=4
        )


def test_dense_attention_matches_a_hand_computation() -> None:
    """Anchor the baseline itself: one query over three keys, with and without a window."""
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[2.0, 0.0]]])
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[0.0, 0.0]]])
    scores = torch.tensor([1.0, 0.0, 2.0]) / 2**0.5
    weights = torch.softmax(scores, 0)
    expected = weights[0] * v[0, 0] + weights[1] * v[1, 0]
    torch.testing.assert_close(dense_attention(q, k, v)[0, 0], expected)
    windowed = torch.softmax(scores[1:], 0)[0] * v[1, 0]
    torch.testing.assert_close(dense_attention(q, k, v, sliding_window=2)[0, 0], windowed)


# -- through the publication transports -----------------------------------------------------


def _step_from(scenario: Any, tensors: Any) -> float:
    table = tensors.table(0)
    cache = prepare_cache(scenario)
    out = run_step(scenario, cache, table.block_table, table.row_lengths, table.slot_mapping)
    return float((out - reference(scenario)).abs().max())


def test_published_tables_drive_the_attention_shm_and_stream(tmp_path: Any) -> None:
    scenario = make_scenario(1056, 32, seed=5)
    tables = batch_tables(scenario)
    geometry = RingGeometry(depth=2, max_num_reqs=8, max_num_tokens=64, tables=((0, 32, 4 * 33),))
    publisher: Any = create_publisher("shm", geometry, shm_dir=str(tmp_path))
    publisher.publish(11, [tables])
    view = open_table_view(publisher.descriptor())
    assert _step_from(scenario, view.wait_tensors(11, timeout=1, copy=False)) < TOLERANCE
    view.close()
    publisher.close()
    payload = pack_slot(11, 1, [tables])
    assert _step_from(scenario, unpack_slot(payload).to_torch()) < TOLERANCE


def _worker(descriptor: Any, step: int, page_size: int, kbs: int, seed: int) -> float:
    """A worker process: read the published step, write the new K/V at the published slots,
    attend through the published table; return the error against dense attention."""
    view = open_table_view(descriptor)
    tensors = view.wait_tensors(step, timeout=60)
    error = _step_from(make_scenario(page_size, kbs, seed=seed), tensors)
    view.close()
    return error


@pytest.fixture(scope="module")
def worker_pool() -> Any:
    """Two worker processes (spawned once: each imports torch)."""
    with mp.get_context("spawn").Pool(2) as pool:
        yield pool


@pytest.mark.parametrize("kind", ["shm", "cpu_ipc"])
def test_two_worker_processes_read_the_same_published_batch(
    kind: str, tmp_path: Any, worker_pool: Any
) -> None:
    page_size, kbs, seed = 272, 16, 3
    scenario = make_scenario(page_size, kbs, seed=seed)
    tables = batch_tables(scenario)
    geometry = RingGeometry(
        depth=2, max_num_reqs=8, max_num_tokens=64, tables=((0, kbs, tables.block_table.shape[1]),)
    )
    publisher: Any = create_publisher(kind, geometry, shm_dir=str(tmp_path))
    pending = [
        worker_pool.apply_async(_worker, (publisher.descriptor(), 4, page_size, kbs, seed))
        for _ in range(2)
    ]
    publisher.publish(4, [tables])  # the workers are (probably) already waiting
    errors = [p.get(timeout=120) for p in pending]
    publisher.close()
    assert all(e < TOLERANCE for e in errors), errors


def test_slot_mapping_is_independent_of_the_kernel_block_size() -> None:
    """The property that lets one published slot mapping serve every kernel block size."""
    scenario = make_scenario(1056, 16, seed=1)
    for kbs in (16, 32):
        other = dataclasses.replace(scenario, kernel_block_size=kbs)
        np.testing.assert_array_equal(
            batch_tables(other).slot_mapping, batch_tables(scenario).slot_mapping
        )
    table = np.array([[3, 5]], np.int32)
    positions = np.arange(1000, 1100)
    expected = np.where(positions < 1056, 3 * 1056 + positions, 5 * 1056 + positions - 1056)
    np.testing.assert_array_equal(slot_mapping(table, [1000], [100], 1056), expected)
