"""transformers integration: ``experts_implementation="mega_moe"`` (and ``"torch"``), plus expert parallelism.

``register()`` adds two implementations to transformers' ExpertsInterface. An experts module that uses that interface
(``Qwen3MoeExperts`` and the other ``@use_experts_implementation`` classes) then runs ``prime_megamoe.fused_experts``
with its own ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]:

    from prime_megamoe.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="mega_moe")

The backend follows the implementation name; the backend options (``[model.moe.dispatch]``), the precision and the
expert-parallel group come from ``configure_experts(model, moe, group)`` (defaults: ``MoEConfig()``, one rank).

Expert parallelism over a group of W ranks: ``init_expert_parallel(ep)`` builds the groups (inside one node),
``shard_experts(model, group)`` keeps on rank r only experts ``[r*E/W, (r+1)*E/W)`` and
``load_weights(model, path, ...)`` fills a (possibly sharded) model from safetensors files, reading only the slices
this rank keeps. The router stays whole on every rank, so ``top_k_index`` holds global expert ids, as
``fused_experts`` expects.

Works with transformers 5.x: only ``ExpertsInterface.register`` (a class method of ``GeneralInterface``) and the
``config._experts_implementation`` attribute are used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError, DispatchConfig, MoEConfig
from ..functional import fused_experts

IMPLEMENTATIONS: tuple[str, ...] = ("mega_moe", "torch")
_SETTINGS = "_prime_megamoe"


@dataclass
class ExpertsSettings:
    """What an experts module runs with: backend options per implementation, precision, EP group."""

    moe: MoEConfig
    group: dist.ProcessGroup | None = None

    def dispatch_for(self, backend: str) -> DispatchConfig:
        if self.moe.dispatch.type == backend:
            return self.moe.dispatch
        return self.moe.dispatch.model_copy(update={"type": backend})


def _check_supported(module: nn.Module) -> None:
    # Attributes set by transformers' @use_experts_implementation (absent in older 5.x releases: then the defaults
    # below are what those releases assume).
    unsupported = []
    if getattr(module, "has_bias", False):
        unsupported.append("has_bias=True")
    if getattr(module, "is_transposed", False) or getattr(module, "experts_are_transposed", False):
        unsupported.append("transposed weights")
    if not getattr(module, "has_gate", True):
        unsupported.append("has_gate=False")
    if not getattr(module, "is_concatenated", True):
        unsupported.append("interleaved gate/up rows")
    if getattr(module, "has_post_expert_norm", False):
        unsupported.append("a post-expert norm")
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        unsupported.append(f"hidden_act={act!r}")
    if unsupported:
        raise NotImplementedError(
            f"{type(module).__name__} uses {', '.join(unsupported)}; the prime_megamoe experts implementations "
            "compute SwiGLU experts with gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I] "
            "only: pick another experts_implementation for this model"
        )


def _make_forward(backend: str):
    def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        settings: ExpertsSettings | None = getattr(self, _SETTINGS, None)
        if settings is None:
            settings = ExpertsSettings(MoEConfig())
            setattr(self, _SETTINGS, settings)
        if not getattr(self, "_prime_megamoe_checked", False):
            _check_supported(self)
            self._prime_megamoe_checked = True
        return fused_experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            dispatch=settings.dispatch_for(backend),
            precision=settings.moe.precision,
            group=settings.group,
        )

    experts_forward.__name__ = f"{backend}_experts_forward"
    experts_forward.__doc__ = f"transformers experts forward running prime_megamoe.fused_experts(dispatch={backend!r})"
    return experts_forward


mega_moe_experts_forward = _make_forward("mega_moe")
torch_experts_forward = _make_forward("torch")


def register() -> None:
    """Add ``"mega_moe"`` and ``"torch"`` to transformers' ExpertsInterface (idempotent)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as err:  # pragma: no cover - transformers < 5
        raise ImportError(
            "prime_megamoe's transformers integration needs transformers >= 5 (ExpertsInterface); "
            "install it with pip install 'transformers>=5'"
        ) from err
    ExpertsInterface.register("mega_moe", mega_moe_experts_forward)
    ExpertsInterface.register("torch", torch_experts_forward)


