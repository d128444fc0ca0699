"""The symmetric-memory transport: peer-to-peer writes over NVLink, device-side signals, overlapped with compute.

One workspace per (group, capacity, block layout, row results, k), allocated on first use (or by ``reserve``) with
``torch.distributed._symmetric_memory`` and shared by every layer of the model (rounds run one after another on each
rank). Each rank's part, with W ranks, capacity C, a block of parts i = 0.. of width w_i (tokens: one part [H] in
the activations' dtype; fp8 tokens: [H] e4m3 values and [H / 128] fp32 scales; mxfp8: [H] e4m3 and [H / 32] e8m0)
and row results of width H:

    inbox<i>   [2, W, C, w_i]  part i of the blocks pushed to this rank (tokens forward, output gradients backward):
                               [round parity, source rank]; slot q of a parity is written by rank q
    index      [C, k]       int32  this rank's published routing (forward), read in place by the peers
    weights    [C, k]       fp32
    row_res    [W, C, H]    dtype  results for this rank's tokens; slot q is written by rank q
    pair_res   [W, C, k]    fp32   top-k weight gradients for this rank's tokens (backward); slot q by rank q
    flags      [2, W]       int32  channel 0: "rank q pushed its round-n block here",
                                   channel 1: "rank q wrote its slot, round n"
    heartbeat  [2, W]       int32  slot q: rank q's heartbeat (``comm.liveness``), advanced by its heartbeat thread
                                   (row 0, every 0.2 s) and by its wait kernels while they spin (row 1, every ms)

Per rank: 2 W C (sum of the parts' bytes per row) + W C H (results) + small parts; bf16 tokens at the
Qwen3-30B-A3B shape (H = 2048), W = 8, C = 16384: 1.5 GiB; fp8 tokens: 1.0 GiB.

A round on rank r (see ``comm.transport``), with streams `compute` (the caller's) and `comm` (a side stream):
- start: record an event (what `comm` waits for before it reads the block). A block of fewer than C rows has its
  routing padded into the workspace here (compute); a full block's own plan reads the caller's routing, and its
  fill writes the published copy on the way (``routing_sink``; the event is recorded again after that fill).
- push (``exchange_now``, or the first use of a peer's block): on `comm`, copy the block straight into slot r of
  every peer's inbox (one NVLink write per part and peer; no local copy first), then flag channel 0 on that peer.
  A block the caller wrote into ``own_block()`` (its own inbox slot) is pushed from there, once ``block_written``.
  Copy-engine work and stream memory operations only, so nothing on `comm` waits for an SM while the GEMMs hold
  them all (only a routing no fill wrote takes a small conversion kernel first). The forward pushes right after its
  own first FC1 is queued, the backward after its own first GEMM.
- the first use of a peer's routing or rows: `compute` waits (a small kernel, bounded: see below) for every
  peer's flag of this round; the peers' plans then read their routing in place and the GEMMs read their rows from
  the inbox. A caller that keeps the rows past the round (the forward with autograd) gets a private copy, written on
  `comm` from the inbox and from its own block while the GEMMs run; a caller that reads its own block among the
  gathered rows (the backward's W2 weight gradient) has it copied into its own inbox slot by the push.
- send(s): results for rank s's tokens go straight into rank r's own slot when s = r; otherwise into a staging
  buffer that `comm` copies into rank s's slot r, then flags channel 1 on rank s.
- finish: wait (compute) for channel 1 from every peer, then return the slots; the caller sums them in rank order.

Waits are bounded by the peers' liveness, not by their speed. The wait kernel restarts a peer's clock whenever the
peer's heartbeat changes, and traps once a peer it waits for has been silent for ``comm_timeout_s`` (it is gone) or the
wait has lasted ``comm_stall_timeout_s`` (a live peer never joined). A rank's heartbeat thread writes row 0 with stream
write-value operations on a stream of its own; its wait kernels write row 1 themselves, because with few hardware
queues (``CUDA_DEVICE_MAX_CONNECTIONS=1``) the thread's writes can queue behind a rank's own spinning wait kernel while
that rank waits for a third, slow one.

Why reuse is safe without extra flags. The inbox alternates between two halves by round parity: rank q pushes
round n into this rank's half n % 2 only after its own round n started, i.e. after it received this rank's results
of round n - 1, which this rank sends (stream order) after everything it read from half n % 2 in round n - 2 (the
last reader, the backward's W2 weight gradient, runs after the results of its round are sent; the private copy of
a kept round runs on `comm` before the next round's sends). A rank overwrites its published routing only after it
has received every peer's results of the round before, and each peer reads the routing before sending those. A peer
writes into this rank's result slots only after this round's block, pushed after this rank summed the previous
round's slots.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
import torch.distributed as dist

from ..kernels.signals import KERNEL_BEAT_NS, wait_flags_kernel
from ..ops.compiled_launch import launch
from .liveness import WaitBounds, heartbeat
from .transport import PAIR_RESULTS, ROW_RESULTS, BlockParts, Transport

log = logging.getLogger("prime_megamoe")

PUBLISHED, RETURNED = 0, 1  # flag channels
_RESULT_REGION = {ROW_RESULTS: "row_res", PAIR_RESULTS: "pair_res"}  # where each result kind lands
_ALIGN = 256


class SymmetricWorkspace:
    """The symmetric buffers of one (group, capacity, block layout, row results, k); see the module docstring."""

    def __init__(
        self,
        group,
        capacity: int,
        parts: BlockParts,
        results: tuple[int, torch.dtype],
        top_k: int,
        device: torch.device,
    ):
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "stream_write_value32_"):
            raise RuntimeError(
                f"[model.moe.dispatch] transport = 'symmetric_memory' sets its flags with "
                f"torch.ops.symm_mem.stream_write_value32_, which this torch ({torch.__version__}) lacks; use a CUDA "
                f"build of torch >= 2.9, or transport = 'collectives'"
            )
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.world, self.rank, self.capacity, self.top_k = world, rank, capacity, top_k
        self.parts, self.results = parts, results
        hidden, dtype = results
        inboxes = {
            f"inbox{i}": ((2, world, capacity, w), dt) for i, (w, dt) in enumerate(zip(parts.widths, parts.dtypes))
        }
        regions = {
            **inboxes,
            "index": ((capacity, top_k), torch.int32),
            "weights": ((capacity, top_k), torch.float32),
            "row_res": ((world, capacity, hidden), dtype),
            "pair_res": ((world, capacity, top_k), torch.float32),
            "flags": ((2, world), torch.int32),
            "heartbeat": ((2, world), torch.int32),
        }
        offsets, total = {}, 0  # in elements of each region's dtype, regions aligned to _ALIGN bytes
        for name, (shape, dt) in regions.items():
            item = torch.empty((), dtype=dt).element_size()
            offsets[name] = total // item
            total += math.ceil(math.prod(shape) * item / _ALIGN) * _ALIGN
        self.nbytes = total
        self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        self.buffer.zero_()  # flags start at round 0
        torch.cuda.current_stream(device).synchronize()
        self.handle = symm_mem.rendezvous(self.buffer, group)
        dist.barrier(group=group)  # no peer signals before every flag is zero

        def view(peer: int, name: str) -> torch.Tensor:
            shape, dt = regions[name]
            return self.handle.get_buffer(peer, shape, dt, offsets[name])

        self.views = [{name: view(peer, name) for name in regions} for peer in range(world)]
        self.local = self.views[rank]
        # Each peer's flags as flat 32-bit words (what ``signal`` writes into), made once: views cost host time.
        self.flag_words = [self.views[peer]["flags"].view(torch.uint32).view(-1) for peer in range(world)]
        # Per round parity: this rank's inboxes as gathered rows [W*C, w_i], and slot `rank` of each peer's inboxes
        # (the push targets), also made once.
        peers = [q for q in range(world) if q != rank]
        self.gathered = [tuple(self.local[name][p].view(world * capacity, -1) for name in inboxes) for p in range(2)]
        self.outbox = [{q: tuple(self.views[q][name][p][rank] for name in inboxes) for q in peers} for p in range(2)]
        self.round = 0
        self._start_heartbeat(device)
        # High priority: the one kernel this stream may run (the routing's conversion when no fill wrote it) gets an
        # SM as soon as one frees up, instead of queueing behind a GEMM's blocks; the rest is copies and flags.
        self.comm_stream = torch.cuda.Stream(device=device, priority=-1)
        self.last_stream: torch.cuda.Stream | None = None  # the stream the last round computed on
        self.last_stream_id: int | None = None  # and its raw handle (compared each round: no Stream object made)
        log.info(
            "prime_megamoe: symmetric-memory workspace for EP = %d, max_tokens_per_rank = %d, blocks of %s, row "
            "results [%d] %s, k = %d: %.1f MiB per rank",
            world,
            capacity,
            ", ".join(f"[{w}] {dt}" for w, dt in zip(parts.widths, parts.dtypes)),
            hidden,
            dtype,
            top_k,
            total / 2**20,
        )

    def signal(self, peer: int, channel: int, value: int) -> None:
        """Set flag (channel, this rank) on ``peer`` to ``value`` once this stream's earlier work is done: a stream
        memory operation (the driver's write-value, with a system-scope fence before the write), so it needs no SM and
        never queues behind the GEMMs' blocks as a kernel would."""
        torch.ops.symm_mem.stream_write_value32_(self.flag_words[peer], channel * self.world + self.rank, value)

    def _start_heartbeat(self, device: torch.device) -> None:
        """Every peer is zeroed and rendezvoused: from now on the heartbeat thread writes this rank's heartbeat (row
        0, slot ``rank``) into every peer's workspace, and the wait kernels find each peer's row 1 in ``peer_beats``."""
        self.device = device
        self.peer_beats = torch.tensor(
            [self.views[q]["heartbeat"].data_ptr() for q in range(self.world)], dtype=torch.int64, device=device
        )
        self.beat_words = [self.views[q]["heartbeat"].view(torch.uint32).view(-1) for q in range(self.world)]
        del self.beat_words[self.rank]
        self.beat_stream = torch.cuda.Stream(device=device, priority=-1)
        # Beats while the workspace lives (a released one until the last round holding it is done), not longer: the
        # thread holds it only weakly.
        key, method = ("symmetric_memory", id(self)), weakref.WeakMethod(self._beat)

        def beat(count: int) -> None:
            live = method()
            if live is None:
                heartbeat().remove(key)
            else:
                live(count)

        heartbeat().add(key, beat)

    def _beat(self, count: int) -> None:
        """From the heartbeat thread: ``count`` into this rank's slot of every peer's heartbeat, on a stream that
        holds nothing else (write-value operations: no SM, no wait for the layer's work)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.beat_stream):
            for words in self.beat_words:
                torch.ops.symm_mem.stream_write_value32_(words, self.rank, count)

    def wait(self, channel: int, value: int, bounds: WaitBounds) -> None:
        """Hold this stream until every peer has set its flag on ``channel`` to ``value`` or more; trap once a peer
        waited for is silent for ``bounds.silence_s`` or the wait lasts ``bounds.stall_s``."""
        launch(
            wait_flags_kernel,
            (1,),
            self.local["flags"],
            self.local["heartbeat"],
            self.peer_beats,
            value,
            self.rank,
            channel,
            int(bounds.silence_s * 1e9),
            int(bounds.stall_s * 1e9),
            WORLD=self.world,
            WORLD_BLOCK=max(2, 1 << (self.world - 1).bit_length()),
            BEAT_NS=KERNEL_BEAT_NS,
            num_warps=1,
        )


_WORKSPACES: dict[tuple, SymmetricWorkspace] = {}


def release_workspaces(group) -> None:
    """Forget the workspaces of ``group`` (see ``factory.release_transports``)."""
    for key in [key for key in _WORKSPACES if key[0] == group.group_name]:
        del _WORKSPACES[key]


def workspace_info() -> list[dict]:
    """Every symmetric-memory workspace allocated in this process and its size per rank."""
    return [
        {
            "ep": ws.world,
            "max_tokens_per_rank": ws.capacity,
            "block": [(w, str(dt)) for w, dt in zip(ws.parts.widths, ws.parts.dtypes)],
            "hidden": ws.results[0],
            "top_k": ws.top_k,
            "dtype": str(ws.results[1]),
            "bytes_per_rank": ws.nbytes,
        }
        for ws in _WORKSPACES.values()
    ]


class SymmetricMemoryTransport(Transport):
    """Transport over the shared workspace of its group and shapes (see the module docstring); one object serves
    every round of its group, one round at a time."""

    def __init__(self, group, capacity: int, device: torch.device, bounds: WaitBounds):
        super().__init__(group, capacity, device, bounds)
        self.workspace: SymmetricWorkspace | None = None

    def _workspace(self, parts: BlockParts, results: tuple[int, torch.dtype], top_k: int) -> SymmetricWorkspace:
        key = (self.group.group_name, self.capacity, parts, results, top_k, self.device.index)
        ws = _WORKSPACES.get(key)
        if ws is None:
            ws = _WORKSPACES[key] = SymmetricWorkspace(self.group, self.capacity, parts, results, top_k, self.device)
        return ws

    def reserve(self, parts, results, top_k):
        self.workspace = self._workspace(parts, results, top_k)

    def start(self, block, routing, kinds, top_k, *, results, num_rows=None, keep=False, read_own=False):
        written = isinstance(block, BlockParts)  # the caller writes its block into its inbox slot
        parts = block if written else BlockParts.of(block)
        ws = self.workspace
        if ws is None or (ws.parts, ws.results, ws.top_k) != (parts, results, top_k):
            ws = self.workspace = self._workspace(parts, results, top_k)
        c = self.capacity
        num_rows = num_rows if written else block[0].shape[0]
        ws.round += 1
        self.round = ws.round
        self._gathered = ws.gathered[self.round % 2]
        self._outbox = ws.outbox[self.round % 2]
        stream_id = torch._C._cuda_getCurrentRawStream(self.device.index)  # no Stream object: host time
        if stream_id != ws.last_stream_id:
            compute = torch.cuda.current_stream(self.device)
            if ws.last_stream is not None:
                # The previous round ran on another stream: its sum of this rank's result slots must be done before
                # peers may write them again (they do once this round's block is pushed).
                compute.wait_stream(ws.last_stream)
            ws.last_stream, ws.last_stream_id = compute, stream_id
        # A full block's routing is planned from the caller's tensors, and published by the own plan's fill
        # (``routing_sink``) or else converted by the push; a partial one is padded here, on compute, where the own
        # plan reads it next. Rows past num_rows stay as they are: no routing entry points at them (ids -1).
        self._routing, self._routing_sunk = None, False
        if routing is not None and num_rows == c:
            self._routing = routing
        elif routing is not None:
            ws.local["index"][:num_rows].copy_(routing[0])  # copy_ converts to int32 / fp32
            ws.local["weights"][:num_rows].copy_(routing[1])
            ws.local["index"][num_rows:].fill_(-1)
        # What the side stream waits for before pushing: the block and the previous round's sum, not the GEMMs the
        # caller issues between now and then.
        # torch.Event: its record() and wait() find the current stream in C++, not through a Python Stream object
        self._ready = torch.Event(self.device)
        self._ready.record()  # on compute
        own = slice(self.rank * c, self.rank * c + num_rows)
        self._own_slot = tuple(g[own] for g in self._gathered)
        self._block = self._own_slot if written else block
        self._written, self._num_rows = written, num_rows
        self._peers_in, self._own_in = False, None
        self._read_own = read_own and not written
        self._kept = tuple(g.new_empty(g.shape) for g in self._gathered) if keep else None
        self._kinds, self._results = kinds, results
        self._staging = {}
        return self._kept

    def own_block(self):
        return self._own_slot

    def block_written(self):
        self._ready.record()  # the push reads the own slot after the caller's writes

    def routing_sink(self):
        if self._routing is None or self._block is None:  # a partial block's routing is in place already
            return None
        self._routing_sunk = True
        ws = self.workspace
        return ws.local["index"], ws.local["weights"]

    def routing_written(self):
        # The push must follow the fill that writes the routing: the side stream waits for this event.
        self._ready.record()

    def _push(self) -> None:
        """On the side stream, once per round: the block into slot r of every peer's inboxes, each peer flagged once
        its copies (and the published routing) have landed; then the own block where this round reads or keeps it
        (an event). Issued at ``exchange_now`` or at the first use of a peer's block."""
        if self._block is None:
            return
        ws, c, rank, block, n = self.workspace, self.capacity, self.rank, self._block, self._num_rows
        comm = ws.comm_stream
        comm.wait_event(self._ready)
        for t in block:
            t.record_stream(comm)  # read on comm: its memory must outlive that read even if the caller drops it
        with torch.cuda.stream(comm):
            if self._routing is not None and not self._routing_sunk:
                for name, t in zip(("index", "weights"), self._routing):
                    t.record_stream(comm)
                    ws.local[name].copy_(t)  # copy_ converts to int32 / fp32 (a small kernel)
            for peer in self._peers():
                for target, part in zip(self._outbox[peer], block):
                    (target if n == c else target[:n]).copy_(part)
                ws.signal(peer, PUBLISHED, self.round)
            # The own block after the peers': nothing reads it before the pushes are out.
            own = slice(rank * c, rank * c + n)
            if self._kept is not None:
                for kept, part in zip(self._kept, block):
                    kept[own].copy_(part)
            if self._read_own:
                for slot, part in zip(self._own_slot, block):
                    slot.copy_(part)
            if self._kept is not None or self._read_own:
                self._own_in = torch.Event(self.device)
                self._own_in.record(comm)
        self._block = None

    def _await_peers(self) -> None:
        """Once per round, on compute: push (if not yet), then wait for every peer's block of this round. A kept
        round's private copy of the peers' blocks follows on the side stream, while compute reads the inbox."""
        if self._peers_in:
            return
        self._push()
        ws, c = self.workspace, self.capacity
        ws.wait(PUBLISHED, self.round, self.bounds)  # on compute: the GEMMs that read the blocks come next
        self._peers_in = True
        if self._kept is not None:
            arrived = torch.Event(self.device)
            arrived.record()
            ws.comm_stream.wait_event(arrived)
            with torch.cuda.stream(ws.comm_stream):
                for source in self._peers():
                    rows = slice(source * c, (source + 1) * c)
                    for kept, gathered in zip(self._kept, self._gathered):
                        kept[rows].copy_(gathered[rows])

    def routing(self, first, count):
        ws = self.workspace
        sources = range(first, first + count)
        if any(q != self.rank for q in sources):
            self._await_peers()  # the peers' routing is read in place, over NVLink
        if first == self.rank and count == 1 and self._routing is not None:
            return self._routing  # a full block: the caller's own tensors, nothing to copy first
        if count == 1:
            return ws.views[first]["index"], ws.views[first]["weights"]
        return tuple(torch.cat([ws.views[q][name] for q in sources]) for name in ("index", "weights"))

    def _peers(self) -> list[int]:
        return [q for q in self.source_order() if q != self.rank]

    def exchange_now(self):
        self._push()

    def wait_rows(self, source):
        if source != self.rank:
            self._await_peers()
            return self._gathered
        if self._written:
            return self._gathered  # written there by the caller, on this stream
        if not self._read_own:
            raise RuntimeError(
                "wait_rows(own rank) in a round started without read_own=True: the own block is not among the "
                "gathered rows; read it from the caller's tensor, or start the round with read_own=True"
            )
        self._push()
        self._own_in.wait()  # on the current stream
        return self._gathered

    def _slot(self, peer: int, kind: str, source_slot: int) -> torch.Tensor:
        return self.workspace.views[peer][_RESULT_REGION[kind]][source_slot]

    def partial_buffers(self, source):
        if source == self.rank:
            return {kind: self._slot(self.rank, kind, self.rank) for kind in self._kinds}
        staging = {kind: torch.empty_like(self._slot(self.rank, kind, source)) for kind in self._kinds}
        self._staging[source] = staging
        return staging

    def send(self, source):
        if source == self.rank:
            return
        ws = self.workspace
        written = torch.Event(self.device)
        written.record()
        with torch.cuda.stream(ws.comm_stream):
            ws.comm_stream.wait_event(written)
            for kind, buf in self._staging[source].items():
                self._slot(source, kind, self.rank).copy_(buf)
            ws.signal(source, RETURNED, self.round)

    def finish(self):
        ws = self.workspace
        self._await_peers()  # keeps each round's protocol whole even if no peer block was read
        ws.wait(RETURNED, self.round, self.bounds)
        comm_done = torch.Event(self.device)  # what compute waits for: staging and the kept copy are written on comm
        comm_done.record(ws.comm_stream)
        comm_done.wait()
        self._staging, self._kept = {}, None
        return {kind: ws.local[_RESULT_REGION[kind]] for kind in self._kinds}
