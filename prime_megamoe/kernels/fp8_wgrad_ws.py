"""The fp8 weight gradient of ``fp8_gemm.py`` (``fp8_grouped_wgrad_kernel`` with MX = False) as a warp-specialised,
persistent Hopper kernel (Gluon), built like ``gemm_ws.py``.

``C[e] = A_t[:, tiles of e] @ B_t[:, tiles of e]^T``: both operands in the cols_t layout (K-major, [M, T128] and
[N, T128], fp8), the reduction over expert e's 128-column row tiles ``[expert_tiles[e], expert_tiles[e + 1])``, each
tile's product promoted with one scale per output row and one per output column (``scale[t, m]``,
``scale[t, n]``): ``acc + P * (sa[:, None] * sb[None, :])``, the Triton kernel's expression, so both give the same
bits. An expert without tiles gets zeros.

- The producer (1 warp) walks the program's output tiles (expert major, then row block, then column block, so that
  programs running together share the expert's A and B panels in L2) and fills a ring of stages: TMA boxes of A
  (HALVES of them) and B at the row tile's columns, and both scale vectors by cp.async, which the stage's ready
  barrier waits for.
- HALVES MMA partitions (4 warps each when HALVES = 2) take the rows of each output tile: each step's wgmma into a
  fresh fp32 tile, the scales read from the stage, waited for, the stage freed, the product scaled and added. The
  next tile's step count is loaded while this tile's MMAs run.
- SUBS = 2 (the layer's config): 256-column tiles (a 256 x 128 B box a stage), each MMA partition computing its rows'
  two 128-column parts in turn, one accumulator each: only one fresh tile is live at a time, so the two
  accumulators fit beside it, and each A box is read once per 256 output columns instead of 128.
- Stores: by TMA (a box of one partition's rows of the output viewed as [E * M, N]) where the launcher allows it
  (``TMA_STORE``: a contiguous 2-byte output whose M is a multiple of the box), else from a row-contiguous layout
  with masks.

The layer's two weight gradients run it on Hopper. ``tests/test_fp8_gemm_ws.py`` checks it against the Triton kernel
on the GPU (Gluon has no interpreter; on the CPU it is compiled for sm_90), ``scripts/fp8_ws_smoke.py wgrad``
launches every config under a watchdog. Measured (Qwen3-30B-A3B, T = 16384, one H200, ``scripts/fp8_probe.py
--ws-only --gemms dW1 dW2``, the same bits as the Triton kernel): dW1 1.001 ms against 1.244, dW2 0.536 against
0.693; with SUBS = 2 (the same probe, another machine) dW1 0.981 against 1.115 for 128-column tiles, dW2 0.542
against 0.589.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gemm_ws import _allocate_stages, _cp_async, _store_by_tma, _tma_load


@gluon.jit
def _wgrad_tile_of(t, m_tiles, n_tiles, TILE_ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Expert, first output row and first output column of persistent tile t."""
    per_expert = m_tiles * n_tiles
    part = t % per_expert
    return t // per_expert, (part // n_tiles) * TILE_ROWS, (part % n_tiles) * BLOCK_N


