"""Batch table build, kernel expansion and slot mapping: pagekeeper vs vLLM's worker BlockTable.

Workload (one scheduling step of one KV-cache group), page_size 64, kernel_block_size 16
(r = 4):
  * 256 running requests x 128 pages each: the batch's kernel block table [256, 512] int32
    (and a ragged variant, 1-128 pages per row, as real batches are);
  * slot mapping of 8,192 scheduled tokens over those 256 rows (224 decodes of one token,
    32 prefill chunks sharing the rest), int64; and of a pure decode step (256 tokens).

pagekeeper keeps each request's pages in a ``PageRows`` store as they are allocated, so a
step is ``gather`` + ``build_batch_tables`` (kernel table, row lengths and slots in one
call). The baseline is what vLLM's GPU worker does per step, measured in the same run with
interleaved repetitions (A B A B ...):
  * ``BlockTable.add_row(block_ids, i)`` per request (vllm/v1/worker/block_table.py), the
    ``commit_block_table`` copy, then ``AttentionGroup.map_to_kernel_block_table``
    (vllm/v1/worker/utils.py: ``torch.add(offsets, table.unsqueeze(-1), alpha=r)``);
  * slot mapping: the model runner's positions (``_prepare_inputs``: request index per token,
    ``_get_cumsum_and_arange``, computed-token offsets; numpy) and the math of
    ``BlockTable.compute_slot_mapping``'s Triton kernel (gather the row's block,
    ``block * block_size + pos % block_size``). The kernel needs a GPU (vLLM's CPU backend a
    compiled ``_C`` op), so its math runs here in vectorised numpy, as vLLM's worker computed
    it on the CPU before the kernel existed: a lower bound on vLLM's CPU cost, without the
    kernel launch and without any bounds check.
When vLLM is not importable, a faithful numpy copy of the same per-request ``add_row``
approach stands in (and says so). torch runs on one thread by default (``--torch-threads``):
the pagekeeper core is single-threaded, and on a shared machine torch's thread pool turns
medians into noise.

Run (vLLM baseline):
  VLLM_TARGET_DEVICE=cpu PYTHONPATH=/work/main/service:/work/main/client \\
      /opt/vllm-anchor/bin/python bench/bench_tables.py
or with the project venv (numpy stand-in): .venv/bin/python bench/bench_tables.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(_ROOT, "service"), os.path.join(_ROOT, "client")]

from pagekeeper.core.tables import PageRows, build_batch_tables, slot_mapping  # noqa: E402

NUM_REQS = 256
PAGES_PER_REQ = 128
PAGE_SIZE = 64
KERNEL_BLOCK_SIZE = 16
RATIO = PAGE_SIZE // KERNEL_BLOCK_SIZE
NUM_TOKENS = 8192
NUM_PREFILLS = 32


# -- workload --------------------------------------------------------------------------------


@dataclass
class Step:
    page_lists: list[list[int]]  # each request's pages, as vLLM's scheduler hands them over
    starts: np.ndarray  # first scheduled position of each row (its computed tokens)
    counts: np.ndarray  # scheduled tokens of each row


def make_step(*, is_ragged: bool, is_decode_only: bool, seed: int = 0) -> Step:
    rng = np.random.default_rng(seed)
    counts = np.ones(NUM_REQS, dtype=np.int64)
    if not is_decode_only:
        prefill_rows = rng.choice(NUM_REQS, NUM_PREFILLS, replace=False)
        chunk, extra = divmod(NUM_TOKENS - (NUM_REQS - NUM_PREFILLS), NUM_PREFILLS)
        counts[prefill_rows] = chunk
        counts[prefill_rows[:extra]] += 1
    if is_ragged:  # each row long enough for its scheduled tokens
        min_pages = -(-counts // PAGE_SIZE)
        lengths = rng.integers(min_pages, PAGES_PER_REQ + 1)
    else:
        lengths = np.full(NUM_REQS, PAGES_PER_REQ)
    # Distinct physical pages, scattered like a pool after some churn.
    all_pages = rng.permutation(np.arange(1, NUM_REQS * PAGES_PER_REQ + 1, dtype=np.int64))
    page_lists = [
        all_pages[i * PAGES_PER_REQ : i * PAGES_PER_REQ + int(n)].tolist()
        for i, n in enumerate(lengths)
    ]
    starts = rng.integers(0, lengths * PAGE_SIZE - counts + 1)
    return Step(page_lists, starts, counts)


# -- pagekeeper --------------------------------------------------------------------------------


class Pagekeeper:
    name = "pagekeeper"

    def __init__(self, step: Step) -> None:
        # Filled as allocations happen (not per step); rows land in arbitrary order.
        self.step = step
        self.rows = PageRows(PAGES_PER_REQ, initial_rows=64)
        self.batch_rows = np.empty(NUM_REQS, dtype=np.int64)
        for i, pages in enumerate(step.page_lists):
            row = self.rows.add_row()
            self.rows.append(row, pages)
            self.batch_rows[i] = row
        self.no_tokens = np.zeros(NUM_REQS, dtype=np.int64)
        self.table, self.num_pages = self.rows.gather(self.batch_rows)

    def build(self) -> np.ndarray:
        """Kernel table only (no scheduled tokens)."""
        table, num_pages = self.rows.gather(self.batch_rows)
        return build_batch_tables(
            table,
            num_pages,
            self.no_tokens,
            self.no_tokens,
            page_size=PAGE_SIZE,
            kernel_block_size=KERNEL_BLOCK_SIZE,
        ).block_table

    def build_from_scratch(self) -> np.ndarray:
        """Rows filled per request inside the timed region, like vLLM's add_row loop."""
        rows = PageRows(PAGES_PER_REQ, initial_rows=NUM_REQS)
        batch = np.empty(NUM_REQS, dtype=np.int64)
        for i, pages in enumerate(self.step.page_lists):
            batch[i] = row = rows.add_row()
            rows.append(row, pages)
        table, num_pages = rows.gather(batch)
        return build_batch_tables(
            table,
            num_pages,
            self.no_tokens,
            self.no_tokens,
            page_size=PAGE_SIZE,
            kernel_block_size=KERNEL_BLOCK_SIZE,
        ).block_table

    def step_slots(self) -> np.ndarray:
        """Slot mapping alone, from the step's gathered table (the baseline, too, reads the
        table it already holds)."""
        return slot_mapping(
            self.table, self.step.starts, self.step.counts, PAGE_SIZE, num_pages=self.num_pages
        )

    def step_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """What the service publishes per step: kernel table + slots, one call."""
        table, num_pages = self.rows.gather(self.batch_rows)
        tables = build_batch_tables(
            table,
            num_pages,
            self.step.starts,
            self.step.counts,
            page_size=PAGE_SIZE,
            kernel_block_size=KERNEL_BLOCK_SIZE,
        )
        return tables.block_table, tables.slot_mapping


