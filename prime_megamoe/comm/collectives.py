"""Fixed-size token exchange over torch.distributed (gloo on CPU, NCCL on GPU).

Every rank contributes a block of exactly ``capacity`` rows (its tokens, padded), so split sizes are static: no
counts travel to the host and the calls are stream-ordered on GPU. Collectives here move bytes only (no reductions),
so tensors travel as raw bytes (uint8), which every backend supports.

Waits are bounded by the peers' liveness (``comm.liveness``). On CPU (gloo) an exchange waits as long as every peer
of the group keeps publishing its heartbeat, and raises an error naming this rank, the exchange and the peer(s) once a
peer has been silent for ``bounds.silence_s`` (``comm_timeout_s``: it is gone), once gloo reports a failure (a peer's
connection closed), or once the wait has lasted ``bounds.stall_s`` (``comm_stall_timeout_s``: a live peer never joined
it), instead of hanging. On GPU the exchange is enqueued on the stream (waiting on the host would add a sync); there
the process group's own timeout (``init_process_group(timeout=...)``) and NCCL's watchdog turn a peer that never
arrives into an error.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .liveness import WaitBounds, entered_exchange, start_heartbeat, wait_for_work


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _finish(work, group, what: str, bounds: WaitBounds | None) -> None:
    if work is None:
        return
    if bounds is None or dist.get_backend(group) != "gloo":
        work.wait()
        return
    start_heartbeat()  # peers judge this rank by it (idempotent)
    entered_exchange(group)
    wait_for_work(work, group, what, bounds)


def all_gather_blocks(
    block: torch.Tensor, group, bounds: WaitBounds | None = None, what="dispatch", out: torch.Tensor | None = None
) -> torch.Tensor:
    """[C, ...] on each of W ranks -> [W*C, ...] on every rank (rank r's block at rows [r*C, (r+1)*C)), into ``out``
    (contiguous) when given."""
    world = dist.get_world_size(group)
    if out is None:
        out = block.new_empty((world * block.shape[0], *block.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(_wire(out), _wire(block.contiguous()), group=group, async_op=True)
    _finish(work, group, what, bounds)
    return out


def exchange_blocks(blocks: torch.Tensor, group, bounds: WaitBounds | None = None, what="combine") -> torch.Tensor:
    """[W*C, ...]: block s goes to rank s. Returns [W*C, ...] whose block s came from rank s."""
    out = torch.empty_like(blocks)
    work = dist.all_to_all_single(_wire(out), _wire(blocks.contiguous()), group=group, async_op=True)
    _finish(work, group, what, bounds)
    return out


_HOST_GROUPS: dict[int, tuple] = {}


def host_max(value: int, group, bounds: WaitBounds | None, what: str) -> int:
    """The largest ``value`` over the ranks of ``group``, known on the host of every rank. A gloo group reduces it
    itself; for another backend (NCCL) a gloo group of the same ranks is made once (only its members take part), so
    the answer needs no device sync. With ``bounds`` the wait is bounded by the peers' liveness like every exchange
    (a peer gone before it joins is an error naming it and ``what`` was waited for, not a hang)."""
    host_group = group
    if dist.get_backend(group) != "gloo":
        found = _HOST_GROUPS.get(id(group))
        if found is None:
            ranks = dist.get_process_group_ranks(group)
            found = _HOST_GROUPS[id(group)] = (
                group,
                dist.new_group(ranks, backend="gloo", use_local_synchronization=True),
            )
        host_group = found[1]
    t = torch.tensor([value], dtype=torch.int64)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group, async_op=True)
    _finish(work, host_group, what, bounds)
    return int(t)


_CHECKED_GROUPS: set[int] = set()


def check_group_within_node(group, local_world_size: int | None = None) -> None:
    """Expert parallelism runs over NVLink inside one node: every rank of ``group`` must sit on the same node.

    Nodes are inferred as torchrun lays ranks out: global rank // ranks per node, which defaults to
    ``$LOCAL_WORLD_SIZE`` (without it the layout is unknown and nothing is checked). Checked once per group."""
    if id(group) in _CHECKED_GROUPS:  # first: this runs on every call
        return
    if local_world_size is None and os.environ.get("LOCAL_WORLD_SIZE"):
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    if local_world_size is None:
        return
    ranks = dist.get_process_group_ranks(group)
    nodes = sorted({r // local_world_size for r in ranks})
    if len(nodes) > 1:
        raise ValueError(
            f"the expert-parallel group (global ranks {ranks}) spans nodes {nodes} (LOCAL_WORLD_SIZE = "
            f"{local_world_size}); expert parallelism stays inside one node: choose [model.moe] ep <= ranks per node "
            f"and build EP groups of consecutive ranks, with data parallelism across nodes"
        )
    _CHECKED_GROUPS.add(id(group))


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


def pad_rows(t: torch.Tensor, capacity: int, fill=0) -> torch.Tensor:
    """t [T, ...] -> [capacity, ...]: the rows of t, then ``fill``."""
    if t.shape[0] == capacity:
        return t.contiguous()
    out = t.new_full((capacity, *t.shape[1:]), fill)
    out[: t.shape[0]] = t
    return out
