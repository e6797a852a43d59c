"""Reference paged attention (torch, CPU or any device): the proof that published tables are
right for a kernel.

A worker owns a KV cache laid out the way paged-attention kernels see it, in kernel blocks::

    k_cache, v_cache: [num_kernel_blocks, kernel_block_size, num_kv_heads, head_dim]
    num_kernel_blocks = num_pages * r,   r = page_size // kernel_block_size

    slot s  ->  k_cache[s // kernel_block_size, s % kernel_block_size]
               (= page s // page_size, offset s % page_size: the same memory, whatever r is)

Each step it writes the scheduled tokens' K/V at their slots (``write_kv(slot_mapping, ...)``)
and computes attention for the batch by gathering K/V through the kernel block table
(``paged_attention``). :func:`dense_attention` is the baseline: the same attention over one
request's contiguous K/V with ``torch.nn.functional.scaled_dot_product_attention``. A table
that points anywhere wrong (a wrong expansion ratio, a stale page, a page shared by mistake)
reads other tokens' K/V, or unwritten memory, which the cache fills with NaN by default, and
the two disagree.

Semantics (vLLM's): a request with ``seq_len`` tokens of context after this step schedules
its last ``query_len`` tokens; query ``i`` sits at position ``seq_len - query_len + i`` and
attends causally to positions ``<=`` its own; with a sliding window ``w`` only to the last
``w`` positions (``pos - w < key_pos <= pos``). Kernel blocks that lie wholly before the
first query's window are never read, which is what lets a sliding-window table hold the null
page there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


class ReferencePagedAttention:
    """A KV cache in kernel blocks plus a straightforward paged attention over it.

    ``fill`` initialises the cache (NaN by default, so reading a slot nobody wrote poisons
    the output instead of passing silently).
    """

    def __init__(
        self,
        *,
        num_kernel_blocks: int,
        kernel_block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        fill: float = math.nan,
    ) -> None:
        if min(num_kernel_blocks, kernel_block_size, num_kv_heads, head_dim) < 1:
            raise ValueError("cache dimensions must be positive")
        shape = (num_kernel_blocks, kernel_block_size, num_kv_heads, head_dim)
        self.kernel_block_size = kernel_block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.k_cache = torch.full(shape, fill, dtype=dtype, device=device)
        self.v_cache = torch.full(shape, fill, dtype=dtype, device=device)

    @classmethod
    def for_pages(
        cls,
        *,
        num_pages: int,
        page_size: int,
        kernel_block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        fill: float = math.nan,
    ) -> ReferencePagedAttention:
        """A cache for a pool of ``num_pages`` pages, seen as kernel blocks."""
        if page_size % kernel_block_size:
            raise ValueError(
                f"page size {page_size} is not a multiple of kernel block size {kernel_block_size}"
            )
        return cls(
            num_kernel_blocks=num_pages * (page_size // kernel_block_size),
            kernel_block_size=kernel_block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            fill=fill,
        )

    @property
    def num_slots(self) -> int:
        return int(self.k_cache.shape[0]) * self.kernel_block_size

    def write_kv(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store token ``t``'s K/V (``[num_tokens, num_kv_heads, head_dim]``) at slot
        ``slot_mapping[t]``; negative slots (padding) are skipped."""
        slots = slot_mapping.to(device=self.k_cache.device, dtype=torch.long)
        if slots.ndim != 1 or k.shape != v.shape or k.shape[0] != slots.shape[0]:
            raise ValueError(
                f"slot_mapping {tuple(slots.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                "do not describe the same tokens"
            )
        keep = slots >= 0
        slots = slots[keep]
        if slots.numel() and int(slots.max()) >= self.num_slots:
            raise IndexError(f"slot {int(slots.max())} beyond the cache ({self.num_slots} slots)")
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k[slots] = k.to(device=flat_k.device, dtype=flat_k.dtype)[keep]
        flat_v[slots] = v.to(device=flat_v.device, dtype=flat_v.dtype)[keep]

    def paged_attention(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        query_lens: Sequence[int] | torch.Tensor,
        *,
        row_lengths: Sequence[int] | torch.Tensor | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Attention of the batch's scheduled tokens through the kernel block table.

        ``q``: ``[num_tokens, num_q_heads, head_dim]``, requests' tokens in batch order
        (``query_lens[i]`` each); ``block_table[i]``: request i's kernel block ids;
        ``seq_lens[i]``: its context length after this step. ``row_lengths`` (as
        published) bounds what may be read: a table too short for ``seq_len`` raises
        ``ValueError`` rather than reading padding. Returns ``[num_tokens, num_q_heads,
        head_dim]``.
        """
        seq_list = [int(x) for x in seq_lens]
        query_list = [int(x) for x in query_lens]
        if len(seq_list) != len(query_list) or block_table.shape[0] < len(seq_list):
            raise ValueError("seq_lens, query_lens and block_table rows must match")
        if sum(query_list) != q.shape[0]:
            raise ValueError(f"query_lens sum to {sum(query_list)}, q has {q.shape[0]} tokens")
        num_q_heads = q.shape[1]
        if num_q_heads % self.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads for {self.num_kv_heads} KV heads")
        group = num_q_heads // self.num_kv_heads
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        kbs = self.kernel_block_size
        table = block_table.to(device=self.k_cache.device, dtype=torch.long)
        q = q.to(self.k_cache.device)
        limits = None if row_lengths is None else [int(x) for x in row_lengths]
        out = torch.empty_like(q)
        start = 0
        for i, (seq_len, query_len) in enumerate(zip(seq_list, query_list, strict=True)):
            if not 0 < query_len <= seq_len:
                raise ValueError(f"request {i}: query_len {query_len}, seq_len {seq_len}")
            first_query_pos = seq_len - query_len
            first_key = (
                0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)
            )
            first_block = first_key // kbs
            end_block = -(-seq_len // kbs)
            have = table.shape[1] if limits is None else limits[i]
            if end_block > have:
                raise ValueError(
                    f"request {i}: {seq_len} tokens need {end_block} kernel blocks, its table "
                    f"row has {have}"
                )
            blocks = table[i, first_block:end_block]
            k = self.k_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)
            v = self.v_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)
            key_pos = torch.arange(
                first_block * kbs, first_block * kbs + k.shape[0], device=q.device
            )
            keep = key_pos < seq_len
            k, v, key_pos = k[keep], v[keep], key_pos[keep]
            query_pos = torch.arange(first_query_pos, seq_len, device=q.device)
            allowed = key_pos[None, :] <= query_pos[:, None]
            if sliding_window is not None:
                allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
            k = k.repeat_interleave(group, dim=1).to(q.dtype)
            v = v.repeat_interleave(group, dim=1).to(q.dtype)
            qi = q[start : start + query_len]
            scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
            scores = scores.masked_fill(~allowed[None], -math.inf)
            probs = torch.softmax(scores, dim=-1)
            out[start : start + query_len] = torch.einsum("hqk,khd->qhd", probs, v)
            start += query_len
        return out


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The baseline: ``q`` (``[query_len, num_q_heads, head_dim]``) are the last
    ``query_len`` positions of one sequence whose K/V (``[seq_len, num_kv_heads, head_dim]``)
    are contiguous; causal (and windowed) attention with torch's
    ``scaled_dot_product_attention``."""
    query_len, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.repeat_interleave(group, dim=1).transpose(0, 1)[None].to(q.dtype),
        v.repeat_interleave(group, dim=1).transpose(0, 1)[None].to(q.dtype),
        attn_mask=mask,
        scale=scale,
    )
    return out[0].transpose(0, 1)
