"""Kernel block tables: kernel size choice, expansion, slots, batch build, PageRows."""

from __future__ import annotations

import subprocess
import sys
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from pagekeeper.core import tables
from pagekeeper.core.errors import FailedPrecondition, InvalidArgument
from pagekeeper.core.tables import (
    MultipleOf,
    PageRows,
    build_batch_tables,
    choose_kernel_block_size,
    expand_to_kernel_blocks,
    padding_waste,
    slot_mapping,
)
from pagekeeper.core.types import BatchTables
from tests.helpers.props import examples

# -- naive references ----------------------------------------------------------------------


def naive_expand(page_ids: list[int], ratio: int) -> list[int]:
    out = []
    for page in page_ids:
        for j in range(ratio):
            out.append(page * ratio + j)
    return out


def naive_slots(
    table: np.ndarray, starts: list[int], counts: list[int], block_size: int
) -> list[int]:
    """Slots by the textbook formula, one token at a time; works for pages or kernel blocks."""
    slots = []
    for row, (start, count) in enumerate(zip(starts, counts, strict=True)):
        for pos in range(start, start + count):
            slots.append(int(table[row, pos // block_size]) * block_size + pos % block_size)
    return slots


# -- choose_kernel_block_size ----------------------------------------------------------------

FLASHINFER = [16, 32, 64]
FLASH_ATTN = [MultipleOf(16)]
FLASH_MLA = [64]


@pytest.mark.parametrize(
    ("page_size", "backends", "expected"),
    [
        (1056, [FLASHINFER], 32),  # 1056 = 32 * 33: 64 does not divide it
        (64, [FLASH_ATTN], 64),
        (96, [FLASHINFER, [MultipleOf(32)]], 32),  # 96 is no FlashInfer size; 32 suits both
        (128, [[MultipleOf(32)]], 128),
        (16, [FLASHINFER], 16),
        (256, [FLASH_MLA], 64),
        (256, [FLASHINFER, FLASH_MLA], 64),
        (528, [FLASHINFER, FLASH_ATTN], 16),  # 528 = 16 * 33
        (96, [[32, 16], [16]], 16),  # 32 only suits the first backend
        (64, [[MultipleOf(1)]], 64),
        (48, [], 48),  # nothing constrains it
        (64, [FLASH_ATTN, FLASHINFER], 64),
    ],
)
def test_choose_kernel_block_size(page_size: int, backends: list, expected: int) -> None:
    assert choose_kernel_block_size(page_size, backends) == expected


@pytest.mark.parametrize(
    ("page_size", "backends"),
    [
        (48, [[64]]),  # 64 does not divide 48
        (96, [[32], [16]]),  # each backend's only size is refused by the other
        (40, [FLASH_ATTN]),  # a MultipleOf never proposes a divisor
        (24, [FLASHINFER]),
    ],
)
def test_choose_kernel_block_size_refuses(page_size: int, backends: list) -> None:
    with pytest.raises(FailedPrecondition) as info:
        choose_kernel_block_size(page_size, backends)
    message = info.value.message
    assert f"page size {page_size}" in message
    assert str(backends[0]) in message  # the backends are named


def test_mamba_pages_are_never_split() -> None:
    # An attention group with the same page size would be split to 32; a mamba group not.
    assert choose_kernel_block_size(1056, [FLASHINFER]) == 32
    with pytest.raises(FailedPrecondition, match="mamba"):
        choose_kernel_block_size(1056, [FLASHINFER], is_mamba=True)
    assert choose_kernel_block_size(1056, [FLASH_ATTN], is_mamba=True) == 1056
    assert choose_kernel_block_size(64, [FLASHINFER], is_mamba=True) == 64
    assert choose_kernel_block_size(1056, [], is_mamba=True) == 1056


@pytest.mark.parametrize(
    ("page_size", "backends"),
    [
        (0, [FLASHINFER]),
        (-16, [FLASHINFER]),
        (True, [FLASHINFER]),
        (64, [[]]),
        (64, [[MultipleOf(0)]]),
        (64, [[0]]),
        (64, [["16"]]),
        (64, [[16.0]]),
        (1056, [16, 32, 64]),  # one backend's sizes not in a list of backends
        (64, "16"),
        (64, [["16"], "32"]),
    ],
)
def test_choose_kernel_block_size_rejects_bad_input(page_size: object, backends: list) -> None:
    with pytest.raises(InvalidArgument):
        choose_kernel_block_size(page_size, backends)  # type: ignore[arg-type]


backend_strategy = st.lists(
    st.one_of(
        st.sampled_from([1, 2, 4, 8, 16, 32, 48, 64, 128, 256]),
        st.builds(MultipleOf, st.sampled_from([1, 2, 8, 16, 32, 64])),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=examples(300), deadline=None)
@given(
    page_size=st.integers(1, 1100),
    backends=st.lists(backend_strategy, min_size=1, max_size=3),
)
def test_choose_kernel_block_size_matches_brute_force(page_size: int, backends: list) -> None:
    def accepts(sizes: list, size: int) -> bool:
        return any(
            size % spec.n == 0 if isinstance(spec, MultipleOf) else size == spec for spec in sizes
        )

    def suits_all(size: int) -> bool:
        return all(accepts(sizes, size) for sizes in backends)

    listed = [s for sizes in backends for s in sizes if not isinstance(s, MultipleOf)]
    if suits_all(page_size):
        expected: int | None = page_size
    else:
        fits = [s for s in listed if page_size % s == 0 and suits_all(s)]
        expected = max(fits) if fits else None
    if expected is None:
        with pytest.raises(FailedPrecondition):
            choose_kernel_block_size(page_size, backends)
    else:
        chosen = choose_kernel_block_size(page_size, backends)
        assert chosen == expected
        assert page_size % chosen == 0


# -- expand_to_kernel_blocks ---------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(
    pages=st.lists(st.integers(0, 2**20), max_size=40),
    ratio=st.integers(1, 66),
)
def test_expand_1d_matches_naive_loop(pages: list[int], ratio: int) -> None:
    got = expand_to_kernel_blocks(np.array(pages, dtype=np.int64), ratio)
    assert got.dtype == np.int32
    assert got.shape == (len(pages) * ratio,)
    assert got.tolist() == naive_expand(pages, ratio)


@settings(max_examples=examples(200), deadline=None)
@given(
    num_rows=st.integers(0, 6),
    num_cols=st.integers(0, 9),
    ratio=st.integers(1, 16),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.int32, np.int64, np.uint16]),
)
def test_expand_2d_matches_naive_loop(
    num_rows: int, num_cols: int, ratio: int, seed: int, dtype: type
) -> None:
    table = np.random.default_rng(seed).integers(0, 30000, (num_rows, num_cols)).astype(dtype)
    got = expand_to_kernel_blocks(table, ratio)
    assert got.dtype == np.int32
    assert got.shape == (num_rows, num_cols * ratio)
    assert got.tolist() == [naive_expand(row, ratio) for row in table.tolist()]


def test_expand_ratio_one_is_a_copy() -> None:
    pages = np.array([3, 1, 2], dtype=np.int32)
    got = expand_to_kernel_blocks(pages, 1)
    assert got.tolist() == [3, 1, 2]
    got[0] = 99
    assert pages[0] == 3


def test_expand_accepts_lists_and_int_ratio_types() -> None:
    assert expand_to_kernel_blocks([2, 0], np.int64(2)).tolist() == [4, 5, 0, 1]  # type: ignore[arg-type]


def test_expand_guards_int32_overflow() -> None:
    # (2**29 - 1) * 4 + 3 == 2**31 - 1: the last id that fits.
    assert expand_to_kernel_blocks(np.array([2**29 - 1]), 4)[-1] == 2**31 - 1
    with pytest.raises(InvalidArgument, match="int32"):
        expand_to_kernel_blocks(np.array([5, 2**29]), 4)
    with pytest.raises(InvalidArgument, match="int32"):
        expand_to_kernel_blocks(np.array([2**31], dtype=np.int64), 1)


@pytest.mark.parametrize(
    ("pages", "ratio"),
    [
        (np.array([1, -1]), 4),  # -1 padding must not be expanded into -4…-1
        (np.array([1.0, 2.0]), 2),
        (np.array(5), 2),
        (np.array([1, 2]), 0),
        (np.array([1, 2]), True),
    ],
)
def test_expand_rejects_bad_input(pages: np.ndarray, ratio: int) -> None:
    with pytest.raises(InvalidArgument):
        expand_to_kernel_blocks(pages, ratio)


# -- slot_mapping --------------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn, page_sizes: st.SearchStrategy[int]) -> tuple:
    """A random batch: a page table, per-row page counts, and token ranges inside them."""
    page_size = draw(page_sizes)
    num_rows = draw(st.integers(0, 6))
    num_cols = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 5000, (num_rows, num_cols)).astype(np.int32)
    num_pages = rng.integers(0, num_cols + 1, num_rows)
    starts, counts = [], []
    for row in range(num_rows):
        capacity = int(num_pages[row]) * page_size
        end = draw(st.integers(0, capacity))
        start = draw(st.integers(0, end))
        starts.append(start)
        counts.append(end - start)
    # Garbage beyond each row's pages must never be read.
    for row in range(num_rows):
        table[row, num_pages[row] :] = -7
    return page_size, table, num_pages, starts, counts


