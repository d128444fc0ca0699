"""The clamped SwiGLU (``activation_clamp``, prime-rl's experts option): a = silu(min(g, c)) * clamp(u, -c, c), its
gradient zero where g or u was clamped (torch.clamp's convention: it passes where g <= c and where -c <= u <= c).

Every backend and precision against a float64 reference of the clamped layer (``tests.oracle.loop_reference``: the
transformers oracle has no clamp), the output and the four gradients, with ragged routing and a limit that clamps
20-50% of the routed g and u values; each check also asserts that the result is far (beyond three tolerances) from
the unclamped oracle's, so a path that ignored the clamp fails. Then the SwiGLU backward passes (bf16 rows, fp8
quantising) at the limit itself, with values planted exactly at +-c (the bounds pass the gradient); the limits that
mean plain SwiGLU (None, inf) running the unclamped kernels; bad limits. Expert parallelism with the clamp:
tests/test_mega_moe_ep.py; the Gluon kernels with CLAMP compiled for sm_90: the register-check tests.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from prime_megamoe import fused_experts
from prime_megamoe.kernels import tuning
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops import launch
from prime_megamoe.ops.activation import check_activation_clamp, clamp_kernel_args
from prime_megamoe.ops.expert_compute import routed_experts
from prime_megamoe.ops.quantized_experts import routed_experts_quantized
from prime_megamoe.ops.routing_plan import build_routing_plan

from .oracle import (
    NAMES,
    bf16_as_stored_by_kernels,
    clamped_fractions,
    make_problem,
    oracle_with_grads,
    ragged_routing,
    rel_err,
    routed_h,
    run_mega_moe,
)
from .test_fp8_experts import EMULATION_TOL, ORACLE_TOL, _dequant_cols_t, _emulate, _fake_quant, _fake_quant_halves
from .test_fp8_experts import _problem as _fp8_problem
from .test_fp8_experts import _run as _run_quantized

# h = x W1^T has unit variance in these problems: ~23% of g lie above 0.75 and ~45% of u outside [-0.75, 0.75].
# (0.75 is exact in bf16 and fp32, so values planted at the limit are exactly at it for the kernels too.)
LIMIT = 0.75


def _bf16_rounded(t):
    return t.to(torch.bfloat16).to(t.dtype)


def _assert_clamped_fractions(x, index, w1):
    g_frac, u_frac = clamped_fractions(x, index, w1, LIMIT)
    assert 0.2 <= g_frac <= 0.5 and 0.2 <= u_frac <= 0.5, (g_frac, u_frac)


def _check(got, problem, ref, tol, label):
    """``got`` (out, dx, dweights, dW1, dW2) within ``tol`` of ``ref`` and beyond 3 * tol of the unclamped oracle."""
    x, index, weights, w1, w2, grad_out = problem
    plain = oracle_with_grads(x, index, weights, w1, w2, grad_out)
    for name, a, b, p, like in zip(NAMES, got, ref, plain, (x, x, weights, w1, w2)):
        assert a.shape == like.shape and a.dtype == like.dtype, f"{label} {name}: {a.shape} {a.dtype}"
        assert torch.isfinite(a).all(), f"{label} {name}: non-finite values"
        err, off = rel_err(a, b), rel_err(a, p)
        assert err <= tol, f"{label} {name}: relative error {err:.3e} > {tol:.0e} against the clamped reference"
        assert off > 3 * tol, f"{label} {name}: only {off:.3e} from the unclamped oracle: the clamp did not act"


# ----------------------------------------------------------------------------------------------------------------
# The reference and the option's values


def test_reference_with_an_unreached_limit_is_the_transformers_oracle():
    # The clamped reference is the loop reference; with a limit no value reaches, it is the transformers oracle.
    problem = make_problem(15, 24, 12, 6, 3, torch.float64, seed=11, routing="ragged")
    x, index, weights, w1, w2, grad_out = problem
    oracle = oracle_with_grads(*problem)
    for decided_on in (None, _bf16_rounded):
        loose = oracle_with_grads(*problem, activation_clamp=1e9, clamp_decided_on=decided_on)
        for name, a, b in zip(NAMES, loose, oracle):
            assert rel_err(a, b) < 1e-12, name


def test_bad_limits_are_errors_that_name_the_option():
    x, index, weights, w1, w2, _ = make_problem(3, 24, 8, 4, 2, torch.float32, seed=1)
    for dispatch in ("mega_moe", "torch"):
        for bad in (0, 0.0, -0.0, -1.5, float("nan"), float("-inf")):
            with pytest.raises(ValueError, match=r"activation_clamp = .*must be > 0"):
                fused_experts(x, index, weights, w1, w2, dispatch=dispatch, activation_clamp=bad)
        for bad in ("1.0", True, torch.tensor(1.0)):
            with pytest.raises(TypeError, match="activation_clamp must be a number"):
                fused_experts(x, index, weights, w1, w2, dispatch=dispatch, activation_clamp=bad)
    # The layers' own entry points and the launchers check it too (before any kernel runs).
    kw = {"expert_base": 0, "tile_m": tuning.tile_m(), "activation_clamp": -1.0}
    with pytest.raises(ValueError, match="activation_clamp"):
        routed_experts(x, index, weights, w1, w2, **kw)
    with pytest.raises(ValueError, match="activation_clamp"):
        routed_experts_quantized(x, index, weights, w1, w2, precision="fp8", **kw)
    with pytest.raises(ValueError, match="activation_clamp"):
        launch.fc1_swiglu(x, w1, None, save_h=False, activation_clamp=float("nan"))
    with pytest.raises(ValueError, match="activation_clamp"):
        fl.fp8_fc1_swiglu(None, None, None, fl.fp8_format(), inter=8, h_dtype=None, activation_clamp=0.0)


def test_plain_swiglu_limits_run_the_unclamped_kernels(monkeypatch):
    """None, +inf and a limit above every finite fp32 value mean plain SwiGLU: the kernels get CLAMP False (their
    plain SwiGLU form, the kernels compiled before the option existed) and give its bits."""
    for plain in (None, math.inf, 1e39):
        assert check_activation_clamp(plain) is None and clamp_kernel_args(plain) == (0.0, False)
    assert check_activation_clamp(np.float32(2.5)) == 2.5 and clamp_kernel_args(3) == (3.0, True)
    x, index, weights, w1, w2, _ = make_problem(9, 24, 8, 4, 2, torch.float32, seed=2)
    seen = []
    real_launch = launch.launch

    def spy(kernel, grid, *args, **constexprs):
        if "CLAMP" in constexprs:
            seen.append(constexprs["CLAMP"])
        return real_launch(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(launch, "launch", spy)
    with torch.no_grad():
        inf = fused_experts(x, index, weights, w1, w2, activation_clamp=math.inf)
    assert seen == [False]  # the FC1 + SwiGLU launch
    plain = oracle_with_grads(x, index, weights, w1, w2, torch.zeros_like(x))[0]
    assert rel_err(inf, plain) < 1e-5


# ----------------------------------------------------------------------------------------------------------------
# The layer, unquantised (precision "bf16": the inputs' dtype) on both backends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unquantized_layer_matches_the_clamped_reference(dtype):
    """mega_moe and torch, fp32 and bf16 data. In bf16 both keep h in bf16 and their backward decides from it which
    elements were clamped: an element within a bf16 rounding of +-c may go either way, and its gradient jumps there
    (from da * u * silu'(c) to 0; a few such elements cost 2-5% of a gradient's norm against the exact reference).
    So the bf16 reference decides the clamp on h rounded as each layer stores it (``oracle.clamp_gate_up``): torch
    rounds to nearest, the Triton kernels to nearest on a GPU and toward zero under the interpreter."""
    problem = make_problem(24, 32, 16, 4, 2, dtype, seed=17, routing="ragged")
    x, index, weights, w1, w2, grad_out = problem
    _assert_clamped_fractions(x, index, w1)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for dispatch, decided_on in (("mega_moe", bf16_as_stored_by_kernels), ("torch", _bf16_rounded)):
        decided_on = decided_on if dtype == torch.bfloat16 else None
        ref = oracle_with_grads(*problem, activation_clamp=LIMIT, clamp_decided_on=decided_on)
        got = run_mega_moe(*problem, dispatch=dispatch, activation_clamp=LIMIT)
        _check(got, problem, ref, tol, f"{dispatch} {dtype}")


# ----------------------------------------------------------------------------------------------------------------
# The backward passes at the limit itself


def _plant_limits(h: torch.Tensor, inter: int, limit: float) -> torch.Tensor:
    """h [P, 2I] with g values exactly at the limit and one fp32 step above it, u values exactly at +-limit and one
    step outside, spread over the rows and columns."""
    g, u = h[:, :inter], h[:, inter:]
    up = torch.nextafter(torch.tensor(limit), torch.tensor(math.inf)).item()
    n = torch.arange(g.numel()).view(g.shape)  # element numbers of one half, row-major
    g[n % 5 == 0] = limit
    g[n % 7 == 1] = up
    u[n % 6 == 0] = limit
    u[n % 6 == 3] = -limit
    u[n % 11 == 1] = up
    u[n % 13 == 2] = -up
    return h


def _clamped_dswiglu_reference(g_a, h, w, inter, limit):
    """float64 (dh = [dg | du], a) of the clamped SwiGLU from g_a = dy W2 [P, I], h [P, 2I], the rows' weights w."""
    g, u = h.double()[:, :inter], h.double()[:, inter:]
    g_ok, u_ok = g <= limit, (u >= -limit) & (u <= limit)
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    sig = torch.sigmoid(g)
    silu = g * sig
    da = g_a.double() * w
    return torch.cat([da * u * (sig + silu * (1 - sig)) * g_ok, da * silu * u_ok], 1), silu * u, g_ok, u_ok


