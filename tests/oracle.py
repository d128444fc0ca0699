"""References for the expert layer (a plain loop, and transformers' Qwen3MoeExperts: the oracle, in float64) and the
checks the layer tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from prime_megamoe import fused_experts
from prime_megamoe.kernels import tuning


def bf16_as_stored_by_kernels(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 as the layer's Triton kernels store an fp32 value there: to nearest even on a GPU, toward
    zero under the interpreter (which drops the low 16 bits), in ``t``'s dtype."""
    if not tuning.interpreting():
        return t.to(torch.bfloat16).to(t.dtype)
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(t.dtype)


def clamp_gate_up(g, u, limit, decide_on=None):
    """The clamped SwiGLU's inputs: min(g, limit) and clamp(u, -limit, limit), by torch.clamp (whose gradient passes
    where g <= limit and -limit <= u <= limit). ``decide_on`` = (g', u'): decide which elements are clamped on these
    values instead, as a layer does from the h it computed and kept (rounded to bf16, or from fp8 operands); an
    element clamped by neither keeps its exact value (near the limit the two differ by less than that rounding)."""
    if decide_on is None:
        return g.clamp(max=limit), u.clamp(-limit, limit)
    g_r, u_r = decide_on
    return (
        torch.where(g_r <= limit, g, limit),
        torch.where(u_r > limit, limit, torch.where(u_r < -limit, -limit, u)),
    )


def loop_reference(
    x, top_k_index, top_k_weights, gate_up_proj, down_proj, activation_clamp=None, clamp_decided_on=None
):
    """y_t = sum_j w_tj * W2_e (silu(g) * u), [g; u] = W1_e x_t, one (token, slot) at a time. With
    ``activation_clamp`` c the clamped SwiGLU: silu(min(g, c)) * clamp(u, -c, c) (``clamp_gate_up``), the clamp
    decided on h itself, or (``clamp_decided_on``) on a function of it (a rounding) or on given values [T, k, 2I]."""
    inter = down_proj.shape[-1]
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            h = gate_up_proj[e] @ x[t]
            g, u = h[:inter], h[inter:]
            if activation_clamp is not None:
                decide = clamp_decided_on
                if callable(decide):
                    decide = decide(h.detach())
                elif decide is not None:
                    decide = decide[t, j].to(h.dtype)
                if decide is not None:
                    decide = (decide[:inter], decide[inter:])
                g, u = clamp_gate_up(g, u, activation_clamp, decide)
            acc = acc + top_k_weights[t, j] * (down_proj[e] @ (F.silu(g) * u))
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(x.shape)


def routed_h(x, top_k_index, gate_up_proj) -> torch.Tensor:
    """[T, k, 2I] float64: h = W1_e x_t of every (token, slot), computed expert by expert."""
    index = top_k_index.long()
    h = torch.zeros(*index.shape, gate_up_proj.shape[1], dtype=torch.float64, device=x.device)
    for e in range(gate_up_proj.shape[0]):
        hit = index == e
        h[hit] = x.double()[hit.nonzero()[:, 0]] @ gate_up_proj[e].double().T
    return h


def clamped_fractions(x, top_k_index, gate_up_proj, activation_clamp) -> tuple[float, float]:
    """The fractions of the routed pairs' g values above c and of their u values outside [-c, c] (float64): how much
    of the input a clamp test actually clamps."""
    g, u = routed_h(x, top_k_index, gate_up_proj).chunk(2, dim=-1)
    return float((g > activation_clamp).double().mean()), float((u.abs() > activation_clamp).double().mean())


def qwen3_experts_reference(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """transformers' Qwen3MoeExperts eager forward with the given (global, all-expert) weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    num_experts, two_i, hidden = gate_up_proj.shape
    cfg = Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=two_i // 2,
        num_experts=num_experts,
        num_experts_per_tok=top_k_index.shape[1],
    )
    cfg._experts_implementation = "eager"
    experts = Qwen3MoeExperts(cfg).to(gate_up_proj.dtype)
    del experts.gate_up_proj, experts.down_proj
    experts.gate_up_proj = gate_up_proj  # plain tensors keep the caller's autograd graph
    experts.down_proj = down_proj
    return experts(x, top_k_index, top_k_weights)


def oracle_with_grads(
    x, top_k_index, top_k_weights, gate_up_proj, down_proj, grad_out, activation_clamp=None, clamp_decided_on=None
):
    """(out, dx, dweights, dW1, dW2) in float64: from the transformers oracle, or with ``activation_clamp`` (which
    transformers' Qwen3MoeExperts does not have) from the loop reference's clamped SwiGLU (``loop_reference``)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, top_k_weights, gate_up_proj, down_proj)]
    xd, wd, w1d, w2d = leaves
    if activation_clamp is None:
        out = qwen3_experts_reference(xd, top_k_index.long(), wd, w1d, w2d)
    else:
        out = loop_reference(xd, top_k_index.long(), wd, w1d, w2d, activation_clamp, clamp_decided_on)
    grads = torch.autograd.grad(out, leaves, grad_out.double())
    return (out.detach(), *grads)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().double()
    b = b.detach().double()
    denom = b.norm()
    if denom == 0:
        return float((a - b).norm())
    return float((a - b).norm() / denom)


