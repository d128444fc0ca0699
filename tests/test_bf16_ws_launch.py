"""The warp-specialised Hopper grouped GEMM on bf16 operands (``ops/bf16_ws_launch.py``, the kernel of
``kernels/gemm_ws.py`` with SCALED = False).

Gluon kernels have no interpreter: on the CPU the kernel is compiled for sm_90 as the launcher runs it (no spill, no
wgmma serialisation, the register split, the ring in shared memory) and the applicability rules are checked; on a
Hopper GPU every GEMM form the layer has (FC2 with the top-k weights, the gathered FC2 dgrad, the FC1 dgrad, FC1's
gathered rows) is checked against float64 torch on the same bf16 operands, and against the Triton kernel, with ragged
routing (an empty expert, one with most rows, K and N not multiples of the tile)."""

from __future__ import annotations

import json

import pytest
import torch

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops import launch
from prime_megamoe.ops.bf16_ws_launch import BF16_WS_CONFIGS, bf16_grouped_gemm_ws, bf16_ws_unavailable
from prime_megamoe.ops.fp8_ws_launch import producer_split
from prime_megamoe.ops.routing_plan import build_routing_plan
from tests.oracle import ragged_routing, rel_err
from tests.test_register_check import compile_for_hopper

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90 wgmma code, no interpreter)")


@pytest.mark.parametrize(
    "cfg",
    BF16_WS_CONFIGS,
    ids=lambda c: f"n{c.block_n}s{c.stages}{'t' if c.tma_store else ''}{'g' if c.stagger else ''}",
)
@pytest.mark.parametrize(
    "kmajor,gather",
    [(True, False), (True, True), (False, False), (False, True)],
    ids=["k", "k_gather", "n", "n_gather"],
)
def test_bf16_ws_kernel_compiles_for_hopper_with_its_register_split(cfg, kmajor, gather):
    load_warps, load_regs, mma_regs = producer_split(gather)
    b_box = f"bf16[{cfg.block_n}, 64]" if kmajor else f"bf16[64, {cfg.block_n}]"
    types = {
        "a_desc": f"tensordesc<bf16[{cfg.a_rows}, 64]>",
        "b_desc": f"tensordesc<{b_box}>",
        "c_desc": f"tensordesc<bf16[{cfg.a_rows}, 128]>",
        "a_ptr": "*bf16",
        "as_ptr": "*bf16",
        "bs_ptr": "*bf16",
        "c_ptr": "*bf16",
        "row_src_ptr": "*i32",
    }
    constexprs = {
        "SEGS": 1,
        "SCALE_ROWS": True,
        "B_GROUP_N": 128,
        "STAGES": cfg.stages,
        "TILE_M": QTILE_M,
        "HALVES": cfg.halves,
        "TMA_STORE": cfg.tma_store,
        "GATHER": gather,
        "SCALES_FIRST": False,
        "SUBS": cfg.subs,
        "SCALED": False,
        "B_KMAJOR": kmajor,
        "STAGGER": cfg.stagger,
        "LOAD_WARPS": load_warps,
        "LOAD_REGS": load_regs,
        "MMA_REGS": mma_regs,
    }
    options = ["--warps", str(cfg.num_warps), "--maxnreg", str(cfg.maxnreg), "--types", json.dumps(types)]
    ((_, registers, spill, smem, partitions, wgmma),) = compile_for_hopper(
        "prime_megamoe.kernels.gemm_ws:grouped_gemm_ws_kernel", constexprs, options
    )
    assert wgmma == "ok", "ptxas serialises the kernel's wgmma instructions (see register_check.wgmma_serialised)"
    assert int(registers) == cfg.maxnreg and int(spill) == 0, f"{spill} bytes spilled"
    ring = cfg.stages * (cfg.block_m + cfg.block_n) * 64 * 2  # A and B boxes of 64 bf16 columns
    assert ring + (cfg.block_m * 128 * 2 if cfg.tma_store else 0) <= int(smem) <= 227 * 1024
    assert max(int(v) for v in partitions.split(",")) >= 200


def test_bf16_ws_applicability_says_why_not():
    a = torch.empty(256, 256, dtype=torch.bfloat16)
    b = torch.empty(2, 128, 256, dtype=torch.bfloat16)
    assert "CUDA GPU" in bf16_ws_unavailable(a, b, transpose_b=True, gather=False)
    if HOPPER:
        a, b = a.cuda(), b.cuda()
        assert bf16_ws_unavailable(a, b, transpose_b=True, gather=False) is None
        assert "bf16 operands" in bf16_ws_unavailable(a.float(), b, transpose_b=True, gather=False)
        assert "multiple of 64" in bf16_ws_unavailable(a[:, :96], b[:, :96], transpose_b=False, gather=False)
        assert "row_base" in bf16_ws_unavailable(a, b, transpose_b=True, gather=True, row_base=8)


