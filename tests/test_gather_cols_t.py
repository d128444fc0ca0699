"""The weight gradients' gather-quantise pass in Gluon (``kernels/gather_cols_t.py``): compiled for sm_90 on the CPU,
and on a GPU checked bitwise against the Triton launch it stands in for (``quantize.gather_quantize_cols_t_kernel``)
and against a plain torch quantiser."""

from __future__ import annotations

import pytest
import torch

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.ops import fp8_launch as fl
from tests.test_quantize import _ragged_plan, _ref_cols_t
from tests.test_register_check import compile_for_hopper
from tests.test_swiglu_grad_fused import _cols_t_written, rank_that_receives_nothing

TYPES = (
    '{"x_ptr": "*bf16", "row_src_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "tile_expert_ptr": "*i32",'
    ' "tile_row_ptr": "*i32", "num_tiles_ptr": "*i32", "expert_offsets_ptr": "*i32"}'
)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2"])
def test_gluon_gather_compiles_for_hopper(pow2):
    """As the launcher launches it (GATHER_COLS_T_GLUON_BLOCK): no spill, registers that let several programs share
    an SM, almost no shared memory (only the column maxima cross warps)."""
    bc, cpt, warps = fl.GATHER_COLS_T_GLUON_BLOCK
    ((_, registers, spill, smem, *_),) = compile_for_hopper(
        "prime_megamoe.kernels.gather_cols_t:gather_cols_t_kernel",
        {"POW2": pow2, "TILE_M": QTILE_M, "BC": bc, "CPT": cpt},
        ["--warps", str(warps), "--types", TYPES],
    )
    assert int(spill) == 0 and 3 * int(registers) * warps * 32 <= 64 * 1024
    assert int(smem) <= 4096


def test_gluon_gather_applicability_says_why_not():
    x = torch.empty(8, 256, dtype=torch.bfloat16)
    assert "CUDA GPU" in fl.gluon_gather_unavailable(x, fl.fp8_format())
    if torch.cuda.is_available():
        assert "not mx" in fl.gluon_gather_unavailable(x.cuda(), fl.MX_FORMAT)
    # (The error comes before the routing plan is read: none is needed here.)
    with pytest.raises(ValueError, match="gluon=True: the Gluon gather pass cannot run here: it runs on a CUDA"):
        fl.quantize_sorted_cols_t(x, None, fl.fp8_format(), gluon=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hidden,pow2,dtype",
    [(256, False, torch.bfloat16), (200, True, torch.bfloat16), (136, False, torch.float32)],
    ids=["bf16", "ragged_columns_pow2", "fp32_source"],
)
def test_gluon_gather_matches_the_triton_launch_and_torch(hidden, pow2, dtype):
    """Ragged routing (an empty expert, one taking most rows and ending mid-tile), column counts that are not a
    multiple of the column block: the same bits as the Triton launch, and with power-of-two scales (exact
    reciprocals) as a torch quantiser per tile."""
    plan = _ragged_plan(150, 4, 2, seed=6, device="cuda")
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(150, hidden, generator=gen) * torch.exp2(torch.randint(-6, 6, (150, 1), generator=gen))
    x[:, 3] = 0.0  # an all-zero column: scale 1
    x = x.to(dtype)
    fmt = fl.fp8_format(pow2)
    got = fl.quantize_sorted_cols_t(x.cuda(), plan, fmt, gluon=True)
    ref = fl.quantize_sorted_cols_t(x.cuda(), plan, fmt, gluon=False)
    for a, b in zip(_cols_t_written(got, plan), _cols_t_written(ref, plan)):
        assert torch.equal(a, b)
    # The layer's default (gluon=None) takes the Gluon form here.
    default = fl.quantize_sorted_cols_t(x.cuda(), plan, fmt)
    assert torch.equal(_cols_t_written(default, plan)[0], _cols_t_written(got, plan)[0])
    if not pow2:
        return  # (on a GPU both kernels divide approximately (PTX div.full.f32), torch exactly: last bits differ)
    for t, q_ref, s_ref in _ref_cols_t(x, plan, fmt):
        q = got.data[:, t * QTILE_M : (t + 1) * QTILE_M].cpu()
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"tile {t} values"
        assert torch.equal(got.scale[t].cpu(), s_ref[0]), f"tile {t} scales"


@pytest.mark.gpu
def test_gluon_gather_on_a_rank_that_receives_nothing():
    """Every token routed to other ranks' experts: rows but no tiles; the launch finishes (each program returns at
    the tile count) and gives outputs of the plan's shapes."""
    plan, g_a, _ = rank_that_receives_nothing()
    out = fl.quantize_sorted_cols_t(g_a[: plan.num_rows], plan, fl.fp8_format(), gluon=True)
    torch.cuda.synchronize()
    assert out.data.shape == (128, plan.max_tiles * QTILE_M) and out.scale.shape == (plan.max_tiles, 128)
