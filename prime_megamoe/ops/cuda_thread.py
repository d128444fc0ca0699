"""Backwards that launch Triton kernels bind the autograd engine's worker thread to the CUDA context first.

The engine runs a backward on a thread of its own and switches that thread's device only where it differs from the
current one, so the thread holds no CUDA context until some kernel is launched through the CUDA runtime. When the
first kernel of a backward is one of ours, Triton encodes its TMA descriptors with the driver in a thread without a
context and fails ("Failed to create tensor map descriptor: invalid device context"). ``torch.cuda.set_device``
binds the device's primary context to the calling thread (once bound, the call changes nothing).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def bind_cuda_context(tensors) -> None:
    """Makes the device of the first CUDA tensor among ``tensors`` current in this thread, binding its context."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            torch.cuda.set_device(t.device)
            return


def binds_cuda_context(backward: Callable) -> Callable:
    """Decorates an autograd Function's ``backward``: the incoming gradients' device is made current first."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        bind_cuda_context(grads)
        return backward(ctx, *grads)

    return wrapper