def _reference(a_rows, b, plan, transpose_b, row_scale=None):
    """float64: out[r] = row_scale[r] * A[r] @ op(B[e]) over each expert's sorted rows."""
    offsets = plan.expert_offsets.tolist()
    b = b.double().cpu()
    n = b.shape[1] if transpose_b else b.shape[2]
    out = torch.zeros(a_rows.shape[0], n, dtype=torch.float64)
    for e in range(b.shape[0]):
        r0, r1 = offsets[e], offsets[e + 1]
        out[r0:r1] = a_rows[r0:r1] @ (b[e].T if transpose_b else b[e])
    if row_scale is not None:
        out *= row_scale.double().cpu()[:, None]
    return out


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("hidden,inter", [(256, 128), (1024, 384), (192, 96)], ids=["small", "wide", "ragged"])
def test_bf16_ws_gemm_matches_float64_and_the_triton_kernel(hidden, inter):
    device, experts, tokens = "cuda", 4, 300
    index, weights = ragged_routing(tokens, experts, 2, seed=7, hot_fraction=0.8)
    plan = build_routing_plan(
        index.to(device), weights.to(device), expert_base=0, num_local_experts=experts, tile_m=QTILE_M
    )
    assert int(plan.expert_offsets.diff().max()) >= QTILE_M  # whole tiles, stored by TMA
    gen = torch.Generator().manual_seed(7)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    x, dy = rand(tokens, hidden), rand(tokens, hidden)
    act, dh = rand(plan.sorted_rows, inter), rand(plan.sorted_rows, 2 * inter)
    w1, w2 = rand(experts, 2 * inter, hidden, scale=hidden**-0.5), rand(experts, hidden, inter, scale=inter**-0.5)
    # (name, A, B, transpose_b, gather, row scale): every grouped GEMM of the layer
    cases = [
        ("FC1 rows", x, w1, True, True, None),
        ("FC2", act, w2, True, False, plan.row_weight),
        ("FC2 dgrad", dy, w2, False, True, None),
        ("FC1 dgrad", dh, w1, False, False, None),
    ]
    pairs = plan.num_pairs
    src = plan.row_src[:pairs].long().cpu()
    for name, a, b, transpose_b, gather, row_scale in cases:
        why_not = bf16_ws_unavailable(a, b, transpose_b=transpose_b, gather=gather)
        k = b.shape[2] if transpose_b else b.shape[1]
        if not transpose_b and k % 64:
            assert "multiple of 64" in why_not, name
            with pytest.raises(ValueError, match="multiple of 64"):
                launch.grouped_gemm(a, b, plan, transpose_b=transpose_b, gather=gather, use_ws=True)
            continue
        assert why_not is None, (name, why_not)
        a_rows = a.double().cpu()[src] if gather else a.double().cpu()[:pairs]
        want = _reference(a_rows, b, plan, transpose_b, row_scale[:pairs] if row_scale is not None else None)
        triton_out = launch.grouped_gemm(a, b, plan, transpose_b=transpose_b, gather=gather, row_scale=row_scale)
        for cfg in BF16_WS_CONFIGS:
            for programs in (None, 1, 3):
                for out_dtype in (torch.float32, torch.bfloat16):
                    c = torch.full((plan.sorted_rows, want.shape[1]), float("nan"), device=device, dtype=out_dtype)
                    bf16_grouped_gemm_ws(
                        a, b, plan, c, transpose_b=transpose_b, gather=gather, row_scale=row_scale, config=cfg,
                        programs=programs,
                    )  # fmt: skip
                    got = c[:pairs].cpu()
                    assert not got.isnan().any(), (name, cfg, programs, "rows left unwritten")
                    # fp32: the exact bf16 products summed in fp32; bf16: one rounding of that
                    bound = 1e-5 if out_dtype == torch.float32 else 4e-3
                    assert rel_err(got, want) < bound, (name, cfg, programs, out_dtype, rel_err(got, want))
        assert rel_err(triton_out[:pairs].cpu(), want) < 4e-3, name
        ws = launch.grouped_gemm(a, b, plan, transpose_b=transpose_b, gather=gather, row_scale=row_scale, use_ws=True)
        assert rel_err(ws[:pairs].cpu(), triton_out[:pairs].cpu()) < 4e-3, name


@pytest.mark.gpu
@needs_hopper
def test_bf16_ws_gemm_on_a_rank_that_receives_nothing():
    """Every token routed to the other rank's experts: rows but no tiles; the kernel writes nothing."""
    device = "cuda"
    index, weights = ragged_routing(64, 8, 2, seed=3, empty_expert=None, hot_expert=None, forbid=range(0, 4))
    plan = build_routing_plan(index.to(device), weights.to(device), expert_base=0, num_local_experts=4, tile_m=QTILE_M)
    assert int(plan.num_tiles[0]) == 0 and plan.num_pairs > 0
    a = torch.randn(plan.sorted_rows, 128, device=device, dtype=torch.bfloat16)
    b = torch.randn(4, 256, 128, device=device, dtype=torch.bfloat16)
    c = torch.full((plan.sorted_rows, 256), 7.0, device=device, dtype=torch.bfloat16)
    bf16_grouped_gemm_ws(a, b, plan, c, transpose_b=True)
    torch.cuda.synchronize()
    assert torch.equal(c, torch.full_like(c, 7.0))


def test_grouped_gemm_asks_for_the_kernel_only_where_it_applies():
    """use_ws=True where the kernel cannot run is an error naming why; use_ws=None runs the Triton kernel there, the
    same values as use_ws=False."""
    index, weights = ragged_routing(40, 4, 2, seed=11)
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=4, tile_m=tile_m())
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(plan.sorted_rows, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(4, 48, 32, generator=gen).to(torch.bfloat16)
    with pytest.raises(
        ValueError,
        match="use_ws=True: grouped_gemm's warp-specialised kernel cannot run here: it runs on a CUDA GPU only",
    ):
        launch.grouped_gemm(a, b, plan, transpose_b=True, use_ws=True)
    chosen = launch.grouped_gemm(a, b, plan, transpose_b=True, use_ws=None)
    assert torch.equal(chosen, launch.grouped_gemm(a, b, plan, transpose_b=True, use_ws=False))
