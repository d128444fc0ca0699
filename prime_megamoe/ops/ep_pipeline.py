"""Autograd for the expert-parallel routed experts: dispatch, expert GEMMs and combine as one pipeline per call, in
every precision.

Rank r of W holds experts [r*E_l, (r+1)*E_l). Every rank's block holds its tokens (at most ``block_rows`` = C of
them); the routing plan covers all W blocks, one segment per source rank (``RoutingPlan.segment``), so rank r
computes its experts' share of each source's tokens segment by segment while the transport brings in the next block
and carries finished results back. The own block is computed in two pieces split by expert (``compute_order``,
``own_split``): the first while the peers' blocks arrive, the second while the last peer's results travel back, so
neither transfer waits alone. What a piece computes, and in which format blocks travel (bf16, or e4m3 rows with their
scales), is ``ep_stages``' part.

forward   plan the own block (own routing only; the fill also writes the routing the peers read, and quantises the
          own block into place) -> own block's first expert piece (the block is pushed to the peers once its FC1 is
          queued) -> plan the peers' blocks (their routing) -> per piece: [wait block s] FC1+SwiGLU, FC2; once a
          source is complete: combine into s's result block, send -> each rank sums the W result blocks of its
          tokens in rank order (fp32)
backward  own block's first piece (pushing dy to the peers on the side stream is queued after its first GEMMs) ->
          per piece: [wait block s] FC2 dgrad+dSwiGLU, FC1 dgrad; once a source is complete: combine into s's dx
          block and its top-k weight gradients, send -> weight gradients over all segments (local, while results
          travel) -> each rank sums its W dx blocks in rank order

Fixed orders everywhere (rank order for the sums, segment order inside each expert's weight-gradient reduction), so
outputs and gradients are bitwise repeatable, and the same under every transport. What the forward saves: a copy of
the gathered blocks [W*C, ...] (for the W1 weight gradient; the transport's own buffers are reused by later rounds),
h = x W1^T in sorted order, and the plan itself, leased from the transport's pool until the graph is freed
(``PlanLease``); see ``expert_compute`` for why h and not a recompute.
"""

from __future__ import annotations

import torch

from ..comm.transport import PAIR_RESULTS, ROW_RESULTS, Transport
from . import launch
from .activation import check_activation_clamp
from .cuda_thread import binds_cuda_context
from .ep_stages import Bf16Backward, Bf16Forward, QuantizedBackward, QuantizedForward, Recipe, tile_height
from .quantized_experts import quantized_format
from .routing_plan import PlanLease, allocate_routing_plan, fill_routing_plan, take_plan
from .sm_budget import in_kept_sm_budget, keeps_sm_budget


def compute_order(transport: Transport):
    """(source, expert piece, first piece of the source, last piece) in the order this rank computes them: the lower
    local experts (``own_split``) on its own block (nothing to wait for, while the peers' blocks arrive), each peer's
    block whole, then the upper experts on its own block, which covers the return of the last peer's results."""
    own = transport.rank
    peers = [(s, None, True, True) for s in transport.source_order() if s != own]
    return [(own, 0, True, False), *peers, (own, 1, False, True)]


def own_split(num_local: int) -> int:
    """Local experts [0, split) form the own block's first piece, the rest its last. Three quarters first: the host
    issues the push, the peers' routing plans and their first GEMMs while the GPU computes that piece, and a single
    call is host-bound (an even split left the GPU idle there, 3.37-3.52 against 3.21-3.27 ms forward in an A/B on
    one machine, prime_megamoe.bench); the last quarter still outlasts the return of the last peer's results."""
    return num_local * 3 // 4


def lease_forward_plan(
    transport: Transport, top_k: int, num_local: int, tile_m: int, device: torch.device
) -> PlanLease:
    """A forward plan for this transport's rounds at these sizes, emptied for a new fill: a free one from the
    transport's pool, else a new one. A plan last used on another stream is waited for (its stream) first."""
    rows = transport.block_rows
    pool = transport.reused.setdefault(("forward_plans", rows, top_k, num_local, tile_m, device), [])
    return take_plan(
        pool,
        lambda: allocate_routing_plan(
            transport.world * rows,
            top_k,
            num_local_experts=num_local,
            tile_m=tile_m,
            device=device,
            num_segments=transport.world,
            split_expert=own_split(num_local),
        ),
        device,
    )


