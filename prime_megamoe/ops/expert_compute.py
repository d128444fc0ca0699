"""Autograd for the routed experts of one rank, wired from the fused kernels (bf16 / fp32, unquantised).

Forward:  FC1 (gather rows, SwiGLU epilogue) -> FC2 (top-k weight epilogue) -> combine (k rows per source row, fixed
order). Backward: FC2 dgrad (gathering dy) -> the SwiGLU backward row pass (dh, w * a and the top-k weight gradient's
per-row dot) -> FC1 dgrad -> combine into dx; weight gradients as grouped GEMMs reducing over each expert's rows.

What the forward saves: the source rows (the caller holds them anyway), the routing plan (leased from a pool of plans
of its sizes until the graph is freed: ``routing_plan.PlanLease``), and the FC1 output
h = x W1^T ([P, 2I], P = rows * k). Saving h instead of recomputing FC1 costs P * 2I * 2 bytes in bf16: at the
Qwen3-30B-A3B shape and T = 16384, 131072 * 1536 * 2 = 403 MB per layer (Qwen3-235B-A22B: 805 MB), and saves an FC1
GEMM (a third of the forward FLOPs) in the backward. Trainers that checkpoint activations re-run the forward of one
layer just before its backward, so only one layer's h is alive at a time. The SwiGLU output a is not saved: the
backward recomputes it from h in the SwiGLU backward pass. With ``activation_clamp`` (the clamped SwiGLU,
``ops.activation``) h is saved unclamped and both the forward and the backward clamp it in their kernels; nothing
else changes.
"""

from __future__ import annotations

import torch

from . import launch
from .activation import check_activation_clamp
from .cuda_thread import binds_cuda_context
from .routing_plan import RoutingPlan, lease_routing_plan
from .sm_budget import in_kept_sm_budget, keeps_sm_budget


def unquantized_forward(rows, w1, w2, plan: RoutingPlan, save_h: bool, activation_clamp: float | None = None):
    """FC1 + SwiGLU (clamped with ``activation_clamp``), FC2 + top-k weight, combine: (out [R, H], h [P, 2I] or
    None)."""
    h, act = launch.fc1_swiglu(
        rows, w1, plan, save_h=save_h, activation_clamp=activation_clamp, use_ws=launch.LAYER_FC1_WS
    )
    # The Triton FC2 reads by pointer: TMA reads measured no faster here (0.731 against 0.738 ms at Qwen3-30B-A3B,
    # T = 16384, one H200) and cost host time per launch, which single forwards wait on.
    out_sorted = launch.grouped_gemm(
        act, w2, plan, transpose_b=True, row_scale=plan.row_weight, use_tma=False, use_ws=launch.LAYER_WS
    )
    return launch.combine_rows(out_sorted, plan.pair_pos, rows.dtype), h


def combine_with_pair_values(dx_sorted, dw_row, plan: RoutingPlan, dx_dtype, weights_dtype):
    """(dx [R, H], d top-k weights [R, k] or None when ``weights_dtype`` is None) in one combine launch."""
    if weights_dtype is None:
        return launch.combine_rows(dx_sorted, plan.pair_pos, dx_dtype), None
    grad_weights = torch.empty(plan.pair_pos.shape, dtype=weights_dtype, device=dx_sorted.device)
    grad_rows = launch.combine_rows(dx_sorted, plan.pair_pos, dx_dtype, pair_src=dw_row, pair_out=grad_weights)
    return grad_rows, grad_weights


def unquantized_backward(
    grad_out, rows, w1, w2, h, plan: RoutingPlan, needs_input_grad, *, weights_dtype, activation_clamp=None
):
    """The backward's GEMMs in the inputs' dtype, from what a forward saved (rows, w1, w2, h, the plan):
    (d rows, d top-k weights, d w1, d w2), each None unless ``needs_input_grad`` (the forward's: rows, top_k_index,
    top_k_weights, w1, w2) asks for it. Also the quantised precisions' backward where it would not pay
    (``quantized_experts``)."""
    grad_out = grad_out.contiguous().to(rows.dtype)
    dh, aw, dw_row = launch.fc2_dgrad_dswiglu(
        grad_out, w2, h, plan, activation_clamp=activation_clamp, use_ws=launch.LAYER_WS
    )

    grad_rows = grad_weights = grad_w1 = grad_w2 = None
    if needs_input_grad[0]:
        dx_sorted = launch.grouped_gemm(dh, w1, plan, transpose_b=False, use_ws=launch.LAYER_WS)
        grad_rows, grad_weights = combine_with_pair_values(
            dx_sorted, dw_row, plan, rows.dtype, weights_dtype if needs_input_grad[2] else None
        )
    elif needs_input_grad[2]:
        grad_weights = plan.pair_values(dw_row, weights_dtype)
    # The weight gradients on the warp-specialised Hopper kernel where it applies (bf16 on sm_90:
    # ``bf16_ws_launch.bf16_grouped_wgrad_ws``), else the Triton kernel.
    if needs_input_grad[3]:
        grad_w1 = launch.grouped_wgrad(dh, rows, plan, torch.empty_like(w1), gather_a=False, gather_b=True, use_ws=None)
    if needs_input_grad[4]:
        grad_w2 = launch.grouped_wgrad(
            grad_out, aw, plan, torch.empty_like(w2), gather_a=True, gather_b=False, use_ws=None
        )
    return grad_rows, grad_weights, grad_w1, grad_w2


