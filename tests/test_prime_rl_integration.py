"""``MegaMoETokenDispatcher`` driven as prime-rl's MoE layer drives it (EP = 1, 2, 4 over gloo): a stand-in
``GroupedExperts`` with fp32 master weights (DTensors sharded on an expert-parallel device mesh under EP) and bf16
activations, fused and unfused gate/up, a shared expert, zero-score (dropped) slots, the clamped SwiGLU on and off,
``synchronize()`` after the layer and a selective-checkpointing recompute; outputs and every gradient against a
float64 reference. Also the config table shared with prime-rl, and the errors for what the kernels cannot compute."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prime_megamoe import MoEConfig, load_config
from prime_megamoe.integrations.prime_rl import MegaMoEDispatchConfig, MegaMoETokenDispatcher

from .distributed import run_on_ranks
from .oracle import bf16_as_stored_by_kernels, clamp_gate_up, ragged_routing, rel_err

HIDDEN, INTER, EXPERTS, TOP_K, SHARED_INTER = 32, 16, 8, 2, 24
TOL = 2e-2  # bf16 activations and GEMM operands


class GroupedExperts(nn.Module):
    """prime-rl's experts layout: gate_proj / up_proj [E, I, H], down_proj [E, H, I], and gate_up_proj [E, 2I, H]
    (gate rows first) or None when its fusions are off; an activation class with the clamp's limit, no biases."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, fused: bool, clamp: float | None, mesh=None):
        super().__init__()

        def param(t):
            if mesh is not None:
                from torch.distributed.tensor import Shard, distribute_tensor

                t = distribute_tensor(t, mesh, [Shard(0)])
            return nn.Parameter(t)

        inter = w1.shape[1] // 2
        self.gate_up_proj = param(w1.clone()) if fused else None
        self.gate_proj = None if fused else param(w1[:, :inter].clone())
        self.up_proj = None if fused else param(w1[:, inter:].clone())
        self.down_proj = param(w2.clone())
        self.gate_proj_bias = self.up_proj_bias = self.down_proj_bias = None
        self.activation = ClampedSilu(clamp) if clamp is not None else Silu

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d gate_up_proj, d down_proj) of this rank's experts, as plain tensors."""

        def local(p):
            return p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad

        if self.gate_up_proj is not None:
            d_w1 = local(self.gate_up_proj)
        else:
            d_w1 = torch.cat([local(self.gate_proj), local(self.up_proj)], dim=1)
        return d_w1, local(self.down_proj)


class Silu:
    """Stand-in for prime-rl's plain SwiGLU activation class."""


class ClampedSilu:
    """Stand-in for prime-rl's clamped SwiGLU activation (an instance with its limit)."""

    def __init__(self, limit: float):
        self.limit = limit


