"""nn.Modules and the token dispatcher: router math against transformers, the MoE block end to end on both backends,
the prime-rl-style dispatcher interface and its errors."""

from __future__ import annotations

import pytest
import torch

from prime_megamoe import (
    GroupedExperts,
    MoEBlock,
    MoEConfig,
    TokenDispatcher,
    TopKRouter,
    build_dispatcher,
    fused_experts,
    softmax_top_k,
)

from .oracle import rel_err

H, I, E, K = 32, 16, 8, 2


def qwen3_config(**kw):
    from transformers import Qwen3MoeConfig

    args = dict(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True)
    args.update(kw)
    cfg = Qwen3MoeConfig(**args)
    cfg._experts_implementation = "eager"
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Router


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_router_matches_transformers(top_k, norm, dtype):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(top_k * 10 + norm)
    ours = TopKRouter(H, E, top_k, norm_topk_prob=norm).to(dtype)
    theirs = Qwen3MoeTopKRouter(qwen3_config(num_experts_per_tok=top_k, norm_topk_prob=norm)).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    x = torch.randn(37, H).to(dtype)
    logits, weights, index = ours(x)
    ref_logits, ref_weights, ref_index = theirs(x)
    assert logits.dtype == ref_logits.dtype and weights.dtype == ref_weights.dtype
    assert torch.equal(logits, ref_logits)
    assert torch.equal(index, ref_index)
    assert torch.equal(weights, ref_weights)
    assert index.shape == (37, top_k) and index.dtype == torch.int64
    if norm:
        torch.testing.assert_close(
            weights.float().sum(-1), torch.ones(37), rtol=0, atol=2e-2 if dtype != torch.float32 else 1e-6
        )
    else:
        assert (weights.float().sum(-1) < 1 + 1e-3).all()


def test_router_gradient_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(3)
    ours = TopKRouter(H, E, K)
    theirs = Qwen3MoeTopKRouter(qwen3_config())
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    x = torch.randn(20, H)
    g = torch.randn(20, K)
    (ours(x)[1] * g).sum().backward()
    (theirs(x)[1] * g).sum().backward()
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-6, atol=1e-7)
    assert ours.weight.grad.abs().sum() > 0


def test_softmax_top_k_rejects_bad_k():
    logits = torch.randn(4, E)
    with pytest.raises(ValueError, match="top_k = 9"):
        softmax_top_k(logits, E + 1)
    with pytest.raises(ValueError, match="top_k = 0"):
        softmax_top_k(logits, 0)


def test_softmax_top_k_picks_largest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    weights, index = softmax_top_k(logits, 2, norm_topk_prob=True)
    assert index.tolist() == [[1, 3]]
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(weights[0], e / e.sum())


# ---------------------------------------------------------------------------------------------------------------
# Grouped experts


def test_grouped_experts_layout_and_init():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 256, 128, dtype=torch.float32)
    assert experts.gate_up_proj.shape == (4, 256, 256)
    assert experts.down_proj.shape == (4, 256, 128)
    # Unit-variance outputs for unit-variance inputs: std 1/sqrt(fan_in).
    assert abs(experts.gate_up_proj.std().item() - 256**-0.5) < 0.1 * 256**-0.5
    assert abs(experts.down_proj.std().item() - 128**-0.5) < 0.1 * 128**-0.5
    bf = GroupedExperts(2, 8, 4, dtype=torch.bfloat16)
    assert bf.gate_up_proj.dtype == torch.bfloat16 and bf.down_proj.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------
# MoE block


def _block(dispatch, seed=0, **kw):
    torch.manual_seed(seed)
    return MoEBlock(H, I, E, K, MoEConfig(dispatch=dispatch), **kw)


def _forward_backward(block, x, g):
    x = x.clone().requires_grad_()
    out = block(x)
    out.backward(g)
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return out.detach(), x.grad, grads


def test_moe_block_matches_transformers_sparse_block():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = _block("torch", seed=1)
    ref = Qwen3MoeSparseMoeBlock(qwen3_config())
    with torch.no_grad():
        ref.gate.weight.copy_(block.router.weight)
        ref.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        ref.experts.down_proj.copy_(block.experts.down_proj)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, H, generator=gen)
    g = torch.randn(3, 7, H, generator=gen)
    out, dx, grads = _forward_backward(block, x, g)
    ref_out, ref_dx, ref_grads = _forward_backward(ref, x, g)
    assert out.shape == (3, 7, H)
    assert rel_err(out, ref_out) <= 1e-5
    assert rel_err(dx, ref_dx) <= 1e-5
    assert rel_err(grads["router.weight"], ref_grads["gate.weight"]) <= 1e-5
    assert rel_err(grads["experts.gate_up_proj"], ref_grads["experts.gate_up_proj"]) <= 1e-5
    assert rel_err(grads["experts.down_proj"], ref_grads["experts.down_proj"]) <= 1e-5


