"""FC1 + SwiGLU of ``fp8_gemm.py`` (``fp8_fc1_swiglu_kernel`` with MX = False) as a warp-specialised, persistent
Hopper kernel (Gluon), built from the parts of ``gemm_ws.py``.

``h = x[src] @ W1[e]^T`` (fp8 operands, fp32 accumulation promoted every 128 products, the Triton kernel's
expression), ``a = silu(h[:, :I]) * h[:, I:]``; h is stored in its dtype (when the backward needs it) and a in fp8
with one scale per row and 128 columns, as the Triton kernel stores them.

- A tile is 128 sorted rows (two 64-row halves, one per MMA partition) and one 128-column scale group of a: gate
  columns [c, c + 128) and the up columns I further. Each stage holds A's 128 rows once (gathered) and 256 rows of
  W1 (the gate box, then the up box, by TMA).
- Each step of an MMA partition: the gate wgmma (64 x 128), waited for and promoted into the gate accumulator, then
  the up wgmma likewise. One at a time, so that two accumulators and one fresh product fit the registers; the other
  partition's wgmma runs while one promotes.
- The producer (4 warps) gathers A's rows by cp.async as the gathering GEMM does, A's row scales and the step's
  gate / up block scales (each copied for a partition's 64 rows) by cp.async, the two B boxes by TMA, all counted on the
  stage's ready barrier.
- Epilogue: h's gate and up parts stored from registers in 64-column halves (fewer registers in flight), then
  a = silu(gate) * up (CLAMP: silu(min(gate, c)) * clamp(up, -c, c), c = clamp_limit; ``kernels/activation.py``),
  its 128-column group quantised in registers and stored with its scale.

Requirements (the launcher checks them): the fp8 format (128 x 128 weight blocks, 1 x 128 activation groups), I a
multiple of 128, H a multiple of 16 (16-byte row pieces of x).

History: the first form (commit 10aa39d) split each tile into two 64-column sub-tiles, gate and up side by side in
one wgmma; it gave the same bits as the Triton kernel but took 1.285 ms against 1.163 (Qwen3-30B-A3B, T = 16384,
one H200; ``scripts/fp8_probe.py --ws-only``): Nsight Compute put its L1/TEX path at 77%, as it
gathered x's rows once per sub-tile. This form gathers them once per tile: the same bits as the Triton kernel, 0.899
ms against 1.164 with 4 stages, 0.905 with 3 (the same probe, another run); the layer runs it. It
compiles for sm_90 on the CPU (Triton 3.6: no spill; 3.9: 24 bytes; no wgmma serialisation).
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gemm_ws import _cp_async, _partition_barrier, _stage_barriers, _tile_of, _tile_with_end, _tma_load

FP8_MAX = gl.constexpr(448.0)
SMALLEST_NORMAL = gl.constexpr(1.1754943508222875e-38)


@gluon.jit
def _fc1_load_partition(
    b_desc,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    xq_ptr,
    row_src_ptr,
    xs_ptr,
    ws_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    M,
    I,
    K,
    stride_xm,
    stride_xsm,
    stride_wse,
    stride_wsn,
    UP_SCALE_OFF,
    row_base,
    TILE_M: gl.constexpr,
    SCALED: gl.constexpr,
):
    """Fills each stage: A's rows gathered (cp.async, 16 bytes a thread; x holds source rows from ``row_base`` on),
    the gate and up boxes of W1 (TMA) and, SCALED (fp8), A's row scales and the step's gate and up block scales, each
    copied for a partition's rows (cp.async). Unscaled (bf16): the pointers and strides of the scales are unused."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]  # rows of one MMA partition
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]  # gate (and up) rows of one step
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    TILE_ROWS: gl.constexpr = 2 * BLOCK_M
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    VEC: gl.constexpr = 128 // a_bufs.dtype.primitive_bitwidth  # elements of a 16-byte piece
    chunk_layout: gl.constexpr = gl.BlockedLayout(
        [1, VEC], [32 * VEC // BLOCK_K, BLOCK_K // VEC], [gl.num_warps(), 1], [1, 0]
    )
    chunk_rows: gl.constexpr = gl.SliceLayout(1, chunk_layout)
    n_groups = I // BLOCK_N
    k_steps = gl.cdiv(K, BLOCK_K)
    total = gl.load(num_tiles_ptr) * (TILE_M // TILE_ROWS) * n_groups
    # The stage's B scales: the gate block's in its first BLOCK_M entries, the up block's in the rest (each MMA
    # partition reads them as a row vector of its BLOCK_M rows).
    slots = gl.arange(0, 2 * BLOCK_M, layout=row_layout)
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, row0, col0 = _tile_of(t, n_groups, tile_expert_ptr, tile_row_ptr, TILE_ROWS, BLOCK_N, TILE_M)
        if SCALED:
            rows = row0 + gl.arange(0, TILE_ROWS, layout=row_layout)
            in_rows = rows < M
            sa_ptrs = xs_ptr + gl.load(row_src_ptr + rows, mask=in_rows, other=0).to(gl.int64) * stride_xsm
            group = col0 // BLOCK_N
            sb_ptrs = (
                ws_ptr
                + expert.to(gl.int64) * stride_wse
                + gl.where(slots < BLOCK_M, group, UP_SCALE_OFF + group) * stride_wsn
            )
        # Each half's source rows as 32-bit element offsets (the launcher checks that x's size allows it): 64-bit
        # pointers held across the steps made the producer's registers spill.
        rows_0 = row0 + gl.arange(0, BLOCK_M, layout=chunk_rows)
        ok_0 = rows_0 < M
        off_0 = (gl.load(row_src_ptr + rows_0, mask=ok_0, other=0) - row_base) * stride_xm
        rows_1 = rows_0 + BLOCK_M
        ok_1 = rows_1 < M
        off_1 = (gl.load(row_src_ptr + rows_1, mask=ok_1, other=0) - row_base) * stride_xm
        gate_row = expert * 2 * I + col0  # W1 viewed as [E * 2I, H]
        for j in range(k_steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            k = j * BLOCK_K
            if SCALED:
                _cp_async(sa_bufs.index(s), sa_ptrs + j, mask=in_rows)
                _cp_async(sb_bufs.index(s), sb_ptrs + j)
            cols = k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, chunk_layout))
            in_cols = (cols < K)[None, :]
            _cp_async(a_bufs.index(2 * s), xq_ptr + (off_0[:, None] + cols[None, :]), mask=ok_0[:, None] & in_cols)
            _cp_async(a_bufs.index(2 * s + 1), xq_ptr + (off_1[:, None] + cols[None, :]), mask=ok_1[:, None] & in_cols)
            async_copy.mbarrier_arrive(bar)
            # Every producer warp has counted its copies on the barrier before one thread arms it.
            _partition_barrier()
            mbarrier.expect(bar, 2 * b_desc.block_type.nbytes)
            _tma_load(b_desc, [gate_row, k], bar, b_bufs.index(s).slice(0, BLOCK_N))
            _tma_load(b_desc, [gate_row + I, k], bar, b_bufs.index(s).slice(BLOCK_N, BLOCK_N))
            it += 1


@gluon.jit
def _promote(acc, a_tile, b_tile, scale, mma_layout: gl.constexpr):
    """acc + (A @ B^T) * scale[row]: one fresh wgmma, waited for (the Triton kernel's expression)."""
    BLOCK_M: gl.constexpr = a_tile.type.shape[0]
    BLOCK_N: gl.constexpr = b_tile.type.shape[0]
    tile = warpgroup_mma(
        a_tile,
        b_tile.permute((1, 0)),
        gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout),
        use_acc=False,
        is_async=True,
    )
    done = warpgroup_mma_wait(num_outstanding=0, deps=(tile,))
    return acc + done * scale[:, None]