# ---------------------------------------------------------------------------------------------------------------------
# Finding and configuring experts modules


def is_experts_module(module: nn.Module) -> bool:
    """A module holding all of one layer's experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 and down.dim() == 3
    )


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) of every experts module in ``model``."""
    for name, module in model.named_modules():
        if is_experts_module(module):
            yield name, module


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Qualified names of the expert weights (sharded over the EP group; every other parameter is replicated)."""
    names = set()
    for prefix, _ in experts_modules(model):
        for attr in ("gate_up_proj", "down_proj"):
            names.add(f"{prefix}.{attr}" if prefix else attr)
    return names


def configure_experts(model: nn.Module, moe: MoEConfig | None = None, group: dist.ProcessGroup | None = None) -> int:
    """Set the backend options, precision and expert-parallel group every experts module of ``model`` runs with.

    Returns how many experts modules were configured. ``group`` must be the group the experts were sharded over
    (``shard_experts``) or None for unsharded experts."""
    moe = moe or MoEConfig()
    size = 1 if group is None else dist.get_world_size(group)
    count = 0
    for _, module in experts_modules(model):
        sharded = getattr(module, "ep_size", 1)
        if sharded != size:
            raise ValueError(
                f"experts are sharded over {sharded} ranks but the group has {size}; call shard_experts(model, group) "
                "with the same group"
            )
        setattr(module, _SETTINGS, ExpertsSettings(moe, group))
        count += 1
    return count


# ---------------------------------------------------------------------------------------------------------------------
# Expert parallelism


@dataclass
class ExpertParallel:
    """Process groups of an EP run. Ranks ``[g*ep, (g+1)*ep)`` form EP group g (inside one node); the ranks with
    the same EP rank in every EP group hold the same experts and form the replica group (data parallel for them)."""

    ep: int
    ep_rank: int
    ep_group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup | None  # None when there is a single EP group
    world: int
    rank: int

    @property
    def num_replicas(self) -> int:
        return self.world // self.ep


def check_expert_parallel_layout(ep: int, world: int, local_world: int) -> None:
    """Raise ConfigError (naming ``[model.moe] ep``) unless EP groups of ``ep`` consecutive ranks fit in nodes of
    ``local_world`` ranks and tile the ``world`` ranks."""
    if ep > world or world % ep:
        raise ConfigError(
            f"[model.moe] ep = {ep} does not divide the {world} ranks of this run; set ep to a divisor of the number "
            f"of ranks (launch with torchrun --nproc-per-node {ep} or more)"
        )
    if ep > local_world or local_world % ep:
        raise ConfigError(
            f"[model.moe] ep = {ep} would span nodes: each node runs LOCAL_WORLD_SIZE = {local_world} ranks and the "
            f"expert-parallel group must stay inside one node (NVLink); set ep to a divisor of {local_world}"
        )


def init_expert_parallel(ep: int, *, local_world_size: int | None = None) -> ExpertParallel:
    """Build the EP and replica groups for ``ep`` (every rank must call this). Without torch.distributed, or with one
    rank, this is the trivial layout. ``local_world_size`` defaults to ``$LOCAL_WORLD_SIZE`` (set by torchrun), or
    the world size when unset (one node)."""
    if not (dist.is_available() and dist.is_initialized()):
        if ep != 1:
            raise ConfigError(
                f"[model.moe] ep = {ep} needs {ep} ranks; launch with torchrun --nproc-per-node {ep} "
                "(torch.distributed is not initialised)"
            )
        return ExpertParallel(1, 0, None, None, 1, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_expert_parallel_layout(ep, world, local_world_size)
    ep_group = replica_group = None
    for g in range(world // ep):  # every rank creates every group, in the same order
        ranks = list(range(g * ep, (g + 1) * ep))
        group = dist.new_group(ranks) if ep > 1 else None
        if rank in ranks:
            ep_group = group
    if world // ep > 1:
        for e in range(ep):
            ranks = list(range(e, world, ep))
            group = dist.new_group(ranks)
            if rank in ranks:
                replica_group = group
    return ExpertParallel(ep, rank % ep, ep_group, replica_group, world, rank)


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None) -> list[str]:
    """Keep on this rank only its experts' slice ``[r*E/W, (r+1)*E/W)`` of every experts module's weights.

    Works on meta tensors too (no memory is touched then). Returns the names of the sharded modules."""
    rank, size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    names = []
    for name, module in experts_modules(model):
        if hasattr(module, "num_global_experts"):
            raise ValueError(f"{name} is already sharded (over {module.ep_size} ranks)")
        num_experts = module.gate_up_proj.shape[0]
        if num_experts % size:
            raise ConfigError(
                f"[model.moe] ep = {size} does not divide the {num_experts} experts of {name}; choose ep so that it "
                "divides the number of experts"
            )
        local = num_experts // size
        lo = rank * local
        for attr in ("gate_up_proj", "down_proj"):
            old = getattr(module, attr)
            data = old.detach()[lo : lo + local]
            data = data if data.is_meta else data.clone()
            setattr(module, attr, nn.Parameter(data, requires_grad=old.requires_grad))
        module.num_global_experts = num_experts
        module.num_local_experts = local
        module.ep_rank = rank
        module.ep_size = size
        module.expert_offset = lo
        names.append(name)
    return names


# ---------------------------------------------------------------------------------------------------------------------
# Loading weights, reading only the slices a rank keeps


def _checkpoint_index(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a directory (with or without an index) or a single file."""
    if path.is_file():
        files = [path]
    else:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {key: path / fname for key, fname in weight_map.items()}
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                out[key] = f
    return out


