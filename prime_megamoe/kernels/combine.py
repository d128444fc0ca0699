"""Deterministic combine: each output row is the sum of up to k source rows, taken in slot order (no atomics)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def combine_rows_kernel(
    src_ptr,
    pos_ptr,
    out_ptr,
    pair_src_ptr,
    pair_out_ptr,
    H,
    stride_src,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAIR_VALUES: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    """out[t] = sum_j src[pos[t, j]] over slots with pos >= 0 (fp32 sum, j ascending); rows with none get zeros.
    PAIR_VALUES: also pair_out[t, j] = pair_src[pos[t, j]] (zero where pos < 0), from the first column block's
    program: the per-pair values the backward returns with dx (top-k weight gradients), in the same launch."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # The slot's row index, broadcast over the columns (a per-column mask keeps the interpreter happy too).
        p = tl.zeros((BLOCK_H,), dtype=tl.int64) + tl.load(pos_ptr + t * TOP_K + j).to(tl.int64)
        row = tl.load(src_ptr + tl.maximum(p, 0) * stride_src + cols, mask=col_mask & (p >= 0), other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
    if PAIR_VALUES:
        if tl.program_id(1) == 0:
            slots = tl.arange(0, K_BLOCK)
            slot_mask = slots < TOP_K
            pos = tl.load(pos_ptr + t * TOP_K + slots, mask=slot_mask, other=-1).to(tl.int64)
            value = tl.load(pair_src_ptr + tl.maximum(pos, 0), mask=slot_mask & (pos >= 0), other=0.0)
            tl.store(pair_out_ptr + t * TOP_K + slots, value.to(pair_out_ptr.dtype.element_ty), mask=slot_mask)


@triton.jit
def sum_blocks_kernel(
    blocks_ptr,
    out_ptr,
    num_rows,
    num_cols,
    stride_block,
    stride_row,
    stride_out,
    NUM_BLOCKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """out[t] = sum_s blocks[s, t] in fp32, s ascending (rank order): one pass, no fp32 copy of the blocks."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    offs = rows[:, None] * stride_row + cols[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for s in tl.static_range(NUM_BLOCKS):
        acc += tl.load(blocks_ptr + s * stride_block + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
