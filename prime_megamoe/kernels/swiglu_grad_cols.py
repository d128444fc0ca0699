"""The quantising SwiGLU backward's column outputs (``swiglu_grad.swiglu_backward_quantize_kernel`` with COLS_OUT) in
a layout made for them (Gluon).

Same outputs and bits as the Triton launch for the fp8 format (128-row column groups = the routing tile): from g_a
[P, I] and h = [g | u] [P, 2I] it writes dh^T = [dg | du]^T and (w * a)^T column-scaled in the cols_t layout, with
their scales.

Why a second kernel: the Triton launch loads its block with 8 consecutive columns a thread (the loads' contiguous
dim), so each column's max over the tile's 128 rows crosses threads, and its fp8 values go through shared memory,
a byte at a time, to be stored transposed. Nsight Compute found that launch issuing an instruction every ~4.5
cycles a warp (busy, not waiting on memory), at ~2.2 TB/s, and ~74 SASS instructions a thread per element
(Qwen3-30B-A3B, T = 16384, one H200). Here each thread holds 16 consecutive rows of CPT adjacent columns from the
load on:

- each load is one vector of a row's CPT columns (4 bytes with the launcher's CPT = 2; a warp's load covers whole
  32-byte sectors);
- the column max is a max over the thread's 16 rows, then a reduction over the warps;
- each column's transposed store is 16 consecutive bytes a thread (one vector store) from the same registers: the
  store layout differs from the load layout only in the order of a thread's registers, which moves no data.

Measured (Qwen3-30B-A3B, T = 16384, one H200, ``scripts/fp8_pass_probe.py``): 0.318 ms with CPT = 2 against 0.342
with one column a thread (whose loads are 2 bytes), and 0.367 for that before the quantisers lost their clamp to
+-448 (the conversion saturates; ``scripts/register_check.py --sass``: 1008 instructions against 1104).

The arithmetic is the Triton pass's, in its order (``swiglu_grad_fused._dswiglu_chunk``, ``_quantise``,
``fp8_fc1_ws._scale_from_amax``), so the outputs are the same bits; rows past the tile's expert load zeros, which
is what the cols_t layout stores there. Gluon kernels have no interpreter: this one is tested on the GPU against the
Triton launch and compiled for sm_90 on the CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fp8_fc1_ws import _scale_from_amax
from .swiglu_grad_fused import _dswiglu_chunk, _quantise


@gluon.constexpr_function
def _column_layout(tile_m, bc, cpt, num_warps, for_stores):
    """The transposing passes' register layout: a thread holds 16 rows of ``cpt`` adjacent columns, a warp
    ``tile_m // num_warps`` rows of all ``bc`` columns; for the transposed stores the same arrangement with each
    thread's registers ordered rows first (so converting between the two moves no data)."""
    row_threads = tile_m // (16 * num_warps)
    if row_threads * (bc // cpt) != 32:
        raise ValueError(
            f"a warp must cover TILE_M // num_warps rows of BC columns (TILE_M {tile_m}, BC {bc}, "
            f"CPT {cpt}, {num_warps} warps)"
        )
    return gl.BlockedLayout([16, cpt], [row_threads, bc // cpt], [num_warps, 1], [0, 1] if for_stores else [1, 0])


@gluon.jit
def _store_cols(q_ptr, s_ptr, x, t, col, cols, col_ok, q_offsets, q_ok, stride_s, POW2: gl.constexpr):
    """x [TILE, BC] fp32 (tile t, columns col + cols) quantised per column over the tile's rows: values at
    q_ptr + q_offsets (in q_offsets' layout: a thread's rows of a column contiguous in its registers, so that they
    are one vector store), scales at s[t, col + j]; columns where col_ok / q_ok is False are not stored."""
    scale = _scale_from_amax(gl.max(gl.abs(x), axis=0), POW2)
    q = gl.convert_layout(_quantise(x, (1.0 / scale)[None, :]), q_offsets.type.layout)
    gl.store(q_ptr + q_offsets, q, mask=q_ok)
    gl.store(s_ptr + t.to(gl.int64) * stride_s + col + cols, scale, mask=col_ok)


@gluon.jit
def _column_block(
    tile_expert_ptr,
    tile_row_ptr,
    expert_offsets_ptr,
    t,
    n,
    TILE_M: gl.constexpr,
    BC: gl.constexpr,
    layout: gl.constexpr,
    store_layout: gl.constexpr,
):
    """Program (c, t)'s block: routing tile t by columns [c * BC, c * BC + BC) of n. Returns, in ``layout``, the
    tile's rows, which of them are its expert's, the first column, the block's columns and which are below n; and in
    ``store_layout`` (the transposed stores') the column indices col + j and the tile-space rows t * TILE_M + r."""
    expert = gl.load(tile_expert_ptr + t)
    row0 = gl.load(tile_row_ptr + t)
    row_end = gl.load(expert_offsets_ptr + expert + 1)
    col = gl.program_id(0) * BC
    rows = row0 + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BC, layout=gl.SliceLayout(0, layout))
    cols_s = col + gl.arange(0, BC, layout=gl.SliceLayout(0, store_layout))
    pos = t.to(gl.int64) * TILE_M + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, store_layout))
    return rows, rows < row_end, col, cols, (col + cols) < n, cols_s, pos[:, None]