@settings(max_examples=examples(200), deadline=None)
@given(batch=batches(st.integers(1, 80)))
def test_slot_mapping_matches_naive(batch: tuple) -> None:
    page_size, table, num_pages, starts, counts = batch
    expected = naive_slots(table, starts, counts, page_size)
    # Both strategies, whichever the batch's shape would pick: per token and per page run.
    for threshold in (0, 10**9):
        with patch.object(tables, "_MIN_TOKENS_PER_ROW_FOR_RUNS", threshold):
            got = slot_mapping(
                table, np.array(starts), np.array(counts), page_size, num_pages=num_pages
            )
        assert got.dtype == np.int64
        assert got.tolist() == expected


# Page sizes 16…1056 that some of the kernel block sizes 16/32/64 divide.
page_sizes_16 = st.integers(1, 66).map(lambda k: 16 * k)


@settings(max_examples=examples(150), deadline=None)
@given(batch=batches(page_sizes_16), pad_id=st.sampled_from([0, -1]))
def test_slots_do_not_depend_on_kernel_block_size(batch: tuple, pad_id: int) -> None:
    page_size, table, num_pages, starts, counts = batch
    by_pages = naive_slots(table, starts, counts, page_size)
    for kernel_block_size in (16, 32, 64):
        if page_size % kernel_block_size:
            continue
        tables = build_batch_tables(
            table,
            num_pages,
            np.array(starts),
            np.array(counts),
            page_size=page_size,
            kernel_block_size=kernel_block_size,
            pad_id=pad_id,
        )
        assert tables.slot_mapping.tolist() == by_pages
        ratio = page_size // kernel_block_size
        assert tables.block_table.shape == (table.shape[0], table.shape[1] * ratio)
        for row, length in enumerate(num_pages):
            expected_row = naive_expand(table[row, :length].tolist(), ratio)
            padding = [pad_id] * (table.shape[1] - length) * ratio
            assert tables.block_table[row].tolist() == expected_row + padding
            assert tables.row_lengths[row] == length * ratio
        # The kernel's own view: kernel block of each position, times its size, plus offset.
        by_kernel_blocks = naive_slots(tables.block_table, starts, counts, kernel_block_size)
        assert by_kernel_blocks == by_pages


@settings(max_examples=examples(100), deadline=None)
@given(
    page_size=st.sampled_from([16, 48, 64, 1056]),
    num_rows=st.integers(1, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_slot_mapping_of_a_decode_batch(page_size: int, num_rows: int, seed: int) -> None:
    # One token per row takes its own shortcut; it must agree with the general formula.
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 10_000, (num_rows, 6)).astype(np.int32)
    num_pages = rng.integers(1, 7, num_rows)
    starts = [int(rng.integers(0, n * page_size)) for n in num_pages]
    counts = [1] * num_rows
    got = slot_mapping(table, np.array(starts), np.array(counts), page_size, num_pages=num_pages)
    assert got.tolist() == naive_slots(table, starts, counts, page_size)


def test_slot_mapping_example() -> None:
    # Row 0 decodes position 70 (page index 1 = page 3); row 1 prefills 3 tokens from 14,
    # crossing from page 5 into page 9 at page_size 16.
    table = np.array([[7, 3, 0], [5, 9, 0]], dtype=np.int32)
    got = slot_mapping(table, np.array([70, 14]), np.array([1, 3]), 64)
    assert got.tolist() == [3 * 64 + 6, 5 * 64 + 14, 5 * 64 + 15, 5 * 64 + 16]
    got = slot_mapping(table, np.array([0, 14]), np.array([0, 3]), 16)
    assert got.tolist() == [5 * 16 + 14, 5 * 16 + 15, 9 * 16 + 0]


def test_slot_mapping_empty() -> None:
    empty = np.zeros((0, 4), dtype=np.int32)
    assert slot_mapping(empty, np.zeros(0), np.zeros(0), 16).shape == (0,)
    table = np.ones((2, 4), dtype=np.int32)
    got = slot_mapping(table, np.array([5, 0]), np.array([0, 0]), 16)
    assert got.shape == (0,) and got.dtype == np.int64


def test_slot_mapping_refuses_positions_beyond_the_row() -> None:
    table = np.array([[7, 3], [5, 9]], dtype=np.int32)
    # Position 32 is the first token of a third page, which neither row has.
    with pytest.raises(InvalidArgument, match="row 1"):
        slot_mapping(table, np.array([0, 30]), np.array([1, 3]), 16)
    # Within the table's columns but beyond the row's own pages.
    with pytest.raises(InvalidArgument, match="row 0"):
        slot_mapping(table, np.array([16, 0]), np.array([1, 1]), 16, num_pages=np.array([1, 2]))
    # A zero-token row touches no page, wherever it starts.
    assert slot_mapping(table, np.array([999, 0]), np.array([0, 1]), 16).tolist() == [80]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"start_positions": np.array([0]), "num_tokens": np.array([1, 1])},
        {"start_positions": np.array([-1, 0]), "num_tokens": np.array([1, 1])},
        {"start_positions": np.array([0, 0]), "num_tokens": np.array([-1, 1])},
        {"start_positions": np.array([0.5, 0]), "num_tokens": np.array([1, 1])},
        {"start_positions": np.array([0, 0]), "num_tokens": np.array([1, 1]), "page_size": 0},
        {"start_positions": np.array([0, 0]), "num_tokens": np.array([1, 1]), "num_pages": [3, 1]},
        {"start_positions": np.array([0, 0]), "num_tokens": np.array([1, 1]), "num_pages": [1]},
    ],
)
def test_slot_mapping_rejects_bad_input(kwargs: dict) -> None:
    args = {"page_table": np.array([[7, 3], [5, 9]], dtype=np.int32), "page_size": 16} | kwargs
    with pytest.raises(InvalidArgument):
        slot_mapping(**args)


