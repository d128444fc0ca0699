"""Grouped GEMMs with float8 e4m3 operands and block scales: the quantised twins of ``grouped_gemm.py``.

Rows are in expert-sorted order and tiles come from the device-side tile list of the routing plan, as in the bf16
kernels; the row tile here is always ``QTILE_M`` = 128 rows (one token-dim scale block per tile, see wgrad).

Two scale formats, picked by the constexpr ``MX``:

- ``MX = False`` (fp8, DeepSeek-V3 recipe): fp32 scales. The A operand (activations) carries one scale per row and
  128 columns of K (``GROUP_K`` = 128); the B operand (weights) one per 128 x 128 block (``B_GROUP_N`` = 128). Each
  BLOCK_K (<= 128, dividing 128) step is one fp8 ``tl.dot`` into a fresh fp32 tile that is then scaled and added to
  the accumulator, so partial sums are promoted to full fp32 every 128 products (wgmma's fp8 accumulator is
  narrower than fp32). Where a tile's columns lie in one weight block (BLOCK_N <= 128) the weight's scale is one
  number per step, so the promotion scales rows only; each step's scales are loaded a step ahead.
- ``MX = True`` (OCP MXFP8): e8m0 scales for 1 x 32 blocks along K on both operands (``GROUP_K`` = 32,
  ``B_GROUP_N`` = 1), consumed by ``tl.dot_scaled``. Blackwell runs that natively; on Hopper Triton decomposes it
  (upcasts the operands to bf16 with the scale applied, then a bf16 MMA): mxfp8 on Hopper is an emulation with
  MX numerics and bf16 speed.

Every B operand of the row-tiled GEMMs is a weight stored K-major: ``B[e][k, n] = bq[e, n, k]`` with scales
``bs[e, n // B_GROUP_N, kg]``. The forward uses the weight as it is stored (``W1 [E, 2I, H]``, ``W2 [E, H, I]``), the
dgrads use a transposed copy (``W1^T [E, H, 2I]``, ``W2^T [E, I, H]``), made once per optimizer step by the weight
cache. The weight gradients reduce over rows: both their operands are activations stored transposed, rows
contiguous (K-major too), in the tile-space "cols_t" layout of ``quantize.py``, written by the SwiGLU backward pass
of ``swiglu_grad.py`` (dh^T, (w * a)^T) and by ``gather_quantize_cols_t_kernel`` (x^T, dy^T of the gathered source
rows).

A reduction dim made of two halves (``2I`` = gate and up) is treated as ``SEGS`` = 2 segments of length K, each
blocked from its own start, so I need not be a multiple of the block size. Any K is allowed: loads past K are
masked to zero and the last block's scale covers only the real elements.

Kernels only: they know nothing of autograd or configs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation import clamp_gate_up
from .grouped_gemm import tile_rows as _tile_rows
from .grouped_gemm import tile_span as _tile_span
from .grouped_gemm import wgrad_tile_ids, wgrad_tile_offsets
from .quantize import store_rows_q
from .tuning import QTILE_M, autotune, gemm_tma_boxes, interpreting


def _cfg(bn, bk, warps, stages, bm=QTILE_M, **extra):
    # Every fp8 operand read by TMA is K-major: the row-tiled GEMMs' A and weights, both cols_t operands of the wgrad
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra},
        num_warps=warps,
        num_stages=stages,
        pre_hook=gemm_tma_boxes,
    )


def _candidates(kind: str) -> list[triton.Config]:
    if interpreting():
        extra = {"GROUP_M": 1} if kind == "wgrad" else {}
        return [_cfg(128, 128, 1, 1, **extra)]  # (tests launch the half-tile path explicitly)
    # Kept from every earlier candidate by scripts/fp8_probe.py at Qwen3-30B-A3B, T = 16384 (one H200);
    # the first one runs untuned (small problems, PRIME_MEGAMOE_AUTOTUNE=0). bm=64: half a row
    # tile per program, for the registers: each fp8 step needs a fresh dot tile next to the accumulators.
    if kind == "fc1":  # two accumulators (gate and up); 128 x 128 leads (1.19 ms against 1.38 for 64 x 128)
        return [_cfg(128, 128, 8, 3), _cfg(128, 128, 8, 4), _cfg(128, 128, 8, 3, bm=64), _cfg(128, 128, 8, 4, bm=64)]
    if kind == "gemm":  # 64 x 128 on 4 warps leads for FC2, FC2 dgrad and FC1 dgrad; wider tiles spill
        return [
            _cfg(128, 128, 4, 3, bm=64),
            _cfg(128, 128, 4, 4, bm=64),
            _cfg(128, 128, 8, 3, bm=64),
            _cfg(128, 128, 8, 3),
        ]
    if kind == "wgrad":  # BLOCK_K is the row tile (QTILE_M); BLOCK_M / BLOCK_N tile the weight; 64 x 128 on 4 warps
        # leads (dW1 1.22 ms, dW2 0.65 with TMA reads); 128 x 256 and 256 x 128 took 2.2-4.8 ms, a fifth stage more
        return [
            _cfg(128, QTILE_M, 4, 3, bm=64, GROUP_M=8),
            _cfg(128, QTILE_M, 4, 4, bm=64, GROUP_M=8),
            _cfg(64, QTILE_M, 4, 4, bm=128, GROUP_M=8),
            _cfg(128, QTILE_M, 8, 3, bm=128, GROUP_M=8),
        ]
    raise ValueError(f"unknown kernel family {kind!r}")


def quant_configs(kind: str) -> list[triton.Config]:
    """Autotuning candidates (evaluated at import). Constraints: BLOCK_K divides 128 (one fp32 scale per step) and
    is a multiple of 32 (MX groups); BLOCK_M divides the row tile QTILE_M; FC1 emits 1x128-scaled fp8, so its BLOCK_N
    is a multiple of 128."""
    configs = _candidates(kind)
    for c in configs:
        kw = c.kwargs
        if kind == "wgrad":
            ok = kw["BLOCK_K"] == QTILE_M
        else:
            ok = QTILE_M % kw["BLOCK_M"] == 0 and 128 % kw["BLOCK_K"] == 0 and kw["BLOCK_K"] % 32 == 0
            if kind == "fc1":
                ok = ok and kw["BLOCK_N"] % 128 == 0
        if not ok:
            raise ValueError(f"{kind} config {kw} breaks the quantised GEMM block constraints")
    return configs


@triton.jit
def _a_scales(
    s_ptr, rows64, row_mask, stride_sm, kg0, kg_end, MX: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr
):
    """Scales of an A tile (rows x BLOCK_K at group kg0): fp8 [BLOCK_M] fp32, MX [BLOCK_M, BLOCK_K // 32] e8m0."""
    if MX:
        kg = kg0 + tl.arange(0, BLOCK_K // GROUP_K)
        return tl.load(
            s_ptr + rows64[:, None] * stride_sm + kg[None, :],
            mask=row_mask[:, None] & (kg < kg_end)[None, :],
            other=127,
        )
    else:
        return tl.load(s_ptr + rows64 * stride_sm + kg0, mask=row_mask, other=0.0)


@triton.jit
def _b_scales(
    s_ptr,
    col0,
    cols,
    col_mask,
    stride_sn,
    kg0,
    kg_end,
    MX: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    B_GROUP_N: tl.constexpr,
    B_SCALAR: tl.constexpr,
):
    """Scales of a B tile (BLOCK_K x cols at group kg0, cols = col0 + j): fp8 [BLOCK_N] fp32, or with B_SCALAR (the
    tile's columns lie in one weight block) that block's scale alone; MX [BLOCK_N, BLOCK_K // 32] e8m0."""
    if MX:
        n_idx = (cols // B_GROUP_N).to(tl.int64)
        kg = kg0 + tl.arange(0, BLOCK_K // GROUP_K)
        return tl.load(
            s_ptr + n_idx[:, None] * stride_sn + kg[None, :], mask=col_mask[:, None] & (kg < kg_end)[None, :], other=127
        )
    elif B_SCALAR:
        return tl.load(s_ptr + (col0 // B_GROUP_N).to(tl.int64) * stride_sn + kg0, mask=kg0 < kg_end, other=0.0)
    else:
        n_idx = (cols // B_GROUP_N).to(tl.int64)
        return tl.load(s_ptr + n_idx * stride_sn + kg0, mask=col_mask, other=0.0)


@triton.jit
def _scaled_mma(acc, a, sa, b, sb, MX: tl.constexpr, B_SCALAR: tl.constexpr):
    """acc + the scaled product of one K step. fp8: a fresh fp32 dot, scaled per row (and per column unless the B
    scale is one number) before it is added, so every 128 products are promoted to full fp32."""
    if MX:
        return tl.dot_scaled(a, sa, "e4m3", b, sb, "e4m3", acc)
    elif B_SCALAR:
        return acc + tl.dot(a, b) * (sa * sb)[:, None]
    else:
        return acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])


# ----------------------------------------------------------------------------------------------------------------
# FC1 + SwiGLU:  h = x[src] @ W1[e]^T (fp8 x fp8, fp32 accumulate),  a = silu(h[:, :I]) * h[:, I:]
#   (CLAMP: a = silu(min(g, c)) * clamp(u, -c, c), c = clamp_limit: kernels/activation.py; h is stored unclamped)
#   h is stored in the output dtype when the backward needs it; a is stored in fp8 with 1 x GROUP_K scales along I
#   (the K of FC2), so FC2 reads it without another pass. With B_TMA, W1 is read by TMA, viewed as [E * 2I, H] in
#   [BLOCK_N, BLOCK_K] boxes (gate rows, then up rows I further).
# ----------------------------------------------------------------------------------------------------------------
@autotune(quant_configs("fc1"), key=["N", "K", "M_BUCKET", "MX"])
@triton.jit
def fp8_fc1_swiglu_kernel(
    b_desc,
    xq_ptr,
    xs_ptr,
    row_src_ptr,
    wq_ptr,
    ws_ptr,
    h_ptr,
    aq_ptr,
    as_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    N,
    K,
    NKG,
    NG_OUT,
    UP_SCALE_OFF,
    M_BUCKET,
    stride_xm,
    stride_xsm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_hm,
    stride_am,
    stride_asm,
    clamp_limit,
    SAVE_H: tl.constexpr,
    CLAMP: tl.constexpr,
    MX: tl.constexpr,
    POW2: tl.constexpr,
    GROUP_K: tl.constexpr,
    B_GROUP_N: tl.constexpr,
    B_TMA: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)  # a BLOCK_M part of a TILE_M tile (see grouped_gemm.tile_rows)
    if pid_m >= tl.load(num_tiles_ptr) * (TILE_M // BLOCK_M):
        return
    expert, rows, row_mask = _tile_rows(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid_m, BLOCK_M, TILE_M)
    src = tl.load(row_src_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    a_ptrs = xq_ptr + src[:, None] * stride_xm + ks[None, :]
    g_ptrs = wq_ptr + e64 * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    ws_e = ws_ptr + e64 * stride_wse
    wu_s = ws_e + UP_SCALE_OFF * stride_wsn
    col0 = pid_n * BLOCK_N
    B_SCALAR: tl.constexpr = (not MX) and BLOCK_N <= B_GROUP_N
    # Each step's scales are loaded one step ahead: their latency hides behind the previous step's MMA.
    sa = _a_scales(xs_ptr, src, row_mask, stride_xsm, 0, NKG, MX, BLOCK_K, GROUP_K)
    sg = _b_scales(ws_e, col0, cols, col_mask, stride_wsn, 0, NKG, MX, BLOCK_K, GROUP_K, B_GROUP_N, B_SCALAR)
    su = _b_scales(wu_s, col0, cols, col_mask, stride_wsn, 0, NKG, MX, BLOCK_K, GROUP_K, B_GROUP_N, B_SCALAR)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if B_TMA:  # W1 viewed as [E * 2I, H]: the expert's gate rows, then its up rows N further
            wg = tl.trans(b_desc.load([expert * 2 * N + col0, k0]))
            wu = tl.trans(b_desc.load([expert * 2 * N + N + col0, k0]))
        else:
            wg = tl.load(g_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        kg1 = (k0 + BLOCK_K) // GROUP_K
        sa1 = _a_scales(xs_ptr, src, row_mask, stride_xsm, kg1, NKG, MX, BLOCK_K, GROUP_K)
        sg1 = _b_scales(ws_e, col0, cols, col_mask, stride_wsn, kg1, NKG, MX, BLOCK_K, GROUP_K, B_GROUP_N, B_SCALAR)
        su1 = _b_scales(wu_s, col0, cols, col_mask, stride_wsn, kg1, NKG, MX, BLOCK_K, GROUP_K, B_GROUP_N, B_SCALAR)
        acc_g = _scaled_mma(acc_g, a, sa, wg, sg, MX, B_SCALAR)
        acc_u = _scaled_mma(acc_u, a, sa, wu, su, MX, B_SCALAR)
        sa, sg, su = sa1, sg1, su1
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    rows64 = rows.to(tl.int64)
    if SAVE_H:
        out_mask = row_mask[:, None] & col_mask[None, :]
        h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
        tl.store(h_ptrs, acc_g.to(h_ptr.dtype.element_ty), mask=out_mask)
        tl.store(h_ptrs + N, acc_u.to(h_ptr.dtype.element_ty), mask=out_mask)
    if B_TMA:  # boxes past N read other rows' weights: zero those columns (their act), which the quantiser's amax sees
        acc_g = tl.where(col_mask[None, :], acc_g, 0.0)
    if CLAMP:
        acc_g, acc_u = clamp_gate_up(acc_g, acc_u, clamp_limit)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    store_rows_q(
        aq_ptr,
        as_ptr,
        act,
        rows64,
        row_mask,
        cols,
        col_mask,
        0,
        0,
        NG_OUT,
        stride_am,
        stride_asm,
        pid_n,
        MX,
        POW2,
        BLOCK_M,
        BLOCK_N,
        GROUP_K,
    )


# ----------------------------------------------------------------------------------------------------------------
# Grouped GEMM with fp8 operands:  C[r] = scale[r] * A[src[r] if GATHER_A else r] @ B[e]
#   A [*, SEGS*K] fp8 with row scales [*, SEGS*NKG]; B[e][k, n] = bq[e, n, k] with block scales.
#   FC2 forward: A = SwiGLU output (fp8 from the FC1 epilogue), B = W2, scale = top-k weight.
#   FC2 dgrad:   A = dy (fp8, gathered rows), B = W2^T copy; output g_a for the SwiGLU backward pass.
#   FC1 dgrad:   A = d[gate, up] (fp8 from the SwiGLU backward pass, SEGS = 2), B = W1^T copy.
# With B_TMA the weights are read by TMA, viewed as [E * N, SEGS * K] in [BLOCK_N, BLOCK_K] boxes; with A_TMA an A
# that is not gathered is read in [BLOCK_M, BLOCK_K] boxes from its sorted rows. A box past N or an expert's rows
# reads other rows (their outputs are not stored); past K it reads zeros at the tensor's end, or the next segment's
# columns, which meet zero A columns (the launcher takes A by TMA only where K is a multiple of 128 or SEGS = 1).
# ----------------------------------------------------------------------------------------------------------------
@autotune(quant_configs("gemm"), key=["N", "K", "SEGS", "M_BUCKET", "MX"])
@triton.jit
def fp8_grouped_gemm_kernel(
    a_desc,
    b_desc,
    aq_ptr,
    as_ptr,
    row_src_ptr,
    bq_ptr,
    bs_ptr,
    c_ptr,
    row_scale_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    N,
    K,
    NKG,
    M_BUCKET,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    SEGS: tl.constexpr,
    GATHER_A: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    MX: tl.constexpr,
    GROUP_K: tl.constexpr,
    B_GROUP_N: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)  # a BLOCK_M part of a TILE_M tile (see grouped_gemm.tile_rows)
    if pid_m >= tl.load(num_tiles_ptr) * (TILE_M // BLOCK_M):
        return
    expert, row_start, row_end = _tile_span(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid_m, BLOCK_M, TILE_M)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    if GATHER_A:
        src = tl.load(row_src_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    bs_e = bs_ptr + e64 * stride_bse
    col0 = pid_n * BLOCK_N
    B_SCALAR: tl.constexpr = (not MX) and BLOCK_N <= B_GROUP_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for seg in tl.static_range(SEGS):
        a_ptrs = aq_ptr + src[:, None] * stride_am + seg * K + ks[None, :]
        b_ptrs = bq_ptr + e64 * stride_be + cols.to(tl.int64)[None, :] * stride_bn + seg * K + ks[:, None]
        kg_end = (seg + 1) * NKG
        # Each step's scales are loaded one step ahead: their latency hides behind the previous step's MMA.
        sa = _a_scales(as_ptr, src, row_mask, stride_asm, seg * NKG, kg_end, MX, BLOCK_K, GROUP_K)
        sb = _b_scales(
            bs_e, col0, cols, col_mask, stride_bsn, seg * NKG, kg_end, MX, BLOCK_K, GROUP_K, B_GROUP_N, B_SCALAR
        )
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            if A_TMA:  # the sorted rows from the block's first row (rows past the expert's end are not stored)
                a = a_desc.load([row_start, seg * K + k0])
            else:
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if B_TMA:  # the weights viewed as [E * N, SEGS * K]
                b = tl.trans(b_desc.load([expert * N + col0, seg * K + k0]))
            else:
                b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            kg1 = seg * NKG + (k0 + BLOCK_K) // GROUP_K
            sa1 = _a_scales(as_ptr, src, row_mask, stride_asm, kg1, kg_end, MX, BLOCK_K, GROUP_K)
            sb1 = _b_scales(
                bs_e, col0, cols, col_mask, stride_bsn, kg1, kg_end, MX, BLOCK_K, GROUP_K, B_GROUP_N, B_SCALAR
            )
            acc = _scaled_mma(acc, a, sa, b, sb, MX, B_SCALAR)
            sa, sb = sa1, sb1
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if SCALE_ROWS:
        acc = acc * tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# ----------------------------------------------------------------------------------------------------------------
# Weight gradient:  C[e] = A_T[:, rows of e] @ B_T[:, rows of e]^T in fp8, the reduction over each expert's row tiles.
#   Both operands arrive in the cols_t layout of quantize.py: [M or N, max_tiles * 128] fp8, the reduction (rows)
#   contiguous (K-major, as Hopper's fp8 wgmma needs both operands), tile t at columns [128 t, 128 t + 128) with zeros
#   past its expert's end, scales [max_tiles * (128 // GROUP_R), M or N] along the rows.
#   dW1[e] = dh^T x[src]  (A = dh^T from the SwiGLU backward pass, B = x^T from gather_quantize_cols_t_kernel);
#   dW2[e] = dy[src]^T aw (A = dy^T from gather_quantize_cols_t_kernel, B = aw^T from that pass).
#   One K step per row tile (BLOCK_K = 128): its fp8 product is promoted to the fp32 accumulator with its scales.
#   Experts with no rows get zeros.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _wgrad_tile(tiles_ptr, j, t_end, TILE_LIST: tl.constexpr):
    """Row tile of step j of an expert's reduction: j itself (the expert's tiles are consecutive), or the j-th entry
    of the tile list (a multi-segment plan: the expert's tiles of every segment, in segment order); 0 past t_end."""
    if TILE_LIST:
        return tl.load(tiles_ptr + j, mask=j < t_end, other=0)
    return j


@triton.jit
def _wgrad_scales(
    as_ptr,
    bs_ptr,
    t,
    j,
    t_end,
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    stride_asr,
    stride_bsr,
    MX: tl.constexpr,
    G: tl.constexpr,
):
    """Scales of row tile t (step j of the reduction; none past t_end) of both wgrad operands: fp8 [BLOCK_M],
    [BLOCK_N] fp32; MX [BLOCK_M, G], [BLOCK_N, G] e8m0."""
    m_ok = m_mask & ((offs_m * 0 + j) < t_end)  # (a vector compare: the mask must be a tensor)
    n_ok = n_mask & ((offs_n * 0 + j) < t_end)
    if MX:
        blk = t * G + tl.arange(0, G)
        sa = tl.trans(tl.load(as_ptr + blk[:, None] * stride_asr + offs_m[None, :], mask=m_ok[None, :], other=127))
        sb = tl.trans(tl.load(bs_ptr + blk[:, None] * stride_bsr + offs_n[None, :], mask=n_ok[None, :], other=127))
    else:
        sa = tl.load(as_ptr + t * stride_asr + offs_m, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptr + t * stride_bsr + offs_n, mask=n_ok, other=0.0)
    return sa, sb


@autotune(quant_configs("wgrad"), key=["M", "N", "M_BUCKET", "MX"])
@triton.jit
def fp8_grouped_wgrad_kernel(
    a_desc,
    b_desc,
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    expert_tiles_ptr,
    tiles_ptr,
    M,
    N,
    M_BUCKET,
    stride_am,
    stride_asr,
    stride_bn,
    stride_bsr,
    stride_ce,
    stride_cm,
    stride_cn,
    MX: tl.constexpr,
    GROUP_R: tl.constexpr,
    USE_TMA: tl.constexpr,
    TILE_LIST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_K % GROUP_R == 0)
    tl.static_assert(MX or GROUP_R == BLOCK_K)  # fp8: one fp32 scale per column and tile
    G: tl.constexpr = BLOCK_K // GROUP_R
    expert = tl.program_id(1)
    offs_m, offs_n, m_mask, n_mask = wgrad_tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_m, pid_n = wgrad_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    t_begin = tl.load(expert_tiles_ptr + expert)
    t_end = tl.load(expert_tiles_ptr + expert + 1)
    t = _wgrad_tile(tiles_ptr, t_begin, t_end, TILE_LIST)
    k0 = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + k0[None, :]
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + k0[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Each tile's scales are loaded one tile ahead: their latency hides behind the previous tile's MMA.
    sa, sb = _wgrad_scales(
        as_ptr, bs_ptr, t, t_begin, t_end, offs_m, offs_n, m_mask, n_mask, stride_asr, stride_bsr, MX, G
    )
    for j in range(t_begin, t_end):
        # Padding rows of the tile are zeros in memory: no row mask.
        if USE_TMA:  # boxes past M or N read zeros at the tensor's end
            a = a_desc.load([m0, t * BLOCK_K])
            b = b_desc.load([n0, t * BLOCK_K])
        else:
            a = tl.load(a_rows + t.to(tl.int64) * BLOCK_K, mask=m_mask[:, None], other=0.0)
            b = tl.load(b_rows + t.to(tl.int64) * BLOCK_K, mask=n_mask[:, None], other=0.0)
        t_next = _wgrad_tile(tiles_ptr, j + 1, t_end, TILE_LIST)
        sa1, sb1 = _wgrad_scales(
            as_ptr, bs_ptr, t_next, j + 1, t_end, offs_m, offs_n, m_mask, n_mask, stride_asr, stride_bsr, MX, G
        )
        acc = _scaled_mma(acc, a, sa, tl.trans(b), sb, MX, False)
        sa, sb = sa1, sb1
        t = t_next
    c_ptrs = c_ptr + expert.to(tl.int64) * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