def _shard_range(param: torch.Tensor) -> tuple[int, int] | None:
    """For a DTensor sharded on dim 0 over a 1-D mesh (FSDP2), the global rows [lo, hi) this rank holds."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    if len(param.placements) != 1 or not isinstance(param.placements[0], Shard) or param.placements[0].dim != 0:
        raise NotImplementedError(f"loading into a DTensor with placements {param.placements} is not supported")
    size = param.device_mesh.size()
    rank = param.device_mesh.get_local_rank()
    rows = param.shape[0]
    chunk = -(-rows // size)
    lo = min(rank * chunk, rows)
    return lo, min(lo + chunk, rows)


class _Reader:
    """Open safetensors files once each and read row ranges of named tensors."""

    def __init__(self, index: dict[str, Path]):
        self.index = index
        self._handles: dict[Path, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def rows(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        from safetensors import safe_open

        f = self.index[key]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        handle = self._handles[f]
        if lo is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[lo:hi]


def _expert_rows(reader: _Reader, prefix: str, attr: str, first: int, count: int) -> torch.Tensor:
    """Experts [first, first + count) of one layer's ``attr`` in our layout, from a fused or a per-expert checkpoint."""
    fused = f"{prefix}.{attr}"
    if fused in reader:
        return reader.rows(fused, first, first + count)
    per_expert = []
    for e in range(first, first + count):
        if attr == "gate_up_proj":
            gate, up = f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight"
            if gate not in reader or up not in reader:
                raise KeyError(f"checkpoint has neither {fused} nor {gate} / {up}")
            per_expert.append(torch.cat([reader.rows(gate), reader.rows(up)], dim=0))
        else:
            key = f"{prefix}.{e}.down_proj.weight"
            if key not in reader:
                raise KeyError(f"checkpoint has neither {fused} nor {key}")
            per_expert.append(reader.rows(key))
    if not per_expert:
        raise KeyError(f"no experts to read for {fused}")
    return torch.stack(per_expert)


