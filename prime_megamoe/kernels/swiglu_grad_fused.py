"""The quantising SwiGLU backward (``swiglu_grad.swiglu_backward_quantize_kernel``) in one pass (Gluon).

Same outputs and numerics as the Triton pass for the fp8 format (1 x 128 row groups, 128-row column groups): from
g_a [P, I] and h = [g | u] [P, 2I] it writes dh = [dg | du] row-scaled, dh^T and (w * a)^T column-scaled in the cols_t
layout, and dw_partial[c, r] = <g_a, a> over column block c.

Why a second kernel: the Triton pass runs as two launches (row outputs from 16 x 128 blocks, column outputs from
128 x 64 blocks), so g_a and h are read twice; its one-launch form holds a 128 x 128 block of six fp32 tensors and
ran slower still (BENCHMARKS.md). Here a program takes one routing tile (128 rows) by one 128-column group and keeps
its inputs in shared memory:

- the program first issues asynchronous copies (cp.async) of every RB-row chunk of g_a, g and u into shared memory;
- phase A walks the chunks as they land: computes dg, du and w * a in fp32, quantises dg and du per row and stores them with their scales and the
  chunk's dw partials, and keeps a running elementwise max of |dg|, |du|, |w * a|;
- the column scales follow from those maxima (one reduction over the rows);
- phase B walks the chunks again from shared memory, computes the same fp32 values, quantises them with the column
  scales and stores them transposed (each thread a run of consecutive rows of one column).

Each thread reads exactly the shared-memory elements it copied (the copies and both phases use one layout), so
waiting for its own copies is enough: no barrier. Rows past the tile's expert load zeros: the cols_t layout stores zeros there, and the row
outputs are not stored. dw_partial sums 128 columns in another order than the Triton pass (its layout differs), so
it may differ in the last bits; every other output is the same bits. Gluon kernels have no interpreter: this one is
tested on the GPU against the Triton pass and compiled for sm_90 on the CPU.

Measured (Qwen3-30B-A3B, T = 16384, one H200, ``scripts/fp8_pass_probe.py``; benchmarks/results/
fp8_pass_probe_s15.txt): slower than the two launches, so the layer does not use it (``fp8_launch.fp8_dswiglu``'s
``fused`` is False by default): with plain loads 0.888 ms against 0.671, with the copies asynchronous 0.797 against
0.673 (the layer's backward 4.62 against 4.40 ms one call). What it spends that time on is not measured yet; the
candidates: two programs an SM (128 registers, ~100 KB of shared memory each) with nothing overlapping a program's
own phases, ~70 barriers a program (each layout conversion and column reduction), and phase B's transposed stores in
8-byte pieces (16 rows a chunk). In the twenty-first session it took 1.110 ms against 0.527 for the two launches
(fp8_pass_probe_s21.txt; its quantiser had lost the clamp before the saturating conversion, and the column launch had
become faster); not looked into further.

A persistent form was tried and dropped in that session (BENCHMARKS.md): one program an SM, the next item's inputs
copied by cp.async into a second buffer while the program computes, one register layout for the row and the column
outputs (4 columns of 4 rows a thread), no layout conversions. It took 1.4-3.8 ms: the two sweeps still evaluate the
SwiGLU derivative twice (~112 SASS instructions an element against ~113 for the two launches together), and eight
warps an SM with a barrier for each column reduction left the SM idle.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .fp8_fc1_ws import _scale_from_amax
from .fp8_gemm_ws import _cp_async


@gluon.jit
def _dswiglu_chunk(ga, g, u, w):
    """fp32 (dg, du, w * a, g_a * a) of one chunk: the Triton pass's expressions, in its order."""
    sig = 1 / (1 + gl.exp(-g))  # tl.sigmoid's expression
    silu = g * sig
    act = silu * u
    da = ga * w[:, None]
    dg = da * u * (sig + silu * (1.0 - sig))
    du = da * silu
    return dg, du, act * w[:, None], ga * act


