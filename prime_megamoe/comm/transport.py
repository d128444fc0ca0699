"""How the expert-parallel pipeline moves blocks between ranks: one interface, two transports.

One exchange round (a forward call, or a backward call) on rank r of W ranks, each block ``capacity`` rows:

1. ``start(block, routing, kinds, top_k, keep=..., read_own=...)``: publish this rank's block (its T <= C tokens, or
   output gradients) and, in the forward, its routing. ``routing(first, count)`` then gives the routing of a run of
   source ranks ([count*C, k] int32 / fp32, id -1 on padding rows): the own block's without waiting for any peer, so
   its plan and first GEMMs need not wait either. Where ``routing_sink()`` names tensors, the own plan's fill writes
   the published routing there as it reads it.
2. For each source rank s, in the order of ``source_order()``: ``wait_rows(s)`` gives every rank's rows [W*C, H]
   (block s at rows [s*C, s*C + T_s), readable on the current stream until ``finish``; rows past T_s are padding
   that no routing entry points at); write this rank's results for rank s's tokens into ``partial_buffers(s)``;
   ``send(s)``. The own block is among those rows only in a round started with ``read_own``; otherwise the caller
   reads it from its own tensor.
3. ``finish()``: every rank's results for this rank's tokens, [W, C, ...] per kind (slot q from rank q). A round
   started with ``keep`` returned from ``start`` a [W*C, H] tensor of every block (the own one too) that is the
   caller's to keep, complete on the current stream after ``finish``.

Transports differ only in when bytes move: ``CollectiveTransport`` moves everything in blocking collectives at
``start`` and ``finish``; ``comm.symmetric_memory.SymmetricMemoryTransport`` pushes this rank's block into the
peers' memory while the own block is computed and pushes each result block as soon as it is written. The
arithmetic is the same, so both give bitwise the same results.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gather_blocks, exchange_blocks, pad_rows
from .liveness import WaitBounds

# Result kinds a round returns to the source ranks: "rows" [C, H] in the rows' dtype (the layer output, or the
# token gradient), "pairs" [C, k] fp32 (the top-k weight gradient, backward only).
ROW_RESULTS = "rows"
PAIR_RESULTS = "pairs"


class Transport:
    """Interface of one expert-parallel group's exchange (see the module docstring)."""

    def __init__(self, group, capacity: int, bounds: WaitBounds | None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.capacity = capacity
        self.bounds = bounds  # how long a wait may last: a peer's silence, and a stall (``comm.liveness``)
        # Buffers the layer keeps per transport and reuses round after round (``ep_pipeline.lease_forward_plan``)
        self.reused: dict = {}

    def source_order(self) -> list[int]:
        """This rank's own block first (nothing to wait for), then the peers in ring order."""
        return [(self.rank + i) % self.world for i in range(self.world)]

    def start(
        self,
        block: torch.Tensor,
        routing: tuple[torch.Tensor, torch.Tensor] | None,
        kinds: tuple[str, ...],
        top_k: int,
        *,
        keep: bool = False,
        read_own: bool = False,
    ) -> torch.Tensor | None:
        """block [T, H] (T <= C); routing (global ids [T, k], weights [T, k], any int / float dtypes) or None; kinds:
        the result kinds this round returns; keep: the caller keeps every block past ``finish`` (-> rows [W*C, H],
        its own tensor; else None); read_own: the caller reads its own block through ``wait_rows(rank)``."""
        raise NotImplementedError

    def routing(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The published routing of source ranks [first, first + count) (a round started with routing): (ids
        [count*C, k] int32, weights [count*C, k] fp32), padding rows' ids -1, readable on the current stream. The
        own block's needs no wait for the peers (and may be the caller's own tensors, in their dtypes, when they
        fill the block)."""
        raise NotImplementedError

    def routing_sink(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where this rank's own plan fill should also write its routing (ids int32, weights fp32, [C', k]
        contiguous with C' the block's rows) for the peers, or None when nothing needs writing. A caller that fills
        them calls ``routing_written`` right after issuing that fill."""
        return None

    def routing_written(self) -> None:
        """The fill that wrote ``routing_sink``'s tensors has been issued on the current stream."""

    def wait_rows(self, source: int) -> torch.Tensor:
        """-> rows [W*C, H] in which block ``source`` can be read on the current stream (until ``finish``)."""
        raise NotImplementedError

    def exchange_now(self) -> None:
        """Send this rank's block to the peers now, on the side, without making the caller's stream wait (a
        transport may otherwise do it at the first use of a peer's block)."""
        raise NotImplementedError

    def partial_buffers(self, source: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def send(self, source: int) -> None:
        raise NotImplementedError

    def finish(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class CollectiveTransport(Transport):
    """torch.distributed collectives (gloo on CPU, NCCL on GPU): all_gather at ``start``, all_to_all at ``finish``.
    Waits on gloo are bounded by the peers' liveness (see ``collectives`` and ``liveness``)."""

    def start(self, block, routing, kinds, top_k, *, keep=False, read_own=False):
        c = self.capacity
        rows = self._rows = all_gather_blocks(pad_rows(block, c), self.group, self.bounds, "dispatch of rows")
        self._routing = None
        if routing is not None:
            padded = (pad_rows(routing[0].to(torch.int32), c, -1), pad_rows(routing[1].float(), c))
            self._routing = tuple(all_gather_blocks(t, self.group, self.bounds, "dispatch of routing") for t in padded)
        w = self.world
        self._staging = {}
        for kind in kinds:
            if kind == ROW_RESULTS:
                self._staging[kind] = block.new_empty(w, c, block.shape[1])
            else:
                self._staging[kind] = torch.empty(w, c, top_k, dtype=torch.float32, device=block.device)
        return rows if keep else None  # the gathered rows are this round's own tensor already

    def routing(self, first, count):
        c = self.capacity
        return tuple(t[first * c : (first + count) * c] for t in self._routing)

    def wait_rows(self, source):
        return self._rows  # the all_gather has completed

    def exchange_now(self):
        pass  # the all_gather has completed

    def partial_buffers(self, source):
        return {kind: buf[source] for kind, buf in self._staging.items()}

    def send(self, source):
        pass  # everything travels in one all_to_all at finish

    def finish(self):
        out = {}
        for kind, buf in self._staging.items():
            flat = buf.view(self.world * self.capacity, *buf.shape[2:])
            out[kind] = exchange_blocks(flat, self.group, self.bounds, f"return of results ({kind})").view(buf.shape)
        self._staging, self._rows = {}, None
        return out
