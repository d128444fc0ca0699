"""The `torch` backend's precision = "fp8" (rowwise-scaled e4m3 grouped GEMMs, ``ops.fp8_grouped_mm``).

On CPU it runs the reference form of the recipe; here it is checked against
- the float64 transformers oracle within the fused fp8 tests' bound (ORACLE_TOL: e4m3's own noise), outputs and all
  four gradients, ragged routing (an empty expert, a hot one), the clamped SwiGLU, empty (-1) slots (EP = 2 over
  gloo: in tests/test_torch_backend.py, which runs it in the same processes as the bf16 EP cases);
- a float64 emulation of the recipe written out by hand here (which operand is scaled along which dim, the manual
  backward), within EMULATION_TOL, so a wrong scale or operand fails even where the oracle's bound would hide it;
- per GEMM: the reference form equals a plain dequantise-and-matmul, and the op form's arguments pass
  torch._scaled_grouped_mm's own checks (its meta kernel, on the meta device).
The GPU test compares the torch._scaled_grouped_mm form with the reference form (skipped without a Hopper GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prime_megamoe import fused_experts
from prime_megamoe.ops import fp8_grouped_mm as fg

from .oracle import assert_matches_oracle, clamped_fractions, oracle_with_grads, ragged_routing, rel_err, run_mega_moe
from .test_fp8_experts import EMULATION_TOL, ORACLE_TOL

NAMES = ("out", "d_hidden_states", "d_top_k_weights", "d_gate_up_proj", "d_down_proj")


def fp8_problem(tokens, hidden, inter, experts, top_k, seed, dtype=torch.float32, **routing):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    grad_out = torch.randn(tokens, hidden, generator=gen)
    index, weights = ragged_routing(tokens, experts, top_k, seed=seed, **routing)
    x, weights, w1, w2, grad_out = (t.to(dtype) for t in (x, weights, w1, w2, grad_out))
    return x, index, weights, w1, w2, grad_out


def run_fp8(x, index, weights, w1, w2, grad_out, **kwargs):
    return run_mega_moe(x, index, weights, w1, w2, grad_out, dispatch="torch", precision="fp8", **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# The quantisation and one grouped GEMM at a time


def _fake_quant(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded onto e4m3 with one scale (amax / 448 in fp32, at least 2**-126; 1 for zeros) per slice along ``dim``,
    in float64 (written independently of the module: the scale's definition and torch's e4m3 rounding)."""
    xd = x.double()
    amax = xd.abs().amax(dim=dim, keepdim=True)
    scale = torch.where(amax > 0, (amax / 448.0).float().clamp(min=2.0**-126).double(), torch.ones_like(amax))
    return (xd / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale


def test_quantize_rows_and_group_cols():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(23, 40, generator=gen) * torch.logspace(-3, 3, 23)[:, None]
    x[5] = 0.0  # an all-zero row: scale 1, zeros
    q, s = fg.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (23,)
    assert s[5] == 1.0 and (q[5].float() == 0).all()
    amax = x.abs().amax(-1)
    nz = amax > 0
    torch.testing.assert_close(s[nz], amax[nz] / 448.0, rtol=0, atol=0)
    assert (q.float()[nz].abs().amax(-1) == 448.0).all()  # each row's largest element lands on e4m3's maximum
    deq = q.double() * s.double()[:, None]
    torch.testing.assert_close(deq, _fake_quant(x, -1), rtol=0, atol=0)
    assert ((deq - x.double()).abs() <= 2.0**-4 * x.double().abs() + 2.0**-9 * s.double()[:, None]).all()

    counts = [0, 7, 16, 0]
    rows = torch.randn(23, 12, generator=gen)
    q, s = fg.quantize_group_cols(rows, counts)
    assert s.shape == (4, 12) and (s[0] == 1).all() and (s[3] == 1).all()
    deq = q.double() * s.double()[fg._group_ids(counts, rows.device)]
    want = torch.cat([_fake_quant(part, 0) for part in rows.split([7, 16])])
    torch.testing.assert_close(deq, want, rtol=0, atol=0)


def test_reference_grouped_gemms_are_dequantise_and_matmul():
    gen = torch.Generator().manual_seed(1)
    counts = [9, 0, 30, 1]  # an empty group and a one-row group
    rows, k, n = sum(counts), 48, 40
    a = torch.randn(rows, k, generator=gen)
    b = torch.randn(len(counts), n, k, generator=gen)
    a_q, a_s = fg.quantize_rows(a)
    b_q, b_s = fg.quantize_rows(b)
    got = fg.grouped_mm_rows(a_q, a_s, b_q, b_s, counts, torch.float32, use_op=False)
    a_d, b_d = a_q.double() * a_s.double()[:, None], b_q.double() * b_s.double()[..., None]
    group = fg._group_ids(counts, a.device)
    want = torch.stack([a_d[r] @ b_d[group[r]].T for r in range(rows)])
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6

    # Groups along the reduction: out[g] = A_g^T B_g over group g's rows; an empty group gives zeros.
    c = torch.randn(rows, 24, generator=gen)
    a_q, a_s = fg.quantize_group_cols(a, counts)
    c_q, c_s = fg.quantize_group_cols(c, counts)
    got = fg.grouped_mm_cols(a_q, a_s, c_q, c_s, counts, torch.bfloat16, use_op=False)
    a_d, c_d = a_q.double() * a_s.double()[group], c_q.double() * c_s.double()[group]
    want = torch.stack([a_d[group == g].T @ c_d[group == g] for g in range(len(counts))])
    assert got.shape == (4, k, 24) and got.dtype == torch.bfloat16 and (got[1] == 0).all()
    assert rel_err(got, want) < 4e-3  # the bf16 output's rounding


@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="this torch has no _scaled_grouped_mm")
def test_op_form_arguments_pass_torchs_checks():
    # The meta kernel runs the checks of the CUDA one (dtypes, row/column-major operands, 16-byte strides, scale
    # shapes, int32 offsets): the op form's calls, on meta tensors, at every GEMM shape the layer issues.
    counts = [5, 0, 37, 16]
    rows, k, n = sum(counts), 64, 96
    meta = torch.device("meta")
    x, w, dy = torch.empty(rows, k, device=meta), torch.empty(4, n, k, device=meta), torch.empty(rows, n, device=meta)
    fwd = fg.grouped_mm_rows(*fg.quantize_rows(x), *fg.quantize_rows(w), counts, torch.float32, use_op=True)
    assert fwd.shape == (rows, n) and fwd.dtype == torch.float32
    wt = w.transpose(1, 2)
    dgrad = fg.grouped_mm_rows(*fg.quantize_rows(dy), *fg.quantize_rows(wt), counts, torch.bfloat16, use_op=True)
    assert dgrad.shape == (rows, k)
    wgrad = fg.grouped_mm_cols(
        *fg.quantize_group_cols(dy, counts), *fg.quantize_group_cols(x, counts), counts, torch.float32, use_op=True
    )
    assert wgrad.shape == (4, n, k)