@gluon.jit
def _quantise(x, inv_scale):
    # No clamp to +-FP8_MAX first: the conversion saturates (cvt.rn.satfinite), which gives the clamp's bits for
    # every finite or infinite value and keeps a NaN a NaN.
    return (x * inv_scale).to(gl.float8e4nv)


@gluon.jit
def _store_rows_q(q_ptr, s_ptr, x, rows64, ok, col, cols, s_col, stride_q, stride_s, POW2: gl.constexpr):
    """x [RB, 128] fp32 quantised per row (one 128-column group) at q[rows, col + cols], its scale at s[rows, s_col]."""
    scale = _scale_from_amax(gl.max(gl.abs(x), axis=1), POW2)
    q = _quantise(x, (1.0 / scale)[:, None])
    gl.store(q_ptr + rows64[:, None] * stride_q + (col + cols)[None, :], q, mask=ok[:, None])
    gl.store(s_ptr + rows64 * stride_s + s_col, scale, mask=ok)


@gluon.jit
def _store_cols_t(q_ptr, x, inv_scale, col, pos0, stride_q, t_layout: gl.constexpr):
    """x [RB, 128] fp32 quantised with per-column scales, stored transposed: q[col + j, pos0 + r]."""
    RB: gl.constexpr = x.type.shape[0]
    BC: gl.constexpr = x.type.shape[1]
    q = gl.convert_layout(_quantise(x, inv_scale[None, :]), t_layout)
    rr = gl.arange(0, RB, layout=gl.SliceLayout(1, t_layout))
    cc = gl.arange(0, BC, layout=gl.SliceLayout(0, t_layout))
    gl.store(q_ptr + (col + cc).to(gl.int64)[None, :] * stride_q + (pos0 + rr)[:, None], q)


