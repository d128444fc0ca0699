"""The `mega_moe` backend: fused Triton expert kernels, expert-parallel over a group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import DispatchConfig
from ..kernels.tuning import tile_m
from ..ops.expert_compute import routed_experts
from .registry import register_backend


@register_backend("mega_moe")
def mega_moe_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    precision: str,
    group: dist.ProcessGroup | None,
    options: DispatchConfig,
) -> torch.Tensor:
    if precision != "bf16":
        raise NotImplementedError(f"mega_moe precision = {precision!r} is not implemented yet; use 'bf16'")
    world = 1 if group is None else dist.get_world_size(group)
    if world > 1:
        raise NotImplementedError("mega_moe with expert parallelism (ep > 1) is not implemented yet")
    if hidden_states.shape[0] == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    return routed_experts(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, expert_base=0, tile_m=tile_m()
    )
