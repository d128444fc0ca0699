"""``kernels.interpreter_speed``: under the interpreter a launch patches ``triton.language`` once, however many
``@triton.jit`` helpers its programs call, and the kernels compute what they computed before."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from prime_megamoe.kernels.interpreter_speed import install
from prime_megamoe.kernels.tuning import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's patching only (CPU runs)")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _with_helper(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, _twice(_twice(tl.load(x_ptr + offs, mask=mask))) + 1, mask=mask)


@triton.jit
def _inline(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 4 + 1, mask=mask)


def _patches_per_launch(monkeypatch, kernel) -> int:
    from triton.runtime import interpreter

    calls = []
    original = interpreter._patch_builtin

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    x = torch.arange(40, dtype=torch.float32)
    y = torch.zeros_like(x)
    kernel[(3,)](x, y, 40, BLOCK=16)  # three programs, each calling the helper twice
    monkeypatch.undo()
    assert torch.equal(y, x * 4 + 1)
    return len(calls)


def test_helper_calls_reuse_the_launch_patch(monkeypatch):
    install()  # (the test setup installed it already: idempotent)
    inline = _patches_per_launch(monkeypatch, _inline)
    assert inline > 0
    assert _patches_per_launch(monkeypatch, _with_helper) == inline  # six helper calls: no patching of their own