@pytest.mark.parametrize("threshold", [0, 10**9])
def test_slot_mapping_refuses_negative_pages_it_would_read(threshold: int) -> None:
    table = np.array([[7, -1]], dtype=np.int32)
    with patch.object(tables, "_MIN_TOKENS_PER_ROW_FOR_RUNS", threshold):
        got = slot_mapping(table, np.array([0]), np.array([16]), 16)
        assert got.tolist() == list(range(112, 128))
        with pytest.raises(InvalidArgument, match="negative"):
            slot_mapping(table, np.array([15]), np.array([2]), 16)


def test_slot_mapping_rejects_a_1d_table() -> None:
    with pytest.raises(InvalidArgument, match="2-D"):
        slot_mapping(np.array([1, 2]), np.array([0]), np.array([1]), 16)


# -- build_batch_tables --------------------------------------------------------------------


def test_build_batch_tables_pads_and_ignores_columns_beyond_num_pages() -> None:
    # Beyond num_pages lie values that would overflow or turn negative if expanded.
    table = np.array([[7, 3], [1, 2**31 - 1], [-5, -5]], dtype=np.int32)
    tables = build_batch_tables(
        table,
        np.array([2, 1, 0]),
        np.array([70, 10, 0]),
        np.array([1, 2, 0]),
        page_size=64,
        kernel_block_size=16,
        group_id=2,
    )
    assert isinstance(tables, BatchTables)
    assert tables.group_id == 2 and tables.kernel_block_size == 16 and tables.pad_id == 0
    assert tables.block_table.dtype == np.int32
    assert tables.block_table.tolist() == [
        [28, 29, 30, 31, 12, 13, 14, 15],
        [4, 5, 6, 7, 0, 0, 0, 0],  # padding: the null page's first kernel block
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert tables.row_lengths.dtype == np.int32
    assert tables.row_lengths.tolist() == [8, 4, 0]
    assert tables.slot_mapping.dtype == np.int64
    assert tables.slot_mapping.tolist() == [198, 74, 75]


def test_build_batch_tables_pads_with_minus_one() -> None:
    tables = build_batch_tables(
        np.array([[7, 3], [1, 123]]),
        np.array([2, 1]),
        np.array([0, 0]),
        np.array([1, 1]),
        page_size=32,
        kernel_block_size=16,
        pad_id=-1,
    )
    assert tables.pad_id == -1
    assert tables.block_table.tolist() == [[14, 15, 6, 7], [2, 3, -1, -1]]


def test_build_batch_tables_with_kernel_block_equal_to_page() -> None:
    table = np.array([[4, 6, 9]], dtype=np.int32)
    tables = build_batch_tables(
        table, np.array([2]), np.array([15]), np.array([2]), page_size=16, kernel_block_size=16
    )
    assert tables.block_table.tolist() == [[4, 6, 0]]
    assert tables.row_lengths.tolist() == [2]
    assert tables.slot_mapping.tolist() == [4 * 16 + 15, 6 * 16]


def test_build_batch_tables_empty_batch() -> None:
    tables = build_batch_tables(
        np.zeros((0, 0), dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        page_size=64,
        kernel_block_size=16,
    )
    assert tables.block_table.shape == (0, 0)
    assert tables.row_lengths.shape == (0,)
    assert tables.slot_mapping.shape == (0,)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel_block_size": 48},  # does not divide 64
        {"kernel_block_size": 128},
        {"kernel_block_size": 0},
        {"page_size": 0},
        {"pad_id": 5},  # a real kernel block id is no padding
        {"num_pages": np.array([3, 1])},
        {"num_pages": np.array([-1, 1])},
        {"num_pages": np.array([2])},
        {"num_tokens": np.array([1, 70])},  # row 1 has one page of 64 tokens
    ],
)
def test_build_batch_tables_rejects_bad_input(kwargs: dict) -> None:
    args = {
        "page_table": np.array([[7, 3], [1, 0]], dtype=np.int32),
        "num_pages": np.array([2, 1]),
        "start_positions": np.array([0, 0]),
        "num_tokens": np.array([1, 1]),
        "page_size": 64,
        "kernel_block_size": 16,
    } | kwargs
    with pytest.raises(InvalidArgument):
        build_batch_tables(**args)


