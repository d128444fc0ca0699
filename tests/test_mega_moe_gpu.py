"""The fused layer on a GPU at the Qwen3-30B-A3B layer shape (skipped without CUDA): outputs and all gradients
against the float64 transformers oracle, and bitwise equal over two identical calls; the clamped SwiGLU
(activation_clamp) at a modest shape in bf16 and fp8."""

from __future__ import annotations

import pytest
import torch

from prime_megamoe import DispatchConfig

from .oracle import NAMES, TOL, assert_matches_oracle, run_mega_moe


@pytest.mark.gpu
class TestQwen3ShapeOnGPU:
    T, H, I, E, K = 4096, 2048, 768, 128, 8

    def _problem(self, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(self.T, self.H, generator=gen)
        logits = torch.randn(self.T, self.E, generator=gen)
        w1 = torch.randn(self.E, 2 * self.I, self.H, generator=gen) * self.H**-0.5
        w2 = torch.randn(self.E, self.H, self.I, generator=gen) * self.I**-0.5
        g = torch.randn(self.T, self.H, generator=gen)
        weights, index = torch.softmax(logits, -1).topk(self.K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        dev = torch.device("cuda")
        x, weights, w1, w2, g = (t.to(dev, torch.bfloat16) for t in (x, weights, w1, w2, g))
        return x, index.to(dev), weights, w1, w2, g

    def test_matches_float64_oracle_bf16(self):
        x, index, weights, w1, w2, g = self._problem(0)
        got = run_mega_moe(x, index, weights, w1, w2, g)
        torch.cuda.synchronize()
        # transformers' experts in float64 on the GPU (the oracle loops over experts, so memory stays small).
        assert_matches_oracle(got, x, index, weights, w1, w2, g, TOL[torch.bfloat16])

    def test_bitwise_deterministic(self):
        x, index, weights, w1, w2, g = self._problem(1)
        first = run_mega_moe(x, index, weights, w1, w2, g)
        second = run_mega_moe(x, index, weights, w1, w2, g)
        for name, a, b in zip(NAMES, first, second):
            assert torch.equal(a, b), f"{name} differs between two identical calls"

    def test_compiled_kernel_launches_compute_what_regular_launches_do(self, monkeypatch):
        # ops.compiled_launch calls the compiled kernels of earlier launches directly; the same call through
        # kernel[grid] alone must give the same bits.
        from prime_megamoe.ops import compiled_launch

        x, index, weights, w1, w2, g = self._problem(2)
        direct = run_mega_moe(x, index, weights, w1, w2, g)
        direct = run_mega_moe(x, index, weights, w1, w2, g)  # the second call runs from the cache
        assert len(compiled_launch._CACHE) > 0
        monkeypatch.setenv("PRIME_MEGAMOE_DIRECT_LAUNCH", "0")
        regular = run_mega_moe(x, index, weights, w1, w2, g)
        for name, a, b in zip(NAMES, direct, regular):
            assert torch.equal(a, b), f"{name} differs between compiled-kernel and regular launches"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_no_grad_forward_captures_in_a_cuda_graph(precision):
    """Warmed up on a side stream (as torch.cuda.graph wants), the layer's no-grad forward captures: its pooled
    routing plan, last used on that stream, is not waited for across the capture's boundary. The replay gives the
    eager call's bits, also after eager calls in between (they share the pooled plan)."""
    from prime_megamoe import fused_experts

    T, H, I, E, K = 512, 256, 128, 8, 2
    gen = torch.Generator().manual_seed(3)
    dev = torch.device("cuda")
    x = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
    weights, index = torch.softmax(torch.randn(T, E, generator=gen), -1).topk(K, dim=-1)
    w1 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dev, torch.bfloat16)
    index, weights = index.to(dev), weights.to(dev, torch.bfloat16)

    def forward():
        with torch.no_grad():
            return fused_experts(x, index, weights, w1, w2, dispatch="mega_moe", precision=precision)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager = forward()
    torch.cuda.current_stream().wait_stream(side)
    eager = eager.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    forward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_clamped_swiglu_matches_the_clamped_reference(precision):
    """activation_clamp on a GPU (bf16 data, T = 512, H = 512, I = 384, 8 experts, top-4, ragged routing): the output
    and the four gradients against the float64 clamped reference and far from the unclamped oracle (bounds and the
    reference's clamp decisions as in tests/test_activation_clamp.py: on h rounded to bf16 as the layer keeps it,
    and for fp8 computed from the recipe's e4m3 operands). fp8 runs the Hopper kernels here (the warp-specialised
    FC1 + SwiGLU, the Gluon column pass), which the CPU tests only compile."""
    from .oracle import bf16_as_stored_by_kernels, make_problem, oracle_with_grads
    from .test_activation_clamp import (
        CLAMPED_ORACLE_TOL,
        LIMIT,
        _assert_clamped_fractions,
        _check,
        _quantized_forward_h,
    )

    problem = make_problem(512, 512, 384, 8, 4, torch.bfloat16, seed=5, routing="ragged", device="cuda")
    x, index, weights, w1, w2, g = problem
    _assert_clamped_fractions(x, index, w1)
    # fp8_backward_min_expert_work = 0: the fp8 backward kernels at this size (256 rows an expert x 512 x 384) too
    dispatch = DispatchConfig(fp8_backward_min_expert_work=0)
    got = run_mega_moe(*problem, precision=precision, activation_clamp=LIMIT, dispatch=dispatch)
    torch.cuda.synchronize()
    cpu = [t.cpu() for t in problem]
    if precision == "fp8":
        decided_on = bf16_as_stored_by_kernels(_quantized_forward_h(precision, cpu[0], cpu[1], cpu[3]))
    else:
        decided_on = bf16_as_stored_by_kernels
    ref = oracle_with_grads(*cpu, activation_clamp=LIMIT, clamp_decided_on=decided_on)
    tol = TOL[torch.bfloat16] if precision == "bf16" else CLAMPED_ORACLE_TOL[precision]
    _check([t.cpu() for t in got], cpu, ref, tol, f"GPU {precision}")


@pytest.mark.gpu
def test_fp8_backward_below_the_threshold_is_the_bf16_backward():
    """fp8 through the backend with the default fp8_backward_min_expert_work (2**29) at 256 routed rows an expert x
    H x I = 5.0e7 (T = 512, 8 experts, top-4): the fp8 forward, then the bf16 backward kernels (the warp-specialised
    weight gradients included) on the forward's saved tensors, bitwise; within the fp8 bound of the float64 oracle."""
    from prime_megamoe.kernels.tuning import tile_m
    from prime_megamoe.ops import quantized_experts as qe
    from prime_megamoe.ops.expert_compute import unquantized_backward

    from .oracle import make_problem
    from .test_fp8_experts import ORACLE_TOL

    problem = make_problem(512, 512, 384, 8, 4, torch.bfloat16, seed=6, routing="ragged", device="cuda")
    x, index, weights, w1, w2, g = problem
    got = run_mega_moe(*problem, precision="fp8")
    _, lease, h = qe._forward(x, index, weights, w1, w2, 0, tile_m(), "fp8", False, need_grad=True)
    want = unquantized_backward(g, x, w1, w2, h, lease.plan, (True,) * 5, weights_dtype=weights.dtype)
    for name, a, b in zip(NAMES[1:], got[1:], want):
        assert torch.equal(a, b), f"{name}: differs from the bf16 backward on the fp8 forward's saved tensors"
    assert_matches_oracle(got, x, index, weights, w1, w2, g, ORACLE_TOL)


_BAD_ID_CALL = """
import sys, torch
from prime_megamoe import fused_experts
T, H, I, E, K = 512, 256, 128, 8, 2  # the CUDA graph test's sizes, which run fp8 too
dev = torch.device("cuda")
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
w1 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * H**-0.5
w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * I**-0.5
weights, index = torch.softmax(torch.randn(T, E, device=dev), -1).topk(K, dim=-1)
index[300, 1] = int(sys.argv[2])
out = fused_experts(x, index, weights.to(torch.bfloat16), w1, w2, dispatch="mega_moe", precision=sys.argv[1])
torch.cuda.synchronize()
print("synced", float(out.float().abs().sum()) > 0)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_an_expert_id_out_of_range_fails_the_call_at_the_next_sync(precision):
    """Without validate_routing, mega_moe checks the ids on the device (its routing kernels flag them; an assertion
    after the layer's kernels): an id past E fails the call's next sync, -1 (an empty slot) does not. A device-side
    assertion leaves the process's CUDA context unusable, so each call runs in a process of its own."""
    import subprocess
    import sys

    def run(bad_id):
        return subprocess.run(
            [sys.executable, "-c", _BAD_ID_CALL, precision, str(bad_id)], capture_output=True, text=True, timeout=300
        )

    ok = run(-1)
    assert ok.returncode == 0 and "synced True" in ok.stdout, ok.stderr[-2000:]
    failed = run(8)
    assert failed.returncode != 0 and "synced" not in failed.stdout
    assert "device-side assert" in failed.stderr or "outside [0, 8)" in failed.stderr, failed.stderr[-2000:]
