"""The quantising SwiGLU backward (``swiglu_grad.swiglu_backward_quantize_kernel``) in one pass (Gluon).

Same outputs and numerics as the Triton pass for the fp8 format (1 x 128 row groups, 128-row column groups): from
g_a [P, I] and h = [g | u] [P, 2I] it writes dh = [dg | du] row-scaled, dh^T and (w * a)^T column-scaled in the cols_t
layout, and dw_partial[c, r] = <g_a, a> over column block c.

Why a second kernel: the Triton pass runs as two launches (row outputs, then column outputs), so g_a and h are read
twice (~1.85 GB moved at Qwen3-30B-A3B, T = 16384, against ~1.1 GB for one pass). Here a persistent program walks
work items (a routing tile's 128 rows by a 128-column group of I):

- the next item's g_a, g and u are copied into shared memory by cp.async (zero-filled past the expert's rows) while
  the program computes the current one: two buffers of 3 x 128 x 128 bf16 (192 KB), one program an SM;
- the first sweep (two 64-row halves) computes dg, du and w * a in fp32, stores dg and du row-scaled with the dw
  partials, and takes each column's maximum;
- the second sweep computes the same values again from the buffer and stores them column-scaled and transposed.

One register layout serves both sweeps: a thread holds 4 adjacent columns of 8 rows, a warp 8 rows of all 128
columns. A row's maximum or sum is then a reduction over the warp's lanes, a column's a maximum over the thread's
rows and one exchange between the warps, and a thread's transposed store is 8 consecutive bytes of one column; no
value goes through shared memory to change layout (the earlier form of this kernel converted each chunk there and
was slower than the two launches: 0.797 against 0.673 ms, fp8_pass_probe_s15.txt).

The arithmetic is the Triton pass's, in its order, so every output is the same bits but dw_partial, whose 128-column
sums run in another order (last bits). Gluon kernels have no interpreter: this one is tested on the GPU against the
Triton pass and compiled for sm_90 on the CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .fp8_fc1_ws import _scale_from_amax
from .fp8_gemm_ws import _cp_async, _partition_barrier as _barrier


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
def _copy_tile(ga_ptr, h_ptr, ga_s, g_s, u_s, slot, item, NC, I, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
               stride_gam, stride_hm, CHUNKS: gl.constexpr, copy_layout: gl.constexpr):
    """Issues the asynchronous copies (cp.async, 16 bytes a thread, one commit group) of work item ``item``'s g_a, g
    and u (routing tile item // NC, 128-column group item % NC) into chunks slot * CHUNKS + k of ``ga_s``, ``g_s``,
    ``u_s`` [2 * CHUNKS, RB, BC] (rows k * RB on); rows past the tile's expert are zero-filled, as the Triton pass's
    masked loads read them."""
    RB: gl.constexpr = ga_s.type.shape[1]
    BC: gl.constexpr = ga_s.type.shape[2]
    t = item // NC
    col = (item % NC) * BC
    row0 = gl.load(tile_row_ptr + t)
    row_end = gl.load(expert_offsets_ptr + gl.load(tile_expert_ptr + t) + 1)
    cols = col + gl.arange(0, BC, layout=gl.SliceLayout(0, copy_layout))
    for k in gl.static_range(CHUNKS):
        rows = row0 + k * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, copy_layout))
        ok = (rows < row_end)[:, None]
        rows64 = rows.to(gl.int64)
        _cp_async(ga_s.index(slot * CHUNKS + k), ga_ptr + rows64[:, None] * stride_gam + cols[None, :], mask=ok)
        h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
        _cp_async(g_s.index(slot * CHUNKS + k), h_ptrs, mask=ok)
        _cp_async(u_s.index(slot * CHUNKS + k), h_ptrs + I, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _chunk(ga_s, g_s, u_s, slot, k, row_weight_ptr, row0, row_end, layout: gl.constexpr):
    """Chunk k (rows k * RB to k * RB + RB) of the item in buffer ``slot``: (rows, whether each is the expert's, and
    the fp32 dg, du, w * a, g_a * a of ``_dswiglu_chunk``)."""
    CHUNKS: gl.constexpr = ga_s.type.shape[0] // 2
    RB: gl.constexpr = ga_s.type.shape[1]
    rows = row0 + k * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, layout))
    ok = rows < row_end
    w = gl.load(row_weight_ptr + rows, mask=ok, other=0.0).to(gl.float32)
    ga = ga_s.index(slot * CHUNKS + k).load(layout).to(gl.float32)
    g = g_s.index(slot * CHUNKS + k).load(layout).to(gl.float32)
    u = u_s.index(slot * CHUNKS + k).load(layout).to(gl.float32)
    dg, du, aw, dw = _dswiglu_chunk(ga, g, u, w)
    return rows, ok, dg, du, aw, dw


@gluon.jit
def swiglu_backward_fused_kernel(
    ga_ptr, h_ptr, row_weight_ptr, dhq_ptr, dhs_ptr, dhtq_ptr, dhts_ptr, awtq_ptr, awts_ptr, dw_partial_ptr,
    tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr,
    I, NG, stride_gam, stride_hm, stride_dhm, stride_dhsm, stride_dhtk, stride_dhtsr, stride_awtk, stride_awtsr,
    stride_dwp,
    POW2: gl.constexpr, TILE_M: gl.constexpr, CHUNKS: gl.constexpr, num_warps: gl.constexpr,
):
    """Persistent: program p takes work items p, p + programs, ... (item = routing tile * NC + 128-column group of
    I; the device-side tile count ends the sequence), the next item's copies in flight while it computes one."""
    BC: gl.constexpr = 128
    RB: gl.constexpr = TILE_M // CHUNKS  # the rows of one sweep's step
    # Compute layout: a thread 4 adjacent columns of RB // num_warps rows, a warp those rows over all 128
    # columns. Row maxima and sums are shuffles in a warp, column maxima a max over the thread's rows and one
    # exchange between the warps; rows are stored 4 bytes a thread (128 contiguous bytes a warp).
    layout: gl.constexpr = gl.BlockedLayout([RB // num_warps, 4], [1, 32], [num_warps, 1], [1, 0])
    # The same threads with each thread's rows contiguous in its registers: the transposed stores, a run of
    # consecutive rows of one column a thread (RB // num_warps bytes), take it without moving data.
    t_layout: gl.constexpr = gl.BlockedLayout([RB // num_warps, 4], [1, 32], [num_warps, 1], [0, 1])
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    # Two items' inputs, each in CHUNKS chunks of RB rows (a chunk is indexed at run time: the sweeps are loops).
    ga_s = gl.allocate_shared_memory(ga_ptr.dtype.element_ty, [2 * CHUNKS, RB, BC], smem_layout)
    g_s = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [2 * CHUNKS, RB, BC], smem_layout)
    u_s = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [2 * CHUNKS, RB, BC], smem_layout)
    NC = I // BC
    total = gl.load(num_tiles_ptr) * NC
    cols = gl.arange(0, BC, layout=cols_layout)
    first = gl.program_id(0)
    if first < total:
        _copy_tile(ga_ptr, h_ptr, ga_s, g_s, u_s, 0, first, NC, I, tile_expert_ptr, tile_row_ptr,
                   expert_offsets_ptr, stride_gam, stride_hm, CHUNKS, copy_layout)
    it = 0
    for item in range(first, total, gl.num_programs(0)):
        slot = it % 2
        nxt = item + gl.num_programs(0)
        # Every thread has finished the last item (the buffer refilled here) before any copies into it start.
        _barrier()
        if nxt < total:
            _copy_tile(ga_ptr, h_ptr, ga_s, g_s, u_s, 1 - slot, nxt, NC, I, tile_expert_ptr, tile_row_ptr,
                       expert_offsets_ptr, stride_gam, stride_hm, CHUNKS, copy_layout)
            async_copy.wait_group(1)  # this item's copies (the older group) have landed
        else:
            async_copy.wait_group(0)
        _barrier()  # ... every thread's
        t = item // NC
        c = item % NC
        col = c * BC
        row0 = gl.load(tile_row_ptr + t)
        row_end = gl.load(expert_offsets_ptr + gl.load(tile_expert_ptr + t) + 1)
        # Row outputs (row scales from one 128-column group), dw partials, and the column maxima over the tile.
        amax_g = gl.zeros([BC], gl.float32, cols_layout)
        amax_u = gl.zeros([BC], gl.float32, cols_layout)
        amax_a = gl.zeros([BC], gl.float32, cols_layout)
        for k in range(CHUNKS):
            rows, ok, dg, du, aw, dw = _chunk(ga_s, g_s, u_s, slot, k, row_weight_ptr, row0, row_end, layout)
            rows64 = rows.to(gl.int64)
            gl.store(dw_partial_ptr + c.to(gl.int64) * stride_dwp + rows, gl.sum(dw, axis=1), mask=ok)
            _store_rows_q(dhq_ptr, dhs_ptr, dg, rows64, ok, col, cols, c, stride_dhm, stride_dhsm, POW2)
            _store_rows_q(dhq_ptr, dhs_ptr, du, rows64, ok, I + col, cols, NG + c, stride_dhm, stride_dhsm, POW2)
            amax_g = gl.maximum(amax_g, gl.max(gl.abs(dg), axis=0))
            amax_u = gl.maximum(amax_u, gl.max(gl.abs(du), axis=0))
            amax_a = gl.maximum(amax_a, gl.max(gl.abs(aw), axis=0))
        s_g = _scale_from_amax(amax_g, POW2)
        s_u = _scale_from_amax(amax_u, POW2)
        s_a = _scale_from_amax(amax_a, POW2)
        t64 = t.to(gl.int64)
        gl.store(dhts_ptr + t64 * stride_dhtsr + col + cols, s_g)
        gl.store(dhts_ptr + t64 * stride_dhtsr + I + col + cols, s_u)
        gl.store(awts_ptr + t64 * stride_awtsr + col + cols, s_a)
        inv_g, inv_u, inv_a = 1.0 / s_g, 1.0 / s_u, 1.0 / s_a
        # Column outputs: the same values again from the buffer, quantised with the column scales, transposed.
        for k in range(CHUNKS):
            _, _, dg, du, aw, _ = _chunk(ga_s, g_s, u_s, slot, k, row_weight_ptr, row0, row_end, layout)
            pos0 = t64 * TILE_M + k * RB
            _store_cols_t(dhtq_ptr, dg, inv_g, col, pos0, stride_dhtk, t_layout)
            _store_cols_t(dhtq_ptr, du, inv_u, I + col, pos0, stride_dhtk, t_layout)
            _store_cols_t(awtq_ptr, aw, inv_a, col, pos0, stride_awtk, t_layout)
        it += 1