def test_build_batch_tables_guards_int32_overflow() -> None:
    with pytest.raises(InvalidArgument, match="int32"):
        build_batch_tables(
            np.array([[2**28]], dtype=np.int64),
            np.array([1]),
            np.array([0]),
            np.array([1]),
            page_size=1024,
            kernel_block_size=16,
        )


@pytest.mark.parametrize(
    ("counts", "page_size", "expected"),
    [
        ([0], 16, 0),
        ([16, 32], 16, 0),
        ([1], 16, 15),
        ([17, 5, 64], 16, 15 + 11 + 0),
        ([1000], 1056, 56),
        ([], 16, 0),
    ],
)
def test_padding_waste(counts: list[int], page_size: int, expected: int) -> None:
    assert padding_waste(np.array(counts, dtype=np.int64), page_size) == expected
    assert isinstance(padding_waste(counts, page_size), int)


def test_padding_waste_rejects_bad_input() -> None:
    with pytest.raises(InvalidArgument):
        padding_waste([-1], 16)
    with pytest.raises(InvalidArgument):
        padding_waste([1], 0)


# -- PageRows ------------------------------------------------------------------------------


def test_page_rows_basic_life() -> None:
    rows = PageRows(max_pages_per_row=4, initial_rows=4)
    a, b = rows.add_row(), rows.add_row()
    assert (a, b) == (0, 1)
    rows.append(a, [5, 6])
    rows.append(a, np.array([7], dtype=np.int64))
    rows.append(b, [])
    rows.append(b, [9])
    assert rows.num_pages(a) == 3 and rows.num_pages(b) == 1
    assert rows.row(a).tolist() == [5, 6, 7]
    assert rows.row(a).dtype == np.int32
    assert rows.num_rows == 2
    rows.set_page(a, 0, 0)  # slid out of the window: the null page
    assert rows.row(a).tolist() == [0, 6, 7]


def test_page_rows_row_view_is_read_only() -> None:
    rows = PageRows(4)
    row = rows.add_row()
    rows.append(row, [1, 2])
    view = rows.row(row)
    with pytest.raises(ValueError):
        view[0] = 5
    rows.append(row, [3])  # the store itself stays writable
    assert rows.row(row).tolist() == [1, 2, 3]


