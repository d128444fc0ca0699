"""Routing metadata on the device: which rows each local expert takes, in which order, in which tiles.

Two small kernels around one device sort, with static output sizes: no count is ever read back to the host, the host
spends little time issuing it, and the layer can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..kernels.routing import routing_keys_kernel, routing_plan_kernel


@dataclass
class RoutingPlan:
    """(source row, slot) pairs that hit this rank's experts, sorted by local expert then by pair index.

    ``num_pairs`` = rows * k is a static bound; sorted rows past the device-side total are never touched.
    """

    num_rows: int  # R: rows of the source (tokens on one rank, or W * capacity with expert parallelism)
    top_k: int
    num_local_experts: int
    tile_m: int
    expert_offsets: torch.Tensor  # [E_local + 1] int32: expert e owns sorted rows [off[e], off[e+1])
    row_src: torch.Tensor  # [R*k] int32: source row of each sorted row
    row_weight: torch.Tensor  # [R*k] fp32: top-k weight of each sorted row
    pair_pos: torch.Tensor  # [R, k] int32: sorted row of each (row, slot) pair, -1 where the expert is not local
    tile_expert: torch.Tensor  # [max_tiles] int32
    tile_row: torch.Tensor  # [max_tiles] int32: first sorted row of each tile
    num_tiles: torch.Tensor  # [1] int32: tiles actually in use

    @property
    def num_pairs(self) -> int:
        return self.num_rows * self.top_k

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.numel()

    def pair_values(self, row_values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[R, k] from per-sorted-row values [P]: each (row, slot) pair's value, zero where its expert is elsewhere."""
        pos = self.pair_pos.long()
        return torch.where(pos >= 0, row_values[pos.clamp(min=0)], 0.0).to(dtype)


def build_routing_plan(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    expert_base: int,
    num_local_experts: int,
    tile_m: int,
) -> RoutingPlan:
    """Plan for source rows with global expert ids ``top_k_index`` [R, k] (ids outside
    [expert_base, expert_base + E_local), including -1 for padding rows, are other ranks' and skipped)."""
    num_rows, top_k = top_k_index.shape
    device = top_k_index.device
    num_pairs = num_rows * top_k
    max_tiles = (num_pairs + tile_m - 1) // tile_m + num_local_experts
    index = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1)

    keys = torch.empty(num_pairs, dtype=torch.int32, device=device)
    counts = torch.zeros(num_local_experts, dtype=torch.int32, device=device)
    block = 1024
    grid = (max(triton.cdiv(num_pairs, block), 1),)
    routing_keys_kernel[grid](
        index, keys, counts, num_pairs, expert_base,
        NUM_LOCAL=num_local_experts, NUM_BINS=triton.next_power_of_2(num_local_experts + 1), BLOCK=block,
    )
    # Stable: within an expert, rows keep the pair order (row-major over (row, slot)), so results are reproducible.
    order = torch.sort(keys, stable=True).indices

    plan = RoutingPlan(
        num_rows=num_rows,
        top_k=top_k,
        num_local_experts=num_local_experts,
        tile_m=tile_m,
        expert_offsets=torch.empty(num_local_experts + 1, dtype=torch.int32, device=device),
        row_src=torch.empty(num_pairs, dtype=torch.int32, device=device),
        row_weight=torch.empty(num_pairs, dtype=torch.float32, device=device),
        pair_pos=torch.empty(num_rows, top_k, dtype=torch.int32, device=device),
        tile_expert=torch.empty(max_tiles, dtype=torch.int32, device=device),
        tile_row=torch.empty(max_tiles, dtype=torch.int32, device=device),
        num_tiles=torch.empty(1, dtype=torch.int32, device=device),
    )
    routing_plan_kernel[grid](
        order, weights, counts,
        plan.row_src, plan.row_weight, plan.pair_pos, plan.expert_offsets, plan.tile_expert, plan.tile_row,
        plan.num_tiles, num_pairs, max_tiles,
        TOP_K=top_k, NUM_LOCAL=num_local_experts, EXPERT_BLOCK=triton.next_power_of_2(num_local_experts),
        TILE_M=tile_m, BLOCK=block, TILE_BLOCK=32,
    )
    return plan