def test_op_is_used_only_where_it_runs(monkeypatch):
    assert not fg.can_use_scaled_grouped_mm(torch.device("cpu"), 64, 64)
    monkeypatch.setattr(fg, "IMPLEMENTATION", "op")
    with pytest.raises(RuntimeError, match="Hopper"):
        fg._use_op(torch.device("cpu"), 64, 64)


# ---------------------------------------------------------------------------------------------------------------
# The layer on one rank: the oracle, and a float64 emulation of the recipe


def emulate(x, index, weights, w1, w2, grad_out, activation_clamp=None):
    """(out, dx, dweights, dW1, dW2) of the fp8 recipe in float64 with a hand-written backward: per expert, every GEMM
    operand fake-quantised along that GEMM's reduction dim (rows of activations and of weights; the weight gradients'
    operands per column over the expert's rows). Slots with id -1 contribute nothing."""
    x, weights, w1, w2, dy = (t.double() for t in (x, weights, w1, w2, grad_out))
    inter = w2.shape[-1]
    out, dx, dwt = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(weights)
    dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
    for e in range(w1.shape[0]):
        tok, slot = (index == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe, we, dye = x[tok], weights[tok, slot][:, None], dy[tok]
        h = _fake_quant(xe, 1) @ _fake_quant(w1[e], 1).T
        g, u = h[:, :inter], h[:, inter:]
        gc, uc = (
            (g, u)
            if activation_clamp is None
            else (g.clamp(max=activation_clamp), u.clamp(-activation_clamp, activation_clamp))
        )
        a = F.silu(gc) * uc
        o = _fake_quant(a, 1) @ _fake_quant(w2[e], 1).T
        out.index_add_(0, tok, we * o)
        dwt[tok, slot] = (dye * o).sum(1)
        do = we * dye
        da = _fake_quant(do, 1) @ _fake_quant(w2[e], 0)  # W2 [H, I] scaled along H (per column)
        sig = torch.sigmoid(gc)
        dg = da * uc * sig * (1 + gc * (1 - sig))
        du = da * F.silu(gc)
        if activation_clamp is not None:
            dg = dg * (g <= activation_clamp)
            du = du * (u.abs() <= activation_clamp)
        dh = torch.cat([dg, du], 1)
        dx.index_add_(0, tok, _fake_quant(dh, 1) @ _fake_quant(w1[e], 0))
        dw2[e] = _fake_quant(do, 0).T @ _fake_quant(a, 0)
        dw1[e] = _fake_quant(dh, 0).T @ _fake_quant(xe, 0)
    return out, dx, dwt, dw1, dw2


def check_emulation(got, want, label):
    for name, a, b in zip(NAMES, got, want):
        err = rel_err(a, b)
        assert err < EMULATION_TOL, f"{label} {name}: {err:.2e} vs the emulated recipe"


SINGLE = [
    # (label, tokens, hidden, inter, experts, top_k, seed, dtype)
    ("ragged_k4", 40, 64, 48, 8, 4, 2, torch.float32),
    ("ragged_odd", 17, 40, 24, 6, 3, 4, torch.float32),
    ("ragged_bf16", 48, 96, 32, 4, 2, 5, torch.bfloat16),
]


@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c[0])
def test_single_rank_fp8_matches_oracle_and_recipe(case):
    label, tokens, hidden, inter, experts, top_k, seed, dtype = case
    problem = fp8_problem(tokens, hidden, inter, experts, top_k, seed, dtype, empty_expert=0, hot_expert=1)
    x, index, weights, w1, w2, grad_out = problem
    counts = torch.bincount(index.reshape(-1), minlength=experts)
    assert counts[0] == 0 and counts[1] == counts.max()
    got = run_fp8(*problem)
    assert_matches_oracle(got, *problem, ORACLE_TOL)
    if dtype == torch.float32:
        check_emulation(got, emulate(*problem), label)
    # The expert nobody picked gets exactly zero weight gradients.
    assert (got[3][0] == 0).all() and (got[4][0] == 0).all() and got[3][1].abs().sum() > 0
    # fp8 is not bf16: the quantisation shows (same inputs through precision = "bf16").
    plain = run_mega_moe(*problem, dispatch="torch")
    assert rel_err(got[0], plain[0]) > 1e-3