@gluon.jit
def _wgrad_load_partition(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    as_ptr,
    bs_ptr,
    expert_tiles_ptr,
    tiles_ptr,
    M,
    N,
    E,
    stride_asr,
    stride_bsr,
    HALVES: gl.constexpr,
    TILE_LIST: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]  # rows of one MMA partition's A box
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    TILE_ROWS: gl.constexpr = HALVES * BLOCK_M
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    m_tiles = gl.cdiv(M, TILE_ROWS)
    n_tiles = gl.cdiv(N, BLOCK_N)
    total = E * m_tiles * n_tiles
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, m0, n0 = _wgrad_tile_of(t, m_tiles, n_tiles, TILE_ROWS, BLOCK_N)
        t_begin = gl.load(expert_tiles_ptr + expert)
        t_end = gl.load(expert_tiles_ptr + expert + 1)
        rows = m0 + gl.arange(0, TILE_ROWS, layout=vec_layout)
        cols = n0 + gl.arange(0, BLOCK_N, layout=vec_layout)
        for j in range(t_begin, t_end):
            if TILE_LIST:  # the expert's tiles of every segment, in segment order
                kt = gl.load(tiles_ptr + j)
            else:  # the expert's tiles are consecutive
                kt = j
            s = it % STAGES
            # A buffer is free once the MMAs that read it are done; a fresh mbarrier counts as phase 1 done.
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            _cp_async(sa_bufs.index(s), as_ptr + kt * stride_asr + rows, mask=rows < M)
            _cp_async(sb_bufs.index(s), bs_ptr + kt * stride_bsr + cols, mask=cols < N)
            async_copy.mbarrier_arrive(bar)  # the barrier's phase also waits for this lane's copies
            mbarrier.expect(bar, HALVES * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            for h in gl.static_range(HALVES):  # boxes past M or N read zeros
                _tma_load(a_desc, [m0 + h * BLOCK_M, kt * BLOCK_K], bar, a_bufs.index(HALVES * s + h))
            _tma_load(b_desc, [n0, kt * BLOCK_K], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _wgrad_promoted(
    acc,
    a_buf,
    b_buf,
    sa_bufs,
    sb_bufs,
    s,
    mma_layout: gl.constexpr,
    HALF: gl.constexpr,
    SUB: gl.constexpr,
    LATE_SCALES: gl.constexpr,
):
    """Column part SUB of one row tile's product for the rows of half HALF: a fresh wgmma tile, waited for, scaled
    by row and column and added to ``acc``."""
    BLOCK_M: gl.constexpr = a_buf.type.shape[0]
    SUB_N: gl.constexpr = acc.type.shape[1]
    tile = warpgroup_mma(
        a_buf,
        b_buf.slice(SUB * SUB_N, SUB_N).permute((1, 0)),
        gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout),
        use_acc=False,
        is_async=True,
    )
    if LATE_SCALES:  # read once the tile is in: fewer registers live while it is in flight
        done = warpgroup_mma_wait(num_outstanding=0, deps=(tile,))
        sa = sa_bufs.index(s).slice(HALF * BLOCK_M, BLOCK_M).load(gl.SliceLayout(1, mma_layout))
        sb = sb_bufs.index(s).slice(SUB * SUB_N, SUB_N).load(gl.SliceLayout(0, mma_layout))
    else:
        sa = sa_bufs.index(s).slice(HALF * BLOCK_M, BLOCK_M).load(gl.SliceLayout(1, mma_layout))
        sb = sb_bufs.index(s).slice(SUB * SUB_N, SUB_N).load(gl.SliceLayout(0, mma_layout))
        done = warpgroup_mma_wait(num_outstanding=0, deps=(tile,))
    return acc + done * (sa[:, None] * sb[None, :])


@gluon.jit
def _wgrad_mma_step(
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
):
    """One row tile of the reduction for the rows of half HALF (one column part)."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    acc = _wgrad_promoted(
        acc, a_bufs.index(HALVES * s + HALF), b_bufs.index(s), sa_bufs, sb_bufs, s, mma_layout, HALF, 0, False
    )
    mbarrier.arrive(empty.index(s), count=1)
    return acc


@gluon.jit
def _wgrad_mma_step2(
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
):
    """One row tile of the reduction for the rows of half HALF, two column parts in turn (SUBS = 2): one accumulator
    and one fresh tile live at a time, so the two accumulators fit in the MMA partition's registers."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    a_buf = a_bufs.index(HALVES * s + HALF)
    acc0 = _wgrad_promoted(acc0, a_buf, b_bufs.index(s), sa_bufs, sb_bufs, s, mma_layout, HALF, 0, True)
    acc1 = _wgrad_promoted(acc1, a_buf, b_bufs.index(s), sa_bufs, sb_bufs, s, mma_layout, HALF, 1, True)
    mbarrier.arrive(empty.index(s), count=1)
    return acc0, acc1


@gluon.jit
def _wgrad_store(
    acc, c_desc, c_smem, c_ptr, expert, row_s0, col0, M, N, stride_ce, stride_cm, stride_cn, TMA_STORE: gl.constexpr
):
    """One partition's rows of one column part of an output tile: by TMA, or from registers with masks."""
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    SUB_N: gl.constexpr = acc.type.shape[1]
    out = acc.to(c_ptr.dtype.element_ty)
    if TMA_STORE:
        if row_s0 < M:  # (M is a multiple of BLOCK_M here: a box never reaches the next expert's rows)
            _store_by_tma(out, c_desc, c_smem, expert * M + row_s0, col0)
    else:
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // SUB_N, SUB_N // 8], [num_warps, 1], [1, 0])
        out_rows = gl.convert_layout(out, store_layout)
        rows_s = row_s0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
        cols_s = col0 + gl.arange(0, SUB_N, layout=gl.SliceLayout(0, store_layout))
        c_ptrs = (
            c_ptr
            + expert.to(gl.int64) * stride_ce
            + rows_s.to(gl.int64)[:, None] * stride_cm
            + cols_s[None, :] * stride_cn
        )
        gl.store(c_ptrs, out_rows, mask=(rows_s < M)[:, None] & (cols_s < N)[None, :])


@gluon.jit
def _wgrad_mma_partition(
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    c_desc,
    c_smem,
    c_ptr,
    expert_tiles_ptr,
    M,
    N,
    E,
    stride_ce,
    stride_cm,
    stride_cn,
    HALF: gl.constexpr,
    HALVES: gl.constexpr,
    SUBS: gl.constexpr,
    TMA_STORE: gl.constexpr,
):
    """Rows [HALF * BLOCK_M, (HALF + 1) * BLOCK_M) of every output tile of this program, in SUBS column parts."""
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]  # the whole tile's columns
    SUB_N: gl.constexpr = BLOCK_N // SUBS
    TILE_ROWS: gl.constexpr = HALVES * BLOCK_M
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, SUB_N, 32]
    )
    m_tiles = gl.cdiv(M, TILE_ROWS)
    n_tiles = gl.cdiv(N, BLOCK_N)
    total = E * m_tiles * n_tiles
    programs = gl.num_programs(0)
    # The first tile's step count (its expert's row tiles); each later tile's is loaded while the tile before it
    # runs. (With no tiles at all nothing is loaded and the loop does not run.)
    expert, m0, n0 = _wgrad_tile_of(gl.minimum(gl.program_id(0), total - 1), m_tiles, n_tiles, TILE_ROWS, BLOCK_N)
    steps = gl.load(expert_tiles_ptr + expert + 1, mask=total > 0, other=0) - gl.load(
        expert_tiles_ptr + expert, mask=total > 0, other=0
    )
    it = 0
    for t in range(gl.program_id(0), total, programs):
        expert_n, m0_n, n0_n = _wgrad_tile_of(gl.minimum(t + programs, total - 1), m_tiles, n_tiles, TILE_ROWS, BLOCK_N)
        steps_n = gl.load(expert_tiles_ptr + expert_n + 1) - gl.load(expert_tiles_ptr + expert_n)
        row_s0 = m0 + HALF * BLOCK_M
        # While loops, not ``for _ in range(steps)``: Triton 3.6's Gluon inliner replaces a loop-carried value that
        # is only an inner for loop's bound by its first value (every tile then ran the first tile's step count:
        # wrong sums, or a hang when the counts differ in total; scripts/fp8_ws_smoke.py found it).
        j = 0
        if SUBS == 1:
            acc = gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout)
            while j < steps:
                acc = _wgrad_mma_step(acc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, it, mma_layout, HALF, HALVES)
                it += 1
                j += 1
            _wgrad_store(
                acc, c_desc, c_smem, c_ptr, expert, row_s0, n0, M, N, stride_ce, stride_cm, stride_cn, TMA_STORE
            )
        else:
            gl.static_assert(SUBS == 2, "SUBS is 1 or 2")
            acc0 = gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout)
            acc1 = gl.zeros([BLOCK_M, SUB_N], gl.float32, mma_layout)
            while j < steps:
                acc0, acc1 = _wgrad_mma_step2(
                    acc0, acc1, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, it, mma_layout, HALF, HALVES
                )
                it += 1
                j += 1
            _wgrad_store(
                acc0, c_desc, c_smem, c_ptr, expert, row_s0, n0, M, N, stride_ce, stride_cm, stride_cn, TMA_STORE
            )
            _wgrad_store(
                acc1,
                c_desc,
                c_smem,
                c_ptr,
                expert,
                row_s0,
                n0 + SUB_N,
                M,
                N,
                stride_ce,
                stride_cm,
                stride_cn,
                TMA_STORE,
            )
        expert, m0, n0, steps = expert_n, m0_n, n0_n, steps_n
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def fp8_grouped_wgrad_ws_kernel(
    a_desc,
    b_desc,
    c_desc,
    as_ptr,
    bs_ptr,
    c_ptr,
    expert_tiles_ptr,
    tiles_ptr,
    M,
    N,
    E,
    stride_asr,
    stride_bsr,
    stride_ce,
    stride_cm,
    stride_cn,
    STAGES: gl.constexpr,
    HALVES: gl.constexpr,
    SUBS: gl.constexpr,
    TMA_STORE: gl.constexpr,
    TILE_LIST: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    MMA_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """HALVES = 1: one MMA partition of ``num_warps`` warps; HALVES = 2: two 4-warp partitions (the default one and
    a worker with MMA_REGS registers) on the two 64-row halves of each output tile, from the same B buffers. SUBS:
    128-column parts of a tile (B boxes of SUBS * 128 rows; output boxes of one part). Without TMA_STORE ``c_desc``
    is not read (any descriptor will do)."""
    # The B scales: one per output column of the tile.
    a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_bufs = _allocate_stages(
        a_desc, b_desc, c_desc, STAGES, HALVES, b_desc.block_type.shape[0], TMA_STORE
    )
    # (Argument tuples written out in the call: a tuple bound to a name first loses its constexprs.)
    if HALVES == 1:
        gl.warp_specialize(
            [
                (
                    _wgrad_mma_partition,
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
                        expert_tiles_ptr,
                        M,
                        N,
                        E,
                        stride_ce,
                        stride_cm,
                        stride_cn,
                        0,
                        HALVES,
                        SUBS,
                        TMA_STORE,
                    ),
                ),
                (
                    _wgrad_load_partition,
                    (
                        a_desc,
                        b_desc,
                        a_bufs,
                        b_bufs,
                        sa_bufs,
                        sb_bufs,
                        ready,
                        empty,
                        as_ptr,
                        bs_ptr,
                        expert_tiles_ptr,
                        tiles_ptr,
                        M,
                        N,
                        E,
                        stride_asr,
                        stride_bsr,
                        HALVES,
                        TILE_LIST,
                    ),
                ),
            ],
            [1],
            [LOAD_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _wgrad_mma_partition,
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
                        expert_tiles_ptr,
                        M,
                        N,
                        E,
                        stride_ce,
                        stride_cm,
                        stride_cn,
                        0,
                        HALVES,
                        SUBS,
                        TMA_STORE,
                    ),
                ),
                (
                    _wgrad_mma_partition,
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
                        expert_tiles_ptr,
                        M,
                        N,
                        E,
                        stride_ce,
                        stride_cm,
                        stride_cn,
                        1,
                        HALVES,
                        SUBS,
                        TMA_STORE,
                    ),
                ),
                (
                    _wgrad_load_partition,
                    (
                        a_desc,
                        b_desc,
                        a_bufs,
                        b_bufs,
                        sa_bufs,
                        sb_bufs,
                        ready,
                        empty,
                        as_ptr,
                        bs_ptr,
                        expert_tiles_ptr,
                        tiles_ptr,
                        M,
                        N,
                        E,
                        stride_asr,
                        stride_bsr,
                        HALVES,
                        TILE_LIST,
                    ),
                ),
            ],
            [4, 1],
            [MMA_REGS, LOAD_REGS],
        )
