"""The fused `mega_moe` backend with expert parallelism over gloo processes (EP = 2 and 4): outputs and all four
gradients against the float64 transformers oracle, ragged routing (an empty expert, a hot expert, a rank that
receives nothing, a rank that sends nothing, unequal token counts), bitwise determinism, bounded waits, the one-node
rule, the transport choice and the quantised precisions under EP."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist

from prime_megamoe import DispatchConfig, fused_experts
from prime_megamoe.comm import factory as transport_registry
from prime_megamoe.comm.collectives import check_group_within_node
from prime_megamoe.comm.factory import make_transport

from .distributed import run_on_ranks
from .oracle import oracle_with_grads
from .test_torch_backend import DTYPES, TOL, Case, assert_matches, make_problem

CASES = [
    Case("ragged", 40, 24, 8, 3, "ragged", (7, 12, 1, 9)),
    Case("starved", 32, 16, 8, 2, "starved", (6, 0, 8, 5)),  # rank 1 sends no tokens, the last rank receives none
]


def _seed(case: Case, world: int, dtype_name: str) -> int:
    return 7000 + 100 * world + 10 * CASES.index(case) + list(DTYPES).index(dtype_name)


def _run(x, index, weights, w1, w2, grad_out, group, capacity, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)]
    opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=capacity)
    out = fused_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], dispatch=opts, group=group, **kwargs)
    out.backward(grad_out)
    return (out.detach(), *(t.grad for t in leaves))


def _ep_body(rank, world, cases):
    group = dist.group.WORLD
    results = {}
    for case, dtype_name in cases:
        x, w, w1, w2, g, idx = make_problem(case, world, DTYPES[dtype_name], _seed(case, world, dtype_name))
        counts = case.tokens_per_rank(world)
        t0, t1 = sum(counts[:rank]), sum(counts[: rank + 1])
        per_rank = case.experts // world
        e0, e1 = rank * per_rank, (rank + 1) * per_rank
        args = (x[t0:t1], idx[t0:t1], w[t0:t1], w1[e0:e1], w2[e0:e1], g[t0:t1], group, max(counts))
        first = results[(case.name, dtype_name)] = _run(*args)
        if (case, dtype_name) != cases[0]:
            continue
        # On the first case only (each call is an interpreted forward and backward): bitwise repeatability, and at
        # LAYER_CHECKS_WORLD the layer-level checks.
        results["repeat_bitwise"] = all(torch.equal(a, b) for a, b in zip(first, _run(*args)))
        if world == LAYER_CHECKS_WORLD:
            results["interleaved"] = _interleaved_layers_match(args, first, case.experts)
            results["plan_pool"] = _plan_pool_checks(args, case.experts)
    return results


def _forward_plans() -> list[int]:
    """Ids of the forward plans free in every transport's pool (``ep_pipeline.lease_forward_plan``)."""
    return sorted(
        id(plan)
        for _, transport in transport_registry._TRANSPORTS.values()
        for key, pool in transport.reused.items()
        if key[0] == "forward_plans"
        for plan, _ in pool
    )


def _plan_pool_checks(args, num_experts) -> dict:
    """The forward's plans come from a pool per transport: a call whose graph is freed gives its plan back (the next
    step allocates none), a graph that is alive holds its plan, and a graph kept with ``retain_graph`` keeps its plan
    through other calls: its second backward adds exactly the first one's gradients again."""
    x, index, weights, w1, w2, grad_out, group, capacity = args
    opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=capacity)
    leaves, other = ([t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)] for _ in range(2))

    def call(tensors, idx=index):
        return fused_experts(tensors[0], idx, tensors[1], tensors[2], tensors[3], dispatch=opts, group=group)

    call(leaves).backward(grad_out)
    gc.collect()
    free = _forward_plans()
    call(leaves).backward(grad_out)
    gc.collect()
    checks = {"reused": bool(free) and _forward_plans() == free}
    held = call(leaves)
    checks["held"] = len(_forward_plans()) == len(free) - 1
    del held
    gc.collect()
    checks["returned"] = _forward_plans() == free
    for t in leaves:
        t.grad = None
    out = call(leaves)
    out.backward(grad_out, retain_graph=True)
    once = [t.grad.clone() for t in leaves]
    call(other, (index + 1) % num_experts).backward(grad_out)  # refills a free plan, not the held one
    out.backward(grad_out)
    checks["retained"] = all(torch.equal(t.grad, 2 * g) for t, g in zip(leaves, once))
    return checks