class SharedExpert(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj, self.up_proj = (
            nn.Linear(HIDDEN, SHARED_INTER, bias=False),
            nn.Linear(HIDDEN, SHARED_INTER, bias=False),
        )
        self.down_proj = nn.Linear(SHARED_INTER, HIDDEN, bias=False)
        for lin, w in ((self.gate_proj, gate), (self.up_proj, up), (self.down_proj, down)):
            lin.weight.data = w.clone()

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def make_problem(tokens_per_rank: list[int], seed: int, clamp: float | None):
    """Every rank's inputs (concatenated in rank order) and every expert's weights; routing with an expert nobody
    picks, a hot expert and a few dropped (zero-score) slots."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(tokens_per_rank)
    # With the clamp on, inputs large enough that a good share of g and u lie beyond it.
    scale = 3.0 if clamp is not None else 1.0
    x = (torch.randn(total, HIDDEN, generator=gen) * scale).bfloat16()
    w1 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER**-0.5
    shared = [torch.randn(SHARED_INTER, HIDDEN, generator=gen) * HIDDEN**-0.5 for _ in range(2)]
    shared.append(torch.randn(HIDDEN, SHARED_INTER, generator=gen) * SHARED_INTER**-0.5)
    shared = [t.bfloat16() for t in shared]  # the shared expert computes in the activations' dtype (FSDP2's cast)
    index, scores = ragged_routing(total, EXPERTS, TOP_K, seed=seed + 1)
    dropped = torch.rand(total, TOP_K, generator=gen) < 0.15
    scores = scores.masked_fill(dropped, 0.0)
    grad_out = torch.randn(total, HIDDEN, generator=gen).bfloat16()
    return x, index, scores, w1, w2, shared, grad_out


def reference(x, index, scores, w1, w2, shared, grad_out, clamp):
    """float64: (out, dx, d scores, dW1, dW2) of the routed experts (a zero score contributes nothing and gets no
    gradient) plus the shared expert. The clamp is decided on h as the layer keeps it (from the bf16 weights it
    computes with, stored in bf16): an h within a bf16 rounding of the limit is clamped on one side of it only."""
    leaves = [t.detach().double().requires_grad_() for t in (x, scores, w1, w2)]
    xd, sd, w1d, w2d = leaves
    w1_used = w1.bfloat16().double()
    out = torch.zeros_like(xd)
    for e in range(w1.shape[0]):
        rows, slots = ((index == e) & (scores != 0)).nonzero(as_tuple=True)
        g, u = (xd[rows] @ w1d[e].T).chunk(2, dim=-1)
        if clamp is not None:
            kept = bf16_as_stored_by_kernels(xd[rows].detach() @ w1_used[e].T)
            g, u = clamp_gate_up(g, u, clamp, kept.chunk(2, dim=-1))
        out = out.index_add(0, rows, (F.silu(g) * u) @ w2d[e].T * sd[rows, slots, None])
    sg, su, sdn = (t.double() for t in shared)
    out = out + (F.silu(xd @ sg.T) * (xd @ su.T)) @ sdn.T
    grads = torch.autograd.grad(out, leaves, grad_out.double())
    return (out.detach(), *grads)


def _layer_on_rank(rank, world, tokens, seed, clamp, fused, checkpointing):
    """One rank's layer as prime-rl calls it: x and the router's scores require grad, the experts are fp32
    parameters (DTensors over EP), the dispatcher is built with prime-rl's keywords."""
    x, index, scores, w1, w2, shared, grad_out = make_problem(tokens, seed, clamp)
    t0, t1 = sum(tokens[:rank]), sum(tokens[: rank + 1])
    mesh = None
    group = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        group = mesh.get_group("ep")
    experts = GroupedExperts(w1, w2, fused, clamp, mesh)
    shared_expert = SharedExpert(*shared)
    dispatcher = MegaMoETokenDispatcher(
        num_experts=EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_shared_experts=1,
        activation_clamp=clamp,
        group=group,
        max_tokens_per_rank=max(tokens),
        num_sms=None,
    )
    calls = []
    layer_forward = dispatcher.forward_experts

    def counted(*args):
        calls.append(torch.is_grad_enabled())
        return layer_forward(*args)

    dispatcher.forward_experts = counted
    xr = x[t0:t1].clone().requires_grad_()
    sr = scores[t0:t1].clone().requires_grad_()

    def block(x_in, scores_in):
        out = dispatcher.run_fused(x_in, scores_in.reshape(-1), index[t0:t1].reshape(-1), experts, shared_expert)
        dispatcher.synchronize()
        return out

    if checkpointing:
        from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

        def policy(ctx, op, *args, **kwargs):
            save = op == torch.ops.prime_megamoe.routed_experts.default
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        context = functools.partial(create_selective_checkpoint_contexts, policy)
        out = checkpoint(block, xr, sr, use_reentrant=False, context_fn=context)
    else:
        out = block(xr, sr)
    out.backward(grad_out[t0:t1])
    d_w1, d_w2 = experts.grads()
    return {
        "out": out.detach(),
        "dx": xr.grad,
        "dscores": sr.grad,
        "dw1": d_w1,
        "dw2": d_w2,
        "dtypes": (out.dtype, xr.grad.dtype, d_w1.dtype, d_w2.dtype),
        "calls": calls,
    }


def _check(per_rank, tokens, seed, clamp, world):
    """Every rank's outputs and gradients against the float64 reference; dropped slots get no score gradient."""
    x, index, scores, w1, w2, shared, grad_out = make_problem(tokens, seed, clamp)
    ref_out, ref_dx, ref_ds, ref_dw1, ref_dw2 = reference(x, index, scores, w1, w2, shared, grad_out, clamp)
    local = EXPERTS // world
    for rank, got in enumerate(per_rank):
        t0, t1 = sum(tokens[:rank]), sum(tokens[: rank + 1])
        e0, e1 = rank * local, (rank + 1) * local
        assert got["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
        pairs = (
            ("out", got["out"], ref_out[t0:t1]),
            ("dx", got["dx"], ref_dx[t0:t1]),
            ("d scores", got["dscores"], ref_ds[t0:t1]),
            ("d gate_up_proj", got["dw1"], ref_dw1[e0:e1]),
            ("d down_proj", got["dw2"], ref_dw2[e0:e1]),
        )
        for name, a, b in pairs:
            assert a.shape == b.shape, f"rank {rank} {name}: {tuple(a.shape)} != {tuple(b.shape)}"
            err = rel_err(a.double(), b)
            assert err <= TOL, f"rank {rank} {name}: relative error {err:.3e} > {TOL}"
        assert (got["dscores"][scores[t0:t1] == 0] == 0).all(), f"rank {rank}: a dropped slot got a score gradient"
    assert (scores == 0).any(), "the problem has no dropped slot"


def _ep_body(rank, world, runs):
    return [_layer_on_rank(rank, world, *run) for run in runs]


# (tokens per rank, seed, clamp, fused gate/up, selective checkpointing)
EP_RUNS = {
    1: [([14], 11, None, True, True), ([9], 12, 2.0, False, False)],
    2: [([10, 7], 21, 2.0, False, True)],
    4: [([6, 0, 5, 4], 41, None, True, False)],
}


@pytest.mark.parametrize("world", sorted(EP_RUNS))
def test_dispatcher_as_prime_rl_calls_it(world):
    runs = EP_RUNS[world]
    if world == 1:
        per_run = [[_layer_on_rank(0, 1, *run)] for run in runs]
    else:
        per_rank = run_on_ranks(_ep_body, world, runs)
        per_run = [[per_rank[r][i] for r in range(world)] for i in range(len(runs))]
    for run, results in zip(runs, per_run):
        tokens, seed, clamp, fused, checkpointing = run
        _check(results, tokens, seed, clamp, world)
        # The op runs once without grad (the forward) and once with it (its backward); a saved output is not
        # recomputed under selective checkpointing.
        for got in results:
            assert got["calls"] == [False, True], got["calls"]


# ---------------------------------------------------------------------------------------------------------------
# Config: prime-rl's table


def test_prime_rl_table_defaults_and_conversion():
    table = MegaMoEDispatchConfig()
    assert (table.type, table.max_tokens_per_rank, table.num_sms, table.fp8, table.capacity_factor) == (
        "mega_moe",
        None,
        None,
        False,
        1.25,
    )
    assert table.resolved_precision == "bf16"
    assert MegaMoEDispatchConfig(fp8=True).resolved_precision == "fp8"
    assert MegaMoEDispatchConfig(fp8=True, precision="mxfp8").resolved_precision == "mxfp8"
    converted = MegaMoEDispatchConfig(transport="collectives").to_dispatch_config(seq_len=4096)
    assert (converted.type, converted.max_tokens_per_rank, converted.transport) == ("mega_moe", 4096, "collectives")
    assert MegaMoEDispatchConfig(max_tokens_per_rank=512).to_dispatch_config(4096).max_tokens_per_rank == 512
    options = MegaMoEDispatchConfig(fp8=True, comm_timeout_s=5.0).dispatcher_options()
    assert options["precision"] == "fp8" and options["comm_timeout_s"] == 5.0
    with pytest.raises(ValueError, match="wgrad_tile_scalez"):
        MegaMoEDispatchConfig(wgrad_tile_scalez=True)


def test_our_config_reads_prime_rl_table(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model.moe.dispatch]\ntype = "mega_moe"\nfp8 = true\ncapacity_factor = 1.5\nnum_sms = 120\n')
    moe = load_config(path).model.moe
    assert (moe.precision, moe.dispatch.max_tokens_per_rank, moe.dispatch.num_sms) == ("fp8", None, 120)
    with pytest.raises(ValueError, match="fp8 = true"):
        MoEConfig(precision="mxfp8", dispatch={"fp8": True})


# ---------------------------------------------------------------------------------------------------------------
# What the kernels cannot compute is refused, naming it


def _dispatcher(**kw):
    args = dict(
        num_experts=EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        group=None,
        max_tokens_per_rank=None,
    )
    args.update(kw)
    return MegaMoETokenDispatcher(**args)


def test_refuses_what_it_cannot_compute():
    x, index, scores, w1, w2, _, _ = make_problem([4], 5, None)
    experts = GroupedExperts(w1, w2, True, None)
    experts.down_proj_bias = nn.Parameter(torch.zeros(EXPERTS, HIDDEN))
    with pytest.raises(ValueError, match="down_proj_bias"):
        _dispatcher().run(x, scores, index, experts)

    class Relu2:
        pass

    experts = GroupedExperts(w1, w2, True, None)
    experts.activation = Relu2
    with pytest.raises(ValueError, match="Relu2"):
        _dispatcher().run(x, scores, index, experts)
    experts.activation = ClampedSilu(7.0)
    with pytest.raises(ValueError, match="activation_clamp = 7.0"):
        _dispatcher(activation_clamp=3.0).run(x, scores, index, experts)
    with pytest.raises(NotImplementedError, match="score_before_experts"):
        _dispatcher().run(x, scores, index, GroupedExperts(w1, w2, True, None), score_before_experts=True)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="activation_clamp"):
            _dispatcher(activation_clamp=bad)
    with pytest.raises(ValueError, match="comm_timeout_z"):
        _dispatcher(comm_timeout_z=3)
    with pytest.raises(ValueError, match="top_k"):
        _dispatcher().run(x, scores[:, :1], index[:, :1], GroupedExperts(w1, w2, True, None))
    assert _dispatcher(activation_clamp=float("inf")).activation_clamp is None
    assert _dispatcher(fp8=True).precision == "fp8"
    assert _dispatcher().synchronize() is None


def test_compiled_block_around_the_dispatcher():
    """The block around the dispatcher under torch.compile (AOTAutograd's eager backend: no C++ compiler needed),
    as prime-rl compiles its decoder blocks: the op runs at its graph break, and output and every gradient are the
    eager block's bits."""
    x, index, scores, w1, w2, _, grad_out = make_problem([12], 13, None)
    experts = GroupedExperts(w1, w2, True, None)
    dispatcher = _dispatcher(max_tokens_per_rank=12)

    def block(x_in, scores_in):
        return dispatcher.run(x_in, scores_in.reshape(-1), index.reshape(-1), experts) * 1.0

    def grads_of(fn):
        leaves = [x.clone().requires_grad_(), scores.clone().requires_grad_()]
        experts.zero_grad(set_to_none=True)
        out = fn(*leaves)
        out.backward(grad_out)
        return (out.detach(), *(t.grad for t in leaves), experts.gate_up_proj.grad, experts.down_proj.grad)

    eager = grads_of(block)
    compiled = grads_of(torch.compile(block, backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), "the compiled block differs from the eager one"


# ---------------------------------------------------------------------------------------------------------------
# On a GPU: the stand-in at the Qwen3-30B-A3B layer shape, and the op inside a compiled block


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_qwen3_shape_and_compiled_block(precision):
    """fp32 master weights (fused gate/up) and bf16 activations at H = 2048, I = 768, 128 experts, top-8, T = 2048,
    zero-score slots: outputs and gradients against float64 within the bounds of the layer's own GPU tests (bf16:
    2e-2; fp8: the fp8 oracle bound); then the block around the dispatcher under torch.compile gives the eager
    block's bits (the op runs eagerly at its graph break, as prime-rl compiles its decoder blocks)."""
    from .test_fp8_experts import ORACLE_TOL

    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 2048, 2048, 768, 128, 8
    dev = torch.device("cuda")
    w1 = (torch.randn(experts, 2 * inter, hidden) * hidden**-0.5).to(dev)
    w2 = (torch.randn(experts, hidden, inter) * inter**-0.5).to(dev)
    module = GroupedExperts(w1, w2, fused=True, clamp=None).to(dev)
    x = torch.randn(tokens, hidden, device=dev).bfloat16().requires_grad_()
    scores, index = torch.softmax(torch.randn(tokens, experts, device=dev), -1).topk(top_k, dim=-1)
    scores = (scores / scores.sum(-1, keepdim=True)).masked_fill(torch.rand(tokens, top_k, device=dev) < 0.05, 0.0)
    scores = scores.requires_grad_()
    grad_out = torch.randn(tokens, hidden, device=dev).bfloat16()
    dispatcher = MegaMoETokenDispatcher(
        num_experts=experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=inter,
        group=None,
        max_tokens_per_rank=tokens,
        precision=precision,
    )

    def block(x_in, scores_in):
        return dispatcher.run(x_in, scores_in, index, module) * 1.0

    out = block(x, scores)
    out.backward(grad_out)
    got = (out.detach(), x.grad, scores.grad, module.gate_up_proj.grad, module.down_proj.grad)
    dropped_ids = index.masked_fill(scores.detach() == 0, -1)
    ref = reference(
        x,
        dropped_ids.clamp(min=0),
        scores.detach(),
        w1,
        w2,
        (torch.zeros(1, hidden, device=dev),) * 2 + (torch.zeros(hidden, 1, device=dev),),
        grad_out,
        None,
    )
    tol = 2e-2 if precision == "bf16" else ORACLE_TOL
    for name, a, b in zip(("out", "dx", "d scores", "d gate_up_proj", "d down_proj"), got, ref):
        err = rel_err(a.double(), b)
        assert err <= tol, f"{precision} {name}: relative error {err:.3e} > {tol}"

    eager = [t.clone() for t in got]
    for t in (x, scores, module.gate_up_proj, module.down_proj):
        t.grad = None
    compiled = torch.compile(block)
    out = compiled(x, scores)
    out.backward(grad_out)
    again = (out.detach(), x.grad, scores.grad, module.gate_up_proj.grad, module.down_proj.grad)
    assert all(torch.equal(a, b) for a, b in zip(eager, again)), "the compiled block differs from the eager one"