def _forward(
    rows,
    top_k_index,
    top_k_weights,
    w1,
    w2,
    expert_base: int,
    tile_m: int,
    need_grad: bool,
    activation_clamp=None,
    check_ids: int | None = None,
):
    """(out [R, H], the plan's lease, h or None): a pooled plan (``routing_plan.PlanLease``), so no allocation on the
    host's path to the first GEMM. ``check_ids``: see ``routed_experts``."""
    lease = lease_routing_plan(
        top_k_index,
        top_k_weights,
        expert_base=expert_base,
        num_local_experts=w1.shape[0],
        tile_m=tile_m,
        check_ids_below=check_ids,
    )
    out, h = unquantized_forward(
        rows.contiguous(), w1, w2, lease.plan, save_h=need_grad, activation_clamp=activation_clamp
    )
    if check_ids is not None:  # after the GEMMs' launches: off the host's path to the first one
        lease.plan.assert_ids_in_range(check_ids)
    return out, lease, h


class RoutedExperts(torch.autograd.Function):
    """rows [R, H], top_k_index [R, k] (global ids), top_k_weights [R, k], w1 [E_l, 2I, H], w2 [E_l, H, I]
    -> out [R, H]: for each row, the weighted sum over the slots whose expert lives here (zeros if none). The backward
    runs within the SM budget its forward ran in (``sm_budget``: ``[model.moe.dispatch] num_sms``)."""

    @staticmethod
    @keeps_sm_budget
    def forward(
        ctx,
        rows,
        top_k_index,
        top_k_weights,
        w1,
        w2,
        expert_base: int,
        tile_m: int,
        grad_enabled: bool,
        activation_clamp: float | None = None,
        check_ids: int | None = None,
    ):
        rows = rows.contiguous()
        need_grad = grad_enabled and any(ctx.needs_input_grad[i] for i in (0, 2, 3, 4))
        out, lease, h = _forward(
            rows, top_k_index, top_k_weights, w1, w2, expert_base, tile_m, need_grad, activation_clamp, check_ids
        )
        ctx.activation_clamp = activation_clamp
        plan = lease.plan
        if need_grad:
            ctx.save_for_backward(rows, w1, w2, h)
            ctx.plan, ctx.plan_lease = plan, lease  # the lease (and its plan) held until the graph is freed
        ctx.weights_dtype = top_k_weights.dtype
        return out

    @staticmethod
    @binds_cuda_context
    @in_kept_sm_budget
    def backward(ctx, grad_out):
        rows, w1, w2, h = ctx.saved_tensors
        grads = unquantized_backward(
            grad_out,
            rows,
            w1,
            w2,
            h,
            ctx.plan,
            ctx.needs_input_grad,
            weights_dtype=ctx.weights_dtype,
            activation_clamp=ctx.activation_clamp,
        )
        return grads[0], None, *grads[1:], None, None, None, None, None


def routed_experts(
    rows,
    top_k_index,
    top_k_weights,
    w1,
    w2,
    *,
    expert_base: int,
    tile_m: int,
    activation_clamp: float | None = None,
    check_ids: int | None = None,
) -> torch.Tensor:
    """``activation_clamp``: the clamped SwiGLU's limit (``ops.activation``; None: plain SwiGLU). ``check_ids`` (E,
    the expert count of the global ids): the routing plan's kernels also check that every id lies in [-1, E), and a
    device-side assertion after the forward's launches fails the next sync where one does not (what
    ``validation.check_expert_ids(sync=False)`` checks, without launches of its own); None: not checked here."""
    activation_clamp = check_activation_clamp(activation_clamp)
    if not torch.is_grad_enabled():
        # Nothing to record (inference, the first forward under activation checkpointing): the forward alone,
        # without autograd's bookkeeping on the host's path to the first GEMM (single calls are host-bound).
        return _forward(
            rows, top_k_index, top_k_weights, w1, w2, expert_base, tile_m, False, activation_clamp, check_ids
        )[0]
    return RoutedExperts.apply(
        rows, top_k_index, top_k_weights, w1, w2, expert_base, tile_m, True, activation_clamp, check_ids
    )
