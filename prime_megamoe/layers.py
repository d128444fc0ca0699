"""nn.Modules for trainers that build their own models: router, grouped experts, MoE block."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .config import MoEConfig
from .dispatch.dispatcher import build_dispatcher
from .routing import softmax_top_k
from .validation import group_rank_and_size


class TopKRouter(nn.Module):
    """Qwen3-style router: linear logits, fp32 softmax, top-k, optional renormalisation."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)

    def forward(self, x: torch.Tensor):
        """x [T, H] -> (logits [T, E], top_k_weights [T, k], top_k_index [T, k])."""
        logits = nn.functional.linear(x, self.weight)
        weights, index = softmax_top_k(logits, self.top_k, self.norm_topk_prob)
        return logits, weights, index


class GroupedExperts(nn.Module):
    """This rank's experts, in the transformers / prime-rl layout:
    gate_up_proj [E_local, 2*I, H] (gate rows first, then up rows), down_proj [E_local, H, I]."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, dtype=None, device=None):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=1.0 / math.sqrt(self.gate_up_proj.shape[-1]))
        nn.init.normal_(self.down_proj, std=1.0 / math.sqrt(self.down_proj.shape[-1]))


class MoEBlock(nn.Module):
    """Router + this rank's experts + the configured dispatcher. Input [..., H], output the same shape."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        moe: MoEConfig | None = None,
        *,
        norm_topk_prob: bool = True,
        group: dist.ProcessGroup | None = None,
        dtype=None,
        device=None,
    ):
        super().__init__()
        moe = moe or MoEConfig()
        _, world = group_rank_and_size(group)
        if num_experts % world:
            raise ValueError(
                f"num_experts = {num_experts} is not divisible by the expert-parallel size {world}; choose ep "
                f"([model.moe] ep) so that it divides the number of experts"
            )
        self.num_experts = num_experts
        self.router = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        if dtype is not None or device is not None:
            self.router.to(dtype=dtype, device=device)
        self.experts = GroupedExperts(num_experts // world, hidden_size, intermediate_size, dtype, device)
        self.dispatcher = build_dispatcher(moe, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, weights, index = self.router(flat)
        out = self.dispatcher.run(flat, weights, index, self.experts, score_before_experts=False)
        return out.view(shape)
