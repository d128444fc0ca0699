"""Fixed-size token exchange over torch.distributed (gloo on CPU, NCCL on GPU).

Every rank contributes a block of exactly ``capacity`` rows (its tokens, padded), so split sizes are static: no
counts travel to the host and the calls are stream-ordered on GPU. Collectives here move bytes only (no reductions),
so tensors travel as raw bytes (uint8), which every backend supports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None)
    if gather is not None:
        gather(_wire(out), _wire(inp), group=group)
    else:
        dist.all_gather_into_tensor(_wire(out), _wire(inp), group=group)


def all_gather_blocks(block: torch.Tensor, group) -> torch.Tensor:
    """[C, ...] on each of W ranks -> [W*C, ...] on every rank (rank r's block at rows [r*C, (r+1)*C))."""
    world = dist.get_world_size(group)
    out = block.new_empty((world * block.shape[0], *block.shape[1:]))
    _all_gather_into(out, block.contiguous(), group)
    return out


def exchange_blocks(blocks: torch.Tensor, group) -> torch.Tensor:
    """[W*C, ...]: block s goes to rank s. Returns [W*C, ...] whose block s came from rank s."""
    out = torch.empty_like(blocks)
    dist.all_to_all_single(_wire(out), _wire(blocks.contiguous()), group=group)
    return out


class _AllToAllVariable(torch.autograd.Function):
    """all_to_all with host-known split sizes (the baseline's exchange); the backward sends gradients back."""

    @staticmethod
    def forward(ctx, inp, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        dist.all_to_all_single(_wire(out), _wire(inp.contiguous()), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(_wire(back), _wire(grad.contiguous()), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_variable(inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable all_to_all of rows with split sizes given on the host."""
    return _AllToAllVariable.apply(inp, out_splits, in_splits, group)
