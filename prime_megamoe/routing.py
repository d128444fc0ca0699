"""Qwen3-style router math: softmax over experts, top-k, optional renormalisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_top_k(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True):
    """Return (top_k_weights [T, k] in the logits' dtype, top_k_index [T, k] int64) from logits [T, E].

    The softmax runs in fp32, as in transformers' Qwen3-MoE; with ``norm_topk_prob`` the k weights sum to one.
    """
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k = {top_k} must lie in [1, num_experts = {num_experts}]")
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), index
