"""Typed configuration, loaded from TOML.

The MoE section lives at ``[model.moe]``. ``dispatch`` accepts the shorthand ``dispatch = "mega_moe"`` or the table
``[model.moe.dispatch]`` with ``type = "mega_moe"`` and backend options. Unknown keys and bad values are errors that
name the key, the file and the allowed values.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

Precision = Literal["bf16", "fp8", "mxfp8", "fp8_bwd"]
DispatchType = Literal["torch", "mega_moe"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
# What the `torch` backend runs: the GEMMs in the inputs' dtype, or rowwise-scaled fp8 (fp8_bwd and mxfp8: mega_moe).
TORCH_PRECISIONS: tuple[str, ...] = ("bf16", "fp8")
DISPATCH_TYPES: tuple[str, ...] = get_args(DispatchType)


class ConfigError(ValueError):
    """A configuration problem, with the key, the file and how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DispatchConfig(_Strict):
    """Backend options for the MoE dispatch (``[model.moe.dispatch]``). The field names and defaults of prime-rl's
    ``[model.moe.dispatch]`` table (``type``, ``max_tokens_per_rank``, ``num_sms``, ``fp8``, ``capacity_factor``) mean
    the same here, so one table serves both trainers."""

    type: DispatchType = "mega_moe"
    # The most tokens one rank may pass to the layer in one call (a hard capacity: more is an error naming this key).
    # None: no limit without expert parallelism; over EP, the largest call so far sizes the exchange buffers (they
    # grow, once, when a call brings more tokens). The reference trainer sets it to its tokens per rank.
    max_tokens_per_rank: int | None = Field(default=None, gt=0)
    # Streaming multiprocessors the layer's kernels may use, forward and backward (None: all of them), leaving the
    # rest to work that overlaps the layer (collectives of other parallelisms), like DeepGEMM's set_num_sms. The
    # persistent kernels launch that many programs; on CUDA each call runs on a CUDA green context of that many SMs
    # (needs a torch with torch.cuda.green_contexts). At most the GPU's SM count; results do not depend on it.
    num_sms: int | None = Field(default=None, gt=0)
    # prime-rl's switch for fp8 experts: true means [model.moe] precision = "fp8".
    fp8: bool = False
    # prime-rl's row pools of its fp8 kernel hold capacity_factor * max_tokens_per_rank * top_k routed rows; this
    # layer's buffers hold every routed row (nothing is dropped), so the value is checked (> 0) and has no effect.
    capacity_factor: float = Field(default=1.25, gt=0)
    # Sum each token's k contributions in a fixed order (no float atomics): bitwise reproducible. The only mode so
    # far: false is rejected at the first call.
    deterministic: bool = True
    # How top_k_index is checked against [-1, E) on a GPU. False (default): a device-side assertion, no host sync, so
    # the layer stays asynchronous and capturable in a CUDA graph. True: a host-side check with a readable message
    # (one device sync per call), for debugging. CPU tensors are always checked on the host.
    validate_routing: bool = False
    # How long a peer of the expert-parallel group may show no sign of life while this rank waits for its block:
    # every rank publishes a heartbeat several times a second (a thread, whatever the layer is doing), and a wait
    # fails with an error naming this rank, the peer and the block once the peer's heartbeat has stood still this
    # long (it crashed or was killed). A slow but live peer never trips it, however long the wait. None: the device's
    # default, 10 s on a GPU, 300 s under the Triton interpreter / on the CPU (processes there share few cores, and a
    # starved heartbeat thread may wait seconds for one).
    comm_timeout_s: float | None = Field(default=None, gt=0)
    # How long one cross-rank wait may last even while every peer is alive: a peer that never joins the exchange
    # (ranks calling the layer a different number of times) becomes an error after this long instead of a hang. Like
    # NCCL's watchdog it is generous, far above any healthy wait.
    comm_stall_timeout_s: float = Field(default=1800.0, gt=0)
    # How tokens and results move between the ranks of an expert-parallel group. "symmetric_memory": peer copies
    # through symmetric-memory buffers with device-side signals, overlapped with the expert GEMMs (CUDA only).
    # "collectives": torch.distributed all_gather / all_to_all, not overlapped (any backend, gloo on CPU). "auto":
    # symmetric_memory on CUDA, collectives elsewhere.
    transport: Literal["auto", "symmetric_memory", "collectives"] = "auto"
    # fp8 / fp8_bwd: round scales up to powers of two (exact rescaling, slightly coarser). mxfp8 scales always are.
    fp8_pow2_scales: bool = False
    # fp8 / fp8_bwd without expert parallelism: the backward runs its GEMMs in fp8 when an expert's average work,
    # tokens * top_k / local experts * H * I (the multiply-adds of its FC2), is at least this; else in bf16 from the
    # same saved tensors (more precise): on small GEMMs quantising the backward's operands costs more than its fp8
    # GEMMs save. One H200: Qwen3-30B-A3B is faster in bf16 at 256 rows an expert (4.0e8), in fp8 at 512 (8.1e8);
    # Qwen3-235B-A22B in fp8 at 256 (1.6e9). 0: fp8 at every size. The expert-parallel pipeline always runs the fp8
    # backward; mxfp8 always runs its own.
    fp8_backward_min_expert_work: int = Field(default=2**29, ge=0)