@gluon.jit
def swiglu_backward_cols_kernel(
    ga_ptr,
    h_ptr,
    row_weight_ptr,
    dhtq_ptr,
    dhts_ptr,
    awtq_ptr,
    awts_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    I,
    stride_gam,
    stride_hm,
    stride_dhtk,
    stride_dhtsr,
    stride_awtk,
    stride_awtsr,
    clamp_limit,
    POW2: gl.constexpr,
    TILE_M: gl.constexpr,
    BC: gl.constexpr,
    CPT: gl.constexpr,
    num_warps: gl.constexpr,
    CLAMP: gl.constexpr,
):
    """Program (c, t): routing tile t (past the device-side tile count: nothing) by gate columns [c * BC, c * BC +
    BC) of I (those below I) and the same up columns, I further. A thread holds 16 rows of CPT adjacent columns; a
    warp TILE_M // num_warps rows of all BC columns. The loads take the CPT columns as one vector (CPT * 2 bytes);
    the transposed stores take each column's 16 rows as one (16 bytes), from the same registers in another order."""
    layout: gl.constexpr = _column_layout(TILE_M, BC, CPT, num_warps, False)
    store_layout: gl.constexpr = _column_layout(TILE_M, BC, CPT, num_warps, True)
    t = gl.program_id(1)
    if t < gl.load(num_tiles_ptr):
        rows, ok, col, cols, col_ok, cols_s, pos = _column_block(
            tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, t, I, TILE_M, BC, layout, store_layout
        )
        rows64 = rows.to(gl.int64)
        w = gl.load(row_weight_ptr + rows, mask=ok, other=0.0).to(gl.float32)
        mask = ok[:, None] & col_ok[None, :]
        ga = gl.load(ga_ptr + rows64[:, None] * stride_gam + (col + cols)[None, :], mask=mask, other=0.0).to(gl.float32)
        h_ptrs = h_ptr + rows64[:, None] * stride_hm + (col + cols)[None, :]
        g = gl.load(h_ptrs, mask=mask, other=0.0).to(gl.float32)
        u = gl.load(h_ptrs + I, mask=mask, other=0.0).to(gl.float32)
        dg, du, aw, _ = _dswiglu_chunk(ga, g, u, w, clamp_limit, CLAMP)
        q_ok = (cols_s < I)[None, :]
        _store_cols(
            dhtq_ptr,
            dhts_ptr,
            dg,
            t,
            col,
            cols,
            col_ok,
            cols_s.to(gl.int64)[None, :] * stride_dhtk + pos,
            q_ok,
            stride_dhtsr,
            POW2,
        )
        _store_cols(
            dhtq_ptr,
            dhts_ptr,
            du,
            t,
            I + col,
            cols,
            col_ok,
            (I + cols_s).to(gl.int64)[None, :] * stride_dhtk + pos,
            q_ok,
            stride_dhtsr,
            POW2,
        )
        _store_cols(
            awtq_ptr,
            awts_ptr,
            aw,
            t,
            col,
            cols,
            col_ok,
            cols_s.to(gl.int64)[None, :] * stride_awtk + pos,
            q_ok,
            stride_awtsr,
            POW2,
        )
