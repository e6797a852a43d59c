"""Kernel block tables: physical pages → the block ids and slots an attention kernel reads.

The pool allocates **pages** of ``page_size`` tokens (large enough for a Mamba state page in
hybrid models); attention kernels index **kernel blocks** of ``kernel_block_size`` tokens
(FlashAttention, FlashInfer, FlashMLA … each accept only some sizes). With
``r = page_size // kernel_block_size`` page ``p`` *is* kernel blocks ``p*r … p*r+r-1``: the
same bytes viewed in ``r`` consecutive slices, so nothing moves when the kernel block size
changes, only the ids in the table do::

    token position    0       16      32      48      64      80      96      112     128
                      |.......|.......|.......|.......|.......|.......|.......|.......|
    pages of the row  |           page 7              |           page 3              |
    physical table    [              7                ,               3               ]
    kernel blocks     |  28   |  29   |  30   |  31   |  12   |  13   |  14   |  15   |
                        7*4+0   7*4+1   7*4+2   7*4+3   3*4+0   3*4+1   3*4+2   3*4+3
                      (page_size = 64, kernel_block_size = 16, r = 4)

    slot of position 70 = page 3 * 64 + 70 % 64              = 198
                        = kernel block 12 * 16 + 70 % 16     = 198   (whatever r is)

A batch's table is padded to its longest row::

    row 0  [ 28 29 30 31 | 12 13 14 15 ]          row_lengths[0] = 8
    row 1  [  4  5  6  7 |  0  0  0  0 ]          row_lengths[1] = 4, then pad_id (0)

Page ``0`` is the **null page**: it is never handed to a request, pads tables, and stands in
for sliding-window pages that left the window. Padding with ``0`` therefore points at the null
page's first kernel block, which is always mapped and safe to read; kernels never read past
``row_lengths`` anyway. ``-1`` is the other accepted pad for kernels that check for it.

Everything here is vectorised numpy: no Python loop runs per request or per token. The one
per-request structure, :class:`PageRows`, keeps every running request's physical table as a
row of one preallocated 2-D array (like vLLM's worker ``BlockTable``), so building a batch is
one fancy-index gather.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pagekeeper.core.errors import FailedPrecondition, InvalidArgument
from pagekeeper.core.extensions import load_extension
from pagekeeper.core.types import BatchTables, Int32Array, Int64Array

# The pool's C loops (``_poolops.c``); PageRows uses two of them (None: numpy only).
_ops = load_extension("_poolops", "PAGEKEEPER_NATIVE_POOL")
# Little-endian int32 from a list of ints: the table's own layout on a little-endian host.
_pack_i32 = _ops.pack_i32 if _ops is not None and sys.byteorder == "little" else None
_PACKED_RUN = 8
"""Runs of at least this many page ids are written to a row through ``_pack_i32``."""

__all__ = [
    "PAD_IDS",
    "MultipleOf",
    "PageRows",
    "build_batch_tables",
    "choose_kernel_block_size",
    "expand_to_kernel_blocks",
    "padding_waste",
    "slot_mapping",
]

_INT32_LIMIT = 2**31
# Up to this ratio (even), kernel ids are written as int64 lanes of two (see _expand);
# beyond it one strided pass per lane costs more than np.repeat.
_MAX_LANE_RATIO = 8
PAD_IDS = (0, -1)
"""Accepted table padding: ``0`` (the null page's first kernel block, safe to read) or ``-1``."""


# -- kernel block size selection -----------------------------------------------------------


class MultipleOf(NamedTuple):
    """A backend accepts any kernel block size that is a multiple of ``n``."""

    n: int


KernelBlockSizeSpec = int | MultipleOf


def _accepts(sizes: Sequence[KernelBlockSizeSpec], size: int) -> bool:
    """Whether one backend, listing ``sizes``, can run with kernel blocks of ``size``."""
    for spec in sizes:
        if isinstance(spec, MultipleOf):
            if size % spec.n == 0:
                return True
        elif size == spec:
            return True
    return False


def _check_backends(backends: Sequence[Sequence[KernelBlockSizeSpec]]) -> None:
    if isinstance(backends, str | bytes) or not isinstance(backends, Sequence):
        raise InvalidArgument(f"backends must be a list of size lists, got {backends!r}")
    for i, sizes in enumerate(backends):
        if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence):
            raise InvalidArgument(
                f"backend {i} must list its kernel block sizes (e.g. [[16, 32]] for one "
                f"backend), got {sizes!r}"
            )
        if len(sizes) == 0:
            raise InvalidArgument(
                f"backend {i} lists no kernel block sizes (use MultipleOf(1) for any size)"
            )
        for spec in sizes:
            if isinstance(spec, MultipleOf):
                value = spec.n
            elif isinstance(spec, int) and not isinstance(spec, bool):
                value = spec
            else:
                raise InvalidArgument(
                    f"backend {i}: kernel block size {spec!r} is neither an int nor MultipleOf"
                )
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(
                    f"backend {i}: kernel block size {spec!r} must be a positive int"
                )


