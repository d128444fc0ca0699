"""Grouped GEMMs over variable rows per expert, with the MoE's gathers and epilogues fused in.

Rows are in expert-sorted order: expert e owns rows [expert_offsets[e], expert_offsets[e+1]). A tile list built on
the device (see ``prime_megamoe.ops.routing_plan``) names, for each TILE_M tile of rows, its expert and first row (a
program takes a tile, or a BLOCK_M part of one); a launch covers the static upper bound of tiles and programs past
the device-side tile count return at once, so no host ever reads a count.

Kernels only: they know nothing of autograd or configs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation import clamp_gate_up
from .tuning import autotune, autotune_configs


@triton.jit
def _dot(a, b, acc, CAST_F32: tl.constexpr, IEEE: tl.constexpr):
    # The interpreter computes bf16 dots wrongly: it gets fp32 tiles instead. fp32 inputs use exact fp32 products.
    if CAST_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def tile_span(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid_m, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr):
    """Expert, first row and the expert's row end of row block ``pid_m``. The tile list has TILE_M-row tiles; a
    program may take BLOCK_M rows of one (BLOCK_M divides TILE_M): block ``pid_m`` is part ``pid_m % (TILE_M //
    BLOCK_M)`` of tile ``pid_m // (TILE_M // BLOCK_M)``. Smaller blocks hold fewer accumulators, for configs that
    need the room."""
    tl.static_assert(TILE_M % BLOCK_M == 0)
    PARTS: tl.constexpr = TILE_M // BLOCK_M
    tile = pid_m // PARTS
    expert = tl.load(tile_expert_ptr + tile)
    row_start = tl.load(tile_row_ptr + tile) + (pid_m % PARTS) * BLOCK_M
    return expert, row_start, tl.load(expert_offsets_ptr + expert + 1)


@triton.jit
def tile_rows(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid_m, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr):
    """Expert, row indices and row mask of row block ``pid_m`` (see ``tile_span``)."""
    expert, row_start, row_end = tile_span(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid_m, BLOCK_M, TILE_M)
    rows = row_start + tl.arange(0, BLOCK_M)
    return expert, rows, rows < row_end


# ----------------------------------------------------------------------------------------------------------------
# FC1 + SwiGLU:  h = x[src - row_base] @ W1[e]^T,  a = silu(h[:, :I]) * h[:, I:]
# (CLAMP: a = silu(min(g, c)) * clamp(u, -c, c) with c = clamp_limit, kernels/activation.py; h is stored unclamped)
# (row_base: where x starts among the plan's source rows; the own block of an expert-parallel plan is read from the
# caller's tokens, which are rows [rank * C, rank * C + T) of the gathered blocks)
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _fc1_swiglu_tile(
    x_ptr,
    row_src_ptr,
    w_ptr,
    h_ptr,
    a_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    expert_offsets_ptr,
    pid_m,
    pid_n,
    N,
    K,
    row_base,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_hm,
    stride_am,
    clamp_limit,
    SAVE_H: tl.constexpr,
    CLAMP: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_M: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    expert, rows, row_mask = tile_rows(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid_m, BLOCK_M, TILE_M)
    src = tl.load(row_src_ptr + rows, mask=row_mask, other=row_base).to(tl.int64) - row_base
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + src[:, None] * stride_xm + ks[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if ONE_DOT:
        # Gate and up columns interleaved in one [BLOCK_K, 2 * BLOCK_N] operand (even: gate row c, odd: up row
        # N + c): one MMA per K step reads the row tile once for both, and the accumulator's column pairs (held by
        # one thread) split back into gate and up without moving data.
        pairs = tl.arange(0, 2 * BLOCK_N)
        w_cols = pid_n * BLOCK_N + pairs // 2
        w_rows = w_cols + (pairs % 2) * N
        gu_ptrs = w_base + w_rows[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            wgu = tl.load(gu_ptrs, mask=k_mask[:, None] & (w_cols < N)[None, :], other=0.0)
            acc = _dot(a, wgu, acc, CAST_F32, IEEE)
            a_ptrs += BLOCK_K
            gu_ptrs += BLOCK_K * stride_wk
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        g_ptrs = w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        u_ptrs = g_ptrs + N * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc_g = _dot(a, wg, acc_g, CAST_F32, IEEE)
            acc_u = _dot(a, wu, acc_u, CAST_F32, IEEE)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
    out_mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    if SAVE_H:
        h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
        tl.store(h_ptrs, acc_g.to(h_ptr.dtype.element_ty), mask=out_mask)
        tl.store(h_ptrs + N, acc_u.to(h_ptr.dtype.element_ty), mask=out_mask)
    if CLAMP:
        acc_g, acc_u = clamp_gate_up(acc_g, acc_u, clamp_limit)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(a_ptr + rows64[:, None] * stride_am + cols[None, :], act.to(a_ptr.dtype.element_ty), mask=out_mask)


@autotune(autotune_configs("fc1"), key=["N", "K", "M_BUCKET", "TILE_M"])
@triton.jit
def fc1_swiglu_kernel(
    x_ptr,
    row_src_ptr,
    w_ptr,
    h_ptr,
    a_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    N,
    K,
    M_BUCKET,
    NUM_SMS,
    row_base,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_hm,
    stride_am,
    clamp_limit,
    SAVE_H: tl.constexpr,
    CLAMP: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    if PERSISTENT:
        num_n = tl.cdiv(N, BLOCK_N)
        total = tl.load(num_tiles_ptr) * (TILE_M // BLOCK_M) * num_n
        for work in tl.range(tl.program_id(0), total, NUM_SMS, flatten=True):
            _fc1_swiglu_tile(
                x_ptr,
                row_src_ptr,
                w_ptr,
                h_ptr,
                a_ptr,
                tile_expert_ptr,
                tile_row_ptr,
                expert_offsets_ptr,
                work // num_n,
                work % num_n,
                N,
                K,
                row_base,
                stride_xm,
                stride_we,
                stride_wn,
                stride_wk,
                stride_hm,
                stride_am,
                clamp_limit,
                SAVE_H,
                CLAMP,
                CAST_F32,
                IEEE,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                TILE_M,
                ONE_DOT,
            )
    else:
        pid_m = tl.program_id(1)
        if pid_m < tl.load(num_tiles_ptr) * (TILE_M // BLOCK_M):
            _fc1_swiglu_tile(
                x_ptr,
                row_src_ptr,
                w_ptr,
                h_ptr,
                a_ptr,
                tile_expert_ptr,
                tile_row_ptr,
                expert_offsets_ptr,
                pid_m,
                tl.program_id(0),
                N,
                K,
                row_base,
                stride_xm,
                stride_we,
                stride_wn,
                stride_wk,
                stride_hm,
                stride_am,
                clamp_limit,
                SAVE_H,
                CLAMP,
                CAST_F32,
                IEEE,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                TILE_M,
                ONE_DOT,
            )


# ----------------------------------------------------------------------------------------------------------------
# Plain grouped GEMM with optional row gather and optional per-row scale:
#   C[r] = scale[r] * A[src[r] - row_base] @ B[e]     (B addressed by strides, so W or W^T both work)
# Used for FC2 (A = SwiGLU output, scale = top-k weight) and the FC1 dgrad (A = d[gate, up], B = W1).
# With A_TMA, an A that is not gathered is read by TMA in [BLOCK_M, BLOCK_K] boxes from its sorted rows (rows past the
# expert's end are read and their output rows not stored); with B_TMA, B[e] is read by TMA from the weights viewed as
# 2D: [E * N, K] boxes [BLOCK_N, BLOCK_K] when B_KMAJOR (B[e] = W[e]^T, K contiguous), else [E * K, N] boxes
# [BLOCK_K, BLOCK_N]. A box past K or N reads zeros or a neighbouring expert's rows; those meet zero A columns (the
# K tail) or land in output columns that are not stored (the N tail).
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _gemm_tile(
    a_desc,
    b_desc,
    a_ptr,
    row_src_ptr,
    b_ptr,
    c_ptr,
    row_scale_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    expert_offsets_ptr,
    pid_m,
    pid_n,
    N,
    K,
    row_base,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    GATHER_A: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_M: tl.constexpr,
):
    expert, row_start, row_end = tile_span(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid_m, BLOCK_M, TILE_M)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    if GATHER_A:
        src = tl.load(row_src_ptr + rows, mask=row_mask, other=row_base).to(tl.int64) - row_base
    else:
        src = rows.to(tl.int64)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    if B_KMAJOR:  # the expert's first row in the 2D view of the weights
        b_row0 = expert * N
    else:
        b_row0 = expert * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A_TMA:
            a = a_desc.load([row_start, k0])
        else:
            a = tl.load(a_ptrs, mask=row_mask[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
        if B_TMA:
            if B_KMAJOR:
                b = tl.trans(b_desc.load([b_row0 + n0, k0]))
            else:
                b = b_desc.load([b_row0 + k0, n0])
        else:
            b = tl.load(b_ptrs, mask=((k0 + ks) < K)[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a, b, acc, CAST_F32, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if SCALE_ROWS:
        acc = acc * tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@autotune(autotune_configs("gemm"), key=["N", "K", "M_BUCKET", "TILE_M"])
@triton.jit
def grouped_gemm_kernel(
    a_desc,
    b_desc,
    a_ptr,
    row_src_ptr,
    b_ptr,
    c_ptr,
    row_scale_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    N,
    K,
    M_BUCKET,
    NUM_SMS,
    row_base,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    GATHER_A: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    if PERSISTENT:
        # NUM_SMS programs walk the (row tile, column block) work list; the flattened loop lets one tile's epilogue
        # overlap the next tile's first loads.
        num_n = tl.cdiv(N, BLOCK_N)
        total = tl.load(num_tiles_ptr) * (TILE_M // BLOCK_M) * num_n
        for work in tl.range(tl.program_id(0), total, NUM_SMS, flatten=True):
            _gemm_tile(
                a_desc,
                b_desc,
                a_ptr,
                row_src_ptr,
                b_ptr,
                c_ptr,
                row_scale_ptr,
                tile_expert_ptr,
                tile_row_ptr,
                expert_offsets_ptr,
                work // num_n,
                work % num_n,
                N,
                K,
                row_base,
                stride_am,
                stride_be,
                stride_bk,
                stride_bn,
                stride_cm,
                GATHER_A,
                SCALE_ROWS,
                CAST_F32,
                IEEE,
                A_TMA,
                B_TMA,
                B_KMAJOR,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                TILE_M,
            )
    else:
        pid_m = tl.program_id(1)
        if pid_m < tl.load(num_tiles_ptr) * (TILE_M // BLOCK_M):
            _gemm_tile(
                a_desc,
                b_desc,
                a_ptr,
                row_src_ptr,
                b_ptr,
                c_ptr,
                row_scale_ptr,
                tile_expert_ptr,
                tile_row_ptr,
                expert_offsets_ptr,
                pid_m,
                tl.program_id(0),
                N,
                K,
                row_base,
                stride_am,
                stride_be,
                stride_bk,
                stride_bn,
                stride_cm,
                GATHER_A,
                SCALE_ROWS,
                CAST_F32,
                IEEE,
                A_TMA,
                B_TMA,
                B_KMAJOR,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                TILE_M,
            )


# ----------------------------------------------------------------------------------------------------------------
# Weight gradient:  C[e] = A[rows of e]^T @ B[rows of e],  the reduction over each expert's rows. One operand is dense
# (D: in sorted row order, read in row chunks, by TMA where the GPU has it), the other gathered (G: row src[r]).
# dW1[e] = dh^T @ x[src] (D = A);  dW2[e] = dy[src]^T @ aw (D = B). Experts with no rows get zeros.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def wgrad_tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile (pid_m, pid_n) of a weight-gradient program: an expert's tiles are consecutive programs, grouped
    GROUP_M row blocks at a time so that neighbouring programs share A and B panels."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


@triton.jit
def wgrad_tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column indices of a weight-gradient program's output tile, and their masks."""
    pid_m, pid_n = wgrad_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _wgrad_step(
    d_desc,
    d_ptr,
    g_ptr,
    rg,
    row,
    r_mask,
    d_cols,
    d_col_mask,
    d_col0,
    g_cols,
    g_col_mask,
    ks,
    acc,
    stride_dm,
    stride_gm,
    DENSE_A: tl.constexpr,
    USE_TMA: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
):
    """acc += one BLOCK_K chunk of rows starting at sorted row ``row`` (gathered operand at rows ``rg``); rows
    outside ``r_mask`` read zeros on the gathered side (and on the sorted side through pointers). A TMA chunk reads
    whole rows: callers give it only chunks inside the expert."""
    if USE_TMA:
        d = d_desc.load([row, d_col0])
    else:
        d = tl.load(
            d_ptr + (row + ks).to(tl.int64)[:, None] * stride_dm + d_cols[None, :],
            mask=r_mask[:, None] & d_col_mask[None, :],
            other=0.0,
        )
    g = tl.load(
        g_ptr + rg[:, None] * stride_gm + g_cols[None, :], mask=r_mask[:, None] & g_col_mask[None, :], other=0.0
    )
    if DENSE_A:
        return _dot(tl.trans(d), g, acc, CAST_F32, IEEE)
    else:
        return _dot(tl.trans(g), d, acc, CAST_F32, IEEE)


