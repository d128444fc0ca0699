"""Autograd for the expert-parallel routed experts: dispatch, expert GEMMs and combine as one pipeline per call.

Rank r of W holds experts [r*E_l, (r+1)*E_l). Every rank's tokens are padded to ``capacity`` rows (a block); the
routing plan covers all W blocks, one segment per source rank (``RoutingPlan.segment``), so rank r computes its
experts' share of each source's tokens segment by segment while the transport brings in the next block and carries
finished results back. The own block is computed in two pieces split by expert (``compute_order``, ``own_split``):
the first while the peers' blocks arrive, the second while the last peer's results travel back, so neither transfer
waits alone.

forward   plan the own block (own routing only; the fill also writes the routing the peers read) -> own block's
          first expert piece (read from x itself; x is pushed to the peers once its FC1 is queued) -> plan the
          peers' blocks (their routing) -> per piece: [wait block s] FC1+SwiGLU, FC2; once a source is complete:
          combine into s's result block, send -> each rank sums the W result blocks of its tokens in rank order
          (fp32)
backward  own block's first piece (read from dy itself; pushing dy to the peers on the side stream is queued after
          its first GEMMs) -> per piece:
          [wait block s] FC2 dgrad+dSwiGLU, FC1 dgrad; once a source is complete: combine into s's dx block and its
          top-k weight gradients, send -> weight gradients over all segments (local, while results travel) -> each
          rank sums its W dx blocks in rank order

Fixed orders everywhere (rank order for the sums, segment order inside each expert's weight-gradient reduction), so
outputs and gradients are bitwise repeatable, and the same under every transport. What the forward saves: a copy of the
gathered rows [W*C, H] (for the W1 weight gradient; the transport's own buffers are reused by later rounds), h = x W1^T
in sorted order, and the plan itself, leased from the transport's pool until the graph is freed (``PlanLease``); see
``expert_compute`` for why h and not a recompute.
"""

from __future__ import annotations

import torch