# -- baselines ---------------------------------------------------------------------------------


def vllm_positions(
    arange_np: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """GPUModelRunner._prepare_inputs: request index and position of every token."""
    num_reqs = num_scheduled.shape[0]
    req_indices = np.repeat(arange_np[:num_reqs], num_scheduled)
    cu_num_tokens = np.cumsum(num_scheduled)
    total = int(cu_num_tokens[-1])
    cumsums_offsets = np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
    arange = arange_np[:total] - cumsums_offsets
    positions = num_computed[req_indices] + arange
    return req_indices, positions


def kernel_slot_math(
    table: np.ndarray, req_indices: np.ndarray, positions: np.ndarray, out: np.ndarray
) -> np.ndarray:
    """The compute-slot-mapping kernel's math (dcp world size 1), vectorised."""
    block_table_indices = req_indices * table.shape[1] + positions // PAGE_SIZE
    block_numbers = table.ravel()[block_table_indices]
    out = out[: positions.shape[0]]
    np.add(block_numbers * PAGE_SIZE, positions % PAGE_SIZE, out=out)
    return out


class VllmBlockTable:
    """vLLM 0.33's worker BlockTable and AttentionGroup kernel-block mapping, on CPU tensors."""

    name = "vLLM 0.33 BlockTable"

    def __init__(self, step: Step) -> None:
        import torch
        from vllm.v1.worker.block_table import BlockTable
        from vllm.v1.worker.utils import AttentionGroup

        self.step = step
        self.block_table = BlockTable(
            block_size=PAGE_SIZE,
            max_num_reqs=NUM_REQS,
            max_num_blocks_per_req=PAGES_PER_REQ,
            max_num_batched_tokens=NUM_TOKENS,
            pin_memory=False,
            device=torch.device("cpu"),
            cp_kv_cache_interleave_size=1,
        )
        # The fields map_to_kernel_block_table reads, as create_metadata_builders sets them.
        self.group = SimpleNamespace(
            kernel_block_size=KERNEL_BLOCK_SIZE,
            kernel_block_stride=0,
            kv_cache_spec=SimpleNamespace(block_size=PAGE_SIZE),
            kernel_block_table=torch.zeros(
                1,
                NUM_REQS,
                self.block_table.block_table.np.shape[1] * RATIO,
                dtype=torch.int32,
            ),
            kernel_block_offsets=torch.arange(RATIO, dtype=torch.int32),
        )
        self._map = AttentionGroup.map_to_kernel_block_table
        self.arange_np = np.arange(max(NUM_TOKENS, NUM_REQS) + 1, dtype=np.int64)
        self.build()  # rows in place for slots()

    def build(self) -> np.ndarray:
        block_table = self.block_table
        for i, block_ids in enumerate(self.step.page_lists):
            block_table.add_row(block_ids, i)
        block_table.commit_block_table(NUM_REQS)
        out = self._map(self.group, block_table.get_device_tensor(NUM_REQS), 0)
        return out.numpy()

    def slots(self) -> np.ndarray:
        req_indices, positions = vllm_positions(self.arange_np, self.step.starts, self.step.counts)
        return kernel_slot_math(
            self.block_table.block_table.np,
            req_indices,
            positions,
            self.block_table.slot_mapping.np,
        )

    def step_tables(self) -> tuple[np.ndarray, np.ndarray]:
        return self.build(), self.slots()


class NumpyBlockTable:
    """A numpy copy of vLLM's BlockTable.add_row approach, when vLLM is not importable."""

    name = "numpy stand-in for vLLM BlockTable"

    def __init__(self, step: Step) -> None:
        self.step = step
        self.table = np.zeros((NUM_REQS, PAGES_PER_REQ), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(NUM_REQS, dtype=np.int32)
        self.device_table = np.zeros_like(self.table)
        self.kernel_table = np.zeros((NUM_REQS, PAGES_PER_REQ * RATIO), dtype=np.int32)
        self.offsets = np.arange(RATIO, dtype=np.int32)
        self.slot_buffer = np.zeros(NUM_TOKENS, dtype=np.int64)
        self.arange_np = np.arange(max(NUM_TOKENS, NUM_REQS) + 1, dtype=np.int64)
        self.build()

    def _append_row(self, block_ids: list[int], row_idx: int) -> None:
        if not block_ids:
            return
        num_blocks = len(block_ids)
        start = self.num_blocks_per_row[row_idx]
        self.num_blocks_per_row[row_idx] += num_blocks
        self.table[row_idx, start : start + num_blocks] = block_ids

    def build(self) -> np.ndarray:
        for i, block_ids in enumerate(self.step.page_lists):
            self.num_blocks_per_row[i] = 0
            self._append_row(block_ids, i)
        self.device_table[:NUM_REQS] = self.table[:NUM_REQS]
        out = self.kernel_table[:NUM_REQS].reshape(NUM_REQS, PAGES_PER_REQ, RATIO)
        np.add(self.offsets, self.device_table[:NUM_REQS, :, None] * RATIO, out=out)
        return self.kernel_table[:NUM_REQS]

    def slots(self) -> np.ndarray:
        req_indices, positions = vllm_positions(self.arange_np, self.step.starts, self.step.counts)
        return kernel_slot_math(self.table, req_indices, positions, self.slot_buffer)

    def step_tables(self) -> tuple[np.ndarray, np.ndarray]:
        return self.build(), self.slots()


def make_baseline(step: Step, use_vllm: bool) -> Any:
    if use_vllm:
        try:
            return VllmBlockTable(step)
        except Exception as exc:  # any import/setup failure means "no vLLM here"
            print(f"vLLM not usable here ({type(exc).__name__}: {exc}); using the numpy stand-in")
    return NumpyBlockTable(step)


# -- timing ------------------------------------------------------------------------------------


def interleaved(
    a: Callable[[], object], b: Callable[[], object], repeats: int
) -> tuple[float, float, float, float]:
    """Median and minimum microseconds of a and b, run A B A B ... so drift hits both."""
    for _ in range(max(3, repeats // 10)):
        a()
        b()
    times_a, times_b = [], []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        t0 = clock()
        a()
        t1 = clock()
        b()
        t2 = clock()
        times_a.append(t1 - t0)
        times_b.append(t2 - t1)
    return (
        statistics.median(times_a) / 1e3,
        statistics.median(times_b) / 1e3,
        min(times_a) / 1e3,
        min(times_b) / 1e3,
    )


def check_same(ours: Pagekeeper, theirs: Any) -> None:
    """Same answers before any timing: each row's kernel ids and every slot."""
    table, slots = ours.step_tables()
    their_table, their_slots = theirs.step_tables()
    for i, pages in enumerate(ours.step.page_lists):
        n = len(pages) * RATIO
        assert np.array_equal(table[i, :n], their_table[i, :n]), f"row {i} differs"
        assert (table[i, n:] == 0).all(), f"row {i} padding"
    assert np.array_equal(slots, their_slots), "slot mappings differ"
    assert np.array_equal(ours.build_from_scratch(), ours.build())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--numpy-baseline", action="store_true", help="skip vLLM")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    use_vllm = not args.numpy_baseline
    if use_vllm:
        try:
            import torch

            torch.set_num_threads(args.torch_threads)
        except ImportError:
            pass

    full = make_step(is_ragged=False, is_decode_only=False)
    ragged = make_step(is_ragged=True, is_decode_only=False, seed=1)
    decode = make_step(is_ragged=False, is_decode_only=True, seed=2)
    pairs = {}
    for label, step in (("full", full), ("ragged", ragged), ("decode", decode)):
        ours, theirs = Pagekeeper(step), make_baseline(step, use_vllm)
        check_same(ours, theirs)
        pairs[label] = (ours, theirs)
    baseline_name = pairs["full"][1].name

    rows = []

    def measure(label: str, pair: str, method: str, ours_method: str | None = None) -> None:
        ours, theirs = pairs[pair]
        rows.append(
            (
                label,
                *interleaved(
                    getattr(ours, ours_method or method), getattr(theirs, method), args.repeats
                ),
            )
        )

    shape = f"{NUM_REQS}x{PAGES_PER_REQ} p{PAGE_SIZE}/k{KERNEL_BLOCK_SIZE}"
    measure(f"table+expand {shape}", "full", "build")
    measure("  ragged rows (1-128 pages)", "ragged", "build")
    measure("  rows refilled per request (not our path)", "full", "build", "build_from_scratch")
    measure(f"slot mapping {NUM_TOKENS} tok / {NUM_REQS} rows", "full", "slots", "step_slots")
    measure(f"  decode only ({NUM_REQS} tok)", "decode", "slots", "step_slots")
    measure("step: table + slots (full, mixed)", "full", "step_tables")
    measure("step: table + slots (ragged, mixed)", "ragged", "step_tables")
    measure("step: table + slots (full, decode)", "decode", "step_tables")

    threads = f", torch threads {args.torch_threads}" if "vLLM 0" in baseline_name else ""
    print(
        f"baseline: {baseline_name}; numpy {np.__version__}{threads}; "
        f"{args.repeats} interleaved runs, medians"
    )
    print(f"{'case':44} {'pagekeeper':>10} {'baseline':>10} {'speedup':>8}   min: pk / base")
    for label, ta, tb, min_a, min_b in rows:
        print(f"{label:44} {ta:10.1f} {tb:10.1f} {tb / ta:7.2f}x   {min_a:8.1f} / {min_b:.1f}")
    print("times in microseconds; speedup = baseline median / pagekeeper median")


if __name__ == "__main__":
    main()
