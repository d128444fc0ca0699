"""The quantising SwiGLU backward (``swiglu_grad.swiglu_backward_quantize_kernel``) in one pass (Gluon), opt-in.

Same outputs and numerics as the Triton pass for the fp8 format (1 x 128 row groups, 128-row column groups): from
g_a [P, I] and h = [g | u] [P, 2I] it writes dh = [dg | du] row-scaled, dh^T and (w * a)^T column-scaled in the cols_t
layout, and dw_partial[c, r] = <g_a, a> over column block c.

Why a second kernel: the layer's two launches (row outputs, then column outputs) read g_a and h twice (~1.85 GB moved
at Qwen3-30B-A3B, T = 16384, against ~1.1 GB for one pass) and evaluate the SwiGLU derivative twice (~108 SASS
instructions an element together). Here a persistent program (one an SM) walks work items (a routing tile's 128
rows by a 128-column group of I):

- the first sweep takes the item in chunks of RB rows, each chunk's inputs loaded into registers while the chunk
  before is computed (the next item's first chunk during the current item's last); it computes dg, du and w * a in
  fp32 once, stores dg and du row-scaled with the dw partials, keeps each element's running maximum for the column
  scales, and stashes the three fp32 values in shared memory (3 x 64 KB);
- the second sweep quantises the stash with the column scales and stores it transposed, each thread 16 consecutive
  rows of a column (one 16-byte store).

That is ~78 instructions an element (``scripts/register_check.py --sass``), but the stash leaves room for one
program an SM. With eight warps it ran at ~30% of the SM's issue rate: 0.771 ms against 0.525 for the two launches
(``scripts/fp8_pass_probe.py``), and in the layer's profile 752 against 519 us. With
sixteen warps (125 registers) it took 1.003 ms: the per-item work (column reductions over more warps, the scales)
grows to ~93 instructions an element in all. So the layer keeps the two launches (``fp8_launch.fp8_dswiglu``'s
``fused`` is False by default). Two earlier forms were slower still (``scripts/fp8_pass_probe.py``): the inputs
kept in shared memory with layout conversions (0.797 ms, 1.110 in another run of the probe), and a persistent form
that evaluated the derivative in both sweeps (1.4-3.8 ms).

The arithmetic is the Triton pass's, in its order, so every output is the same bits but dw_partial, whose 128-column
sums run in another order (last bits). Rows past the tile's expert load zeros: the cols_t layout stores zeros there,
and the row outputs are not stored. Gluon kernels have no interpreter: this one is tested on the GPU against the
Triton pass and compiled for sm_90 on the CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fp8_fc1_ws import _clamp_gate_up, _scale_from_amax
from .gemm_ws import _partition_barrier as _barrier


@gluon.jit
def _dswiglu_chunk(ga, g, u, w, clamp_limit, CLAMP: gl.constexpr):
    """fp32 (dg, du, w * a, g_a * a) of one chunk: the Triton pass's expressions, in its order (with CLAMP the
    clamped SwiGLU's, ``kernels/activation.py``: g and u clamped, dg and du zero where they were cut)."""
    if CLAMP:
        g_ok = g <= clamp_limit
        u_ok = (u >= -clamp_limit) & (u <= clamp_limit)
        g, u = _clamp_gate_up(g, u, clamp_limit)
    sig = 1 / (1 + gl.exp(-g))  # tl.sigmoid's expression
    silu = g * sig
    act = silu * u
    da = ga * w[:, None]
    dg = da * u * (sig + silu * (1.0 - sig))
    du = da * silu
    if CLAMP:
        dg = gl.where(g_ok, dg, 0.0)
        du = gl.where(u_ok, du, 0.0)
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
def _item(item, NC, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, valid, BC: gl.constexpr):
    """Work item ``item`` (routing tile item // NC by BC-column group item % NC): its tile, first column, first row
    and the end of its expert's rows; with ``valid`` False nothing is read (zeros)."""
    t = item // NC
    row0 = gl.load(tile_row_ptr + t, mask=valid, other=0)
    expert = gl.load(tile_expert_ptr + t, mask=valid, other=0)
    row_end = gl.load(expert_offsets_ptr + expert + 1, mask=valid, other=0)
    return t, (item % NC) * BC, row0, row_end


