"""Routing metadata kernels: per-expert counts, then a stable counting sort of the pairs by expert that writes every
row and tile index of the plan directly.

Two small launches replace a few dozen tiny framework ops (a general device sort alone is a dozen launches and
memsets for keys that take at most a few hundred values), so building the metadata costs little host time and never
reads a count back to the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .quantize import quantize_tile


@triton.jit
def routing_keys_kernel(
    index_ptr,
    key_ptr,
    counts_ptr,
    hist_ptr,
    num_pairs,
    pairs_per_segment,
    expert_base,
    weights_ptr,
    out_index_ptr,
    out_weights_ptr,
    x_ptr,
    q_ptr,
    s_ptr,
    x_rows,
    x_cols,
    stride_xm,
    stride_qm,
    stride_sm,
    key_programs,
    x_col_tiles,
    id_check_ptr,
    num_experts,
    NUM_LOCAL: tl.constexpr,
    NUM_BINS: tl.constexpr,
    SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
    COPY_ROUTING: tl.constexpr,
    CHECK_IDS: tl.constexpr,
    QUANT_ROWS: tl.constexpr,
    QK: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    POW2: tl.constexpr,
    E8M0: tl.constexpr,
):
    """key = segment * NUM_LOCAL + local expert id of each (row, slot) pair, or SKIP (= segments * NUM_LOCAL) where
    the expert lives elsewhere; counts[key] += 1 for local keys. Segments count from the first one this launch
    covers (a segment is a block of consecutive source rows: one source rank's tokens under expert parallelism), so
    sorting by key orders rows by segment, then by expert. Integer atomics: the counts are exact whatever order the
    programs run in. hist [programs, NUM_BINS]: each program's count per key (the sort's chunk table); NUM_BINS >
    SKIP + 1, so the padding lanes' bin (the last) is no key.

    COPY_ROUTING: also write the ids as int32 to out_index and the weights (weights_ptr) as fp32 to out_weights, the
    form peers read a published routing in: the copy rides on this launch instead of taking kernels of its own on
    the side stream, where they would wait for a free SM behind the GEMMs and hold back the publish.

    CHECK_IDS: a program that meets an id outside [-1, num_experts) stores 1 at id_check[0] (zeroed with the
    counts; every such program stores the same 1), for ``routing_place_kernel`` to turn into the plan's flag: the
    range check of ``validation.check_expert_ids`` without launches of its own.

    QUANT_ROWS: programs from ``key_programs`` on quantise x [x_rows, x_cols] per row in 1 x QK blocks into q and
    scales s (``quantize.quantize_tile``, BM x BK tiles, ``x_col_tiles`` a row): the quantised forward's rows ride
    on this launch, one launch fewer on the host's path to the first GEMM. Otherwise the x arguments are unused."""
    pid = tl.program_id(0)
    if QUANT_ROWS:
        if pid >= key_programs:
            tile = pid - key_programs
            quantize_tile(
                x_ptr,
                q_ptr,
                s_ptr,
                0,
                0,
                tile // x_col_tiles,
                tile % x_col_tiles,
                x_rows,
                x_cols,
                0,
                0,
                stride_xm,
                1,
                0,
                0,
                stride_qm,
                1,
                0,
                0,
                stride_sm,
                1,
                1,
                QK,
                BM,
                BK,
                POW2,
                E8M0,
            )
            return
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    raw_ids = tl.load(index_ptr + offs, mask=mask, other=-1)
    if CHECK_IDS:  # on the ids as given (int64 ones too), before the narrowing below
        bad = ((raw_ids < -1) | (raw_ids >= num_experts)).to(tl.int32)
        if tl.max(bad, 0) > 0:
            tl.store(id_check_ptr, 1)
    ids = raw_ids.to(tl.int32)
    if COPY_ROUTING:
        tl.store(out_index_ptr + offs, ids, mask=mask)
        tl.store(out_weights_ptr + offs, tl.load(weights_ptr + offs, mask=mask, other=0.0).to(tl.float32), mask=mask)
    local = ids - expert_base
    segment = offs // pairs_per_segment
    key = tl.where((local >= 0) & (local < NUM_LOCAL), segment * NUM_LOCAL + local, SKIP)
    tl.store(key_ptr + offs, key, mask=mask)
    hist = tl.histogram(tl.where(mask, key, NUM_BINS - 1), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    tl.store(hist_ptr + pid * NUM_BINS + bins, hist)
    tl.atomic_add(counts_ptr + bins, hist, mask=(bins < SKIP) & (hist > 0))


@triton.jit
def routing_place_kernel(
    key_ptr,
    hist_ptr,
    weights_ptr,
    counts_ptr,
    row_src_ptr,
    row_weight_ptr,
    pair_pos_ptr,
    expert_offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_tiles_ptr,
    half_tile_expert_ptr,
    half_tile_row_ptr,
    half_num_tiles_ptr,
    num_pairs,
    first_segment,
    pairs_per_segment,
    tiles_per_segment,
    split_expert,
    id_check_ptr,
    TOP_K: tl.constexpr,
    NUM_LOCAL: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    SKIP: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
    HALVES: tl.constexpr,
    HIST_BLOCK: tl.constexpr,
    CHECK_IDS: tl.constexpr,
):
    """Grid (1 + segments of this launch, chunks of BLOCK pairs as routing_keys_kernel's programs). Plans segments
    [first_segment, first_segment + SKIP // NUM_LOCAL) of the plan from their pairs' keys, counts and per-chunk
    counts (``hist``). Every segment has fixed places, so segments can be planned in separate launches (a rank plans
    its own block before the peers' routing arrives):

    - sorted rows [s * P, s * P + count_s) (P = pairs_per_segment), expert-major, pairs in index order within an
      expert (a stable counting sort by key): source row, weight, and the inverse map from each pair to its sorted
      row (-1: not local). Program (0, c) sorts chunk c's keys once (with their lanes, so the sort is stable) and
      places each pair after the segment's pairs of smaller keys (``counts``), the key's pairs in earlier chunks
      (``hist``) and the chunk's earlier pairs of its key; each pair is written by exactly one program, at a place
      fixed by the keys alone.
    - expert offsets [s * (NUM_LOCAL + 1), (s + 1) * (NUM_LOCAL + 1)): expert e's rows are [off[e], off[e + 1]);
    - tile slots [s * tiles_per_segment, (s + 1) * tiles_per_segment), of which num_tiles[s] are in use, and each
      expert's tiles within them, expert_tiles [s * (NUM_LOCAL + 1), ...): expert e's tiles are the segment's
      [et[e], et[e + 1]) (what the weight gradients walk): programs (1 + s, c), from the counts alone.

    CHECK_IDS: program (0, 0) sets id_check[1] to 1 if routing_keys_kernel found no id out of range (id_check[0]
    still 0), else 0: the flag the plan's ``assert_ids_in_range`` asserts on.

    HALVES: also split each segment's tiles at expert ``split_expert``: the lower experts' tiles are the first
    half_num_tiles[s, 0] of the segment's list; the upper experts' half_num_tiles[s, 1] tiles are copied, from slot
    s * tiles_per_segment on, into the half tile list, so either half can be launched on its own."""
    chunk = tl.program_id(1)
    if CHECK_IDS:
        if (tl.program_id(0) == 0) & (chunk == 0):
            tl.store(id_check_ptr + 1, (tl.load(id_check_ptr) == 0).to(tl.int32))
    if tl.program_id(0) == 0:
        lanes = tl.arange(0, BLOCK)
        offs = chunk * BLOCK + lanes
        # Padding lanes take the last bin (no key), which sorts after every key.
        keys = tl.load(key_ptr + offs, mask=offs < num_pairs, other=NUM_BINS - 1)
        order = tl.sort(keys * BLOCK + lanes)  # key-major, lane order within a key: a stable sort of the chunk
        sorted_keys = order // BLOCK
        pair = chunk * BLOCK + order % BLOCK
        bins = tl.arange(0, NUM_BINS)
        # Per key b: the sorted row of its first pair in this chunk, less the chunk's pairs of smaller keys (the
        # sorted position of that pair).
        key_counts = tl.load(counts_ptr + bins, mask=bins < SKIP, other=0)
        smaller = tl.cumsum(key_counts, 0) - key_counts  # every smaller key, earlier segments' too
        for s in tl.static_range(1, SKIP // NUM_LOCAL):  # less each earlier segment's pairs (its rows start at s * P)
            previous = tl.sum(tl.where((bins >= (s - 1) * NUM_LOCAL) & (bins < s * NUM_LOCAL), key_counts, 0), 0)
            smaller -= tl.where(bins >= s * NUM_LOCAL, previous, 0)
        in_earlier_chunks = tl.zeros((NUM_BINS,), dtype=tl.int32)
        for c0 in range(0, chunk, HIST_BLOCK):
            hist_rows = c0 + tl.arange(0, HIST_BLOCK)
            block = tl.load(
                hist_ptr + hist_rows[:, None] * NUM_BINS + bins[None, :], mask=(hist_rows < chunk)[:, None], other=0
            )
            in_earlier_chunks += tl.sum(block, 0)
        chunk_hist = tl.load(hist_ptr + chunk * NUM_BINS + bins)
        first_rows = (first_segment + bins // NUM_LOCAL) * pairs_per_segment
        key_base = first_rows + smaller + in_earlier_chunks - (tl.cumsum(chunk_hist, 0) - chunk_hist)
        placed = tl.gather(key_base, sorted_keys, 0) + lanes
        valid = pair < num_pairs
        local = valid & (sorted_keys < SKIP)
        global_pair = first_segment * pairs_per_segment + pair
        weights = tl.load(weights_ptr + pair, mask=local, other=0.0).to(tl.float32)
        tl.store(row_src_ptr + placed, (global_pair // TOP_K).to(tl.int32), mask=local)
        tl.store(row_weight_ptr + placed, weights, mask=local)
        tl.store(pair_pos_ptr + global_pair, tl.where(local, placed, -1).to(tl.int32), mask=valid)
    else:
        seg = tl.program_id(0) - 1
        pid = chunk
        experts = tl.arange(0, EXPERT_BLOCK)
        e_mask = experts < NUM_LOCAL
        counts = tl.load(counts_ptr + seg * NUM_LOCAL + experts, mask=e_mask, other=0)
        plan_seg = first_segment + seg
        seg_base = plan_seg * pairs_per_segment  # first sorted row of this segment
        row_end = tl.cumsum(counts, 0)
        tiles = (counts + TILE_M - 1) // TILE_M
        tile_end = tl.cumsum(tiles, 0)
        if HALVES:
            lower = tl.sum(tl.where(experts < split_expert, tiles, 0), 0)  # the lower experts' tiles
        if pid == 0:
            offsets = expert_offsets_ptr + plan_seg * (NUM_LOCAL + 1)
            tl.store(offsets + experts + 1, (seg_base + row_end).to(tl.int32), mask=e_mask)
            tl.store(offsets, seg_base.to(tl.int32))
            tl.store(num_tiles_ptr + plan_seg, tl.sum(tiles, 0).to(tl.int32))
            expert_tiles = expert_tiles_ptr + plan_seg * (NUM_LOCAL + 1)
            tl.store(expert_tiles + experts + 1, tile_end.to(tl.int32), mask=e_mask)
            tl.store(expert_tiles, 0)
            if HALVES:
                tl.store(half_num_tiles_ptr + 2 * plan_seg, lower.to(tl.int32))
                tl.store(half_num_tiles_ptr + 2 * plan_seg + 1, (tl.sum(tiles, 0) - lower).to(tl.int32))
        # Tile list: tile t belongs to the expert whose tile range holds it; programs share the static tile bound.
        for t0 in range(pid * TILE_BLOCK, tiles_per_segment, tl.num_programs(1) * TILE_BLOCK):
            t = t0 + tl.arange(0, TILE_BLOCK)
            before_t = (tile_end[None, :] <= t[:, None]) & e_mask[None, :]  # experts wholly before t
            expert = tl.minimum(tl.sum(before_t.to(tl.int32), 1), NUM_LOCAL - 1)
            first_tile = tl.sum(tl.where(before_t, tiles[None, :], 0), 1)
            first_row = tl.sum(tl.where(before_t, counts[None, :], 0), 1)
            t_mask = t < tiles_per_segment
            slot = plan_seg * tiles_per_segment + t
            row = (seg_base + first_row + (t - first_tile) * TILE_M).to(tl.int32)
            tl.store(tile_expert_ptr + slot, expert.to(tl.int32), mask=t_mask)
            tl.store(tile_row_ptr + slot, row, mask=t_mask)
            if HALVES:
                # Tiles past the segment's count land past the upper half's count too: never read.
                upper = t_mask & (expert >= split_expert)
                half_slot = slot - lower
                tl.store(half_tile_expert_ptr + half_slot, expert.to(tl.int32), mask=upper)
                tl.store(half_tile_row_ptr + half_slot, row, mask=upper)


@triton.jit
def expert_ids_in_range_kernel(index_ptr, ok_ptr, num_ids, num_experts, BLOCK: tl.constexpr):
    """ok[0] (set to 1 before the launch) becomes 0 if any id lies outside [-1, num_experts) (-1: an empty slot). A
    program per BLOCK ids; every program that finds one stores the same 0, so the order of their stores does not
    matter."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(index_ptr + offs, mask=offs < num_ids, other=0)
    bad = ((ids < -1) | (ids >= num_experts)).to(tl.int32)
    if tl.max(bad, 0) > 0:
        tl.store(ok_ptr, 0)


@triton.jit
def expert_tile_list_kernel(
    expert_tiles_ptr,
    offsets_ptr,
    tiles_ptr,
    tiles_per_segment,
    NUM_SEGMENTS: tl.constexpr,
    NUM_LOCAL: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Expert e's row tiles over every segment of a plan, in segment order, as one list: tiles[offsets[e] :
    offsets[e + 1]]. ``expert_tiles`` [S * (E + 1)]: segment s's expert e owns the segment's tiles [et[s(E+1) + e],
    et[s(E+1) + e + 1]), numbered in the segment (the plan's tile numbers: plus s * tiles_per_segment). A program
    per expert; the last also writes offsets[E]."""
    e = tl.program_id(0)
    experts = tl.arange(0, EXPERT_BLOCK)
    before = 0  # tiles of the experts below e, in every segment
    for s in tl.static_range(NUM_SEGMENTS):
        seg = expert_tiles_ptr + s * (NUM_LOCAL + 1)
        lo = tl.load(seg + experts, mask=experts < e, other=0)
        hi = tl.load(seg + experts + 1, mask=experts < e, other=0)
        before += tl.sum(hi - lo, 0)
    tl.store(offsets_ptr + e, before)
    pos = before
    for s in tl.static_range(NUM_SEGMENTS):
        lo = tl.load(expert_tiles_ptr + s * (NUM_LOCAL + 1) + e)
        hi = tl.load(expert_tiles_ptr + s * (NUM_LOCAL + 1) + e + 1)
        for first in range(lo, hi, BLOCK):
            tile = first + tl.arange(0, BLOCK)
            tl.store(tiles_ptr + pos + tile - lo, s * tiles_per_segment + tile, mask=tile < hi)
        pos += hi - lo
    if e == NUM_LOCAL - 1:
        tl.store(offsets_ptr + NUM_LOCAL, pos)