def test_page_rows_reuses_released_rows_lowest_first() -> None:
    rows = PageRows(4, initial_rows=8)
    ids = [rows.add_row() for _ in range(4)]
    rows.append(ids[1], [4, 5, 6])
    rows.append(ids[3], [8])
    rows.release_row(ids[3])
    rows.release_row(ids[1])
    assert rows.num_rows == 2
    assert rows.add_row() == 1  # lowest released row first
    assert rows.num_pages(1) == 0  # a reused row starts empty …
    table, _ = rows.gather(np.array([0, 1, 2]))
    assert table.shape == (3, 0)
    rows.append(1, [2])
    table, num_pages = rows.gather(np.array([1]))
    assert table.tolist() == [[2]]  # … and holds no stale pages
    assert num_pages.tolist() == [1]
    assert rows.add_row() == 3
    assert rows.add_row() == 4  # then fresh rows
    assert rows.capacity == 8


def test_page_rows_grow_by_doubling_and_keep_contents() -> None:
    rows = PageRows(3, initial_rows=2)
    before = rows.nbytes
    for i in range(5):
        row = rows.add_row()
        assert row == i
        rows.append(row, [i + 1] * (i % 3 + 1))
    assert rows.capacity == 8
    assert rows.nbytes == 4 * before
    assert rows.nbytes == 8 * 3 * 4 + 8 * 4 + 8
    for i in range(5):
        assert rows.row(i).tolist() == [i + 1] * (i % 3 + 1)


def test_page_rows_append_past_the_limit_changes_nothing() -> None:
    rows = PageRows(3)
    row = rows.add_row()
    rows.append(row, [1, 2])
    with pytest.raises(InvalidArgument, match="max_pages_per_row"):
        rows.append(row, [3, 4])
    assert rows.row(row).tolist() == [1, 2]
    rows.append(row, [3])
    with pytest.raises(InvalidArgument):
        rows.append(row, [4])


@pytest.mark.parametrize(
    "pages",
    [[-1], [2**31], [[1, 2]], [1.5]],
)
def test_page_rows_append_rejects_bad_ids(pages: list) -> None:
    rows = PageRows(4)
    row = rows.add_row()
    with pytest.raises(InvalidArgument):
        rows.append(row, pages)
    assert rows.num_pages(row) == 0


def test_page_rows_rejects_unknown_rows_and_indices() -> None:
    rows = PageRows(4, initial_rows=2)
    row = rows.add_row()
    rows.append(row, [1, 2])
    for bad in (1, 2, -1):  # 1 exists in storage but was never handed out
        with pytest.raises(InvalidArgument):
            rows.append(bad, [1])
        with pytest.raises(InvalidArgument):
            rows.num_pages(bad)
    with pytest.raises(InvalidArgument):
        rows.set_page(row, 2, 0)  # only indices 0 and 1 exist
    with pytest.raises(InvalidArgument):
        rows.set_page(row, -1, 0)
    with pytest.raises(InvalidArgument):
        rows.set_page(row, 0, -3)
    rows.release_row(row)
    with pytest.raises(InvalidArgument, match="not in use"):
        rows.release_row(row)
    with pytest.raises(InvalidArgument, match="not in use"):
        rows.row(row)
    with pytest.raises(InvalidArgument):
        rows.gather(np.array([row]))
    with pytest.raises(InvalidArgument):
        rows.gather(np.array([5]))
    with pytest.raises(InvalidArgument):
        PageRows(0)
    with pytest.raises(InvalidArgument):
        PageRows(4, initial_rows=0)


def test_page_rows_gather_feeds_build_batch_tables() -> None:
    rows = PageRows(max_pages_per_row=8)
    ids = [rows.add_row() for _ in range(3)]
    rows.append(ids[0], [7, 3])
    rows.append(ids[1], [1])
    rows.append(ids[2], [9, 8, 4])
    batch = np.array([ids[1], ids[0]])  # batch order differs from row order
    table, num_pages = rows.gather(batch)
    assert table.dtype == np.int32 and num_pages.dtype == np.int32
    assert table.tolist() == [[1, 0], [7, 3]]  # maxlen = 2: only the batch's rows count
    assert num_pages.tolist() == [1, 2]
    tables = build_batch_tables(
        table, num_pages, np.array([0, 70]), np.array([1, 1]), page_size=64, kernel_block_size=32
    )
    assert tables.block_table.tolist() == [[2, 3, 0, 0], [14, 15, 6, 7]]
    assert tables.slot_mapping.tolist() == [64, 198]
    empty_table, empty_counts = rows.gather(np.array([], dtype=np.int64))
    assert empty_table.shape == (0, 0) and empty_counts.shape == (0,)


