"""Less host work per kernel under Triton's interpreter (CPU runs: the tests, the trainer without a GPU); what every
kernel computes is untouched.

The interpreter swaps ``triton.language``'s functions for interpreted ones at each launch and again at every call of
a ``@triton.jit`` helper inside the kernel, although the launch has already swapped them: the repeated swap
(``inspect.getmembers`` over the language modules) is about a third of an interpreted layer's time. ``install()``
skips the swap of a helper call when the launch around it has already swapped every language module the helper sees;
anything else goes through the interpreter's own code. The interpreter's numpy type of a Triton type
(``_get_np_dtype``) builds its table of 18 types at every call, hundreds of thousands of calls in a test:
``install()`` remembers its answer per element type (an interpreted fp8 layer test: 18.5 s against 21.8). Its
reductions with a combine function it does not know run element by element in Python; ``tl.sort`` (the routing
plan's stable sort) is built on one of them, the xor reduction: ``install()`` runs that one as numpy's xor reduce
(an interpreted routing plan: 0.16 s against 0.37). Where Triton has no such internals, nothing is changed. Only
entry points call it (the trainer's CLI, the test setup): importing the package changes nothing in Triton.
"""

from __future__ import annotations

import inspect

import numpy as np

from .tuning import interpreting

_INSTALLED = [False]


def install() -> None:
    """Install the skip (idempotent); nothing to do unless kernels run in the interpreter."""
    if _INSTALLED[0] or not interpreting():
        return
    _INSTALLED[0] = True
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return
    grid_call = executor.__call__
    state = {"depth": 0, "patched": set()}

    class _Nothing:
        def restore(self):
            pass

    module_ids: dict = {}  # per function: the ids of the language modules its globals hold (they do not change)

    def lang_modules(fn) -> set[int]:
        if fn not in module_ids:
            module_ids[fn] = {
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)
            }
        return module_ids[fn]

    def patch_once_per_launch(fn):
        langs = lang_modules(fn)
        if state["depth"] and langs and langs <= state["patched"]:
            return _Nothing()
        scope = patch_lang(fn)
        if state["depth"]:
            state["patched"] |= langs
        return scope

    def launch(self, *args, **kwargs):
        state["depth"] += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            if not state["depth"]:
                state["patched"].clear()

    interpreter._patch_lang = patch_once_per_launch
    executor.__call__ = launch
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:
        interpreter._get_np_dtype = _remembered(np_dtype, tl)
    reduce_ops, xor_combine = getattr(interpreter, "ReduceOps", None), getattr(tl.standard, "_xor_combine", None)
    if reduce_ops is not None and xor_combine is not None and hasattr(reduce_ops, "apply_impl"):
        reduce_ops.apply_impl = _xor_in_numpy(reduce_ops.apply_impl, xor_combine)


def _remembered(np_dtype, tl):
    """``np_dtype`` (the interpreter's numpy type of a Triton type: a block's is its element's, every pointer's
    uint64) answered from a table of the element types it has been asked for."""
    table: dict = {}

    def remembered(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        key = "pointer" if isinstance(element, tl.pointer_type) else element
        if key not in table:
            table[key] = np_dtype(element)
        return table[key]

    remembered.__wrapped__ = np_dtype
    return remembered


def _xor_in_numpy(apply_impl, xor_combine):
    """``ReduceOps.apply_impl`` with a one-input xor reduction along an axis computed by ``np.bitwise_xor.reduce``;
    every other reduction as before."""

    def apply(self, input):
        if self.combine_fn is xor_combine and len(input) == 1 and self.axis is not None:
            data = input[0].handle.data
            return [
                self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)
            ]
        return apply_impl(self, input)

    apply.__wrapped__ = apply_impl
    return apply
