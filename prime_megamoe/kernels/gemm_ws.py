"""The row-tiled fp8 grouped GEMM of ``fp8_gemm.py`` as a warp-specialised, persistent Hopper kernel (Gluon), and
the same kernel on bf16 operands (SCALED = False, below).

Same math and operands as ``fp8_grouped_gemm_kernel`` with MX = False: ``C[r] = scale[r] * A[r] @ B[e]^T``, A the
expert-sorted rows [P, SEGS * K] (fp8, one fp32 scale per row and 128 columns), B the K-major weights viewed as
[E * N, SEGS * K] (fp8, one fp32 scale per 128 x 128 block), fp32 accumulation promoted every 128 products.

Why a second kernel: the Triton kernel's programs load their own operands and stall on each step's MMA before they
scale its product; only other programs on the SM fill that time. Here the loads come from a producer warp of their
own, and the MMA warp groups only compute:

- the producer partition (1 warp) walks the program's persistent tile sequence and fills a ring of ``STAGES``
  shared-memory stages, each guarded by a ``ready`` / ``empty`` mbarrier pair: the TMA copies of A and B, and the
  step's scales (A's per row, B's block scale copied for every row) by asynchronous copies (cp.async) that the
  stage's ready barrier also waits for, so neither the producer nor the MMA warps ever wait on a global load;
- the MMA partition(s) (``num_warps`` / 4 warp groups, 64 rows each) issue each step's wgmma into a fresh fp32 tile,
  read the step's scales from the stage, wait for the wgmma, free the stage, then scale and add the product; after
  the last step they apply the row scale and store the tile: by TMA (through shared memory, not waited for) where
  the part of the tile holds only its expert's rows, else from a row-contiguous layout with a row mask (an expert's
  rows end inside a tile, and a box would overwrite the next expert's rows).

Waiting for step j - 1 only, with step j in flight, would overlap the promotion with the tensor cores inside a warp
group, but ptxas then serialises every wgmma of the kernel (its C7514 / C7515 notes: a wgmma's accumulator
registers are read or written while another wgmma runs), which cost more than it saves; so the overlap comes from
the other MMA partition (HALVES = 2, the layer's config), the other warp group, or the other program on the SM
(64-row tiles). The next tile's indices and row scales are loaded while this tile's MMAs run.

SUBS = 2 (every row-tiled GEMM of the layer): 256-column tiles, each MMA partition computing its rows' two
128-column parts in turn (one accumulator each, one fresh tile live at a time), each part's weight-block scale staged
by the producer; each A box is read once per 256 output columns. FC2 0.465 ms against 0.485, the FC1 dgrad 0.802
against 0.845 (``scripts/fp8_probe.py --ws-only``), the gathering FC2 dgrad 0.448-0.455 against 0.482-0.537 on
three machines (0.474 against 0.476 on a fourth), same bits. ptxas keeps a few loop scalars on the stack in this form
(24-40 bytes, one local load a step).

GATHER (the FC2 dgrad's dy, FC1's x: A's rows are the plan's source rows): TMA cannot gather on Hopper, so four
producer warps copy A's rows by cp.async into the swizzled stage (16 bytes a thread), and the MMA warps fence the
async proxy before their wgmma reads them. The layer's FC2 dgrad runs it: 0.490 ms against 0.542 for the Triton
kernel's gather (``scripts/fp8_probe.py --ws-only``, same bits).

Tiles are numbered row tile major, column tile minor (as the Triton kernel's grid), and program p takes tiles p,
p + programs, ...; all partitions walk that sequence. Requirements (the launcher checks them): BLOCK_K = 128 = the
scale group, column parts of 128 (one weight scale per part and step), and with SEGS = 2 each segment's K a multiple
of 128 (a box must not run into the next segment). Gluon kernels have no interpreter: this one is tested on the GPU
against the Triton kernel and compiled for sm_90 on the CPU.

SCALED = False (bf16 operands, ``ops/bf16_ws_launch.py``): no scales are staged or read, the products accumulate in
the wgmma's own fp32 accumulators (``_plain_tile``: step j issued before step j - 1's stage is freed), K steps of 64
(128 bytes, the boxes' swizzle width), and B may be read N-major (B_KMAJOR = False: boxes [BLOCK_K, BLOCK_N] of the
weights viewed as [E * K, N], one segment, K a whole number of steps) as the bf16 dgrads read W1 and W2.

Measured (Qwen3-30B-A3B, T = 16384, one H200, ``scripts/fp8_probe.py --ws-only``, the same bits as the Triton
kernel; ``scripts/fp8_probe.py --ws-only``), the layer's config (two 4-warp MMA partitions on the halves of
each 128-row tile, TMA stores): FC2 0.468-0.483 ms against 0.576-0.580 for the Triton kernel, the FC1 dgrad
0.847-0.858 against 1.063-1.070. How it got there, FC2:
one two-warp-group partition 0.593; two partitions on the halves 0.543-0.559; TMA stores 0.522; scales staged by
the producer 0.481 (the MMA warps had waited at each step's end for global loads of the next step's scales);
staged by cp.async 0.468. Tried and dropped: two 4-warp MMA partitions on alternate tiles (ping-pong, 0.72: their
main loops must take turns); the second half issuing each step after the first (no gain); 5 stages (no gain).
Also dropped (bf16, T = 2048 and 4096): a partition passing over a tile whose 64-row half holds none of its expert's
rows (the stages freed without an MMA, so the other half had the tensor cores alone) was no faster, and the FC1
dgrad's 256-column config 9% slower (``benchmarks/results/bf16_ws_empty_half_h200.txt``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# The TMA copies were renamed between Triton releases (async_copy_global_to_shared -> async_load,
# async_copy_shared_to_global -> async_store, same arguments).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
# The per-thread async copy (cp.async) was renamed too (async_copy_global_to_shared -> async_load).
_cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
# A barrier over the partition's warps (renamed thread_barrier -> barrier).
_partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def _tile_of(
    t,
    n_col_tiles,
    tile_expert_ptr,
    tile_row_ptr,
    TILE_ROWS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    TILE_M: gl.constexpr,
    valid=True,
):
    """Expert, first row and first column of persistent tile t: a TILE_ROWS part of one of the plan's TILE_M-row
    tiles and a BLOCK_N column block. ``valid`` False: no load (zeros). (The Gluon twin of ``grouped_gemm.tile_span``,
    which a Gluon kernel cannot call.)"""
    PARTS: gl.constexpr = TILE_M // TILE_ROWS
    part = t // n_col_tiles
    row_tile = part // PARTS
    expert = gl.load(tile_expert_ptr + row_tile, mask=valid, other=0)
    row0 = gl.load(tile_row_ptr + row_tile, mask=valid, other=0) + (part % PARTS) * TILE_ROWS
    return expert, row0, (t % n_col_tiles) * BLOCK_N


@gluon.jit
def _tile_with_end(
    t,
    n_col_tiles,
    tile_expert_ptr,
    tile_row_ptr,
    expert_offsets_ptr,
    TILE_ROWS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    TILE_M: gl.constexpr,
    valid=True,
):
    """First row and first column of persistent tile t (``_tile_of``), and the end of its expert's rows: what an
    MMA partition needs to store the tile."""
    expert, row0, col0 = _tile_of(t, n_col_tiles, tile_expert_ptr, tile_row_ptr, TILE_ROWS, BLOCK_N, TILE_M, valid)
    return row0, col0, gl.load(expert_offsets_ptr + expert + 1)


@gluon.jit
def _load_partition(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    a_ptr,
    row_src_ptr,
    as_ptr,
    bs_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    M,
    N,
    K,
    NKG,
    stride_am,
    stride_asm,
    stride_bse,
    stride_bsn,
    SEGS: gl.constexpr,
    B_GROUP_N: gl.constexpr,
    TILE_M: gl.constexpr,
    HALVES: gl.constexpr,
    GATHER: gl.constexpr,
    SUBS: gl.constexpr,
    SCALED: gl.constexpr,
    B_KMAJOR: gl.constexpr,
):
    """Fills each stage: A (HALVES boxes of rows: TMA copies, or with GATHER the rows row_src[r] of A copied by
    cp.async in 16-byte pieces, as TMA cannot gather on Hopper), B by TMA, and the step's scales (A's, one per row
    of the tile, and B's block scale, copied for every row) by cp.async. The stage's ready barrier waits for all of
    it; the producer never waits for a load itself, except each tile's source row indices (GATHER). Unscaled
    (bf16) operands have no scales to copy; B_KMAJOR False: B's boxes are [BLOCK_K, BLOCK_N] of weights viewed as
    [E * K, N]."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]  # rows of one MMA partition's A box
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0 if B_KMAJOR else 1]  # the tile's columns: SUBS parts of SUB_N
    SUB_N: gl.constexpr = BLOCK_N // SUBS
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    TILE_ROWS: gl.constexpr = HALVES * BLOCK_M
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    # A gathered: 16 bytes (VEC elements) a thread, a row's 128 bytes over 8 threads.
    VEC: gl.constexpr = 128 // a_desc.dtype.primitive_bitwidth
    chunk_layout: gl.constexpr = gl.BlockedLayout(
        [1, VEC], [32 * VEC // BLOCK_K, BLOCK_K // VEC], [gl.num_warps(), 1], [1, 0]
    )
    chunk_rows: gl.constexpr = gl.SliceLayout(1, chunk_layout)
    n_col_tiles = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    total = gl.load(num_tiles_ptr) * (TILE_M // TILE_ROWS) * n_col_tiles
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, row0, col0 = _tile_of(t, n_col_tiles, tile_expert_ptr, tile_row_ptr, TILE_ROWS, BLOCK_N, TILE_M)
        # Rows past the expert's end read other rows' scales (only outputs that are not stored meet them); rows
        # past A's end read nothing (zeros).
        rows = row0 + gl.arange(0, TILE_ROWS, layout=row_layout)
        in_rows = rows < M
        if GATHER:
            sa_ptrs = as_ptr + gl.load(row_src_ptr + rows, mask=in_rows, other=0).to(gl.int64) * stride_asm
            # Each half's source rows, in the layout of its copies (a second half only when HALVES = 2).
            rows_0 = row0 + gl.arange(0, BLOCK_M, layout=chunk_rows)
            ok_0 = rows_0 < M
            base_0 = a_ptr + gl.load(row_src_ptr + rows_0, mask=ok_0, other=0).to(gl.int64) * stride_am
            if HALVES == 2:
                rows_1 = rows_0 + BLOCK_M
                ok_1 = rows_1 < M
                base_1 = a_ptr + gl.load(row_src_ptr + rows_1, mask=ok_1, other=0).to(gl.int64) * stride_am
        else:
            sa_ptrs = as_ptr + rows.to(gl.int64) * stride_asm
        sb_ptrs = bs_ptr + expert.to(gl.int64) * stride_bse + (col0 // B_GROUP_N) * stride_bsn + rows * 0
        for j in range(SEGS * k_steps):
            s = it % STAGES
            # A buffer is free once the MMA that read it is done; a fresh mbarrier counts as phase 1 done.
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            if SCALED:
                kg = (j // k_steps) * NKG + j % k_steps  # the step's scale group (segment j // k_steps)
                _cp_async(sa_bufs.index(s), sa_ptrs + kg, mask=in_rows)
                for p in gl.static_range(SUBS):  # each column part's block scale (a part past N reads none: unused)
                    _cp_async(
                        sb_bufs.index(s).slice(p * TILE_ROWS, TILE_ROWS),
                        sb_ptrs + (p * SUB_N // B_GROUP_N) * stride_bsn + kg,
                        mask=rows * 0 + col0 + p * SUB_N < N,
                    )
            k = (j // k_steps) * K + (j % k_steps) * BLOCK_K
            if GATHER:
                cols = k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, chunk_layout))
                in_cols = (cols < (j // k_steps + 1) * K)[None, :]  # the segment's K ends inside the last step
                _cp_async(a_bufs.index(HALVES * s), base_0[:, None] + cols[None, :], mask=ok_0[:, None] & in_cols)
                if HALVES == 2:
                    _cp_async(
                        a_bufs.index(HALVES * s + 1), base_1[:, None] + cols[None, :], mask=ok_1[:, None] & in_cols
                    )
            async_copy.mbarrier_arrive(bar)  # the barrier's phase also waits for this lane's copies
            if GATHER:
                # Every producer warp has counted its copies on the barrier before one thread arms it: else the
                # phase could complete with another warp's copies not yet counted.
                _partition_barrier()
                mbarrier.expect(bar, b_desc.block_type.nbytes)
            else:
                mbarrier.expect(bar, HALVES * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                for h in gl.static_range(HALVES):
                    _tma_load(a_desc, [row0 + h * BLOCK_M, k], bar, a_bufs.index(HALVES * s + h))
            if B_KMAJOR:
                _tma_load(b_desc, [expert * N + col0, k], bar, b_bufs.index(s))
            else:  # one segment (the launcher checks): K rows of each expert, a whole number of steps
                _tma_load(b_desc, [expert * K + k, col0], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _mma_step(
    acc,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    it,
    mma_layout: gl.constexpr,
    HALF: gl.constexpr,
    HALVES: gl.constexpr,
    GATHER: gl.constexpr,
    SCALES_FIRST: gl.constexpr,
):
    """Step ``it`` for the rows of half HALF: wait for the stage, issue its wgmma into a fresh fp32 tile, read the
    step's scales while it runs, wait for it, free the stage, add the product scaled. SCALES_FIRST: read the scales
    before the wgmma is issued (read after it, ptxas puts their product between the step's wgmma instructions, whose
    issue then waits for the reads: Nsight Compute on scripts/fp8_gemm_once.py)."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    if GATHER:  # A was written by cp.async (the generic proxy); the wgmma reads it through the async proxy
        fence_async_shared()
    acc = _promoted_part(
        acc,
        a_bufs.index(HALVES * s + HALF),
        b_bufs.index(s),
        sa_bufs.index(s),
        sb_bufs.index(s),
        mma_layout,
        HALF,
        0,
        SCALES_FIRST,
    )
    mbarrier.arrive(empty.index(s), count=1)
    return acc


@gluon.jit
def _promoted_part(
    acc,
    a_buf,
    b_buf,
    sa_buf,
    sb_buf,
    mma_layout: gl.constexpr,
    HALF: gl.constexpr,
    PART: gl.constexpr,
    SCALES_FIRST: gl.constexpr,
):
    """Column part PART of one step's product for the rows of half HALF, scaled and added to ``acc``."""
    BLOCK_M: gl.constexpr = a_buf.type.shape[0]
    SUB_N: gl.constexpr = acc.type.shape[1]
    TILE_ROWS: gl.constexpr = sa_buf.type.shape[0]
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    if SCALES_FIRST:
        sa = sa_buf.slice(HALF * BLOCK_M, BLOCK_M).load(row_layout)
        sb = sb_buf.slice(PART * TILE_ROWS + HALF * BLOCK_M, BLOCK_M).load(row_layout)
    tile = warpgroup_mma(
        a_buf,
        b_buf.slice(PART * SUB_N, SUB_N).permute((1, 0)),
        gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout),
        use_acc=False,
        is_async=True,
    )
    if SCALES_FIRST:
        done = warpgroup_mma_wait(num_outstanding=0, deps=(tile,))
    else:
        sa = sa_buf.slice(HALF * BLOCK_M, BLOCK_M).load(row_layout)
        sb = sb_buf.slice(PART * TILE_ROWS + HALF * BLOCK_M, BLOCK_M).load(row_layout)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(tile,))
    return acc + done * (sa * sb)[:, None]


@gluon.jit
def _mma_step2(
    acc0,
    acc1,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    it,
    mma_layout: gl.constexpr,
    HALF: gl.constexpr,
    HALVES: gl.constexpr,
    GATHER: gl.constexpr,
    SCALES_FIRST: gl.constexpr,
):
    """Step ``it`` of a 256-column tile (SUBS = 2) for the rows of half HALF: its two 128-column parts in turn, one
    accumulator each, one fresh tile live at a time."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    if GATHER:
        fence_async_shared()
    a_buf = a_bufs.index(HALVES * s + HALF)
    acc0 = _promoted_part(
        acc0, a_buf, b_bufs.index(s), sa_bufs.index(s), sb_bufs.index(s), mma_layout, HALF, 0, SCALES_FIRST
    )
    acc1 = _promoted_part(
        acc1, a_buf, b_bufs.index(s), sa_bufs.index(s), sb_bufs.index(s), mma_layout, HALF, 1, SCALES_FIRST
    )
    mbarrier.arrive(empty.index(s), count=1)
    return acc0, acc1


@gluon.jit
def _plain_part(acc, a_buf, b_buf, PART: gl.constexpr, B_KMAJOR: gl.constexpr):
    """Issue (not wait for) the wgmma adding A @ column part PART of B to ``acc`` (unscaled operands)."""
    SUB_N: gl.constexpr = acc.type.shape[1]
    if B_KMAJOR:
        b_part = b_buf.slice(PART * SUB_N, SUB_N).permute((1, 0))
    else:
        b_part = b_buf.slice(PART * SUB_N, SUB_N, dim=1)
    return warpgroup_mma(a_buf, b_part, acc, is_async=True)


@gluon.jit
def _plain_tile(
    acc0,
    acc1,
    a_bufs,
    b_bufs,
    ready,
    empty,
    it,
    n_steps,
    HALF: gl.constexpr,
    HALVES: gl.constexpr,
    GATHER: gl.constexpr,
    SUBS: gl.constexpr,
    B_KMAJOR: gl.constexpr,
):
    """The main loop of one tile on unscaled (bf16) operands: the products accumulate in fp32 in the wgmma's own
    accumulators (no promotion), and step j's wgmma is issued before step j - 1's stage is freed, so the tensor
    cores never wait for this warp group between steps. ``acc1`` is only used with SUBS = 2."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    for j in range(n_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if GATHER:  # A was written by cp.async (the generic proxy); the wgmma reads it through the async proxy
            fence_async_shared()
        acc0, acc1 = _plain_step(acc0, acc1, a_bufs.index(HALVES * s + HALF), b_bufs.index(s), SUBS, B_KMAJOR)
        if j > 0:  # step j - 1's wgmma is done: its stage is free
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        it += 1
    acc0, acc1 = _plain_drain(acc0, acc1, SUBS)
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
    return acc0, acc1, it


@gluon.jit
def _plain_step(acc0, acc1, a_buf, b_buf, SUBS: gl.constexpr, B_KMAJOR: gl.constexpr):
    """One step of an unscaled main loop: issue its wgmma into ``acc0`` (and ``acc1``'s, SUBS = 2), then wait for
    the step before's only, so the tensor cores always have the next one."""
    acc0 = _plain_part(acc0, a_buf, b_buf, 0, B_KMAJOR)
    if SUBS == 2:
        acc1 = _plain_part(acc1, a_buf, b_buf, 1, B_KMAJOR)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
    else:
        acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0,))
    return acc0, acc1


@gluon.jit
def _plain_drain(acc0, acc1, SUBS: gl.constexpr):
    """Wait for an unscaled main loop's last wgmma(s)."""
    if SUBS == 2:
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    else:
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
    return acc0, acc1


@gluon.jit
def _store_by_tma(out, c_desc, c_smem, row, col):
    """``out`` to ``c_desc`` at [row, col] through shared memory and a TMA store, which runs while the partition
    goes on to its next tile (the previous tile's store has long left the buffer; waited for anyway)."""
    tma.store_wait(0)
    c_smem.store(out)
    fence_async_shared()
    _tma_store(c_desc, [row, col], c_smem)


@gluon.jit
def _store_part(out, c_desc, c_smem, c_ptr, row_s0, col0, row_end, N, stride_cm, TMA_STORE: gl.constexpr):
    """One partition's rows of one column part of a tile: by TMA where all its rows are the expert's (TMA_STORE),
    else from registers with a row mask."""
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = out.type.shape[0]
    SUB_N: gl.constexpr = out.type.shape[1]
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // SUB_N, SUB_N // 8], [num_warps, 1], [1, 0])
    if TMA_STORE and row_s0 + BLOCK_M <= row_end:  # all rows are the expert's
        _store_by_tma(out, c_desc, c_smem, row_s0, col0)
    else:
        # The expert's rows end inside this part (a box would overwrite the next expert's rows): stored from a
        # row-contiguous layout (16 bytes a thread, whole rows a warp): from the MMA layout each thread would
        # write 4 bytes per row and 8-column block, and every 32-byte sector would be written twice.
        out_rows = gl.convert_layout(out, store_layout)
        rows_s = row_s0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
        cols_s = col0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(0, store_layout))
        c_ptrs = c_ptr + rows_s.to(gl.int64)[:, None] * stride_cm + cols_s[None, :]
        gl.store(c_ptrs, out_rows, mask=(rows_s < row_end)[:, None] & (cols_s < N)[None, :])


@gluon.jit
def _mma_partition(
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    c_desc,
    c_smem,
    c_ptr,
    row_scale_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    M,
    N,
    K,
    stride_cm,
    SEGS: gl.constexpr,
    SCALE_ROWS: gl.constexpr,
    TILE_M: gl.constexpr,
    HALF: gl.constexpr,
    HALVES: gl.constexpr,
    TMA_STORE: gl.constexpr,
    GATHER: gl.constexpr,
    SCALES_FIRST: gl.constexpr,
    SUBS: gl.constexpr,
    SCALED: gl.constexpr,
    B_KMAJOR: gl.constexpr,
    stored,
    STAGGER: gl.constexpr,
):
    """Rows [HALF * BLOCK_M, (HALF + 1) * BLOCK_M) of every tile of this program (HALVES partitions split a tile),
    in SUBS column parts. STAGGER (unscaled, HALVES = 2): the partitions store their tiles in turn
    (``wgrad_ws._wgrad_mma_partition`` says why; ``stored``: one mbarrier per partition)."""
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    TILE_ROWS: gl.constexpr = HALVES * BLOCK_M
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1 if B_KMAJOR else 2]  # the tile's columns
    SUB_N: gl.constexpr = BLOCK_N // SUBS
    # One warp group per 64 rows; a wgmma instruction takes 32 bytes of K (fp8: 32, bf16: 16).
    MMA_K: gl.constexpr = 256 // a_bufs.dtype.primitive_bitwidth
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, SUB_N, MMA_K]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    n_col_tiles = gl.cdiv(N, BLOCK_N)
    n_steps = SEGS * gl.cdiv(K, BLOCK_K)
    total = gl.load(num_tiles_ptr) * (TILE_M // TILE_ROWS) * n_col_tiles
    programs = gl.num_programs(0)
    lane_rows = HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)  # this partition's rows of a tile

    # The first tile's indices and row scales; each later tile's are loaded while the tile before it runs.
    # (With no tiles at all the tile list holds no valid entry: nothing is loaded, the loop below does not run.)
    t0 = gl.minimum(gl.program_id(0), total - 1)
    row0, col0, row_end = _tile_with_end(
        t0, n_col_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, TILE_ROWS, BLOCK_N, TILE_M, valid=total > 0
    )
    rows = row0 + lane_rows
    if SCALE_ROWS:
        rs_next = gl.load(row_scale_ptr + rows, mask=rows < M, other=0.0).to(gl.float32)
    it = 0
    tile = 0
    for t in range(gl.program_id(0), total, programs):
        row0_n, col0_n, row_end_n = _tile_with_end(
            gl.minimum(t + programs, total - 1),
            n_col_tiles,
            tile_expert_ptr,
            tile_row_ptr,
            expert_offsets_ptr,
            TILE_ROWS,
            BLOCK_N,
            TILE_M,
        )
        row_s0 = row0 + HALF * BLOCK_M
        # Each step's MMA into a fresh fp32 tile, waited for, then scaled and added. (Waiting for the previous step's
        # only, with the next in flight, makes ptxas serialise every wgmma of the kernel: a wgmma's accumulator
        # registers must not be written while another wgmma runs, and each fresh tile is.)
        if not SCALED:
            acc0 = gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout)
            acc1 = gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout) if SUBS == 2 else acc0
            acc0, acc1, it = _plain_tile(
                acc0, acc1, a_bufs, b_bufs, ready, empty, it, n_steps, HALF, HALVES, GATHER, SUBS, B_KMAJOR
            )
            if SCALE_ROWS:
                acc0 = acc0 * rs_next[:, None]
            if STAGGER:
                mbarrier.wait(stored.index(1 - HALF), (tile & 1) ^ (1 - HALF))
            _store_part(
                acc0.to(c_ptr.dtype.element_ty), c_desc, c_smem, c_ptr, row_s0, col0, row_end, N, stride_cm, TMA_STORE
            )
            if SUBS == 2:
                if SCALE_ROWS:
                    acc1 = acc1 * rs_next[:, None]
                _store_part(
                    acc1.to(c_ptr.dtype.element_ty),
                    c_desc,
                    c_smem,
                    c_ptr,
                    row_s0,
                    col0 + SUB_N,
                    row_end,
                    N,
                    stride_cm,
                    TMA_STORE,
                )
            if STAGGER:
                mbarrier.arrive(stored.index(HALF), count=1)
        elif SUBS == 1:
            acc = gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout)
            for _j in range(n_steps):
                acc = _mma_step(
                    acc,
                    a_bufs,
                    b_bufs,
                    sa_bufs,
                    sb_bufs,
                    ready,
                    empty,
                    it,
                    mma_layout,
                    HALF,
                    HALVES,
                    GATHER,
                    SCALES_FIRST,
                )
                it += 1
            if SCALE_ROWS:
                acc = acc * rs_next[:, None]
            _store_part(
                acc.to(c_ptr.dtype.element_ty), c_desc, c_smem, c_ptr, row_s0, col0, row_end, N, stride_cm, TMA_STORE
            )
        else:
            gl.static_assert(SUBS == 2, "SUBS is 1 or 2")
            acc0 = gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout)
            acc1 = gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout)
            for _j in range(n_steps):
                acc0, acc1 = _mma_step2(
                    acc0,
                    acc1,
                    a_bufs,
                    b_bufs,
                    sa_bufs,
                    sb_bufs,
                    ready,
                    empty,
                    it,
                    mma_layout,
                    HALF,
                    HALVES,
                    GATHER,
                    SCALES_FIRST,
                )
                it += 1
            if SCALE_ROWS:
                acc0 = acc0 * rs_next[:, None]
                acc1 = acc1 * rs_next[:, None]
            _store_part(
                acc0.to(c_ptr.dtype.element_ty), c_desc, c_smem, c_ptr, row_s0, col0, row_end, N, stride_cm, TMA_STORE
            )
            _store_part(
                acc1.to(c_ptr.dtype.element_ty),
                c_desc,
                c_smem,
                c_ptr,
                row_s0,
                col0 + SUB_N,
                row_end,
                N,
                stride_cm,
                TMA_STORE,
            )
        if SCALE_ROWS:
            rows_n = row0_n + lane_rows
            rs_next = gl.load(row_scale_ptr + rows_n, mask=rows_n < M, other=0.0).to(gl.float32)
        row0, col0, row_end = row0_n, col0_n, row_end_n
        tile += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _stage_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """A ring's ready / empty mbarriers: ready completes on the producer's arrival (with its transaction bytes and
    cp.async copies), empty once each of CONSUMERS MMA partitions has freed the stage."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


@gluon.jit
def _allocate_stages(
    a_desc, b_desc, c_desc, STAGES: gl.constexpr, HALVES: gl.constexpr, SB_WIDTH: gl.constexpr, TMA_STORE: gl.constexpr
):
    """The ring (STAGES stages of HALVES A boxes, one B box, A's row scales and SB_WIDTH B scales), its ready /
    empty mbarriers (each MMA partition frees a stage), and with TMA_STORE one output box per MMA partition (else
    A's buffers stand in, unused)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [HALVES * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    sa_bufs = gl.allocate_shared_memory(
        gl.float32, [STAGES, HALVES * a_desc.block_type.shape[0]], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, SB_WIDTH], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready, empty = _stage_barriers(STAGES, HALVES)
    if TMA_STORE:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [HALVES] + c_desc.block_type.shape, c_desc.layout)
    else:
        c_bufs = a_bufs
    return a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_bufs


