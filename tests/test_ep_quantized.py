"""The quantised precisions (fp8, fp8_bwd, mxfp8) through the expert-parallel pipeline over gloo (EP = 2 and 4): the
float64 oracle within the fp8 bound, bitwise repeatability, bitwise equality of the output and the data gradients
with a plain loop over the same blocks (each source's block through the one-rank layer, partial sums added in rank
order), what travels (e4m3 rows with their scales), and ragged routing: an empty expert, a hot expert, a rank that
sends nothing and a rank that receives nothing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from prime_megamoe import DispatchConfig, fused_experts
from prime_megamoe.comm import transport as transport_module
from prime_megamoe.kernels import tuning
from prime_megamoe.ops.quantized_experts import routed_experts_quantized

from .distributed import run_on_ranks
from .oracle import oracle_with_grads, ragged_routing, rel_err
from .test_fp8_experts import ORACLE_TOL

INTER, EXPERTS, TOP_K = 128, 8, 2


def hidden_of(precision: str) -> int:
    """One 128-column fp8 scale group a row (fewer interpreted steps); mxfp8's 32-column blocks over 256 columns,
    where its gradients stay inside the oracle bound (at 128 columns one random draw of dweights lands just past it)."""
    return 256 if precision == "mxfp8" else 128


def _problem(tokens: list[int], seed: int, hidden: int):
    """Every rank's tokens in rank order; expert 0 never chosen, expert 1 hot, the last rank's experts never chosen
    (it receives nothing)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(tokens)
    x = torch.randn(total, hidden, generator=gen)
    w1 = torch.randn(EXPERTS, 2 * INTER, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(EXPERTS, hidden, INTER, generator=gen) / INTER**0.5
    grad_out = torch.randn(total, hidden, generator=gen)
    per_rank = EXPERTS // len(tokens)
    forbid = range(EXPERTS - per_rank, EXPERTS)
    index, weights = ragged_routing(total, EXPERTS, TOP_K, seed=seed, empty_expert=0, hot_expert=1, forbid=forbid)
    return x, index, weights, w1, w2, grad_out


def _slices(rank: int, tokens: list[int], world: int):
    t0, t1 = sum(tokens[:rank]), sum(tokens[: rank + 1])
    per_rank = EXPERTS // world
    return slice(t0, t1), slice(rank * per_rank, (rank + 1) * per_rank)


def _pipeline(x, index, weights, w1, w2, grad_out, precision, capacity):
    leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=capacity, comm_timeout_s=3600)
    out = fused_experts(
        leaves[0], index, leaves[1], leaves[2], leaves[3], dispatch=opts, precision=precision, group=dist.group.WORLD
    )
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def _all_blocks(t: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """Every rank's rows of t (a plain all_gather of blocks padded to the most tokens)."""
    most = max(tokens)
    padded = t.new_zeros(most, *t.shape[1:])
    padded[: t.shape[0]] = t
    blocks = [torch.empty_like(padded) for _ in tokens]
    dist.all_gather(blocks, padded)
    return [b[:n] for b, n in zip(blocks, tokens)]


def _plain_loop(x, index, weights, w1, w2, grad_out, precision, tokens):
    """The same blocks through the one-rank layer: this rank's experts on each source's block in turn; each source
    gets the partial outputs and data gradients back and adds them in rank order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sources = [_all_blocks(t, tokens) for t in (x, index, weights, grad_out)]
    partial = {"out": [], "dx": [], "dw": []}
    for xs, idx, ws, gs in zip(*sources):
        leaves = [t.clone().requires_grad_() for t in (xs, ws)]
        out = routed_experts_quantized(
            leaves[0],
            idx,
            leaves[1],
            w1,
            w2,
            expert_base=rank * w1.shape[0],
            tile_m=tuning.tile_m(),
            precision=precision,
        )
        out.backward(gs)
        for name, value in zip(partial, (out.detach(), leaves[0].grad, leaves[1].grad)):
            partial[name].append(value)
    summed = []
    for name in partial:  # rank s receives every rank's partial for its block, and sums them in rank order
        mine = []
        for source in range(world):
            blocks = [torch.empty_like(partial[name][rank]) if source == rank else None for _ in range(world)]
            if source == rank:
                dist.gather(partial[name][source], blocks, dst=source)
                mine = blocks
            else:
                dist.gather(partial[name][source], None, dst=source)
        acc = torch.zeros_like(mine[0], dtype=torch.float32)
        for block in mine:
            acc = acc + block.float()
        summed.append(acc.to(mine[0].dtype))
    return summed


def _ep_body(rank, world, runs):
    """Every run of one world size in the same processes (one spawn): [(precision, tokens, seed)] -> results."""
    return [_ep_run(rank, world, *run) for run in runs]


def _ep_run(rank, world, precision, tokens, seed):
    x, index, weights, w1, w2, grad_out = _problem(tokens, seed, hidden_of(precision))
    rows, experts = _slices(rank, tokens, world)
    args = (x[rows], index[rows], weights[rows], w1[experts], w2[experts], grad_out[rows], precision)
    sent = []
    gather = transport_module.all_gather_blocks

    def recording_gather(block, *a, **kw):  # what crosses the wire: dtype, width and bytes of every block
        sent.append((block.dtype, block.shape[-1], block.numel() * block.element_size()))
        return gather(block, *a, **kw)

    transport_module.all_gather_blocks = recording_gather
    first = _pipeline(*args, capacity=max(tokens))
    transport_module.all_gather_blocks = gather
    again = _pipeline(*args, capacity=max(tokens))
    loop = _plain_loop(*args, tokens=tokens)
    return {
        "got": first,
        "repeat": all(torch.equal(a, b) for a, b in zip(first, again)),
        "loop": [torch.equal(a, b) for a, b in zip((first[0], first[1], first[2]), loop)],
        "sent": sent,
    }


# (world, precision, tokens per rank): every precision at EP = 2 and 4, a rank that sends nothing at EP = 4 (a
# different one per precision), unequal counts everywhere; the runs of one world size share one spawn
RUNS = [
    (2, "fp8", [14, 9]),
    (2, "fp8_bwd", [14, 9]),
    (2, "mxfp8", [9, 14]),
    (4, "fp8", [7, 0, 9, 5]),
    (4, "fp8_bwd", [6, 4, 8, 0]),
    (4, "mxfp8", [0, 5, 3, 7]),
]


_RESULTS: dict[int, list] = {}


def _seed(world: int) -> int:
    return 31 + world


def results_for(world: int, precision: str) -> list[dict]:
    """Per rank, the results of ``precision``'s run at ``world``: the runs of one world size share one spawn."""
    if world not in _RESULTS:
        runs = [(p, tokens, _seed(world)) for w, p, tokens in RUNS if w == world]
        per_rank = run_on_ranks(_ep_body, world, runs)
        _RESULTS[world] = {run[0]: [r[i] for r in per_rank] for i, run in enumerate(runs)}
    return _RESULTS[world][precision]


@pytest.mark.parametrize("world,precision,tokens", RUNS, ids=[f"ep{w}-{p}" for w, p, _ in RUNS])
def test_quantized_pipeline(world, precision, tokens):
    seed = _seed(world)
    per = results_for(world, precision)
    hidden = hidden_of(precision)
    x, index, weights, w1, w2, grad_out = _problem(tokens, seed, hidden)
    ref = oracle_with_grads(x, index, weights, w1, w2, grad_out)
    names = ("out", "dx", "dweights", "dW1", "dW2")
    gathered = [torch.cat([r["got"][n] for r in per]) for n in (0, 1, 2)]
    gathered += [torch.cat([r["got"][n] for r in per]) for n in (3, 4)]
    for name, a, b in zip(names, gathered, ref):
        err = rel_err(a.double(), b)
        assert err < ORACLE_TOL, f"{precision} EP={world} {name}: {err:.3e} against the float64 oracle"
    last = per[-1]["got"]
    assert (last[3] == 0).all() and (last[4] == 0).all(), "the rank that receives nothing has weight gradients"
    first = per[0]["got"]
    assert (first[3][0] == 0).all() and (first[4][0] == 0).all(), "the expert nobody picked has weight gradients"
    for rank, r in enumerate(per):
        assert r["repeat"], f"rank {rank}: a repeated call gave different bits"
        assert all(r["loop"]), f"rank {rank}: out / dx / d weights differ from the plain loop over blocks: {r['loop']}"
        # Blocks of rows (width H, and their scales' width): e4m3 with scales, about a quarter of these fp32 rows;
        # fp8_bwd's forward sends its (here fp32) tokens as they are. (Routing travels as [C, k].)
        rows = [(dtype, width, n) for dtype, width, n in r["sent"] if width != TOP_K]
        fp8_rows = [n for dtype, width, n in rows if dtype == torch.float8_e4m3fn]
        scales = [n for dtype, width, n in rows if width in (hidden // 128, hidden // 32)]
        assert len(fp8_rows) == (1 if precision == "fp8_bwd" else 2), rows
        block_bytes = sum(fp8_rows) + sum(scales)
        assert block_bytes < 0.3 * len(fp8_rows) * max(tokens) * hidden * 4, rows
