"""Dispatch backends (``torch`` baseline, ``mega_moe`` fused) and the prime-rl-style token dispatcher."""

from . import mega_moe, torch_baseline  # noqa: F401  (importing registers the backends)
from .dispatcher import TokenDispatcher, build_dispatcher
from .registry import backend_names, get_backend, register_backend

__all__ = ["TokenDispatcher", "backend_names", "build_dispatcher", "get_backend", "register_backend"]