@gluon.jit
def _load_chunk(
    ga_ptr,
    h_ptr,
    row_weight_ptr,
    row0,
    row_end,
    col,
    k,
    I,
    stride_gam,
    stride_hm,
    RB: gl.constexpr,
    BC: gl.constexpr,
    layout: gl.constexpr,
):
    """Rows [k * RB, k * RB + RB) of an item, in ``layout``: g_a, g, u (bf16) and the rows' weights; rows past the
    expert's end (or all, for an item past the end: row_end 0) read zeros, as the Triton pass's masked loads."""
    rows = row0 + k * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, layout))
    cols = col + gl.arange(0, BC, layout=gl.SliceLayout(0, layout))
    ok = rows < row_end
    rows64 = rows.to(gl.int64)
    ga = gl.load(ga_ptr + rows64[:, None] * stride_gam + cols[None, :], mask=ok[:, None], other=0.0)
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    g = gl.load(h_ptrs, mask=ok[:, None], other=0.0)
    u = gl.load(h_ptrs + I, mask=ok[:, None], other=0.0)
    w = gl.load(row_weight_ptr + rows, mask=ok, other=0.0)
    return ga, g, u, w


@gluon.jit
def _store_cols_from_stash(q_ptr, stash, k, inv_scale, col, t, stride_q, TILE_M: gl.constexpr, t_layout: gl.constexpr):
    """Chunk k of a stashed fp32 output, quantised with the per-column inverse scales (in t_layout's column slice)
    and stored transposed: q[col + j, t * TILE_M + k * RB + r], each thread's 16 rows of a column one 16-byte
    store."""
    RB: gl.constexpr = stash.type.shape[1]
    BC: gl.constexpr = stash.type.shape[2]
    q = _quantise(stash.index(k).load(t_layout), inv_scale[None, :])
    rr = gl.arange(0, RB, layout=gl.SliceLayout(1, t_layout))
    cc = gl.arange(0, BC, layout=gl.SliceLayout(0, t_layout))
    pos = t.to(gl.int64) * TILE_M + k * RB + rr
    gl.store(q_ptr + (col + cc).to(gl.int64)[None, :] * stride_q + pos[:, None], q)


