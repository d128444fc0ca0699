"""Host side of the warp-specialised Hopper fp8 kernels: the row-tiled grouped GEMM (``kernels/gemm_ws.py``) and
the weight gradient (``kernels/fp8_wgrad_ws.py``): when they apply, their TMA descriptors, their persistent grids.

``ws_gemm_unavailable`` says why a row-tiled fp8 GEMM cannot run there, or None where it can: it needs a Hopper GPU
(the kernel is sm_90 wgmma code), the fp8 format (not mx), each segment's K a multiple of 128 when there are two
segments (16 when A is gathered), and both operands TMA-readable. ``fp8_launch.fp8_grouped_gemm(use_ws=True)`` runs it;
asking for it where it does not apply is an error that says why. The layer asks for it for FC2 and the FC1 dgrad,
where it applies: with the default config (two 4-warp MMA partitions on the halves of each 128-row tile, TMA
stores) FC2 took 0.468-0.483 ms against 0.576-0.580 for the Triton kernel and the FC1 dgrad 0.847-0.858 against
1.063-1.070 (Qwen3-30B-A3B, T = 16384, one H200, two runs of scripts/fp8_probe.py --ws-only).
The FC2 dgrad runs it too, its producer warps gathering dy's rows: 0.490 against 0.542 ms
(scripts/fp8_probe.py --ws-only). ``fp8_launch.fp8_grouped_wgrad(use_ws=...)`` likewise runs the
weight-gradient kernel (``ws_wgrad_unavailable`` says where it cannot); the layer's two weight gradients ask for it:
dW1 1.001 ms against 1.244 for the Triton kernel, dW2 0.536 against 0.693 (the same probe).
``fp8_launch.fp8_fc1_swiglu(use_ws=...)`` runs the FC1 + SwiGLU kernel (``ws_fc1_unavailable``); the layer asks for
it: 0.899 ms against 1.164 for the Triton kernel, same bits (the same probe; its first form,
which gathered x's rows twice per tile, took 1.285 against 1.163). All of them launch
through the compiled-kernel cache (``compiled_launch.launch``).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels.fp8_gemm import QTILE_M
from .activation import clamp_kernel_args
from .compiled_launch import GluonTensorDescriptor, launch
from .routing_plan import RoutingPlan
from .sizes import cdiv
from .sm_budget import available_sms as _num_sms
from .sm_budget import cuda_properties as _cuda_properties
from .tma import tma_readable

if TYPE_CHECKING:
    from .qtensor import QTensor

WS_BLOCK_N, WS_BLOCK_K = 128, 128
WS_WEIGHT_BLOCK = 128  # rows of a weight scale block in the fp8 format (the only one the kernel takes)
WS_LOAD_REGS = 40  # registers of the producer warp; the MMA warp groups get the rest (setmaxnreg)


@dataclass(frozen=True)
class WSConfig:
    """block_m = 128: one program per SM, either one MMA partition of two warp groups (halves = 1) or two 4-warp MMA
    partitions taking a 64-row half of each tile each (halves = 2), launch-time registers 168 (12 warps fit the
    SM's 64K); block_m = 64: two programs per SM, one MMA warp group each (registers 128, so 2 x 8 warps fit).
    stages: buffers of A (block_m x 128) and B (128 x 128) fp8. tma_store: tile parts holding only their expert's
    rows are stored by TMA, for outputs of 2-byte elements that TMA can write (a 4-byte output's buffers would not
    fit beside the ring; other outputs are stored from registers, the same values). scales_first: each step reads
    its scales before issuing its wgmma (see ``_mma_step``): no faster (scripts/fp8_probe.py), so not the default.
    subs = 2: 256-column tiles whose two 128-column parts each MMA partition computes in turn, one accumulator
    each, so that every A box is read once per 256 output columns. stagger (bf16, halves = 2): the two MMA
    partitions store their tiles in turn, so that one's steps run while the other stores."""

    block_m: int = 128
    stages: int = 4
    halves: int = 1
    tma_store: bool = False
    scales_first: bool = False
    subs: int = 1
    stagger: bool = False

    @property
    def block_n(self) -> int:  # output columns of a tile: ``subs`` parts of 128, each MMA partition takes in turn
        return self.subs * WS_BLOCK_N

    @property
    def a_rows(self) -> int:  # rows of one A box (one MMA partition's part of a tile)
        return self.block_m // self.halves

    @property
    def num_warps(self) -> int:  # of the default partition
        return self.a_rows // 16

    @property
    def maxnreg(self) -> int:
        return 168 if self.programs_per_sm == 1 else 128

    @property
    def programs_per_sm(self) -> int:
        return 128 // self.block_m


WS_MMA_REGS = 232  # the second MMA partition's registers (halves = 2)
# Gathering A (cp.async from 4 producer warps, row addresses held per tile) needs more producer registers.
WS_GATHER_LOAD_WARPS, WS_GATHER_LOAD_REGS, WS_GATHER_MMA_REGS = 4, 64, 216
# The second (256 columns, 3 stages: a stage holds twice the B box) is every GEMM's default. Against the first (128
# columns): FC2 0.465 against 0.485 ms, the FC1 dgrad 0.802 against 0.845, dW1 0.981 against 1.115, dW2 0.542
# against 0.589 (scripts/fp8_probe.py --ws-only, one H200); the gathering FC2 dgrad 0.448-0.455 against 0.482-0.537
# on three machines (0.474 against 0.476 on a fourth). Same bits.
WS_CONFIGS = (
    WSConfig(128, 4, halves=2, tma_store=True),
    WSConfig(128, 3, halves=2, tma_store=True, subs=2),
    WSConfig(128, 4, halves=2, tma_store=True, scales_first=True),
    WSConfig(128, 4, halves=2),
    WSConfig(128, 4, tma_store=True),
    WSConfig(64, 4),
)
# The weight gradient reads its scales in one order (no scales_first): the configs that differ for it.
WS_WGRAD_CONFIGS = tuple(c for c in WS_CONFIGS if not c.scales_first)
WS_GEMM_DEFAULT = WS_WGRAD_DEFAULT = WS_CONFIGS[1]


def gluon_device_unavailable(device: torch.device) -> str | None:
    """Why a Gluon kernel cannot run on ``device``, or None when it can."""
    if device.type != "cuda":
        return "it runs on a CUDA GPU only (Gluon kernels have no interpreter)"
    if GluonTensorDescriptor is None:
        return "it is a Gluon kernel, and this Triton has no Gluon (triton.experimental.gluon)"
    return None


def hopper_unavailable(device: torch.device) -> str | None:
    """Why a warp-specialised Gluon kernel (Hopper wgmma code) cannot run on ``device``, or None when it can."""
    why_not = gluon_device_unavailable(device)
    if why_not is None and _cuda_properties(device).major != 9:
        why_not = "it is Hopper (sm_90) wgmma code"
    return why_not


@functools.cache
def ws_kernel(module: str, name: str):
    """The Gluon kernel ``name`` of ``kernels/<module>.py``, imported at its first launch (Gluon kernels load only
    where they run) and then reused: an import statement on every launch's path costs ~2 us."""
    return getattr(importlib.import_module(f"..kernels.{module}", __package__), name)


def _hopper_fp8_unavailable(data: torch.Tensor, mx: bool) -> str | None:
    why_not = hopper_unavailable(data.device)
    if why_not is not None:
        return why_not
    if mx:
        return "it takes the fp8 format (fp32 1x128 / 128x128 scales), not mx"
    return None


def ws_gemm_unavailable(
    aq_data: torch.Tensor, bq_data: torch.Tensor, *, mx: bool, gather: bool, segments: int, k: int
) -> str | None:
    """Why the warp-specialised kernel cannot run this GEMM, or None when it can."""
    why_not = _hopper_fp8_unavailable(aq_data, mx)
    if why_not is not None:
        return why_not
    if gather and k % 16:
        return f"gathering A's rows in 16-byte pieces needs K a multiple of 16 (got {k})"
    if segments == 2 and k % WS_BLOCK_K:
        return f"with two segments each segment's K must be a multiple of {WS_BLOCK_K} (got {k})"
    if not (tma_readable(aq_data) and tma_readable(bq_data.view(-1, bq_data.shape[-1]))):
        return "its operands must be TMA-readable (contiguous rows, 16-byte aligned)"
    return None


@functools.cache
def box_layout(rows: int):
    """The shared-memory layout of an fp8 operand box of ``rows`` x WS_BLOCK_K (A's and B's alike)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, WS_BLOCK_K], gl.float8e4nv)


@functools.cache
def _out_layout(block_m: int, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(
        [block_m, WS_BLOCK_N], {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    )


def tma_store_applies(c: torch.Tensor) -> bool:
    """Whether the kernel's TMA store can write ``c`` (see ``WSConfig.tma_store``)."""
    return c.dtype in (torch.bfloat16, torch.float16) and tma_readable(c)


def weight_descriptor(bq: QTensor, rows: int = WS_BLOCK_N):
    """The TMA descriptor of a K-major operand viewed as [rows, K] in [rows, WS_BLOCK_K] boxes, made once per
    QTensor and box (cached weight operands live until their weight changes: no descriptor per call)."""
    layout = box_layout(rows)
    desc = bq.descriptors.get((rows, layout))
    if desc is None:
        desc = bq.descriptors[(rows, layout)] = GluonTensorDescriptor.from_tensor(
            bq.data.view(-1, bq.data.shape[-1]), [rows, WS_BLOCK_K], layout
        )
    return desc


def output_descriptor(c_2d: torch.Tensor | None, a_desc, config: WSConfig):
    """(the output's TMA descriptor, whether the output is stored by TMA): boxes of one MMA partition's rows where the
    config stores by TMA and ``c_2d`` (None: it cannot be viewed so) can take it; else A's descriptor stands in (the
    kernel does not read it)."""
    tma_store = config.tma_store and c_2d is not None and tma_store_applies(c_2d)
    if not tma_store:
        return a_desc, False
    layout = _out_layout(config.a_rows, c_2d.dtype)
    return GluonTensorDescriptor.from_tensor(c_2d, [config.a_rows, WS_BLOCK_N], layout), True


def producer_split(gather: bool) -> tuple[int, int, int]:
    """(producer warps, producer registers, second MMA partition's registers) of the row-tiled kernel: gathering A
    takes four producer warps with more registers."""
    if gather:
        return WS_GATHER_LOAD_WARPS, WS_GATHER_LOAD_REGS, WS_GATHER_MMA_REGS
    return 1, WS_LOAD_REGS, WS_MMA_REGS


def _descriptors(a_2d: torch.Tensor, b_desc, c_2d: torch.Tensor | None, config: WSConfig):
    """TMA descriptors of A (boxes of one MMA partition's rows) and the output (``output_descriptor``). Returns them
    with ``b_desc`` (``weight_descriptor``) and whether the output is stored by TMA."""
    a_desc = GluonTensorDescriptor.from_tensor(a_2d, [config.a_rows, WS_BLOCK_K], box_layout(config.a_rows))
    c_desc, tma_store = output_descriptor(c_2d, a_desc, config)
    return a_desc, b_desc, c_desc, tma_store


def _grid(per_sm: int, device: torch.device, tiles: int, programs: int | None) -> tuple[int]:
    """Persistent programs: as many as the SMs hold (``per_sm`` each; the SMs within the budget in effect:
    ``sm_budget.available_sms``), at most one a tile and at most ``programs``."""
    return (max(1, min(per_sm * _num_sms(device), tiles, programs or tiles)),)


def fp8_grouped_gemm_ws(
    aq: QTensor,
    bq: QTensor,
    plan: RoutingPlan,
    c: torch.Tensor,
    *,
    segments: int,
    row_scale: torch.Tensor | None,
    gather: bool = False,
    config: WSConfig = WS_GEMM_DEFAULT,
    programs: int | None = None,
) -> None:
    """c[r] = row_scale[r] * A[src[r] if gather else r] @ B[e]^T with the warp-specialised kernel (callers check
    ``ws_gemm_unavailable`` first): A [P or R, segments * K] fp8 with row scales [.., segments * cdiv(K, 128)], B the
    K-major weights [E, N, segments * K] in fp8 blocks; ``gather``: A's rows are the plan's source rows (copied by
    cp.async: the layer's FC2 dgrad). ``programs``: at most that many persistent programs (tests give small problems
    several tiles a program this way)."""
    aq_data, aq_scale, bq_data, bq_scale = aq.data, aq.scale, bq.data, bq.scale
    # The kernel bounds its sorted-row loads by every sorted row of the buffers (a segment's view indexes them all)
    rows, n, k = plan.sorted_rows, bq_data.shape[1], bq_data.shape[2] // segments
    if plan.num_pairs == 0 or aq_data.shape[0] == 0:  # no rows (a rank that receives nothing): no tiles
        return
    a_desc, b_desc, c_desc, tma_store = _descriptors(aq_data, weight_descriptor(bq, config.block_n), c, config)
    tiles = plan.max_tiles * (QTILE_M // config.block_m) * cdiv(n, config.block_n)
    grid = _grid(config.programs_per_sm, c.device, tiles, programs)
    load_warps, load_regs, mma_regs = producer_split(gather)
    launch(
        ws_kernel("gemm_ws", "grouped_gemm_ws_kernel"),
        grid,
        a_desc,
        b_desc,
        c_desc,
        aq_data,
        plan.row_src,
        aq_scale,
        bq_scale,
        c,
        row_scale if row_scale is not None else plan.row_weight,
        plan.tile_expert,
        plan.tile_row,
        plan.num_tiles,
        plan.expert_offsets,
        rows,
        n,
        k,
        aq_scale.shape[1] // segments,
        aq_data.stride(0),
        aq_scale.stride(0),
        bq_scale.stride(0),
        bq_scale.stride(1),
        c.stride(0),
        SEGS=segments,
        SCALE_ROWS=row_scale is not None,
        B_GROUP_N=WS_WEIGHT_BLOCK,
        STAGES=config.stages,
        TILE_M=QTILE_M,
        HALVES=config.halves,
        TMA_STORE=tma_store,
        GATHER=gather,
        SCALES_FIRST=config.scales_first,
        SUBS=config.subs,
        SCALED=True,
        B_KMAJOR=True,
        STAGGER=False,
        LOAD_WARPS=load_warps,
        LOAD_REGS=load_regs,
        MMA_REGS=mma_regs,
        num_warps=config.num_warps,
        maxnreg=config.maxnreg,
    )


def ws_wgrad_unavailable(a_t_data: torch.Tensor, b_t_data: torch.Tensor, *, mx: bool) -> str | None:
    """Why the warp-specialised weight-gradient kernel cannot run, or None when it can."""
    why_not = _hopper_fp8_unavailable(a_t_data, mx)
    if why_not is None and not (tma_readable(a_t_data) and tma_readable(b_t_data)):
        why_not = "its operands must be TMA-readable (contiguous rows, 16-byte aligned)"
    return why_not


def fp8_grouped_wgrad_ws(
    a_t: QTensor,
    b_t: QTensor,
    out: torch.Tensor,
    *,
    expert_tiles: torch.Tensor,
    tile_list: torch.Tensor | None = None,
    config: WSConfig = WS_WGRAD_DEFAULT,
    programs: int | None = None,
) -> None:
    """out[e] = A_t[:, tiles of e] @ B_t[:, tiles of e]^T with ``kernels/fp8_wgrad_ws.py`` (callers check the
    operands and ``ws_wgrad_unavailable`` first; ``fp8_launch.fp8_grouped_wgrad(use_ws=True)`` does both): cols_t
    operands a_t [M, T128], b_t [N, T128] with scales [T128 / 128, M] / [.., N], out [E, M, N]. Expert e's tiles:
    [expert_tiles[e], expert_tiles[e + 1]), or with ``tile_list`` the entries of that list there
    (``fp8_launch.expert_tile_list``). Stores by TMA where the config asks for it and out is a contiguous 2-byte
    tensor whose M is a multiple of the box's rows."""
    m, n, experts = a_t.data.shape[0], b_t.data.shape[0], out.shape[0]
    # Boxes of the output viewed as [E * M, N] must not reach the next expert's rows.
    out_2d = out.view(-1, n) if out.is_contiguous() and m % config.a_rows == 0 else None
    a_desc, b_desc, c_desc, tma_store = _descriptors(a_t.data, weight_descriptor(b_t, config.block_n), out_2d, config)
    tiles = experts * cdiv(m, config.block_m) * cdiv(n, config.block_n)
    grid = _grid(config.programs_per_sm, out.device, tiles, programs)
    launch(
        ws_kernel("fp8_wgrad_ws", "fp8_grouped_wgrad_ws_kernel"),
        grid,
        a_desc,
        b_desc,
        c_desc,
        a_t.scale,
        b_t.scale,
        out,
        expert_tiles,
        expert_tiles if tile_list is None else tile_list,
        m,
        n,
        experts,
        a_t.scale.stride(0),
        b_t.scale.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        STAGES=config.stages,
        HALVES=config.halves,
        SUBS=config.subs,
        TMA_STORE=tma_store,
        TILE_LIST=tile_list is not None,
        LOAD_REGS=WS_LOAD_REGS,
        MMA_REGS=WS_MMA_REGS,
        num_warps=config.num_warps,
        maxnreg=config.maxnreg,
    )


def ws_fc1_unavailable(
    xq_data: torch.Tensor, w1q_data: torch.Tensor, *, mx: bool, group: int, weight_rows: int, inter: int
) -> str | None:
    """Why the warp-specialised FC1 + SwiGLU kernel cannot run, or None when it can."""
    why_not = _hopper_fp8_unavailable(xq_data, mx)
    if why_not is not None:
        return why_not
    if group != WS_BLOCK_K or weight_rows != WS_WEIGHT_BLOCK:
        return f"it takes 1 x {WS_BLOCK_K} activation groups and {WS_WEIGHT_BLOCK}-row weight blocks"
    if inter % WS_BLOCK_N:
        return f"the intermediate size must be a multiple of {WS_BLOCK_N} (got {inter})"
    if xq_data.shape[1] % 16:
        return f"gathering x's rows in 16-byte pieces needs the hidden size a multiple of 16 (got {xq_data.shape[1]})"
    if not (xq_data.stride(1) == 1 and tma_readable(w1q_data.view(-1, w1q_data.shape[2]))):
        return "x's rows must be contiguous and W1 TMA-readable (contiguous rows, 16-byte aligned)"
    if xq_data.shape[0] * xq_data.stride(0) >= 2**31:
        return "x must have fewer than 2^31 elements (its rows are addressed by 32-bit offsets)"
    return None


def fp8_fc1_swiglu_ws(
    xq: QTensor,
    w1q: QTensor,
    plan: RoutingPlan,
    h: torch.Tensor | None,
    aq: torch.Tensor,
    a_scale: torch.Tensor,
    *,
    inter: int,
    pow2: bool,
    stages: int = 4,
    programs: int | None = None,
    activation_clamp: float | None = None,
) -> None:
    """h = x[src] @ W1[e]^T (stored in h's dtype unless h is None) and a = silu(gate) * up (with ``activation_clamp``
    c: silu(min(gate, c)) * clamp(up, -c, c), ``ops.activation``; h unclamped) into aq (fp8) with its
    row scales a_scale [P, inter / 128], with ``kernels/fp8_fc1_ws.py`` (callers check ``ws_fc1_unavailable``
    first): xq [R, H] row-scaled source rows, w1q = quantize_w1_fwd(W1) [E, 2I, H]. ``programs``: at most that many
    persistent programs (tests give small problems several tiles a program this way)."""
    clamp_limit, clamp = clamp_kernel_args(activation_clamp)
    # The kernel bounds its sorted-row loads by every sorted row of the buffers (a segment's view indexes them all)
    rows, hidden = plan.sorted_rows, xq.data.shape[1]
    if plan.num_pairs == 0 or xq.data.shape[0] == 0:  # no rows (a rank that receives nothing): nothing to compute
        return
    if w1q.scale.stride(2) != 1:
        raise ValueError("W1's block scales must be contiguous along K")
    # Boxes of 128 gate (or up) rows of W1: a step reads one of each.
    b_desc = weight_descriptor(w1q)
    grid = _grid(1, aq.device, plan.max_tiles * (inter // WS_BLOCK_N), programs)
    save_h = h is not None
    launch(
        ws_kernel("fp8_fc1_ws", "fp8_fc1_swiglu_ws_kernel"),
        grid,
        b_desc,
        xq.data,
        plan.row_src,
        xq.scale,
        w1q.scale,
        h if save_h else aq,
        aq,
        a_scale,
        plan.tile_expert,
        plan.tile_row,
        plan.num_tiles,
        plan.expert_offsets,
        rows,
        inter,
        hidden,
        cdiv(inter, WS_WEIGHT_BLOCK),
        xq.data.stride(0),
        xq.scale.stride(0),
        w1q.scale.stride(0),
        w1q.scale.stride(1),
        h.stride(0) if save_h else 0,
        aq.stride(0),
        a_scale.stride(0),
        clamp_limit,
        SAVE_H=save_h,
        CLAMP=clamp,
        POW2=pow2,
        STAGES=stages,
        TILE_M=QTILE_M,
        LOAD_WARPS=WS_GATHER_LOAD_WARPS,
        LOAD_REGS=WS_GATHER_LOAD_REGS,
        MMA_REGS=WS_GATHER_MMA_REGS,
        num_warps=4,
        maxnreg=168,
    )