class ExpertParallelExperts(torch.autograd.Function):
    @staticmethod
    @keeps_sm_budget
    def forward(ctx, x, top_k_index, top_k_weights, w1, w2, transport: Transport, recipe: Recipe, grad_enabled: bool):
        x = x.contiguous()  # the own block's GEMMs read it row by row
        num_tokens, top_k = top_k_index.shape
        world, rank = transport.world, transport.rank
        num_local, hidden = w1.shape[0], w1.shape[2]
        need_grad = grad_enabled and any(ctx.needs_input_grad[i] for i in (0, 2, 3, 4))
        math = (QuantizedForward if recipe.quantized_forward else Bf16Forward)(recipe, x, w1, w2, need_grad)
        kept = transport.start(
            math.block(),
            (top_k_index, top_k_weights),
            (ROW_RESULTS,),
            top_k,
            results=(hidden, x.dtype),
            num_rows=num_tokens,
            keep=need_grad,
        )
        lease = lease_forward_plan(transport, top_k, num_local, recipe.tile_m, x.device)
        plan = lease.plan
        # The own block's plan needs only this rank's routing: its first GEMMs go out before the peers' routing is
        # waited for; the peers' plans follow, while the GPU computes the own block's first piece. The fill also
        # writes the routing the peers read (where the transport asks for it): no conversion kernel is left for the
        # push, which then needs no SM while the GEMMs hold them. A quantised block is quantised into place by it.
        sink = transport.routing_sink()
        quantize = math.own_quantization(transport)
        fill_routing_plan(
            plan,
            *transport.routing(rank, 1),
            expert_base=rank * num_local,
            first_segment=rank,
            copy_to=sink,
            quantize=quantize,
        )
        if sink is not None:
            transport.routing_written()
        if quantize is not None:
            transport.block_written()
        math.allocate(plan)
        own_base = rank * transport.block_rows
        peers_planned = False
        for s, half, first, last in compute_order(transport):
            if s != rank and not peers_planned:
                for first_peer, count in ((0, rank), (rank + 1, world - rank - 1)):  # the peers below and above
                    if count:
                        fill_routing_plan(
                            plan,
                            *transport.routing(first_peer, count),
                            expert_base=rank * num_local,
                            first_segment=first_peer,
                        )
                peers_planned = True
            piece = plan.segment(s, half)
            if s == rank and math.own_from_caller:  # the own tokens straight from x: nothing to wait for
                y = math.piece(None, piece, plan, row_base=own_base)
            else:  # a peer's block, or the own one quantised into the gathered rows
                y = math.piece(transport.wait_rows(s), piece, plan, row_base=None)
            if s == rank and first:
                # The block goes to the peers once the own first FC1 is queued: that FC1 is not held up by the
                # push's host time, and the copies run under it and the FC2 behind it.
                transport.exchange_now()
            if last:
                launch.combine_rows(y, plan.segment(s).pair_pos, x.dtype, out=transport.partial_buffers(s)[ROW_RESULTS])
                transport.send(s)
        out = launch.sum_blocks(transport.finish()[ROW_RESULTS], num_tokens, x.dtype)
        if need_grad:
            ctx.save_for_backward(w1, w2, math.h, *kept)
            ctx.plan_lease, ctx.transport = lease, transport  # the lease (and its plan) held until the graph is freed
            ctx.weights_dtype = top_k_weights.dtype
            ctx.recipe = recipe
        return out

    @staticmethod
    @binds_cuda_context
    @in_kept_sm_budget
    def backward(ctx, grad_out):
        w1, w2, h, *kept = ctx.saved_tensors
        plan, transport, recipe = ctx.plan_lease.plan, ctx.transport, ctx.recipe
        num_tokens, hidden = grad_out.shape
        rank = transport.rank
        kinds = (ROW_RESULTS, PAIR_RESULTS)
        dy = grad_out.to(h.dtype).contiguous()  # the own pieces read it row by row
        math = (QuantizedBackward if recipe.quantized_backward else Bf16Backward)(recipe, dy, w1, w2, h, plan)
        # The bf16 W2 weight gradient reads every block from the gathered rows, the own one too.
        transport.start(
            math.block(),
            None,
            kinds,
            plan.top_k,
            results=(hidden, dy.dtype),
            num_rows=num_tokens,
            read_own=ctx.needs_input_grad[4] and math.own_from_caller,
        )
        if transport.block_rows * transport.world != plan.num_rows:
            raise RuntimeError(
                f"the backward's blocks hold {transport.block_rows} rows but its forward planned "
                f"{plan.num_rows // transport.world}: every rank must pass the same tokens to a layer's forward and "
                "backward"
            )
        math.write_own(transport)
        own_base = rank * transport.block_rows
        for s, half, first, last in compute_order(transport):
            piece = plan.segment(s, half)
            if s == rank and math.own_from_caller:  # straight from the caller's gradient: no wait
                math.piece(None, piece, row_base=own_base)
            else:
                math.piece(transport.wait_rows(s), piece, row_base=None)
            if s == rank and first:
                # Push once the own first GEMMs are queued: a single call reaches its backward with the GPU about to
                # go idle, and the exchange's host time would otherwise come first. The peers' blocks are first read
                # after the whole own piece (~0.9 ms at Qwen3-30B-A3B, T = 16384).
                transport.exchange_now()
            if last:
                seg, results = plan.segment(s), transport.partial_buffers(s)
                launch.combine_rows(
                    math.dx_sorted,
                    seg.pair_pos,
                    dy.dtype,
                    out=results[ROW_RESULTS],
                    pair_src=math.dw_row(),
                    pair_out=results[PAIR_RESULTS],
                )
                transport.send(s)
        # Weight gradients stay local; they run while the last result blocks travel.
        grad_w1, grad_w2 = math.weight_grads(transport, kept, ctx.needs_input_grad[3], ctx.needs_input_grad[4])
        results = transport.finish()
        grad_x = launch.sum_blocks(results[ROW_RESULTS], num_tokens, dy.dtype)
        grad_weights = launch.sum_blocks(results[PAIR_RESULTS], num_tokens, ctx.weights_dtype)
        return grad_x, None, grad_weights, grad_w1, grad_w2, None, None, None


