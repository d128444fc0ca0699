"""Input checks shared by every backend: shapes, dtypes, expert ids, capacity.

Each error names the problem and the fix. Shape checks are free (no device sync); the expert-id range check needs the
values, so it either syncs once (``validate_routing = true``) or becomes a device-side assertion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .kernels.routing import expert_ids_in_range_kernel
from .kernels.tuning import interpreting
from .ops.compiled_launch import launch
from .ops.sizes import cdiv


@dataclass(frozen=True)
class ExpertShapes:
    """Sizes of one MoE call, as seen by one rank."""

    num_tokens: int  # T on this rank
    hidden: int  # H
    intermediate: int  # I
    top_k: int  # k
    num_local_experts: int  # E_local
    world: int  # W, the expert-parallel group size
    rank: int  # this rank's index in the group

    @property
    def num_experts(self) -> int:
        return self.num_local_experts * self.world


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of ``group``; ``None`` means a single rank."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_expert_inputs(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    group: dist.ProcessGroup | None,
    max_tokens_per_rank: int | None = None,
) -> ExpertShapes:
    """Validate shapes and dtypes of a ``fused_experts`` call and return its sizes."""
    if hidden_states.dim() != 2:
        raise ValueError(
            f"hidden_states must be 2-D [T, H], got shape {tuple(hidden_states.shape)}; flatten batch and sequence "
            "first"
        )
    if top_k_index.dim() != 2 or top_k_weights.dim() != 2:
        raise ValueError(
            f"top_k_index and top_k_weights must be 2-D [T, k], got {tuple(top_k_index.shape)} "
            f"and {tuple(top_k_weights.shape)}"
        )
    num_tokens, hidden = hidden_states.shape
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != num_tokens:
        raise ValueError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} must both be "
            f"[T, k] with T = {num_tokens} (hidden_states' first dim)"
        )
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if hidden_states.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise TypeError(f"hidden_states must be bfloat16, float16 or float32, got {hidden_states.dtype}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"gate_up_proj must be [E_local, 2*I, H] and down_proj [E_local, H, I]; got {tuple(gate_up_proj.shape)} "
            f"and {tuple(down_proj.shape)}"
        )
    num_local, two_i, h_w = gate_up_proj.shape
    if h_w != hidden or two_i % 2:
        raise ValueError(f"gate_up_proj must be [E_local, 2*I, H] with H = {hidden}, got {tuple(gate_up_proj.shape)}")
    inter = two_i // 2
    if tuple(down_proj.shape) != (num_local, hidden, inter):
        raise ValueError(
            f"down_proj must be [E_local, H, I] = [{num_local}, {hidden}, {inter}] to match gate_up_proj "
            f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}"
        )
    if gate_up_proj.dtype != hidden_states.dtype or down_proj.dtype != hidden_states.dtype:
        raise TypeError(
            f"gate_up_proj ({gate_up_proj.dtype}) and down_proj ({down_proj.dtype}) must have hidden_states' dtype "
            f"({hidden_states.dtype}); cast the weights or the activations"
        )
    devices = {t.device for t in (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    rank, world = group_rank_and_size(group)
    if max_tokens_per_rank is not None and num_tokens > max_tokens_per_rank:
        raise ValueError(
            f"{num_tokens} tokens on rank {rank} exceed max_tokens_per_rank = {max_tokens_per_rank}; raise "
            f"[model.moe.dispatch] max_tokens_per_rank or pass fewer tokens per call"
        )
    return ExpertShapes(num_tokens, hidden, inter, top_k_index.shape[1], num_local, world, rank)


def expert_id_error(num_experts: int) -> str:
    """The device-side check's message (the host check names the id it found)."""
    return f"top_k_index holds an expert id outside [0, {num_experts}) that is not -1 (an empty slot)"


def check_expert_ids(top_k_index: torch.Tensor, num_experts: int, *, sync: bool) -> None:
    """Every id must lie in [0, num_experts), or be -1: an empty slot (a dropped token-expert pair, which adds
    nothing to the output and gets a zero weight gradient). ``sync`` checks on the host (clear message, one device
    sync); otherwise a device-side assertion keeps the call free of host syncs (on a GPU, or in the Triton
    interpreter: a flag, one small kernel and the assertion, three launches where the elementwise checks took six)."""
    if top_k_index.numel() == 0:
        return
    message = expert_id_error(num_experts)
    if not sync and (top_k_index.is_cuda or interpreting()):
        torch._assert_async(expert_ids_in_range(top_k_index, num_experts), message)
        return
    bad = (top_k_index < -1) | (top_k_index >= num_experts)
    if sync:
        if bool(bad.any()):
            first = top_k_index[bad][0].item()
            raise ValueError(
                f"top_k_index holds expert id {first}, outside [0, {num_experts}) and not -1 (an empty slot); ids "
                f"are global: E = E_local * ep_size = {num_experts}"
            )
    else:
        torch._assert_async(~bad.any(), message)


def expert_ids_in_range(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [1] on the ids' device: 1 if every id lies in [0, num_experts) or is -1, else 0; computed on the
    device."""
    ok = torch.ones(1, dtype=torch.int32, device=top_k_index.device)
    block = 64 if interpreting() else 4096
    launch(
        expert_ids_in_range_kernel,
        (cdiv(top_k_index.numel(), block),),
        top_k_index.reshape(-1),
        ok,
        top_k_index.numel(),
        num_experts,
        BLOCK=block,
        num_warps=4,
    )
    return ok
