"""The layer's Hopper host path on the CPU: which kernels a forward and backward launch, each with every parameter.

On a Hopper GPU the layer runs warp-specialised Gluon kernels that have no interpreter, so their host code (the
applicability checks, descriptors, grids, argument lists) runs only there. Here the Hopper and Gluon device checks
are made to pass on CPU tensors and every launch is recorded instead of run: the tests check the kernels each
precision launches, and that each launch binds every parameter of its kernel (positionally, by name, or by its
autotuning config) and names no parameter it lacks. No kernel runs, so no output is checked (the GPU tests and the
interpreter tests do that).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import prime_megamoe.ops.bf16_ws_launch as bf16_ws_launch
import prime_megamoe.ops.fp8_launch as fp8_launch
import prime_megamoe.ops.fp8_ws_launch as fp8_ws_launch
import prime_megamoe.ops.launch as ops_launch
import prime_megamoe.ops.routing_plan as routing_plan
from prime_megamoe import fused_experts
from prime_megamoe.config import DispatchConfig
from tests.scripts import load_script

host_path_cpu = load_script("host_path_cpu")
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}


def parameters(kernel) -> tuple[str, dict, set]:
    """(the kernel's name, its Python function's parameters, the names its autotuning configs and heuristics set)."""
    given = set()
    fn = kernel
    while not inspect.isfunction(fn):
        for config in getattr(fn, "configs", ())[:1]:
            given |= set(config.all_kwargs())
        given |= set(getattr(fn, "values", {}))  # heuristics
        fn = fn.fn
    return fn.__name__, dict(inspect.signature(fn).parameters), given


@pytest.fixture
def launches(monkeypatch):
    """The kernels launched (by name) with the Hopper branches taken on CPU tensors (``scripts/host_path_cpu.py``),
    each launch's arguments checked against its kernel's parameters and recorded instead of run."""
    recorded: list[str] = []

    def record(kernel, grid, *args, **constexprs):
        name, params, given = parameters(kernel)
        names = list(params)
        assert len(args) <= len(names), f"{name}: {len(args)} arguments for {len(names)} parameters"
        bound = set(names[: len(args)]) | set(constexprs) | given
        unbound = [n for n, p in params.items() if n not in bound and p.default is inspect.Parameter.empty]
        assert not unbound, f"{name}: parameters not given: {unbound}"
        unknown = sorted(set(constexprs) - set(names) - LAUNCH_OPTIONS)
        assert not unknown, f"{name}: no such parameters: {unknown}"
        recorded.append(name)

    for module in (ops_launch, fp8_launch, fp8_ws_launch, bf16_ws_launch, routing_plan):
        monkeypatch.setattr(module, "launch", record)
    with host_path_cpu.hopper_path_on_cpu():
        yield recorded


def layer_call(precision: str, tokens: int = 64, hidden: int = 256, inter: int = 128, experts: int = 4, top_k: int = 2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).requires_grad_()
    index = torch.randint(0, experts, (tokens, top_k), generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen).requires_grad_()
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    # fp8: the quantised backward at this size too (fp8_backward_min_expert_work = 0)
    dispatch = DispatchConfig(type="mega_moe", max_tokens_per_rank=tokens, fp8_backward_min_expert_work=0)
    y = fused_experts(x, index, weights, w1, w2, dispatch=dispatch, precision=precision)
    y.backward(torch.ones_like(y))


def test_bf16_runs_the_warp_specialised_weight_gradients(launches):
    layer_call("bf16")
    assert launches.count("bf16_grouped_wgrad_ws_kernel") == 2  # dW1 and dW2
    assert launches[:2] == ["routing_keys_kernel", "routing_place_kernel"]
    assert "fc1_swiglu_kernel" in launches  # the Triton FC1 (the warp-specialised one is opt-in)


def test_fp8_runs_a_warp_specialised_kernel_for_every_gemm(launches):
    layer_call("fp8")
    assert launches.count("fp8_fc1_swiglu_ws_kernel") == 1
    # FC2, the FC2 dgrad (gathering dy's rows) and the FC1 dgrad
    assert launches.count("grouped_gemm_ws_kernel") == 3
    assert launches.count("fp8_grouped_wgrad_ws_kernel") == 2  # dW1 and dW2
    # the SwiGLU backward's row and column passes, and x^T and dy^T gathered for the weight gradients (Gluon)
    assert "swiglu_backward_quantize_kernel" in launches and "swiglu_backward_cols_kernel" in launches
    assert launches.count("gather_cols_t_kernel") == 2
    assert not {"fp8_fc1_swiglu_kernel", "fp8_grouped_gemm_kernel", "fp8_grouped_wgrad_kernel"} & set(launches)


def test_fp8_bwd_runs_the_bf16_forward_and_the_warp_specialised_fp8_backward(launches):
    layer_call("fp8_bwd")
    assert "fc1_swiglu_kernel" in launches and "fp8_fc1_swiglu_ws_kernel" not in launches
    assert launches.count("grouped_gemm_ws_kernel") == 2  # the FC2 dgrad and the FC1 dgrad
    assert launches.count("fp8_grouped_wgrad_ws_kernel") == 2
