"""Routing metadata on the device: which rows each local expert takes, in which order, in which tiles.

Two small kernels per fill (the whole plan, or a run of its segments: keys and counts, then a stable counting
sort that writes the plan), with static output sizes: no count is ever read back to the host, the host spends little
time issuing it, and the layer can be captured in a CUDA graph.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..kernels.routing import routing_keys_kernel, routing_place_kernel
from ..kernels.tuning import interpreting
from ..validation import expert_id_error
from .compiled_launch import launch
from .sizes import cdiv, next_power_of_2


@dataclass
class RoutingPlan:
    """(source row, slot) pairs that hit this rank's experts, sorted by segment, then local expert, then pair index.

    A segment is a block of ``num_rows / num_segments`` consecutive source rows: one source rank's tokens under
    expert parallelism, so that each rank's rows can be computed as soon as they arrive (``segment(s)``); without
    expert parallelism there is one segment. Segment s owns the sorted rows [s * P, s * P + count_s), P = its pairs
    (rows * k): fixed places, so each segment can be planned on its own (``fill_routing_plan``), the own block's
    before the peers' routing has arrived. Sorted rows past a segment's count are never touched.
    """

    num_rows: int  # R: source rows of this plan (or of one segment, for a segment view)
    top_k: int
    num_local_experts: int
    tile_m: int
    # [S * (E_local + 1)] int32: (segment s, expert e) owns sorted rows [off[s*(E_local+1) + e], ... + e + 1])
    expert_offsets: torch.Tensor
    row_src: torch.Tensor  # [sorted_rows] int32: source row of each sorted row (over all segments)
    row_weight: torch.Tensor  # [sorted_rows] fp32: top-k weight of each sorted row
    pair_pos: torch.Tensor  # [R, k] int32: sorted row of each (row, slot) pair, -1 where the expert is not local
    tile_expert: torch.Tensor  # [S * tiles per segment] int32: local expert of each row tile
    tile_row: torch.Tensor  # [S * tiles per segment] int32: first sorted row of each tile
    num_tiles: torch.Tensor  # [S] int32: tiles in use per segment
    # [S * (E_local + 1)] int32: (segment s, expert e) owns the segment's tiles [et[s*(E_local+1) + e], ... + e + 1])
    expert_tiles: torch.Tensor | None = None
    num_segments: int = 1
    sorted_rows: int = -1  # rows of every sorted-order buffer (all segments' pairs); num_pairs when -1
    # This plan's tile 0 is tile ``first_tile`` of the whole plan (a segment's view; None for a half's view, whose
    # compacted tile list is not the plan's tile numbering). Passes that write per tile (cols_t operands) use it.
    first_tile: int | None = 0
    # Expert halves (``build_routing_plan(split_expert=...)``): the upper experts' tiles of each segment, compacted
    # (same layout as tile_expert / tile_row), and [S, 2] tiles in use per (segment, half).
    split_expert: int | None = None
    half_tile_expert: torch.Tensor | None = None
    half_tile_row: torch.Tensor | None = None
    half_num_tiles: torch.Tensor | None = None
    # [S * E_local] int32: local pairs per (segment, expert), as the plan's kernels count them
    counts: torch.Tensor | None = field(default=None, repr=False)
    # [2] int32 after the counts (zeroed with them): 1 at [0] once a fill that checks ids met one out of range; [1]
    # the fill's verdict, 1 if none was (``assert_ids_in_range``)
    id_check: torch.Tensor | None = field(default=None, repr=False)
    _counts_and_check: torch.Tensor | None = field(default=None, repr=False, compare=False)  # both, one view
    _views: dict = field(default_factory=dict, repr=False, compare=False)  # segment views made so far
    _scratch: torch.Tensor | None = field(default=None, repr=False, compare=False)  # the fills' keys and counts

    def __post_init__(self):
        if self.sorted_rows < 0:
            self.sorted_rows = self.num_pairs

    @property
    def num_pairs(self) -> int:
        return self.num_rows * self.top_k

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.numel()

    def segment(self, s: int, half: int | None = None) -> RoutingPlan:
        """The plan of segment ``s`` alone, for the tile-list kernels: its tiles and experts' row ranges, indexing the
        same sorted-row buffers (``sorted_rows`` long) and the same source rows as the whole plan. ``half`` = 0 or 1
        keeps only the tiles of the experts below or from ``split_expert`` (the plan must have been built with it);
        the two halves' results together are the segment's."""
        if half is not None and self.split_expert is None:
            raise ValueError("segment(s, half): the plan was built without split_expert")
        if self.num_segments == 1 and half is None:
            return self
        view = self._views.get((s, half))
        if view is None:  # the forward and the backward ask for the same views: build each once
            view = self._views[(s, half)] = self._segment_view(s, half)
        return view

    def _segment_view(self, s: int, half: int | None) -> RoutingPlan:
        rows, tiles = self.num_rows // self.num_segments, self.max_tiles // self.num_segments
        experts = self.num_local_experts
        tile_expert, tile_row, num_tiles = self.tile_expert, self.tile_row, self.num_tiles[s : s + 1]
        if half is not None:
            num_tiles = self.half_num_tiles[s, half : half + 1]
            if half == 1:
                tile_expert, tile_row = self.half_tile_expert, self.half_tile_row
        return RoutingPlan(
            num_rows=rows,
            top_k=self.top_k,
            num_local_experts=experts,
            tile_m=self.tile_m,
            expert_offsets=self.expert_offsets[s * (experts + 1) : (s + 1) * (experts + 1)],
            # (a half's tile list is compacted apart: the whole segment's expert tiles do not index it)
            expert_tiles=None if half is not None else self.expert_tiles[s * (experts + 1) : (s + 1) * (experts + 1)],
            row_src=self.row_src,
            row_weight=self.row_weight,
            pair_pos=self.pair_pos[s * rows : (s + 1) * rows],
            tile_expert=tile_expert[s * tiles : (s + 1) * tiles],
            tile_row=tile_row[s * tiles : (s + 1) * tiles],
            num_tiles=num_tiles,
            num_segments=1,
            sorted_rows=self.sorted_rows,
            first_tile=s * tiles if half is None else None,
        )

    def reset_counts(self) -> None:
        """Zeroes the counts and the id check for a new fill, one launch (a plan of ``allocate_routing_plan``)."""
        self._counts_and_check.zero_()

    def assert_ids_in_range(self, num_experts: int) -> None:
        """A device-side assertion (no host sync) that the last fill, run with ``check_ids_below=num_experts``, met
        no expert id outside [-1, num_experts): the next sync fails where one was, with
        ``validation.check_expert_ids``'s message."""
        torch._assert_async(self.id_check[1], expert_id_error(num_experts))

    def scratch(self, size: int) -> torch.Tensor:
        """int32 [size] working memory of a fill, kept with the plan (fills of one plan run one after another on a
        stream)."""
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.int32, device=self.row_src.device)
        return self._scratch[:size]

    def pair_values(self, row_values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[R, k] from per-sorted-row values: each (row, slot) pair's value, zero where its expert is elsewhere."""
        pos = self.pair_pos.long()
        return torch.where(pos >= 0, row_values[pos.clamp(min=0)], 0.0).to(dtype)


def allocate_routing_plan(
    num_rows: int,
    top_k: int,
    *,
    num_local_experts: int,
    tile_m: int,
    device: torch.device,
    num_segments: int = 1,
    split_expert: int | None = None,
) -> RoutingPlan:
    """An unfilled plan for ``num_rows`` source rows in ``num_segments`` equal blocks (R must divide); fill each
    segment with ``fill_routing_plan`` before using it. ``split_expert``: also list each segment's tiles of local
    experts [0, split) and [split, E_local) apart (``RoutingPlan.segment(s, half)``)."""
    if num_rows % num_segments:
        raise ValueError(f"{num_rows} source rows do not split into {num_segments} equal segments")
    if split_expert is not None and not 0 <= split_expert <= num_local_experts:
        raise ValueError(f"split_expert = {split_expert} is outside [0, {num_local_experts}]")
    layout, total = _plan_layout(num_rows, top_k, num_local_experts, tile_m, num_segments, split_expert)
    # Every part is a view of this one buffer, zeroed once: sorted rows no fill places (dropped slots, a segment's
    # rows past its pairs) keep a valid source row (0), as kernels that load a whole tile's row_src before masking by
    # the expert's end read them (the warp-specialised fp8 kernels' producers).
    storage = torch.zeros(total, dtype=torch.int32, device=device)

    def part(name):
        first, size = layout[name]
        return storage[first : first + size]

    plan = RoutingPlan(
        num_rows=num_rows,
        top_k=top_k,
        num_local_experts=num_local_experts,
        tile_m=tile_m,
        expert_offsets=part("expert_offsets"),
        row_src=part("row_src"),
        row_weight=part("row_weight").view(torch.float32),
        pair_pos=part("pair_pos").view(num_rows, top_k),
        tile_expert=part("tile_expert"),
        tile_row=part("tile_row"),
        num_tiles=part("num_tiles"),
        expert_tiles=part("expert_tiles"),
        num_segments=num_segments,
        counts=part("counts")[: num_segments * num_local_experts],
        id_check=part("counts")[num_segments * num_local_experts :],
        _counts_and_check=part("counts"),
    )
    if split_expert is not None:
        plan.split_expert = split_expert
        plan.half_tile_expert, plan.half_tile_row = part("half_tile_expert"), part("half_tile_row")
        plan.half_num_tiles = part("half_num_tiles").view(num_segments, 2)
    return plan


_PART_ALIGN = 64  # int32 elements (256 bytes), as separate allocations would be: kernels specialise on alignment


def _plan_layout(num_rows, top_k, num_local, tile_m, num_segments, split_expert) -> tuple[dict, int]:
    """{part: (first element, elements)} of a plan's int32 storage, and its size. One buffer for every part: an
    allocation each would be a dozen host calls on the layer's path to its first GEMM."""
    num_pairs = num_rows * top_k
    tiles = num_segments * ((num_pairs // num_segments + tile_m - 1) // tile_m + num_local)
    sizes = {  # row_weight's fp32 has int32's size; the counts' part ends with the id check's two
        "counts": num_segments * num_local + 2,
        "expert_offsets": num_segments * (num_local + 1),
        "row_src": num_pairs,
        "row_weight": num_pairs,
        "pair_pos": num_pairs,
        "tile_expert": tiles,
        "tile_row": tiles,
        "num_tiles": num_segments,
        "expert_tiles": num_segments * (num_local + 1),
    }
    if split_expert is not None:
        sizes.update(half_tile_expert=tiles, half_tile_row=tiles, half_num_tiles=2 * num_segments)
    layout, total = {}, 0
    for name, size in sizes.items():
        layout[name] = (total, size)
        total += -(-size // _PART_ALIGN) * _PART_ALIGN
    return layout, total


ROUTING_CHUNK = 1024  # pairs per program of the routing kernels
# Under the interpreter a program's sort costs Python work per element and stage: small chunks (several per call at
# the tests' sizes, so the cross-chunk counts are exercised) keep a CPU test's plan cheap.
INTERPRETED_ROUTING_CHUNK = 64


def routing_chunk() -> int:
    """Pairs per program of the routing kernels: ``ROUTING_CHUNK`` compiled, ``INTERPRETED_ROUTING_CHUNK`` under the
    interpreter."""
    return INTERPRETED_ROUTING_CHUNK if interpreting() else ROUTING_CHUNK


class RowQuantization(NamedTuple):
    """Rows the plan's first launch also quantises (``routing_keys_kernel``'s QUANT_ROWS): x [R, K] (contiguous
    rows) into q (fp8, same shape) and scale [R, cdiv(K, group)], one scale per row and ``group`` columns, in tiles of
    block_rows x block_cols; ``fp8_launch.row_quantization`` makes it. One launch fewer on the host's path to the
    quantised forward's first GEMM."""

    x: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor
    group: int
    block_rows: int
    block_cols: int
    pow2: bool
    e8m0: bool


def routing_keys(
    top_k_index: torch.Tensor,
    counts: torch.Tensor,
    *,
    segment_pairs: int,
    expert_base: int,
    num_local_experts: int,
    chunk: int | None = None,
    scratch=None,
    copy_routing=None,
    quantize: RowQuantization | None = None,
    id_check: torch.Tensor | None = None,
    num_experts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keys, hist, bins) of the (row, slot) pairs of ``top_k_index`` [n * R_s, k]: keys [n * R_s * k] int32, key =
    segment * E_local + local expert, or n * E_local where the expert is elsewhere; hist [chunks, bins] int32, each
    chunk's pairs per key (``bins`` a power of two > n * E_local + 1). ``counts`` [n * E_local] int32, zeroed: gets
    each local key's pairs added. ``scratch(size)``: where keys and hist go (a new tensor when None).
    ``copy_routing`` (weights, ids out int32, weights out fp32: contiguous, each with top_k_index's element count; an
    internal call, unchecked): the same launch also writes the ids and weights there. ``quantize``: the same launch
    also quantises those rows. ``id_check`` (int32, zero at [0]): where an id outside [-1, num_experts) sets [0] to
    1 (``RoutingPlan.id_check``)."""
    num_pairs = top_k_index.numel()
    chunk = chunk or routing_chunk()
    chunks = max(cdiv(num_pairs, chunk), 1)
    num_bins = next_power_of_2(counts.numel() + 2)  # keys 0..n*E_l (the last: elsewhere), one for padding
    size = num_pairs + chunks * num_bins
    if scratch is None:
        scratch = torch.empty(size, dtype=torch.int32, device=top_k_index.device)
    else:
        scratch = scratch(size)
    keys, hist = scratch[:num_pairs], scratch[num_pairs:]
    weights, out_index, out_weights = copy_routing if copy_routing is not None else (None, None, None)
    if quantize is None:
        programs, x_args = chunks, (None, None, None, 0, 0, 0, 0, 0, chunks, 1)
        quant = {"QUANT_ROWS": False, "QK": 1, "BM": 1, "BK": 1, "POW2": False, "E8M0": False}
    else:
        x_rows, x_cols = quantize.x.shape
        col_tiles = cdiv(x_cols, quantize.block_cols)
        programs = chunks + cdiv(x_rows, quantize.block_rows) * col_tiles
        x_args = (
            quantize.x,
            quantize.q,
            quantize.scale,
            x_rows,
            x_cols,
            quantize.x.stride(0),
            quantize.q.stride(0),
            quantize.scale.stride(0),
            chunks,
            col_tiles,
        )
        quant = {
            "QUANT_ROWS": True,
            "QK": quantize.group,
            "BM": quantize.block_rows,
            "BK": quantize.block_cols,
            "POW2": quantize.pow2,
            "E8M0": quantize.e8m0,
        }
    launch(
        routing_keys_kernel,
        (programs,),
        top_k_index.reshape(-1),
        keys,
        counts,
        hist,
        num_pairs,
        max(segment_pairs, 1),
        expert_base,
        weights,
        out_index,
        out_weights,
        *x_args,
        id_check,
        num_experts,
        NUM_LOCAL=num_local_experts,
        NUM_BINS=num_bins,
        SKIP=counts.numel(),
        BLOCK=chunk,
        COPY_ROUTING=copy_routing is not None,
        CHECK_IDS=id_check is not None,
        **quant,
    )
    return keys, hist, num_bins


def fill_routing_plan(
    plan: RoutingPlan,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    expert_base: int,
    first_segment: int = 0,
    chunk: int | None = None,
    copy_to: tuple[torch.Tensor, torch.Tensor] | None = None,
    quantize: RowQuantization | None = None,
    check_ids_below: int | None = None,
) -> None:
    """Plan segments [first_segment, first_segment + n) from their source rows' global expert ids ``top_k_index``
    [n * R_s, k] (ids outside [expert_base, expert_base + E_local), including -1 for padding rows, are other ranks'
    and skipped) and weights. Segments filled in separate calls do not touch each other's parts of the plan. Two
    launches: keys and counts, then the sort that writes the plan (``kernels.routing``), ``chunk`` pairs a program.
    ``copy_to`` (ids int32, weights fp32, both [n * R_s, k] contiguous): the first launch also copies the routing
    there, converted (a rank's published routing, ``Transport.routing_sink``). ``quantize``: the first launch also
    quantises those rows (``RowQuantization``). ``check_ids_below`` (E, the expert count of the ids): the launches
    also check that every id lies in [-1, E), for ``RoutingPlan.assert_ids_in_range`` (the plan's counts and id check
    zeroed before: ``take_plan``)."""
    chunk = chunk or routing_chunk()
    seg_rows = plan.num_rows // plan.num_segments
    rows, top_k = top_k_index.shape
    num_segments = rows // seg_rows if seg_rows else plan.num_segments  # no rows: every segment is empty
    whole = rows % seg_rows == 0 if seg_rows else rows == 0
    if not whole or top_k != plan.top_k or not 0 <= first_segment <= plan.num_segments - num_segments:
        raise ValueError(
            f"routing of {rows} rows x {top_k} does not fill whole segments of {seg_rows} rows x {plan.top_k} from "
            f"segment {first_segment} of {plan.num_segments}"
        )
    experts = plan.num_local_experts
    seg_pairs = seg_rows * top_k
    counts = plan.counts[first_segment * experts : (first_segment + num_segments) * experts]
    keys, hist, num_bins = routing_keys(
        top_k_index,
        counts,
        segment_pairs=seg_pairs,
        expert_base=expert_base,
        num_local_experts=experts,
        chunk=chunk,
        scratch=plan.scratch,
        copy_routing=None if copy_to is None else (top_k_weights.reshape(-1), *copy_to),
        quantize=quantize,
        id_check=None if check_ids_below is None else plan.id_check,
        num_experts=check_ids_below or 0,
    )
    halves = plan.split_expert is not None
    skip = num_segments * experts
    launch(
        routing_place_kernel,
        (1 + num_segments, hist.numel() // num_bins),
        keys,
        hist,
        top_k_weights.reshape(-1),
        counts,
        plan.row_src,
        plan.row_weight,
        plan.pair_pos,
        plan.expert_offsets,
        plan.tile_expert,
        plan.tile_row,
        plan.num_tiles,
        plan.expert_tiles,
        plan.half_tile_expert if halves else plan.tile_expert,
        plan.half_tile_row if halves else plan.tile_row,
        plan.half_num_tiles if halves else plan.num_tiles,
        keys.numel(),
        first_segment,
        max(seg_pairs, 1),
        plan.max_tiles // plan.num_segments,
        plan.split_expert if halves else experts,
        None if check_ids_below is None else plan.id_check,
        TOP_K=top_k,
        NUM_LOCAL=experts,
        EXPERT_BLOCK=next_power_of_2(experts),
        NUM_BINS=num_bins,
        SKIP=skip,
        TILE_M=plan.tile_m,
        BLOCK=chunk,
        TILE_BLOCK=32,
        HALVES=halves,
        HIST_BLOCK=16,
        CHECK_IDS=check_ids_below is not None,
    )


def build_routing_plan(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    expert_base: int,
    num_local_experts: int,
    tile_m: int,
    num_segments: int = 1,
    split_expert: int | None = None,
) -> RoutingPlan:
    """The plan of source rows with global expert ids ``top_k_index`` [R, k], every segment filled at once (see
    ``allocate_routing_plan`` and ``fill_routing_plan``)."""
    plan = allocate_routing_plan(
        top_k_index.shape[0],
        top_k_index.shape[1],
        num_local_experts=num_local_experts,
        tile_m=tile_m,
        device=top_k_index.device,
        num_segments=num_segments,
        split_expert=split_expert,
    )
    fill_routing_plan(plan, top_k_index, top_k_weights, expert_base=expert_base)
    return plan


class PlanLease:
    """A routing plan taken from a pool of free plans of its sizes. The plan goes back to the pool when the lease is
    dropped: at the end of a call that keeps nothing for a backward, or when the autograd graph holding the lease is
    freed (after its backward, or unused). A plan is therefore never refilled while a backward may still read it
    (also one run with ``retain_graph``), and a model's layers reuse the same few plans step after step: no per-call
    allocation of the plan's dozen views, and the segment views each plan caches stay valid for its forward and
    backward. A plan returned on one stream and taken on another is waited for first (``take_plan``)."""

    def __init__(self, pool: list, plan: RoutingPlan, stream):
        self.plan = plan
        weakref.finalize(self, pool.append, (plan, stream))  # holds the pool and the plan, not the lease


def _capturing(stream) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


def take_plan(pool: list, allocate, device: torch.device) -> PlanLease:
    """A lease on a free plan of ``pool``, its counts zeroed for a new fill, else on ``allocate()``. A plan last used
    on another stream is waited for, except while this stream is captured in a CUDA graph and that stream is not: a
    capture cannot depend on work outside it (CUDA refuses, and the capture fails), and torch.cuda.graph finishes all
    work on the device before it starts capturing."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    if pool:
        plan, last_stream = pool.pop()
        if (
            stream is not None
            and last_stream is not None
            and last_stream != stream
            and not (_capturing(stream) and not _capturing(last_stream))
        ):
            stream.wait_stream(last_stream)
        plan.reset_counts()
    else:
        plan = allocate()
    return PlanLease(pool, plan, stream)


# Free one-segment plans by (rows, top_k, local experts, tile_m, device), for the layer without expert parallelism.
# Only the PLAN_POOL_SIZES most recently used sizes keep theirs: token counts that change from step to step must not
# leave a plan behind for each count seen (a dropped pool's plans are freed as their leases end).
_PLAN_POOLS: OrderedDict[tuple, list] = OrderedDict()
PLAN_POOL_SIZES = 4


def lease_routing_plan(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    expert_base: int,
    num_local_experts: int,
    tile_m: int,
    quantize: RowQuantization | None = None,
    check_ids_below: int | None = None,
) -> PlanLease:
    """``build_routing_plan``'s plan (one segment), filled, on a lease from the pool of plans of its sizes;
    ``quantize``: the fill's first launch also quantises those rows (``RowQuantization``); ``check_ids_below``: the
    fill also checks the ids' range (``fill_routing_plan``)."""
    rows, top_k = top_k_index.shape
    device = top_k_index.device
    key = (rows, top_k, num_local_experts, tile_m, device)
    pool = _PLAN_POOLS.get(key)
    if pool is None:
        pool = _PLAN_POOLS[key] = []
        while len(_PLAN_POOLS) > PLAN_POOL_SIZES:
            _PLAN_POOLS.popitem(last=False)
    else:
        _PLAN_POOLS.move_to_end(key)
    lease = take_plan(
        pool,
        lambda: allocate_routing_plan(rows, top_k, num_local_experts=num_local_experts, tile_m=tile_m, device=device),
        device,
    )
    fill_routing_plan(
        lease.plan,
        top_k_index,
        top_k_weights,
        expert_base=expert_base,
        quantize=quantize,
        check_ids_below=check_ids_below,
    )
    return lease
