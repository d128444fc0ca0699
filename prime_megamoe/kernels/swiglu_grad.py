"""The SwiGLU backward as a row pass after the FC2 dgrad GEMM: the bf16 / fp32 path, and the quantised one.

For each expert-sorted row r with routing weight w and saved FC1 output h = [g | u]:

    g_a = dy[src] @ W2[e]                        (the GEMM before this pass: the gradient reaching a = silu(g) * u)
    dw[r] = <g_a, a>                             (the top-k weight gradient of the pair; no stored FC2 output)
    da = w * g_a;  dh = [da * u * silu'(g) | da * silu(g)];  aw = w * a   (aw feeds the FC2 weight gradient)

Why not in the GEMM's epilogue: loading h and writing three outputs next to the accumulators needed more registers
than a Hopper thread has (ptxas spilled in every candidate config). This pass streams g_a and h once; the GEMM keeps
a plain epilogue.

With the clamped SwiGLU (CLAMP, limit c = clamp_limit; ``kernels/activation.py``) g and u are clamped first,
``a = silu(min(g, c)) * clamp(u, -c, c)``, and dg (du) is zero where g (u) was clamped.

Rows are walked through the routing plan's tile list, so a segment's pass touches only its rows. Each row's dw is
summed over its columns in a fixed order (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation import clamp_gate_up, gate_passes, up_passes
from .grouped_gemm import tile_rows
from .quantize import store_cols_t, store_rows_q


@triton.jit
def _swiglu_inputs(ga_ptr, h_ptr, rows64, cols, mask, N, stride_gam, stride_hm, clamp_limit, CLAMP: tl.constexpr):
    """One block of rows x columns: g_a and h = [g | u] loaded in fp32 (zeros outside ``mask``), and from them
    (g_a, u, sigmoid(g), silu(g), a = silu(g) * u, g, u) with g and u clamped (CLAMP) in all but the last two."""
    ga = tl.load(ga_ptr + rows64[:, None] * stride_gam + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    g_in = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    u_in = tl.load(h_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    g = g_in
    u = u_in
    if CLAMP:
        g, u = clamp_gate_up(g_in, u_in, clamp_limit)
    sig = tl.sigmoid(g)
    silu = g * sig
    return ga, u, sig, silu, silu * u, g_in, u_in


@triton.jit
def _dgate(da, u, sig, silu, g_in, clamp_limit, CLAMP: tl.constexpr):
    """dg from da = w * g_a and ``_swiglu_inputs``; zero where the clamp (CLAMP) cut g."""
    dg = da * u * (sig + silu * (1.0 - sig))
    if CLAMP:
        dg = tl.where(gate_passes(g_in, clamp_limit), dg, 0.0)
    return dg


@triton.jit
def _dup(da, silu, u_in, clamp_limit, CLAMP: tl.constexpr):
    """du from da and ``_swiglu_inputs``; zero where the clamp (CLAMP) cut u."""
    du = da * silu
    if CLAMP:
        du = tl.where(up_passes(u_in, clamp_limit), du, 0.0)
    return du


@triton.jit
def swiglu_backward_rows_kernel(
    ga_ptr,
    h_ptr,
    row_weight_ptr,
    dh_ptr,
    aw_ptr,
    dw_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    N,
    stride_gam,
    stride_hm,
    stride_dhm,
    stride_awm,
    clamp_limit,
    TILE_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CLAMP: tl.constexpr,
):
    """One program per BLOCK_R rows of a routing tile (programs past the device-side tile count return)."""
    pid = tl.program_id(0)
    if pid < tl.load(num_tiles_ptr) * (TILE_M // BLOCK_R):
        _, rows, row_mask = tile_rows(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid, BLOCK_R, TILE_M)
        rows64 = rows.to(tl.int64)
        w = tl.load(row_weight_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, N, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < N)[None, :]
            ga, u, sig, silu, act, g_in, u_in = _swiglu_inputs(
                ga_ptr, h_ptr, rows64, cols, mask, N, stride_gam, stride_hm, clamp_limit, CLAMP
            )
            dw += tl.sum(ga * act, axis=1)
            da = ga * w
            dh_ptrs = dh_ptr + rows64[:, None] * stride_dhm + cols[None, :]
            dg = _dgate(da, u, sig, silu, g_in, clamp_limit, CLAMP)
            tl.store(dh_ptrs, dg.to(dh_ptr.dtype.element_ty), mask=mask)
            du = _dup(da, silu, u_in, clamp_limit, CLAMP)
            tl.store(dh_ptrs + N, du.to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(
                aw_ptr + rows64[:, None] * stride_awm + cols[None, :], (act * w).to(aw_ptr.dtype.element_ty), mask=mask
            )
        tl.store(dw_ptr + rows, dw, mask=row_mask)


# ----------------------------------------------------------------------------------------------------------------
# The same pass for the quantised backward (fp8 / MXFP8): after the fp8 FC2 dgrad GEMM it emits every operand of the
# later fp8 GEMMs, quantised as ``kernels.quantize`` does it:
#   ROWS_OUT: dh = [dg | du] row-scaled (1 x GROUP_K along each half of 2I), the A of the FC1 dgrad, and
#             dw_partial[c, r] = <g_a, a> over column block c in fp32 (the caller sums the blocks in order);
#   COLS_OUT: dh^T and (w * a)^T column-scaled (GROUP_R x 1 along the rows of each 128-row tile), transposed into the
#             cols_t layout: the K-major operands of the two weight gradients.
# A program takes BLOCK_R rows of a routing tile by BLOCK_C columns. Row scales need whole 1 x GROUP_K groups
# (BLOCK_C a multiple of GROUP_K), column scales a whole tile (BLOCK_R = TILE_M), so one launch with both outputs
# works on tile x 128 blocks, while two launches (ROWS_OUT, then COLS_OUT) can take thinner blocks each and read
# g_a and h twice. Rows past the tile's expert read zeros, which is what the cols_t layout stores there.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def swiglu_backward_quantize_kernel(
    ga_ptr,
    h_ptr,
    row_weight_ptr,
    dhq_ptr,
    dhs_ptr,
    dhtq_ptr,
    dhts_ptr,
    awtq_ptr,
    awts_ptr,
    dw_partial_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    N,
    NG_OUT,
    stride_gam,
    stride_hm,
    stride_dhm,
    stride_dhsm,
    stride_dhtk,
    stride_dhtsr,
    stride_awtk,
    stride_awtsr,
    stride_dwp,
    clamp_limit,
    ROWS_OUT: tl.constexpr,
    COLS_OUT: tl.constexpr,
    MX: tl.constexpr,
    POW2: tl.constexpr,
    GROUP_K: tl.constexpr,
    GROUP_R: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CLAMP: tl.constexpr,
):
    tl.static_assert(not ROWS_OUT or BLOCK_C % GROUP_K == 0)
    tl.static_assert(not COLS_OUT or BLOCK_R == TILE_M)
    blk = tl.program_id(0)
    part = tl.program_id(1)  # BLOCK_R rows of a routing tile (see grouped_gemm.tile_rows)
    if part < tl.load(num_tiles_ptr) * (TILE_M // BLOCK_R):
        _, rows, row_mask = tile_rows(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, part, BLOCK_R, TILE_M)
        rows64 = rows.to(tl.int64)
        w = tl.load(row_weight_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        cols = blk * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        ga, u, sig, silu, act, g_in, u_in = _swiglu_inputs(
            ga_ptr, h_ptr, rows64, cols, mask, N, stride_gam, stride_hm, clamp_limit, CLAMP
        )
        da = ga * w
        dg = _dgate(da, u, sig, silu, g_in, clamp_limit, CLAMP)
        du = _dup(da, silu, u_in, clamp_limit, CLAMP)
        if ROWS_OUT:
            tl.store(dw_partial_ptr + blk * stride_dwp + rows, tl.sum(ga * act, axis=1), mask=row_mask)
            store_rows_q(
                dhq_ptr,
                dhs_ptr,
                dg,
                rows64,
                row_mask,
                cols,
                col_mask,
                0,
                0,
                NG_OUT,
                stride_dhm,
                stride_dhsm,
                blk,
                MX,
                POW2,
                BLOCK_R,
                BLOCK_C,
                GROUP_K,
            )
            store_rows_q(
                dhq_ptr,
                dhs_ptr,
                du,
                rows64,
                row_mask,
                cols,
                col_mask,
                N,
                NG_OUT,
                NG_OUT,
                stride_dhm,
                stride_dhsm,
                blk,
                MX,
                POW2,
                BLOCK_R,
                BLOCK_C,
                GROUP_K,
            )
        if COLS_OUT:
            cols64 = cols.to(tl.int64)
            store_cols_t(
                dhtq_ptr,
                dhts_ptr,
                dg,
                part,
                cols64,
                col_mask,
                stride_dhtk,
                stride_dhtsr,
                POW2,
                MX,
                TILE_M,
                BLOCK_C,
                GROUP_R,
            )
            store_cols_t(
                dhtq_ptr,
                dhts_ptr,
                du,
                part,
                cols64 + N,
                col_mask,
                stride_dhtk,
                stride_dhtsr,
                POW2,
                MX,
                TILE_M,
                BLOCK_C,
                GROUP_R,
            )
            store_cols_t(
                awtq_ptr,
                awts_ptr,
                act * w,
                part,
                cols64,
                col_mask,
                stride_awtk,
                stride_awtsr,
                POW2,
                MX,
                TILE_M,
                BLOCK_C,
                GROUP_R,
            )
