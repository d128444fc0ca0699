"""Less host work per kernel under Triton's interpreter (CPU runs: the tests, the trainer without a GPU); what every
kernel computes is untouched.

The interpreter swaps ``triton.language``'s functions for interpreted ones at each launch and again at every call of
a ``@triton.jit`` helper inside the kernel, although the launch has already swapped them: the repeated swap
(``inspect.getmembers`` over the language modules) is about a third of an interpreted layer's time. ``install()``
skips the swap of a helper call when the launch around it has already swapped every language module the helper sees;
anything else goes through the interpreter's own code. Where Triton has no such internals, nothing is changed. Only
entry points call it (the trainer's CLI, the test setup): importing the package changes nothing in Triton.
"""

from __future__ import annotations

import inspect

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

    def lang_modules(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}

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
