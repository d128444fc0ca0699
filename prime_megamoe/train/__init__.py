"""Reference SFT trainer for Qwen3-MoE-architecture causal LMs, with ``prime_megamoe`` experts.

``python -m prime_megamoe.train CONFIG.toml`` or ``torchrun --nproc-per-node N -m prime_megamoe.train CONFIG.toml``;
in Python, ``train(load_config(path))``.
"""

from .cli import main
from .trainer import train

__all__ = ["main", "train"]
