"""The pool of one-segment routing plans (``routing_plan.lease_routing_plan``): a leased plan is the plan
``build_routing_plan`` makes, a dropped lease's plan is refilled by the next lease of its sizes (counts emptied first),
a plan still leased (held by an autograd graph) is never handed out again, and only the most recently used sizes keep
their free plans. The layer's forward and backward through the pool: ``test_mega_moe_kernels.py`` and
``test_fp8_experts.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from prime_megamoe import fused_experts
from prime_megamoe.ops import routing_plan as rp
from prime_megamoe.ops.routing_plan import build_routing_plan, lease_routing_plan

from .oracle import make_problem


def make_routing(rows: int, top_k: int, num_experts: int, seed: int, *, crowd: int | None = None):
    """Random distinct ids per row; ``crowd``: most pairs go to that expert (one expert with most rows)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(rows)])
    if crowd is not None:
        ids[: rows * 3 // 4, 0] = crowd
        ids[: rows * 3 // 4, 1:] = torch.where(
            ids[: rows * 3 // 4, 1:] == crowd, (crowd + 1) % num_experts, ids[: rows * 3 // 4, 1:]
        )
    return ids.to(torch.int64), torch.rand(rows, top_k, generator=gen)


def assert_same_plan(a, b):
    """Every part a kernel reads: the counts, offsets, pair positions and tile list in use, the sorted rows."""
    assert torch.equal(a.counts, b.counts)
    assert torch.equal(a.expert_offsets, b.expert_offsets)
    assert torch.equal(a.pair_pos, b.pair_pos)
    assert torch.equal(a.num_tiles, b.num_tiles)
    tiles = int(a.num_tiles[0])
    assert torch.equal(a.tile_expert[:tiles], b.tile_expert[:tiles])
    assert torch.equal(a.tile_row[:tiles], b.tile_row[:tiles])
    pairs = int(a.expert_offsets[-1])
    assert torch.equal(a.row_src[:pairs], b.row_src[:pairs])
    assert torch.equal(a.row_weight[:pairs], b.row_weight[:pairs])


@pytest.fixture(autouse=True)
def empty_pools():
    rp._PLAN_POOLS.clear()
    yield
    rp._PLAN_POOLS.clear()


def test_a_leased_plan_is_the_built_plan_and_a_dropped_one_is_refilled():
    rows, k, experts = 40, 2, 6
    first = make_routing(rows, k, experts, seed=0)
    lease = lease_routing_plan(*first, expert_base=0, num_local_experts=experts, tile_m=4)
    assert_same_plan(lease.plan, build_routing_plan(*first, expert_base=0, num_local_experts=experts, tile_m=4))
    storage = lease.plan.row_src.data_ptr()
    del lease
    gc.collect()
    # Other routing (one expert with most pairs, one with none) into the same storage: the old counts are gone.
    second = make_routing(rows, k, experts, seed=1, crowd=2)
    second[0][second[0] == 5] = 4
    again = lease_routing_plan(*second, expert_base=0, num_local_experts=experts, tile_m=4)
    assert again.plan.row_src.data_ptr() == storage
    built = build_routing_plan(*second, expert_base=0, num_local_experts=experts, tile_m=4)
    assert int(built.counts[5]) == 0 and int(built.counts[2]) > rows // 2
    assert_same_plan(again.plan, built)


def test_a_plan_still_leased_is_not_handed_out_again():
    routing = make_routing(16, 2, 4, seed=2)
    held = lease_routing_plan(*routing, expert_base=0, num_local_experts=4, tile_m=4)
    other = lease_routing_plan(*make_routing(16, 2, 4, seed=3), expert_base=0, num_local_experts=4, tile_m=4)
    assert other.plan is not held.plan
    # The held plan still holds its own routing.
    assert_same_plan(held.plan, build_routing_plan(*routing, expert_base=0, num_local_experts=4, tile_m=4))


def test_a_rank_whose_rows_are_all_elsewhere_gets_an_empty_plan():
    ids, weights = make_routing(12, 2, 8, seed=4)
    lease = lease_routing_plan(ids, weights, expert_base=0, num_local_experts=8, tile_m=4)
    del lease
    gc.collect()
    again = lease_routing_plan(ids + 8, weights, expert_base=0, num_local_experts=8, tile_m=4)  # experts 8..15
    assert int(again.plan.counts.sum()) == 0 and int(again.plan.num_tiles[0]) == 0
    assert bool((again.plan.pair_pos == -1).all())


def test_only_the_most_recently_used_sizes_keep_their_free_plans():
    for rows in range(4, 4 + 2 * (rp.PLAN_POOL_SIZES + 2), 2):
        lease_routing_plan(*make_routing(rows, 1, 3, seed=rows), expert_base=0, num_local_experts=3, tile_m=4)
    gc.collect()
    assert len(rp._PLAN_POOLS) == rp.PLAN_POOL_SIZES
    kept_rows = sorted(key[0] for key in rp._PLAN_POOLS)
    assert kept_rows == list(range(4 + 2 * (2 + 0), 4 + 2 * (rp.PLAN_POOL_SIZES + 2), 2))
    assert all(len(pool) == 1 for pool in rp._PLAN_POOLS.values())


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_layer_returns_its_plan_after_a_no_grad_forward_and_after_the_backward(precision):
    # A forward without autograd (inference, the first forward under activation checkpointing) runs without the
    # autograd function and gives its plan back at once; a forward with autograd holds it until its graph is freed.
    # The two forwards give the same output.
    x, index, weights, w1, w2, grad_out = make_problem(24, 64, 32, 4, 2, torch.float32, seed=5, routing="ragged")

    def layer(*inputs):
        return fused_experts(*inputs, dispatch="mega_moe", precision=precision)

    def free_plans():
        gc.collect()
        return sum(len(pool) for pool in rp._PLAN_POOLS.values())

    with torch.no_grad():
        out_no_grad = layer(x, index, weights, w1, w2)
    assert out_no_grad.grad_fn is None and free_plans() == 1
    params = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    out = layer(params[0], index, *params[1:])
    assert free_plans() == 0  # held by the graph
    assert torch.equal(out.detach(), out_no_grad)
    out.backward(grad_out)
    del out
    assert free_plans() == 1
    assert all(p.grad is not None for p in params)
