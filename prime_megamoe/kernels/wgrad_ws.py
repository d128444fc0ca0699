"""The bf16 weight gradient of ``grouped_gemm.grouped_wgrad_kernel`` as a warp-specialised, persistent Hopper kernel
(Gluon), built like ``gemm_ws.py``.

``C[e] = A[src of rows of e]^T @ B[rows of e]`` with A [R, M] gathered (sorted row r reads source row ``row_src[r]``)
and B [*, N] in sorted row order, bf16, C [E, M, N] (TRANSPOSE_C: C^T, [E, N, M]): the reduction runs over expert e's
sorted rows of every segment, in segment order. The layer's two weight gradients: dW2 = dy[src]^T aw as it is, and
dW1 = dh^T x[src] as (x[src]^T dh)^T, TRANSPOSE_C (``ops/bf16_ws_launch.bf16_grouped_wgrad_ws``): the gathered
operand always takes the tile's 128-row side and the sorted one its 256-column side, the shape where the gathered
copies keep up with the tensor cores (the other way, 32 KiB of gathered rows a step, dW1 ran 2.74 ms against 1.79
for the Triton kernel at Qwen3-30B-A3B, T = 16384).

Why a second kernel: at a few hundred rows per expert each output tile is a few K steps, and the Triton kernel's
program then spends as long storing its tile as computing it, with nothing else on the SM to fill that time (dW1 at
Qwen3-235B-A22B, T = 4096, 256 rows an expert: 2.29 ms, 360 TFLOP/s; its 3.2 GB of output alone take ~0.7 ms to
write). Here the stores are TMA copies that run while the next tile's steps do:

- the producer partition (4 warps) walks the program's output tiles (expert major, then row block, then column block,
  as ``fp8_wgrad_ws``) and, for each tile, its expert's rows of every segment in steps of BLOCK_K rows: B's chunk by
  TMA (a box [BLOCK_K, BLOCK_N]), A's gathered rows by cp.async in 16-byte pieces (TMA cannot gather on Hopper;
  their ids are loaded a step ahead, which took dW1 at Qwen3-30B-A3B, T = 16384, from 1.65-1.69 to 1.36-1.39 ms on
  an H100), both into one stage of a ring guarded by ready / empty mbarriers;
- two 4-warp MMA partitions take the two 64-row halves of each 128-row output tile: both operands sit in shared
  memory row-major (M- and N-major), which bf16 wgmma reads as they are (A through a transposed view), so no operand
  is transposed in memory first; step j's wgmma is issued before step j - 1's stage is freed, the products
  accumulate in the wgmma's fp32 accumulators, and the finished tile is stored by TMA (or from registers, with
  masks, where a box could not hold it).

Rows of a step: a step past the expert's end is moved back to end there (the rows it shares with the step before
read zeros on the gathered side), so B's box stays inside the expert's rows, as in the Triton kernel; an expert with
fewer than BLOCK_K rows in a segment has B copied by cp.async too, with a row mask (a box there could reach rows no
plan wrote). An expert without rows gets zeros.

Gluon kernels have no interpreter: ``tests/test_bf16_wgrad_ws.py`` compiles it for sm_90 on the CPU and checks it
against float64 and the Triton kernel on a Hopper GPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

from .fp8_wgrad_ws import _wgrad_store, _wgrad_tile_of
from .gemm_ws import (
    _cp_async,
    _partition_barrier,
    _plain_drain,
    _plain_step,
    _stage_barriers,
    _tma_load,
    _tma_store,
)


@gluon.jit
def _step_row(k0, start, end, BLOCK_K: gl.constexpr):
    """The first row of the step that starts at ``k0``: the last step is moved back to end at the expert's end (not
    before its start)."""
    return gl.maximum(gl.minimum(k0, end - BLOCK_K), start)


@gluon.jit
def _step_rows(row_ids_ptr, row, k0, end, BLOCK_K: gl.constexpr, COLS: gl.constexpr, GATHERED: gl.constexpr):
    """(the rows that a step's copies read, which of them are the step's: [k0, end)) for a [BLOCK_K, COLS] buffer:
    rows [row, row + BLOCK_K), with GATHERED their source rows ``row_ids[r]``."""
    # 16 bytes (8 bf16) a thread, a row over COLS / 8 threads (``_copy_rows`` has the same layout)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // COLS, COLS // 8], [gl.num_warps(), 1], [1, 0])
    r = row + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    ok = (r >= k0) & (r < end)
    if GATHERED:
        src = gl.load(row_ids_ptr + r, mask=ok, other=0).to(gl.int64)
    else:
        src = r.to(gl.int64)
    return src, ok


@gluon.jit
def _copy_rows(buf, base_ptr, src, ok, col0, ncols, stride):
    """cp.async of rows ``src`` (``_step_rows``), columns [col0, col0 + the buffer's width), into ``buf``; rows not
    ``ok`` and columns past ``ncols`` read zeros."""
    COLS: gl.constexpr = buf.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // COLS, COLS // 8], [gl.num_warps(), 1], [1, 0])
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    _cp_async(buf, base_ptr + src[:, None] * stride + cols[None, :], mask=ok[:, None] & (cols < ncols)[None, :])


@gluon.jit
def _wgrad_load_partition(
    d_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    d_ptr,
    g_ptr,
    row_src_ptr,
    expert_offsets_ptr,
    M,
    N,
    E,
    num_segments,
    stride_d,
    stride_g,
):
    BLOCK_K: gl.constexpr = b_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    HALF_M: gl.constexpr = a_bufs.type.shape[2]  # one MMA partition's columns of A
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    TILE_ROWS: gl.constexpr = 2 * HALF_M
    m_tiles = gl.cdiv(M, TILE_ROWS)
    n_tiles = gl.cdiv(N, BLOCK_N)
    total = E * m_tiles * n_tiles
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, m0, n0 = _wgrad_tile_of(t, m_tiles, n_tiles, TILE_ROWS, BLOCK_N)
        for seg in range(num_segments):
            start = gl.load(expert_offsets_ptr + seg * (E + 1) + expert)
            end = gl.load(expert_offsets_ptr + seg * (E + 1) + expert + 1)
            short = end - start < BLOCK_K  # B by cp.async too, rows masked
            # The gathered rows' ids of the segment's first step; each later step's are loaded while the step
            # before it is issued and its stage waited for, so that no step's copies wait on that load (past the
            # expert's end the load is masked off).
            src, ok = _step_rows(row_src_ptr, start, start, end, BLOCK_K, HALF_M, True)
            for k0 in range(start, end, BLOCK_K):
                row = _step_row(k0, start, end, BLOCK_K)
                k1 = k0 + BLOCK_K
                src_n, ok_n = _step_rows(
                    row_src_ptr, _step_row(k1, start, end, BLOCK_K), k1, end, BLOCK_K, HALF_M, True
                )
                s = it % STAGES
                # A buffer is free once the MMAs that read it are done; a fresh mbarrier counts as phase 1 done.
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                for h in gl.static_range(2):
                    _copy_rows(a_bufs.index(2 * s + h), g_ptr, src, ok, m0 + h * HALF_M, M, stride_g)
                if short:
                    d_src, d_ok = _step_rows(row_src_ptr, row, k0, end, BLOCK_K, BLOCK_N, False)
                    _copy_rows(b_bufs.index(s), d_ptr, d_src, d_ok, n0, N, stride_d)
                async_copy.mbarrier_arrive(bar)  # the barrier's phase also waits for this lane's copies
                # Every producer warp has counted its copies on the barrier before one thread arms it: else the
                # phase could complete with another warp's copies not yet counted.
                _partition_barrier()
                if short:
                    mbarrier.arrive(bar, count=1)
                else:
                    mbarrier.expect(bar, d_desc.block_type.nbytes)
                    _tma_load(d_desc, [row, n0], bar, b_bufs.index(s))
                src, ok = src_n, ok_n
                it += 1


@gluon.jit
def _store_part(
    acc,
    c_desc,
    c_smem,
    c_ptr,
    expert,
    row_s0,
    col0,
    M,
    N,
    stride_ce,
    stride_cm,
    stride_cn,
    TMA_STORE: gl.constexpr,
    TRANSPOSE_C: gl.constexpr,
):
    """One partition's rows of one column part of an output tile. TRANSPOSE_C: the part is written transposed (the
    output is C^T), by TMA from a transposed view of the output box [SUB_N, 64] of C^T viewed as [E * N, M]; else
    as ``fp8_wgrad_ws._wgrad_store`` (the pointer path takes either orientation through its strides)."""
    if TRANSPOSE_C and TMA_STORE:
        if (row_s0 < M) & (col0 < N):  # (N is a multiple of SUB_N here: a box never reaches the next expert's)
            tma.store_wait(0)
            c_smem.permute((1, 0)).store(acc.to(c_ptr.dtype.element_ty))
            fence_async_shared()
            _tma_store(c_desc, [expert * N + col0, row_s0], c_smem)
    else:
        _wgrad_store(acc, c_desc, c_smem, c_ptr, expert, row_s0, col0, M, N, stride_ce, stride_cm, stride_cn, TMA_STORE)


@gluon.jit
def _tile_steps(expert_offsets_ptr, expert, E, num_segments, BLOCK_K: gl.constexpr, valid=True):
    """K steps of one output tile: each segment's rows of its expert, BLOCK_K a step."""
    steps = 0
    for seg in range(num_segments):
        start = gl.load(expert_offsets_ptr + seg * (E + 1) + expert, mask=valid, other=0)
        end = gl.load(expert_offsets_ptr + seg * (E + 1) + expert + 1, mask=valid, other=0)
        steps += gl.cdiv(end - start, BLOCK_K)
    return steps


