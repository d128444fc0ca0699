"""The column pass of the quantising SwiGLU backward in Gluon (``kernels/swiglu_grad_cols.py``): compiled for sm_90 on
the CPU, and on a GPU checked bitwise against the Triton launch it stands in for (``swiglu_grad.py``, COLS_OUT)."""

from __future__ import annotations

import pytest
import torch

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.ops import fp8_launch as fl
from tests.test_register_check import compile_for_hopper
from tests.test_swiglu_grad_fused import _cols_t_written, ragged_swiglu_backward_inputs, rank_that_receives_nothing

TYPES = (
    '{"ga_ptr": "*bf16", "h_ptr": "*bf16", "row_weight_ptr": "*fp32", "dhtq_ptr": "*fp8e4nv", "dhts_ptr": "*fp32",'
    ' "awtq_ptr": "*fp8e4nv", "awts_ptr": "*fp32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32",'
    ' "num_tiles_ptr": "*i32", "expert_offsets_ptr": "*i32"}'
)


@pytest.mark.parametrize(
    "pow2,clamp", [(False, False), (True, False), (False, True)], ids=["fp32_scales", "pow2", "clamp"]
)
def test_gluon_cols_compiles_for_hopper(pow2, clamp):
    """As the launcher launches it (DSWIGLU_COLS_GLUON_BLOCK): no spill, registers that let several programs share
    an SM (three; two with the clamped SwiGLU's masks, activation_clamp), and almost no shared memory (only the
    column maxima cross warps)."""
    bc, cpt, warps = fl.DSWIGLU_COLS_GLUON_BLOCK
    ((_, registers, spill, smem, *_),) = compile_for_hopper(
        "prime_megamoe.kernels.swiglu_grad_cols:swiglu_backward_cols_kernel",
        {"POW2": pow2, "TILE_M": QTILE_M, "BC": bc, "CPT": cpt, "CLAMP": clamp},
        ["--warps", str(warps), "--types", TYPES],
    )
    assert int(spill) == 0 and (2 if clamp else 3) * int(registers) * warps * 32 <= 64 * 1024
    assert int(smem) <= 4096


def test_column_layout_rejects_a_block_a_warp_does_not_cover():
    """Both transposing Gluon passes take their layouts from ``_column_layout``: a (BC, CPT, warps) whose warp does
    not cover TILE_M // num_warps rows of BC columns is a compile error that names the block."""
    with pytest.raises(Exception, match=r"a warp must cover .*BC 32, CPT 2, 2 warps"):
        compile_for_hopper(
            "prime_megamoe.kernels.swiglu_grad_cols:swiglu_backward_cols_kernel",
            {"POW2": False, "TILE_M": QTILE_M, "BC": 32, "CPT": 2, "CLAMP": False},
            ["--warps", "2", "--types", TYPES],
        )


def test_gluon_cols_applicability_says_why_not():
    g_a, h = torch.empty(8, 256, dtype=torch.bfloat16), torch.empty(8, 512, dtype=torch.bfloat16)
    assert "CUDA GPU" in fl.gluon_cols_unavailable(g_a, h, fl.fp8_format())
    if torch.cuda.is_available():
        assert "not mx" in fl.gluon_cols_unavailable(g_a.cuda(), h.cuda(), fl.MX_FORMAT)
        assert "contiguous" in fl.gluon_cols_unavailable(g_a.cuda().t(), h.cuda(), fl.fp8_format())
    # (The error comes before the routing plan is read: none is needed here.)
    with pytest.raises(ValueError, match="gluon=True: the Gluon column pass cannot run here: it runs on a CUDA"):
        fl.dswiglu_cols_t(g_a, h, None, fl.fp8_format(), gluon=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,inter,pow2,clamp",
    [(300, 256, False, None), (700, 384, True, None), (64, 200, False, None), (300, 256, False, 1.5)],
    ids=["two_groups", "three_groups_pow2", "ragged_columns", "two_groups_clamp"],
)
def test_gluon_cols_matches_the_triton_launch(tokens, inter, pow2, clamp):
    """Ragged routing (an empty expert, one taking most rows, tiles ending mid-way) and an intermediate size that is
    not a multiple of the column block: the same bits as the Triton launch for dh^T and (w * a)^T and their scales.
    ``clamp``: the clamped SwiGLU (activation_clamp; h has standard deviation 2, so ~25% of g and ~45% of u are cut)."""
    plan, g_a, h = ragged_swiglu_backward_inputs(tokens, inter)
    fmt = fl.fp8_format(pow2)
    ref = fl.dswiglu_cols_t(g_a, h, plan, fmt, gluon=False, activation_clamp=clamp)
    got = fl.dswiglu_cols_t(g_a, h, plan, fmt, gluon=True, activation_clamp=clamp)
    for name, a_q, b_q in zip(("dh_t", "aw_t"), got, ref):
        for a, b in zip(_cols_t_written(a_q, plan), _cols_t_written(b_q, plan)):
            assert torch.equal(a, b), name
    # The layer's default (gluon=None) takes the Gluon form here.
    default = fl.dswiglu_cols_t(g_a, h, plan, fmt, activation_clamp=clamp)
    assert torch.equal(_cols_t_written(default[0], plan)[0], _cols_t_written(got[0], plan)[0])
    if clamp is not None:  # and the clamp acted: without it dh^T differs
        plain = fl.dswiglu_cols_t(g_a, h, plan, fmt, gluon=True)
        assert not torch.equal(_cols_t_written(plain[0], plan)[0], _cols_t_written(got[0], plan)[0])


@pytest.mark.gpu
def test_gluon_cols_on_a_rank_that_receives_nothing():
    """Every token routed to other ranks' experts: rows but no tiles; the launch finishes (each program returns at
    the tile count) and gives outputs of the plan's shapes."""
    plan, g_a, h = rank_that_receives_nothing()
    dh_t, aw_t = fl.dswiglu_cols_t(g_a, h, plan, fl.fp8_format(), gluon=True)
    torch.cuda.synchronize()
    assert dh_t.data.shape == (256, plan.max_tiles * QTILE_M) and aw_t.data.shape == (128, plan.max_tiles * QTILE_M)
