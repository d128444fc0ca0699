"""The one-pass quantising SwiGLU backward (``kernels/swiglu_grad_fused.py``, Gluon): compiled for sm_90 on the CPU,
and on a GPU checked against the two-launch Triton pass (``kernels/swiglu_grad.py``) it replaces."""

from __future__ import annotations

import pytest
import torch

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.routing_plan import build_routing_plan
from tests.oracle import ragged_routing
from tests.test_register_check import compile_for_hopper

TYPES = (
    '{"ga_ptr": "*bf16", "h_ptr": "*bf16", "row_weight_ptr": "*fp32", "dhq_ptr": "*fp8e4nv", "dhs_ptr": "*fp32",'
    ' "dhtq_ptr": "*fp8e4nv", "dhts_ptr": "*fp32", "awtq_ptr": "*fp8e4nv", "awts_ptr": "*fp32",'
    ' "dw_partial_ptr": "*fp32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32", "num_tiles_ptr": "*i32",'
    ' "expert_offsets_ptr": "*i32"}'
)


@pytest.mark.parametrize(
    "pow2,clamp", [(False, False), (True, False), (False, True)], ids=["fp32_scales", "pow2", "clamp"]
)
def test_fused_dswiglu_compiles_for_hopper(pow2, clamp):
    """As the launcher launches it (DSWIGLU_FUSED_BLOCK), with and without the clamped SwiGLU (activation_clamp): no
    spill, and shared memory for one item's fp32 dg, du and w * a (3 x 128 x 128 x 4 bytes) within an SM's (one
    program an SM)."""
    rb, warps = fl.DSWIGLU_FUSED_BLOCK
    ((_, registers, spill, smem, *_),) = compile_for_hopper(
        "prime_megamoe.kernels.swiglu_grad_fused:swiglu_backward_fused_kernel",
        {"POW2": pow2, "TILE_M": QTILE_M, "RB": rb, "CLAMP": clamp},
        ["--warps", str(warps), "--types", TYPES],
    )
    assert int(spill) == 0
    assert 3 * QTILE_M * 128 * 4 <= int(smem) <= 227 * 1024


def test_fused_dswiglu_applicability_says_why_not():
    g_a, h = torch.empty(8, 256, dtype=torch.bfloat16), torch.empty(8, 512, dtype=torch.bfloat16)
    assert "CUDA GPU" in fl.fused_dswiglu_unavailable(g_a, h, fl.fp8_format())
    if torch.cuda.is_available():
        assert "not mx" in fl.fused_dswiglu_unavailable(g_a.cuda(), h.cuda(), fl.MX_FORMAT)
    # (The error comes before the routing plan is read: none is needed here.)
    with pytest.raises(ValueError, match="fused=True: the one-pass SwiGLU backward cannot run here: it runs on a CUDA"):
        fl.fp8_dswiglu(g_a, h, None, fl.fp8_format(), fused=True)


def _cols_t_written(q: fl.QTensor, plan) -> list[torch.Tensor]:
    """The tile-space columns (and scale rows) a pass writes: those of the device-side tile count."""
    written = int(plan.num_tiles[0]) * QTILE_M
    return [q.data[:, :written].view(torch.uint8), q.scale[: written // QTILE_M]]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,inter,pow2,clamp",
    [(300, 256, False, None), (700, 384, True, None), (64, 128, False, None), (300, 256, False, 1.5)],
    ids=["two_groups", "three_groups_pow2", "one_tile", "two_groups_clamp"],
)
def test_fused_dswiglu_matches_the_two_launch_pass(tokens, inter, pow2, clamp):
    """Ragged routing (an empty expert, one taking most rows, tiles ending mid-way): the same bits as the Triton
    pass for dh (row-scaled), dh^T and (w * a)^T (column-scaled) and their scales; dw per row to fp32 rounding
    (its 128-column sums run in another order). ``clamp``: the clamped SwiGLU (activation_clamp)."""
    plan, g_a, h = ragged_swiglu_backward_inputs(tokens, inter)
    fmt = fl.fp8_format(pow2)
    ref = fl.fp8_dswiglu(g_a, h, plan, fmt, fused=False, activation_clamp=clamp)
    got = fl.fp8_dswiglu(g_a, h, plan, fmt, fused=True, activation_clamp=clamp)
    assert torch.equal(got.dh_rows.data.view(torch.uint8), ref.dh_rows.data.view(torch.uint8))
    assert torch.equal(got.dh_rows.scale, ref.dh_rows.scale)
    for name in ("dh_t", "aw_t"):
        for a, b in zip(_cols_t_written(getattr(got, name), plan), _cols_t_written(getattr(ref, name), plan)):
            assert torch.equal(a, b), name
    torch.testing.assert_close(got.dw_row, ref.dw_row, rtol=1e-5, atol=1e-5)
    if clamp is not None:  # and the clamp acted
        plain = fl.fp8_dswiglu(g_a, h, plan, fmt, fused=True)
        assert not torch.equal(plain.dh_rows.data.view(torch.uint8), got.dh_rows.data.view(torch.uint8))


def ragged_swiglu_backward_inputs(tokens, inter, device="cuda"):
    """(plan, g_a [P, inter], h [P, 2 inter]) in bf16 for ragged routing over 4 experts (one empty, one with most
    rows, tiles ending mid-way), seeded by ``tokens``."""
    index, weights = ragged_routing(tokens, 4, 2, seed=tokens, hot_fraction=0.8)
    plan = build_routing_plan(index.to(device), weights.to(device), expert_base=0, num_local_experts=4, tile_m=QTILE_M)
    gen = torch.Generator().manual_seed(tokens)
    g_a = torch.randn(plan.num_pairs, inter, generator=gen).bfloat16().to(device)
    h = (2 * torch.randn(plan.num_pairs, 2 * inter, generator=gen)).bfloat16().to(device)
    return plan, g_a, h


def rank_that_receives_nothing(device="cuda"):
    """(plan, g_a [P, 128], h [P, 256]) where every token went to other ranks' experts: rows but no tiles."""
    index, weights = ragged_routing(64, 8, 2, seed=3, empty_expert=None, hot_expert=None, forbid=range(0, 4))
    plan = build_routing_plan(index.to(device), weights.to(device), expert_base=0, num_local_experts=4, tile_m=QTILE_M)
    assert int(plan.num_tiles[0]) == 0 and plan.num_pairs > 0
    g_a = torch.randn(plan.num_pairs, 128, device=device).bfloat16()
    h = torch.randn(plan.num_pairs, 256, device=device).bfloat16()
    return plan, g_a, h


@pytest.mark.gpu
def test_fused_dswiglu_on_a_rank_that_receives_nothing():
    """Every token routed to other ranks' experts: rows but no tiles; the launch finishes (each program returns at
    the tile count) and gives outputs of the plan's shapes."""
    plan, g_a, h = rank_that_receives_nothing()
    out = fl.fp8_dswiglu(g_a, h, plan, fl.fp8_format(), fused=True)
    torch.cuda.synchronize()
    assert out.dh_rows.data.shape == (plan.num_pairs, 256) and out.dw_row.shape == (plan.num_pairs,)
