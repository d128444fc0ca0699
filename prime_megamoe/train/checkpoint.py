"""Checkpoints: model, optimizer, step and RNG, one safetensors file per rank.

``output_dir/checkpoints/step_00000020/rank_00000.safetensors`` holds what rank 0 owns: its shard of every weight
(its experts; with FSDP2 its rows of every weight) and the matching AdamW state, plus the RNG state. ``meta.json``
records the step and the layout; ``checkpoints/latest`` names the newest complete checkpoint (it is written after every
rank has finished). Resuming needs the same number of ranks and the same ep; the data order is a function of the
step, so the resumed run continues the same loss curve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from .parallel import Runtime


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _host(t: torch.Tensor) -> torch.Tensor:
    return _local(t).detach().contiguous().cpu()


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    pointer = checkpoint_root(output_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_root(output_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def save_checkpoint(
    output_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, rt: Runtime, extra: dict
) -> Path:
    """Write the checkpoint after ``step`` optimizer steps; every rank calls this."""
    from safetensors.torch import save_file

    root = checkpoint_root(output_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()

    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, value in model.state_dict().items():
        local = _local(value)
        storage = (local.data_ptr(), local.numel())
        if local.numel() and storage in seen:  # tied weights: stored once
            continue
        seen.add(storage)
        tensors[f"model/{name}"] = _host(value)
    optim_state = optimizer.state_dict()
    for idx, state in optim_state["state"].items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{idx}/{k}"] = _host(v)
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    non_tensor_state = {
        str(idx): {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        for idx, state in optim_state["state"].items()
    }
    metadata = {
        "param_groups": json.dumps(optim_state["param_groups"]),
        "optim_scalars": json.dumps(non_tensor_state),
    }
    save_file(tensors, str(tmp / f"rank_{rt.rank:05d}.safetensors"), metadata=metadata)
    _barrier()
    if rt.is_main:
        meta = {"step": step, "world": rt.world, "ep": rt.ep.ep, "fsdp": rt.fsdp, **extra}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / "latest").write_text(final.name + "\n")
    _barrier()
    return final


@torch.no_grad()
def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, rt: Runtime) -> dict:
    """Restore what ``save_checkpoint`` wrote into an identically laid out run; returns meta.json."""
    from safetensors import safe_open

    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise ConfigError(f"train.resume_from = {str(path)!r} is not a checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    layout = (meta["world"], meta["ep"], meta["fsdp"])
    if layout != (rt.world, rt.ep.ep, rt.fsdp):
        raise ConfigError(
            f"checkpoint {path} was written by {meta['world']} ranks with ep = {meta['ep']} and fsdp = {meta['fsdp']}; "
            f"this run has {rt.world} ranks, [model.moe] ep = {rt.ep.ep}, fsdp = {rt.fsdp}: resume with the same layout"
        )
    with safe_open(str(path / f"rank_{rt.rank:05d}.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        file_meta = f.metadata()
        for name, value in model.state_dict().items():
            key = f"model/{name}"
            if key not in keys:
                continue  # a tied weight, restored through its twin
            _local(value).copy_(f.get_tensor(key))

        params = [p for group in optimizer.param_groups for p in group["params"]]
        scalars = json.loads(file_meta["optim_scalars"])
        state = {}
        for idx, param in enumerate(params):
            prefix = f"optim/{idx}/"
            entries = {k[len(prefix) :]: f.get_tensor(k) for k in keys if k.startswith(prefix)}
            if not entries:
                continue
            for k, v in entries.items():
                if isinstance(param, DTensor) and v.dim() > 0:
                    v = DTensor.from_local(
                        v.to(param.device),
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                entries[k] = v
            entries.update(scalars.get(str(idx), {}))
            state[idx] = entries
        optimizer.load_state_dict({"state": state, "param_groups": json.loads(file_meta["param_groups"])})
        torch.set_rng_state(f.get_tensor("rng/cpu"))
        if "rng/cuda" in keys and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("rng/cuda"))
    return meta