def test_single_rank_fp8_clamped_swiglu_and_empty_slots():
    # The clamp's gradient mask is discontinuous: e4m3 noise in h moves the elements next to the limit across it, and
    # each such element sends (or holds back) its whole dg or du. With c = 1 (a sixth of g and a third of u clamped)
    # that puts the FC1 dgrad and wgrad 12-18% off the float64 oracle, on top of the recipe's 6%: there the exact
    # check is the emulation (which sees the same h), the oracle bound covers what the mask does not reach. With
    # c = 2.5 (about 1% clamped) all five meet the oracle bound.
    problem = fp8_problem(36, 64, 32, 6, 3, seed=8, empty_expert=0, hot_expert=1)
    x, index, weights, w1, w2, grad_out = problem
    for clamp in (1.0, 2.5):
        assert min(clamped_fractions(x, index, w1, clamp)) > 0.004
        got = run_fp8(*problem, activation_clamp=clamp)
        check_emulation(got, emulate(*problem, activation_clamp=clamp), f"clamp {clamp}")
        oracle = oracle_with_grads(*problem, clamp)
        names = NAMES if clamp > 2 else ("out", "d_top_k_weights", "d_down_proj")
        for name in names:
            n = NAMES.index(name)
            assert rel_err(got[n], oracle[n]) < ORACLE_TOL, f"clamp {clamp} {name} vs the oracle"

    # Empty slots (-1): they contribute nothing and get no weight gradient.
    clamp = 2.5
    index = index.clone()
    index[::5, -1] = -1
    dropped = index < 0
    got = run_fp8(x, index, weights, w1, w2, grad_out, activation_clamp=clamp)
    assert (got[2][dropped] == 0).all()
    oracle = list(oracle_with_grads(x, index.clamp(min=0), weights * ~dropped, w1, w2, grad_out, clamp))
    oracle[2] = oracle[2] * ~dropped
    assert_matches_oracle(got, x, index, weights, w1, w2, grad_out, ORACLE_TOL, ref=oracle)
    check_emulation(got, emulate(x, index, weights, w1, w2, grad_out, clamp), "clamp, empty slots")


def test_single_rank_fp8_no_tokens_and_frozen_weights():
    x = torch.randn(0, 16, requires_grad=True)
    w1 = torch.randn(4, 16, 16, requires_grad=True)
    w2 = torch.randn(4, 16, 8, requires_grad=True)
    out = fused_experts(
        x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), w1, w2, dispatch="torch", precision="fp8"
    )
    assert out.shape == (0, 16)
    out.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1)) and torch.equal(w2.grad, torch.zeros_like(w2))
    # Only the activations need gradients: the weights' stay None.
    x, index, weights, w1, w2, grad_out = fp8_problem(12, 32, 16, 4, 2, seed=8)
    xg = x.clone().requires_grad_()
    out = fused_experts(xg, index, weights, w1, w2, dispatch="torch", precision="fp8")
    (dx,) = torch.autograd.grad(out, [xg], grad_out)
    assert rel_err(dx, oracle_with_grads(x, index, weights, w1, w2, grad_out)[1]) < ORACLE_TOL


