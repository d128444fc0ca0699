"""The `torch` backend against the plain loop and the transformers float64 oracle, on one rank and with expert
parallelism over gloo processes (EP = 1, 2, 4): outputs and the gradients of hidden_states, top_k_weights,
gate_up_proj and down_proj. Its precision = "fp8" is tested in test_torch_backend_fp8.py, except with EP = 2, which
runs here in the same gloo processes as the bf16 cases (one spawn costs seconds)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from prime_megamoe import DispatchConfig, fused_experts

from .distributed import run_on_ranks
from .oracle import assert_matches_oracle, loop_reference, oracle_with_grads, ragged_routing, rel_err
from .test_torch_backend_fp8 import ORACLE_TOL as FP8_ORACLE_TOL
from .test_torch_backend_fp8 import check_emulation as check_fp8_emulation
from .test_torch_backend_fp8 import emulate as emulate_fp8
from .test_torch_backend_fp8 import fp8_problem
from .test_torch_backend_fp8 import run_fp8 as run_fp8_single

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRAD_NAMES = ("out", "d_hidden_states", "d_top_k_weights", "d_gate_up_proj", "d_down_proj")


@dataclass(frozen=True)
class Case:
    """One routed-experts problem over all ranks: shapes, routing kind and tokens per rank."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    routing: str  # "uniform" | "ragged" (one empty expert, one hot) | "starved" (ragged, last rank gets nothing)
    tokens: tuple[int, ...] | int  # per rank; an int means the same count on every rank

    def tokens_per_rank(self, world: int) -> list[int]:
        if isinstance(self.tokens, int):
            return [self.tokens] * world
        return [self.tokens[r % len(self.tokens)] for r in range(world)]


