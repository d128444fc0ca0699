"""Routing metadata on the device: which rows each local expert takes, in which order, in which tiles.

Everything here is a handful of small device ops (sort, scatter-add, cumsum, searchsorted) with static output sizes,
so it never reads a count back to the host and the layer can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    local = top_k_index.reshape(-1).to(torch.int64) - expert_base
    is_local = (local >= 0) & (local < num_local_experts)
    key = torch.where(is_local, local, torch.full_like(local, num_local_experts))

    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    expert_offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts[:num_local_experts], 0, out=expert_offsets[1:])

    pair_pos = torch.empty(num_pairs, dtype=torch.int64, device=device)
    pair_pos.scatter_(0, order, torch.arange(num_pairs, device=device))
    pair_pos = torch.where(is_local, pair_pos, torch.full_like(pair_pos, -1))

    tiles_per_expert = (counts[:num_local_experts] + tile_m - 1) // tile_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    max_tiles = (num_pairs + tile_m - 1) // tile_m + num_local_experts
    tile_ids = torch.arange(max_tiles, device=device)
    tile_expert = torch.searchsorted(tile_end, tile_ids, right=True).clamp_(max=num_local_experts - 1)
    tile_first = (tile_end - tiles_per_expert)[tile_expert]
    tile_row = expert_offsets[tile_expert] + (tile_ids - tile_first) * tile_m

    return RoutingPlan(
        num_rows=num_rows,
        top_k=top_k,
        num_local_experts=num_local_experts,
        tile_m=tile_m,
        expert_offsets=expert_offsets.to(torch.int32),
        row_src=(order // top_k).to(torch.int32),
        row_weight=top_k_weights.reshape(-1)[order].to(torch.float32),
        pair_pos=pair_pos.view(num_rows, top_k).to(torch.int32),
        tile_expert=tile_expert.to(torch.int32),
        tile_row=tile_row.to(torch.int32),
        num_tiles=tile_end[-1:].to(torch.int32),
    )