@pytest.mark.parametrize("precision", ["fp8_bwd", "mxfp8"])
def test_other_quantised_precisions_are_refused(precision):
    x, index, weights, w1, w2, _ = fp8_problem(8, 16, 8, 4, 2, seed=9)
    with pytest.raises(NotImplementedError, match=rf"precision = '{precision}'.*mega_moe"):
        fused_experts(x, index, weights, w1, w2, dispatch="torch", precision=precision)


# ---------------------------------------------------------------------------------------------------------------
# On a Hopper GPU: torch._scaled_grouped_mm against the reference form


def _hopper() -> bool:
    return torch.cuda.is_available() and fg.can_use_scaled_grouped_mm(torch.device("cuda"), 16, 16)


@pytest.mark.gpu
def test_scaled_grouped_mm_matches_reference_form():
    if not _hopper():
        pytest.skip("needs a Hopper GPU and a torch with _scaled_grouped_mm")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    counts = [0, 300, 17, 1, 64, 130]  # an empty group, group sizes off the 16-row alignment
    rows, k, n = sum(counts), 256, 384
    a = torch.randn(rows, k, device=dev, generator=gen, dtype=torch.bfloat16)
    b = torch.randn(len(counts), n, k, device=dev, generator=gen, dtype=torch.bfloat16)
    c = torch.randn(rows, n, device=dev, generator=gen, dtype=torch.bfloat16)
    # The compiled quantisation (the op's path) gives the eager values, up to rare rounding-midpoint cases.
    for quantize, args in ((fg.quantize_rows, (a,)), (fg.quantize_group_cols, (c, counts))):
        (q1, s1), (q0, s0) = quantize(*args, compiled=True), quantize(*args, compiled=False)
        assert torch.equal(s1, s0) and (q1.float() != q0.float()).float().mean() < 1e-4, quantize.__name__
    assert fg._compiled.get("failed") is None, fg._compiled.get("failed")
    results = {}
    for use_op in (True, False):
        fwd = fg.grouped_mm_rows(*fg.quantize_rows(a), *fg.quantize_rows(b), counts, torch.bfloat16, use_op=use_op)
        wgrad = fg.grouped_mm_cols(
            *fg.quantize_group_cols(c, counts),
            *fg.quantize_group_cols(a, counts),
            counts,
            torch.bfloat16,
            use_op=use_op,
        )
        results[use_op] = (fwd, wgrad)
    for name, got, want in zip(("2D x 3D", "2D x 2D"), results[True], results[False]):
        assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16, name
        assert rel_err(got, want) < 5e-3, name  # bf16 outputs, fp32 accumulation in different orders
    assert (results[True][1][0] == 0).all()  # the empty group's weight gradient


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_layer_on_scaled_grouped_mm_matches_reference_form(monkeypatch, dtype):
    if not _hopper():
        pytest.skip("needs a Hopper GPU and a torch with _scaled_grouped_mm")
    # Forward and backward of the layer (ragged routing: expert 0 empty, expert 1 hot), the op form against the
    # reference form and the float64 oracle.
    hidden, inter, experts, top_k, tokens = 512, 256, 8, 4, 512
    problem = fp8_problem(tokens, hidden, inter, experts, top_k, seed=3, dtype=dtype)
    on_gpu = [t.cuda() for t in problem]
    monkeypatch.setattr(fg, "IMPLEMENTATION", "op")
    got = run_fp8(*on_gpu)
    assert fg._compiled.get("failed") is None, fg._compiled.get("failed")  # compiled in forward and backward
    monkeypatch.setattr(fg, "IMPLEMENTATION", "reference")
    want = run_fp8(*on_gpu)
    # The op returns each GEMM's output in bf16 where the reference form keeps fp32 until the end, so FC1's output
    # (and with it the e4m3 rounding of the SwiGLU output FC2 reads) differs in a few elements by an e4m3 step:
    # 1.4e-2 on the bf16 output on an H200; the oracle bound below is the recipe's own.
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype == dtype, name
        assert rel_err(a, b) < 3e-2, name
    assert (got[3][0] == 0).all() and (got[4][0] == 0).all()
    oracle = oracle_with_grads(*problem)
    for name, a, b in zip(NAMES, got, oracle):
        assert rel_err(a.cpu(), b) < ORACLE_TOL, name