@gluon.jit
def swiglu_backward_fused_kernel(
    ga_ptr, h_ptr, row_weight_ptr, dhq_ptr, dhs_ptr, dhtq_ptr, dhts_ptr, awtq_ptr, awts_ptr, dw_partial_ptr,
    tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr,
    I, NG, stride_gam, stride_hm, stride_dhm, stride_dhsm, stride_dhtk, stride_dhtsr, stride_awtk, stride_awtsr,
    stride_dwp,
    POW2: gl.constexpr, TILE_M: gl.constexpr, RB: gl.constexpr, num_warps: gl.constexpr,
):
    """Program (c, t): routing tile t (its rows past the device-side tile count: nothing) by columns [c * 128,
    c * 128 + 128) of I (gate), the up columns I further."""
    BC: gl.constexpr = 128
    CHUNKS: gl.constexpr = TILE_M // RB
    # A chunk [RB, 128]: 8 consecutive columns (16 bf16 bytes) a thread, a row over 16 threads.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    # Transposed stores: each thread RB / 2 consecutive rows of one column (contiguous bytes of the cols_t layout).
    t_layout: gl.constexpr = gl.BlockedLayout([RB // 2, 1], [2, 16], [1, num_warps], [0, 1])
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    c = gl.program_id(0)
    t = gl.program_id(1)
    if t < gl.load(num_tiles_ptr):
        expert = gl.load(tile_expert_ptr + t)
        row0 = gl.load(tile_row_ptr + t)
        row_end = gl.load(expert_offsets_ptr + expert + 1)
        col = c * BC
        cols = gl.arange(0, BC, layout=cols_layout)
        ga_s = gl.allocate_shared_memory(ga_ptr.dtype.element_ty, [CHUNKS, RB, BC], smem_layout)
        g_s = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [CHUNKS, RB, BC], smem_layout)
        u_s = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [CHUNKS, RB, BC], smem_layout)
        # Every chunk's copies in flight at once (cp.async, 16 bytes a thread; rows past the expert's end are
        # zero-filled), one commit group a chunk, so that phase A starts on a chunk as soon as it has landed.
        for k in gl.static_range(CHUNKS):
            rows = row0 + k * RB + gl.arange(0, RB, layout=rows_layout)
            ok = (rows < row_end)[:, None]
            rows64 = rows.to(gl.int64)
            _cp_async(ga_s.index(k), ga_ptr + rows64[:, None] * stride_gam + (col + cols)[None, :], mask=ok)
            h_ptrs = h_ptr + rows64[:, None] * stride_hm + (col + cols)[None, :]
            _cp_async(g_s.index(k), h_ptrs, mask=ok)
            _cp_async(u_s.index(k), h_ptrs + I, mask=ok)
            async_copy.commit_group()
        amax_g = gl.zeros([RB, BC], gl.float32, layout)
        amax_u = gl.zeros([RB, BC], gl.float32, layout)
        amax_a = gl.zeros([RB, BC], gl.float32, layout)
        for k in gl.static_range(CHUNKS):
            rows = row0 + k * RB + gl.arange(0, RB, layout=rows_layout)
            ok = rows < row_end
            rows64 = rows.to(gl.int64)
            w = gl.load(row_weight_ptr + rows, mask=ok, other=0.0).to(gl.float32)
            async_copy.wait_group(CHUNKS - 1 - k)  # this thread's copies of chunk k have landed
            ga = ga_s.index(k).load(layout).to(gl.float32)
            g = g_s.index(k).load(layout).to(gl.float32)
            u = u_s.index(k).load(layout).to(gl.float32)
            dg, du, aw, dw = _dswiglu_chunk(ga, g, u, w)
            gl.store(dw_partial_ptr + c.to(gl.int64) * stride_dwp + rows, gl.sum(dw, axis=1), mask=ok)
            _store_rows_q(dhq_ptr, dhs_ptr, dg, rows64, ok, col, cols, c, stride_dhm, stride_dhsm, POW2)
            _store_rows_q(dhq_ptr, dhs_ptr, du, rows64, ok, I + col, cols, NG + c, stride_dhm, stride_dhsm, POW2)
            amax_g = gl.maximum(amax_g, gl.abs(dg))
            amax_u = gl.maximum(amax_u, gl.abs(du))
            amax_a = gl.maximum(amax_a, gl.abs(aw))
        s_g = _scale_from_amax(gl.max(amax_g, axis=0), POW2)
        s_u = _scale_from_amax(gl.max(amax_u, axis=0), POW2)
        s_a = _scale_from_amax(gl.max(amax_a, axis=0), POW2)
        gl.store(dhts_ptr + t.to(gl.int64) * stride_dhtsr + col + cols, s_g)
        gl.store(dhts_ptr + t.to(gl.int64) * stride_dhtsr + I + col + cols, s_u)
        gl.store(awts_ptr + t.to(gl.int64) * stride_awtsr + col + cols, s_a)
        inv_g, inv_u, inv_a = 1.0 / s_g, 1.0 / s_u, 1.0 / s_a
        for k in gl.static_range(CHUNKS):
            rows = row0 + k * RB + gl.arange(0, RB, layout=rows_layout)
            w = gl.load(row_weight_ptr + rows, mask=rows < row_end, other=0.0).to(gl.float32)
            ga = ga_s.index(k).load(layout).to(gl.float32)
            g = g_s.index(k).load(layout).to(gl.float32)
            u = u_s.index(k).load(layout).to(gl.float32)
            dg, du, aw, _ = _dswiglu_chunk(ga, g, u, w)
            pos0 = t.to(gl.int64) * TILE_M + k * RB
            _store_cols_t(dhtq_ptr, dg, inv_g, col, pos0, stride_dhtk, t_layout)
            _store_cols_t(dhtq_ptr, du, inv_u, I + col, pos0, stride_dhtk, t_layout)
            _store_cols_t(awtq_ptr, aw, inv_a, col, pos0, stride_awtk, t_layout)
