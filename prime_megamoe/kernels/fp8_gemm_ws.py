"""The row-tiled fp8 grouped GEMM of ``fp8_gemm.py`` as a warp-specialised, persistent Hopper kernel (Gluon).

Same math and operands as ``fp8_grouped_gemm_kernel`` with MX = False: ``C[r] = scale[r] * A[r] @ B[e]^T``, A the
expert-sorted rows [P, SEGS * K] (fp8, one fp32 scale per row and 128 columns), B the K-major weights viewed as
[E * N, SEGS * K] (fp8, one fp32 scale per 128 x 128 block), fp32 accumulation promoted every 128 products.

Why a second kernel: in the Triton kernel every 128-wide K step waits for its own MMA before it scales the partial
product and adds it (Triton places ``wgmma.wait_group 0`` right after each step's MMAs), so within a warp group the
promotion never overlaps the tensor cores. Here the promotion of step j runs while the MMA of step j + 1 is in
flight (``warpgroup_mma_wait(num_outstanding=1)``), and the loads come from a producer warp of their own:

- the producer partition (1 warp) walks the program's persistent tile sequence and issues the TMA copies of A and B
  into rings of ``STAGES`` shared-memory buffers, each guarded by a ``ready`` / ``empty`` mbarrier pair;
- the MMA partitions issue the wgmma of each step asynchronously into a fresh fp32 tile, wait for the previous
  step's, free that step's buffers, then scale and add it; after the last step they apply the row scale and store
  the tile with a row mask (an expert's rows end inside a tile, so a TMA store would overwrite the next expert's
  rows). ``CONSUMERS`` = 1: one 8-warp partition (two warp groups, 64 rows each) per 128-row tile. ``CONSUMERS`` =
  2 (ping-pong): two 4-warp partitions take alternate 64-row tiles from rings of their own, so one's promotion and
  epilogue run while the other's MMAs do.

Tiles are numbered row tile major, column tile minor (as the Triton kernel's grid), and program p takes tiles p,
p + programs, ...; both partitions walk that sequence. Requirements (the launcher checks them): BLOCK_K = 128 = the
scale group, BLOCK_N <= 128 dividing 128 (one weight scale per step), and with SEGS = 2 each segment's K a multiple
of 128 (a box must not run into the next segment). Gluon kernels have no interpreter: this one is tested on the GPU
against the Triton kernel and compiled for sm_90 on the CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# The TMA load was renamed between Triton releases (async_copy_global_to_shared -> async_load, same arguments).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _tile_of(t, n_col_tiles, tile_expert_ptr, tile_row_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             TILE_M: gl.constexpr):
    """Expert, first row and first column of persistent tile t (a BLOCK_M part of a TILE_M row tile)."""
    PARTS: gl.constexpr = TILE_M // BLOCK_M
    part_tile = t // n_col_tiles
    row_tile = part_tile // PARTS
    row0 = gl.load(tile_row_ptr + row_tile) + (part_tile % PARTS) * BLOCK_M
    return gl.load(tile_expert_ptr + row_tile), row0, (t % n_col_tiles) * BLOCK_N


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, num_tiles_ptr,
                    N, K, SEGS: gl.constexpr, CONSUMERS: gl.constexpr, TILE_M: gl.constexpr):
    """Producer: every tile of this program in order; tile i goes to consumer i % CONSUMERS's ring of buffers."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0] // CONSUMERS
    n_col_tiles = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    n_steps = SEGS * k_steps
    total = gl.load(num_tiles_ptr) * (TILE_M // BLOCK_M) * n_col_tiles
    i = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, row0, col0 = _tile_of(t, n_col_tiles, tile_expert_ptr, tile_row_ptr, BLOCK_M, BLOCK_N, TILE_M)
        ring = i % CONSUMERS
        it = (i // CONSUMERS) * n_steps  # steps this ring has carried before this tile
        for j in range(n_steps):
            s = ring * STAGES + it % STAGES
            # A buffer is free once the MMA that read it is done; a fresh mbarrier counts as phase 1 done.
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            k = (j // k_steps) * K + (j % k_steps) * BLOCK_K
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [row0, k], bar, a_bufs.index(s))
            _tma_load(b_desc, [expert * N + col0, k], bar, b_bufs.index(s))
            it += 1
        i += 1


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, row_scale_ptr,
                   tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr,
                   N, K, NKG, stride_asm, stride_bse, stride_bsn, stride_cm,
                   SEGS: gl.constexpr, SCALE_ROWS: gl.constexpr, B_GROUP_N: gl.constexpr, CONSUMERS: gl.constexpr,
                   TILE_M: gl.constexpr, CONSUMER: gl.constexpr):
    """Consumer CONSUMER: tiles CONSUMER, CONSUMER + CONSUMERS, ... of this program, from its ring of buffers."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0] // CONSUMERS
    # One warp group per 64 rows; fp8 wgmma takes K = 32 per instruction.
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    n_col_tiles = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    n_steps = SEGS * k_steps
    total = gl.load(num_tiles_ptr) * (TILE_M // BLOCK_M) * n_col_tiles
    programs = gl.num_programs(0)
    it = 0
    for t in range(gl.program_id(0) + CONSUMER * programs, total, CONSUMERS * programs):
        expert, row0, col0 = _tile_of(t, n_col_tiles, tile_expert_ptr, tile_row_ptr, BLOCK_M, BLOCK_N, TILE_M)
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
        row_mask = rows < gl.load(expert_offsets_ptr + expert + 1)
        sa_ptrs = as_ptr + rows.to(gl.int64) * stride_asm
        sb_ptr = bs_ptr + expert.to(gl.int64) * stride_bse + (col0 // B_GROUP_N) * stride_bsn
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)

        # Step 0: issue its MMA; its promotion happens once step 1's MMA is in flight.
        s = CONSUMER * STAGES + it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        prev = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)),
                             gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout), use_acc=False, is_async=True)
        prev_scale = gl.load(sa_ptrs, mask=row_mask, other=0.0) * gl.load(sb_ptr)
        prev_s = s
        it += 1
        for j in range(1, n_steps):
            s = CONSUMER * STAGES + it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            cur = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)),
                                gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout), use_acc=False, is_async=True)
            kg = (j // k_steps) * NKG + j % k_steps
            cur_scale = gl.load(sa_ptrs + kg, mask=row_mask, other=0.0) * gl.load(sb_ptr + kg)
            # Step j - 1 is done (step j may still run): free its buffers, promote its product.
            prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev, ))
            mbarrier.arrive(empty.index(prev_s), count=1)
            acc += prev * prev_scale[:, None]
            prev, prev_scale, prev_s = cur, cur_scale, s
            it += 1
        prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev, ))
        mbarrier.arrive(empty.index(prev_s), count=1)
        acc += prev * prev_scale[:, None]

        if SCALE_ROWS:
            acc = acc * gl.load(row_scale_ptr + rows, mask=row_mask, other=0.0).to(gl.float32)[:, None]
        cols = col0 + gl.arange(0, BLOCK_N, layout=col_layout)
        c_ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
        gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols < N)[None, :])


@gluon.jit
def fp8_grouped_gemm_ws_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, c_ptr, row_scale_ptr,
    tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr,
    N, K, NKG, stride_asm, stride_bse, stride_bsn, stride_cm,
    SEGS: gl.constexpr, SCALE_ROWS: gl.constexpr, B_GROUP_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, TILE_M: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """CONSUMERS = 1: the default partition (num_warps = 8, two warp groups) computes every 128-row tile.
    CONSUMERS = 2 (ping-pong): the default partition (num_warps = 4) and a 4-warp worker take alternate 64-row tiles,
    each with its own ring of STAGES buffers, so one's promotion and epilogue overlap the other's MMAs."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [CONSUMERS * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [CONSUMERS * STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS * STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS * STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    load_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, num_tiles_ptr,
                 N, K, SEGS, CONSUMERS, TILE_M)
    first = (a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, row_scale_ptr,
             tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr,
             N, K, NKG, stride_asm, stride_bse, stride_bsn, stride_cm, SEGS, SCALE_ROWS, B_GROUP_N, CONSUMERS,
             TILE_M, FIRST)
    if CONSUMERS == 1:
        gl.warp_specialize([(_mma_partition, first), (_load_partition, load_args)], [1], [LOAD_REGS])
    else:
        second = (a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, row_scale_ptr,
                  tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr,
                  N, K, NKG, stride_asm, stride_bse, stride_bsn, stride_cm, SEGS, SCALE_ROWS, B_GROUP_N, CONSUMERS,
                  TILE_M, SECOND)
        gl.warp_specialize([(_mma_partition, first), (_mma_partition, second), (_load_partition, load_args)],
                           [4, 1], [MMA_REGS, LOAD_REGS])