def expert_parallel_experts(
    x,
    top_k_index,
    top_k_weights,
    w1,
    w2,
    *,
    transport: Transport,
    tile_m: int,
    precision: str = "bf16",
    pow2_scales: bool = False,
    activation_clamp: float | None = None,
):
    """x [T, H], top_k_index [T, k] (global expert ids, -1 for an empty slot), top_k_weights [T, k], this rank's
    w1 [E_l, 2I, H] and w2 [E_l, H, I] -> [T, H]: the MoE output of this rank's tokens over the experts of every rank
    in the group. ``precision``: "bf16", "fp8", "fp8_bwd" or "mxfp8" (``quantized_experts``); ``tile_m``: the bf16
    kernels' tile height; ``activation_clamp``: the clamped SwiGLU's limit (``ops.activation``; None: plain)."""
    activation_clamp = check_activation_clamp(activation_clamp)
    if x.shape[0] > transport.capacity:
        raise ValueError(
            f"{x.shape[0]} tokens on rank {transport.rank} exceed max_tokens_per_rank = {transport.capacity}; raise "
            f"[model.moe.dispatch] max_tokens_per_rank or pass fewer tokens per call"
        )
    fmt = None if precision == "bf16" else quantized_format(precision, pow2_scales)
    recipe = Recipe(precision, fmt, tile_height(precision, tile_m), activation_clamp)
    return ExpertParallelExperts.apply(
        x, top_k_index, top_k_weights, w1, w2, transport, recipe, torch.is_grad_enabled()
    )
