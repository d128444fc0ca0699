"""``kernels.interpreter_speed``: under the interpreter a launch patches ``triton.language`` once, however many
``@triton.jit`` helpers its programs call, and the kernels compute what they computed before."""

from __future__ import annotations

import numpy as np
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


def test_remembered_numpy_types_are_the_interpreters():
    # The interpreter's numpy type of every kind of Triton type (scalars, blocks, pointers, blocks of pointers), asked
    # twice: the remembered answers are the interpreter's own, and each element type is asked of it once.
    from triton.runtime import interpreter

    from prime_megamoe.kernels.interpreter_speed import _remembered

    install()
    original = getattr(interpreter._get_np_dtype, "__wrapped__", None)
    if original is None:
        pytest.skip("kernels are compiled here: the interpreter is not patched")
    types = [tl.float32, tl.bfloat16, tl.float8e4nv, tl.int1, tl.int64, tl.pointer_type(tl.float32)]
    types += [
        tl.block_type(tl.float32, [4, 8]),
        tl.block_type(tl.pointer_type(tl.bfloat16), [4]),
        tl.block_type(tl.int1, [2]),
    ]
    asked = []

    def counting(t):
        asked.append(t)
        return original(t)

    remembered = _remembered(counting, tl)
    for _ in range(2):
        for t in types:
            assert remembered(t) == original(t) == interpreter._get_np_dtype(t), t
    assert len(asked) == 6, asked  # the five scalar types and one pointer: blocks are asked as their elements


@triton.jit
def _xor_and_sort(x_ptr, rows_ptr, cols_ptr, sorted_ptr, R: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(rows_ptr + tl.arange(0, R), tl.xor_sum(x, 1))
    tl.store(cols_ptr + tl.arange(0, C), tl.xor_sum(x, 0))
    tl.store(sorted_ptr + offs, tl.sort(x, 1))  # built on xor reductions


def test_xor_reductions_run_in_numpy_with_the_interpreters_results(monkeypatch):
    from triton.runtime import interpreter

    install()
    if getattr(interpreter.ReduceOps.apply_impl, "__wrapped__", None) is None:
        pytest.skip("this Triton's interpreter has no ReduceOps.apply_impl to patch")
    slow = []
    original = interpreter.ReduceOps.generic_reduce

    def counted(self, input):
        slow.append(1)
        return original(self, input)

    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", counted)
    x = torch.randint(-(2**30), 2**30, (8, 16), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    rows, cols, out = torch.zeros(8, dtype=torch.int32), torch.zeros(16, dtype=torch.int32), torch.zeros_like(x)
    _xor_and_sort[(1,)](x, rows, cols, out, R=8, C=16)
    assert not slow, "an xor reduction ran element by element"
    assert torch.equal(rows, torch.from_numpy(np.bitwise_xor.reduce(x.numpy(), axis=1)))
    assert torch.equal(cols, torch.from_numpy(np.bitwise_xor.reduce(x.numpy(), axis=0)))
    assert torch.equal(out, x.sort(dim=1).values)
    # The interpreter's own path (the patch bypassed) gives the same results.
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", interpreter.ReduceOps.apply_impl.__wrapped__)
    again = [torch.zeros_like(t) for t in (rows, cols, out)]
    _xor_and_sort[(1,)](x, *again, R=8, C=16)
    assert slow, "the bypassed patch still ran"
    assert all(torch.equal(a, b) for a, b in zip(again, (rows, cols, out)))