from ..comm.transport import PAIR_RESULTS, ROW_RESULTS, Transport
from . import launch
from .activation import check_activation_clamp
from .routing_plan import PlanLease, allocate_routing_plan, fill_routing_plan, take_plan


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
    pool = transport.reused.setdefault(("forward_plans", top_k, num_local, tile_m, device), [])
    return take_plan(
        pool,
        lambda: allocate_routing_plan(
            transport.world * transport.capacity,
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
    def forward(
        ctx,
        x,
        top_k_index,
        top_k_weights,
        w1,
        w2,
        transport: Transport,
        tile_m: int,
        grad_enabled: bool,
        activation_clamp: float | None = None,
    ):
        x = x.contiguous()  # the own block's GEMMs read it row by row
        num_tokens, top_k = top_k_index.shape
        world = transport.world
        num_local, inter, hidden = w1.shape[0], w1.shape[1] // 2, w1.shape[2]
        rank, capacity = transport.rank, transport.capacity
        need_grad = grad_enabled and any(ctx.needs_input_grad[i] for i in (0, 2, 3, 4))
        kept_rows = transport.start(x, (top_k_index, top_k_weights), (ROW_RESULTS,), top_k, keep=need_grad)
        lease = lease_forward_plan(transport, top_k, num_local, tile_m, x.device)
        plan = lease.plan
        # The own block's plan needs only this rank's routing: its first GEMMs go out before the peers' routing is
        # waited for; the peers' plans follow, while the GPU computes the own block's first piece. The fill also
        # writes the routing the peers read (where the transport asks for it): no conversion kernel is left for the
        # push, which then needs no SM while the GEMMs hold them.
        sink = transport.routing_sink()
        fill_routing_plan(
            plan, *transport.routing(rank, 1), expert_base=rank * num_local, first_segment=rank, copy_to=sink
        )
        if sink is not None:
            transport.routing_written()
        a = x.new_empty(plan.sorted_rows, inter)
        h = x.new_empty(plan.sorted_rows, 2 * inter) if need_grad else None
        y = None  # allocated after the first FC1 is issued: one host step less before it
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
            if s == rank:  # the own tokens straight from x (source rows [rank*C, rank*C + T)): nothing to wait for
                launch.fc1_swiglu(
                    x,
                    w1,
                    piece,
                    save_h=need_grad,
                    out=(h, a),
                    row_base=rank * capacity,
                    activation_clamp=activation_clamp,
                )
                if first:
                    # x goes to the peers once the own first FC1 is queued: that FC1 is not held up by the push's
                    # host time, and the copies run under it and the FC2 behind it.
                    transport.exchange_now()
            else:
                rows = transport.wait_rows(s)
                launch.fc1_swiglu(rows, w1, piece, save_h=need_grad, out=(h, a), activation_clamp=activation_clamp)
            if y is None:
                y = x.new_empty(plan.sorted_rows, hidden)
            # FC2 by pointer reads, as in expert_compute.unquantized_forward (TMA: no faster, more host time)
            launch.grouped_gemm(a, w2, piece, transpose_b=True, row_scale=plan.row_weight, out=y, use_tma=False)
            if last:
                launch.combine_rows(y, plan.segment(s).pair_pos, x.dtype, out=transport.partial_buffers(s)[ROW_RESULTS])
                transport.send(s)
        out = launch.sum_blocks(transport.finish()[ROW_RESULTS], num_tokens, x.dtype)
        if need_grad:
            ctx.save_for_backward(kept_rows, w1, w2, h)
            ctx.plan_lease, ctx.transport = lease, transport  # the lease (and its plan) held until the graph is freed
            ctx.weights_dtype = top_k_weights.dtype
            ctx.activation_clamp = activation_clamp
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rows, w1, w2, h = ctx.saved_tensors
        plan, transport = ctx.plan_lease.plan, ctx.transport
        num_tokens = grad_out.shape[0]
        rank, capacity = transport.rank, transport.capacity
        kinds = (ROW_RESULTS, PAIR_RESULTS)
        own_dy = grad_out.to(rows.dtype).contiguous()  # the own pieces read it row by row
        # The W2 weight gradient reads every block from the gathered rows, the own one too.
        transport.start(own_dy, None, kinds, plan.top_k, read_own=ctx.needs_input_grad[4])
        buffers = launch.dswiglu_buffers(own_dy, w2, plan)
        _, dh, aw, dw_row = buffers
        dx_sorted = own_dy.new_empty(plan.sorted_rows, own_dy.shape[1])
        for s, half, first, last in compute_order(transport):
            piece = plan.segment(s, half)
            if s == rank:  # straight from the caller's gradient, as the forward reads its tokens: no wait
                launch.fc2_dgrad_dswiglu(
                    own_dy,
                    w2,
                    h,
                    piece,
                    out=buffers,
                    row_base=rank * capacity,
                    activation_clamp=ctx.activation_clamp,
                )
                if first:
                    # Push once the own first GEMMs are queued: a single call reaches its backward with the GPU
                    # about to go idle, and the exchange's host time would otherwise come first. The peers' blocks
                    # are first read after the whole own piece (~0.9 ms at Qwen3-30B-A3B, T = 16384).
                    transport.exchange_now()
            else:
                dy = transport.wait_rows(s)
                launch.fc2_dgrad_dswiglu(dy, w2, h, piece, out=buffers, activation_clamp=ctx.activation_clamp)
            launch.grouped_gemm(dh, w1, piece, transpose_b=False, out=dx_sorted)
            if last:
                seg, results = plan.segment(s), transport.partial_buffers(s)
                launch.combine_rows(
                    dx_sorted,
                    seg.pair_pos,
                    rows.dtype,
                    out=results[ROW_RESULTS],
                    pair_src=dw_row,
                    pair_out=results[PAIR_RESULTS],
                )
                transport.send(s)
        # Weight gradients stay local; they run while the last result blocks travel.
        grad_w1 = grad_w2 = None
        if ctx.needs_input_grad[3]:
            grad_w1 = launch.grouped_wgrad(dh, rows, plan, torch.empty_like(w1), gather_a=False, gather_b=True)
        if ctx.needs_input_grad[4]:
            dy = transport.wait_rows(rank)  # this weight gradient reads every block, the own one too
            grad_w2 = launch.grouped_wgrad(dy, aw, plan, torch.empty_like(w2), gather_a=True, gather_b=False)
        results = transport.finish()
        grad_x = launch.sum_blocks(results[ROW_RESULTS], num_tokens, rows.dtype)
        grad_weights = launch.sum_blocks(results[PAIR_RESULTS], num_tokens, ctx.weights_dtype)
        return grad_x, None, grad_weights, grad_w1, grad_w2, None, None, None, None


def expert_parallel_experts(
    x,
    top_k_index,
    top_k_weights,
    w1,
    w2,
    *,
    transport: Transport,
    tile_m: int,
    activation_clamp: float | None = None,
):
    """x [T, H], top_k_index [T, k] (global expert ids), top_k_weights [T, k], this rank's w1 [E_l, 2I, H] and
    w2 [E_l, H, I] -> [T, H]: the MoE output of this rank's tokens over the experts of every rank in the group.
    ``activation_clamp``: the clamped SwiGLU's limit (``ops.activation``; None: plain SwiGLU)."""
    activation_clamp = check_activation_clamp(activation_clamp)
    if x.shape[0] > transport.capacity:
        raise ValueError(
            f"{x.shape[0]} tokens on rank {transport.rank} exceed max_tokens_per_rank = {transport.capacity}; raise "
            f"[model.moe.dispatch] max_tokens_per_rank or pass fewer tokens per call"
        )
    return ExpertParallelExperts.apply(
        x, top_k_index, top_k_weights, w1, w2, transport, tile_m, torch.is_grad_enabled(), activation_clamp
    )