def choose_kernel_block_size(
    page_size: int,
    backends: Sequence[Sequence[int | MultipleOf]],
    *,
    is_mamba: bool = False,
) -> int:
    """The kernel block size a group's attention backends all run with (vLLM's
    ``select_common_block_size``).

    ``backends[i]`` lists the sizes backend ``i`` supports: exact ints and
    :class:`MultipleOf`. The rule:

    1. ``page_size`` itself, if every backend accepts it (no splitting);
    2. else the largest *listed int* that divides ``page_size`` and that every backend
       accepts (listed there, or a multiple of one of its ``MultipleOf``) — the largest keeps
       tables shortest. A ``MultipleOf`` never proposes a size of its own: if it accepts a
       divisor of the page, it accepts the page, and case 1 applied;
    3. else :class:`FailedPrecondition`.

    Mamba groups are never split (a state page is one unit), so with ``is_mamba`` only case 1
    applies. No backends at all means nothing constrains the size: ``page_size``.
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise InvalidArgument(f"page_size must be a positive int, got {page_size!r}")
    _check_backends(backends)
    if all(_accepts(sizes, page_size) for sizes in backends):
        return page_size
    listed = [list(sizes) for sizes in backends]
    if is_mamba:
        raise FailedPrecondition(
            f"mamba group with page size {page_size}: mamba pages are never split into kernel "
            f"blocks, and not every backend accepts {page_size} (backends: {listed})"
        )
    candidates = sorted(
        {
            spec
            for sizes in backends
            for spec in sizes
            if not isinstance(spec, MultipleOf) and page_size % spec == 0
        },
        reverse=True,
    )
    for size in candidates:
        if all(_accepts(sizes, size) for sizes in backends):
            return size
    raise FailedPrecondition(
        f"no kernel block size divides page size {page_size} and suits every backend "
        f"(backends: {listed})"
    )


# -- expansion and slots -------------------------------------------------------------------


def _as_int_array(name: str, value: npt.ArrayLike) -> npt.NDArray[np.integer]:
    array = np.asarray(value)
    if array.size == 0 and array.dtype.kind == "f":
        # np.asarray([]) is float64; an empty list is still a valid empty id list.
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integers, got dtype {array.dtype}")
    return array


def _check_ratio(ratio: int) -> None:
    if not isinstance(ratio, int | np.integer) or isinstance(ratio, bool) or ratio < 1:
        raise InvalidArgument(f"ratio must be a positive int, got {ratio!r}")


def _check_expandable(low: int, high: int, ratio: int) -> None:
    """Raise unless page ids in ``[low, high]`` expand to int32 kernel ids."""
    if low < 0:
        raise InvalidArgument(f"page ids must be >= 0, got {low}")
    if high * ratio + ratio - 1 >= _INT32_LIMIT:
        raise InvalidArgument(
            f"page id {high} with ratio {ratio} gives kernel block id "
            f"{high * ratio + ratio - 1}, beyond int32"
        )


def _expand(
    pages: npt.NDArray[np.integer],
    ratio: int,
    padding: tuple[npt.NDArray[np.bool_], Int32Array, int] | None = None,
) -> Int32Array:
    """``p*r + j`` for ``j`` in ``0 … r-1``, flattened into the last axis (ids already checked).

    ``padding = (valid, row_lengths, pad_id)`` (2-D only): ``valid[i, c]`` says whether
    column ``c`` of row ``i`` is a real page (``pages`` holds 0 where it is not), and every
    kernel id from ``row_lengths[i]`` on becomes ``pad_id`` (0 or -1).

    numpy is slow at broadcasting into a short inner axis (``[..., C, 1] + [r]`` runs its
    inner loop ``r`` elements at a time), so neither strategy does that:

    * small even ``r`` (the common 2, 4, 8): the output is seen as int64 *lanes*, each holding
      two neighbouring kernel ids. Lane ``l`` of page ``p`` is
      ``(p*r + 2l) + (p*r + 2l + 1) << 32`` (little-endian: the low half comes first), i.e.
      ``p*r*(2**32 + 1) + 2**32 + 2l*(2**32 + 1)``: one multiply-add per page, then one long
      strided add per lane. No half carries into the other: both stay below ``2**31``. A pad
      of 0 or -1 is the same number as an int64 lane, so padding is one masked per-page
      copy per lane instead of a masked pass over every kernel id.
    * otherwise: ``np.repeat`` (a block copy) of ``p*r``, then the offsets ``0 … r-1`` added
      as one long row broadcast over the leading axes.
    """
    if ratio % 2 == 0 and ratio <= _MAX_LANE_RATIO and sys.byteorder == "little":
        out = np.empty((*pages.shape[:-1], pages.shape[-1] * ratio), dtype=np.int32)
        num_lanes = ratio // 2
        lanes = out.reshape(-1).view(np.int64).reshape(-1, num_lanes)
        both_halves = (1 << 32) + 1
        # Written straight into the output (no page-sized temporaries: fresh large buffers
        # cost page faults).
        first_lane = lanes[:, 0]
        np.multiply(
            pages.reshape(-1), ratio * both_halves, out=first_lane, dtype=np.int64, casting="unsafe"
        )
        first_lane += 1 << 32
        for lane in range(1, num_lanes):
            np.add(first_lane, 2 * lane * both_halves, out=lanes[:, lane])
        if padding is not None:
            valid, _, pad_id = padding
            is_padding = ~valid.reshape(-1)
            for lane in range(num_lanes):
                np.copyto(lanes[:, lane], pad_id, where=is_padding)
        return out
    # int32 whatever the input type (a uint16 product would wrap); callers proved it fits.
    scaled: Int32Array = np.multiply(pages, ratio, dtype=np.int32, casting="unsafe")
    if ratio == 1:
        if padding is not None and padding[2] != 0:
            valid, _, pad_id = padding
            scaled[~valid] = pad_id
        return scaled
    out = np.repeat(scaled, ratio, axis=-1)
    out += np.tile(np.arange(ratio, dtype=np.int32), pages.shape[-1])
    if padding is not None:
        _, row_lengths, pad_id = padding
        columns = np.arange(out.shape[-1], dtype=np.int32)
        np.copyto(out, pad_id, where=columns >= row_lengths[:, None])
    return out


def expand_to_kernel_blocks(page_ids: npt.ArrayLike, ratio: int) -> Int32Array:
    """Expand page ids to kernel block ids: the last axis grows ``ratio`` times.

    ``[p, q]`` becomes ``[p*r, p*r+1, …, p*r+r-1, q*r, …, q*r+r-1]``. Works for any number of
    leading axes (a 1-D request table, a 2-D batch table); always a new int32 array
    (``ratio == 1`` included). Raises :class:`InvalidArgument` for a negative page id or one
    whose last kernel block would not fit in int32.
    """
    _check_ratio(ratio)
    ratio = int(ratio)
    pages = _as_int_array("page_ids", page_ids)
    if pages.ndim == 0:
        raise InvalidArgument("page_ids must have at least one axis")
    if pages.size:
        _check_expandable(int(pages.min()), int(pages.max()), ratio)
    return _expand(pages, ratio)


def _check_page_size(page_size: int) -> int:
    if not isinstance(page_size, int | np.integer) or isinstance(page_size, bool) or page_size < 1:
        raise InvalidArgument(f"page_size must be a positive int, got {page_size!r}")
    return int(page_size)


# Average scheduled tokens per row from which slots are computed per (row, page) run rather
# than per token: a prefill chunk spans few pages, so its runs are far fewer than its tokens,
# while for decodes (one token per row) the per-token path does less bookkeeping.
_MIN_TOKENS_PER_ROW_FOR_RUNS = 8


def slot_mapping(
    page_table: npt.ArrayLike,
    start_positions: npt.ArrayLike,
    num_tokens: npt.ArrayLike,
    page_size: int,
    *,
    num_pages: npt.ArrayLike | None = None,
) -> Int64Array:
    """Slots of each row's tokens at positions ``start … start+n-1``, rows in order.

    ``slot = page_table[row, pos // page_size] * page_size + pos % page_size``; the same as
    with kernel blocks of any size dividing the page, so callers never pass the kernel block
    size. ``page_table`` is ``[R, C]``; ``num_pages[i]`` (default ``C``) says how many of row
    ``i``'s columns are real pages. A position in a page the row does not have raises
    :class:`InvalidArgument` instead of reading padding, and so does a token that would land
    in a page with a negative id. Vectorised: no Python loop over rows or tokens.
    """
    page_size = _check_page_size(page_size)
    table = _check_table(page_table)
    num_rows, num_cols = table.shape
    limits = None if num_pages is None else _check_num_pages(num_pages, num_rows, num_cols)
    return _slots(table, start_positions, num_tokens, page_size, limits)


def _check_table(page_table: npt.ArrayLike) -> npt.NDArray[np.integer]:
    table = _as_int_array("page_table", page_table)
    if table.ndim != 2:
        raise InvalidArgument(f"page_table must be 2-D [rows, pages], got shape {table.shape}")
    return table


def _check_num_pages(
    num_pages: npt.ArrayLike, num_rows: int, num_cols: int
) -> npt.NDArray[np.integer]:
    lengths = _as_int_array("num_pages", num_pages)
    if lengths.shape != (num_rows,):
        raise InvalidArgument(f"num_pages must have shape ({num_rows},), got {lengths.shape}")
    if num_rows and (lengths.min() < 0 or lengths.max() > num_cols):
        raise InvalidArgument(f"num_pages must lie in [0, {num_cols}]")
    return lengths


def _slots(
    table: npt.NDArray[np.integer],
    start_positions: npt.ArrayLike,
    num_tokens: npt.ArrayLike,
    page_size: int,
    limits: npt.NDArray[np.integer] | None,
) -> Int64Array:
    """:func:`slot_mapping` once the table, page size and page counts are checked."""
    num_rows, num_cols = table.shape
    starts = _as_int_array("start_positions", start_positions).astype(np.int64, copy=False)
    counts = _as_int_array("num_tokens", num_tokens).astype(np.int64, copy=False)
    if starts.shape != (num_rows,) or counts.shape != (num_rows,):
        raise InvalidArgument(
            f"start_positions {starts.shape} and num_tokens {counts.shape} must both have "
            f"shape ({num_rows},), one entry per page_table row"
        )
    if num_rows == 0:
        return np.empty(0, dtype=np.int64)
    min_count = int(counts.min())
    if min_count < 0 or starts.min() < 0:
        raise InvalidArgument("start_positions and num_tokens must be >= 0")
    ends = starts + counts
    last_page = ends - 1
    if page_size & (page_size - 1) == 0:  # shifts are several times cheaper than division
        last_page >>= page_size.bit_length() - 1
    else:
        last_page //= page_size
    # The last page each row touches must be one of its pages (rows with no tokens touch none).
    beyond = last_page >= (num_cols if limits is None else limits)
    if min_count == 0:
        beyond &= counts > 0
    if beyond.any():
        row = int(np.argmax(beyond))
        have = num_cols if limits is None else int(limits[row])
        raise InvalidArgument(
            f"row {row}: positions up to {int(ends[row] - 1)} need page index "
            f"{int(last_page[row])}, but the row has {have} pages of {page_size}"
        )
    cu_tokens = np.cumsum(counts)
    total = int(cu_tokens[-1])
    if total == 0:
        return np.empty(0, dtype=np.int64)
    if table.dtype == np.uint64:  # uint64 - int64 would be float64
        table = table.astype(np.int64)
    flat_table = np.ascontiguousarray(table).reshape(-1)
    if total >= _MIN_TOKENS_PER_ROW_FOR_RUNS * num_rows:
        return _slots_by_run(
            flat_table,
            num_cols,
            starts,
            counts,
            last_page,
            cu_tokens,
            page_size,
            has_empty_rows=min_count == 0,
        )
    is_decode = min_count == 1 and total == num_rows  # one token per row
    return _slots_by_token(
        flat_table, num_cols, starts, counts, None if is_decode else cu_tokens, page_size
    )


def _slots_by_token(
    flat_table: npt.NDArray[np.integer],
    num_cols: int,
    starts: Int64Array,
    counts: Int64Array,
    cu_tokens: Int64Array | None,
    page_size: int,
) -> Int64Array:
    """Slots one token at a time (cheapest bookkeeping: best for decode batches).

    Token ``t`` of row ``i`` gets the *virtual position* ``v = i*C*page_size + pos``: its
    position in the row-major flattened table, so ``v // page_size`` indexes the flat table
    and ``v % page_size`` is the offset in the page. ``v = t + (i*C*page_size + start_i -
    first_token_i)``: one ``np.repeat`` of a per-row constant gives every ``v``. Then
    ``slot = page*page_size + v - (v // page_size)*page_size``. ``cu_tokens=None`` says every
    row has exactly one token, so ``v`` is the per-row constant itself.
    """
    num_rows = starts.shape[0]
    virtual = np.arange(0, num_rows * num_cols * page_size, num_cols * page_size)
    virtual += starts
    if cu_tokens is not None:
        virtual -= cu_tokens - counts
        virtual = np.repeat(virtual, counts)
        virtual += np.arange(virtual.shape[0], dtype=np.int64)
    is_power_of_two = page_size & (page_size - 1) == 0
    shift = page_size.bit_length() - 1
    page_index = virtual >> shift if is_power_of_two else virtual // page_size
    pages = flat_table[page_index]
    if pages.min() < 0:
        raise InvalidArgument("a scheduled token falls in a page with a negative id")
    slots: Int64Array = np.subtract(pages, page_index, dtype=np.int64)
    if is_power_of_two:
        slots <<= shift
    else:
        slots *= page_size
    slots += virtual
    return slots


def _slots_by_run(
    flat_table: npt.NDArray[np.integer],
    num_cols: int,
    starts: Int64Array,
    counts: Int64Array,
    last_page: Int64Array,
    cu_tokens: Int64Array,
    page_size: int,
    has_empty_rows: bool,
) -> Int64Array:
    """Slots per run of tokens that share a page (best when rows hold prefill chunks).

    Within one (row, page) run consecutive tokens get consecutive slots, so
    ``slot = t + shift[run]`` for token ``t`` of the batch. Runs are counted per row
    (``last_page - first_page + 1``), their page ids gathered once, and only the final
    ``np.repeat`` + ``np.arange`` touch every token. For a run on page index ``j`` of row
    ``i`` (flat table index ``f = i*C + j``), with ``base_i = i*C*page_size + start_i -
    first_token_i``::

        shift     = page*page_size - j*page_size + start_i - first_token_i
                  = (page - f)*page_size + base_i
        first t   = first_token_i + j*page_size - start_i  =  f*page_size - base_i

    except that a row's first run begins at ``first_token_i``.
    """
    num_rows = starts.shape[0]
    total = int(cu_tokens[-1])
    runs_per_row = last_page - starts // page_size
    runs_per_row += 1
    if has_empty_rows:
        runs_per_row[counts == 0] = 0
    cu_runs = np.cumsum(runs_per_row)
    first_run = cu_runs - runs_per_row
    first_token = cu_tokens - counts
    row_offset = np.arange(0, num_rows * num_cols, num_cols)
    # Flat index of each run's page: row*C + first_page + (run - first_run of the row).
    flat_index = np.repeat(row_offset + last_page - cu_runs + 1, runs_per_row)
    flat_index += np.arange(flat_index.shape[0])
    pages = flat_table[flat_index]
    if pages.min() < 0:
        raise InvalidArgument("a scheduled token falls in a page with a negative id")
    row_offset *= page_size
    row_offset += starts
    row_offset -= first_token
    base = np.repeat(row_offset, runs_per_row)
    run_start = flat_index * page_size
    run_start -= base
    if has_empty_rows:
        first_run, first_token = first_run[counts > 0], first_token[counts > 0]
    run_start[first_run] = first_token
    run_length = np.empty_like(run_start)
    np.subtract(run_start[1:], run_start[:-1], out=run_length[:-1])
    run_length[-1] = total - run_start[-1]
    shift: Int64Array = np.subtract(pages, flat_index, dtype=np.int64)
    shift *= page_size
    shift += base
    slots = np.repeat(shift, run_length)
    slots += np.arange(total)
    return slots


def build_batch_tables(
    page_table: npt.ArrayLike,
    num_pages: npt.ArrayLike,
    start_positions: npt.ArrayLike,
    num_tokens: npt.ArrayLike,
    *,
    page_size: int,
    kernel_block_size: int,
    group_id: int = 0,
    pad_id: int = 0,
) -> BatchTables:
    """One group's published tables for a batch whose rows are already in batch order.

    ``page_table[i, :num_pages[i]]`` are row ``i``'s physical page ids; columns beyond are
    ignored (they may hold anything). Returns the kernel block table ``[R, C*r]`` int32 whose
    row ``i`` holds the expanded pages in its first ``row_lengths[i] = num_pages[i]*r``
    entries and ``pad_id`` after them (``0``: the null page's first kernel block, safe to
    read; or ``-1``), and the int64 slot mapping of the ``num_tokens[i]`` tokens starting at
    ``start_positions[i]`` of each row. ``kernel_block_size`` must divide ``page_size``.
    """
    page_size = _check_page_size(page_size)
    if (
        not isinstance(kernel_block_size, int)
        or isinstance(kernel_block_size, bool)
        or kernel_block_size < 1
        or page_size % kernel_block_size != 0
    ):
        raise InvalidArgument(
            f"kernel_block_size {kernel_block_size!r} must be a positive divisor of "
            f"page_size {page_size}"
        )
    if pad_id not in PAD_IDS:
        raise InvalidArgument(f"pad_id must be one of {PAD_IDS}, got {pad_id!r}")
    ratio = page_size // kernel_block_size
    table = _check_table(page_table)
    num_rows, num_cols = table.shape
    lengths = _check_num_pages(num_pages, num_rows, num_cols)
    # Validates token ranges (and reads only real pages) before anything is built.
    slots = _slots(table, start_positions, num_tokens, page_size, lengths)

    row_lengths = lengths.astype(np.int32) * np.int32(ratio)
    padding = None
    if num_rows and int(lengths.min()) < num_cols:
        lengths64 = lengths.astype(np.int64, copy=False)
        valid = np.arange(num_cols, dtype=np.int64) < lengths64[:, None]
        # Columns past a row's pages may hold anything (a huge or negative id): zero them
        # so they neither fail the range check nor wrap; _expand writes the pad over them.
        table = table * valid
        padding = (valid, row_lengths, pad_id)
    if table.size:
        _check_expandable(int(table.min()), int(table.max()), ratio)
    block_table = _expand(table, ratio, padding)
    return BatchTables(
        group_id=group_id,
        kernel_block_size=kernel_block_size,
        block_table=block_table,
        row_lengths=row_lengths,
        slot_mapping=slots,
        pad_id=pad_id,
    )


def padding_waste(num_tokens_per_row: npt.ArrayLike, page_size: int) -> int:
    """Tokens allocated but unused: the empty tail of each row's last page, summed."""
    page_size = _check_page_size(page_size)
    counts = _as_int_array("num_tokens_per_row", num_tokens_per_row).astype(np.int64)
    if counts.size and counts.min() < 0:
        raise InvalidArgument("num_tokens_per_row must be >= 0")
    return int(((-counts) % page_size).sum())


# -- per-request rows ----------------------------------------------------------------------


class PageRows:
    """Every running request's physical table for one group, as rows of one 2-D int32 array.

    Rows are handed out by :meth:`add_row` (released rows are reused, lowest first, so live
    rows stay packed) and grow by doubling; the column count is fixed at the most pages one
    request may hold. Entries past a row's length are always ``0`` (the null page), so a
    gathered batch table is deterministic and safe to read even before padding.
    """

    def __init__(self, max_pages_per_row: int, initial_rows: int = 64) -> None:
        if not isinstance(max_pages_per_row, int) or max_pages_per_row < 1:
            raise InvalidArgument(
                f"max_pages_per_row must be a positive int, got {max_pages_per_row!r}"
            )
        if not isinstance(initial_rows, int) or initial_rows < 1:
            raise InvalidArgument(f"initial_rows must be a positive int, got {initial_rows!r}")
        self._max_pages = max_pages_per_row
        self._table: Int32Array = np.zeros((initial_rows, max_pages_per_row), dtype=np.int32)
        self._num_pages: Int32Array = np.zeros(initial_rows, dtype=np.int32)
        self._is_live = np.zeros(initial_rows, dtype=np.bool_)
        self._num_fresh = 0  # rows [0, _num_fresh) have been handed out at least once
        self._free_rows: list[int] = []  # min-heap of released rows
        self._num_live = 0
        self._bytes: memoryview | None = None
        """``_table``'s bytes (a cache: made again once ``_table`` is another array)."""

    # -- properties ---------------------------------------------------------------------
    @property
    def max_pages_per_row(self) -> int:
        return self._max_pages

    @property
    def capacity(self) -> int:
        """Rows allocated (live or not); doubles when full."""
        return int(self._table.shape[0])

    @property
    def num_rows(self) -> int:
        """Live rows."""
        return self._num_live

    @property
    def nbytes(self) -> int:
        """Bytes held by the row storage (table, lengths, liveness)."""
        return int(self._table.nbytes + self._num_pages.nbytes + self._is_live.nbytes)

    # -- row lifetime -------------------------------------------------------------------
    def add_row(self) -> int:
        """A new empty row for a request; reuses the lowest released row if any."""
        if self._free_rows:
            row = heapq.heappop(self._free_rows)
        else:
            if self._num_fresh == self.capacity:
                self._grow()
            row = self._num_fresh
            self._num_fresh += 1
        self._is_live[row] = True
        self._num_live += 1
        return row

    def release_row(self, row: int) -> None:
        """Give a request's row back; its entries are zeroed for the next owner."""
        self._check_live(row)
        self._table[row, : self._num_pages[row]] = 0
        self._num_pages[row] = 0
        self._is_live[row] = False
        self._num_live -= 1
        heapq.heappush(self._free_rows, row)

    def _grow(self) -> None:
        capacity = self.capacity * 2
        table = np.zeros((capacity, self._max_pages), dtype=np.int32)
        table[: self.capacity] = self._table
        num_pages = np.zeros(capacity, dtype=np.int32)
        num_pages[: self.capacity] = self._num_pages
        is_live = np.zeros(capacity, dtype=np.bool_)
        is_live[: self.capacity] = self._is_live
        self._table, self._num_pages, self._is_live = table, num_pages, is_live

    def _check_live(self, row: int) -> None:
        if not isinstance(row, int | np.integer) or not 0 <= row < self.capacity:
            raise InvalidArgument(f"row {row!r} does not exist")
        if not self._is_live[row]:
            raise InvalidArgument(f"row {row} is not in use")

    # -- contents -----------------------------------------------------------------------
    def append(self, row: int, page_ids: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """Add pages to the end of a row (table order)."""
        self._check_live(row)
        if type(page_ids) is list and len(page_ids) <= 8:
            # A decode crossing into a new page appends one id: plain ints, no numpy reductions.
            start = int(self._num_pages[row])
            end = start + len(page_ids)
            if end > self._max_pages:
                raise InvalidArgument(
                    f"row {row} would hold {end} pages, more than max_pages_per_row "
                    f"{self._max_pages}"
                )
            table_row = self._table[row]
            for i, page in enumerate(page_ids):
                if type(page) is not int or not 0 <= page < _INT32_LIMIT:
                    raise InvalidArgument("page ids must be ints in [0, 2**31)")
                table_row[start + i] = page
            self._num_pages[row] = end
            return
        pages = np.asarray(page_ids)
        if pages.ndim != 1:
            raise InvalidArgument(f"page_ids must be 1-D, got shape {pages.shape}")
        count = pages.shape[0]
        if count == 0:
            return
        if pages.dtype.kind not in "iu":
            raise InvalidArgument(f"page_ids must hold integers, got dtype {pages.dtype}")
        start = int(self._num_pages[row])
        end = start + count
        if end > self._max_pages:
            raise InvalidArgument(
                f"row {row} would hold {end} pages, more than max_pages_per_row {self._max_pages}"
            )
        # One reduction checks both bounds: seen as uint64, a negative id is >= 2**63.
        if pages.astype(np.int64, copy=False).view(np.uint64).max() >= _INT32_LIMIT:
            raise InvalidArgument("page ids must lie in [0, 2**31)")
        self._table[row, start:end] = pages
        self._num_pages[row] = end

    def append_page(self, row: int, num_pages: int, page_id: int) -> None:
        """Add one page a pool just handed out to the end of a live row whose length the
        caller keeps (``num_pages``): a decode crossing into a new page. The shortest path:
        the caller owns the row and the id came from the pool, so only the length and the
        row's room are checked."""
        if num_pages != self._num_pages[row] or num_pages >= self._max_pages:
            raise InvalidArgument(
                f"row {row} holds {int(self._num_pages[row])} of at most {self._max_pages} "
                f"pages; cannot append at {num_pages}"
            )
        self._table[row, num_pages] = page_id
        self._num_pages[row] = num_pages + 1

    def append_run(self, row: int, num_pages: int, page_ids: list[int]) -> None:
        """Add a run of pages a pool just handed out to the end of a live row whose length
        the caller keeps (``num_pages``): an admission's new pages. Like :meth:`append_page`,
        only the length and the row's room are checked; the ids are the pool's own."""
        end = num_pages + len(page_ids)
        if num_pages != self._num_pages[row] or end > self._max_pages:
            raise InvalidArgument(
                f"row {row} holds {int(self._num_pages[row])} of at most {self._max_pages} "
                f"pages; cannot append {len(page_ids)} at {num_pages}"
            )
        if _pack_i32 is not None and len(page_ids) >= _PACKED_RUN and type(page_ids) is list:
            # Packed to int32 in C and copied into the row's bytes: 125 ids in ~0.35 us,
            # against ~1.7 us for numpy's conversion of a list.
            view = self._bytes
            # Made again once the table grew, or a snapshot restored another. (numpy's
            # arrays export the buffer protocol; its stubs do not say so.)
            if view is None or view.obj is not self._table:  # type: ignore[comparison-overlap]
                view = self._bytes = memoryview(self._table).cast("B")  # type: ignore[arg-type]
            start = 4 * (row * self._max_pages + num_pages)
            view[start : start + 4 * len(page_ids)] = _pack_i32(page_ids)
        else:
            self._table[row, num_pages:end] = page_ids
        self._num_pages[row] = end

    def append_page_each(
        self, rows: Sequence[int], num_pages: Sequence[int], page_ids: Sequence[int]
    ) -> None:
        """:meth:`append_page` for many distinct live rows at once (a decode step where
        many requests cross into a new page): row ``rows[i]``, whose length the caller
        keeps as ``num_pages[i]``, gets ``page_ids[i]`` (ids a pool just handed out). All
        or nothing: checked before any row changes."""
        if _ops is not None and _ops.append_each(
            self._table, self._num_pages, rows, num_pages, page_ids
        ):
            return  # checked and written in one C pass (else: nothing changed, named below)
        index = np.asarray(rows, dtype=np.intp)
        at = np.asarray(num_pages, dtype=np.intp)
        if not index.shape == at.shape == (len(page_ids),):
            raise InvalidArgument(
                f"{len(rows)} rows, {len(num_pages)} lengths and {len(page_ids)} page ids"
            )
        if not index.size:
            return
        bad = (self._num_pages[index] != at) | (at >= self._max_pages)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            row = int(index[i])
            raise InvalidArgument(
                f"row {row} holds {int(self._num_pages[row])} of at most {self._max_pages} "
                f"pages; cannot append at {int(at[i])}"
            )
        self._table[index, at] = page_ids
        self._num_pages[index] = at + 1

    def set_page(self, row: int, index: int, page_id: int) -> None:
        """Overwrite one existing entry (a sliding-window page that left becomes ``0``)."""
        self._check_live(row)
        if not isinstance(index, int | np.integer) or not 0 <= index < self._num_pages[row]:
            raise InvalidArgument(
                f"row {row} has {int(self._num_pages[row])} pages; index {index!r} is not one"
            )
        if not 0 <= page_id < _INT32_LIMIT:
            raise InvalidArgument(f"page id {page_id} must lie in [0, 2**31)")
        self._table[row, index] = page_id

    def num_pages(self, row: int) -> int:
        self._check_live(row)
        return int(self._num_pages[row])

    def storage(self) -> Int32Array:
        """The table itself (rows x max pages, not a copy), for C loops that read page ids
        in place; valid until the next :meth:`add_row` (growth moves it)."""
        return self._table

    def page(self, row: int, index: int) -> int:
        """Entry ``index`` of a row (a live row, an index below its length)."""
        # .item(): plain ints out of numpy without scalar objects (~4x faster here).
        if not 0 <= index < self._num_pages.item(row) or not self._is_live.item(row):
            raise InvalidArgument(f"row {row} has no page {index}")
        page: int = self._table.item(row, index)
        return page

    def row(self, row: int) -> Int32Array:
        """A read-only view of the row's pages. Being a view, it shows later
        :meth:`set_page` writes and the zeroes :meth:`release_row` leaves; copy it to keep
        it. Do not hold it across :meth:`add_row` (growth moves the storage)."""
        self._check_live(row)
        view = self._table[row, : self._num_pages[row]]
        view.flags.writeable = False
        return view

    def gather(self, rows: npt.ArrayLike) -> tuple[Int32Array, Int32Array]:
        """The rows' tables in the given order, ``[R, maxlen]`` (maxlen = their longest
        row; shorter rows end in zeros), and their page counts ``[R]``. One fancy-index
        copy, ready for :func:`build_batch_tables`."""
        index = _as_int_array("rows", rows)
        if index.ndim != 1:
            raise InvalidArgument(f"rows must be 1-D, got shape {index.shape}")
        if index.size:
            if index.min() < 0 or index.max() >= self.capacity:
                raise InvalidArgument(f"rows must lie in [0, {self.capacity})")
            if not self._is_live[index].all():
                dead = int(index[~self._is_live[index]][0])
                raise InvalidArgument(f"row {dead} is not in use")
        num_pages = self._num_pages[index]
        max_len = int(num_pages.max()) if num_pages.size else 0
        return self._table[index, :max_len], num_pages