@gluon.jit
def grouped_gemm_ws_kernel(
    a_desc,
    b_desc,
    c_desc,
    a_ptr,
    row_src_ptr,
    as_ptr,
    bs_ptr,
    c_ptr,
    row_scale_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    expert_offsets_ptr,
    M,
    N,
    K,
    NKG,
    stride_am,
    stride_asm,
    stride_bse,
    stride_bsn,
    stride_cm,
    SEGS: gl.constexpr,
    SCALE_ROWS: gl.constexpr,
    B_GROUP_N: gl.constexpr,
    STAGES: gl.constexpr,
    TILE_M: gl.constexpr,
    HALVES: gl.constexpr,
    TMA_STORE: gl.constexpr,
    GATHER: gl.constexpr,
    SCALES_FIRST: gl.constexpr,
    SUBS: gl.constexpr,
    SCALED: gl.constexpr,
    B_KMAJOR: gl.constexpr,
    STAGGER: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    MMA_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """HALVES = 1: one MMA partition (``num_warps`` warps, 64 rows a warp group) computes each tile. HALVES = 2: two
    4-warp MMA partitions (the default one and a worker with MMA_REGS registers) compute the two 64-row halves of
    each 128-row tile from the same B buffers; neither waits at the other's barriers, so one's promotion can run
    while the other's wgmma does (one partition of two warp groups keeps both in step at its barriers). TMA_STORE:
    parts of a tile that hold only their expert's rows are stored by TMA through ``c_desc`` (a box of one
    partition's rows), the others from registers; without it ``c_desc`` is not read (any descriptor will do)."""
    # Each step's scales: A's per row, B's block scale (per column part) copied for every row (so that both are
    # read alike).
    a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_bufs = _allocate_stages(
        a_desc, b_desc, c_desc, STAGES, HALVES, SUBS * HALVES * a_desc.block_type.shape[0], TMA_STORE
    )
    if STAGGER:
        gl.static_assert(HALVES == 2 and not SCALED, "STAGGER: two unscaled MMA partitions")
        stored = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(stored.index(i), count=1)
    else:
        stored = ready  # not read
    # (The partitions' argument tuples are written out in the call: a tuple bound to a name first loses its
    # constexprs.)
    if HALVES == 1:
        gl.warp_specialize(
            [
                (
                    _mma_partition,
                    (
                        a_bufs,
                        b_bufs,
                        sa_bufs,
                        sb_bufs,
                        ready,
                        empty,
                        c_desc,
                        c_bufs.index(0),
                        c_ptr,
                        row_scale_ptr,
                        tile_expert_ptr,
                        tile_row_ptr,
                        num_tiles_ptr,
                        expert_offsets_ptr,
                        M,
                        N,
                        K,
                        stride_cm,
                        SEGS,
                        SCALE_ROWS,
                        TILE_M,
                        0,
                        HALVES,
                        TMA_STORE,
                        GATHER,
                        SCALES_FIRST,
                        SUBS,
                        SCALED,
                        B_KMAJOR,
                        stored,
                        STAGGER,
                    ),
                ),
                (
                    _load_partition,
                    (
                        a_desc,
                        b_desc,
                        a_bufs,
                        b_bufs,
                        sa_bufs,
                        sb_bufs,
                        ready,
                        empty,
                        a_ptr,
                        row_src_ptr,
                        as_ptr,
                        bs_ptr,
                        tile_expert_ptr,
                        tile_row_ptr,
                        num_tiles_ptr,
                        M,
                        N,
                        K,
                        NKG,
                        stride_am,
                        stride_asm,
                        stride_bse,
                        stride_bsn,
                        SEGS,
                        B_GROUP_N,
                        TILE_M,
                        HALVES,
                        GATHER,
                        SUBS,
                        SCALED,
                        B_KMAJOR,
                    ),
                ),
            ],
            [LOAD_WARPS],
            [LOAD_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _mma_partition,
                    (
                        a_bufs,
                        b_bufs,
                        sa_bufs,
                        sb_bufs,
                        ready,
                        empty,
                        c_desc,
                        c_bufs.index(0),
                        c_ptr,
                        row_scale_ptr,
                        tile_expert_ptr,
                        tile_row_ptr,
                        num_tiles_ptr,
                        expert_offsets_ptr,
                        M,
                        N,
                        K,
                        stride_cm,
                        SEGS,
                        SCALE_ROWS,
                        TILE_M,
                        0,
                        HALVES,
                        TMA_STORE,
                        GATHER,
                        SCALES_FIRST,
                        SUBS,
                        SCALED,
                        B_KMAJOR,
                        stored,
                        STAGGER,
                    ),
                ),
                (
                    _mma_partition,
                    (
                        a_bufs,
                        b_bufs,
                        sa_bufs,
                        sb_bufs,
                        ready,
                        empty,
                        c_desc,
                        c_bufs.index(1),
                        c_ptr,
                        row_scale_ptr,
                        tile_expert_ptr,
                        tile_row_ptr,
                        num_tiles_ptr,
                        expert_offsets_ptr,
                        M,
                        N,
                        K,
                        stride_cm,
                        SEGS,
                        SCALE_ROWS,
                        TILE_M,
                        1,
                        HALVES,
                        TMA_STORE,
                        GATHER,
                        SCALES_FIRST,
                        SUBS,
                        SCALED,
                        B_KMAJOR,
                        stored,
                        STAGGER,
                    ),
                ),
                (
                    _load_partition,
                    (
                        a_desc,
                        b_desc,
                        a_bufs,
                        b_bufs,
                        sa_bufs,
                        sb_bufs,
                        ready,
                        empty,
                        a_ptr,
                        row_src_ptr,
                        as_ptr,
                        bs_ptr,
                        tile_expert_ptr,
                        tile_row_ptr,
                        num_tiles_ptr,
                        M,
                        N,
                        K,
                        NKG,
                        stride_am,
                        stride_asm,
                        stride_bse,
                        stride_bsn,
                        SEGS,
                        B_GROUP_N,
                        TILE_M,
                        HALVES,
                        GATHER,
                        SUBS,
                        SCALED,
                        B_KMAJOR,
                    ),
                ),
            ],
            [4, LOAD_WARPS],
            [MMA_REGS, LOAD_REGS],
        )
