"""prime_megamoe: a fused, expert-parallel Mixture-of-Experts layer for training, in Triton."""

from .config import Config, ConfigError, DispatchConfig, MoEConfig, load_config
from .dispatch import TokenDispatcher, backend_names, build_dispatcher
from .functional import fused_experts
from .layers import GroupedExperts, MoEBlock, TopKRouter
from .ops.quantized_experts import invalidate_weight_cache
from .routing import softmax_top_k

__all__ = [
    "Config",
    "ConfigError",
    "DispatchConfig",
    "GroupedExperts",
    "MoEBlock",
    "MoEConfig",
    "TokenDispatcher",
    "TopKRouter",
    "backend_names",
    "build_dispatcher",
    "fused_experts",
    "invalidate_weight_cache",
    "load_config",
    "softmax_top_k",
]

__version__ = "0.1.0"