def ragged_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    seed: int,
    empty_expert: int | None = 0,
    hot_expert: int | None = 1,
    hot_fraction: float = 0.7,
    forbid: range | None = None,
):
    """Router-like (top_k_index, top_k_weights): distinct experts per token, weights that sum to one, with one
    expert never chosen, one chosen by most tokens, and optionally a range of experts (a rank's) never chosen."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if hot_expert is not None:
        hot = torch.rand(num_tokens, generator=gen) < hot_fraction
        logits[hot, hot_expert] += 100.0
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    if forbid is not None:
        logits[:, forbid.start : forbid.stop] = -1e9
    probs = torch.softmax(logits, dim=-1)
    weights, index = probs.topk(top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
NAMES = ("out", "d_hidden_states", "d_top_k_weights", "d_gate_up_proj", "d_down_proj")


def run_mega_moe(x, index, weights, w1, w2, grad_out, dispatch="mega_moe", **kwargs):
    """(out, dx, dweights, dW1, dW2) of one ``fused_experts`` call (``kwargs``: its other options)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)]
    out = fused_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], dispatch=dispatch, group=None, **kwargs)
    out.backward(grad_out)
    return (out.detach(), *(t.grad for t in leaves))


def assert_matches_oracle(got, x, index, weights, w1, w2, grad_out, tol, activation_clamp=None, ref=None):
    """``got`` within ``tol`` (relative norm) of ``ref`` (default: ``oracle_with_grads``), dtypes and shapes too."""
    if ref is None:
        ref = oracle_with_grads(x, index, weights, w1, w2, grad_out, activation_clamp)
    inputs = (x, x, weights, w1, w2)
    for name, a, b, like in zip(NAMES, got, ref, inputs):
        assert a is not None, f"{name}: no gradient"
        assert a.shape == like.shape and a.dtype == like.dtype, f"{name}: {a.shape}/{a.dtype}"
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err = rel_err(a, b)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def make_problem(
    num_tokens, hidden, inter, experts, top_k, dtype, *, seed, routing="uniform", hot_fraction=0.7, device="cpu"
):
    """Random inputs in ``dtype``: tokens, router-like routing, weights at a unit-variance scale, upstream grad."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    grad_out = torch.randn(num_tokens, hidden, generator=gen)
    route_seed = seed * 7919 + 1
    if routing == "uniform":
        index, weights = ragged_routing(num_tokens, experts, top_k, seed=route_seed, empty_expert=None, hot_expert=None)
    elif routing == "ragged":  # expert 0 never chosen, expert 1 chosen by most tokens
        index, weights = ragged_routing(num_tokens, experts, top_k, seed=route_seed, hot_fraction=hot_fraction)
    else:
        raise ValueError(routing)
    x, weights, w1, w2, grad_out = (t.to(device=device, dtype=dtype) for t in (x, weights, w1, w2, grad_out))
    return x, index.to(device), weights, w1, w2, grad_out


def only_config(monkeypatch, kernel, **changes):
    """Make an autotuned kernel run its first candidate with ``changes`` (e.g. a smaller BLOCK_M). Launches then go
    through Triton itself: the compiled-kernel cache of ``ops.compiled_launch`` would keep running the kernel it
    compiled before the change."""
    monkeypatch.setenv("PRIME_MEGAMOE_DIRECT_LAUNCH", "0")
    first = kernel.configs[0]
    config = triton.Config(
        {**first.kwargs, **changes}, num_warps=first.num_warps, num_stages=first.num_stages, pre_hook=first.pre_hook
    )
    monkeypatch.setattr(kernel, "configs", [config])
    monkeypatch.setattr(kernel, "cache", {})