def make_problem(case: Case, world: int, dtype: torch.dtype, seed: int):
    """All ranks' tokens (concatenated in rank order), all experts' weights and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(case.tokens_per_rank(world))
    e, h, i, k = case.experts, case.hidden, case.inter, case.top_k
    x = torch.randn(total, h, generator=gen)
    w1 = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, generator=gen) * i**-0.5
    grad_out = torch.randn(total, h, generator=gen)
    route_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    if case.routing == "uniform":
        index, weights = ragged_routing(total, e, k, seed=route_seed, empty_expert=None, hot_expert=None)
    elif case.routing == "ragged":
        index, weights = ragged_routing(total, e, k, seed=route_seed, empty_expert=0, hot_expert=1)
    elif case.routing == "starved":
        per_rank = e // world
        forbid = range((world - 1) * per_rank, e)
        index, weights = ragged_routing(total, e, k, seed=route_seed, empty_expert=0, hot_expert=1, forbid=forbid)
    else:
        raise ValueError(case.routing)
    return tuple(t.to(dtype) for t in (x, weights, w1, w2, grad_out)) + (index,)


def run_backend(x, index, weights, w1, w2, grad_out, group=None, dispatch="torch"):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)]
    out = fused_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], dispatch=dispatch, group=group)
    out.backward(grad_out)
    return (out.detach(), *(t.grad for t in leaves))


def loop_with_grads(x, index, weights, w1, w2, grad_out):
    leaves = [t.detach().double().requires_grad_() for t in (x, weights, w1, w2)]
    out = loop_reference(leaves[0], index, leaves[1], leaves[2], leaves[3])
    grads = torch.autograd.grad(out, leaves, grad_out.double())
    return (out.detach(), *grads)


def assert_matches(got, ref, tol, what=""):
    for name, a, b in zip(GRAD_NAMES, got, ref):
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"{what} {name}: non-finite values"
        err = rel_err(a, b)
        assert err <= tol, f"{what} {name}: relative error {err:.3e} > {tol:.0e}"


# ---------------------------------------------------------------------------------------------------------------
# The references agree with each other (so a mismatch below is the backend's)


def test_loop_reference_matches_transformers_oracle():
    case = Case("ragged", 24, 12, 6, 3, "ragged", 15)
    x, w, w1, w2, g, idx = make_problem(case, 1, torch.float64, seed=11)
    assert_matches(loop_with_grads(x, idx, w, w1, w2, g), oracle_with_grads(x, idx, w, w1, w2, g), 1e-12)


def test_ragged_routing_has_the_promised_shape():
    idx, w = ragged_routing(40, 8, 2, seed=3, empty_expert=0, hot_expert=1, forbid=range(6, 8))
    counts = torch.bincount(idx.reshape(-1), minlength=8)
    assert counts[0] == 0 and counts[6] == 0 and counts[7] == 0
    assert counts[1] == counts.max() and counts[1] > 40 // 2
    assert (idx.sort(-1).values.diff(dim=-1) != 0).all()  # distinct experts per token
    torch.testing.assert_close(w.sum(-1), torch.ones(40))


# ---------------------------------------------------------------------------------------------------------------
# One rank, group=None, in this process

SINGLE_CASES = [
    Case("uniform", 32, 16, 4, 2, "uniform", 24),
    Case("ragged_k4", 64, 48, 8, 4, "ragged", 40),
    Case("ragged_odd", 40, 24, 6, 3, "ragged", 17),
    Case("t1", 32, 16, 8, 2, "uniform", 1),
    Case("t1_k4", 48, 16, 4, 4, "uniform", 1),
]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", SINGLE_CASES, ids=lambda c: c.name)
def test_single_rank_matches_references(case, dtype_name):
    dtype = DTYPES[dtype_name]
    x, w, w1, w2, g, idx = make_problem(
        case, 1, dtype, seed=100 * SINGLE_CASES.index(case) + list(DTYPES).index(dtype_name)
    )
    got = run_backend(x, idx, w, w1, w2, g)
    for t, ref_in in zip(got, (x, x, w, w1, w2)):
        assert t.dtype == dtype and t.shape == ref_in.shape
    assert_matches(got, oracle_with_grads(x, idx, w, w1, w2, g), TOL[dtype], "vs transformers")
    assert_matches(got, loop_with_grads(x, idx, w, w1, w2, g), TOL[dtype], "vs loop")
    if case.routing == "ragged":
        # The expert nobody picked gets exactly zero weight gradients; the hot one does not.
        assert (got[3][0] == 0).all() and (got[4][0] == 0).all()
        assert got[3][1].abs().sum() > 0 and got[4][1].abs().sum() > 0


def test_single_rank_int32_index_and_dispatch_config():
    case = Case("cfg", 32, 16, 4, 2, "ragged", 10)
    x, w, w1, w2, g, idx = make_problem(case, 1, torch.float32, seed=5)
    ref = run_backend(x, idx, w, w1, w2, g)
    got = run_backend(x, idx.to(torch.int32), w, w1, w2, g, dispatch=DispatchConfig(type="torch"))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_single_rank_partial_grads():
    # Only the weights need gradients (frozen activations and router): the rest stays None and results still match.
    case = Case("partial", 32, 16, 4, 2, "uniform", 8)
    x, w, w1, w2, g, idx = make_problem(case, 1, torch.float32, seed=6)
    w1p = w1.clone().requires_grad_()
    out = fused_experts(x, idx, w, w1p, w2, dispatch="torch")
    (gw1,) = torch.autograd.grad(out, [w1p], g)
    ref = oracle_with_grads(x, idx, w, w1, w2, g)
    assert rel_err(out, ref[0]) <= 1e-5
    assert rel_err(gw1, ref[3]) <= 1e-5


def test_single_rank_no_tokens():
    x = torch.randn(0, 16, requires_grad=True)
    w1 = torch.randn(4, 16, 16, requires_grad=True)
    w2 = torch.randn(4, 16, 8, requires_grad=True)
    out = fused_experts(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), w1, w2, dispatch="torch")
    assert out.shape == (0, 16)
    out.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1)) and torch.equal(w2.grad, torch.zeros_like(w2))


def test_single_rank_duplicate_expert_in_one_token():
    # Not what a router produces, but the layer is defined for it: both slots add the same expert's output.
    case = Case("dup", 32, 16, 4, 2, "uniform", 6)
    x, w, w1, w2, g, idx = make_problem(case, 1, torch.float32, seed=9)
    idx[:, 1] = idx[:, 0]
    assert_matches(run_backend(x, idx, w, w1, w2, g), loop_with_grads(x, idx, w, w1, w2, g), 1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism over gloo processes. One spawn per world size runs every case; each case is then checked on
# its own (one spawn costs seconds of interpreter start-up, the cases themselves milliseconds).

EP_CASES = [
    Case("uniform", 32, 16, 8, 2, "uniform", 12),
    Case("ragged_uneven_k4", 48, 24, 8, 4, "ragged", (8, 13, 5, 10)),
    Case("starved_rank", 32, 16, 8, 2, "starved", (11, 6, 9, 14)),
    Case("t1", 32, 16, 8, 2, "uniform", 1),
]
EP_WORLDS = (1, 2, 4)


def _seed(case: Case, world: int, dtype_name: str) -> int:
    return 1000 * world + 10 * EP_CASES.index(case) + list(DTYPES).index(dtype_name)


# precision = "fp8" over gloo with EP = 1 and 2: (name, clamp, drop every 4th token's first slot); tokens per rank
FP8_EP_WORLDS = (1, 2)
FP8_EP_VARIANTS = (("plain", None, False), ("clamp_dropped", 2.5, True))
FP8_EP_TOKENS = (13, 8)  # with EP = 2; one rank takes all 21
FP8_EP_SHAPE = dict(hidden=48, inter=24, experts=8, top_k=4)


def fp8_ep_problem(drop: bool):
    """The global problem of the fp8 EP cases: ragged routing (expert 0 empty, 1 hot), optionally with -1 slots."""
    x, index, weights, w1, w2, grad_out = fp8_problem(
        sum(FP8_EP_TOKENS), seed=11, empty_expert=0, hot_expert=1, **FP8_EP_SHAPE
    )
    if drop:
        index = index.clone()
        index[::4, 0] = -1
    return x, index, weights, w1, w2, grad_out


def _fp8_ep_run(rank, world, group):
    results = {}
    for name, clamp, drop in FP8_EP_VARIANTS:
        x, index, weights, w1, w2, grad_out = fp8_ep_problem(drop)
        tokens = FP8_EP_TOKENS if world == 2 else (sum(FP8_EP_TOKENS),)
        t0, t1 = sum(tokens[:rank]), sum(tokens[: rank + 1])
        per_rank = FP8_EP_SHAPE["experts"] // world
        e0, e1 = rank * per_rank, (rank + 1) * per_rank
        leaves = [t.clone().requires_grad_() for t in (x[t0:t1], weights[t0:t1], w1[e0:e1], w2[e0:e1])]
        out = fused_experts(
            leaves[0],
            index[t0:t1],
            leaves[1],
            leaves[2],
            leaves[3],
            dispatch="torch",
            precision="fp8",
            group=group,
            activation_clamp=clamp,
        )
        out.backward(grad_out[t0:t1])
        results[("fp8", name)] = (out.detach(), *(t.grad for t in leaves))
    return results


def _ep_body(rank, world, cases, fp8=False):
    """Each rank: its own tokens, its slice of experts; forward + backward through the group."""
    group = dist.group.WORLD
    results = _fp8_ep_run(rank, world, group) if fp8 else {}
    for case, dtype_name in cases:
        dtype = DTYPES[dtype_name]
        x, w, w1, w2, g, idx = make_problem(case, world, dtype, _seed(case, world, dtype_name))
        counts = case.tokens_per_rank(world)
        t0, t1 = sum(counts[:rank]), sum(counts[: rank + 1])
        per_rank = case.experts // world
        e0, e1 = rank * per_rank, (rank + 1) * per_rank
        results[(case.name, dtype_name)] = run_backend(
            x[t0:t1], idx[t0:t1], w[t0:t1], w1[e0:e1], w2[e0:e1], g[t0:t1], group=group
        )
    return results


_EP_RESULTS: dict[int, list] = {}


def ep_results(world: int) -> list:
    if world not in _EP_RESULTS:
        cases = [(c, d) for c in EP_CASES for d in DTYPES if not (c.routing == "starved" and world == 1)]
        _EP_RESULTS[world] = run_on_ranks(_ep_body, world, cases, world in FP8_EP_WORLDS)
    return _EP_RESULTS[world]


def _ep_params():
    # A starved rank needs more than one rank.
    return [
        pytest.param(w, c, d, id=f"ep{w}-{c.name}-{d}")
        for w in EP_WORLDS
        for c in EP_CASES
        for d in DTYPES
        if not (c.routing == "starved" and w == 1)
    ]


@pytest.mark.parametrize("world, case, dtype_name", _ep_params())
def test_expert_parallel_matches_oracle(world, case, dtype_name):
    dtype = DTYPES[dtype_name]
    per_rank = ep_results(world)
    x, w, w1, w2, g, idx = make_problem(case, world, dtype, _seed(case, world, dtype_name))
    got = [r[(case.name, dtype_name)] for r in per_rank]
    counts = case.tokens_per_rank(world)
    for r, res in enumerate(got):
        assert res[0].shape == (counts[r], case.hidden) and res[0].dtype == dtype
        assert res[3].shape == (case.experts // world, 2 * case.inter, case.hidden)
    # Token-side results concatenate over ranks; weight gradients concatenate over expert slices (each rank's
    # slice already holds the contributions of every rank's tokens).
    gathered = (
        torch.cat([res[0] for res in got]),
        torch.cat([res[1] for res in got]),
        torch.cat([res[2] for res in got]),
        torch.cat([res[3] for res in got]),
        torch.cat([res[4] for res in got]),
    )
    what = f"EP={world} {case.name} {dtype_name}"
    assert_matches(gathered, oracle_with_grads(x, idx, w, w1, w2, g), TOL[dtype], what + " vs transformers")
    assert_matches(gathered, loop_with_grads(x, idx, w, w1, w2, g), TOL[dtype], what + " vs loop")
    if case.routing == "starved":
        last = got[-1]
        assert (last[3] == 0).all() and (last[4] == 0).all(), "the rank nobody routes to has nonzero weight grads"
        assert all((res[3].abs().sum() > 0) for res in got[:-1])


def test_expert_parallel_matches_single_rank():
    # The same global problem gives the same answer with EP = 2 as on one rank holding all experts.
    case = EP_CASES[1]
    world = 2
    x, w, w1, w2, g, idx = make_problem(case, world, torch.float32, _seed(case, world, "fp32"))
    single = run_backend(x, idx, w, w1, w2, g)
    got = [r[(case.name, "fp32")] for r in ep_results(world)]
    for n, name in enumerate(GRAD_NAMES):
        joined = torch.cat([res[n] for res in got])
        torch.testing.assert_close(joined, single[n], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", [v[0] for v in FP8_EP_VARIANTS])
@pytest.mark.parametrize("world", FP8_EP_WORLDS, ids=lambda w: f"ep{w}")
def test_expert_parallel_fp8_matches_oracle_recipe_and_single_rank(world, variant):
    """precision = "fp8" over gloo, EP = 1 and 2 (ragged routing; the clamped SwiGLU with -1 slots): the float64
    oracle within the fp8 bound, the float64 emulation of the recipe, and the same problem in this process on one rank
    holding every expert (group=None)."""
    _, clamp, drop = next(v for v in FP8_EP_VARIANTS if v[0] == variant)
    x, index, weights, w1, w2, grad_out = fp8_ep_problem(drop)
    got = [r[("fp8", variant)] for r in ep_results(world)]
    joined = tuple(torch.cat([res[n] for res in got]) for n in range(5))
    dropped = index < 0
    oracle = list(oracle_with_grads(x, index.clamp(min=0), weights * ~dropped, w1, w2, grad_out, clamp))
    oracle[2] = oracle[2] * ~dropped
    assert_matches_oracle(joined, x, index, weights, w1, w2, grad_out, FP8_ORACLE_TOL, ref=oracle)
    check_fp8_emulation(joined, emulate_fp8(x, index, weights, w1, w2, grad_out, clamp), f"EP={world} {variant}")
    # Each expert sees the same rows in the same order, so the same scales: EP changes only the summation order.
    single = run_fp8_single(x, index, weights, w1, w2, grad_out, activation_clamp=clamp)
    for name, a, b in zip(GRAD_NAMES, joined, single):
        assert rel_err(a, b) < 1e-5, f"EP={world} {variant} {name} vs one rank"
    assert (joined[2][dropped] == 0).all()
    assert (joined[3][0] == 0).all() and (joined[4][0] == 0).all()  # expert 0 (rank 0's) got no rows
