"""Batches for the reference-attention proof: physical page tables built here (random page
ids, shared prefixes, sliding-window null pages, preemption), expanded and slotted with
``pagekeeper.core.tables`` exactly as the service does, and the dense K/V each request
"really" has, to compare against.

Everything derives from a seed, so a worker process can rebuild the same scenario and check
the tables it reads from a published ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pagekeeper.core.tables import expand_to_kernel_blocks, slot_mapping
from pagekeeper.core.types import BatchTables
from pagekeeper_client.attention import ReferencePagedAttention, dense_attention

NUM_KV_HEADS = 2
NUM_Q_HEADS = 4
HEAD_DIM = 8


@dataclass
class Request:
    """One scheduled request: its physical table and its true, contiguous K/V."""

    page_ids: list[int]
    seq_len: int
    query_len: int
    k: torch.Tensor  # [seq_len, NUM_KV_HEADS, HEAD_DIM]
    v: torch.Tensor
    written_from: int = 0
    """History below this position was written by another request (a shared prefix)."""

    @property
    def history_len(self) -> int:
        return self.seq_len - self.query_len


@dataclass
class Scenario:
    page_size: int
    kernel_block_size: int
    num_pages: int
    requests: list[Request]
    q: torch.Tensor  # [sum(query_len), NUM_Q_HEADS, HEAD_DIM]
    window: int | None = None
    extra_writes: list[tuple[list[int], int, torch.Tensor, torch.Tensor]] = field(
        default_factory=list
    )
    """(page_ids, num_tokens, k, v) written before the step by requests not in the batch."""

    @property
    def ratio(self) -> int:
        return self.page_size // self.kernel_block_size

    @property
    def seq_lens(self) -> list[int]:
        return [r.seq_len for r in self.requests]

    @property
    def query_lens(self) -> list[int]:
        return [r.query_len for r in self.requests]


def _kv(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (n, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _null_pages_before_window(request: Request, page_size: int, window: int) -> None:
    """Replace the pages wholly before the first query's window by the null page (0), as a
    sliding-window group does."""
    first_needed = max(0, request.history_len - window + 1)
    for j in range(len(request.page_ids)):
        if (j + 1) * page_size <= first_needed:
            request.page_ids[j] = 0
    request.written_from = max(request.written_from, (first_needed // page_size) * page_size)


def make_scenario(
    page_size: int,
    kernel_block_size: int,
    *,
    seed: int,
    window: int | None = None,
) -> Scenario:
    """Four requests: a chunked prefill (A), a decode sharing A's first two pages (B), a
    short prefill continuation (C), a full prefill (D). With ``window``, long contexts whose
    early pages are the null page."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    p = page_size
    # Draw from the lower half of the pool: a wrong (r+1) expansion then still indexes
    # inside the cache, so the failure shows as wrong values, not an IndexError.
    num_pages = 24
    pool = list(rng.permutation(np.arange(1, num_pages // 2)))
    if window is None:
        lens = [(2 * p + p // 2 + 5, 5), (2 * p + 7, 1), (p + 3, 3), (min(p, 20), min(p, 20))]
    else:
        lens = [(4 * p + 10, 4), (3 * p + p // 2, 1), (min(p, 20), min(p, 20))]
    requests = []
    for seq_len, query_len in lens:
        k, v = _kv(gen, seq_len)
        pages = [int(pool.pop()) for _ in range(math.ceil(seq_len / p))]
        requests.append(Request(pages, seq_len, query_len, k, v))
    if window is None:
        a, b = requests[0], requests[1]
        shared = 2 * p  # B's first two pages are A's: same tokens, same K/V, written by A
        pool.extend(b.page_ids[:2])
        b.page_ids[:2] = a.page_ids[:2]
        b.k[:shared] = a.k[:shared]
        b.v[:shared] = a.v[:shared]
        b.written_from = shared
    else:
        for r in requests:
            _null_pages_before_window(r, p, window)
    total_q = sum(r.query_len for r in requests)
    q = torch.randn((total_q, NUM_Q_HEADS, HEAD_DIM), generator=gen)
    return Scenario(page_size, kernel_block_size, num_pages, requests, q, window)


def physical_table(scenario: Scenario) -> tuple[np.ndarray, np.ndarray]:
    """[num_reqs, max_pages] int32 padded with the null page, and each row's page count."""
    rows = [r.page_ids for r in scenario.requests]
    width = max(len(r) for r in rows)
    table = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table, np.array([len(r) for r in rows], dtype=np.int32)


def batch_tables(scenario: Scenario, *, ratio: int | None = None, group_id: int = 0) -> BatchTables:
    """What the service publishes for the step: the kernel block table (expanded with
    ``ratio``, normally the true one), row lengths, and the new tokens' slots."""
    ratio = scenario.ratio if ratio is None else ratio
    table, num_pages = physical_table(scenario)
    starts = np.array([r.history_len for r in scenario.requests], dtype=np.int64)
    counts = np.array(scenario.query_lens, dtype=np.int64)
    return BatchTables(
        group_id=group_id,
        kernel_block_size=scenario.kernel_block_size,
        block_table=expand_to_kernel_blocks(table, ratio),
        row_lengths=(num_pages * ratio).astype(np.int32),
        slot_mapping=slot_mapping(table, starts, counts, scenario.page_size, num_pages=num_pages),
    )


def prepare_cache(scenario: Scenario) -> ReferencePagedAttention:
    """A cache holding every request's history (what earlier steps wrote)."""
    cache = ReferencePagedAttention.for_pages(
        num_pages=scenario.num_pages,
        page_size=scenario.page_size,
        kernel_block_size=scenario.kernel_block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
    )
    p = scenario.page_size
    for r in scenario.requests:
        n = r.history_len - r.written_from
        if n <= 0:
            continue
        table = np.array([r.page_ids], dtype=np.int32)
        slots = slot_mapping(table, [r.written_from], [n], p)
        cache.write_kv(
            torch.from_numpy(slots),
            r.k[r.written_from : r.history_len],
            r.v[r.written_from : r.history_len],
        )
    for page_ids, n, k, v in scenario.extra_writes:
        slots = slot_mapping(np.array([page_ids], dtype=np.int32), [0], [n], p)
        cache.write_kv(torch.from_numpy(slots), k, v)
    return cache


def new_kv(scenario: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the step's scheduled tokens, in batch order."""
    ks = [r.k[r.history_len : r.seq_len] for r in scenario.requests]
    vs = [r.v[r.history_len : r.seq_len] for r in scenario.requests]
    return torch.cat(ks), torch.cat(vs)


def run_step(
    scenario: Scenario,
    cache: ReferencePagedAttention,
    block_table: torch.Tensor,
    row_lengths: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The worker's step: write the new tokens' K/V at their slots, then paged attention."""
    k, v = new_kv(scenario)
    cache.write_kv(slots, k, v)
    out: torch.Tensor = cache.paged_attention(
        scenario.q,
        block_table,
        scenario.seq_lens,
        scenario.query_lens,
        row_lengths=row_lengths,
        sliding_window=scenario.window,
    )
    return out


def reference(scenario: Scenario) -> torch.Tensor:
    """Dense attention over each request's contiguous K/V."""
    outs = []
    start = 0
    for r in scenario.requests:
        q = scenario.q[start : start + r.query_len]
        outs.append(dense_attention(q, r.k, r.v, sliding_window=scenario.window))
        start += r.query_len
    out: torch.Tensor = torch.cat(outs)
    return out


def max_error(scenario: Scenario, tables: BatchTables) -> float:
    """Run the step through ``tables`` on a fresh cache; max |paged - dense| (NaN if the
    tables made it read unwritten memory)."""
    cache = prepare_cache(scenario)
    out = run_step(
        scenario,
        cache,
        torch.from_numpy(tables.block_table),
        torch.from_numpy(tables.row_lengths),
        torch.from_numpy(tables.slot_mapping),
    )
    return float((out - reference(scenario)).abs().max())