class PageRowsMachine(RuleBasedStateMachine):
    """PageRows against a dict of lists."""

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.rows = PageRows(max_pages_per_row=5, initial_rows=1)
        self.model: dict[int, list[int]] = {}

    @rule(target=live)
    def add(self) -> int:
        row = self.rows.add_row()
        assert row not in self.model
        # Rows are packed: a new row is the lowest index not in use.
        assert row == min(set(range(len(self.model) + 1)) - set(self.model))
        self.model[row] = []
        return row

    @rule(row=consumes(live))
    def release(self, row: int) -> None:
        self.rows.release_row(row)
        del self.model[row]

    @rule(row=live, pages=st.lists(st.integers(0, 1000), max_size=3))
    def append(self, row: int, pages: list[int]) -> None:
        if len(self.model[row]) + len(pages) > 5:
            with pytest.raises(InvalidArgument):
                self.rows.append(row, pages)
        else:
            self.rows.append(row, pages)
            self.model[row].extend(pages)

    @rule(row=live, index=st.integers(0, 4), page=st.integers(0, 1000))
    def set_page(self, row: int, index: int, page: int) -> None:
        if index < len(self.model[row]):
            self.rows.set_page(row, index, page)
            self.model[row][index] = page
        else:
            with pytest.raises(InvalidArgument):
                self.rows.set_page(row, index, page)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def gather(self, data: st.DataObject) -> None:
        order = data.draw(st.permutations(sorted(self.model)))
        table, num_pages = self.rows.gather(np.array(order))
        max_len = max(len(self.model[r]) for r in order)
        assert table.shape == (len(order), max_len)
        for i, row in enumerate(order):
            pages = self.model[row]
            assert num_pages[i] == len(pages)
            assert table[i].tolist() == pages + [0] * (max_len - len(pages))

    @invariant()
    def rows_match(self) -> None:
        assert self.rows.num_rows == len(self.model)
        for row, pages in self.model.items():
            assert self.rows.row(row).tolist() == pages


TestPageRowsMachine = PageRowsMachine.TestCase
TestPageRowsMachine.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None
)


# -- purity --------------------------------------------------------------------------------


