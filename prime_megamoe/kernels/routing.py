"""Routing metadata kernels: per-expert counts, and, given the expert-sorted pair order, every row and tile index.

Two small launches around one device sort replace a few dozen tiny framework ops, so building the metadata costs
little host time and never reads a count back to the host.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def routing_keys_kernel(
    index_ptr, key_ptr, counts_ptr, num_pairs, expert_base,
    NUM_LOCAL: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr,
):
    """key = local expert id of each (row, slot) pair, or NUM_LOCAL where the expert lives elsewhere; counts[key] += 1
    for local keys.
    Integer atomics: the counts are exact whatever order the programs run in."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    local = tl.load(index_ptr + offs, mask=mask, other=-1).to(tl.int32) - expert_base
    key = tl.where((local >= 0) & (local < NUM_LOCAL), local, NUM_LOCAL)
    tl.store(key_ptr + offs, key, mask=mask)
    hist = tl.histogram(tl.where(mask, key, NUM_BINS - 1), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(counts_ptr + bins, hist, mask=(bins < NUM_LOCAL) & (hist > 0))


@triton.jit
def routing_plan_kernel(
    order_ptr, weights_ptr, counts_ptr,
    row_src_ptr, row_weight_ptr, pair_pos_ptr, expert_offsets_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr,
    num_pairs, max_tiles,
    TOP_K: tl.constexpr, NUM_LOCAL: tl.constexpr, EXPERT_BLOCK: tl.constexpr, TILE_M: tl.constexpr,
    BLOCK: tl.constexpr, TILE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    experts = tl.arange(0, EXPERT_BLOCK)
    counts = tl.load(counts_ptr + experts, mask=experts < NUM_LOCAL, other=0)
    row_end = tl.cumsum(counts, 0)
    total = tl.sum(counts, 0)
    tiles = (counts + TILE_M - 1) // TILE_M
    tile_end = tl.cumsum(tiles, 0)

    # Sorted rows: source row, weight, and the inverse map from each pair to its sorted row (-1: not local).
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < num_pairs
    pair = tl.load(order_ptr + rows, mask=in_range, other=0)
    tl.store(row_src_ptr + rows, (pair // TOP_K).to(tl.int32), mask=in_range)
    tl.store(row_weight_ptr + rows, tl.load(weights_ptr + pair, mask=in_range, other=0.0).to(tl.float32), mask=in_range)
    tl.store(pair_pos_ptr + pair, tl.where(rows < total, rows, -1).to(tl.int32), mask=in_range)

    if pid == 0:
        tl.store(expert_offsets_ptr + experts + 1, row_end.to(tl.int32), mask=experts < NUM_LOCAL)
        tl.store(expert_offsets_ptr, 0)
        tl.store(num_tiles_ptr, tl.sum(tiles, 0).to(tl.int32))

    # Tile list: tile t belongs to the expert whose tile range holds it; programs share the static tile bound.
    for t0 in range(pid * TILE_BLOCK, max_tiles, tl.num_programs(0) * TILE_BLOCK):
        t = t0 + tl.arange(0, TILE_BLOCK)
        before = (tile_end[None, :] <= t[:, None]) & (experts[None, :] < NUM_LOCAL)  # experts wholly before t
        expert = tl.minimum(tl.sum(before.to(tl.int32), 1), NUM_LOCAL - 1)
        first_tile = tl.sum(tl.where(before, tiles[None, :], 0), 1)
        first_row = tl.sum(tl.where(before, counts[None, :], 0), 1)
        t_mask = t < max_tiles
        tl.store(tile_expert_ptr + t, expert.to(tl.int32), mask=t_mask)
        tl.store(tile_row_ptr + t, (first_row + (t - first_tile) * TILE_M).to(tl.int32), mask=t_mask)
