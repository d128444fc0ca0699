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
    R,
    H,
    stride_src,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAIR_VALUES: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    """out[t] = sum_j src[pos[t, j]] over slots with pos >= 0 (fp32 sum, j ascending); rows with none get zeros.
    A program takes BLOCK_R rows (t < R) by BLOCK_H columns. PAIR_VALUES: also pair_out[t, j] = pair_src[pos[t, j]]
    (zero where pos < 0), from the first column block's programs: the per-pair values the backward returns with dx
    (top-k weight gradients), in the same launch."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + rows * TOP_K + j, mask=row_mask, other=-1).to(tl.int64)
        mask = (p >= 0)[:, None] & col_mask[None, :]
        row = tl.load(src_ptr + tl.maximum(p, 0)[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
        acc += row.to(tl.float32)
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if PAIR_VALUES:
        if tl.program_id(1) == 0:
            slots = tl.arange(0, K_BLOCK)
            pair = rows[:, None] * TOP_K + slots[None, :]
            pair_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
            pos = tl.load(pos_ptr + pair, mask=pair_mask, other=-1).to(tl.int64)
            value = tl.load(pair_src_ptr + tl.maximum(pos, 0), mask=pair_mask & (pos >= 0), other=0.0)
            tl.store(pair_out_ptr + pair, value.to(pair_out_ptr.dtype.element_ty), mask=pair_mask)


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