@gluon.jit
def _wgrad_mma_partition(
    a_bufs,
    b_bufs,
    ready,
    empty,
    c_desc,
    c_smem,
    c_ptr,
    expert_offsets_ptr,
    M,
    N,
    E,
    num_segments,
    stride_ce,
    stride_cm,
    stride_cn,
    stored,
    HALF: gl.constexpr,
    SUBS: gl.constexpr,
    TMA_STORE: gl.constexpr,
    TRANSPOSE_C: gl.constexpr,
    STAGGER: gl.constexpr,
):
    """Rows [HALF * 64, (HALF + 1) * 64) of every output tile of this program, in SUBS column parts. STAGGER: the
    two partitions store their tiles in turn (``stored``: one mbarrier per partition, one phase per tile), so one
    partition's steps run while the other stores."""
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_K: gl.constexpr = b_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    HALF_M: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    SUB_N: gl.constexpr = BLOCK_N // SUBS
    TILE_ROWS: gl.constexpr = 2 * HALF_M
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, SUB_N, 16]
    )
    m_tiles = gl.cdiv(M, TILE_ROWS)
    n_tiles = gl.cdiv(N, BLOCK_N)
    total = E * m_tiles * n_tiles
    programs = gl.num_programs(0)
    # The first tile's step count; each later tile's is loaded while the tile before it runs. (With no tiles at all
    # nothing is loaded and the loop does not run.)
    expert, m0, n0 = _wgrad_tile_of(gl.minimum(gl.program_id(0), total - 1), m_tiles, n_tiles, TILE_ROWS, BLOCK_N)
    steps = _tile_steps(expert_offsets_ptr, expert, E, num_segments, BLOCK_K, valid=total > 0)
    it = 0
    tile = 0
    for t in range(gl.program_id(0), total, programs):
        expert_n, m0_n, n0_n = _wgrad_tile_of(gl.minimum(t + programs, total - 1), m_tiles, n_tiles, TILE_ROWS, BLOCK_N)
        steps_n = _tile_steps(expert_offsets_ptr, expert_n, E, num_segments, BLOCK_K)
        acc0 = gl.zeros([HALF_M, SUB_N], gl.float32, mma_layout)
        acc1 = gl.zeros([HALF_M, SUB_N], gl.float32, mma_layout)
        # A while loop, not ``for _ in range(steps)``: Triton 3.6's Gluon inliner replaces a loop-carried value that
        # is only an inner for loop's bound by its first value (``fp8_wgrad_ws``).
        j = 0
        while j < steps:
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            fence_async_shared()  # the cp.async copies (generic proxy) are read by the wgmma (async proxy)
            a_op = a_bufs.index(2 * s + HALF).permute((1, 0))  # [64, BLOCK_K]: A^T's rows, M-major in memory
            acc0, acc1 = _plain_step(acc0, acc1, a_op, b_bufs.index(s), SUBS, False)  # B N-major
            if j > 0:  # step j - 1's wgmma is done: its stage is free
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            it += 1
            j += 1
        acc0, acc1 = _plain_drain(acc0, acc1, SUBS)
        if steps > 0:
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        row_s0 = m0 + HALF * HALF_M
        if STAGGER:
            # Partition 0 stores tile i after partition 1 has stored tile i - 1 (a fresh mbarrier counts as that
            # phase done), partition 1 after partition 0 has stored tile i. Only the first tile's stores wait with
            # nothing else to do: from then on each partition's stores run while the other one's steps do (the
            # ring lets the one ahead run up to STAGES steps beyond the other).
            mbarrier.wait(stored.index(1 - HALF), (tile & 1) ^ (1 - HALF))
        _store_part(
            acc0, c_desc, c_smem, c_ptr, expert, row_s0, n0, M, N, stride_ce, stride_cm, stride_cn, TMA_STORE,
            TRANSPOSE_C,
        )  # fmt: skip
        if SUBS == 2:
            _store_part(
                acc1, c_desc, c_smem, c_ptr, expert, row_s0, n0 + SUB_N, M, N, stride_ce, stride_cm, stride_cn,
                TMA_STORE, TRANSPOSE_C,
            )  # fmt: skip
        if STAGGER:
            mbarrier.arrive(stored.index(HALF), count=1)
        expert, m0, n0, steps = expert_n, m0_n, n0_n, steps_n
        tile += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def bf16_grouped_wgrad_ws_kernel(
    d_desc,
    c_desc,
    d_ptr,
    g_ptr,
    row_src_ptr,
    c_ptr,
    expert_offsets_ptr,
    M,
    N,
    E,
    num_segments,
    stride_d,
    stride_g,
    stride_ce,
    stride_cm,
    stride_cn,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    SUBS: gl.constexpr,
    TMA_STORE: gl.constexpr,
    TRANSPOSE_C: gl.constexpr,
    STAGGER: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    MMA_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Two 4-warp MMA partitions (the default one and a worker with MMA_REGS registers) and a LOAD_WARPS producer.
    A's stage holds two [BLOCK_K, 64] boxes (one per MMA partition), B's one [BLOCK_K, BLOCK_N], both in B's
    descriptor's layout (a bf16 box of 64 or more columns has the same one whatever its width). TMA_STORE: tiles are
    stored by TMA through ``c_desc``, boxes [64, BLOCK_N / SUBS] of C viewed as [E * M, N] (TRANSPOSE_C: [BLOCK_N /
    SUBS, 64] of C^T viewed as [E * N, M]); without it ``c_desc`` is not read (any descriptor will do) and the
    strides say where C's elements go."""
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_K, 64], d_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N], d_desc.layout)
    ready, empty = _stage_barriers(STAGES, 2)
    if STAGGER:
        stored = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(stored.index(i), count=1)
    else:
        stored = ready  # not read
    if TMA_STORE:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    else:
        c_bufs = a_bufs
    gl.warp_specialize(
        [
            (
                _wgrad_mma_partition,
                (
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    c_desc,
                    c_bufs.index(0),
                    c_ptr,
                    expert_offsets_ptr,
                    M,
                    N,
                    E,
                    num_segments,
                    stride_ce,
                    stride_cm,
                    stride_cn,
                    stored,
                    0,
                    SUBS,
                    TMA_STORE,
                    TRANSPOSE_C,
                    STAGGER,
                ),
            ),
            (
                _wgrad_mma_partition,
                (
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    c_desc,
                    c_bufs.index(1),
                    c_ptr,
                    expert_offsets_ptr,
                    M,
                    N,
                    E,
                    num_segments,
                    stride_ce,
                    stride_cm,
                    stride_cn,
                    stored,
                    1,
                    SUBS,
                    TMA_STORE,
                    TRANSPOSE_C,
                    STAGGER,
                ),
            ),
            (
                _wgrad_load_partition,
                (
                    d_desc,
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    d_ptr,
                    g_ptr,
                    row_src_ptr,
                    expert_offsets_ptr,
                    M,
                    N,
                    E,
                    num_segments,
                    stride_d,
                    stride_g,
                ),
            ),
        ],
        [4, LOAD_WARPS],
        [MMA_REGS, LOAD_REGS],
    )
