"""The id range check that rides on the routing plan's kernels (``fill_routing_plan(check_ids_below=E)``,
``RoutingPlan.assert_ids_in_range``): what mega_moe asserts on the device without launches of its own. Out-of-range
ids in any position (past E, below -1, an int64 id that int32 would wrap into range) fail it, -1 (an empty slot)
does not, and the next fill of a pooled plan starts from a clean flag."""

from __future__ import annotations

import gc

import pytest
import torch

from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops import routing_plan as rp
from prime_megamoe.ops.expert_compute import routed_experts
from prime_megamoe.ops.quantized_experts import routed_experts_quantized
from prime_megamoe.ops.routing_plan import lease_routing_plan
from prime_megamoe.validation import expert_id_error

from .oracle import make_problem
from .test_routing_plan_pool import assert_same_plan, make_routing

E = 6


@pytest.fixture(autouse=True)
def empty_pools():
    rp._PLAN_POOLS.clear()
    yield
    rp._PLAN_POOLS.clear()


def lease(ids, weights, check=E):
    return lease_routing_plan(ids, weights, expert_base=0, num_local_experts=E, tile_m=4, check_ids_below=check)


@pytest.mark.parametrize(
    "bad_id, where",
    [(E, (0, 0)), (E + 100, (37, 1)), (-2, (20, 0)), (2**32, (5, 1)), (2**32 + 3, (39, 1))],
    ids=["E", "far_past", "below_-1", "int64_wraps_to_0", "int64_wraps_to_3"],
)
def test_an_id_out_of_range_fails_the_assertion(bad_id, where):
    ids, weights = make_routing(40, 2, E, seed=0)  # 80 pairs: several routing programs under the interpreter
    ids[where] = bad_id
    plan = lease(ids, weights).plan
    assert plan.id_check.tolist() == [1, 0]
    with pytest.raises(RuntimeError, match=r"outside \[0, 6\) that is not -1"):
        plan.assert_ids_in_range(E)


def test_ids_in_range_and_empty_slots_pass_and_the_plan_is_the_unchecked_one():
    ids, weights = make_routing(40, 2, E, seed=1)
    ids[3, 1] = -1  # an empty slot
    checked = lease(ids, weights)
    assert checked.plan.id_check.tolist() == [0, 1]
    checked.plan.assert_ids_in_range(E)
    unchecked = lease(ids, weights, check=None)
    assert unchecked.plan.id_check.tolist() == [0, 0]  # zeroed with the counts, not written without the check
    assert_same_plan(checked.plan, unchecked.plan)


def test_a_pooled_plan_refilled_after_a_bad_fill_starts_clean():
    ids, weights = make_routing(16, 2, E, seed=2)
    bad = ids.clone()
    bad[7, 0] = E
    first = lease(bad, weights)
    storage = first.plan.row_src.data_ptr()
    assert first.plan.id_check.tolist() == [1, 0]
    del first
    gc.collect()
    again = lease(ids, weights)
    assert again.plan.row_src.data_ptr() == storage  # the same plan, refilled
    assert again.plan.id_check.tolist() == [0, 1]
    assert expert_id_error(E) == "top_k_index holds an expert id outside [0, 6) that is not -1 (an empty slot)"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("grad", [False, True])
def test_the_layer_asserts_on_its_plan(precision, grad):
    x, index, weights, w1, w2, _ = make_problem(24, 64, 32, 4, 2, torch.float32, seed=3, routing="ragged")

    def layer(ids):
        kw = {"expert_base": 0, "tile_m": tile_m(), "check_ids": 4}
        with torch.set_grad_enabled(grad):
            if precision == "bf16":
                return routed_experts(x, ids, weights, w1, w2, **kw)
            return routed_experts_quantized(x, ids, weights, w1, w2, precision=precision, **kw)

    good = layer(index)
    if precision == "bf16":  # the check changes nothing else
        assert torch.equal(good, routed_experts(x, index, weights, w1, w2, expert_base=0, tile_m=tile_m()))
    bad = index.clone()
    bad[11, 1] = 4
    with pytest.raises(RuntimeError, match=r"outside \[0, 4\)"):
        layer(bad)


def test_no_rows_pass():
    # A call with no tokens still fills its (empty) plan: nothing out of range.
    plan = lease(torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2)).plan
    assert plan.id_check.tolist() == [0, 1]
    plan.assert_ids_in_range(E)
