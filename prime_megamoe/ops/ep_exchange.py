"""Autograd for moving tokens to the experts' ranks and results back over collectives, around an unsplit expert
call: the expert parallelism of the quantised precisions (bf16 runs the per-source pipeline of ``ep_pipeline``).

Layout: every rank sends a block of ``capacity`` rows (tokens padded to ``max_tokens_per_rank``); after the dispatch
each rank sees ``W * capacity`` source rows, rank s's tokens at rows [s*C, (s+1)*C). The expert compute produces,
for every source row, the sum over the slots whose expert lives on this rank; the combine returns each block to its
source rank, which sums the W partial rows in rank order (fixed order: deterministic).

dispatch and combine are each other's adjoint: the backward of dispatch is a combine, and the backward of combine
is a dispatch.

Tokens of the quantised forwards (fp8, mxfp8) travel quantised: each rank quantises its block per row the way the
experts' FC1 reads it and sends the fp8 values and scales (about half the bytes of bf16); the receivers dequantise,
and the experts' own quantisation maps those rows back onto the values sent (to within an fp32 rounding of a
scale). The gradient passes straight through the rounding, as it does through the experts' own quantisation.
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_blocks, exchange_blocks, pad_rows
from ..comm.liveness import WaitBounds
from . import fp8_launch as fl
from . import launch


def _sum_partials(blocks: torch.Tensor, world: int, num_tokens: int, dtype) -> torch.Tensor:
    return launch.sum_blocks(blocks.view(world, -1, *blocks.shape[1:]), num_tokens, dtype)


class DispatchRows(torch.autograd.Function):
    """x [T, C...] on each rank -> [W*capacity, C...] on every rank (padding rows filled with ``fill``). With a
    quantised format ``fmt``, x [T, H] travels as fp8 rows with their scales and arrives dequantised."""

    @staticmethod
    def forward(ctx, x, capacity: int, group, fill, bounds, fmt):
        ctx.group, ctx.num_tokens, ctx.dtype, ctx.bounds = group, x.shape[0], x.dtype, bounds
        block = pad_rows(x, capacity, fill)
        if fmt is None:
            return all_gather_blocks(block, group, bounds, "dispatch of tokens")
        q = fl.quantize_rows(block, fmt)
        data = all_gather_blocks(q.data, group, bounds, "dispatch of tokens (fp8)")
        scale = all_gather_blocks(q.scale, group, bounds, "dispatch of token scales")
        return fl.dequantize_rows(fl.QTensor(data, scale), fmt, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        world = torch.distributed.get_world_size(ctx.group)
        back = exchange_blocks(grad.contiguous(), ctx.group, ctx.bounds, "return of token gradients")
        return _sum_partials(back, world, ctx.num_tokens, ctx.dtype), None, None, None, None, None


class CombineRows(torch.autograd.Function):
    """Partial rows [W*capacity, H] (block s: this rank's results for rank s's tokens) -> [T, H] on each rank."""

    @staticmethod
    def forward(ctx, partials, num_tokens: int, group, bounds):
        world = torch.distributed.get_world_size(group)
        ctx.group, ctx.capacity, ctx.bounds = group, partials.shape[0] // world, bounds
        back = exchange_blocks(partials, group, bounds, "combine of expert outputs")
        return _sum_partials(back, world, num_tokens, partials.dtype)

    @staticmethod
    def backward(ctx, grad):
        out = all_gather_blocks(
            pad_rows(grad.contiguous(), ctx.capacity), ctx.group, ctx.bounds, "dispatch of output gradients"
        )
        return out, None, None, None


def dispatch_rows(
    x: torch.Tensor, capacity: int, group, fill=0, bounds: WaitBounds | None = None, fmt: fl.QFormat | None = None
) -> torch.Tensor:
    """Every rank's rows, padded to ``capacity`` each; ``fmt``: send them quantised in that format (tokens [T, H])."""
    if x.requires_grad or x.is_floating_point():
        return DispatchRows.apply(x, capacity, group, fill, bounds, fmt)
    return all_gather_blocks(pad_rows(x, capacity, fill), group, bounds, "dispatch of routing")


def combine_rows_across(
    partials: torch.Tensor, num_tokens: int, group, bounds: WaitBounds | None = None
) -> torch.Tensor:
    return CombineRows.apply(partials, num_tokens, group, bounds)
