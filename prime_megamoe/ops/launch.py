"""Host-side launchers for the grouped-GEMM and combine kernels: grids, strides, dtype flags."""

from __future__ import annotations

import torch

from ..kernels import tuning
from ..kernels.combine import combine_rows_kernel, sum_blocks_kernel
from ..kernels.grouped_gemm import fc1_swiglu_kernel, grouped_gemm_kernel, grouped_wgrad_kernel
from ..kernels.swiglu_grad import swiglu_backward_rows_kernel
from . import kernel_choice
from .activation import clamp_kernel_args
from .bf16_ws_launch import (
    bf16_fc1_swiglu_ws,
    bf16_fc1_ws_unavailable,
    bf16_grouped_gemm_ws,
    bf16_grouped_wgrad_ws,
    bf16_wgrad_ws_unavailable,
    bf16_ws_unavailable,
)
from .compiled_launch import launch
from .routing_plan import RoutingPlan
from .sizes import cdiv, next_power_of_2
from .sm_budget import available_sms, cuda_properties
from .tma import tma_descriptor, tma_readable

# Every persistent grid's size (here, ``fp8_ws_launch._grid``, the one-pass SwiGLU backward): the device's SMs within
# the SM budget in effect (``sm_budget``: ``[model.moe.dispatch] num_sms``).
_num_sms = available_sms
_cuda_properties = cuda_properties


# ``use_ws=FASTEST``: the warp-specialised kernel where it applies and was timed faster for the shape
# (``kernel_choice.fastest``), else the Triton kernel.
FASTEST = "fastest"
# What the one-rank layer's bf16 GEMMs ask for (``expert_compute``): FC1 + SwiGLU, and FC2 and the two dgrads. The
# Triton kernels until the layer with FASTEST is measured against them on a GPU. (The expert-parallel stages do not
# ask: a rank that times a GEMM waits on the host for its stream, which may wait on a peer's.)
LAYER_FC1_WS = LAYER_WS = False


def ws_if_faster(op: str, key: tuple, plan: RoutingPlan, work_per_row: int, device, run) -> bool:
    """Whether ``op`` at ``key`` (and the plan's row count, to a power of 2) runs its warp-specialised kernel:
    ``run(use_ws)`` computes it with either family into the same outputs; ``work_per_row``: multiply-adds a row."""
    rows = plan.num_pairs
    candidates = {"triton": lambda: run(False), "ws": lambda: run(True)}
    key = (*key, next_power_of_2(max(rows, 1)))
    return kernel_choice.fastest(op, key, candidates, device, rows * work_per_row) == "ws"


def use_form(asked: bool | None, flag: str, what: str, why_not, *args, **kwargs) -> bool:
    """Whether a launcher runs a kernel's other form (warp-specialised, Gluon, one-pass), as its ``flag`` argument
    ``asked`` says: False: no (``why_not`` is not called); None: where ``why_not(*args, **kwargs)`` gives None;
    True: yes, or a ValueError naming the flag, ``what`` and the reason."""
    if asked is False:
        return False
    reason = why_not(*args, **kwargs)
    if asked and reason is not None:
        raise ValueError(f"{flag}=True: {what} cannot run here: {reason}")
    return reason is None


def _flags(t: torch.Tensor) -> dict:
    return {"CAST_F32": tuning.interpreting(), "IEEE": t.dtype == torch.float32}