@torch.no_grad()
def load_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Fill ``model``'s parameters and persistent buffers from safetensors weights at ``path`` (a directory as written
    by ``save_pretrained``, with or without an index, or one file).

    Expert weights may be stored fused (``...experts.gate_up_proj`` [E, 2I, H]) or per expert
    (``...experts.{e}.gate_proj.weight`` etc., the Hugging Face Hub layout); only this rank's experts are read
    (``safe_open(...).get_slice``), and for FSDP2-sharded parameters (DTensors sharded on dim 0) only this rank's rows.
    Tied weights absent from the checkpoint are skipped."""
    from torch.distributed.tensor import DTensor

    reader = _Reader(_checkpoint_index(Path(path)))
    expert_owner = {}
    for prefix, module in experts_modules(model):
        for attr in ("gate_up_proj", "down_proj"):
            expert_owner[f"{prefix}.{attr}"] = (prefix, attr, getattr(module, "expert_offset", 0))
    tied = _tied_names(model)
    missing = []
    for name, tensor in list(model.named_parameters()) + list(_persistent_buffers(model)):
        rows = _shard_range(tensor)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if name in expert_owner:
            prefix, attr, offset = expert_owner[name]
            lo, hi = rows if rows is not None else (0, tensor.shape[0])
            try:
                value = _expert_rows(reader, prefix, attr, offset + lo, hi - lo) if hi > lo else local[:0]
            except KeyError as err:
                missing.append(str(err))
                continue
        elif name in reader:
            value = reader.rows(name, *rows) if rows is not None else reader.rows(name)
        elif name in tied:
            continue
        else:
            missing.append(name)
            continue
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(f"{name}: checkpoint slice has shape {tuple(value.shape)}, the model {tuple(local.shape)}")
        local.copy_(value.to(local.dtype))
    if missing:
        shown = "; ".join(missing[:5]) + (f"; and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise KeyError(f"weights at {path} lack tensors the model needs: {shown}")


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that share storage with an earlier parameter (e.g. a tied lm_head)."""
    seen, tied = {}, set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.setdefault(id(param), name)
    config = getattr(model, "config", None)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    if weight is not None and getattr(config, "tie_word_embeddings", False):
        tied.update(name for name, param in model.named_parameters() if param is weight)
    return tied


# ---------------------------------------------------------------------------------------------------------------------
# Building models


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point parameters (not buffers: rotary frequencies stay float32) to ``dtype``."""
    done: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in done:
                done[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            module._parameters[name] = done[id(param)]


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter and buffer real (uninitialised) storage on ``device``, then recompute the
    non-persistent buffers (rotary inverse frequencies) from the config, since meta tensors carry no values."""
    model.to_empty(device=device)
    for name, module in model.named_modules():
        non_persistent = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not non_persistent:
            continue
        try:
            with torch.device("cpu"):
                fresh = type(module)(module.config)
        except Exception as err:  # noqa: BLE001 - re-raised with the module named
            raise NotImplementedError(
                f"cannot recompute the buffers {non_persistent} of {name} ({type(module).__name__}) after meta "
                "initialisation"
            ) from err
        for buf in non_persistent:
            # Replaced, not copied into: the fresh buffer keeps its own dtype (rotary frequencies stay float32).
            module._buffers[buf] = getattr(fresh, buf).to(device)
        if hasattr(fresh, "attention_scaling"):
            module.attention_scaling = fresh.attention_scaling


def model_from_config(config, experts_implementation: str):
    """``AutoModelForCausalLM.from_config`` with our experts implementation (``register()`` first).

    transformers releases before 5.7 accepted only their own implementation names when a model was constructed; there
    the model is built with "eager" and switched afterwards (the experts forward reads the name at call time)."""
    from transformers import AutoModelForCausalLM

    register()
    config._experts_implementation = experts_implementation
    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        if "experts_implementation" not in str(err) or experts_implementation not in IMPLEMENTATIONS:
            raise
    config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    model.config._experts_implementation = experts_implementation
    return model


def from_pretrained_expert_parallel(
    path: str | os.PathLike,
    *,
    moe: MoEConfig | None = None,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    experts_implementation: str | None = None,
    **config_kwargs,
):
    """``AutoModelForCausalLM.from_pretrained`` for expert parallelism: build the model on the meta device, keep this
    rank's experts, then read only those slices (and the replicated weights) from ``path``'s safetensors files.

    ``experts_implementation`` defaults to ``moe.dispatch.type``."""
    from transformers import AutoConfig

    moe = moe or MoEConfig()
    impl = experts_implementation or moe.dispatch.type
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    with torch.device("meta"):
        model = model_from_config(config, impl)
    shard_experts(model, group)
    cast_parameters(model, dtype)
    materialize(model, device)
    load_weights(model, path)
    configure_experts(model, moe, group)
    return model
