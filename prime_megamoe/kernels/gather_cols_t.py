"""The weight gradients' gathered operands (``quantize.gather_quantize_cols_t_kernel``: x^T for dW1, dy^T for dW2) in
a layout made for them (Gluon), for the fp8 format.

Same outputs and bits as the Triton launch with 128-row column groups (= the routing tile) and fp32 scales: the
sorted rows x[row_src[r]] of each routing tile, quantised per column over the tile's rows, stored transposed in the
cols_t layout (values at q[k, 128 t + j], scales at s[t, k]).

Why a second kernel: the Triton launch loads its block with consecutive columns a thread, so each column's max over
the tile's rows crosses threads and its fp8 values go through shared memory to be stored transposed. Here, as in the
SwiGLU backward's column pass (``swiglu_grad_cols.py``), each thread holds 16 consecutive rows of CPT adjacent
columns from the load on:

- each load is one vector of a gathered row's CPT columns (CPT * 2 bytes for bf16);
- the column max is a max over the thread's 16 rows, then a reduction over the warps;
- each column's transposed store is 16 consecutive bytes a thread, from the same registers in row order.

An earlier form with one column a thread (2-byte loads) took 0.335 ms against 0.242 for the Triton launch
(scripts/fp8_pass_probe.py) and was dropped.

Rows past the tile's expert load zeros, which is what the cols_t layout stores there. Gluon kernels have no
interpreter: this one is tested on the GPU against the Triton launch and compiled for sm_90 on the CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .swiglu_grad_cols import _column_block, _column_layout, _store_cols


@gluon.jit
def gather_cols_t_kernel(
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
    POW2: gl.constexpr,
    TILE_M: gl.constexpr,
    BC: gl.constexpr,
    CPT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Program (c, t): routing tile t (past the device-side tile count: nothing) by columns [c * BC, c * BC + BC) of
    x [R, K] (those below K; rows contiguous). A thread holds 16 rows of CPT adjacent columns; a warp TILE_M //
    num_warps rows of all BC columns."""
    layout: gl.constexpr = _column_layout(TILE_M, BC, CPT, num_warps, False)
    store_layout: gl.constexpr = _column_layout(TILE_M, BC, CPT, num_warps, True)
    t = gl.program_id(1)
    if t < gl.load(num_tiles_ptr):
        rows, ok, col, cols, col_ok, cols_s, pos = _column_block(
            tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, t, K, TILE_M, BC, layout, store_layout
        )
        src = gl.load(row_src_ptr + rows, mask=ok, other=0).to(gl.int64)
        x = gl.load(
            x_ptr + src[:, None] * stride_xm + (col + cols)[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
        ).to(gl.float32)
        _store_cols(
            q_ptr,
            s_ptr,
            x,
            t,
            col,
            cols,
            col_ok,
            cols_s.to(gl.int64)[None, :] * stride_qk + pos,
            (cols_s < K)[None, :],
            stride_sr,
            POW2,
        )
