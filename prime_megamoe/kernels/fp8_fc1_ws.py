"""FC1 + SwiGLU of ``fp8_gemm.py`` (``fp8_fc1_swiglu_kernel`` with MX = False) as a warp-specialised, persistent
Hopper kernel (Gluon), built from the parts of ``fp8_gemm_ws.py``.

``h = x[src] @ W1[e]^T`` (fp8 operands, fp32 accumulation promoted every 128 products, the Triton kernel's
expression), ``a = silu(h[:, :I]) * h[:, I:]``; h is stored in its dtype (when the backward needs it) and a in fp8
with one scale per row and 128 columns, as the Triton kernel stores them.

- A tile is 128 sorted rows (two 64-row halves, one per MMA partition) and one 128-column scale group of a. It runs
  as two sub-tiles of 64 columns of a each; each step's B stage holds 64 gate rows of W1 and the 64 up rows I
  further (two TMA boxes into the two halves of a 128-row buffer), so one 64 x 128 wgmma gives gate and up side by
  side, promoted with A's row scales and the gate / up block scales (a column vector staged by the producer).
- The producer (4 warps) gathers A's rows by cp.async as the gathering GEMM does, the scales by cp.async, the two
  B boxes by TMA, all counted on the stage's ready barrier.
- The epilogue of a sub-tile splits the accumulator into gate and up (register-local: a thread holds column j and
  j + 64 of the MMA layout), stores h, and computes a; the first sub-tile's a stays in registers until the second's
  is known, then the 128-column group is quantised (amax over both) and stored with its scale.

Requirements (the launcher checks them): the fp8 format (128 x 128 weight blocks, 1 x 128 activation groups), I a
multiple of 128, H a multiple of 16 (16-byte row pieces of x).

Measured (Qwen3-30B-A3B, T = 16384, one H200; ``benchmarks/results/fp8_probe_s14.txt``, runs 5 and 6): the same
bits as the Triton kernel (h, a and its scales), but 1.285 ms against 1.163, so the layer keeps the Triton kernel.
Nsight Compute puts its L1/TEX throughput at 77% (the Triton kernel's 43%): x's rows are gathered by cp.async once
per sub-tile, twice per tile, and h and a leave from registers. What would lift it: one gather per tile (a stage
with A once and both sub-tiles' B, which needs the registers of two accumulators) and TMA stores of h.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .fp8_gemm_ws import _cp_async, _partition_barrier, _tile_of, _tma_load

FP8_MAX = gl.constexpr(448.0)
SMALLEST_NORMAL = gl.constexpr(1.1754943508222875e-38)


@gluon.jit
def _fc1_load_partition(b_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, xq_ptr, row_src_ptr, xs_ptr,
                        ws_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, M, I, K, stride_xm, stride_xsm,
                        stride_wse, stride_wsn, UP_SCALE_OFF, TILE_M: gl.constexpr):
    """Fills each stage: A's rows gathered (cp.async, 16 bytes a thread), the gate and up boxes of W1 (TMA), A's
    row scales and the step's gate / up block scales, one per column of the stage's B (cp.async)."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]  # rows of one MMA partition
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    HALF_N: gl.constexpr = b_desc.block_type.shape[0]  # gate (or up) rows of one step
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    TILE_ROWS: gl.constexpr = 2 * BLOCK_M
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    chunk_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // BLOCK_K, BLOCK_K // 16], [gl.num_warps(), 1],
                                                  [1, 0])
    chunk_rows: gl.constexpr = gl.SliceLayout(1, chunk_layout)
    n_groups = I // (2 * HALF_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    total = gl.load(num_tiles_ptr) * (TILE_M // TILE_ROWS) * n_groups
    cols_sb = gl.arange(0, 2 * HALF_N, layout=row_layout)
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, row0, col0 = _tile_of(t, n_groups, tile_expert_ptr, tile_row_ptr, TILE_ROWS, 2 * HALF_N, TILE_M)
        rows = row0 + gl.arange(0, TILE_ROWS, layout=row_layout)
        in_rows = rows < M
        sa_ptrs = xs_ptr + gl.load(row_src_ptr + rows, mask=in_rows, other=0).to(gl.int64) * stride_xsm
        rows_0 = row0 + gl.arange(0, BLOCK_M, layout=chunk_rows)
        ok_0 = rows_0 < M
        base_0 = xq_ptr + gl.load(row_src_ptr + rows_0, mask=ok_0, other=0).to(gl.int64) * stride_xm
        rows_1 = rows_0 + BLOCK_M
        ok_1 = rows_1 < M
        base_1 = xq_ptr + gl.load(row_src_ptr + rows_1, mask=ok_1, other=0).to(gl.int64) * stride_xm
        # The group's gate block scale for the stage's first HALF_N columns, its up block scale for the rest.
        group = col0 // (2 * HALF_N)
        sb_ptrs = (ws_ptr + expert.to(gl.int64) * stride_wse
                   + gl.where(cols_sb < HALF_N, group, UP_SCALE_OFF + group) * stride_wsn)
        for sub in gl.static_range(2):
            gate_row = expert * 2 * I + col0 + sub * HALF_N  # W1 viewed as [E * 2I, H]
            for j in range(k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                k = j * BLOCK_K
                _cp_async(sa_bufs.index(s), sa_ptrs + j, mask=in_rows)
                _cp_async(sb_bufs.index(s), sb_ptrs + j)
                cols = k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, chunk_layout))
                in_cols = (cols < K)[None, :]
                _cp_async(a_bufs.index(2 * s), base_0[:, None] + cols[None, :], mask=ok_0[:, None] & in_cols)
                _cp_async(a_bufs.index(2 * s + 1), base_1[:, None] + cols[None, :], mask=ok_1[:, None] & in_cols)
                async_copy.mbarrier_arrive(bar)
                # Every producer warp has counted its copies on the barrier before one thread arms it.
                _partition_barrier()
                mbarrier.expect(bar, 2 * b_desc.block_type.nbytes)
                _tma_load(b_desc, [gate_row, k], bar, b_bufs.index(s).slice(0, HALF_N))
                _tma_load(b_desc, [gate_row + I, k], bar, b_bufs.index(s).slice(HALF_N, HALF_N))
                it += 1


@gluon.jit
def _fc1_step(acc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, it, mma_layout: gl.constexpr,
              HALF: gl.constexpr):
    """One K step of half HALF: gate and up in one wgmma, promoted with the row and column scales."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    fence_async_shared()  # A was written by cp.async (the generic proxy); the wgmma reads it through the async one
    tile = warpgroup_mma(a_bufs.index(2 * s + HALF), b_bufs.index(s).permute((1, 0)),
                         gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout), use_acc=False, is_async=True)
    sa = sa_bufs.index(s).slice(HALF * BLOCK_M, BLOCK_M).load(gl.SliceLayout(1, mma_layout))
    sb = sb_bufs.index(s).load(gl.SliceLayout(0, mma_layout))
    done = warpgroup_mma_wait(num_outstanding=0, deps=(tile, ))
    mbarrier.arrive(empty.index(s), count=1)
    return acc + done * (sa[:, None] * sb[None, :])


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
def _store_rows(ptr, values, row0, col0, row_end, stride, store_layout: gl.constexpr):
    """values [R, C] at ptr[row0 + r, col0 + c] for rows before row_end, from a row-contiguous layout."""
    R: gl.constexpr = values.type.shape[0]
    C: gl.constexpr = values.type.shape[1]
    out = gl.convert_layout(values, store_layout)
    rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, store_layout))
    cols = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, store_layout))
    gl.store(ptr + rows.to(gl.int64)[:, None] * stride + cols[None, :], out, mask=(rows < row_end)[:, None])


@gluon.jit
def _fc1_mma_partition(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, act_smem, h_ptr, aq_ptr, as_ptr,
                       tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr, I, K, stride_hm, stride_am,
                       stride_asm,
                       SAVE_H: gl.constexpr, POW2: gl.constexpr, TILE_M: gl.constexpr, HALF: gl.constexpr):
    """Rows [HALF * 64, HALF * 64 + 64) of every tile of this program."""
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]  # gate + up columns of one sub-tile
    HALF_N: gl.constexpr = BLOCK_N // 2
    TILE_ROWS: gl.constexpr = 2 * BLOCK_M
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    h_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HALF_N, HALF_N // 8], [num_warps, 1], [1, 0])
    q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // HALF_N, HALF_N // 16], [num_warps, 1], [1, 0])
    s_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    n_groups = I // BLOCK_N
    k_steps = gl.cdiv(K, BLOCK_K)
    total = gl.load(num_tiles_ptr) * (TILE_M // TILE_ROWS) * n_groups
    programs = gl.num_programs(0)
    t0 = gl.minimum(gl.program_id(0), total - 1)
    expert, row0, col0 = _tile_of(t0, n_groups, tile_expert_ptr, tile_row_ptr, TILE_ROWS, BLOCK_N, TILE_M,
                                  valid=total > 0)
    row_end = gl.load(expert_offsets_ptr + expert + 1)
    it = 0
    for t in range(gl.program_id(0), total, programs):
        expert_n, row0_n, col0_n = _tile_of(gl.minimum(t + programs, total - 1), n_groups, tile_expert_ptr,
                                            tile_row_ptr, TILE_ROWS, BLOCK_N, TILE_M)
        row_end_n = gl.load(expert_offsets_ptr + expert_n + 1)
        rows0 = row0 + HALF * BLOCK_M
        for sub in gl.static_range(2):
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            for j in range(k_steps):
                acc = _fc1_step(acc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, it, mma_layout, HALF)
                it += 1
            # Gate (columns [0, HALF_N)) and up: column j and j + HALF_N sit in the same thread.
            gate, up = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, HALF_N]), (0, 2, 1)))
            a_col = col0 + sub * HALF_N
            if SAVE_H:
                _store_rows(h_ptr, gate.to(h_ptr.dtype.element_ty), rows0, a_col, row_end, stride_hm, h_layout)
                _store_rows(h_ptr, up.to(h_ptr.dtype.element_ty), rows0, I + a_col, row_end, stride_hm, h_layout)
            act = gate * (1 / (1 + gl.exp(-gate))) * up  # tl.sigmoid's expression
            amax = gl.max(gl.abs(act), axis=1)
            if sub == 0:  # kept in shared memory while the second sub-tile runs (registers are short there)
                act_smem.store(act)
                amax_0 = amax
        scale = _scale_from_amax(gl.maximum(amax_0, amax), POW2)
        inv = (1.0 / scale)[:, None]
        for sub in gl.static_range(2):
            y = (act_smem.load(act.type.layout) if sub == 0 else act) * inv
            y = gl.minimum(gl.maximum(y, -FP8_MAX), FP8_MAX)
            _store_rows(aq_ptr, y.to(gl.float8e4nv), rows0, col0 + sub * HALF_N, row_end, stride_am, q_layout)
        scale_rows = rows0 + gl.arange(0, BLOCK_M, layout=s_layout)
        gl.store(as_ptr + scale_rows.to(gl.int64) * stride_asm + col0 // BLOCK_N, gl.convert_layout(scale, s_layout),
                 mask=scale_rows < row_end)
        expert, row0, col0, row_end = expert_n, row0_n, col0_n, row_end_n


@gluon.jit
def fp8_fc1_swiglu_ws_kernel(
    b_desc, xq_ptr, row_src_ptr, xs_ptr, ws_ptr, h_ptr, aq_ptr, as_ptr,
    tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr,
    M, I, K, UP_SCALE_OFF, stride_xm, stride_xsm, stride_wse, stride_wsn, stride_hm, stride_am, stride_asm,
    SAVE_H: gl.constexpr, POW2: gl.constexpr, STAGES: gl.constexpr, TILE_M: gl.constexpr,
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Two 4-warp MMA partitions (the default one and a worker with MMA_REGS registers) on the two 64-row halves of
    each tile, a LOAD_WARPS producer. Without SAVE_H ``h_ptr`` is not written."""
    HALF_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[1]
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_K], gl.float8e4nv)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * HALF_N, BLOCK_K], gl.float8e4nv)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, 64, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2 * HALF_N, BLOCK_K], b_layout)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 2 * HALF_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    # Each MMA partition's a of a tile's first sub-tile (64 x 64 fp32).
    act_smem = gl.allocate_shared_memory(gl.float32, [2, 64, HALF_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    gl.warp_specialize([
        (_fc1_mma_partition, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, act_smem.index(0), h_ptr, aq_ptr,
                              as_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr, I, K,
                              stride_hm, stride_am, stride_asm, SAVE_H, POW2, TILE_M, 0)),
        (_fc1_mma_partition, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, act_smem.index(1), h_ptr, aq_ptr,
                              as_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr, I, K,
                              stride_hm, stride_am, stride_asm, SAVE_H, POW2, TILE_M, 1)),
        (_fc1_load_partition, (b_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, xq_ptr, row_src_ptr, xs_ptr,
                               ws_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, M, I, K, stride_xm, stride_xsm,
                               stride_wse, stride_wsn, UP_SCALE_OFF, TILE_M)),
    ], [4, LOAD_WARPS], [MMA_REGS, LOAD_REGS])