@gluon.jit
def swiglu_backward_fused_kernel(
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
    I,
    NG,
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
    POW2: gl.constexpr,
    TILE_M: gl.constexpr,
    RB: gl.constexpr,
    num_warps: gl.constexpr,
    CLAMP: gl.constexpr,
):
    """Persistent: program p takes work items p, p + programs, ... (item = routing tile * NC + 128-column group of
    I; the device-side tile count ends the sequence). Per item, CHUNKS = TILE_M // RB chunks of RB rows."""
    BC: gl.constexpr = 128
    CHUNKS: gl.constexpr = TILE_M // RB
    # First sweep: a thread 8 adjacent columns (one 16-byte load) of RB // (2 * num_warps) rows, a row over 16
    # lanes (its maximum and sum: in-thread, then four shuffles).
    layout: gl.constexpr = gl.BlockedLayout([RB // (2 * num_warps), 8], [2, 16], [num_warps, 1], [1, 0])
    # Second sweep: a thread T_ROWS consecutive rows of one column (one transposed store of T_ROWS bytes), the warps
    # side by side over the columns.
    T_ROWS: gl.constexpr = RB * BC // (32 * num_warps)
    gl.static_assert((32 // (RB // T_ROWS)) * num_warps == BC, "the second sweep's layout must cover RB x 128")
    t_layout: gl.constexpr = gl.BlockedLayout([T_ROWS, 1], [RB // T_ROWS, 32 // (RB // T_ROWS)], [1, num_warps], [0, 1])
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    stash_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    # dg, du and w * a of one item in fp32: the column outputs are quantised from them once the column scales are
    # known, so the SwiGLU derivative is evaluated once (3 x 64 KB).
    dg_s = gl.allocate_shared_memory(gl.float32, [CHUNKS, RB, BC], stash_layout)
    du_s = gl.allocate_shared_memory(gl.float32, [CHUNKS, RB, BC], stash_layout)
    aw_s = gl.allocate_shared_memory(gl.float32, [CHUNKS, RB, BC], stash_layout)
    NC = I // BC
    total = gl.load(num_tiles_ptr) * NC
    cols = gl.arange(0, BC, layout=cols_layout)
    step = gl.num_programs(0)
    item = gl.program_id(0)
    t, col, row0, row_end = _item(item, NC, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, item < total, BC)
    ga_n, g_n, u_n, w_n = _load_chunk(
        ga_ptr, h_ptr, row_weight_ptr, row0, row_end, col, 0, I, stride_gam, stride_hm, RB, BC, layout
    )
    while item < total:
        nxt = item + step
        t_n, col_n, row0_n, row_end_n = _item(
            nxt, NC, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, nxt < total, BC
        )
        amax_g = gl.zeros([RB, BC], gl.float32, layout)
        amax_u = gl.zeros([RB, BC], gl.float32, layout)
        amax_a = gl.zeros([RB, BC], gl.float32, layout)
        c = item % NC
        for k in range(CHUNKS):
            ga, g, u, w = ga_n, g_n, u_n, w_n
            # The next chunk's loads (this item's, or the next item's first) fly while this one is computed.
            if k + 1 < CHUNKS:
                ga_n, g_n, u_n, w_n = _load_chunk(
                    ga_ptr, h_ptr, row_weight_ptr, row0, row_end, col, k + 1, I, stride_gam, stride_hm, RB, BC, layout
                )
            else:
                ga_n, g_n, u_n, w_n = _load_chunk(
                    ga_ptr, h_ptr, row_weight_ptr, row0_n, row_end_n, col_n, 0, I, stride_gam, stride_hm, RB, BC, layout
                )
            rows = row0 + k * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, layout))
            ok = rows < row_end
            rows64 = rows.to(gl.int64)
            dg, du, aw, dw = _dswiglu_chunk(
                ga.to(gl.float32), g.to(gl.float32), u.to(gl.float32), w.to(gl.float32), clamp_limit, CLAMP
            )
            gl.store(dw_partial_ptr + c.to(gl.int64) * stride_dwp + rows, gl.sum(dw, axis=1), mask=ok)
            _store_rows_q(dhq_ptr, dhs_ptr, dg, rows64, ok, col, cols, c, stride_dhm, stride_dhsm, POW2)
            _store_rows_q(dhq_ptr, dhs_ptr, du, rows64, ok, I + col, cols, NG + c, stride_dhm, stride_dhsm, POW2)
            dg_s.index(k).store(dg)
            du_s.index(k).store(du)
            aw_s.index(k).store(aw)
            amax_g = gl.maximum(amax_g, gl.abs(dg))
            amax_u = gl.maximum(amax_u, gl.abs(du))
            amax_a = gl.maximum(amax_a, gl.abs(aw))
        s_g = _scale_from_amax(gl.max(amax_g, axis=0), POW2)
        s_u = _scale_from_amax(gl.max(amax_u, axis=0), POW2)
        s_a = _scale_from_amax(gl.max(amax_a, axis=0), POW2)
        t64 = t.to(gl.int64)
        gl.store(dhts_ptr + t64 * stride_dhtsr + col + cols, s_g)
        gl.store(dhts_ptr + t64 * stride_dhtsr + I + col + cols, s_u)
        gl.store(awts_ptr + t64 * stride_awtsr + col + cols, s_a)
        t_cols: gl.constexpr = gl.SliceLayout(0, t_layout)
        inv_g = gl.convert_layout(1.0 / s_g, t_cols)
        inv_u = gl.convert_layout(1.0 / s_u, t_cols)
        inv_a = gl.convert_layout(1.0 / s_a, t_cols)
        _barrier()  # every thread's stash writes are visible
        for k in range(CHUNKS):
            _store_cols_from_stash(dhtq_ptr, dg_s, k, inv_g, col, t, stride_dhtk, TILE_M, t_layout)
            _store_cols_from_stash(dhtq_ptr, du_s, k, inv_u, I + col, t, stride_dhtk, TILE_M, t_layout)
            _store_cols_from_stash(awtq_ptr, aw_s, k, inv_a, col, t, stride_awtk, TILE_M, t_layout)
        _barrier()  # every thread has read the stash before the next item writes it
        item, t, col, row0, row_end = nxt, t_n, col_n, row0_n, row_end_n