def test_tables_module_imports_no_transport_or_torch() -> None:
    code = (
        "import sys, pagekeeper.core.tables; "
        "bad = [m for m in ('grpc', 'fastapi', 'torch', 'uvicorn') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_page_rows_append_page_at_the_kept_length_only() -> None:
    rows = PageRows(3)
    row = rows.add_row()
    rows.append(row, [7])
    rows.append_page(row, 1, 9)  # a decode crossing into its second page
    assert rows.row(row).tolist() == [7, 9] and rows.num_pages(row) == 2
    with pytest.raises(InvalidArgument, match="cannot append at 1"):
        rows.append_page(row, 1, 11)  # a stale length would overwrite page 9
    rows.append_page(row, 2, 11)
    with pytest.raises(InvalidArgument, match="at most 3 pages"):
        rows.append_page(row, 3, 12)  # the row is full
    assert rows.row(row).tolist() == [7, 9, 11]


def test_page_rows_append_run_at_the_kept_length_only() -> None:
    rows = PageRows(5)
    row = rows.add_row()
    rows.append_run(row, 0, [4, 2, 8])  # an admission's new pages
    assert rows.row(row).tolist() == [4, 2, 8] and rows.num_pages(row) == 3
    with pytest.raises(InvalidArgument, match="cannot append 2 at 2"):
        rows.append_run(row, 2, [1, 3])  # a stale length would overwrite page 8
    with pytest.raises(InvalidArgument, match="at most 5 pages"):
        rows.append_run(row, 3, [1, 3, 5])  # past the row's room
    assert rows.row(row).tolist() == [4, 2, 8] and rows.num_pages(row) == 3
    rows.append_run(row, 3, [1, 3])
    assert rows.row(row).tolist() == [4, 2, 8, 1, 3]


@pytest.mark.parametrize("packed", [True, False])
def test_page_rows_long_runs_land_in_their_row_as_the_table_grows_and_is_replaced(
    packed: bool, monkeypatch
) -> None:
    """Runs of many ids are packed in C and copied into the table's bytes (the view is made
    again when the table grows or a snapshot restores another): every row holds exactly
    its ids, with or without the C path."""
    if packed and tables._pack_i32 is None:
        pytest.skip("the C pool loops are not built (or the host is big-endian)")
    if not packed:
        monkeypatch.setattr(tables, "_pack_i32", None)
    width = 40
    rows = PageRows(width, initial_rows=1)
    expected: dict[int, list[int]] = {}
    for k in range(9):  # the table doubles from 1 row to 16
        row = rows.add_row()
        first = [1000 * k + i for i in range(tables._PACKED_RUN + k)]
        rows.append_run(row, 0, first)
        more = [5000 + 1000 * k + i for i in range(2 * tables._PACKED_RUN)]
        rows.append_run(row, len(first), more)
        expected[row] = first + more
    restored = rows._table.copy()  # as a snapshot's restore hands over another array
    rows._table = restored
    last = max(expected)
    tail = list(range(90_000, 90_000 + width - len(expected[last])))
    rows.append_run(last, len(expected[last]), tail)
    expected[last] += tail
    for row, ids in expected.items():
        assert rows.row(row).tolist() == ids
        assert rows._table[row, len(ids) :].tolist() == [0] * (width - len(ids))
    assert rows._table is restored


@pytest.mark.parametrize("native", [True, False])
def test_page_rows_append_page_each_is_all_or_nothing(native: bool, monkeypatch) -> None:
    if native and tables._ops is None:
        pytest.skip("the C pool loops are not built")
    if not native:
        monkeypatch.setattr(tables, "_ops", None)
    rows = PageRows(3)
    a, b, c = rows.add_row(), rows.add_row(), rows.add_row()
    rows.append(a, [7])
    rows.append(c, [1, 2])
    rows.append_page_each([c, a, b], [2, 1, 0], [3, 9, 5])  # a decode step's crossings
    assert [rows.row(r).tolist() for r in (a, b, c)] == [[7, 9], [5], [1, 2, 3]]
    with pytest.raises(
        InvalidArgument, match="row 1 holds 1 of at most 3 pages; cannot append at 0"
    ):
        rows.append_page_each([a, b], [2, 0], [10, 11])  # b's length is stale
    with pytest.raises(InvalidArgument, match="at most 3 pages"):
        rows.append_page_each([a, c], [2, 3], [10, 11])  # c is full
    with pytest.raises(InvalidArgument, match="2 rows, 2 lengths and 1 page ids"):
        rows.append_page_each([a, b], [2, 1], [10])
    assert [rows.row(r).tolist() for r in (a, b, c)] == [[7, 9], [5], [1, 2, 3]]
    rows.append_page_each([], [], [])
    assert [rows.num_pages(r) for r in (a, b, c)] == [2, 1, 3]


def test_native_append_each_changes_nothing_when_a_check_fails() -> None:
    """The C pass refuses (False) before writing, and puts back the rows it wrote when a
    row turns out to be listed twice: the table and lengths are as before."""
    if tables._ops is None:
        pytest.skip("the C pool loops are not built")
    table = np.zeros((3, 4), dtype=np.int32)
    lengths = np.array([1, 0, 4], dtype=np.int32)
    table[0, 0], table[2] = 7, [1, 2, 3, 4]
    before = table.copy(), lengths.copy()
    append_each = tables._ops.append_each
    refused = [
        ([0, 1], [1, 0], [5]),  # lists of different lengths
        ([0, 3], [1, 0], [5, 6]),  # no row 3
        ([0, 1], [1, 1], [5, 6]),  # row 1's length is 0
        ([2], [4], [5]),  # row 2 is full
        ([0], [1], [2**31]),  # not an int32 page id
        ([0], [1], [-1]),
        ([0, 1, 0], [1, 0, 1], [5, 6, 8]),  # row 0 twice: written, then put back
    ]
    for rows, at, pages in refused:
        assert append_each(table, lengths, rows, at, pages) is False
        assert (table == before[0]).all() and (lengths == before[1]).all()
    assert append_each(table, lengths, [1, 0], [0, 1], [6, 5]) is True
    assert table[:2].tolist() == [[7, 5, 0, 0], [6, 0, 0, 0]]
    assert lengths.tolist() == [2, 1, 4]
    with pytest.raises(TypeError):
        append_each(table.astype(np.int64), lengths, [], [], [])