@gluon.jit
def _fc1_step(
    acc_g, acc_u, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, it, mma_layout: gl.constexpr, HALF: gl.constexpr
):
    """One K step of half HALF: the gate product promoted, then the up product."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1] // 2
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    fence_async_shared()  # A was written by cp.async (the generic proxy); the wgmma reads it through the async one
    sa = sa_bufs.index(s).slice(HALF * BLOCK_M, BLOCK_M).load(row_layout)
    sg = sb_bufs.index(s).slice(0, BLOCK_M).load(row_layout)
    su = sb_bufs.index(s).slice(BLOCK_M, BLOCK_M).load(row_layout)
    a_tile = a_bufs.index(2 * s + HALF)
    acc_g = _promote(acc_g, a_tile, b_bufs.index(s).slice(0, BLOCK_N), sa * sg, mma_layout)
    acc_u = _promote(acc_u, a_tile, b_bufs.index(s).slice(BLOCK_N, BLOCK_N), sa * su, mma_layout)
    mbarrier.arrive(empty.index(s), count=1)
    return acc_g, acc_u


@gluon.jit
def _scale_from_amax(amax, POW2: gl.constexpr):
    """``quantize.scale_from_amax`` (the same operations, so the same bits)."""
    s = gl.maximum(amax / FP8_MAX, SMALLEST_NORMAL)
    s = gl.where(amax > 0.0, s, 1.0)
    if POW2:
        bits = s.to(gl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        exp = exp + ((bits & 0x7FFFFF) != 0).to(gl.int32)
        s = (exp << 23).to(gl.float32, bitcast=True)
    return s


@gluon.jit
def _clamp_gate_up(g, u, limit):
    """``kernels.activation.clamp_gate_up`` in Gluon (the same operations, so the same bits): min(g, limit) and
    clamp(u, -limit, limit), NaN kept."""
    g_c = gl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    u_c = gl.minimum(gl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    return g_c, u_c


@gluon.jit
def _store_rows(ptr, values, row0, col0, row_end, stride, store_layout: gl.constexpr):
    """values [R, C] at ptr[row0 + r, col0 + c] for rows before row_end, from a row-contiguous layout."""
    R: gl.constexpr = values.type.shape[0]
    C: gl.constexpr = values.type.shape[1]
    out = gl.convert_layout(values, store_layout)
    rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, store_layout))
    cols = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, store_layout))
    gl.store(ptr + rows.to(gl.int64)[:, None] * stride + cols[None, :], out, mask=(rows < row_end)[:, None])


@gluon.jit
def _store_halves(ptr, values, row0, col0, row_end, stride, store_layout: gl.constexpr):
    """values [R, C] (fp32, an MMA layout) in ptr's dtype at ptr[row0 + r, col0 + c], as two [R, C / 2] halves
    (``store_layout`` is a layout of one half)."""
    R: gl.constexpr = values.type.shape[0]
    C: gl.constexpr = values.type.shape[1]
    lo, hi = gl.split(gl.permute(gl.reshape(values, [R, 2, C // 2]), (0, 2, 1)))
    _store_rows(ptr, lo.to(ptr.dtype.element_ty), row0, col0, row_end, stride, store_layout)
    _store_rows(ptr, hi.to(ptr.dtype.element_ty), row0, col0 + C // 2, row_end, stride, store_layout)


@gluon.jit
def _fc1_mma_partition(
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    h_ptr,
    aq_ptr,
    as_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    I,
    K,
    stride_hm,
    stride_am,
    stride_asm,
    clamp_limit,
    SAVE_H: gl.constexpr,
    CLAMP: gl.constexpr,
    POW2: gl.constexpr,
    TILE_M: gl.constexpr,
    HALF: gl.constexpr,
):
    """Rows [HALF * 64, HALF * 64 + 64) of every tile of this program."""
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1] // 2  # columns of a (and of gate, of up) of a tile
    TILE_ROWS: gl.constexpr = 2 * BLOCK_M
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
    )
    h_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 16 // BLOCK_N, BLOCK_N // 16], [num_warps, 1], [1, 0])
    q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // BLOCK_N, BLOCK_N // 16], [num_warps, 1], [1, 0])
    s_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    n_groups = I // BLOCK_N
    k_steps = gl.cdiv(K, BLOCK_K)
    total = gl.load(num_tiles_ptr) * (TILE_M // TILE_ROWS) * n_groups
    programs = gl.num_programs(0)
    t0 = gl.minimum(gl.program_id(0), total - 1)
    row0, col0, row_end = _tile_with_end(
        t0, n_groups, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, TILE_ROWS, BLOCK_N, TILE_M, valid=total > 0
    )
    it = 0
    for t in range(gl.program_id(0), total, programs):
        row0_n, col0_n, row_end_n = _tile_with_end(
            gl.minimum(t + programs, total - 1),
            n_groups,
            tile_expert_ptr,
            tile_row_ptr,
            expert_offsets_ptr,
            TILE_ROWS,
            BLOCK_N,
            TILE_M,
        )
        gate = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        for _j in range(k_steps):
            gate, up = _fc1_step(gate, up, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, it, mma_layout, HALF)
            it += 1
        rows0 = row0 + HALF * BLOCK_M
        if SAVE_H:  # in 64-column halves (a thread holds column j and j + 64): fewer registers in flight
            _store_halves(h_ptr, gate, rows0, col0, row_end, stride_hm, h_layout)
            _store_halves(h_ptr, up, rows0, I + col0, row_end, stride_hm, h_layout)
        if CLAMP:  # after h is stored: the backward recomputes the clamp from it
            gate, up = _clamp_gate_up(gate, up, clamp_limit)
        act = gate * (1 / (1 + gl.exp(-gate))) * up  # tl.sigmoid's expression
        scale = _scale_from_amax(gl.max(gl.abs(act), axis=1), POW2)
        # (No clamp to +-FP8_MAX first: the conversion saturates, the same bits for every value but NaN.)
        y = (act * (1.0 / scale)[:, None]).to(gl.float8e4nv)
        _store_rows(aq_ptr, y, rows0, col0, row_end, stride_am, q_layout)
        scale_rows = rows0 + gl.arange(0, BLOCK_M, layout=s_layout)
        gl.store(
            as_ptr + scale_rows.to(gl.int64) * stride_asm + col0 // BLOCK_N,
            gl.convert_layout(scale, s_layout),
            mask=scale_rows < row_end,
        )
        row0, col0, row_end = row0_n, col0_n, row_end_n


@gluon.jit
def fp8_fc1_swiglu_ws_kernel(
    b_desc,
    xq_ptr,
    row_src_ptr,
    xs_ptr,
    ws_ptr,
    h_ptr,
    aq_ptr,
    as_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    M,
    I,
    K,
    UP_SCALE_OFF,
    stride_xm,
    stride_xsm,
    stride_wse,
    stride_wsn,
    stride_hm,
    stride_am,
    stride_asm,
    clamp_limit,
    SAVE_H: gl.constexpr,
    CLAMP: gl.constexpr,
    POW2: gl.constexpr,
    STAGES: gl.constexpr,
    TILE_M: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    MMA_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Two 4-warp MMA partitions (the default one and a worker with MMA_REGS registers) on the two 64-row halves of
    each tile, a LOAD_WARPS producer. Without SAVE_H ``h_ptr`` is not written."""
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[1]
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_K], gl.float8e4nv)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, BLOCK_K], gl.float8e4nv)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, 64, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2 * BLOCK_N, BLOCK_K], b_layout)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready, empty = _stage_barriers(STAGES, 2)
    gl.warp_specialize(
        [
            (
                _fc1_mma_partition,
                (
                    a_bufs,
                    b_bufs,
                    sa_bufs,
                    sb_bufs,
                    ready,
                    empty,
                    h_ptr,
                    aq_ptr,
                    as_ptr,
                    tile_expert_ptr,
                    tile_row_ptr,
                    num_tiles_ptr,
                    expert_offsets_ptr,
                    I,
                    K,
                    stride_hm,
                    stride_am,
                    stride_asm,
                    clamp_limit,
                    SAVE_H,
                    CLAMP,
                    POW2,
                    TILE_M,
                    0,
                ),
            ),
            (
                _fc1_mma_partition,
                (
                    a_bufs,
                    b_bufs,
                    sa_bufs,
                    sb_bufs,
                    ready,
                    empty,
                    h_ptr,
                    aq_ptr,
                    as_ptr,
                    tile_expert_ptr,
                    tile_row_ptr,
                    num_tiles_ptr,
                    expert_offsets_ptr,
                    I,
                    K,
                    stride_hm,
                    stride_am,
                    stride_asm,
                    clamp_limit,
                    SAVE_H,
                    CLAMP,
                    POW2,
                    TILE_M,
                    1,
                ),
            ),
            (
                _fc1_load_partition,
                (
                    b_desc,
                    a_bufs,
                    b_bufs,
                    sa_bufs,
                    sb_bufs,
                    ready,
                    empty,
                    xq_ptr,
                    row_src_ptr,
                    xs_ptr,
                    ws_ptr,
                    tile_expert_ptr,
                    tile_row_ptr,
                    num_tiles_ptr,
                    M,
                    I,
                    K,
                    stride_xm,
                    stride_xsm,
                    stride_wse,
                    stride_wsn,
                    UP_SCALE_OFF,
                    0,
                    TILE_M,
                    True,
                ),
            ),
        ],
        [4, LOAD_WARPS],
        [MMA_REGS, LOAD_REGS],
    )
