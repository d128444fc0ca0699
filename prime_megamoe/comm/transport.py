"""How the expert-parallel pipeline moves blocks between ranks: one interface, two transports.

A rank's block is its tokens (forward) or output gradients (backward): T <= C rows in one or more row-aligned
parts (``BlockParts``): bf16 rows, or fp8 rows with their scales. One exchange round (a forward call, or a backward
call) on rank r of W ranks, each block ``block_rows`` = C rows:

1. ``start(block, routing, kinds, top_k, results=..., keep=..., read_own=...)``: publish this rank's block and, in
   the forward, its routing. ``block`` is either the caller's own tensors (pushed as they are; the caller reads its
   own rows from them), or a ``BlockParts`` layout with ``num_rows``: the caller then writes its rows into
   ``own_block()`` (views of the gathered rows, so every source's rows, its own too, are read from one place) and
   calls ``block_written()`` before the exchange. ``routing(first, count)`` gives the routing of a run of source
   ranks ([count*C, k] int32 / fp32, id -1 on padding rows): the own block's without waiting for any peer, so its
   plan and first GEMMs need not wait either. Where ``routing_sink()`` names tensors, the own plan's fill writes the
   published routing there as it reads it.
2. For each source rank s, in the order of ``source_order()``: ``wait_rows(s)`` gives every rank's rows, one
   [W*C, width] tensor per part (block s at rows [s*C, s*C + T_s), readable on the current stream until ``finish``;
   rows past T_s are padding that no routing entry points at, and may hold anything); write this rank's results for
   rank s's tokens into ``partial_buffers(s)``; ``send(s)``. A round whose block is the caller's tensors has its own
   block among those rows only when started with ``read_own``.
3. ``finish()``: every rank's results for this rank's tokens, [W, C, ...] per kind (slot q from rank q). A round
   started with ``keep`` returned from ``start`` the gathered parts of every block (the own one too) as the caller's
   own tensors, complete on the current stream after ``finish``.

Transports differ only in when bytes move: ``CollectiveTransport`` moves blocks and results in blocking collectives;
``comm.symmetric_memory.SymmetricMemoryTransport`` pushes this rank's block into the peers' memory while the own
block is computed and pushes each result block as soon as it is written. The arithmetic is the same, so both give
bitwise the same results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import all_gather_blocks, exchange_blocks, host_max, pad_rows
from .liveness import WaitBounds

# Result kinds a round returns to the source ranks: "rows" [C, H] (the layer output, or the token gradient, in the
# ``results`` dtype), "pairs" [C, k] fp32 (the top-k weight gradient, backward only).
ROW_RESULTS = "rows"
PAIR_RESULTS = "pairs"


@dataclass(frozen=True)
class BlockParts:
    """The parts of a block: row-aligned, part i of ``widths[i]`` columns of ``dtypes[i]`` (tokens: one bf16 part;
    quantised tokens: the fp8 values and their scales)."""

    widths: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, tensors: tuple[torch.Tensor, ...]) -> BlockParts:
        return cls(tuple(t.shape[1] for t in tensors), tuple(t.dtype for t in tensors))

    def bytes_per_row(self) -> int:
        return sum(w * torch.empty((), dtype=d).element_size() for w, d in zip(self.widths, self.dtypes))


class Transport:
    """Interface of one expert-parallel group's exchange (see the module docstring). ``capacity``: the most rows a
    block may hold (``max_tokens_per_rank``); ``block_rows``: the rows of every block in the current round."""

    def __init__(self, group, capacity: int, device: torch.device, bounds: WaitBounds | None):
        self.group = group
        self.device = device
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.capacity = capacity
        self.block_rows = capacity
        self.bounds = bounds  # how long a wait may last: a peer's silence, and a stall (``comm.liveness``)
        # Buffers the layer keeps per transport and reuses round after round (``ep_pipeline.lease_forward_plan``)
        self.reused: dict = {}

    def reserve(self, parts: BlockParts, results: tuple[int, torch.dtype], top_k: int) -> None:
        """Allocate now what rounds of blocks of ``parts`` with row results ``results`` (width, dtype) and ``top_k``
        routing will need (a collective operation where there is anything to allocate: every rank of the group calls
        it together), so that no first call allocates it (inside a checkpointed forward, a collective there would
        desync the recompute). Nothing to do for transports without buffers of their own."""

    def source_order(self) -> list[int]:
        """This rank's own block first (nothing to wait for), then the peers in ring order."""
        return [(self.rank + i) % self.world for i in range(self.world)]

    def start(
        self,
        block: tuple[torch.Tensor, ...] | BlockParts,
        routing: tuple[torch.Tensor, torch.Tensor] | None,
        kinds: tuple[str, ...],
        top_k: int,
        *,
        results: tuple[int, torch.dtype],
        num_rows: int | None = None,
        keep: bool = False,
        read_own: bool = False,
    ) -> tuple[torch.Tensor, ...] | None:
        """block: this rank's parts [T, width] (T <= C), or their layout with ``num_rows`` = T (then write them into
        ``own_block()``); routing (global ids [T, k], weights [T, k], any int / float dtypes) or None; kinds: the
        result kinds this round returns; results: (width, dtype) of the row results; keep: the caller keeps every
        block past ``finish`` (-> the gathered parts [W*C, width], its own tensors; else None); read_own: the caller
        reads its own block (given as tensors) through ``wait_rows(rank)``."""
        raise NotImplementedError

    def own_block(self) -> tuple[torch.Tensor, ...]:
        """Where the caller writes its block (a round started with a layout): [T, width] per part."""
        raise NotImplementedError

    def block_written(self) -> None:
        """The writes into ``own_block()`` have been issued on the current stream."""

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

    def wait_rows(self, source: int) -> tuple[torch.Tensor, ...]:
        """-> the gathered parts [W*C, width] in which block ``source`` can be read on the current stream (until
        ``finish``)."""
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
    """torch.distributed collectives (gloo on CPU, NCCL on GPU): the blocks in one all_gather (at ``start``, or once
    the caller has written its block), the results in one all_to_all at ``finish``. A round's blocks hold the most
    rows any rank sends in it (agreed on the host), not ``capacity``: padding is neither moved nor computed. Waits
    on gloo are bounded by the peers' liveness (see ``collectives`` and ``liveness``)."""

    def start(self, block, routing, kinds, top_k, *, results, num_rows=None, keep=False, read_own=False):
        layout = block if isinstance(block, BlockParts) else BlockParts.of(block)
        rows = num_rows if isinstance(block, BlockParts) else block[0].shape[0]
        agreed = host_max(rows, self.group, self.bounds, "dispatch of rows (its size, agreed first)")
        c = self.block_rows = max(agreed, 1)
        w, device = self.world, self.device
        self._rows = rows
        if isinstance(block, BlockParts):
            self._gathered = tuple(
                torch.empty(w * c, width, dtype=dt, device=device) for width, dt in zip(layout.widths, layout.dtypes)
            )
            self._exchanged = False
        else:
            self._gathered = tuple(
                all_gather_blocks(pad_rows(t, c), self.group, self.bounds, "dispatch of rows") for t in block
            )
            self._exchanged = True
        self._routing = None
        if routing is not None:
            padded = (pad_rows(routing[0].to(torch.int32), c, -1), pad_rows(routing[1].float(), c))
            self._routing = tuple(all_gather_blocks(t, self.group, self.bounds, "dispatch of routing") for t in padded)
        self._staging = {}
        width, dtype = results
        for kind in kinds:
            if kind == ROW_RESULTS:
                self._staging[kind] = torch.empty(w, c, width, dtype=dtype, device=device)
            else:
                self._staging[kind] = torch.empty(w, c, top_k, dtype=torch.float32, device=device)
        return self._gathered if keep else None  # the gathered rows are this round's own tensors already

    def own_block(self):
        c, r = self.block_rows, self.rank
        return tuple(g[r * c : r * c + self._rows] for g in self._gathered)

    def routing(self, first, count):
        c = self.block_rows
        return tuple(t[first * c : (first + count) * c] for t in self._routing)

    def _exchange(self) -> None:
        if self._exchanged:
            return
        c, r = self.block_rows, self.rank
        for g in self._gathered:
            own = g[r * c : (r + 1) * c].clone()  # (the collective's input must not alias its output)
            all_gather_blocks(own, self.group, self.bounds, "dispatch of rows", out=g)
        self._exchanged = True

    def wait_rows(self, source):
        self._exchange()
        return self._gathered

    def exchange_now(self):
        self._exchange()

    def partial_buffers(self, source):
        return {kind: buf[source] for kind, buf in self._staging.items()}

    def send(self, source):
        pass  # everything travels in one all_to_all at finish

    def finish(self):
        self._exchange()  # keeps each round's protocol whole even if no peer block was read
        out = {}
        for kind, buf in self._staging.items():
            flat = buf.view(self.world * self.block_rows, *buf.shape[2:])
            out[kind] = exchange_blocks(flat, self.group, self.bounds, f"return of results ({kind})").view(buf.shape)
        self._staging, self._gathered = {}, None
        return out