def _sorted_problem(rows, top_k, experts, hidden, inter, tile_m, seed):
    """A routing plan (ragged: an empty expert, a hot one) with weights in [0.5, 1] (a router's can be ~1e-44, which
    leaves nothing to check in that row), dy, W2 and h with values planted at the limit."""
    index, _ = ragged_routing(rows, experts, top_k, seed=seed, hot_fraction=0.8)
    gen = torch.Generator().manual_seed(seed)
    weights = 0.5 + 0.5 * torch.rand(rows, top_k, generator=gen)
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=experts, tile_m=tile_m)
    dy = torch.randn(rows, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    h = _plant_limits(torch.randn(plan.num_pairs, 2 * inter, generator=gen), inter, LIMIT)
    return plan, dy, w2, h


def test_backward_row_pass_at_the_limit():
    """The bf16 path's FC2 dgrad + SwiGLU backward row pass (fp32 data) against float64: dh zero exactly where g or
    u was clamped, nonzero at the limit itself (inclusive bounds), and aw = w * a and dw = <g_a, a> from the clamped
    a. Ragged routing (an empty expert), I not a multiple of the column block."""
    rows, top_k, experts, hidden, inter = 30, 2, 4, 24, 20
    plan, dy, w2, h = _sorted_problem(rows, top_k, experts, hidden, inter, tuning.tile_m(), seed=6)
    dh, aw, dw_row = launch.fc2_dgrad_dswiglu(dy, w2, h, plan, activation_clamp=LIMIT)
    src, offsets = plan.row_src.long(), plan.expert_offsets.tolist()
    g_a = torch.cat([dy.double()[src[offsets[e] : offsets[e + 1]]] @ w2[e].double() for e in range(experts)])
    w = plan.row_weight.double()[:, None]
    want, act, g_ok, u_ok = _clamped_dswiglu_reference(g_a, h, w, inter, LIMIT)
    assert rel_err(dh, want) < 1e-6 and rel_err(aw, w * act) < 1e-6
    assert rel_err(dw_row, (g_a * act).sum(1)) < 1e-6
    dg, du = dh[:, :inter], dh[:, inter:]
    assert torch.equal(dg[~g_ok], torch.zeros_like(dg[~g_ok])) and torch.equal(du[~u_ok], torch.zeros_like(du[~u_ok]))
    at_g, at_u = h[:, :inter] == LIMIT, h[:, inter:].abs() == LIMIT
    assert at_g.sum() > 10 and at_u.sum() > 10 and (dg[at_g] != 0).all() and (du[at_u] != 0).all()


def test_quantising_backward_pass_at_the_limit():
    """The quantised path's FC2 dgrad + SwiGLU backward (row outputs, and the column outputs of the Triton launch: the
    Gluon one is checked against it on GPUs) against float64 on the same quantised operands: dh row-scaled, dh^T and
    (w * a)^T column-scaled, the recipe's fake quantisation of the clamped float64 values; dw exact up to fp32 sums;
    dh zero where clamped, passing at the limit. A two-tile expert and an empty one. The fp8 format: the clamp comes
    before the format's quantisers (mxfp8 with the clamp: the layer test against the emulated recipe)."""
    fmt = fl.fp8_format()
    rows, top_k, experts, hidden, inter = 80, 2, 4, 64, 64
    plan, dy, w2, h = _sorted_problem(rows, top_k, experts, hidden, inter, 128, seed=8)
    dyq, w2q = fl.quantize_rows(dy, fmt), fl.quantize_w2_bwd(w2, fmt)
    d = fl.fp8_fc2_dgrad_dswiglu(dyq, w2q, h, plan, fmt, activation_clamp=LIMIT)
    dy_deq, w2t_deq = fl.dequantize_rows(dyq, fmt).double(), fl.dequantize_weight(w2q, fmt).double()
    src, offsets = plan.row_src.long(), plan.expert_offsets.tolist()
    g_a = torch.cat([dy_deq[src[offsets[e] : offsets[e + 1]]] @ w2t_deq[e].T for e in range(experts)])
    w = plan.row_weight.double()[:, None]
    dh, act, g_ok, u_ok = _clamped_dswiglu_reference(g_a, h, w, inter, LIMIT)
    assert rel_err(d.dw_row.double(), (g_a * act).sum(1)) < 1e-5
    g_k, pow2 = (32, True) if fmt.mx else (128, fmt.pow2)
    dh_rows = fl.dequantize_rows(d.dh_rows, fmt, segments=2).double()
    want_rows = _fake_quant_halves(dh, 1, g_k, pow2, 1)
    assert rel_err(dh_rows, want_rows) < 1e-3
    cut = torch.cat([~g_ok, ~u_ok], 1)
    at_limit = torch.cat([h[:, :inter] == LIMIT, h[:, inter:].abs() == LIMIT], 1)
    # Zero where clamped; at the limit itself the gradient passes (a value far below its block's maximum may still
    # quantise to zero, in the reference too: compared as a whole, not element by element).
    assert (dh_rows[cut] == 0).all() and rel_err(dh_rows[at_limit], want_rows[at_limit]) < 1e-3
    dh_t, aw_t = _dequant_cols_t(d.dh_t, fmt), _dequant_cols_t(d.aw_t, fmt)
    for t in range(int(plan.num_tiles[0])):
        e, r0 = int(plan.tile_expert[t]), int(plan.tile_row[t])
        r1 = min(r0 + 128, offsets[e + 1])
        for got, ref in ((dh_t, dh), (aw_t, act * w)):
            tile = torch.zeros(128, ref.shape[1], dtype=torch.float64)
            tile[: r1 - r0] = ref[r0:r1]
            assert rel_err(got[:, 128 * t : 128 * (t + 1)], _fake_quant(tile.T.contiguous(), 1, g_k, pow2)) < 1e-3, t
        assert (dh_t[:, 128 * t : 128 * t + r1 - r0][cut[r0:r1].T] == 0).all(), t


# ----------------------------------------------------------------------------------------------------------------
# The layer, quantised


def _quantized_forward_h(precision, x, index, w1):
    """[T, k, 2I] float64: h as the quantised forward computes (and keeps) it, from the recipe's e4m3 x and W1 (fp8,
    mxfp8); None for fp8_bwd, whose bf16-kernel forward keeps these fp32 inputs' h to fp32 rounding."""
    if precision == "fp8_bwd":
        return None
    g_k, w_rows, pow2 = (32, 1, True) if precision == "mxfp8" else (128, 128, False)
    xq = _fake_quant(x, 1, g_k, pow2)
    w1q = torch.stack([_fake_quant_halves(w, w_rows, g_k, pow2, 0) for w in w1])
    return routed_h(xq, index, w1q)


# Against float64 the clamped fp8 / mxfp8 recipe measured 7.0-7.9% (out, dx, dW1, dW2) and 6.8-9.3% (d top-k
# weights) over three seeds at this shape and limit, 0.5-1% above the unclamped recipe on the same problems (6.2-6.9%,
# 5.2-8.2%); fp8_bwd 3-5% either way. The kernels matched the emulated recipe to 1e-7 each time: that bound
# (EMULATION_TOL) is the test of the kernels, the float64 one of the recipe.
CLAMPED_ORACLE_TOL = {"fp8": 0.1, "mxfp8": 0.1, "fp8_bwd": ORACLE_TOL}


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd", "mxfp8"])
def test_quantized_layer_matches_the_clamped_reference(precision):
    """Against the float64 clamped reference (``CLAMPED_ORACLE_TOL``), and against the torch emulation of the recipe
    (same blocks, scales and roundings, float64 GEMMs) with the clamp within the tight bound. An empty expert, a hot
    one; H and I not multiples of 128. The fp8 and mxfp8 forwards compute h from e4m3 operands (~4% off), and the
    backward can only decide from that h which elements were clamped; where the two decisions differ the gradient
    jumps (from da * u * silu'(c) to 0), which put dx and dW1 ~20% off a reference deciding on the exact h. So the
    reference decides the clamp on the forward's h (``_quantized_forward_h``) and computes everything else exactly."""
    problem = _fp8_problem(tokens=40, hidden=96, inter=64, experts=4, top_k=2, seed=23)
    x, index, weights, w1, w2, grad_out = problem
    _assert_clamped_fractions(x, index, w1)
    got = _run_quantized(precision, *problem, activation_clamp=LIMIT)
    decided_on = _quantized_forward_h(precision, x, index, w1)
    ref = oracle_with_grads(*problem, activation_clamp=LIMIT, clamp_decided_on=decided_on)
    _check(got, problem, ref, CLAMPED_ORACLE_TOL[precision], precision)
    emulated = _emulate(precision, *problem, activation_clamp=LIMIT)
    for name, a, b in zip(NAMES, got, emulated):
        assert rel_err(a, b) < EMULATION_TOL, f"{precision} {name}: {rel_err(a, b):.2e} against the emulated recipe"