class MoEConfig(_Strict):
    """``[model.moe]``: which backend runs the experts, in which precision, over how many ranks."""

    dispatch: DispatchConfig = Field(default_factory=DispatchConfig)
    precision: Precision = "bf16"
    # Expert-parallel group size; experts are split evenly over it and it stays inside one node.
    ep: int = Field(default=1, gt=0)

    @field_validator("dispatch", mode="before")
    @classmethod
    def _dispatch_shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"type": value}
        return value

    @model_validator(mode="after")
    def _fp8_switch(self) -> MoEConfig:
        """prime-rl's ``[model.moe.dispatch] fp8 = true`` selects the fp8 experts; it agrees with an explicit
        ``precision`` or sets it."""
        if self.dispatch.fp8 and self.precision != "fp8":
            if "precision" in self.model_fields_set:
                raise ValueError(
                    f"[model.moe.dispatch] fp8 = true asks for fp8 experts but [model.moe] precision = "
                    f"{self.precision!r}; remove one of the two keys"
                )
            object.__setattr__(self, "precision", "fp8")  # (validate_assignment would re-enter this validator)
        return self


class ModelConfig(_Strict):
    """``[model]``: which causal LM to train (Qwen3-MoE architecture)."""

    name: str = Field(
        default="tiny",
        description="preset (tiny, qwen3-30b-a3b, qwen3-235b-a22b), a local directory with config.json (and "
        "*.safetensors weights, which are then loaded), or a transformers config name",
    )
    overrides: dict[str, int | float | bool | str] = Field(
        default_factory=dict,
        description="transformers config fields set on top of the preset / loaded config (e.g. num_hidden_layers = 4)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="compute dtype; with FSDP the master weights stay float32 and this is the parameter dtype "
        "of the mixed-precision policy, without FSDP the weights are stored in it",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(default="sdpa", description="attention kernel")
    moe: MoEConfig = Field(default_factory=MoEConfig)


class DataConfig(_Strict):
    """``[data]``: the built-in synthetic task, or a JSONL file with a local tokenizer."""

    source: Literal["synthetic", "jsonl"] = Field(default="synthetic", description="where examples come from")
    task: Literal["add", "reverse", "sort"] = Field(
        default="add", description="synthetic task: add two numbers, reverse a word, or sort letters"
    )
    path: str | None = Field(default=None, description="JSONL file: one {text} or {prompt, completion} per line")
    tokenizer: str | None = Field(
        default=None,
        description="local tokenizer directory, or 'byte' (default: the model directory's tokenizer if it has "
        "one, else bytes)",
    )
    num_examples: int = Field(
        default=100_000, gt=0, description="synthetic: distinct packed sequences before the stream repeats"
    )

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> DataConfig:
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.path is required when data.source = 'jsonl'")
        return self


class OptimConfig(_Strict):
    """``[optim]``: AdamW with linear warm-up then cosine decay."""

    lr: float = Field(default=3e-3, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="final lr as a fraction of lr")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW betas")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    warmup_steps: int = Field(default=5, ge=0, description="linear warm-up steps")
    max_grad_norm: float = Field(default=1.0, gt=0, description="clip the global gradient norm to this")


class TrainConfig(_Strict):
    """``[train]``: the loop."""

    steps: int = Field(default=60, gt=0, description="optimizer steps")
    batch_size: int = Field(default=8, gt=0, description="sequences per step over all ranks (divisible by them)")
    seq_len: int = Field(default=64, gt=1, description="tokens per sequence (examples are packed)")
    activation_checkpointing: bool = Field(default=False, description="recompute each decoder layer in backward")
    seed: int = Field(default=0, description="seeds model init and the data order")
    log_every: int = Field(default=1, gt=0, description="print a line / update the bar every N steps")
    checkpoint_every: int = Field(default=0, ge=0, description="save a checkpoint every N steps (0: only at the end)")
    save_final: bool = Field(default=True, description="save a checkpoint after the last step")
    resume: bool = Field(default=False, description="continue from the latest checkpoint in output_dir")
    resume_from: str | None = Field(default=None, description="continue from this checkpoint directory")
    data_parallel: Literal["auto", "fsdp", "allreduce"] = Field(
        default="auto",
        description="auto: FSDP2 (fully_shard) on GPU, gradient all-reduce on CPU",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda when available")


class Config(_Strict):
    """A whole run: model, data, optimizer, loop and where outputs go."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    output_dir: str = Field(default="outputs/run", description="metrics.jsonl and checkpoints go here")


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"] if not str(p).startswith("function-"))
        kind = item["type"]
        if kind == "extra_forbidden":
            lines.append(f"unknown key '{key}' in {source}: remove it or check its spelling")
        elif kind in ("literal_error", "enum"):
            allowed = item.get("ctx", {}).get("expected", "")
            lines.append(f"{key} = {item['input']!r} in {source} is not allowed; allowed values: {allowed}")
        else:
            lines.append(f"{key} in {source}: {item['msg']} (got {item.get('input')!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a nested dict (as read from TOML) into a Config; errors name the key and ``source``."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Read a TOML file into a Config. ``overrides`` maps dotted keys (``train.steps``) to values applied on top."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with path.open("rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path} is not valid TOML: {err}") from None
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    return config_from_dict(data, str(path))


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data['a']['b'] = value`` for ``dotted = 'a.b'``, creating tables on the way.

    The dispatch shorthand (``dispatch = "torch"``) is widened to its table form when a nested key is set under it.
    """
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if isinstance(child, str) and part == "dispatch":
            child = {"type": child}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is a value, not a table")
        node[part] = child
        node = child
    if leaf == "dispatch" and isinstance(node.get("dispatch"), dict) and isinstance(value, str):
        node["dispatch"]["type"] = value
    else:
        node[leaf] = value