def _tile_grid(plan: RoutingPlan, n: int, num_sms: int, cols_per_program: int = 1):
    """Grid of a tile-list kernel: one program per (column block, row block: a tile or a BLOCK_M part of one), or
    one per SM of the budget (``_num_sms``) when persistent."""

    def grid(meta):
        if meta["PERSISTENT"]:
            return (num_sms, 1)
        return (cdiv(n, cols_per_program * meta["BLOCK_N"]), plan.max_tiles * (plan.tile_m // meta["BLOCK_M"]))

    return grid


def _tile_args(plan: RoutingPlan):
    return plan.tile_expert, plan.tile_row, plan.num_tiles, plan.expert_offsets


def fc1_swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    plan: RoutingPlan,
    save_h: bool,
    out=None,
    row_base: int = 0,
    *,
    activation_clamp: float | None = None,
    use_ws: bool | None | str = False,
):
    """x [R, H] (source rows), w1 [E, 2I, H] -> (h [P, 2I] or None, a [P, I]) in expert-sorted row order.
    ``out`` = (h or None, a): buffers to write into (a segment view's rows of buffers shared by all segments).
    ``row_base``: x holds source rows [row_base, row_base + len(x)) (the plan's rows that this launch reads).
    ``activation_clamp`` c: a = silu(min(g, c)) * clamp(u, -c, c) (``ops.activation``); h is stored unclamped.
    ``use_ws``: True runs the warp-specialised Hopper kernel (``bf16_ws_launch.bf16_fc1_swiglu_ws``; an error says
    why where it cannot), None runs it where it applies, ``FASTEST`` where it applies and is faster, False the
    Triton kernel."""
    clamp_limit, clamp = clamp_kernel_args(activation_clamp)
    num_pairs, inter, hidden = plan.num_pairs, w1.shape[1] // 2, w1.shape[2]
    if out is None:
        a = x.new_empty(plan.sorted_rows, inter)
        h = x.new_empty(plan.sorted_rows, 2 * inter) if save_h else a  # a stands in for the unused pointer
    else:
        h, a = out
        h = h if save_h else a
    if use_ws == FASTEST:
        use_ws = bf16_fc1_ws_unavailable(x, w1) is None and ws_if_faster(
            "fc1_swiglu",
            (inter, hidden, w1.shape[0], save_h, clamp),
            plan,
            2 * inter * hidden,
            x.device,
            lambda ws: fc1_swiglu(x, w1, plan, save_h, (h, a), row_base, activation_clamp=activation_clamp, use_ws=ws),
        )
    if use_form(use_ws, "use_ws", "fc1_swiglu's warp-specialised kernel", bf16_fc1_ws_unavailable, x, w1):
        h = h if save_h else None
        bf16_fc1_swiglu_ws(x, w1, plan, h, a, row_base=row_base, clamp_limit=clamp_limit, clamp=clamp)
        return h, a
    num_sms = _num_sms(x.device)
    launch(
        fc1_swiglu_kernel,
        _tile_grid(plan, inter, num_sms),
        x,
        plan.row_src,
        w1,
        h,
        a,
        *_tile_args(plan),
        inter,
        hidden,
        num_pairs,
        num_sms,
        row_base,
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        w1.stride(2),
        h.stride(0),
        a.stride(0),
        clamp_limit,
        SAVE_H=save_h,
        CLAMP=clamp,
        TILE_M=plan.tile_m,
        **_flags(x),
    )
    return (h if save_h else None), a


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutingPlan,
    *,
    transpose_b: bool,
    gather: bool = False,
    row_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    row_base: int = 0,
    use_tma: bool | None = None,
    use_ws: bool | None | str = False,
) -> torch.Tensor:
    """C[r] = scale[r] * A[src[r] - row_base if gather else r] @ op(B[e]); op(B) = B[e]^T if transpose_b else B[e].
    ``row_base`` (gather only): A holds source rows [row_base, row_base + len(A)), as in ``fc1_swiglu``.
    ``use_tma``: read B, and A when it is not gathered, by TMA (default: where ``tma_readable``).
    ``use_ws``: True runs the warp-specialised Hopper kernel (``bf16_ws_launch``; an error says why where it cannot),
    None runs it where it applies, ``FASTEST`` where it applies and is faster, False the Triton kernel."""
    if row_base and not gather:
        raise ValueError("grouped_gemm: row_base applies to gathered rows only (gather=True)")
    if transpose_b:  # B[e] is [N, K]
        n, k = b.shape[1], b.shape[2]
        stride_bk, stride_bn = b.stride(2), b.stride(1)
    else:  # B[e] is [K, N]
        k, n = b.shape[1], b.shape[2]
        stride_bk, stride_bn = b.stride(1), b.stride(2)
    what = "grouped_gemm's warp-specialised kernel"
    if use_ws == FASTEST:
        available = bf16_ws_unavailable(a, b, transpose_b=transpose_b, gather=gather, row_base=row_base) is None
        out = a.new_empty(plan.sorted_rows, n) if out is None else out
        flags = (transpose_b, gather, row_scale is not None, use_tma)
        use_ws = available and ws_if_faster(
            "grouped_gemm",
            (n, k, b.shape[0], *flags),
            plan,
            n * k,
            a.device,
            lambda ws: grouped_gemm(
                a,
                b,
                plan,
                transpose_b=transpose_b,
                gather=gather,
                row_scale=row_scale,
                out=out,
                row_base=row_base,
                use_tma=use_tma,
                use_ws=ws,
            ),
        )
    if use_form(
        use_ws, "use_ws", what, bf16_ws_unavailable, a, b, transpose_b=transpose_b, gather=gather, row_base=row_base
    ):
        c = a.new_empty(plan.sorted_rows, n) if out is None else out
        bf16_grouped_gemm_ws(a, b, plan, c, transpose_b=transpose_b, gather=gather, row_scale=row_scale)
        return c
    # The weights as one 2D tensor, [E * N, K] (transpose_b) or [E * K, N], where TMA may read them
    b_2d = b.view(-1, b.shape[2]) if use_tma is not False and b.is_contiguous() else None
    if use_tma is None:
        use_tma = b_2d is not None and tma_readable(b_2d) and (gather or tma_readable(a))
    a_desc = b_desc = None
    if use_tma:
        if b_2d is None:
            raise ValueError("grouped_gemm: use_tma=True needs contiguous weights (they are read as one 2D tensor)")
        # The boxes are set per config by the autotuner's pre-launch hook (tuning.gemm_tma_boxes)
        b_desc = tma_descriptor(b_2d)
        a_desc = None if gather else tma_descriptor(a)
    c = a.new_empty(plan.sorted_rows, n) if out is None else out
    num_sms = _num_sms(a.device)
    launch(
        grouped_gemm_kernel,
        _tile_grid(plan, n, num_sms),
        a_desc,
        b_desc,
        a,
        plan.row_src,
        b,
        c,
        row_scale if row_scale is not None else plan.row_weight,
        *_tile_args(plan),
        n,
        k,
        plan.num_pairs,
        num_sms,
        row_base,
        a.stride(0),
        b.stride(0),
        stride_bk,
        stride_bn,
        c.stride(0),
        GATHER_A=gather,
        SCALE_ROWS=row_scale is not None,
        A_TMA=a_desc is not None,
        B_TMA=use_tma,
        B_KMAJOR=transpose_b,
        TILE_M=plan.tile_m,
        **_flags(a),
    )
    return c


