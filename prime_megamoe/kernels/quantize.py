"""Block quantisation to float8 e4m3 with per-block scales, and the inverse.

Two scale formats:

- ``fp8`` (DeepSeek-V3 style): fp32 scales, one per block; activations use 1x128 blocks along the reduction dim,
  weights 128x128 blocks. ``scale = amax / 448`` (the e4m3 maximum), optionally rounded up to a power of two so that
  rescaling is exact.
- ``mx`` (OCP MX, MXFP8): 1x32 blocks along the reduction dim and e8m0 scales (a biased power-of-two exponent in a
  uint8, ``scale = 2 ** (byte - 127)``). The exponent is rounded *up* (``ceil(log2(amax / 448))``), so no element
  saturates; the OCP reference rounds it down and clamps, which clips the largest elements of a block.

In both formats ``x ~= q * scale`` with ``q = clamp(x / scale, -448, 448)`` rounded to nearest even; a block of zeros
gets scale 1. Values that are representable (``x = q * s`` with e4m3 ``q`` and the block's own scale ``s``) survive a
quantise / dequantise round trip exactly.

The ``@triton.jit`` helpers (``scale_from_amax``, ``quant_groups_rows``, ``quant_groups_cols``, ``store_rows_q``,
``store_cols_t``) are shared with the GEMM epilogues in ``fp8_gemm.py`` and the SwiGLU backward in ``swiglu_grad.py``,
so every producer of fp8 activations computes bitwise the same values and scales as the standalone kernels below.
Kernels only: host launchers live in ``prime_megamoe.ops.fp8_launch``.

Weight-gradient operands ("cols_t" layout). The wgrads reduce over an expert's sorted rows, so their operands are
scaled along the rows (one scale per column for every GROUP_R-row block of a 128-row tile of the routing plan) and
stored transposed, reduction dim contiguous (K-major, as Hopper's fp8 wgmma wants both operands), in *tile space*:
``data [K, max_tiles * TILE]`` holds sorted row ``tile_row[t] + j`` of tile t at column ``t * TILE + j``, and zeros
where that row is past the end of the tile's expert; ``scale [max_tiles * (TILE // GROUP_R), K]``. Tile space (not
the [K, P] sorted-row space) puts every tile at a 128-aligned column, so the wgrad loads aligned, unmasked K-tiles
(expert boundaries are arbitrary rows), at the cost of up to one tile of padding per expert.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8 e4m3 (fn) value
E8M0_BIAS = 127

# The interpreter's fp32 -> e4m3 conversion mis-rounds (a carry out of the mantissa is dropped: 124.3 becomes 64,
# and subnormals flush to zero), so under TRITON_INTERPRET the value is first rounded onto the e4m3 grid in fp32 and
# the conversion is then exact. GPUs use the hardware conversion (round to nearest even), which gives the same bits.
_ROUND_IN_FP32 = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def scale_from_amax(amax, POW2: tl.constexpr):
    """Per-block scale (fp32) for a block whose largest magnitude is ``amax``: amax / 448 (at least 2**-126), 1 for an
    all-zero block;
    with POW2 rounded up to the next power of two (keeps |x| / scale <= 448 and makes the rescale exact)."""
    # At least 2**-126 (the smallest normal fp32), so that 1 / scale stays finite; blocks that small quantise to 0.
    s = tl.maximum(amax / 448.0, 1.1754943508222875e-38)
    s = tl.where(amax > 0.0, s, 1.0)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        exp = exp + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (exp << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def e8m0_from_scale(s):
    """Biased exponent byte of a power-of-two fp32 scale (the OCP e8m0 encoding)."""
    return ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)


@triton.jit
def _round_to_e4m3_grid(y):
    """y in [-448, 448] fp32 -> the nearest e4m3 value (ties to even), still in fp32."""
    bits = y.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of the 23 mantissa bits; an integer add carries into the exponent as it should.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal range (|y| < 2**-6): multiples of 2**-9; adding 1.5 * 2**14 (ulp 2**-9) rounds to nearest even.
    # Rounded on |y| with the sign put back, so that tiny negatives become -0 as in the hardware conversion.
    sub = (tl.abs(y) + 24576.0) - 24576.0
    sub = tl.where(bits < 0, -sub, sub)
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def _to_e4m3(x, inv):
    y = tl.clamp(x * inv, -448.0, 448.0)
    if _ROUND_IN_FP32:
        y = _round_to_e4m3_grid(y)
    return y.to(tl.float8e4nv)


@triton.jit
def quant_groups_rows(x, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, POW2: tl.constexpr):
    """x [BM, BN] fp32, blocks of 1 x GROUP along axis 1 -> (q [BM, BN] e4m3, scales [BM, BN // GROUP] fp32)."""
    x3 = tl.reshape(x, (BM, BN // GROUP, GROUP))
    amax = tl.max(tl.abs(x3), axis=2)
    s = scale_from_amax(amax, POW2)
    q = tl.reshape(_to_e4m3(x3, (1.0 / s)[:, :, None]), (BM, BN))
    return q, s


@triton.jit
def quant_groups_cols(x, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, POW2: tl.constexpr):
    """x [BM, BN] fp32, blocks of GROUP x 1 along axis 0 -> (q [BM, BN] e4m3, scales [BM // GROUP, BN] fp32)."""
    x3 = tl.reshape(x, (BM // GROUP, GROUP, BN))
    amax = tl.max(tl.abs(x3), axis=1)
    s = scale_from_amax(amax, POW2)
    q = tl.reshape(_to_e4m3(x3, (1.0 / s)[:, None, :]), (BM, BN))
    return q, s


@triton.jit
def store_rows_q(
    q_ptr,
    s_ptr,
    x,
    rows64,
    row_mask,
    cols,
    col_mask,
    col_off,
    sgrp_off,
    n_groups,
    stride_qm,
    stride_sm,
    pid_n,
    MX: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    """Quantise x [BLOCK_M, BLOCK_N] (columns pid_n * BLOCK_N + j) in 1 x GROUP_K blocks and store values at columns
    col_off + cols, scales at groups sgrp_off + pid_n * (BLOCK_N // GROUP_K) + j."""
    q, s = quant_groups_rows(x, BLOCK_M, BLOCK_N, GROUP_K, POW2 or MX)
    tl.store(
        q_ptr + rows64[:, None] * stride_qm + (col_off + cols)[None, :], q, mask=row_mask[:, None] & col_mask[None, :]
    )
    grp = pid_n * (BLOCK_N // GROUP_K) + tl.arange(0, BLOCK_N // GROUP_K)
    s_ptrs = s_ptr + rows64[:, None] * stride_sm + (sgrp_off + grp)[None, :]
    s_mask = row_mask[:, None] & (grp < n_groups)[None, :]
    if MX:
        tl.store(s_ptrs, e8m0_from_scale(s), mask=s_mask)
    else:
        tl.store(s_ptrs, s, mask=s_mask)


@triton.jit
def store_cols_t(
    q_ptr,
    s_ptr,
    x,
    t,
    cols,
    col_mask,
    stride_qk,
    stride_sr,
    POW2: tl.constexpr,
    E8M0: tl.constexpr,
    TILE: tl.constexpr,
    BN: tl.constexpr,
    GROUP_R: tl.constexpr,
):
    """x [TILE, BN] fp32 = row tile t of the sorted rows (zeros past its expert's end) at columns ``cols`` (int64):
    quantise in GROUP_R x 1 blocks and store the cols_t layout: q[cols, t * TILE + j], scales
    s[t * (TILE // GROUP_R) + b, cols]."""
    q, s = quant_groups_cols(x, TILE, BN, GROUP_R, POW2 or E8M0)
    pos = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    tl.store(q_ptr + cols[None, :] * stride_qk + pos[:, None], q, mask=col_mask[None, :])
    blk = t.to(tl.int64) * (TILE // GROUP_R) + tl.arange(0, TILE // GROUP_R)
    s_ptrs = s_ptr + blk[:, None] * stride_sr + cols[None, :]
    if E8M0:
        tl.store(s_ptrs, e8m0_from_scale(s), mask=col_mask[None, :])
    else:
        tl.store(s_ptrs, s, mask=col_mask[None, :])


@triton.jit
def gather_quantize_cols_t_kernel(
    x_ptr,
    row_src_ptr,
    q_ptr,
    s_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    K,
    stride_xm,
    stride_qk,
    stride_sr,
    POW2: tl.constexpr,
    E8M0: tl.constexpr,
    GROUP_R: tl.constexpr,
    TILE: tl.constexpr,
    BK: tl.constexpr,
):
    """Program (pid_k, t): the sorted rows of tile t gathered from the source rows (x[row_src[r]], x [R, K] with
    contiguous rows), columns [pid_k * BK, +BK), quantised into the cols_t layout. Written once, read by every
    wgrad program of the tile's expert. Tiles past the device-side tile count are left alone (nothing reads them)."""
    pid_k = tl.program_id(0)
    t = tl.program_id(1)
    if t >= tl.load(num_tiles_ptr):
        return
    expert = tl.load(tile_expert_ptr + t)
    end = tl.load(expert_offsets_ptr + expert + 1)
    rows = tl.load(tile_row_ptr + t) + tl.arange(0, TILE)
    row_mask = rows < end
    src = tl.load(row_src_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    cols = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    col_mask = cols < K
    x = tl.load(
        x_ptr + src[:, None] * stride_xm + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0
    ).to(tl.float32)
    store_cols_t(q_ptr, s_ptr, x, t, cols, col_mask, stride_qk, stride_sr, POW2, E8M0, TILE, BK, GROUP_R)


# ----------------------------------------------------------------------------------------------------------------
# Standalone quantiser over a strided 4-D view [B1, B2, M, K] with blocks of QM x QK on the last two dims. Input, output
# and scales each have their own strides, so one kernel covers rows (1x128, 1x32), weights (128x128) and transposed
# weight copies, and writes the layout each GEMM wants.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def quantize_tile(
    x_ptr,
    q_ptr,
    s_ptr,
    b1,
    b2,
    pid_m,
    pid_k,
    M,
    K,
    sx0,
    sx1,
    sx2,
    sx3,
    sq0,
    sq1,
    sq2,
    sq3,
    ss0,
    ss1,
    ss2,
    ss3,
    QM: tl.constexpr,
    QK: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    POW2: tl.constexpr,
    E8M0: tl.constexpr,
):
    """Tile (pid_m, pid_k) of BM x BK elements of matrix (b1, b2) (int64): (BM / QM) x (BK / QK) blocks. Also run by
    ``routing.routing_keys_kernel``'s programs that quantise the forward's rows."""
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    x = tl.load(x_ptr + b1 * sx0 + b2 * sx1 + rows64[:, None] * sx2 + cols64[None, :] * sx3, mask=mask, other=0.0)
    x = x.to(tl.float32)
    GM: tl.constexpr = BM // QM
    GK: tl.constexpr = BK // QK
    x4 = tl.reshape(x, (GM, QM, GK, QK))
    amax = tl.max(tl.max(tl.abs(x4), axis=3), axis=1)  # [GM, GK]
    s = scale_from_amax(amax, POW2 or E8M0)
    q = tl.reshape(_to_e4m3(x4, (1.0 / s)[:, None, :, None]), (BM, BK))
    tl.store(q_ptr + b1 * sq0 + b2 * sq1 + rows64[:, None] * sq2 + cols64[None, :] * sq3, q, mask=mask)
    blk_m = pid_m * GM + tl.arange(0, GM)
    blk_k = pid_k * GK + tl.arange(0, GK)
    s_ptrs = s_ptr + b1 * ss0 + b2 * ss1 + blk_m.to(tl.int64)[:, None] * ss2 + blk_k.to(tl.int64)[None, :] * ss3
    s_mask = (blk_m < tl.cdiv(M, QM))[:, None] & (blk_k < tl.cdiv(K, QK))[None, :]
    if E8M0:
        tl.store(s_ptrs, e8m0_from_scale(s), mask=s_mask)
    else:
        tl.store(s_ptrs, s, mask=s_mask)


@triton.jit
def quantize_blocks_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    B2,
    M,
    K,
    sx0,
    sx1,
    sx2,
    sx3,
    sq0,
    sq1,
    sq2,
    sq3,
    ss0,
    ss1,
    ss2,
    ss3,
    QM: tl.constexpr,
    QK: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    POW2: tl.constexpr,
    E8M0: tl.constexpr,
):
    """One program quantises a BM x BK tile: (BM / QM) x (BK / QK) blocks."""
    pid_b = tl.program_id(0)
    quantize_tile(
        x_ptr,
        q_ptr,
        s_ptr,
        (pid_b // B2).to(tl.int64),
        (pid_b % B2).to(tl.int64),
        tl.program_id(1),
        tl.program_id(2),
        M,
        K,
        sx0,
        sx1,
        sx2,
        sx3,
        sq0,
        sq1,
        sq2,
        sq3,
        ss0,
        ss1,
        ss2,
        ss3,
        QM,
        QK,
        BM,
        BK,
        POW2,
        E8M0,
    )


@triton.jit
def dequantize_blocks_kernel(
    q_ptr,
    s_ptr,
    y_ptr,
    B2,
    M,
    K,
    sq0,
    sq1,
    sq2,
    sq3,
    ss0,
    ss1,
    ss2,
    ss3,
    sy0,
    sy1,
    sy2,
    sy3,
    QM: tl.constexpr,
    QK: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    E8M0: tl.constexpr,
):
    """y = q * scale of its block (the inverse of ``quantize_blocks_kernel``, same view and strides)."""
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    b1 = (pid_b // B2).to(tl.int64)
    b2 = (pid_b % B2).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    q = tl.load(q_ptr + b1 * sq0 + b2 * sq1 + rows64[:, None] * sq2 + cols64[None, :] * sq3, mask=mask, other=0.0)
    blk_m = (rows // QM).to(tl.int64)
    blk_k = (cols // QK).to(tl.int64)
    s = tl.load(s_ptr + b1 * ss0 + b2 * ss1 + blk_m[:, None] * ss2 + blk_k[None, :] * ss3, mask=mask, other=0)
    if E8M0:
        s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    y = q.to(tl.float32) * s
    tl.store(
        y_ptr + b1 * sy0 + b2 * sy1 + rows64[:, None] * sy2 + cols64[None, :] * sy3,
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )
