"""FC1 + SwiGLU on bf16 operands (``grouped_gemm.fc1_swiglu_kernel``'s math) as a warp-specialised, persistent
Hopper kernel (Gluon): the fp8 kernel of ``fp8_fc1_ws.py`` with its scales compiled out, the main loop of
``gemm_ws.py``'s unscaled GEMM.

``h = x[src - row_base] @ W1[e]^T`` (fp32 accumulation), ``a = silu(h[:, :I]) * h[:, I:]``; h and a stored in their
dtype (h only when the backward needs it).

- A tile is 128 sorted rows (two 64-row halves, one per MMA partition) and 128 columns of a: gate columns
  [c, c + 128) and the up columns I further. Each stage holds A's 128 rows once (gathered by the producer's cp.async
  copies, 16 bytes a thread) and W1's gate box and up box (TMA), K steps of 64 (128 bytes of a row).
- Each step of an MMA partition issues the gate and the up wgmma into their fp32 accumulators and waits for the step
  before's only (``gemm_ws._plain_step``), so the tensor cores always have the next step.
- Epilogue: h's gate and up parts stored from registers in 64-column halves, then a = silu(gate) * up (CLAMP:
  silu(min(gate, c)) * clamp(up, -c, c), c = clamp_limit; ``kernels/activation.py``), stored in a's dtype. Rows
  past the tile's expert are not stored.

Requirements (the launcher checks them): I a multiple of 128, x's row stride a multiple of 16 elements (16-byte
pieces of its rows, which Triton proves from the stride's specialisation), x addressed by 32-bit offsets. The same
bits as the Triton kernel; opt-in (``launch.fc1_swiglu(use_ws=True)``): on one H200 it was no faster where the layer
spends most (``ops/bf16_ws_launch.py`` has the figures). Gluon kernels have no interpreter: tested on the GPU
against the Triton kernel and float64, and compiled for sm_90 on the CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fp8_fc1_ws import _clamp_gate_up, _fc1_load_partition, _store_halves, _store_rows
from .gemm_ws import _plain_tile, _stage_barriers, _tile_with_end


@gluon.jit
def _bf16_fc1_mma_partition(
    a_bufs,
    b_bufs,
    ready,
    empty,
    h_ptr,
    a_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    I,
    K,
    stride_hm,
    stride_am,
    clamp_limit,
    SAVE_H: gl.constexpr,
    CLAMP: gl.constexpr,
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
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    # 16 bytes a thread, whole rows a warp: h in 64-column halves, a in 128 columns.
    h_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 16 // BLOCK_N, BLOCK_N // 16], [num_warps, 1], [1, 0])
    a_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [num_warps, 1], [1, 0])
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
        # The stage's B box: the gate rows, then the up rows (SUBS = 2 parts of BLOCK_N, K-major).
        gate, up, it = _plain_tile(gate, up, a_bufs, b_bufs, ready, empty, it, k_steps, HALF, 2, True, 2, True)
        rows0 = row0 + HALF * BLOCK_M
        if SAVE_H:  # in 64-column halves (a thread holds column j and j + 64): fewer registers in flight
            _store_halves(h_ptr, gate, rows0, col0, row_end, stride_hm, h_layout)
            _store_halves(h_ptr, up, rows0, I + col0, row_end, stride_hm, h_layout)
        if CLAMP:  # after h is stored: the backward recomputes the clamp from it
            gate, up = _clamp_gate_up(gate, up, clamp_limit)
        act = gate * (1 / (1 + gl.exp(-gate))) * up  # tl.sigmoid's expression
        _store_rows(a_ptr, act.to(a_ptr.dtype.element_ty), rows0, col0, row_end, stride_am, a_layout)
        row0, col0, row_end = row0_n, col0_n, row_end_n


@gluon.jit
def bf16_fc1_swiglu_ws_kernel(
    b_desc,
    x_ptr,
    row_src_ptr,
    h_ptr,
    a_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    M,
    I,
    K,
    row_base,
    stride_xm,
    stride_hm,
    stride_am,
    clamp_limit,
    SAVE_H: gl.constexpr,
    CLAMP: gl.constexpr,
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
    dtype: gl.constexpr = b_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_K], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, BLOCK_K], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, 64, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], b_layout)
    ready, empty = _stage_barriers(STAGES, 2)
    gl.warp_specialize(
        [
            (
                _bf16_fc1_mma_partition,
                (
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    h_ptr,
                    a_ptr,
                    tile_expert_ptr,
                    tile_row_ptr,
                    num_tiles_ptr,
                    expert_offsets_ptr,
                    I,
                    K,
                    stride_hm,
                    stride_am,
                    clamp_limit,
                    SAVE_H,
                    CLAMP,
                    TILE_M,
                    0,
                ),
            ),
            (
                _bf16_fc1_mma_partition,
                (
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    h_ptr,
                    a_ptr,
                    tile_expert_ptr,
                    tile_row_ptr,
                    num_tiles_ptr,
                    expert_offsets_ptr,
                    I,
                    K,
                    stride_hm,
                    stride_am,
                    clamp_limit,
                    SAVE_H,
                    CLAMP,
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
                    a_bufs,  # no scales: A's buffers stand in for the scale buffers (not used)
                    a_bufs,
                    ready,
                    empty,
                    x_ptr,
                    row_src_ptr,
                    x_ptr,  # no scales: x stands in for the scale pointers (not read)
                    x_ptr,
                    tile_expert_ptr,
                    tile_row_ptr,
                    num_tiles_ptr,
                    M,
                    I,
                    K,
                    stride_xm,
                    0,
                    0,
                    0,
                    0,
                    row_base,
                    TILE_M,
                    False,
                ),
            ),
        ],
        [4, LOAD_WARPS],
        [MMA_REGS, LOAD_REGS],
    )
