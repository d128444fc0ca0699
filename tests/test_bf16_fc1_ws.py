"""The warp-specialised Hopper FC1 + SwiGLU on bf16 operands (``kernels/fc1_ws.py``,
``ops/bf16_ws_launch.bf16_fc1_swiglu_ws``).

Gluon kernels have no interpreter: on the CPU the kernel is compiled for sm_90 as the launcher runs it (wgmma not
serialised, the register split, the ring in shared memory) and the applicability rules are checked; on a Hopper GPU h
and a are checked against float64 torch on the same bf16 operands and against the Triton kernel, with ragged routing
(an expert without rows, one with most), a hidden size whose last K step is partial, the clamped SwiGLU, a row_base,
few persistent programs, 3 and 4 stages, and a rank with no tiles."""

from __future__ import annotations

import json

import pytest
import torch
import triton

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops import launch
from prime_megamoe.ops.bf16_ws_launch import bf16_fc1_swiglu_ws, bf16_fc1_ws_unavailable
from prime_megamoe.ops.fp8_ws_launch import WS_GATHER_LOAD_REGS, WS_GATHER_LOAD_WARPS, WS_GATHER_MMA_REGS
from prime_megamoe.ops.routing_plan import build_routing_plan
from tests.oracle import ragged_routing, rel_err
from tests.test_register_check import compile_for_hopper

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90 wgmma code, no interpreter)")


@pytest.mark.parametrize(
    "save_h,clamp,stages", [(True, False, 4), (False, False, 4), (True, True, 4), (True, False, 3)],
    ids=["save_h", "no_h", "clamp", "3_stages"],
)  # fmt: skip
def test_bf16_fc1_ws_kernel_compiles_for_hopper_with_its_register_split(save_h, clamp, stages):
    """As the launcher launches it: four gathering producer warps, two MMA partitions holding the gate and up
    accumulators; no wgmma serialisation, the ring (A once, the gate and up boxes of W1) in shared memory. Triton 3.6
    (the GPU machines') is held to no spill; newer releases spill a few loop scalars of h's stores."""
    types = {
        "x_ptr": "*bf16",
        "row_src_ptr": "*i32",
        "h_ptr": "*bf16",
        "a_ptr": "*bf16",
        "b_desc": "tensordesc<bf16[128, 64]>",
    }
    constexprs = {
        "SAVE_H": save_h,
        "CLAMP": clamp,
        "STAGES": stages,
        "TILE_M": QTILE_M,
        "LOAD_WARPS": WS_GATHER_LOAD_WARPS,
        "LOAD_REGS": WS_GATHER_LOAD_REGS,
        "MMA_REGS": WS_GATHER_MMA_REGS,
    }
    ((_, registers, spill, smem, partitions, wgmma),) = compile_for_hopper(
        "prime_megamoe.kernels.fc1_ws:bf16_fc1_swiglu_ws_kernel",
        constexprs,
        ["--warps", "4", "--maxnreg", "168", "--types", json.dumps(types)],
    )
    assert wgmma == "ok", "ptxas serialises the kernel's wgmma instructions (see register_check.wgmma_serialised)"
    assert int(registers) == 168 and int(spill) <= (0 if triton.__version__.startswith("3.6") else 48)
    assert stages * (128 + 256) * 64 * 2 <= int(smem) <= 227 * 1024
    assert max(int(v) for v in partitions.split(",")) >= 200


def test_bf16_fc1_ws_applicability_says_why_not():
    x = torch.empty(16, 256, dtype=torch.bfloat16)
    w1 = torch.empty(2, 512, 256, dtype=torch.bfloat16)
    assert "CUDA GPU" in bf16_fc1_ws_unavailable(x, w1)
    if HOPPER:
        x, w1 = x.cuda(), w1.cuda()
        assert bf16_fc1_ws_unavailable(x, w1) is None
        assert "bf16 operands" in bf16_fc1_ws_unavailable(x.float(), w1)
        assert "multiple of 128" in bf16_fc1_ws_unavailable(x, w1[:, :192])
        assert "multiple of 16" in bf16_fc1_ws_unavailable(x[:, :200].contiguous(), w1[:, :, :200].contiguous())


def test_fc1_swiglu_asks_for_the_kernel_only_where_it_applies():
    """use_ws=True where the kernel cannot run is an error naming why; use_ws=None runs the Triton kernel there, the
    same values as use_ws=False."""
    index, weights = ragged_routing(40, 4, 2, seed=11)
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=4, tile_m=tile_m())
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(40, 32, generator=gen).to(torch.bfloat16)
    w1 = torch.randn(4, 64, 32, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="warp-specialised kernel cannot run here: it runs on a CUDA GPU only"):
        launch.fc1_swiglu(x, w1, plan, save_h=True, use_ws=True)
    h, a = launch.fc1_swiglu(x, w1, plan, save_h=True, use_ws=None)
    h_want, a_want = launch.fc1_swiglu(x, w1, plan, save_h=True, use_ws=False)
    assert torch.equal(h, h_want) and torch.equal(a, a_want)


