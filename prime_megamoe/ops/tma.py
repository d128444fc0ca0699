"""Whether a tensor can be read through a TMA tensor descriptor, and the descriptor the Triton kernels take."""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernels import tuning
from .sm_budget import cuda_properties


def tma_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over 2D ``t``; its box is set by the chosen config's pre-launch hook."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])


def tma_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s layout suits a TMA tensor descriptor: 2D, a contiguous last dim, a 16-byte aligned base and row
    stride (the device aside: ``tma_readable``)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def tma_readable(t: torch.Tensor) -> bool:
    """Whether ``t`` can be read through a TMA tensor descriptor: a GPU with TMA (compute capability 9 or later) and
    ``tma_layout``. Under the interpreter descriptors are emulated, so the layer runs the pointer path there and tests
    choose either."""
    if t.device.type != "cuda" or tuning.interpreting():
        return False
    return tma_layout(t) and cuda_properties(t.device).major >= 9