def dswiglu_buffers(dy: torch.Tensor, w2: torch.Tensor, plan: RoutingPlan):
    """(g_a, dh, aw, dw_row) sized for every sorted row of ``plan``, for ``fc2_dgrad_dswiglu(out=...)``."""
    return dy.new_empty(plan.sorted_rows, w2.shape[2]), *_dswiglu_pass_buffers(dy, w2, plan)


def _dswiglu_pass_buffers(dy: torch.Tensor, w2: torch.Tensor, plan: RoutingPlan):
    """The SwiGLU backward pass's outputs (dh, aw, dw_row) for every sorted row of ``plan``."""
    inter, rows = w2.shape[2], plan.sorted_rows
    return (
        dy.new_empty(rows, 2 * inter),
        dy.new_empty(rows, inter),
        torch.empty(rows, dtype=torch.float32, device=dy.device),
    )


def fc2_dgrad_dswiglu(
    dy: torch.Tensor,
    w2: torch.Tensor,
    h: torch.Tensor,
    plan: RoutingPlan,
    out=None,
    row_base: int = 0,
    *,
    activation_clamp: float | None = None,
    use_ws: bool | None | str = False,
):
    """From dy [R, H] (source rows): (dh [P, 2I], aw [P, I] = w * a, dw_row [P] = <dy W2, a>) in sorted order: the
    FC2 dgrad GEMM g_a = dy[src - row_base] @ W2[e], then the SwiGLU backward row pass (``kernels.swiglu_grad``).
    ``out``: buffers from ``dswiglu_buffers`` shared by all segments; the rows of ``plan``'s tiles are written.
    ``row_base``: dy holds source rows [row_base, row_base + len(dy)), as in ``fc1_swiglu``. ``activation_clamp``:
    the clamped SwiGLU's (the forward's) limit: a is the clamped one and dh is zero where g or u was clamped.
    ``use_ws``: the GEMM's, as ``grouped_gemm``'s."""
    clamp_limit, clamp = clamp_kernel_args(activation_clamp)
    g_a = dy.new_empty(plan.sorted_rows, w2.shape[2]) if out is None else out[0]
    grouped_gemm(dy, w2, plan, transpose_b=False, gather=True, out=g_a, row_base=row_base, use_ws=use_ws)
    # The pass's outputs allocated after the GEMM's launch: off the host's path to the backward's first kernel
    dh, aw, dw_row = _dswiglu_pass_buffers(dy, w2, plan) if out is None else out[1:]
    inter = w2.shape[2]
    block_r = plan.tile_m if tuning.interpreting() else 16
    block_c = min(next_power_of_2(inter), 64 if tuning.interpreting() else 128)
    launch(
        swiglu_backward_rows_kernel,
        (plan.max_tiles * (plan.tile_m // block_r),),
        g_a,
        h,
        plan.row_weight,
        dh,
        aw,
        dw_row,
        *_tile_args(plan),
        inter,
        g_a.stride(0),
        h.stride(0),
        dh.stride(0),
        aw.stride(0),
        clamp_limit,
        TILE_M=plan.tile_m,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        CLAMP=clamp,
        num_warps=4,
    )
    return dh, aw, dw_row


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutingPlan,
    out: torch.Tensor,
    *,
    gather_a: bool,
    gather_b: bool,
    use_tma: bool | None = None,
    use_ws: bool | None = False,
) -> torch.Tensor:
    """out[e] = A[rows of e]^T @ B[rows of e] with A [*, M], B [*, N], out [E, M, N]; exactly one operand is gathered
    (indexed by the source row of each sorted row), the other is in sorted row order. Expert e's rows of every segment
    are reduced, in segment order. ``use_tma``: read the sorted operand by TMA (default: where ``tma_readable``).
    ``use_ws``: True runs the warp-specialised Hopper kernel (``bf16_ws_launch.bf16_grouped_wgrad_ws``; an error says
    why where it cannot), None runs it where it applies, False the Triton kernel."""
    if gather_a == gather_b:
        raise ValueError("grouped_wgrad: exactly one of gather_a / gather_b must be set (one operand is gathered)")
    what = "grouped_wgrad's warp-specialised kernel"
    if use_form(use_ws, "use_ws", what, bf16_wgrad_ws_unavailable, a, b, out, gather_a=gather_a):
        bf16_grouped_wgrad_ws(a, b, plan, out, gather_a=gather_a)
        return out
    dense, gathered = (b, a) if gather_a else (a, b)
    if use_tma is None:
        use_tma = tma_readable(dense)
    # The descriptor's block shape is set per config by the autotuner's pre-launch hook (tuning.dense_chunk_shape).
    desc = tma_descriptor(dense) if use_tma else None
    m, n = a.shape[1], b.shape[1]
    grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), plan.num_local_experts)
    launch(
        grouped_wgrad_kernel,
        grid,
        desc,
        dense,
        gathered,
        plan.row_src,
        out,
        plan.expert_offsets,
        m,
        n,
        plan.num_pairs,
        plan.num_segments,
        plan.num_local_experts + 1,
        dense.stride(0),
        gathered.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        DENSE_A=not gather_a,
        USE_TMA=use_tma,
        **_flags(a),
    )
    return out