def test_moe_block_backends_agree():
    torch_block = _block("torch", seed=4)
    fused_block = _block("mega_moe", seed=5)
    fused_block.load_state_dict(torch_block.state_dict())
    assert fused_block.dispatcher.backend == "mega_moe" and torch_block.dispatcher.backend == "torch"
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 9, H, generator=gen)
    g = torch.randn(2, 9, H, generator=gen)
    out_t, dx_t, grads_t = _forward_backward(torch_block, x, g)
    out_f, dx_f, grads_f = _forward_backward(fused_block, x, g)
    assert out_f.shape == x.shape
    assert rel_err(out_f, out_t) <= 1e-5
    assert rel_err(dx_f, dx_t) <= 1e-5
    assert grads_f.keys() == grads_t.keys() == {"router.weight", "experts.gate_up_proj", "experts.down_proj"}
    for name in grads_t:
        assert grads_t[name].abs().sum() > 0, name
        assert rel_err(grads_f[name], grads_t[name]) <= 1e-5, name


def test_moe_block_dtype_and_device():
    block = _block("torch", dtype=torch.bfloat16)
    assert block.router.weight.dtype == torch.bfloat16
    assert block.experts.gate_up_proj.dtype == torch.bfloat16
    x = torch.randn(5, H, dtype=torch.bfloat16)
    out = block(x)
    assert out.dtype == torch.bfloat16 and out.shape == (5, H)
    assert torch.isfinite(out).all() and out.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------------
# Token dispatcher


def _routing(seed, num_tokens=12):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    weights, index = softmax_top_k(torch.randn(num_tokens, E, generator=gen), K)
    return x, weights, index


def test_dispatcher_run_equals_fused_experts():
    torch.manual_seed(7)
    experts = GroupedExperts(E, H, I)
    dispatcher = build_dispatcher(MoEConfig(dispatch="torch"))
    assert isinstance(dispatcher, TokenDispatcher) and dispatcher.backend == "torch"
    x, weights, index = _routing(8)
    out = dispatcher.run(x, weights, index, experts, score_before_experts=False)
    dispatcher.synchronize()
    ref = fused_experts(x, index, weights, experts.gate_up_proj, experts.down_proj, dispatch="torch")
    assert torch.equal(out, ref)
    # Gradients reach the experts' parameters through the dispatcher.
    out.sum().backward()
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0
    assert experts.down_proj.grad is not None and experts.down_proj.grad.abs().sum() > 0


def test_dispatcher_runs_transformers_experts():
    # transformers' Qwen3MoeExperts holds the same two weights; the dispatcher computes what it computes.
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(9)
    experts = Qwen3MoeExperts(qwen3_config())
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=H**-0.5)
        experts.down_proj.normal_(std=I**-0.5)
    x, weights, index = _routing(10)
    out = build_dispatcher(MoEConfig(dispatch="torch")).run(x, weights, index, experts)
    assert rel_err(out, experts(x, index, weights)) <= 1e-5


def test_dispatcher_uses_configured_precision():
    x, weights, index = _routing(11)
    experts = GroupedExperts(E, H, I)
    dispatcher = build_dispatcher(MoEConfig(dispatch="torch", precision="mxfp8"))
    with pytest.raises(NotImplementedError, match="mxfp8"):
        dispatcher.run(x, weights, index, experts)
    # fp8 runs on the torch backend: e4m3 noise (a few percent), not the unquantised result.
    with torch.no_grad():
        out = build_dispatcher(MoEConfig(dispatch="torch", precision="fp8")).run(x, weights, index, experts)
        ref = fused_experts(x, index, weights, experts.gate_up_proj, experts.down_proj, dispatch="torch")
        assert 1e-3 < rel_err(out, ref) < 8e-2


def test_score_before_experts_not_implemented():
    x, weights, index = _routing(12)
    experts = GroupedExperts(E, H, I)
    dispatcher = build_dispatcher(MoEConfig(dispatch="torch"))
    with pytest.raises(NotImplementedError, match="score_before_experts"):
        dispatcher.run(x, weights, index, experts, score_before_experts=True)


@pytest.mark.parametrize("ep", [2, 4])
def test_build_dispatcher_ep_mismatch(ep):
    with pytest.raises(ValueError) as info:
        build_dispatcher(MoEConfig(dispatch="torch", ep=ep), group=None)
    msg = str(info.value)
    assert f"ep = {ep}" in msg
    assert "1 rank" in msg


def test_moe_block_ep_mismatch():
    with pytest.raises(ValueError, match="ep = 2"):
        MoEBlock(H, I, E, K, MoEConfig(dispatch="torch", ep=2))