def _interleaved_layers_match(args, single, num_experts) -> bool:
    """Two layers' forwards before either backward, as a model without activation checkpointing runs them (one
    transport, so one reused routing plan): the first layer's output and gradients must be bitwise those of the
    same call alone, though the second layer routes differently."""
    x, index, weights, w1, w2, grad_out, group, capacity = args
    opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=capacity)
    first, second = ([t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)] for _ in range(2))
    out = fused_experts(first[0], index, first[1], first[2], first[3], dispatch=opts, group=group)
    other = fused_experts(
        second[0], (index + 1) % num_experts, second[1], second[2], second[3], dispatch=opts, group=group
    )
    torch.autograd.backward([out, other], [grad_out, grad_out])
    return all(torch.equal(a, b) for a, b in zip(single, (out.detach(), *(t.grad for t in first))))


# EP = 2 runs every case in every dtype, with the layer-level checks (two layers interleaved, the plan pool); EP = 4
# (four processes on CI's two cores, the suite's slowest test) each case once: ragged in fp32, starved in bf16.
EP_RUNS = {2: [(c, d) for c in CASES for d in DTYPES], 4: [(CASES[0], "fp32"), (CASES[1], "bf16")]}
LAYER_CHECKS_WORLD = 2
_RESULTS: dict[int, list] = {}


def results_for(world: int) -> list:
    if world not in _RESULTS:
        _RESULTS[world] = run_on_ranks(_ep_body, world, EP_RUNS[world])
    return _RESULTS[world]


@pytest.mark.parametrize(
    "world,case,dtype_name",
    [pytest.param(w, c, d, id=f"{w}-{c.name}-{d}") for w, runs in EP_RUNS.items() for c, d in runs],
)
def test_expert_parallel_mega_moe_matches_oracle(world, case, dtype_name):
    dtype = DTYPES[dtype_name]
    x, w, w1, w2, g, idx = make_problem(case, world, dtype, _seed(case, world, dtype_name))
    assert all(r["repeat_bitwise"] for r in results_for(world)), "a repeated call gave different bits"
    if world == LAYER_CHECKS_WORLD:
        assert all(r["interleaved"] for r in results_for(world)), "a second layer's forward changed the first's"
        pools = [r["plan_pool"] for r in results_for(world)]
        assert all(all(p.values()) for p in pools), f"forward plan pool: {pools}"
    per = [r[(case.name, dtype_name)] for r in results_for(world)]
    gathered = tuple(torch.cat([res[n] for res in per]) for n in range(5))
    assert_matches(gathered, oracle_with_grads(x, idx, w, w1, w2, g), TOL[dtype], f"mega_moe EP={world} {case.name}")
    if case.routing == "starved":  # the last rank's experts are never chosen: it receives no rows
        assert (per[-1][3] == 0).all() and (per[-1][4] == 0).all()


def _stalled_peer_body(rank, world):
    x = torch.randn(4, 32)
    index = torch.tensor([[0, 1]] * 4)
    weights = torch.full((4, 2), 0.5)
    w1, w2 = torch.randn(1, 48, 32), torch.randn(1, 32, 24)
    if rank == 1:  # never joins the exchange
        time.sleep(6.0)
        return None
    opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=4, comm_timeout_s=1.5)
    start = time.monotonic()
    try:
        fused_experts(x, index, weights, w1, w2, dispatch=opts, group=dist.group.WORLD)
    except RuntimeError as err:
        return time.monotonic() - start, str(err)
    return None


def test_a_peer_that_never_arrives_is_an_error_not_a_hang():
    elapsed, message = run_on_ranks(_stalled_peer_body, 2)[0]
    assert elapsed < 5.0
    assert "rank 0" in message and "[1]" in message and "comm_timeout_s" in message


def _node_check_body(rank, world):
    check_group_within_node(dist.group.WORLD, local_world_size=2)  # both ranks on node 0: fine
    try:
        check_group_within_node(dist.new_group([0, 1]), local_world_size=1)  # one rank per node: spans two
    except ValueError as err:
        return str(err)
    return None


def test_an_expert_parallel_group_must_stay_inside_one_node():
    messages = run_on_ranks(_node_check_body, 2)
    assert all(m is not None and "spans nodes" in m and "ep" in m for m in messages)


def test_symmetric_memory_transport_needs_cuda():
    with pytest.raises(ValueError, match=r"transport = 'symmetric_memory' needs CUDA.*'collectives'"):
        make_transport("symmetric_memory", None, 8, torch.device("cpu"), 5.0)


