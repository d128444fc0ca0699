"""The fused Triton path (`dispatch="mega_moe"`, one rank) against the transformers float64 oracle, its determinism,
and unit tests of its pieces: the device-side routing plan and the deterministic row combine.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py), which takes seconds per call, so the
oracle cases are few and small but cover the awkward parts: H and I that are not multiples of the tile sizes,
experts with no rows, an expert spanning several row tiles, k = 1 and k = 4, T = 1, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prime_megamoe import DispatchConfig, fused_experts
from prime_megamoe.kernels import tuning
from prime_megamoe.kernels.grouped_gemm import grouped_wgrad_kernel
from prime_megamoe.kernels.tuning import interpreting
from prime_megamoe.ops.launch import (
    combine_rows,
    dswiglu_buffers,
    fc2_dgrad_dswiglu,
    grouped_gemm,
    grouped_wgrad,
    sum_blocks,
)
from prime_megamoe.ops.routing_plan import (
    allocate_routing_plan,
    build_routing_plan,
    fill_routing_plan,
    routing_keys,
)

from .oracle import (
    NAMES,
    TOL,
    assert_matches_oracle,
    make_problem,
    oracle_with_grads,
    ragged_routing,
    rel_err,
    run_mega_moe,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------------------
# Fused layer vs the float64 oracle (interpreter: each case is one forward and one backward)

# (id, T, H, I, E, k, routing)
ORACLE_CASES = [
    ("uniform_T24_H32_I16_E4_k2", 24, 32, 16, 4, 2, "uniform"),
    ("ragged_T33_H40_I24_E6_k4", 33, 40, 24, 6, 4, "ragged"),  # H, I not multiples of 16; expert 0 empty
    ("ragged_T40_H48_I40_E8_k2", 40, 48, 40, 8, 2, "ragged"),  # hot expert spans several 16-row tiles
    ("k1_T20_H40_I24_E4", 20, 40, 24, 4, 1, "ragged"),
    ("T1_H32_I16_E8_k4", 1, 32, 16, 8, 4, "uniform"),
    ("T3_H24_I8_E8_k2_sparse", 3, 24, 8, 8, 2, "uniform"),  # most experts have no rows
]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: c[0])
def test_mega_moe_matches_oracle(case, dtype_name):
    name, t, h, i, e, k, routing = case
    dtype = DTYPES[dtype_name]
    seed = 31 * ORACLE_CASES.index(case) + len(dtype_name)
    x, index, weights, w1, w2, g = make_problem(t, h, i, e, k, dtype, seed=seed, routing=routing)
    got = run_mega_moe(x, index, weights, w1, w2, g)
    assert_matches_oracle(got, x, index, weights, w1, w2, g, TOL[dtype])
    if routing == "ragged":
        # The expert nobody chose has exactly zero weight gradients.
        assert torch.count_nonzero(got[3][0]) == 0 and torch.count_nonzero(got[4][0]) == 0


def test_mega_moe_matches_oracle_int32_index_and_config():
    # int32 ids, a DispatchConfig instead of a name, an extremely hot expert (4 tiles of rows), fp32.
    x, index, weights, w1, w2, g = make_problem(
        48, 24, 16, 4, 2, torch.float32, seed=77, routing="ragged", hot_fraction=0.95
    )
    counts = torch.bincount(index.reshape(-1), minlength=4)
    assert counts[1] > 3 * 16 - 8  # the hot expert really spans several row tiles
    got = run_mega_moe(x, index.to(torch.int32), weights, w1, w2, g, dispatch=DispatchConfig(type="mega_moe"))
    assert_matches_oracle(got, x, index, weights, w1, w2, g, TOL[torch.float32])


def test_mega_moe_duplicate_expert_in_one_token():
    # Two slots of one token naming the same expert must both count (the oracle and the loop agree on this).
    x, index, weights, w1, w2, g = make_problem(9, 32, 16, 4, 2, torch.float32, seed=5)
    index[::2, 1] = index[::2, 0]
    got = run_mega_moe(x, index, weights, w1, w2, g)
    assert_matches_oracle(got, x, index, weights, w1, w2, g, TOL[torch.float32])


def test_mega_moe_partial_grads_and_no_grad_forward():
    # Only gate_up_proj needs a gradient (the other autograd branches are skipped); a no-grad forward gives the
    # same output bit for bit as the forward that saves activations.
    x, index, weights, w1, w2, g = make_problem(18, 40, 24, 4, 2, torch.float32, seed=8, routing="ragged")
    w1p = w1.clone().requires_grad_()
    out = fused_experts(x, index, weights, w1p, w2, dispatch="mega_moe")
    (gw1,) = torch.autograd.grad(out, [w1p], g)
    with torch.no_grad():
        out_nograd = fused_experts(x, index, weights, w1, w2, dispatch="mega_moe")
    assert torch.equal(out.detach(), out_nograd)
    ref = oracle_with_grads(x, index, weights, w1, w2, g)
    assert rel_err(out, ref[0]) <= 1e-5
    assert rel_err(gw1, ref[3]) <= 1e-5


def test_mega_moe_agrees_with_torch_backend_in_bf16():
    x, index, weights, w1, w2, g = make_problem(20, 40, 24, 6, 3, torch.bfloat16, seed=12, routing="ragged")
    fused = run_mega_moe(x, index, weights, w1, w2, g)
    baseline = run_mega_moe(x, index, weights, w1, w2, g, dispatch="torch")
    for name, a, b in zip(NAMES, fused, baseline):
        assert rel_err(a, b) <= 2e-2, name


@pytest.mark.parametrize("precision", ["bf16", "fp8_bwd"])
def test_forward_without_grad_mode_saves_nothing(monkeypatch, precision):
    # Under torch.no_grad (evaluation, a checkpointed layer's first forward) the parameters still require grad,
    # but no backward will run: FC1 must not write h, and the output must not require grad.
    from prime_megamoe.ops import launch

    calls = []
    fc1 = launch.fc1_swiglu

    def recording_fc1(*args, save_h, **kwargs):
        calls.append(save_h)
        return fc1(*args, save_h=save_h, **kwargs)

    monkeypatch.setattr(launch, "fc1_swiglu", recording_fc1)
    x, index, weights, w1, w2, _ = make_problem(12, 32, 16, 4, 2, torch.float32, seed=2)
    x, weights, w1, w2 = (t.requires_grad_() for t in (x, weights, w1, w2))
    with torch.no_grad():
        out = fused_experts(x, index, weights, w1, w2, dispatch="mega_moe", precision=precision)
    assert calls == [False] and not out.requires_grad
    out = fused_experts(x, index, weights, w1, w2, dispatch="mega_moe", precision=precision)
    assert calls == [False, True] and out.requires_grad


def test_mega_moe_no_tokens_forward():
    x, index, weights, w1, w2, _ = make_problem(0, 32, 16, 4, 2, torch.float32, seed=1)
    out = fused_experts(x, index, weights, w1, w2, dispatch="mega_moe")
    assert out.shape == (0, 32) and out.dtype == torch.float32


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_mega_moe_is_bitwise_deterministic(dtype_name):
    dtype = DTYPES[dtype_name]
    x, index, weights, w1, w2, g = make_problem(26, 40, 24, 6, 4, dtype, seed=99, routing="ragged")
    first = run_mega_moe(x, index, weights, w1, w2, g)
    second = run_mega_moe(x, index, weights, w1, w2, g)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical calls"
    assert rel_err(first[0], oracle_with_grads(x, index, weights, w1, w2, g)[0]) <= TOL[dtype]


# ---------------------------------------------------------------------------------------------------------------
# Routing plan (plain torch ops; fast)


def _random_ids(num_rows, top_k, num_experts, seed, pad_rows=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_rows)])
    if pad_rows:
        ids[-pad_rows:] = -1  # padding rows, as a receive buffer holds past its last valid row
    weights = torch.rand(num_rows, top_k, generator=gen)
    return ids, weights


def check_plan(ids, weights, base, num_local, tile_m):
    plan = build_routing_plan(ids, weights, expert_base=base, num_local_experts=num_local, tile_m=tile_m)
    rows, k = ids.shape
    local = ids.long() - base
    is_local = (local >= 0) & (local < num_local)
    counts = torch.bincount(local[is_local], minlength=num_local)
    total = int(counts.sum())

    assert plan.num_rows == rows and plan.top_k == k and plan.num_pairs == rows * k
    for t in (plan.expert_offsets, plan.row_src, plan.pair_pos, plan.tile_expert, plan.tile_row, plan.num_tiles):
        assert t.dtype == torch.int32
    assert plan.row_weight.dtype == torch.float32

    # Offsets: exclusive prefix sum of the per-expert counts.
    assert torch.equal(plan.counts.long(), counts)
    expected_offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    assert torch.equal(plan.expert_offsets.long(), expected_offsets)

    # pair_pos: a permutation of [0, total) on local pairs, -1 on the others.
    pos = plan.pair_pos.long()
    assert pos.shape == (rows, k)
    assert torch.equal(pos < 0, ~is_local)
    assert (pos[~is_local] == -1).all()
    assert torch.equal(pos[is_local].sort().values, torch.arange(total))

    # Each local pair's sorted row lies in its expert's range and points back at its source row and weight;
    # inside one expert the rows keep the pairs' order.
    src_row = torch.arange(rows).unsqueeze(1).expand(rows, k)
    p = pos[is_local]
    assert torch.equal(plan.row_src.long()[p], src_row[is_local])
    assert torch.equal(plan.row_weight[p], weights[is_local].float())
    e = local[is_local]
    assert ((plan.expert_offsets.long()[e] <= p) & (p < plan.expert_offsets.long()[e + 1])).all()
    for expert in range(num_local):  # boolean indexing keeps (row, slot) order, so p must increase within e
        assert (p[e == expert].diff() > 0).all(), f"rows of expert {expert} are not in pair order"

    # Tile list: ceil(count / tile_m) tiles per expert, in expert order, covering every sorted row exactly once.
    num_tiles = int(plan.num_tiles[0])
    assert num_tiles == int(((counts + tile_m - 1) // tile_m).sum())
    assert plan.max_tiles >= num_tiles
    covered = torch.zeros(total, dtype=torch.long)
    tile_exp = plan.tile_expert.long()[:num_tiles]
    assert (tile_exp.diff() >= 0).all()
    for i in range(num_tiles):
        exp, start = int(plan.tile_expert[i]), int(plan.tile_row[i])
        lo, hi = int(plan.expert_offsets[exp]), int(plan.expert_offsets[exp + 1])
        assert lo <= start < hi, f"tile {i} starts at {start}, outside expert {exp}'s rows [{lo}, {hi})"
        assert (start - lo) % tile_m == 0
        covered[start : min(start + tile_m, hi)] += 1
    assert (covered == 1).all(), "some sorted row is in no tile or in two"
    # Each expert's tiles (what the weight gradients walk): [expert_tiles[e], expert_tiles[e + 1]) of the list.
    tiles_per_expert = (counts + tile_m - 1) // tile_m
    expected_tiles = torch.cat([torch.zeros(1, dtype=torch.long), tiles_per_expert.cumsum(0)])
    assert torch.equal(plan.expert_tiles.long(), expected_tiles)
    for e_i in range(num_local):
        lo, hi = int(plan.expert_tiles[e_i]), int(plan.expert_tiles[e_i + 1])
        assert (tile_exp[lo:hi] == e_i).all()
    # Unused tile slots still name a valid expert (kernels may read them before checking num_tiles).
    assert ((plan.tile_expert >= 0) & (plan.tile_expert < num_local)).all()
    return plan


@pytest.mark.parametrize("index_dtype, weight_dtype", [(torch.int64, torch.bfloat16), (torch.int32, torch.float32)])
def test_fill_copies_the_routing_it_reads(index_dtype, weight_dtype):
    # A rank's own fill also writes its routing for the peers (ids as int32, weights as fp32): exactly the caller's
    # values, padding ids (-1) included, and the plan is the one a fill without the copy writes. Two segments, the
    # fill of the second alone (as a rank plans its own block), over several chunks.
    rows, k, num_local, chunk = 300, 4, 6, 256
    ids, weights = _random_ids(2 * rows, k, 12, seed=21, pad_rows=17)
    ids, weights = ids.to(index_dtype), weights.to(weight_dtype)
    own_ids, own_weights = ids[rows:], weights[rows:]
    plans = [
        allocate_routing_plan(
            2 * rows, k, num_local_experts=num_local, tile_m=4, device=torch.device("cpu"), num_segments=2
        )
        for _ in range(2)
    ]
    out_ids = torch.full((rows, k), 99, dtype=torch.int32)
    out_weights = torch.full((rows, k), float("nan"))
    fill_routing_plan(
        plans[0], own_ids, own_weights, expert_base=6, first_segment=1, chunk=chunk, copy_to=(out_ids, out_weights)
    )
    fill_routing_plan(plans[1], own_ids, own_weights, expert_base=6, first_segment=1, chunk=chunk)
    assert torch.equal(out_ids, own_ids.to(torch.int32)) and (out_ids[-17:] == -1).all()
    assert torch.equal(out_weights, own_weights.float())
    pos = plans[0].pair_pos[rows:]
    assert torch.equal(pos, plans[1].pair_pos[rows:]) and (pos >= 0).any()
    for name in ("row_src", "row_weight"):
        assert torch.equal(getattr(plans[0], name)[pos[pos >= 0].long()], getattr(plans[1], name)[pos[pos >= 0].long()])
    assert torch.equal(plans[0].expert_offsets[num_local + 1 :], plans[1].expert_offsets[num_local + 1 :])


@pytest.mark.parametrize(
    "rows, k, num_local, segments, base, chunk",
    [
        (700, 3, 8, 1, 0, 256),  # 2100 pairs: nine chunks of 256, a ragged last one
        (600, 4, 3, 2, 2, 512),  # two segments of 300 rows; most experts elsewhere
        (40, 2, 4, 1, 4, 1024),  # nothing local: everything in the elsewhere key
        (0, 2, 4, 1, 0, 1024),  # no pairs at all
    ],
)
def test_counting_sort_matches_stable_sort(rows, k, num_local, segments, base, chunk):
    # The plan's counting sort (keys and per-chunk counts, then a program per chunk sorting its keys and placing them)
    # against torch's stable sort of the same keys, over several chunks and segments, ragged experts (a hot one,
    # empty ones) and padding rows: every sorted row, weight and pair position exactly.
    ids, weights = (
        _random_ids(rows, k, 8, seed=rows + k, pad_rows=7)
        if rows
        else (torch.empty(0, k, dtype=torch.long), torch.empty(0, k))
    )
    if rows:
        ids[: rows // 2, 0] = base  # the first local expert takes one slot of half the rows
    ids[ids == base + 1] = -1  # the second local expert gets nothing
    plan = allocate_routing_plan(
        rows, k, num_local_experts=num_local, tile_m=4, device=torch.device("cpu"), num_segments=segments
    )
    fill_routing_plan(plan, ids, weights, expert_base=base, chunk=chunk)
    seg_pairs = max(rows // segments * k, 1)
    keys, hist, bins = routing_keys(
        ids,
        torch.zeros(segments * num_local, dtype=torch.int32),
        segment_pairs=seg_pairs,
        expert_base=base,
        num_local_experts=num_local,
        chunk=chunk,
    )
    local = ids.reshape(-1).long() - base
    segment = torch.arange(rows * k) // seg_pairs
    skip = segments * num_local
    expected_keys = torch.where((local >= 0) & (local < num_local), segment * num_local + local, skip)
    assert torch.equal(keys.long(), expected_keys)
    assert hist.shape == (max(-(-rows * k // chunk), 1) * bins,) and bins > skip + 1
    counts = torch.bincount(expected_keys, minlength=skip + 1)[:-1]
    assert torch.equal(plan.counts.long(), counts)
    # Reference: stable sort by key; segment s's local pairs fill sorted rows [s * P, ...) in that order.
    order = torch.sort(expected_keys, stable=True).indices
    seg_starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.view(segments, num_local).sum(1).cumsum(0)])
    expected_pos = torch.full((rows * k,), -1, dtype=torch.long)
    for place, pair in enumerate(order.tolist()):
        key = int(expected_keys[pair])
        if key < skip:
            s = key // num_local
            expected_pos[pair] = s * seg_pairs + place - int(seg_starts[s])
    assert torch.equal(plan.pair_pos.reshape(-1).long(), expected_pos)
    placed = expected_pos >= 0
    pairs = torch.arange(rows * k)
    assert torch.equal(plan.row_src.long()[expected_pos[placed]], pairs[placed] // k)
    assert torch.equal(plan.row_weight[expected_pos[placed]], weights.reshape(-1)[placed].float())
    offsets = plan.expert_offsets.long().view(segments, num_local + 1)
    expert_tiles = plan.expert_tiles.long().view(segments, num_local + 1)
    for s in range(segments):
        expected = s * seg_pairs + torch.cat(
            [torch.zeros(1, dtype=torch.long), counts.view(segments, num_local)[s].cumsum(0)]
        )
        assert torch.equal(offsets[s], expected)
        tiles = (counts.view(segments, num_local)[s] + plan.tile_m - 1) // plan.tile_m
        assert torch.equal(expert_tiles[s], torch.cat([torch.zeros(1, dtype=torch.long), tiles.cumsum(0)]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("segments, num_local, base", [(1, 128, 0), (2, 64, 64)], ids=["ep1", "two_segments"])
def test_counting_sort_matches_stable_sort_on_gpu(segments, num_local, base):
    """The compiled placement at the layer's scale (16,384 rows x 8 slots: 128 chunks of 1,024 pairs; a hot expert, a
    padded tail) against torch's stable sort of the same keys: every pair position, sorted row and weight."""
    rows, k = 16384, 8
    gen = torch.Generator().manual_seed(segments)
    ids = torch.multinomial(torch.ones(rows, 128), k, generator=gen)
    ids[: rows // 3, 0] = base + 5
    ids[-9:] = -1
    weights = torch.rand(rows, k, generator=gen)
    ids, weights = ids.cuda(), weights.cuda()
    plan = allocate_routing_plan(
        rows, k, num_local_experts=num_local, tile_m=128, device=ids.device, num_segments=segments
    )
    fill_routing_plan(plan, ids, weights, expert_base=base)
    seg_pairs = rows // segments * k
    local = ids.reshape(-1).long() - base
    segment = torch.arange(rows * k, device="cuda") // seg_pairs
    skip = segments * num_local
    keys = torch.where((local >= 0) & (local < num_local), segment * num_local + local, skip)
    order = torch.sort(keys, stable=True).indices
    counts = torch.bincount(keys, minlength=skip + 1)[:skip]
    seg_starts = torch.cat([counts.new_zeros(1), counts.view(segments, num_local).sum(1).cumsum(0)])
    sorted_keys = keys[order]
    place = torch.arange(rows * k, device="cuda")
    seg = (sorted_keys // num_local).clamp(max=segments - 1)
    expected_pos = torch.full((rows * k,), -1, dtype=torch.long, device="cuda")
    placed_sorted = sorted_keys < skip
    expected_pos[order[placed_sorted]] = (seg * seg_pairs + place - seg_starts[seg])[placed_sorted]
    assert torch.equal(plan.pair_pos.reshape(-1).long(), expected_pos)
    placed = expected_pos >= 0
    assert torch.equal(plan.row_src.long()[expected_pos[placed]], torch.arange(rows * k, device="cuda")[placed] // k)
    assert torch.equal(plan.row_weight[expected_pos[placed]], weights.reshape(-1)[placed].float())
    tiles = (counts.view(segments, num_local) + 127) // 128
    expected_tiles = torch.cat([tiles.new_zeros(segments, 1), tiles.cumsum(1)], 1)
    assert torch.equal(plan.expert_tiles.long().view(segments, num_local + 1), expected_tiles)


@pytest.mark.parametrize("tile_m", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_routing_plan_single_rank(seed, tile_m):
    ids, weights = _random_ids(37, 3, 8, seed)
    ids[ids == 5] = 6 if seed else 4  # expert 5 gets no rows; a row may now name one expert twice, which is allowed
    check_plan(ids, weights, base=0, num_local=8, tile_m=tile_m)


@pytest.mark.parametrize("base, num_local", [(0, 2), (2, 3), (6, 2)])
def test_routing_plan_expert_slice(base, num_local):
    # One rank's slice of the experts, with padding rows (-1) at the end: only local pairs are planned.
    ids, weights = _random_ids(29, 4, 8, seed=base + 10, pad_rows=5)
    plan = check_plan(ids, weights, base=base, num_local=num_local, tile_m=4)
    assert (plan.pair_pos[-5:] == -1).all()


def test_routing_plan_ragged():
    idx, w = ragged_routing(40, 8, 2, seed=4, hot_fraction=0.9)
    plan = check_plan(idx, w, base=0, num_local=8, tile_m=16)
    counts = plan.expert_offsets.diff()
    assert counts[0] == 0 and counts[1] > 16  # the empty expert has no tile, the hot one more than one
    assert not (plan.tile_expert[: int(plan.num_tiles[0])] == 0).any()


def test_routing_plan_nothing_local():
    ids, weights = _random_ids(10, 2, 4, seed=3)
    plan = check_plan(ids, weights, base=4, num_local=4, tile_m=16)
    assert int(plan.num_tiles[0]) == 0
    assert (plan.pair_pos == -1).all()
    assert (plan.expert_offsets == 0).all()


def test_routing_plan_single_row():
    ids = torch.tensor([[3, 0, 2]])
    weights = torch.tensor([[0.5, 0.3, 0.2]])
    plan = check_plan(ids, weights, base=0, num_local=4, tile_m=16)
    assert plan.pair_pos.tolist() == [[2, 0, 1]]
    assert plan.expert_offsets.tolist() == [0, 1, 1, 2, 3]
    assert plan.row_weight[:3].tolist() == pytest.approx([0.3, 0.2, 0.5])


def _segmented_case(segments, base, rows=9, k=3):
    ids, weights = _random_ids(rows * segments, k, 8, seed=segments * 10 + base, pad_rows=rows)
    ids[:rows, 0] = base  # segment 0: the first local expert takes one slot of every row
    return ids, weights


def _assert_segments_planned_alone(plan, ids, weights, base, num_local, tile_m, rows, k):
    # Segment s's view must be the plan of its rows alone, placed at sorted row s * rows * k.
    for s in range(plan.num_segments):
        seg_base = s * rows * k
        view = plan.segment(s)
        alone = build_routing_plan(
            ids[s * rows : (s + 1) * rows],
            weights[s * rows : (s + 1) * rows],
            expert_base=base,
            num_local_experts=num_local,
            tile_m=tile_m,
        )
        count = int(alone.expert_offsets[-1])
        assert int(view.expert_offsets[0]) == seg_base
        assert torch.equal(view.expert_offsets - seg_base, alone.expert_offsets)
        n = int(view.num_tiles[0])
        assert n == int(alone.num_tiles[0]) and view.max_tiles == alone.max_tiles
        assert torch.equal(view.tile_expert[:n], alone.tile_expert[:n])
        assert torch.equal(view.tile_row[:n] - seg_base, alone.tile_row[:n])
        assert ((view.tile_expert >= 0) & (view.tile_expert < num_local)).all()
        assert torch.equal(plan.row_src[seg_base : seg_base + count] - s * rows, alone.row_src[:count])
        assert torch.equal(plan.row_weight[seg_base : seg_base + count], alone.row_weight[:count])
        assert torch.equal(torch.where(view.pair_pos >= 0, view.pair_pos - seg_base, -1), alone.pair_pos)
        assert torch.equal(plan.counts[s * num_local : (s + 1) * num_local], alone.counts)
        assert view.sorted_rows == plan.num_pairs and view.num_pairs == rows * k


@pytest.mark.parametrize("segments, base, num_local", [(2, 2, 3), (4, 0, 2), (3, 4, 4)])
def test_segmented_plan_is_each_segment_planned_alone(segments, base, num_local):
    # Expert parallelism plans all source ranks' blocks, segment-major, each at fixed sorted rows. The last block is
    # all padding (a rank with no tokens), another block routes most pairs to one expert.
    rows, k, tile_m = 9, 3, 4
    ids, weights = _segmented_case(segments, base, rows, k)
    plan = build_routing_plan(
        ids, weights, expert_base=base, num_local_experts=num_local, tile_m=tile_m, num_segments=segments
    )
    assert plan.expert_offsets.shape == (segments * (num_local + 1),) and plan.num_tiles.shape == (segments,)
    _assert_segments_planned_alone(plan, ids, weights, base, num_local, tile_m, rows, k)
    assert int(plan.num_tiles[-1]) == 0  # the padding block has nothing to compute


@pytest.mark.parametrize("segments, own", [(2, 1), (4, 2), (3, 0)])
def test_segments_filled_one_launch_at_a_time_give_the_same_plan(segments, own):
    # The EP forward plans its own block first, then the peers below it and above it in one launch each.
    rows, k, tile_m, base, num_local = 9, 3, 4, 2, 3
    ids, weights = _segmented_case(segments, base, rows, k)
    plan = allocate_routing_plan(
        rows * segments,
        k,
        num_local_experts=num_local,
        tile_m=tile_m,
        device=ids.device,
        num_segments=segments,
        split_expert=1,
    )
    parts = [(own, 1), (0, own), (own + 1, segments - own - 1)]
    for first, count in parts:
        if count:
            sl = slice(first * rows, (first + count) * rows)
            fill_routing_plan(plan, ids[sl], weights[sl], expert_base=base, first_segment=first)
    whole = build_routing_plan(
        ids,
        weights,
        expert_base=base,
        num_local_experts=num_local,
        tile_m=tile_m,
        num_segments=segments,
        split_expert=1,
    )
    for name in ("expert_offsets", "pair_pos", "num_tiles", "counts", "half_num_tiles"):
        assert torch.equal(getattr(plan, name), getattr(whole, name)), name
    _assert_segments_planned_alone(plan, ids, weights, base, num_local, tile_m, rows, k)
    with pytest.raises(ValueError, match="whole segments"):
        fill_routing_plan(plan, ids[: rows + 1], weights[: rows + 1], expert_base=base)


@pytest.mark.parametrize("segments, num_local, split", [(2, 4, 2), (3, 3, 1), (2, 4, 0), (2, 4, 4)])
def test_expert_halves_split_each_segments_tiles(segments, num_local, split):
    # The EP pipeline computes its own block in two expert halves: the halves' tiles must be exactly the segment's
    # tiles, the lower experts' ones first in the segment's own list, the upper ones compacted in the half list.
    # Padding blocks, an empty half (split 0 or E_local) and one expert taking most pairs are all covered.
    rows, k, tile_m = 11, 3, 4
    ids, weights = _random_ids(rows * segments, k, num_local, seed=segments + split, pad_rows=rows)
    ids[:rows, 0] = num_local - 1  # the last expert takes a slot of every row of segment 0
    plan = build_routing_plan(
        ids,
        weights,
        expert_base=0,
        num_local_experts=num_local,
        tile_m=tile_m,
        num_segments=segments,
        split_expert=split,
    )
    for s in range(segments):
        whole = plan.segment(s)
        n = int(whole.num_tiles[0])
        tiles = list(zip(whole.tile_expert[:n].tolist(), whole.tile_row[:n].tolist()))
        low, high = plan.segment(s, 0), plan.segment(s, 1)
        n_low, n_high = int(low.num_tiles[0]), int(high.num_tiles[0])
        got_low = list(zip(low.tile_expert[:n_low].tolist(), low.tile_row[:n_low].tolist()))
        got_high = list(zip(high.tile_expert[:n_high].tolist(), high.tile_row[:n_high].tolist()))
        assert got_low == [t for t in tiles if t[0] < split]
        assert got_high == [t for t in tiles if t[0] >= split]
        assert torch.equal(low.expert_offsets, whole.expert_offsets) and torch.equal(high.pair_pos, whole.pair_pos)
    with pytest.raises(ValueError, match="split_expert"):
        build_routing_plan(ids, weights, expert_base=0, num_local_experts=num_local, tile_m=tile_m).segment(0, 1)


@pytest.mark.parametrize("gather_a", [False, True])
@pytest.mark.parametrize("use_tma", [False, True])
def test_weight_gradient_reduces_every_segment(gather_a, use_tma):
    # dW[e] = sum over segments, then rows, of A^T B: the wgrad kernel walks expert e's rows segment by segment
    # (BLOCK_K rows a step, the last step moved back to end at the expert's last row, or one masked step for fewer
    # rows), the sorted operand read through pointers or a tensor descriptor. Several whole chunks per expert,
    # partial ones, an expert with fewer rows than a step, an expert with no rows (zeros) and an all-padding segment.
    # Sorted rows no plan wrote hold NaN: no step may read them.
    block_k = grouped_wgrad_kernel.configs[0].kwargs["BLOCK_K"]
    rows, k, num_local, segments, m, n = 5 * block_k // 2, 2, 4, 3, 24, 20
    ids, weights = _random_ids(rows * segments, k, num_local, seed=5, pad_rows=rows)
    ids[ids == 3] = 1  # expert 3 gets nothing
    twos = ids[:rows] == 2
    ids[:rows][twos & (twos.flatten().cumsum(0).view_as(twos) > 3)] = -1  # expert 2: three rows in segment 0
    plan = build_routing_plan(ids, weights, expert_base=0, num_local_experts=num_local, tile_m=4, num_segments=segments)
    per_segment = plan.expert_offsets.view(segments, num_local + 1).diff(dim=1)
    assert (per_segment >= 2 * block_k).any() and ((per_segment % block_k) != 0).any()  # whole and partial chunks
    assert ((per_segment > 0) & (per_segment < block_k)).any()  # an expert with fewer rows than one step
    gen = torch.Generator().manual_seed(6)
    sorted_op = torch.randn(plan.sorted_rows, m if not gather_a else n, generator=gen)
    written = torch.zeros(plan.sorted_rows, dtype=torch.bool)
    written[plan.pair_pos[plan.pair_pos >= 0].long()] = True
    sorted_op[~written] = float("nan")
    src = torch.randn(rows * segments, n if not gather_a else m, generator=gen)
    a, b = (src, sorted_op) if gather_a else (sorted_op, src)
    got = grouped_wgrad(
        a,
        b,
        plan,
        torch.full((num_local, m, n), float("nan")),
        gather_a=gather_a,
        gather_b=not gather_a,
        use_tma=use_tma,
    )
    pos = plan.pair_pos.long()
    want = torch.zeros(num_local, m, n, dtype=torch.float64)
    for r in range(rows * segments):
        for j in range(k):
            e = int(ids[r, j])
            if e < 0:
                continue
            sorted_row = sorted_op[pos[r, j]].double()
            lhs, rhs = (src[r].double(), sorted_row) if gather_a else (sorted_row, src[r].double())
            want[e] += lhs[:, None] * rhs[None, :]
    assert torch.equal(got[3], torch.zeros(m, n))
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("gather", [False, True])
def test_grouped_gemm_tma_reads_match_pointer_reads(transpose_b, gather):
    # The grouped GEMM with B (and A when it is not gathered) read by TMA boxes must give what pointer loads give:
    # boxes run past an expert's last row (into the next expert's rows) and past K and N (into the next expert's
    # weights or zeros). Ragged routing (an expert with no rows, one with most), K and N not multiples of a block.
    rows, k, num_local, kdim, n = 37, 2, 4, 40, 24
    ids, weights = _random_ids(rows, k, num_local, seed=8)
    ids[ids == 2] = 0  # expert 2 gets nothing, expert 0 most
    plan = build_routing_plan(ids, weights, expert_base=0, num_local_experts=num_local, tile_m=tuning.tile_m())
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(rows if gather else plan.sorted_rows, kdim, generator=gen)
    w = torch.randn(num_local, *((n, kdim) if transpose_b else (kdim, n)), generator=gen)
    got = {
        tma: grouped_gemm(a, w, plan, transpose_b=transpose_b, gather=gather, row_scale=plan.row_weight, use_tma=tma)
        for tma in (False, True)
    }
    # The interpreter's dots run on the host's BLAS, whose kernels for a TMA box and a masked pointer tile of other
    # shapes may round the last bit differently on some CPUs; on a GPU both reads feed the same MMAs.
    torch.testing.assert_close(got[True][: plan.num_pairs], got[False][: plan.num_pairs], rtol=1e-5, atol=1e-5)
    src, off = plan.row_src.long(), plan.expert_offsets.tolist()
    for e in range(num_local):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        lhs = (a[src[lo:hi]] if gather else a[lo:hi]).double()
        rhs = (w[e].T if transpose_b else w[e]).double()
        want = plan.row_weight[lo:hi].double()[:, None] * (lhs @ rhs)
        assert rel_err(got[True][lo:hi], want) < 1e-6
    assert off[3] - off[2] == 0 and off[1] - off[0] > plan.num_pairs // 3


def test_fc2_dgrad_swiglu_backward_per_segment_piece():
    # The FC2 dgrad GEMM and the SwiGLU backward row pass, run piece by piece as the expert-parallel backward does
    # (each segment's expert halves into shared buffers), against float64: dh, aw = w * a and the per-row top-k weight
    # gradient <dy W2, a>. Ragged: an expert with no rows, an all-padding segment, I not a multiple of the column
    # block.
    rows, k, num_local, segments, hidden, inter = 29, 2, 4, 3, 24, 20
    ids, weights = _random_ids(rows * segments, k, num_local, seed=7, pad_rows=rows)
    ids[ids == 2] = 0  # expert 2 gets nothing
    plan = build_routing_plan(
        ids,
        weights,
        expert_base=0,
        num_local_experts=num_local,
        tile_m=tuning.tile_m(),
        num_segments=segments,
        split_expert=num_local // 2,
    )
    gen = torch.Generator().manual_seed(8)
    dy = torch.randn(rows * segments, hidden, generator=gen)
    w2 = torch.randn(num_local, hidden, inter, generator=gen)
    h = torch.randn(plan.sorted_rows, 2 * inter, generator=gen)
    buffers = dswiglu_buffers(dy, w2, plan)
    for s in range(segments):
        for half in (0, 1):
            fc2_dgrad_dswiglu(dy, w2, h, plan.segment(s, half), out=buffers)
    _, dh, aw, dw_row = buffers
    pos = plan.pair_pos.long()
    used = pos[pos >= 0]
    src_of = torch.full((plan.sorted_rows,), -1, dtype=torch.long)
    expert_of = torch.full((plan.sorted_rows,), -1, dtype=torch.long)
    for r in range(rows * segments):
        for j in range(k):
            if ids[r, j] >= 0:
                src_of[pos[r, j]], expert_of[pos[r, j]] = r, int(ids[r, j])
    g, u = h[used, :inter].double(), h[used, inter:].double()
    w = plan.row_weight[used].double()[:, None]
    g_a = torch.einsum("rh,rhi->ri", dy[src_of[used]].double(), w2[expert_of[used]].double())
    sig = torch.sigmoid(g)
    act = g * sig * u
    want_dh = torch.cat([w * g_a * u * (sig + g * sig * (1 - sig)), w * g_a * g * sig], dim=1)
    assert rel_err(dh[used], want_dh) < 1e-6
    assert rel_err(aw[used], w * act) < 1e-6
    assert rel_err(dw_row[used], (g_a * act).sum(1)) < 1e-6


@pytest.mark.parametrize("world, cols, dtype", [(1, 5, torch.float32), (2, 70, torch.bfloat16), (4, 8, torch.float32)])
def test_sum_blocks_is_the_rank_order_fp32_sum(world, cols, dtype):
    gen = torch.Generator().manual_seed(world)
    blocks = torch.randn(world, 11, cols, generator=gen).to(dtype)
    got = sum_blocks(blocks, 9, dtype)
    acc = blocks[0, :9].float()
    for s in range(1, world):
        acc = acc + blocks[s, :9].float()
    assert torch.equal(got, to_kernel_dtype(acc, dtype))
    assert sum_blocks(blocks, 0, dtype).shape == (0, cols)


# ---------------------------------------------------------------------------------------------------------------
# combine_rows (one small kernel; interpreter)


def to_kernel_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> ``dtype`` the way a Triton store converts: round to nearest even on a GPU; the interpreter
    truncates fp32 -> bf16 (it keeps bf16 as raw 16-bit integers and drops the low half)."""
    if dtype == torch.bfloat16 and interpreting():
        return (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x.to(dtype)


def combine_reference(src, pair_pos, out_dtype):
    out = torch.zeros(pair_pos.shape[0], src.shape[1], dtype=torch.float32)
    for j in range(pair_pos.shape[1]):  # slot order, fp32 sum: the order the kernel promises
        p = pair_pos[:, j].long()
        valid = p >= 0
        out[valid] += src[p[valid]].float()
    return to_kernel_dtype(out, out_dtype)


@pytest.mark.parametrize(
    "rows, top_k, hidden, src_dtype, out_dtype",
    [
        (9, 2, 40, torch.float32, torch.float32),
        (7, 3, 100, torch.bfloat16, torch.bfloat16),  # more than one column block
        (5, 1, 24, torch.float32, torch.bfloat16),
        (6, 4, 16, torch.bfloat16, torch.float32),
        (37, 3, 100, torch.float32, torch.float32),  # row blocks too (the interpreter's 16 rows a program)
    ],
)
def test_combine_rows_matches_reference(rows, top_k, hidden, src_dtype, out_dtype):
    gen = torch.Generator().manual_seed(rows * 100 + top_k)
    num_src = rows * top_k + 3
    src = torch.randn(num_src, hidden, generator=gen).to(src_dtype)
    pair_pos = torch.randperm(num_src, generator=gen)[: rows * top_k].view(rows, top_k)
    drop = torch.rand(rows, top_k, generator=gen) < 0.3
    pair_pos = torch.where(drop, -1, pair_pos)
    pair_pos[1] = -1  # a row with no local slot
    pair_pos = pair_pos.to(torch.int32)
    out = combine_rows(src, pair_pos, out_dtype)
    assert out.dtype == out_dtype and out.shape == (rows, hidden)
    ref = combine_reference(src, pair_pos, out_dtype)
    assert torch.equal(out, ref), f"max difference {(out.float() - ref.float()).abs().max():.3e}"
    # Whatever the rounding, the result is within one unit in the last place of the exact fp32 sum.
    exact = combine_reference(src, pair_pos, torch.float32)
    torch.testing.assert_close(out.float(), exact, rtol=2 * torch.finfo(out_dtype).eps, atol=0)
    assert (out[1] == 0).all()


def test_combine_rows_strided_source_and_no_rows():
    # A source that is a column slice of a wider buffer (row stride != hidden).
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(12, 50, generator=gen)
    src = wide[:, :30]
    pair_pos = torch.tensor([[0, 5], [-1, 11], [-1, -1], [3, 2]], dtype=torch.int32)
    out = combine_rows(src, pair_pos, torch.float32)
    assert torch.equal(out, combine_reference(src.contiguous(), pair_pos, torch.float32))
    empty = combine_rows(src, pair_pos[:0], torch.float32)
    assert empty.shape == (0, 30)


@pytest.mark.parametrize("top_k, pair_dtype", [(3, torch.float32), (4, torch.bfloat16), (1, torch.float32)])
def test_combine_rows_pair_values_in_the_same_launch(top_k, pair_dtype):
    # The backward's combine also returns each pair's value (the top-k weight gradient): equal to
    # RoutingPlan.pair_values, zero for slots whose expert is elsewhere and for a row with no local slot.
    gen = torch.Generator().manual_seed(40 + top_k)
    rows, hidden = 7, 24
    num_src = rows * top_k + 2
    src = torch.randn(num_src, hidden, generator=gen)
    values = torch.randn(num_src, generator=gen)
    pair_pos = torch.randperm(num_src, generator=gen)[: rows * top_k].view(rows, top_k)
    pair_pos = torch.where(torch.rand(rows, top_k, generator=gen) < 0.3, -1, pair_pos)
    pair_pos[2] = -1
    pair_pos = pair_pos.to(torch.int32)
    pair_out = torch.full((rows, top_k), 7.0, dtype=pair_dtype)  # every entry must be overwritten
    out = combine_rows(src, pair_pos, torch.float32, pair_src=values, pair_out=pair_out)
    assert torch.equal(out, combine_reference(src, pair_pos, torch.float32))
    pos = pair_pos.long()
    expected = torch.where(pos >= 0, values[pos.clamp(min=0)], 0.0)
    assert torch.equal(pair_out, to_kernel_dtype(expected, pair_dtype))
    assert (pair_out[2] == 0).all()


@pytest.mark.parametrize("block_r, block_h", [(1, 1024), (1, 32), (16, 64), (4, 128)])
def test_combine_rows_kernel_blocks_give_the_same_bits(block_r, block_h):
    # The GPU's launch (a row a program) and the interpreter's (16 rows) are one kernel at two block shapes: every
    # shape gives the reference's bits, pair values included, where rows and columns end inside a block.
    from prime_megamoe.kernels.combine import combine_rows_kernel

    gen = torch.Generator().manual_seed(block_r * 7 + block_h)
    rows, top_k, hidden = 21, 3, 72
    num_src = rows * top_k + 4
    src = torch.randn(num_src, hidden, generator=gen).to(torch.bfloat16)
    values = torch.randn(num_src, generator=gen)
    pair_pos = torch.randperm(num_src, generator=gen)[: rows * top_k].view(rows, top_k)
    pair_pos = torch.where(torch.rand(rows, top_k, generator=gen) < 0.3, -1, pair_pos).to(torch.int32)
    out = torch.full((rows, hidden), 3.0, dtype=torch.bfloat16)
    pair_out = torch.full((rows, top_k), 7.0)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(hidden, block_h))
    combine_rows_kernel[grid](
        src, pair_pos, out, values, pair_out, rows, hidden, src.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_R=block_r, BLOCK_H=block_h, PAIR_VALUES=True, K_BLOCK=4,
    )  # fmt: skip
    assert torch.equal(out, combine_reference(src, pair_pos, torch.bfloat16))
    pos = pair_pos.long()
    assert torch.equal(pair_out, torch.where(pos >= 0, values[pos.clamp(min=0)], 0.0))


def test_combine_rows_pair_values_arguments_checked():
    src, pair_pos = torch.randn(4, 8), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="together"):
        combine_rows(src, pair_pos, torch.float32, pair_src=torch.zeros(4))
    with pytest.raises(ValueError, match=r"contiguous \[2, 2\]"):
        combine_rows(src, pair_pos, torch.float32, pair_src=torch.zeros(4), pair_out=torch.zeros(2, 3))


# (8 examples: ~5 s each on the CPU interpreter; the fixed-shape plan tests above cover the named edge cases.)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 40),
    top_k=st.integers(1, 4),
    num_experts=st.integers(4, 12),
    world=st.sampled_from([1, 2, 4]),
    tile_m=st.sampled_from([1, 2, 8, 16]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_routing_plan_properties(rows, top_k, num_experts, world, tile_m, seed, data):
    # Any shape, any slice of the experts, padding rows: the invariants of check_plan hold.
    num_experts -= num_experts % world
    top_k = min(top_k, num_experts)
    num_local = num_experts // world
    rank = data.draw(st.integers(0, world - 1))
    pad = data.draw(st.integers(0, rows - 1))
    ids, weights = _random_ids(rows, top_k, num_experts, seed, pad_rows=pad)
    check_plan(ids, weights, base=rank * num_local, num_local=num_local, tile_m=tile_m)


def test_small_problems_skip_autotuning(monkeypatch):
    from prime_megamoe.kernels.tuning import SMALL_PROBLEM, prune_candidates

    prune = prune_candidates("N", "K", "M_BUCKET")
    configs = [triton.Config({"BLOCK_M": bm}) for bm in (128, 64, 16)]
    assert prune(configs, {"N": 32, "K": 64, "M_BUCKET": 64}) == configs[:1]  # a tiny model: no candidate timing
    assert prune(configs, {"N": 768, "K": 2048, "M_BUCKET": 131072}) == configs  # Qwen3-30B-A3B: all candidates
    assert prune(configs, {"N": 1, "K": 1, "M_BUCKET": SMALL_PROBLEM}) == configs
    monkeypatch.setenv("PRIME_MEGAMOE_AUTOTUNE", "0")  # checks: never time candidates
    assert prune(configs, {"N": 768, "K": 2048, "M_BUCKET": 131072}) == configs[:1]


def test_candidates_take_row_blocks_that_divide_the_launchs_row_tile():
    from prime_megamoe.kernels.tuning import SMALL_PROBLEM, prune_candidates

    prune = prune_candidates("N", "K", "M_BUCKET")
    configs = [triton.Config({"BLOCK_M": bm}) for bm in (128, 64, 16)]
    big = {"N": 1, "K": 1, "M_BUCKET": SMALL_PROBLEM}
    assert prune(configs, big, TILE_M=128) == configs
    assert prune(configs, big, TILE_M=64) == configs[1:]
    assert prune(configs, {"N": 1, "K": 1, "M_BUCKET": 1}, TILE_M=16) == configs[2:]  # small: the first that fits
    with pytest.raises(ValueError, match="divides the row tile 8"):
        prune(configs, big, TILE_M=8)


@pytest.mark.skipif(not interpreting(), reason="the interpreter's candidates")
def test_interpreted_tile_kernels_run_one_program_a_row_tile():
    # Under the interpreter, a 128-row plan (the quantised layers', whose bf16 backward runs these kernels) gets
    # 128-row programs and a 16-row plan 16-row ones: the first candidate whose BLOCK_M divides the tile.
    from prime_megamoe.kernels.grouped_gemm import fc1_swiglu_kernel, grouped_gemm_kernel
    from prime_megamoe.kernels.tuning import QTILE_M, prune_candidates, tile_m

    for kernel in (fc1_swiglu_kernel, grouped_gemm_kernel):
        prune = prune_candidates("N", "K", "M_BUCKET")
        size = {"N": 32, "K": 32, "M_BUCKET": 64}
        for tile in (QTILE_M, tile_m()):
            (chosen,) = prune(kernel.configs, size, TILE_M=tile)
            assert chosen.kwargs["BLOCK_M"] == tile
        assert "TILE_M" in kernel.keys  # the choice is remembered per row tile
