"""Host side of the warp-specialised Hopper kernels on bf16 operands: the row-tiled grouped GEMM
(``kernels/gemm_ws.py``), FC1 + SwiGLU (``kernels/fc1_ws.py``, ``bf16_fc1_swiglu_ws``) and the weight gradient
(``kernels/wgrad_ws.py``, ``bf16_grouped_wgrad_ws``).

The weight gradient is the layer's (``launch.grouped_wgrad(use_ws=None)`` from the backward, one rank and expert
parallel). Qwen3-30B-A3B, one H200, ms, the Triton kernel's best candidate / the default config: dW1 1.782 / 1.504
and dW2 0.844 / 0.789 at T = 16384, 0.602 / 0.508 and 0.309 / 0.257 at T = 4096; Qwen3-235B-A22B, T = 4096: 2.410 /
1.837 and 1.194 / 0.951 (``scripts/wgrad_probe.py --ws``, ``benchmarks/results/bf16_wgrad_ws.txt``).

The row-tiled GEMM is the fp8 one with its scales compiled out (``SCALED = False``): a producer warp feeds TMA copies
of A and B (or, gathering, cp.async copies of A's source rows) to two 4-warp MMA partitions, each taking a 64-row half
of every 128-row tile; the products accumulate in the wgmma's fp32 accumulators (no per-step promotion), and step j's
wgmma is issued before step j - 1's stage is freed. K steps of 64 (128 bytes of a row, as fp8's 128). FC1 + SwiGLU
is the fp8 FC1 kernel's producer (``fp8_fc1_ws``) with the scales compiled out, feeding that main loop (the gate and
up boxes as the tile's two column parts) and an epilogue storing h and a from registers.

Both are opt-in: ``launch.grouped_gemm(use_ws=True)`` and ``launch.fc1_swiglu(use_ws=True)`` run them, an error saying
why where they do not apply (``bf16_ws_unavailable``, ``bf16_fc1_ws_unavailable``); ``use_ws=None`` runs them where
they apply; the layer runs the Triton kernels. Both give the Triton kernels' bits. Measured on one H200
(``benchmarks/results/bf16_fc1_ws.txt``, ``scripts/bf16_ws_probe.py``), ms, Triton / ws default:

- FC1 dgrad alone: Qwen3-30B-A3B 1.378 / 1.293 (T = 16384), 0.812 / 0.746 (8192), 0.552 / 0.507 (4096), 0.414 /
  0.417 (2048); Qwen3-235B-A22B 5.675 / 5.230 (16384), 2.184 / 1.693 (4096). In the layer (FC1 dgrad on it, one
  machine session each) Qwen3-235B-A22B's backward took 17.623 against 18.051 and 5.723 against 5.871, but
  Qwen3-30B-A3B's was no faster (T = 16384 back to back 5.012 against 5.044; T = 8192 back to back 2.881 and 2.869
  against 2.730 and 2.636).
- FC1 + SwiGLU, h saved: Qwen3-30B-A3B 1.519 / 1.492 (16384), 0.456 / 0.492 (4096); Qwen3-235B-A22B 6.091 / 5.347
  (16384), 1.574 / 1.615 (4096); h not saved (the no-grad forward), slower at every shape: 1.273 / 1.311 (30B,
  16384). The layer's forward with it was slower (back to back 0.785 against 0.720 ms at T = 4096).
- Earlier: FC2 0.731 (the layer's pointer reads) / 0.752 and the gathering FC2 dgrad 0.730 / 0.833
  (``bf16_ws_t16384.txt``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..kernels.fp8_gemm import QTILE_M
from .compiled_launch import GluonTensorDescriptor, launch
from .fp8_ws_launch import (
    WS_BLOCK_N,
    WS_GATHER_LOAD_REGS,
    WS_GATHER_LOAD_WARPS,
    WS_GATHER_MMA_REGS,
    WSConfig,
    _grid,
    hopper_unavailable,
    output_descriptor,
    producer_split,
    ws_kernel,
)
from .routing_plan import RoutingPlan
from .sizes import cdiv
from .tma import tma_readable

BF16_WS_BLOCK_K = 64  # 128 bytes of a bf16 row: the operand boxes' swizzle width
# A stage: two 64 x 64 A boxes and a B box of 256 x 64 (48 KiB) or 128 x 64 (32 KiB); TMA stores take two 16 KiB
# output boxes. A partition holds a stage until its next step's wgmma is issued, so the producer runs at most
# STAGES - 1 steps ahead: the deeper rings trade the TMA stores' buffers for stages.
BF16_WS_CONFIGS = (
    WSConfig(128, 4, halves=2, subs=2),
    WSConfig(128, 4, halves=2, subs=2, stagger=True),
    WSConfig(128, 3, halves=2, tma_store=True, subs=2),
    WSConfig(128, 3, halves=2, tma_store=True, subs=2, stagger=True),
    WSConfig(128, 4, halves=2, tma_store=True),
    WSConfig(128, 5, halves=2, tma_store=True),
    WSConfig(128, 6, halves=2),
)
BF16_WS_DEFAULT = BF16_WS_CONFIGS[0]  # 256 columns, 4 stages, outputs stored from registers


def bf16_ws_unavailable(
    a: torch.Tensor, b: torch.Tensor, *, transpose_b: bool, gather: bool, row_base: int = 0
) -> str | None:
    """Why the warp-specialised kernel cannot compute ``launch.grouped_gemm(a, b, ..., transpose_b, gather)``, or
    None when it can."""
    why_not = hopper_unavailable(a.device)
    if why_not is not None:
        return why_not
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return f"it takes bf16 operands (got {a.dtype} and {b.dtype})"
    k = b.shape[2] if transpose_b else b.shape[1]
    if not transpose_b and k % BF16_WS_BLOCK_K:
        return f"weights read N-major (B[e] as [K, N]) need K a multiple of {BF16_WS_BLOCK_K} (got {k})"
    if gather and row_base:
        return "gathered rows with a row_base (a segment of the source rows) are not implemented"
    if not b.is_contiguous() or not tma_readable(b.view(-1, b.shape[-1])):
        return "the weights must be contiguous and TMA-readable (16-byte aligned rows)"
    if not tma_readable(a):  # gathered rows are copied in 16-byte pieces, which needs the same
        how = "gathering A's rows in 16-byte pieces" if gather else "reading A by TMA"
        return f"{how} needs contiguous, 16-byte aligned rows"
    return None


@functools.cache
def _box_layout(rows: int, cols: int):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    """A TMA descriptor of bf16 ``t`` in [rows, cols] boxes (the operands; the output's: ``output_descriptor``)."""
    return GluonTensorDescriptor.from_tensor(t, [rows, cols], _box_layout(rows, cols))


def bf16_grouped_gemm_ws(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutingPlan,
    c: torch.Tensor,
    *,
    transpose_b: bool,
    gather: bool = False,
    row_scale: torch.Tensor | None = None,
    config: WSConfig = BF16_WS_DEFAULT,
    programs: int | None = None,
) -> None:
    """c[r] = row_scale[r] * A[src[r] if gather else r] @ op(B[e]) (callers check ``bf16_ws_unavailable`` first),
    as ``launch.grouped_gemm``: A [P or R, K] bf16; B [E, N, K] read K-major (op = transpose, ``transpose_b``) or
    [E, K, N] read N-major; c [P, N]. ``programs``: at most that many persistent programs (tests give
    small problems several tiles a program this way)."""
    if plan.tile_m != QTILE_M:
        raise ValueError(f"bf16_grouped_gemm_ws: the plan's row tile must be {QTILE_M} rows (got {plan.tile_m})")
    n, k = (b.shape[1], b.shape[2]) if transpose_b else (b.shape[2], b.shape[1])
    if plan.num_pairs == 0 or a.shape[0] == 0:  # no rows (a rank that receives nothing): no tiles
        return
    a_desc = _descriptor(a, config.a_rows, BF16_WS_BLOCK_K)
    if transpose_b:  # boxes of block_n weight rows, K-major
        b_desc = _descriptor(b.view(-1, k), config.block_n, BF16_WS_BLOCK_K)
    else:  # boxes of BLOCK_K rows of [E * K, N]: whole steps of one expert (K a multiple of the step)
        b_desc = _descriptor(b.view(-1, n), BF16_WS_BLOCK_K, config.block_n)
    c_desc, tma_store = output_descriptor(c, a_desc, config)
    tiles = plan.max_tiles * (QTILE_M // config.block_m) * cdiv(n, config.block_n)
    load_warps, load_regs, mma_regs = producer_split(gather)
    launch(
        ws_kernel("gemm_ws", "grouped_gemm_ws_kernel"),
        _grid(config.programs_per_sm, c.device, tiles, programs),
        a_desc,
        b_desc,
        c_desc,
        a,
        plan.row_src,
        a,  # no scales: A stands in for the scale pointers (not read)
        a,
        c,
        row_scale if row_scale is not None else plan.row_weight,
        plan.tile_expert,
        plan.tile_row,
        plan.num_tiles,
        plan.expert_offsets,
        plan.sorted_rows,  # the kernel bounds its sorted-row loads by every sorted row of the buffers
        n,
        k,
        1,
        a.stride(0),
        0,
        0,
        0,
        c.stride(0),
        SEGS=1,
        SCALE_ROWS=row_scale is not None,
        B_GROUP_N=128,
        STAGES=config.stages,
        TILE_M=QTILE_M,
        HALVES=config.halves,
        TMA_STORE=tma_store,
        GATHER=gather,
        SCALES_FIRST=False,
        SUBS=config.subs,
        SCALED=False,
        B_KMAJOR=transpose_b,
        STAGGER=config.stagger,
        LOAD_WARPS=load_warps,
        LOAD_REGS=load_regs,
        MMA_REGS=mma_regs,
        num_warps=config.num_warps,
        maxnreg=config.maxnreg,
    )


# FC1 + SwiGLU (``kernels/fc1_ws.py``): a stage holds two 64 x 64 A boxes and the gate and up boxes (128 x 64 each),
# 48 KiB; h and a are stored from registers, so four stages fit.
BF16_FC1_WS_STAGES = 4


def bf16_fc1_ws_unavailable(x: torch.Tensor, w1: torch.Tensor) -> str | None:
    """Why the warp-specialised FC1 + SwiGLU kernel cannot compute ``launch.fc1_swiglu(x, w1, ...)``, or None when
    it can."""
    why_not = hopper_unavailable(x.device)
    if why_not is not None:
        return why_not
    if x.dtype != torch.bfloat16 or w1.dtype != torch.bfloat16:
        return f"it takes bf16 operands (got {x.dtype} and {w1.dtype})"
    inter, hidden = w1.shape[1] // 2, w1.shape[2]
    if inter % WS_BLOCK_N:
        return f"the intermediate size must be a multiple of {WS_BLOCK_N} (got {inter})"
    if x.stride(1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16:
        # 16-byte copies of a row need its offsets known as multiples of 8 elements: Triton specialises integers
        # divisible by 16, so the row stride must be one
        return f"x's rows are copied in 16-byte pieces: contiguous rows, a stride a multiple of 16 (got {x.stride(0)})"
    if not w1.is_contiguous() or not tma_readable(w1.view(-1, hidden)):
        return "W1 must be contiguous and TMA-readable (16-byte aligned rows)"
    if x.shape[0] * x.stride(0) >= 2**31:
        return "x must have fewer than 2^31 elements (its rows are addressed by 32-bit offsets)"
    return None


def bf16_fc1_swiglu_ws(
    x: torch.Tensor,
    w1: torch.Tensor,
    plan: RoutingPlan,
    h: torch.Tensor | None,
    a: torch.Tensor,
    *,
    row_base: int = 0,
    clamp_limit: float = 0.0,
    clamp: bool = False,
    stages: int = BF16_FC1_WS_STAGES,
    programs: int | None = None,
) -> None:
    """h = x[src - row_base] @ W1[e]^T (not stored when h is None) and a = silu(gate) * up (``clamp``: the clamped
    SwiGLU at ``clamp_limit``, ``ops.activation``; h unclamped) with ``kernels/fc1_ws.py`` (callers check
    ``bf16_fc1_ws_unavailable`` first), as ``launch.fc1_swiglu``: x [R, H] bf16, w1 [E, 2I, H], h [P, 2I], a [P, I].
    ``programs``: at most that many persistent programs (tests give small problems several tiles a program)."""
    if plan.tile_m != QTILE_M:
        raise ValueError(f"bf16_fc1_swiglu_ws: the plan's row tile must be {QTILE_M} rows (got {plan.tile_m})")
    inter, hidden = w1.shape[1] // 2, w1.shape[2]
    if plan.num_pairs == 0 or x.shape[0] == 0:  # no rows (a rank that receives nothing): nothing to compute
        return
    b_desc = _descriptor(w1.view(-1, hidden), WS_BLOCK_N, BF16_WS_BLOCK_K)  # a gate (or up) box: 128 rows of W1
    save_h = h is not None
    launch(
        ws_kernel("fc1_ws", "bf16_fc1_swiglu_ws_kernel"),
        _grid(1, a.device, plan.max_tiles * (inter // WS_BLOCK_N), programs),
        b_desc,
        x,
        plan.row_src,
        h if save_h else a,
        a,
        plan.tile_expert,
        plan.tile_row,
        plan.num_tiles,
        plan.expert_offsets,
        plan.sorted_rows,  # the kernel bounds its sorted-row loads by every sorted row of the buffers
        inter,
        hidden,
        row_base,
        x.stride(0),
        h.stride(0) if save_h else 0,
        a.stride(0),
        clamp_limit,
        SAVE_H=save_h,
        CLAMP=clamp,
        STAGES=stages,
        TILE_M=QTILE_M,
        LOAD_WARPS=WS_GATHER_LOAD_WARPS,
        LOAD_REGS=WS_GATHER_LOAD_REGS,
        MMA_REGS=WS_GATHER_MMA_REGS,
        num_warps=4,
        maxnreg=168,
    )


@dataclass(frozen=True)
class WgradWSConfig:
    """The bf16 weight-gradient kernel's config (``kernels/wgrad_ws.py``): 128-row output tiles of the gathered
    operand's side (two 64-row MMA partitions) and ``block_n`` columns of the sorted operand's (parts of 128, one
    accumulator each), ``stages`` ring stages (A: 16 KiB, B: ``block_n`` x 64 bf16), TMA stores (two 16 KiB output
    boxes) where the output allows them."""

    block_n: int = 256
    stages: int = 4
    tma_store: bool = True
    stagger: bool = True

    @property
    def subs(self) -> int:
        return self.block_n // WS_BLOCK_N


# Four stages of 48 KiB and the two output boxes fill 224 KiB of the 227 the SM gives a program.
BF16_WGRAD_WS_CONFIGS = (
    WgradWSConfig(256, 4),
    WgradWSConfig(256, 4, stagger=False),
    WgradWSConfig(256, 3),
    WgradWSConfig(128, 4),
    WgradWSConfig(256, 4, tma_store=False),
)
BF16_WGRAD_WS_DEFAULT = BF16_WGRAD_WS_CONFIGS[0]
# Producer warps and registers (every step's rows are gathered: its source row ids, then 16-byte copies of them), and
# the second MMA partition's registers; ``tests/test_bf16_wgrad_ws.py`` checks the split compiles without spills.
WGRAD_WS_LOAD_WARPS, WGRAD_WS_LOAD_REGS, WGRAD_WS_MMA_REGS = 4, 88, 208


def bf16_wgrad_ws_unavailable(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, gather_a: bool) -> str | None:
    """Why the warp-specialised kernel cannot compute ``launch.grouped_wgrad(a, b, plan, out, gather_a=...)``, or
    None when it can."""
    why_not = hopper_unavailable(a.device)
    if why_not is not None:
        return why_not
    if {a.dtype, b.dtype, out.dtype} != {torch.bfloat16}:
        return f"it takes bf16 operands and output (got {a.dtype}, {b.dtype} and {out.dtype})"
    if not out.is_contiguous():
        return "the output must be contiguous"
    dense, gathered = (b, a) if gather_a else (a, b)
    if not tma_readable(dense):
        return "the sorted operand is read by TMA: contiguous, 16-byte aligned rows"
    if not tma_readable(gathered) or gathered.shape[1] % 8:
        return "the gathered operand is copied in 16-byte pieces: contiguous, 16-byte aligned rows of whole pieces"
    if not gather_a and dense.shape[1] % WS_BLOCK_N:
        # The output is written transposed, by TMA in boxes of 128 of its rows that must not reach the next
        # expert's; stored from registers it ran 2-5x slower than the Triton kernel (scripts/wgrad_probe.py --ws).
        cols = dense.shape[1]
        return f"with B gathered, A's columns (the output's rows) must be a multiple of {WS_BLOCK_N} (got {cols})"
    return None


def bf16_grouped_wgrad_ws(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutingPlan,
    out: torch.Tensor,
    *,
    gather_a: bool,
    config: WgradWSConfig = BF16_WGRAD_WS_DEFAULT,
    programs: int | None = None,
) -> None:
    """out[e] = A[rows of e]^T @ B[rows of e] (callers check ``bf16_wgrad_ws_unavailable`` first), as
    ``launch.grouped_wgrad`` with ``gather_a`` (A gathered, B sorted) or not (A sorted, B gathered): A [*, M], B
    [*, N], out [E, M, N]. The kernel takes the gathered operand as its A: with B gathered it computes out^T =
    B[rows]^T @ A[rows] and writes it transposed. ``programs``: at most that many persistent programs."""
    dense, gathered = (b, a) if gather_a else (a, b)
    transpose = not gather_a
    experts = plan.num_local_experts
    m, n = gathered.shape[1], dense.shape[1]  # the kernel's: rows of C (gathered side), columns (sorted side)
    if dense.shape[0] == 0:  # no rows at all (a rank that receives nothing): every expert's gradient is zero
        out.zero_()
        return
    d_desc = _descriptor(dense, BF16_WS_BLOCK_K, config.block_n)
    sub_n = config.block_n // config.subs
    # Output boxes of one MMA partition's 64 rows and one column part, [64, sub_n] of out viewed as [E * M, N], or
    # transposed, [sub_n, 64] of out viewed as [E * N, M]: a box must not reach the next expert's rows, so their
    # count must be a whole number of boxes.
    if transpose:
        tma_store = config.tma_store and n % sub_n == 0
        c_desc = _descriptor(out.view(-1, m), sub_n, 64) if tma_store else d_desc
        stride_cm, stride_cn = out.stride(2), out.stride(1)
    else:
        tma_store = config.tma_store and m % 64 == 0
        c_desc = _descriptor(out.view(-1, n), 64, sub_n) if tma_store else d_desc
        stride_cm, stride_cn = out.stride(1), out.stride(2)
    tiles = experts * cdiv(m, 128) * cdiv(n, config.block_n)
    launch(
        ws_kernel("wgrad_ws", "bf16_grouped_wgrad_ws_kernel"),
        _grid(1, out.device, tiles, programs),
        d_desc,
        c_desc,
        dense,
        gathered,
        plan.row_src,
        out,
        plan.expert_offsets,
        m,
        n,
        experts,
        plan.num_segments,
        dense.stride(0),
        gathered.stride(0),
        out.stride(0),
        stride_cm,
        stride_cn,
        BLOCK_N=config.block_n,
        BLOCK_K=BF16_WS_BLOCK_K,
        STAGES=config.stages,
        SUBS=config.subs,
        TMA_STORE=tma_store,
        TRANSPOSE_C=transpose,
        STAGGER=config.stagger,
        LOAD_WARPS=WGRAD_WS_LOAD_WARPS,
        LOAD_REGS=WGRAD_WS_LOAD_REGS,
        MMA_REGS=WGRAD_WS_MMA_REGS,
        num_warps=4,
        maxnreg=168,
    )