def _reference(x_rows, w1, plan, clamp):
    """float64 (h [P, 2I], a [P, I]) over each expert's sorted rows; ``clamp``: the clamped SwiGLU's limit, decided on
    h as the kernel keeps it (fp32, before rounding to bf16: here float64)."""
    offsets = plan.expert_offsets.tolist()
    w1 = w1.double().cpu()
    inter = w1.shape[1] // 2
    h = torch.zeros(x_rows.shape[0], 2 * inter, dtype=torch.float64)
    for e in range(w1.shape[0]):
        r0, r1 = offsets[e], offsets[e + 1]
        h[r0:r1] = x_rows[r0:r1] @ w1[e].T
    g, u = h[:, :inter], h[:, inter:]
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return h, torch.nn.functional.silu(g) * u


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "hidden,inter,clamp,row_base",
    [(256, 128, None, 0), (208, 384, None, 0), (256, 256, 0.75, 0), (256, 128, None, 24)],
    ids=["small", "partial_k_step", "clamp", "row_base"],
)
def test_bf16_fc1_ws_matches_float64_and_the_triton_kernel(hidden, inter, clamp, row_base):
    device, experts, tokens = "cuda", 4, 300
    index, weights = ragged_routing(tokens, experts, 2, seed=5, hot_fraction=0.8)
    plan = build_routing_plan(
        index.to(device), weights.to(device), expert_base=0, num_local_experts=experts, tile_m=QTILE_M
    )
    assert int(plan.expert_offsets.diff().min()) == 0 and int(plan.expert_offsets.diff().max()) > QTILE_M
    gen = torch.Generator().manual_seed(5)
    x_all = torch.randn(tokens + row_base, hidden, generator=gen).to(device, torch.bfloat16)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(device, torch.bfloat16)
    pairs = plan.num_pairs
    # row_base: the plan's source ids shifted up by row_base and x holding rows from row_base on (an expert-parallel
    # segment's own block), so the launch reads x[src - row_base] = x_all[src]
    plan.row_src[:pairs] += row_base
    x = x_all[row_base:]
    src = plan.row_src[:pairs].long().cpu()
    h_want, a_want = _reference(x_all.double().cpu()[src], w1, plan, clamp)
    h_tri, a_tri = launch.fc1_swiglu(x, w1, plan, True, row_base=row_base, activation_clamp=clamp)
    h_tri, a_tri = h_tri[:pairs].cpu(), a_tri[:pairs].cpu()
    assert rel_err(h_tri, h_want) < 4e-3 and rel_err(a_tri, a_want) < 8e-3
    for save_h in (True, False):
        for programs in (None, 1, 3):
            for stages in (4, 3):
                h = torch.full((plan.sorted_rows, 2 * inter), float("nan"), device=device, dtype=torch.bfloat16)
                a = torch.full((plan.sorted_rows, inter), float("nan"), device=device, dtype=torch.bfloat16)
                limit, on = (0.0, False) if clamp is None else (clamp, True)
                bf16_fc1_swiglu_ws(
                    x, w1, plan, h if save_h else None, a, row_base=row_base, clamp_limit=limit, clamp=on,
                    stages=stages, programs=programs,
                )  # fmt: skip
                msg = (save_h, programs, stages)
                got_a = a[:pairs].cpu()
                assert not got_a.isnan().any(), (msg, "rows of a left unwritten")
                # Both kernels sum the same bf16 products in fp32 and round once: equal up to the summation order
                assert rel_err(got_a, a_want) < 8e-3 and rel_err(got_a, a_tri) < 8e-3, (msg, rel_err(got_a, a_tri))
                if save_h:
                    got_h = h[:pairs].cpu()
                    assert not got_h.isnan().any(), (msg, "rows of h left unwritten")
                    assert rel_err(got_h, h_want) < 4e-3 and rel_err(got_h, h_tri) < 4e-3, msg
                else:
                    assert h.isnan().all(), (msg, "h written without save_h")
    # Bitwise repeatable, and what the layer's launcher runs (use_ws=None picks it on Hopper)
    h1, a1 = launch.fc1_swiglu(x, w1, plan, True, row_base=row_base, activation_clamp=clamp, use_ws=True)
    h2, a2 = launch.fc1_swiglu(x, w1, plan, True, row_base=row_base, activation_clamp=clamp, use_ws=None)
    assert torch.equal(h1[:pairs], h2[:pairs]) and torch.equal(a1[:pairs], a2[:pairs])


@pytest.mark.gpu
@needs_hopper
def test_bf16_fc1_ws_on_a_rank_that_receives_nothing():
    """Every token routed to the other rank's experts: rows but no tiles; the kernel writes nothing."""
    device = "cuda"
    index, weights = ragged_routing(64, 8, 2, seed=3, empty_expert=None, hot_expert=None, forbid=range(0, 4))
    plan = build_routing_plan(index.to(device), weights.to(device), expert_base=0, num_local_experts=4, tile_m=QTILE_M)
    assert int(plan.num_tiles[0]) == 0 and plan.num_pairs > 0
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(4, 256, 128, device=device, dtype=torch.bfloat16)
    h = torch.full((plan.sorted_rows, 256), 7.0, device=device, dtype=torch.bfloat16)
    a = torch.full((plan.sorted_rows, 128), 7.0, device=device, dtype=torch.bfloat16)
    bf16_fc1_swiglu_ws(x, w1, plan, h, a)
    torch.cuda.synchronize()
    assert torch.equal(h, torch.full_like(h, 7.0)) and torch.equal(a, torch.full_like(a, 7.0))