def _transport_choice_body(rank, world):
    x = torch.randn(4, 32)
    index = torch.tensor([[0, 1]] * 4)
    weights = torch.full((4, 2), 0.5)
    w1, w2 = torch.randn(1, 48, 32), torch.randn(1, 32, 24)
    auto = make_transport("auto", dist.group.WORLD, 4, x.device, 5.0)
    # One transport per (name, group, capacity, device, timeout), reused by every call; other options, another one.
    reused = make_transport("auto", dist.group.WORLD, 4, x.device, 5.0) is auto
    distinct = make_transport("auto", dist.group.WORLD, 8, x.device, 5.0) is not auto
    errors = []
    opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=4, transport="symmetric_memory")
    try:
        fused_experts(x, index, weights, w1, w2, dispatch=opts, group=dist.group.WORLD)
    except (ValueError, RuntimeError) as err:
        errors.append((type(err).__name__, str(err)))
    return type(auto).__name__, auto.source_order(), errors, (reused, distinct)


def test_transport_choice_on_cpu():
    results = run_on_ranks(_transport_choice_body, 2)
    for rank, (auto, order, errors, cached) in enumerate(results):
        assert cached == (True, True)
        assert auto == "CollectiveTransport"  # auto picks collectives off CUDA
        assert order == [rank, 1 - rank]  # own block first, then the peer
        assert len(errors) == 1, errors
        ((kind, msg),) = errors
        assert kind == "ValueError" and "needs CUDA tensors" in msg


CLAMP_CASE = Case("clamp", 32, 16, 4, 2, "ragged", (9, 5))  # 2 experts a rank: expert 0 empty, expert 1 hot
CLAMP_SEED = 7301


def _fp8_clamp_problem():
    from tests.test_fp8_experts import _problem

    return _problem(24, 128, 128, 4, 2, seed=37, hot_fraction=0.8)


def _clamped_ep_body(rank, world):
    """EP = 2 with the clamped SwiGLU, max_tokens_per_rank = the most tokens a rank has: the pipeline unquantised (fp32
    data), then in fp8 (ranks' tokens [0, 14) and [14, 24), experts two a rank)."""
    from tests.test_activation_clamp import LIMIT

    x, w, w1, w2, g, idx = make_problem(CLAMP_CASE, world, torch.float32, CLAMP_SEED)
    counts = CLAMP_CASE.tokens_per_rank(world)
    t0, t1 = sum(counts[:rank]), sum(counts[: rank + 1])
    e0, e1 = rank * CLAMP_CASE.experts // world, (rank + 1) * CLAMP_CASE.experts // world
    args = (x[t0:t1], idx[t0:t1], w[t0:t1], w1[e0:e1], w2[e0:e1], g[t0:t1], dist.group.WORLD, max(counts))
    unquantized = _run(*args, activation_clamp=LIMIT)
    x, index, weights, w1, w2, grad_out = _fp8_clamp_problem()
    t0, t1 = (0, 14) if rank == 0 else (14, 24)
    e0, e1 = 2 * rank, 2 * rank + 2
    leaves = [t.clone().requires_grad_() for t in (x[t0:t1], weights[t0:t1], w1[e0:e1], w2[e0:e1])]
    opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=14)
    out = fused_experts(
        leaves[0],
        index[t0:t1],
        *leaves[1:],
        dispatch=opts,
        precision="fp8",
        group=dist.group.WORLD,
        activation_clamp=LIMIT,
    )
    out.backward(grad_out[t0:t1])
    return unquantized, [out.detach()] + [t.grad for t in leaves]


def test_expert_parallel_clamped_swiglu_matches_the_clamped_reference():
    # activation_clamp under EP = 2 (ragged routing, unequal token counts): the pipeline (ops/ep_pipeline.py) in bf16
    # within the fp32 bound and in fp8 within the clamped fp8 bound, against the
    # float64 clamped reference (see tests/test_activation_clamp.py for both bounds and the reference's clamp
    # decisions), and each far from the unclamped oracle.
    from tests.test_activation_clamp import (
        CLAMPED_ORACLE_TOL,
        LIMIT,
        _assert_clamped_fractions,
        _check,
        _quantized_forward_h,
    )

    per = run_on_ranks(_clamped_ep_body, 2)
    x, w, w1, w2, g, idx = make_problem(CLAMP_CASE, 2, torch.float32, CLAMP_SEED)
    problem = (x, idx, w, w1, w2, g)
    _assert_clamped_fractions(x, idx, w1)
    got = [torch.cat([r[0][n] for r in per]) for n in range(5)]
    _check(got, problem, oracle_with_grads(*problem, activation_clamp=LIMIT), TOL[torch.float32], "bf16 EP=2")
    problem = _fp8_clamp_problem()
    _assert_clamped_fractions(problem[0], problem[1], problem[3])
    got = [torch.cat([r[1][n] for r in per]) for n in range(5)]
    decided_on = _quantized_forward_h("fp8", problem[0], problem[1], problem[3])
    ref = oracle_with_grads(*problem, activation_clamp=LIMIT, clamp_decided_on=decided_on)
    _check(got, problem, ref, CLAMPED_ORACLE_TOL["fp8"], "fp8 EP=2")