@autotune(autotune_configs("wgrad"), key=["M", "N", "M_BUCKET"])
@triton.jit
def grouped_wgrad_kernel(
    d_desc,
    d_ptr,
    g_ptr,
    g_src_ptr,
    c_ptr,
    expert_offsets_ptr,
    M,
    N,
    M_BUCKET,
    num_segments,
    offsets_per_segment,
    stride_dm,
    stride_gm,
    stride_ce,
    stride_cm,
    stride_cn,
    DENSE_A: tl.constexpr,
    USE_TMA: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    expert = tl.program_id(1)
    pid_m, pid_n = wgrad_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if DENSE_A:
        d_cols, d_col0, g_cols = offs_m, pid_m * BLOCK_M, offs_n
        d_col_mask, g_col_mask = offs_m < M, offs_n < N
    else:
        d_cols, d_col0, g_cols = offs_n, pid_n * BLOCK_N, offs_m
        d_col_mask, g_col_mask = offs_n < N, offs_m < M
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Each segment's (source rank's) rows of the expert, in a fixed order, BLOCK_K rows a step, in one software-
    # pipelined loop: a TMA copy cannot mask rows, so the last step is moved back to end at the expert's last row
    # and the rows it shares with the step before read zeros on the gathered side (an unpipelined masked step after
    # the loop left its loads' latency exposed once per segment and tile). An expert with fewer than BLOCK_K rows in
    # a segment takes that one masked step, through pointers (a box there could reach rows no plan wrote).
    # (One loop over every segment's chunks, so the pipeline fills once per tile, measured 2-10% slower:
    # scripts/wgrad_probe.py --segments 2 --experts 64.)
    for seg in range(0, num_segments):
        start = tl.load(expert_offsets_ptr + seg * offsets_per_segment + expert)
        end = tl.load(expert_offsets_ptr + seg * offsets_per_segment + expert + 1)
        if end - start >= BLOCK_K:
            last = end - BLOCK_K  # the first row of the last step
            rg = tl.load(g_src_ptr + start + ks).to(tl.int64)
            for k0 in range(start, end, BLOCK_K):
                row = tl.minimum(k0, last)
                acc = _wgrad_step(
                    d_desc,
                    d_ptr,
                    g_ptr,
                    rg,
                    row,
                    row + ks >= k0,
                    d_cols,
                    d_col_mask,
                    d_col0,
                    g_cols,
                    g_col_mask,
                    ks,
                    acc,
                    stride_dm,
                    stride_gm,
                    DENSE_A,
                    USE_TMA,
                    CAST_F32,
                    IEEE,
                )
                # The next step's gathered row ids, read one step ahead: a row load whose address comes from a
                # load of the same step leaves the compiler's software pipeline two buffers deep, waiting on every
                # copy each step; with the ids carried over, the operand loads run several steps ahead.
                rg = tl.load(g_src_ptr + tl.minimum(k0 + BLOCK_K, last) + ks).to(tl.int64)
        elif end > start:
            r_mask = start + ks < end
            rg = tl.load(g_src_ptr + start + ks, mask=r_mask, other=0).to(tl.int64)
            acc = _wgrad_step(
                d_desc,
                d_ptr,
                g_ptr,
                rg,
                start,
                r_mask,
                d_cols,
                d_col_mask,
                d_col0,
                g_cols,
                g_col_mask,
                ks,
                acc,
                stride_dm,
                stride_gm,
                DENSE_A,
                False,
                CAST_F32,
                IEEE,
            )
    c_ptrs = c_ptr + expert.to(tl.int64) * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
