"""Model presets and building a (possibly expert-sharded) Qwen3-MoE causal LM from ``[model]``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..integrations import transformers as hf

# Qwen3-MoE architecture, real shapes for the two Qwen3 MoE models; `tiny` runs on a CPU under the Triton interpreter.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=260,  # bytes + <pad> <bos> <eos> (see train.data.ByteTokenizer)
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    "qwen3-235b-a22b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
    ),
}

# Random-init models up to this many parameters are built whole on the CPU from the seed and then sliced, so that any
# ep gives the same initial weights; larger ones are built on the meta device and each rank initialises its shard.
FULL_INIT_MAX_PARAMS = 1_000_000_000


@dataclass
class ModelSource:
    config: Any  # a transformers PretrainedConfig
    weights_dir: str | None  # a directory with *.safetensors to load, or None for random init
    local_dir: str | None  # a local model directory (tokenizer may live there)


def _qwen3_moe_config(fields: dict[str, Any]):
    from transformers import Qwen3MoeConfig

    fields = dict(fields)
    theta = fields.pop("rope_theta", None)
    cfg = Qwen3MoeConfig(**fields)
    if theta is not None:
        # transformers 5 keeps rope settings in rope_parameters (older releases: a rope_theta attribute).
        params = getattr(cfg, "rope_parameters", None)
        if isinstance(params, dict):
            params["rope_theta"] = theta
        else:
            cfg.rope_theta = theta
    return cfg


def resolve_model(model: ModelConfig) -> ModelSource:
    """The transformers config (with ``model.overrides`` applied) and where weights come from. No weights are read."""
    from transformers import AutoConfig

    name = model.name
    if name in PRESETS:
        cfg, weights, local = _qwen3_moe_config(PRESETS[name]), None, None
    elif Path(name).is_dir():
        if not (Path(name) / "config.json").is_file():
            raise ConfigError(f"model.name = {name!r} is a directory without config.json")
        cfg = AutoConfig.from_pretrained(name, local_files_only=True)
        weights = name if any(Path(name).glob("*.safetensors")) else None
        local = name
    else:
        try:
            from transformers import CONFIG_MAPPING

            # A model type (e.g. qwen3_moe), or a Hub id already in the local cache: the trainer downloads nothing.
            cfg = (
                CONFIG_MAPPING[name]()
                if name in CONFIG_MAPPING
                else AutoConfig.from_pretrained(name, local_files_only=True)
            )
        except Exception as err:  # noqa: BLE001 - re-raised as a config error naming the key
            raise ConfigError(
                f"model.name = {name!r} is not a preset ({', '.join(PRESETS)}), a local directory with config.json, "
                f"or a transformers config name ({type(err).__name__}: {err})"
            ) from None
        weights, local = None, None
    for key, value in model.overrides.items():
        if not hasattr(cfg, key):
            raise ConfigError(f"model.overrides.{key}: {type(cfg).__name__} has no field {key!r}")
        setattr(cfg, key, value)
    cfg._attn_implementation = model.attn_implementation
    return ModelSource(cfg, weights, local)


def num_experts_of(cfg) -> int | None:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (units for FSDP and activation checkpointing)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        inner = getattr(model, "model", model)
        blocks = list(getattr(inner, "layers", []))
    if not blocks:
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}")
    return blocks


def build_model(
    source: ModelSource,
    *,
    experts_implementation: str,
    param_dtype: torch.dtype,
    ep_group,
    seed: int,
    ep_rank: int = 0,
) -> tuple[nn.Module, bool]:
    """Build the model with this rank's experts only. Returns (model, needs_init): with ``needs_init`` the parameters
    are still on the meta device and ``initialize(...)`` must run once the model is parallelised."""
    cfg = source.config
    with torch.device("meta"):
        model = hf.model_from_config(cfg, experts_implementation)
    count = sum(p.numel() for p in model.parameters())
    if source.weights_dir is None and count <= FULL_INIT_MAX_PARAMS:
        # Whole model on the CPU from the seed, then keep this rank's experts: identical weights for every ep.
        torch.manual_seed(seed)
        model = hf.model_from_config(cfg, experts_implementation)
        hf.shard_experts(model, ep_group)
        hf.cast_parameters(model, param_dtype)
        needs_init = False
    else:
        hf.shard_experts(model, ep_group)
        hf.cast_parameters(model, param_dtype)
        needs_init = True
    if not any(True for _ in hf.experts_modules(model)):
        raise ConfigError(
            f"model.name = {type(model).__name__} has no experts modules (gate_up_proj / down_proj); the trainer "
            "trains Mixture-of-Experts models such as Qwen3-MoE"
        )
    return model, needs_init


@torch.no_grad()
def initialize(model: nn.Module, source: ModelSource, device: torch.device, *, seed: int, ep_rank: int) -> None:
    """Materialise a meta-built model on ``device`` and load its weights (only this rank's slices) or initialise it:
    replicated weights from ``seed`` (the same on every rank), each rank's experts from (seed, ep_rank)."""
    hf.materialize(model, device)
    if source.weights_dir is not None:
        hf.load_weights(model, source.weights_dir)
        return
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    std = getattr(source.config, "initializer_range", 0.02)
    rank = dist.get_rank() if dist.is_initialized() else 0
    replicated = torch.Generator(device=device).manual_seed(seed)  # same values on every rank
    own_shard = torch.Generator(device=device).manual_seed(seed * 1000 + 7 + rank)
    own_experts = torch.Generator(device=device).manual_seed(seed * 1000 + 1 + ep_rank)
    experts = set()
    for _, module in hf.experts_modules(model):
        experts.update(id(p) for p in (module.gate_up_proj, module.down_proj))
    for _name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(param, DTensor):
            gen = own_shard  # each rank holds different rows
        elif id(param) in experts:
            gen = own_experts  # replicas of one EP rank hold the same experts
        else:
            gen = replicated
        if local.dim() == 1:  # norm weights
            local.fill_(1.0)
        else:
            local.normal_(0.0, std, generator=gen)
