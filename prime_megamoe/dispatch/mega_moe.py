"""The `mega_moe` backend: fused Triton expert kernels, expert-parallel over a group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.capacity import exchange_capacity
from ..comm.collectives import check_group_within_node
from ..comm.factory import make_transport
from ..comm.liveness import wait_bounds
from ..config import DispatchConfig
from ..kernels.tuning import tile_m
from ..ops.ep_pipeline import expert_parallel_experts
from ..ops.expert_compute import routed_experts
from ..ops.quantized_experts import (
    QUANTIZED_PRECISIONS,
    check_precision_supported,
    routed_experts_quantized,
)
from ..validation import check_expert_ids
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
    activation_clamp: float | None = None,
    check_ids: int | None = None,
) -> torch.Tensor:
    """``check_ids`` (E, the expert count of the global ids; ``fused_experts`` passes it where the ids' range is
    checked on the device): a device-side assertion that every id lies in [-1, E). Without expert parallelism the
    routing plan's kernels check the ids as they sort them (no launches of their own); with it,
    ``validation.check_expert_ids`` after the layer."""
    if precision == "bf16":

        def experts(*args, **kwargs):
            return routed_experts(*args, **kwargs, activation_clamp=activation_clamp)

    elif precision in QUANTIZED_PRECISIONS:
        check_precision_supported(precision, hidden_states.device)

        def experts(*args, **kwargs):
            return routed_experts_quantized(
                *args,
                **kwargs,
                precision=precision,
                pow2_scales=options.fp8_pow2_scales,
                activation_clamp=activation_clamp,
                backward_min_expert_work=options.fp8_backward_min_expert_work,
            )
    else:
        raise ValueError(f"precision = {precision!r}; allowed: 'bf16', {', '.join(map(repr, QUANTIZED_PRECISIONS))}")
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        # T = 0 still runs the (empty) kernels, so weight gradients come back as zeros, not None.
        return experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            gate_up_proj,
            down_proj,
            expert_base=0,
            tile_m=tile_m(),
            check_ids=check_ids,
        )
    check_group_within_node(group)
    # Dispatch, expert GEMMs and combine pipelined per source rank (ops/ep_pipeline.py), in every precision.
    bounds = wait_bounds(options.comm_timeout_s, options.comm_stall_timeout_s, hidden_states.device)
    capacity = exchange_capacity(options.max_tokens_per_rank, group, hidden_states, bounds)
    transport = make_transport(options.transport, group, capacity, hidden_states.device, bounds)
    out = expert_parallel_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        transport=transport,
        tile_m=tile_m(),
        precision=precision,
        pow2_scales=options.fp8_pow2_scales,
        activation_clamp=activation_clamp,
    )
    if check_ids is not None:  # after the layer's launches: off the host's path to its first GEMM
        check_expert_ids(top_k_index, check_ids, sync=False)
    return out
