"""ops.cuda_thread: a backward whose first kernel is one of the layer's runs on the autograd engine's fresh thread
(its TMA descriptors need the thread bound to the CUDA context)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from prime_megamoe.ops import cuda_thread

REPO = Path(__file__).resolve().parent.parent


def test_host_tensors_and_missing_gradients_bind_nothing(monkeypatch):
    def refuse(device):
        raise AssertionError(f"set_device({device}) called for host tensors")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    cuda_thread.bind_cuda_context([None, torch.ones(2), 3.0])

    @cuda_thread.binds_cuda_context
    def backward(ctx, grad):
        return grad * 2

    assert torch.equal(backward(None, torch.ones(2)), torch.full((2,), 2.0))


# A process of its own, where the engine's thread is new. The first call's backward runs on the calling thread, which
# compiles and loads the kernels there (loading a kernel binds the thread it happens on). The second call's backward
# runs on the engine's thread with the gradient given, so the layer's first kernel is the thread's first CUDA work.
_FIRST_BACKWARD = textwrap.dedent(
    """
    import sys

    import torch
    from prime_megamoe import DispatchConfig, fused_experts

    T, H, I, E, K = 256, 256, 128, 8, 2
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=gen).bfloat16().requires_grad_()
    weights, index = torch.softmax(torch.randn(T, E, device=dev, generator=gen), -1).topk(K, dim=-1)
    w1 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H**-0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I**-0.5).bfloat16().requires_grad_()
    config = DispatchConfig(max_tokens_per_rank=T)
    dy = torch.randn(T, H, device=dev, generator=gen).bfloat16()

    def forward_backward():
        out = fused_experts(x, index, weights.bfloat16(), w1, w2, dispatch=config, precision=sys.argv[1])
        out.backward(dy)
        torch.cuda.synchronize()

    with torch.autograd.set_multithreading_enabled(False):
        forward_backward()
    first = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    forward_backward()
    assert all(torch.equal(t.grad, g) for t, g in zip((x, w1, w2), first))
    print("backward ran")
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_first_backward_of_a_process_runs(precision):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", _FIRST_BACKWARD, precision]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "backward ran" in done.stdout