def combine_rows(
    src: torch.Tensor,
    pair_pos: torch.Tensor,
    out_dtype: torch.dtype,
    out=None,
    *,
    pair_src: torch.Tensor | None = None,
    pair_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [R, H]: out[r] = sum_j src[pair_pos[r, j]] (fixed slot order, fp32 sum), zeros where no slot is local.
    ``out``: a row-contiguous [R, H] tensor to write into (it may live on a peer GPU). With ``pair_src`` (a value
    per sorted row) and ``pair_out`` (contiguous [R, k]), the same launch also writes pair_out[r, j] =
    pair_src[pair_pos[r, j]], zero where the slot is not local (``RoutingPlan.pair_values``)."""
    rows, top_k = pair_pos.shape
    hidden = src.shape[1]
    if out is None:
        out = torch.empty(rows, hidden, dtype=out_dtype, device=src.device)
    pair_values = pair_src is not None
    if pair_values != (pair_out is not None):
        raise ValueError("combine_rows: pass pair_src and pair_out together")
    if pair_values and (tuple(pair_out.shape) != (rows, top_k) or not pair_out.is_contiguous()):
        raise ValueError(
            f"combine_rows: pair_out must be contiguous [{rows}, {top_k}], got "
            f"{tuple(pair_out.shape)} with strides {pair_out.stride()}"
        )
    if rows == 0:
        return out
    # A row a program on the GPU (1024 columns of it); under the interpreter 16 rows of 64 columns, so that its
    # per-program Python work is paid once for many rows and tests still cross row and column block edges.
    block_r, block_h = (16, 64) if tuning.interpreting() else (1, 1024)
    block_h = min(next_power_of_2(hidden), block_h)
    launch(
        combine_rows_kernel,
        (cdiv(rows, block_r), cdiv(hidden, block_h)),
        src,
        pair_pos,
        out,
        pair_src if pair_values else src,
        pair_out if pair_values else out,
        rows,
        hidden,
        src.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        PAIR_VALUES=pair_values,
        K_BLOCK=next_power_of_2(top_k),
        num_warps=4,
    )
    return out


def sum_blocks(blocks: torch.Tensor, num_rows: int, out_dtype: torch.dtype) -> torch.Tensor:
    """blocks [W, C, N] -> [num_rows, N]: out[t] = sum over W of blocks[:, t] in rank order (fp32), in one pass."""
    world, _, cols = blocks.shape
    out = torch.empty(num_rows, cols, dtype=out_dtype, device=blocks.device)
    if num_rows == 0:
        return out
    # A few rows per program: a program per row would mostly pay launch and (in the interpreter) per-program costs.
    block_c = min(next_power_of_2(cols), 64 if tuning.interpreting() else 512)
    block_r = max(1, min(32, 4096 // block_c))
    launch(
        sum_blocks_kernel,
        (cdiv(num_rows, block_r), cdiv(cols, block_c)),
        blocks,
        out,
        num_rows,
        cols,
        blocks.stride(0),
        blocks.stride(1),
        out.stride(0),
        NUM_BLOCKS=world,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return out
