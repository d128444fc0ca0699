"""Process groups, data parallelism (FSDP2 or gradient all-reduce), gradient norm and activation checkpointing.

Layout: W ranks, EP groups of ``ep`` consecutive ranks (inside one node), the ``W / ep`` ranks holding the same
experts form a replica group. Every rank reads its own slice of each global batch, so all W ranks are data parallel.

The loss of rank r is ``sum of its token losses / tokens in the global batch``, so the gradient of the global loss is
the plain SUM of the ranks' gradients: replicated (non-expert) weights sum over all W ranks; an expert's gradient
already sums over its EP group (the backward of the combine sends the gradients home) and then sums over the replica
group. FSDP2 reduce-scatters with divide factor 1 to get the same sum; the all-reduce mode does it by hand.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm.liveness import start_heartbeat
from ..integrations.transformers import ExpertParallel, experts_modules, init_expert_parallel


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    ep: ExpertParallel
    fsdp: bool
    owns_process_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_runtime(device_pref: str, ep: int, data_parallel: str) -> Runtime:
    """Join torch.distributed when launched by torchrun (or when a caller already initialised it), pick the device and
    build the EP groups."""
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is available")
    owns = False
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    if use_cuda:  # before NCCL starts, so that each rank talks from its own GPU
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if not dist.is_initialized() and world_env > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
        owns = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        start_heartbeat()  # expert-parallel waits judge a rank alive by it (``comm.liveness``), from the start
    # One rank has nothing to shard or reduce: FSDP only with several ranks.
    fsdp = world > 1 and (data_parallel == "fsdp" or (data_parallel == "auto" and use_cuda))
    return Runtime(rank, world, local_rank, device, init_expert_parallel(ep), fsdp, owns)


def all_reduce_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value


# ---------------------------------------------------------------------------------------------------------------------
# Activation checkpointing and FSDP2


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Recompute each block's forward in its backward (non-reentrant). The block keeps its name and parameters."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], rt: Runtime, param_dtype: torch.dtype) -> None:
    """FSDP2: experts sharded over their replica group, every other weight over all ranks; gradients summed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    ep = rt.ep.ep
    mesh = init_device_mesh(rt.device.type, (rt.world // ep, ep), mesh_dim_names=("replica", "ep"))
    world_mesh = init_device_mesh(rt.device.type, (rt.world,), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        for _, experts in experts_modules(block):
            fully_shard(experts, mesh=mesh["replica"], mp_policy=mp)
        fully_shard(block, mesh=world_mesh, mp_policy=mp)
    fully_shard(model, mesh=world_mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
            else:  # older torch
                module.set_reduce_scatter_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                # A plain SUM reduce-scatter (gloo has no PREMUL_SUM; with factor 1 the two are the same).
                module.set_force_sum_reduction_for_comms(True)


# ---------------------------------------------------------------------------------------------------------------------
# Gradients


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(replicated parameters, expert parameters) of a model, each parameter once."""
    expert_ids = set()
    for _, module in experts_modules(model):
        expert_ids.update(id(p) for p in (module.gate_up_proj, module.down_proj))
    dense, experts, seen = [], [], set()
    for param in model.parameters():
        if id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        (experts if id(param) in expert_ids else dense).append(param)
    return dense, experts


def _all_reduce_grads(params: list[nn.Parameter], group) -> None:
    if not params or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:  # keep the collective identical on every rank
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sync_gradients(dense: list[nn.Parameter], experts: list[nn.Parameter], rt: Runtime) -> None:
    """All-reduce mode: sum replicated gradients over all ranks, expert gradients over their replica group.
    (FSDP2 has already done this in its reduce-scatter.)"""
    if rt.fsdp:
        return
    _all_reduce_grads(dense, None)
    if rt.ep.replica_group is not None:  # None: one EP group, every expert lives on exactly one rank
        _all_reduce_grads(experts, rt.ep.replica_group)


@torch.no_grad()
def clip_grad_norm(dense: list[nn.Parameter], experts: list[nn.Parameter], max_norm: float, rt: Runtime) -> float:
    """Global L2 norm of all gradients (each weight counted once), then scale them to at most ``max_norm``."""

    def sq(params):
        total = torch.zeros((), dtype=torch.float32, device=rt.device)
        for p in params:
            if p.grad is not None:
                total += _local(p.grad).float().pow(2).sum()
        return total

    dense_sq, expert_sq = sq(dense), sq(experts)
    if rt.fsdp:  # gradients are sharded: every rank holds a disjoint part
        all_reduce_sum(dense_sq)
        if rt.ep.replica_group is not None:
            all_reduce_sum(expert_sq, rt.ep.replica_group)
    if rt.ep.ep_group is not None:  # each EP rank holds different experts
        all_reduce_sum(expert_sq, rt.ep.ep_group)
    norm = float((dense_sq + expert_sq).sqrt())
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p in dense + experts:
            if p.grad is not None:
                _local(p.grad).mul_(scale)
    return norm
