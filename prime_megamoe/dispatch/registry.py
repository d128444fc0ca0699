"""Backends by name. ``dispatch = "<name>"`` in the config or in ``fused_experts`` picks one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from ..config import DispatchConfig


class ExpertsBackend(Protocol):
    """Computes the routed experts for one rank's tokens; the result is [T, H] in hidden_states' dtype.

    ``activation_clamp``: None (SwiGLU) or the clamped SwiGLU's limit c > 0 (already checked by ``fused_experts``):
    a = silu(min(g, c)) * clamp(u, -c, c), gradients zero where clamped (torch.clamp's convention).

    ``fused_experts`` checks the expert ids' range itself, except for mega_moe on the device, which it passes
    ``check_ids`` (the expert count E) to assert there that every id lies in [-1, E); other backends never get it."""

    def __call__(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        *,
        precision: str,
        group: dist.ProcessGroup | None,
        options: DispatchConfig,
        activation_clamp: float | None = None,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, ExpertsBackend] = {}


def register_backend(name: str) -> Callable[[ExpertsBackend], ExpertsBackend]:
    def wrap(fn: ExpertsBackend) -> ExpertsBackend:
        _BACKENDS[name] = fn
        return fn

    return wrap


def get_backend(name: str) -> ExpertsBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown dispatch backend {name!r}; registered backends: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def backend_names() -> list[str]:
    return sorted(_BACKENDS)
