"""The symmetric-memory transport: peer-to-peer copies over NVLink, device-side signals, overlapped with compute.

One workspace per (group, capacity, H, k, dtype), allocated on first use with
``torch.distributed._symmetric_memory`` and shared by every layer of the model (rounds run one after another on each
rank). Each rank's part, with W ranks and capacity C:

    rows       [C, H]      dtype  this rank's published block (tokens in the forward, output gradients backward)
    index      [C, k]      int32  its published routing (forward)
    weights    [C, k]      fp32
    row_res    [W, C, H]   dtype  results for this rank's tokens; slot q is written by rank q
    pair_res   [W, C, k]   fp32   top-k weight gradients for this rank's tokens (backward); slot q by rank q
    flags      [2, W]      int32  channel 0: "rank q published round n", channel 1: "rank q wrote its slot, round n"

A round on rank r (see ``comm.transport``), with streams `compute` (the caller's) and `comm` (a side stream):
- start: record an event (what `comm` must wait for before it touches the block). A block of fewer than C rows
  has its routing padded into the workspace here (compute); a full block's own plan reads the caller's routing.
- publish (at the first use of the own rows or of a peer's, or at ``exchange_now``): on `comm`, copy block and
  routing into the workspace (the routing's conversion to int32 / fp32 is a small kernel), flag channel 0 on every
  peer, then copy the own block into a local [W*C, H] buffer (an event). The forward reads its own tokens straight
  from the caller's tensor, so its first GEMMs go out before any of this; so does the backward's first GEMM
  (``exchange_now`` after it).
- pull (at the first use of a peer's routing or rows, or at ``exchange_now``): publish, then `comm` waits for every
  peer's flag and copies each peer's block into the local buffer, an event per block. Forward: the peers' plans wait
  for the flags too and read their routing (a few kB) in place, while compute is busy with the own block.
  `comm` has high priority, so its wait kernel takes the first free SM rather than queue behind a GEMM's blocks
  (flags are set by stream memory operations, which need no SM).
- send(s): results for rank s's tokens go straight into rank r's own slot when s = r; otherwise into a staging
  buffer that `comm` copies into rank s's slot r, then flags channel 1 on rank s.
- finish: wait (compute) for channel 1 from every peer, then return the slots; the caller sums them in rank order.

Why reuse is safe without extra barriers: a rank overwrites its published block only in a later round, after it has
received every peer's results of the earlier round, and each peer sends those only after reading the block. A peer
writes into this rank's slots only after reading this rank's block of the same round, published after this rank
summed the previous round's slots.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from ..kernels.signals import wait_flags_kernel
from ..ops.compiled_launch import launch
from .transport import PAIR_RESULTS, ROW_RESULTS, Transport

log = logging.getLogger("prime_megamoe")

PUBLISHED, RETURNED = 0, 1  # flag channels
_RESULT_REGION = {ROW_RESULTS: "row_res", PAIR_RESULTS: "pair_res"}  # where each result kind lands
_ALIGN = 256


class SymmetricWorkspace:
    """The symmetric buffers of one (group, capacity, H, k, dtype); see the module docstring for the layout."""

    def __init__(self, group, capacity: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "stream_write_value32_"):
            raise RuntimeError(
                f"[model.moe.dispatch] transport = 'symmetric_memory' sets its flags with "
                f"torch.ops.symm_mem.stream_write_value32_, which this torch ({torch.__version__}) lacks; use a CUDA "
                f"build of torch >= 2.9, or transport = 'collectives'"
            )
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.world, self.rank, self.capacity, self.hidden, self.top_k = world, rank, capacity, hidden, top_k
        self.dtype = dtype
        regions = {
            "rows": ((capacity, hidden), dtype),
            "index": ((capacity, top_k), torch.int32),
            "weights": ((capacity, top_k), torch.float32),
            "row_res": ((world, capacity, hidden), dtype),
            "pair_res": ((world, capacity, top_k), torch.float32),
            "flags": ((2, world), torch.int32),
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
        self.round = 0
        # High priority: the wait kernel on this stream gets an SM as soon as one frees up, instead of queueing
        # behind every block of a GEMM launched before it (which held a peer's block back by a whole GEMM).
        self.comm_stream = torch.cuda.Stream(device=device, priority=-1)
        self.last_stream: torch.cuda.Stream | None = None  # the stream the last round computed on
        log.info(
            "prime_megamoe: symmetric-memory workspace for EP = %d, max_tokens_per_rank = %d, H = %d, k = %d, %s: "
            "%.1f MiB per rank", world, capacity, hidden, top_k, dtype, total / 2**20,
        )

    def signal(self, peer: int, channel: int, value: int) -> None:
        """Set flag (channel, this rank) on ``peer`` to ``value`` once this stream's earlier work is done: a stream
        memory operation (the driver's write-value, with a system-scope fence before the write), so it needs no SM and
        never queues behind the GEMMs' blocks as a kernel would."""
        torch.ops.symm_mem.stream_write_value32_(self.flag_words[peer], channel * self.world + self.rank, value)

    def wait(self, channel: int, value: int, timeout_s: float) -> None:
        """Hold this stream until every peer has set its flag on ``channel`` to ``value`` or more."""
        launch(wait_flags_kernel, (1,),
            self.local["flags"], value, self.rank, channel, int(timeout_s * 1e9),
            WORLD=self.world, WORLD_BLOCK=max(2, 1 << (self.world - 1).bit_length()), num_warps=1,
        )


_WORKSPACES: dict[tuple, SymmetricWorkspace] = {}


def workspace_info() -> list[dict]:
    """Every symmetric-memory workspace allocated in this process and its size per rank."""
    return [
        {"ep": ws.world, "max_tokens_per_rank": ws.capacity, "hidden": ws.hidden, "top_k": ws.top_k,
         "dtype": str(ws.dtype), "bytes_per_rank": ws.nbytes}
        for ws in _WORKSPACES.values()
    ]


class SymmetricMemoryTransport(Transport):
    """Transport over the shared workspace of its group and shapes (see the module docstring); one object serves
    every round of its group, one round at a time."""

    def __init__(self, group, capacity: int, device: torch.device, timeout_s: float):
        super().__init__(group, capacity, timeout_s)
        self.device = device
        self.workspace: SymmetricWorkspace | None = None

    def _workspace(self, hidden: int, top_k: int, dtype: torch.dtype) -> SymmetricWorkspace:
        key = (self.group.group_name, self.capacity, hidden, top_k, dtype, self.device.index)
        ws = _WORKSPACES.get(key)
        if ws is None:
            ws = _WORKSPACES[key] = SymmetricWorkspace(self.group, self.capacity, hidden, top_k, dtype, self.device)
        return ws

    def start(self, block, routing, kinds, top_k):
        ws = self.workspace
        if ws is None or (ws.hidden, ws.top_k, ws.dtype) != (block.shape[1], top_k, block.dtype):
            ws = self.workspace = self._workspace(block.shape[1], top_k, block.dtype)
        c, num_rows = self.capacity, block.shape[0]
        ws.round += 1
        self.round = ws.round
        compute = torch.cuda.current_stream(self.device)
        if ws.last_stream is not None and ws.last_stream != compute:
            # The previous round ran on another stream: its sum of this rank's result slots must be done before
            # peers may write them again (they do once this round's block is published).
            compute.wait_stream(ws.last_stream)
        ws.last_stream = compute
        # A full block's routing is planned from the caller's tensors and published with the block (``_publish``);
        # a partial one is padded here, on compute, where the own plan reads it next. Rows past num_rows stay as
        # they are: no routing entry points at them (their ids are -1).
        self._routing = None
        if routing is not None and num_rows == c:
            self._routing = routing
        elif routing is not None:
            ws.local["index"][:num_rows].copy_(routing[0])  # copy_ converts to int32 / fp32
            ws.local["weights"][:num_rows].copy_(routing[1])
            ws.local["index"][num_rows:].fill_(-1)
        self._rows = block.new_empty(self.world * c, block.shape[1])
        # What the side stream waits for before publishing: the block, the rows' memory and the previous round's
        # sum, not the GEMMs the caller issues between now and then.
        self._ready = torch.cuda.Event()
        self._ready.record(compute)
        self._block, self._arrived, self._published = block, {}, None
        self._kinds = kinds
        self._staging = {}
        return self._rows

    def _publish(self) -> None:
        """On the side stream, once per round: block and (a full block's) routing into the workspace, flag channel 0
        on every peer, then the own block into rows (an event). Issued at the first use of the own rows or of a
        peer's (or at ``exchange_now``), so a caller that reads its own tokens directly issues its first GEMMs before
        any of this."""
        if self._block is None:
            return
        ws, c, rank, block = self.workspace, self.capacity, self.rank, self._block
        comm = ws.comm_stream
        comm.wait_event(self._ready)
        block.record_stream(comm)  # read on comm: its memory must outlive that read even if the caller drops it
        with torch.cuda.stream(comm):
            ws.local["rows"][: block.shape[0]].copy_(block)
            if self._routing is not None:
                for name, t in zip(("index", "weights"), self._routing):
                    t.record_stream(comm)
                    ws.local[name].copy_(t)  # copy_ converts to int32 / fp32
            for peer in self._peers():
                ws.signal(peer, PUBLISHED, self.round)
            # The own copy among the gathered rows after the flags: the peers need not wait for it.
            self._rows[rank * c : rank * c + block.shape[0]].copy_(block)
            self._arrived[rank] = torch.cuda.Event()
            self._arrived[rank].record(comm)
        self._block = None

    def _pull(self) -> None:
        """On the side stream, once per round: wait for every peer's block, then copy each into rows, one event per
        block. Issued at the first use of a peer's routing or rows."""
        if self._published is not None:
            return
        self._publish()
        ws, c = self.workspace, self.capacity
        with torch.cuda.stream(ws.comm_stream):
            ws.wait(PUBLISHED, self.round, self.timeout_s)
            self._published = torch.cuda.Event()
            self._published.record(ws.comm_stream)
            for source in self._peers():
                self._rows[source * c : (source + 1) * c].copy_(ws.views[source]["rows"])
                self._arrived[source] = torch.cuda.Event()
                self._arrived[source].record(ws.comm_stream)

    def routing(self, first, count):
        ws, compute = self.workspace, torch.cuda.current_stream(self.device)
        sources = range(first, first + count)
        if any(q != self.rank for q in sources):
            self._pull()
            compute.wait_event(self._published)  # the peers' routing is read in place, over NVLink
        if first == self.rank and count == 1 and self._routing is not None:
            return self._routing  # a full block: the caller's own tensors, nothing to copy first
        if count == 1:
            return ws.views[first]["index"], ws.views[first]["weights"]
        return tuple(torch.cat([ws.views[q][name] for q in sources]) for name in ("index", "weights"))

    def _peers(self) -> list[int]:
        return [q for q in self.source_order() if q != self.rank]

    def exchange_now(self):
        self._pull()

    def wait_rows(self, source):
        self._publish()
        if source != self.rank:
            self._pull()
        torch.cuda.current_stream(self.device).wait_event(self._arrived[source])

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
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(ws.comm_stream):
            ws.comm_stream.wait_event(written)
            for kind, buf in self._staging[source].items():
                self._slot(source, kind, self.rank).copy_(buf)
            ws.signal(source, RETURNED, self.round)

    def finish(self):
        ws = self.workspace
        compute = torch.cuda.current_stream(self.device)
        self._pull()  # keeps each round's protocol whole even if no peer block was read
        ws.wait(RETURNED, self.round, self.timeout_s)
        compute.wait_stream(ws.comm_stream)  # staging and gathered rows are freed on the compute stream
        self._staging, self._rows = {}, None
        return {kind: ws.local[_RESULT_REGION[kind]] for kind in self._kinds}
