"""The warp-specialised Hopper fp8 grouped GEMM (``kernels/gemm_ws.py``, ``ops/fp8_ws_launch.py``).

Gluon kernels have no interpreter: on the CPU the kernel is compiled for sm_90 (registers, no spill, the producer /
MMA register split) and the launcher's applicability rules are checked; on a Hopper GPU its output is checked against
the Triton fp8 kernel (same K order, same promotion) and against float64 torch on the same quantised operands."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import triton

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.fp8_ws_launch import (
    WS_CONFIGS,
    WS_GATHER_LOAD_REGS,
    WS_GATHER_LOAD_WARPS,
    WS_GATHER_MMA_REGS,
    WS_LOAD_REGS,
    WS_MMA_REGS,
    WS_WGRAD_CONFIGS,
    WS_WGRAD_DEFAULT,
    fp8_fc1_swiglu_ws,
    fp8_grouped_gemm_ws,
    fp8_grouped_wgrad_ws,
    producer_split,
    weight_descriptor,
    ws_fc1_unavailable,
    ws_gemm_unavailable,
    ws_wgrad_unavailable,
)
from prime_megamoe.ops.routing_plan import build_routing_plan
from tests.oracle import ragged_routing, rel_err
from tests.test_register_check import compile_for_hopper

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90 wgmma code, no interpreter)")


def _config_id(cfg):
    return (
        f"m{cfg.block_m}n{cfg.block_n}s{cfg.stages}h{cfg.halves}{'t' if cfg.tma_store else ''}"
        f"{'f' if cfg.scales_first else ''}"
    )


def _assert_compiles_with_register_split(kernel: str, cfg, constexprs: dict, types: dict, max_spill: int = 0):
    """``kernel`` compiled for sm_90 as the launcher runs it with ``cfg`` (its A, B and, with TMA stores, bf16 output
    boxes): at most ``max_spill`` bytes of stack a thread, no wgmma serialisation, the launch register cap, the ring
    (and output boxes) in shared memory within the SM's, the MMA warp groups with >= 200 registers."""
    out_box = f"bf16[{cfg.a_rows}, 128]" if cfg.tma_store else f"fp8e4nv[{cfg.a_rows}, 128]"
    types = {
        **types,
        "a_desc": f"tensordesc<fp8e4nv[{cfg.a_rows}, 128]>",
        "b_desc": f"tensordesc<fp8e4nv[{cfg.block_n}, 128]>",
        "c_desc": f"tensordesc<{out_box}>",
    }
    options = ["--warps", str(cfg.num_warps), "--maxnreg", str(cfg.maxnreg), "--types", json.dumps(types)]
    ((_, registers, spill, smem, partitions, wgmma),) = compile_for_hopper(kernel, constexprs, options)
    assert wgmma == "ok", "ptxas serialises the kernel's wgmma instructions (see register_check.wgmma_serialised)"
    assert int(registers) == cfg.maxnreg and int(spill) <= max_spill, f"{spill} bytes spilled"
    ring = cfg.stages * (cfg.block_m + cfg.block_n) * 128  # the ring of A and B tiles
    assert int(smem) >= ring + (cfg.block_m * 128 * 2 if cfg.tma_store else 0)
    assert int(smem) <= 227 * 1024 // cfg.programs_per_sm
    targets = [int(v) for v in partitions.split(",")]
    assert max(targets) >= 200, f"the MMA warp groups should get >= 200 registers, got {targets}"


@pytest.mark.parametrize("cfg", WS_CONFIGS, ids=_config_id)
@pytest.mark.parametrize(
    "scale_rows,gather", [(True, False), (False, False), (False, True)], ids=["row_scaled", "plain", "gathered"]
)
def test_ws_kernel_compiles_for_hopper_with_its_register_split(cfg, scale_rows, gather):
    """As the launcher launches it: a bf16 output (stored by TMA where the config says so); gathered A with four
    producer warps and their registers."""
    load_warps, load_regs, mma_regs = producer_split(gather)
    # With two accumulators (subs = 2) ptxas keeps a few of the tile loop's scalars on the stack (24-40 bytes for
    # these variants with Triton 3.9), one local load a step in the main loop. The config was measured faster
    # with them (scripts/fp8_probe.py --ws-only); a real spill of the accumulators would be hundreds of bytes.
    _assert_compiles_with_register_split(
        "prime_megamoe.kernels.gemm_ws:grouped_gemm_ws_kernel",
        cfg,
        {
            "SEGS": 1 if gather else 2,
            "SCALE_ROWS": scale_rows,
            "B_GROUP_N": 128,
            "STAGES": cfg.stages,
            "TILE_M": QTILE_M,
            "HALVES": cfg.halves,
            "TMA_STORE": cfg.tma_store,
            "GATHER": gather,
            "SCALES_FIRST": cfg.scales_first,
            "SUBS": cfg.subs,
            "SCALED": True,
            "B_KMAJOR": True,
            "STAGGER": False,
            "LOAD_WARPS": load_warps,
            "LOAD_REGS": load_regs,
            "MMA_REGS": mma_regs,
        },
        {"bs_ptr": "*fp32", "c_ptr": "*bf16", "a_ptr": "*fp8e4nv", "row_src_ptr": "*i32"},
        max_spill=64 if cfg.subs == 2 else 0,
    )


def test_ws_applicability_says_why_not():
    a = torch.empty(256, 256, dtype=fl.FP8_DTYPE)
    b = torch.empty(2, 128, 256, dtype=fl.FP8_DTYPE)
    assert "CUDA GPU" in ws_gemm_unavailable(a, b, mx=False, gather=False, segments=1, k=256)


def test_hopper_unavailable_names_what_is_missing(monkeypatch):
    import prime_megamoe.ops.fp8_ws_launch as ws

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(ws, "_cuda_properties", lambda device: type("Props", (), {"major": 8})())
    assert "Hopper" in ws.hopper_unavailable(cuda)
    monkeypatch.setattr(ws, "_cuda_properties", lambda device: type("Props", (), {"major": 9})())
    assert ws.hopper_unavailable(cuda) is None
    monkeypatch.setattr(ws, "GluonTensorDescriptor", None)  # a Triton without Gluon
    assert "no Gluon" in ws.hopper_unavailable(cuda)
    assert "no Gluon" in ws.gluon_device_unavailable(cuda)  # the Gluon passes' check (fp8_launch) too


def test_ws_kernel_is_the_kernels_module_attribute_looked_up_once():
    import prime_megamoe.kernels.gemm_ws as gemm_ws
    import prime_megamoe.ops.fp8_ws_launch as ws

    kernel = ws.ws_kernel("gemm_ws", "grouped_gemm_ws_kernel")
    assert kernel is gemm_ws.grouped_gemm_ws_kernel
    assert ws.ws_kernel("gemm_ws", "grouped_gemm_ws_kernel") is kernel
    assert ws.ws_kernel.cache_info().hits >= 1


def test_weight_descriptor_is_made_once_per_operand():
    # A cached weight operand keeps its TMA descriptor (no descriptor per call); a new operand (the weight changed,
    # so the cache quantised it again) gets its own, over its own data.
    w = torch.randn(2, 256, 256)
    first = fl.quantize_w2_fwd(w, fl.fp8_format())
    desc = weight_descriptor(first)
    assert weight_descriptor(first) is desc
    assert desc.base.data_ptr() == first.data.data_ptr() and list(desc.block_shape) == [128, 128]
    assert list(desc.shape) == [2 * 256, 256]
    wide = weight_descriptor(first, 256)  # 256-row boxes (subs = 2): a descriptor of their own
    assert wide is not desc and list(wide.block_shape) == [256, 128] and weight_descriptor(first, 256) is wide
    second = fl.quantize_w2_fwd(w * 2, fl.fp8_format())
    assert weight_descriptor(second) is not desc
    assert weight_descriptor(second).base.data_ptr() == second.data.data_ptr()


def _quantised_problem(tokens, hidden, inter, experts, top_k, seed, device):
    index, weights = ragged_routing(tokens, experts, top_k, seed=seed, hot_fraction=0.8)
    plan = build_routing_plan(
        index.to(device), weights.to(device), expert_base=0, num_local_experts=experts, tile_m=QTILE_M
    )
    gen = torch.Generator().manual_seed(seed)
    fmt = fl.fp8_format()
    aq = fl.quantize_rows(torch.randn(plan.num_pairs, inter, generator=gen).to(device), fmt)
    dh = fl.quantize_rows(torch.randn(plan.num_pairs, 2 * inter, generator=gen).to(device), fmt, segments=2)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(device)
    dyq = fl.quantize_rows(torch.randn(tokens, hidden, generator=gen).to(device), fmt)
    return (
        plan,
        fmt,
        aq,
        dh,
        fl.quantize_w2_fwd(w2, fmt),
        fl.quantize_w1_bwd(w1, fmt),
        dyq,
        fl.quantize_w2_bwd(w2, fmt),
    )


def _reference(a_rows, b_weights, plan, row_scale=None):
    """float64: out[r] = row_scale[r] * A[r] @ B[e]^T per expert's rows."""
    offsets = plan.expert_offsets.tolist()
    out = torch.zeros(a_rows.shape[0], b_weights.shape[1], dtype=torch.float64)
    for e in range(b_weights.shape[0]):
        r0, r1 = offsets[e], offsets[e + 1]
        out[r0:r1] = a_rows[r0:r1] @ b_weights[e].T
    if row_scale is not None:
        out *= row_scale.double().cpu()[:, None]
    return out


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "hidden,inter",
    [(256, 128), (384, 256), (1024, 512), (192, 96)],
    ids=["small", "two_k_blocks", "eight_k_blocks", "ragged"],
)
def test_ws_gemm_matches_the_triton_kernel(hidden, inter):
    """FC2 (row-scaled output, K = I), the FC2 dgrad (dy's rows gathered, K = H) and the two-segment FC1 dgrad
    (K = 2I), ragged routing with an empty expert and one taking most rows; I = 96 (K past a block, N not a multiple
    of 128) leaves out the FC1 dgrad: two segments need each K a multiple of 128, and asking for it there is an
    error."""
    device = "cuda"
    plan, fmt, aq, dh, w2f, w1b, dyq, w2b = _quantised_problem(300, hidden, inter, 4, 2, seed=5, device=device)
    # The hot expert fills whole tiles, whose parts the TMA-store configs store by TMA.
    assert int(plan.expert_offsets.diff().max()) >= QTILE_M
    # (name, A, B, segments, row scale, gather): the FC2 dgrad gathers dy's rows (cp.async producer warps).
    cases = [("FC2", aq, w2f, 1, plan.row_weight, False), ("FC2 dgrad", dyq, w2b, 1, None, True)]
    if inter % 128 == 0:
        cases.append(("FC1 dgrad", dh, w1b, 2, None, False))
    else:
        with pytest.raises(ValueError, match="multiple of 128"):
            fl.fp8_grouped_gemm(dh, w1b, plan, fmt, out_dtype=torch.float32, segments=2, use_ws=True)
    for (name, a, b, segments, row_scale, gather), out_dtype in itertools.product(
        cases, (torch.float32, torch.bfloat16)
    ):
        # fp32 outputs are stored from registers; bf16 ones (the layer's) by TMA where a config says so and a 64-row
        # part of a tile holds only its expert's rows (the hot expert has several such parts, the others end inside
        # one). Both kernels round the same fp32 value; one bf16 step of slack for a last-bit fp32 difference.
        tol = 1e-6 if out_dtype == torch.float32 else 2**-8
        kw = {"out_dtype": out_dtype, "segments": segments, "row_scale": row_scale, "gather": gather}
        ws = fl.fp8_grouped_gemm(a, b, plan, fmt, use_ws=True, **kw)
        triton_kernel = fl.fp8_grouped_gemm(a, b, plan, fmt, use_ws=False, use_tma=False, **kw)
        torch.testing.assert_close(ws, triton_kernel, rtol=tol, atol=tol, msg=name)
        # Every config, with as many programs as tiles allow and with 1 and 3 programs (many tiles each: the
        # persistent loop, the ring's later rounds, the next tile's indices loaded ahead).
        for cfg in WS_CONFIGS:
            for programs in (None, 1, 3):
                c = torch.full_like(ws, float("nan"))  # a row left unwritten shows
                fp8_grouped_gemm_ws(
                    a, b, plan, c, segments=segments, row_scale=row_scale, gather=gather, config=cfg, programs=programs
                )
                torch.testing.assert_close(
                    c, triton_kernel, rtol=tol, atol=tol, msg=f"{name}, {out_dtype}, {cfg}, {programs}"
                )
        if out_dtype != torch.float32:
            continue
        a_deq = fl.dequantize_rows(a, fmt, segments=segments).double().cpu()
        if gather:
            a_deq = a_deq[plan.row_src[: plan.num_pairs].long().cpu()]
        b_deq = fl.dequantize_weight(b, fmt, k_halves=segments).double().cpu()
        # Hopper's fp8 MMA accumulates each 128-wide step with fewer mantissa bits than fp32 (both kernels alike).
        assert rel_err(ws.cpu(), _reference(a_deq, b_deq, plan, row_scale)) < 1e-3, name


def _plan_without_tiles(seed: int, device: str):
    """A rank's plan (local experts 0-3 of 8) when every token goes to the other rank's experts: rows, no tiles."""
    index, weights = ragged_routing(64, 8, 2, seed=seed, empty_expert=None, hot_expert=None, forbid=range(0, 4))
    plan = build_routing_plan(index.to(device), weights.to(device), expert_base=0, num_local_experts=4, tile_m=QTILE_M)
    assert int(plan.num_tiles[0]) == 0 and plan.num_pairs > 0
    return plan


@pytest.mark.gpu
@needs_hopper
def test_ws_gemm_on_a_rank_that_receives_nothing():
    """Every token routed to other ranks' experts: the plan has rows but no tiles; the kernel must finish and write
    nothing (the output keeps its fill)."""
    device = "cuda"
    plan = _plan_without_tiles(6, device)
    fmt = fl.fp8_format()
    aq = fl.quantize_rows(torch.randn(plan.num_pairs, 128, device=device), fmt)
    w2f = fl.quantize_w2_fwd(torch.randn(4, 256, 128, device=device), fmt)
    assert ws_gemm_unavailable(aq.data, w2f.data, mx=False, gather=False, segments=1, k=128) is None
    c = torch.full((plan.num_pairs, 256), 7.0, device=device)
    fp8_grouped_gemm_ws(aq, w2f, plan, c, segments=1, row_scale=None)
    torch.cuda.synchronize()
    assert torch.equal(c, torch.full_like(c, 7.0))


# ----------------------------------------------------------------------------------------------------------------
# FC1 + SwiGLU (kernels/fp8_fc1_ws.py)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "save_h,pow2,stages,clamp",
    [(True, False, 4, False), (False, True, 4, False), (True, False, 3, False), (True, False, 4, True)],
    ids=["save_h", "pow2", "3_stages", "clamp"],
)
def test_ws_fc1_kernel_compiles_for_hopper_with_its_register_split(save_h, pow2, stages, clamp):
    """As the launcher launches it: four gathering producer warps, two MMA partitions holding the gate and up
    accumulators; no spill (x's rows are addressed by 32-bit offsets for that), no wgmma serialisation, the ring
    (A once, gate and up boxes of W1) in shared memory. ``clamp``: the clamped SwiGLU's epilogue (activation_clamp),
    within the same bounds."""
    types = {
        "xq_ptr": "*fp8e4nv",
        "row_src_ptr": "*i32",
        "xs_ptr": "*fp32",
        "ws_ptr": "*fp32",
        "h_ptr": "*bf16",
        "aq_ptr": "*fp8e4nv",
        "as_ptr": "*fp32",
        "b_desc": "tensordesc<fp8e4nv[128, 128]>",
    }
    ((_, registers, spill, smem, partitions, wgmma),) = compile_for_hopper(
        "prime_megamoe.kernels.fp8_fc1_ws:fp8_fc1_swiglu_ws_kernel",
        {
            "SAVE_H": save_h,
            "CLAMP": clamp,
            "POW2": pow2,
            "STAGES": stages,
            "TILE_M": QTILE_M,
            "LOAD_WARPS": WS_GATHER_LOAD_WARPS,
            "LOAD_REGS": WS_GATHER_LOAD_REGS,
            "MMA_REGS": WS_GATHER_MMA_REGS,
        },
        ["--warps", "4", "--maxnreg", "168", "--types", json.dumps(types)],
    )
    assert wgmma == "ok", "ptxas serialises the kernel's wgmma instructions (see register_check.wgmma_serialised)"
    # Triton 3.6 (the GPU machines') keeps it all in registers; 3.9 spills 24 bytes, among them a value computed
    # before the partitions split that each step then reloads (from L1). The bound keeps that from growing.
    assert int(registers) == 168 and int(spill) <= (0 if triton.__version__.startswith("3.6") else 24)
    assert stages * (128 + 256) * 128 <= int(smem) <= 227 * 1024
    assert max(int(v) for v in partitions.split(",")) >= 200


def test_ws_fc1_applicability_says_why_not():
    x = torch.empty(16, 256, dtype=fl.FP8_DTYPE)
    w1 = torch.empty(2, 512, 256, dtype=fl.FP8_DTYPE)
    assert "CUDA GPU" in ws_fc1_unavailable(x, w1, mx=False, group=128, weight_rows=128, inter=256)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "hidden,inter,clamp",
    [(256, 256, None), (208, 384, None), (256, 256, 0.75)],
    ids=["two_k_blocks", "partial_k_block", "two_k_blocks_clamp"],
)
def test_ws_fc1_matches_the_triton_kernel(hidden, inter, clamp):
    """h and the quantised a against the Triton FC1 + SwiGLU kernel: ragged routing (an empty expert, one taking
    most rows), H = 208 (the last K step partial), plain and power-of-two scales, with and without h, as many
    programs as tiles and 1 and 3 (several tiles a program), 4 and 3 stages; ``clamp``: the clamped SwiGLU
    (activation_clamp; h stays unclamped). Both compute the same fp32 values (the first form of the kernel gave the
    same bits); a quantised value may still land one e4m3 step away where the two round a last fp32 bit apart."""
    device = "cuda"
    index, weights = ragged_routing(300, 4, 2, seed=9, hot_fraction=0.8)
    plan = build_routing_plan(index.to(device), weights.to(device), expert_base=0, num_local_experts=4, tile_m=QTILE_M)
    assert int(plan.expert_offsets.diff().min()) == 0 and int(plan.expert_offsets.diff().max()) > QTILE_M
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(300, hidden, generator=gen).to(device)
    w1 = (torch.randn(4, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device)
    pairs = plan.num_pairs
    for pow2 in (False, True):
        fmt = fl.fp8_format(pow2)
        xq, w1q = fl.quantize_rows(x, fmt), fl.quantize_w1_fwd(w1, fmt)
        h_ref, a_ref = fl.fp8_fc1_swiglu(
            xq, w1q, plan, fmt, inter=inter, h_dtype=torch.bfloat16, activation_clamp=clamp
        )
        a_ref_f = fl.dequantize_rows(a_ref, fmt)
        a_tol = 2**-3 * float(a_ref_f.abs().max())
        for save_h, programs, stages in itertools.product((True, False), (None, 1, 3), (4, 3)):
            msg = f"pow2={pow2}, save_h={save_h}, programs={programs}, stages={stages}"
            h = torch.full((pairs, 2 * inter), float("nan"), dtype=torch.bfloat16, device=device)
            aq = torch.full((pairs, inter), 0x7F, dtype=torch.uint8, device=device).view(fl.FP8_DTYPE)  # NaN
            a_s = torch.full((pairs, inter // 128), float("nan"), device=device)
            fp8_fc1_swiglu_ws(
                xq,
                w1q,
                plan,
                h if save_h else None,
                aq,
                a_s,
                inter=inter,
                pow2=pow2,
                programs=programs,
                stages=stages,
                activation_clamp=clamp,
            )
            torch.testing.assert_close(a_s, a_ref.scale, rtol=1e-6, atol=0, msg=msg)
            torch.testing.assert_close(
                fl.dequantize_rows(fl.QTensor(aq, a_s), fmt), a_ref_f, rtol=0, atol=a_tol, msg=msg
            )
            if save_h:
                torch.testing.assert_close(h, h_ref, rtol=2**-8, atol=2**-8, msg=msg)
            else:
                assert torch.isnan(h).all(), msg  # without h nothing is written there
        h, a = fl.fp8_fc1_swiglu(
            xq, w1q, plan, fmt, inter=inter, h_dtype=torch.bfloat16, use_ws=True, activation_clamp=clamp
        )
        torch.testing.assert_close(h, h_ref, rtol=2**-8, atol=2**-8)
        if clamp is not None:  # the clamp acted: a = silu(min(g, c)) * clamp(u, -c, c) of h, to e4m3 rounding
            g, u = h_ref.float().chunk(2, dim=1)
            want = torch.nn.functional.silu(g.clamp(max=clamp)) * u.clamp(-clamp, clamp)
            assert rel_err(fl.dequantize_rows(a, fmt), want) < 0.05
            assert rel_err(want, torch.nn.functional.silu(g) * u) > 0.3
    with pytest.raises(ValueError, match="not mx"):
        fl.fp8_fc1_swiglu(xq, w1q, plan, fl.MX_FORMAT, inter=inter, h_dtype=None, use_ws=True)


@pytest.mark.gpu
@needs_hopper
def test_ws_fc1_on_a_rank_that_receives_nothing():
    """No row for any local expert: the kernel finishes and writes nothing."""
    device = "cuda"
    plan = _plan_without_tiles(8, device)
    fmt = fl.fp8_format()
    xq = fl.quantize_rows(torch.randn(64, 256, device=device), fmt)
    w1q = fl.quantize_w1_fwd(torch.randn(4, 256, 256, device=device), fmt)
    h = torch.full((plan.num_pairs, 256), 7.0, dtype=torch.bfloat16, device=device)
    aq = torch.zeros(plan.num_pairs, 128, dtype=torch.uint8, device=device)
    a_s = torch.full((plan.num_pairs, 1), 7.0, device=device)
    fp8_fc1_swiglu_ws(xq, w1q, plan, h, aq.view(fl.FP8_DTYPE), a_s, inter=128, pow2=False)
    torch.cuda.synchronize()
    assert (h == 7.0).all() and (aq == 0).all() and (a_s == 7.0).all()


# ----------------------------------------------------------------------------------------------------------------
# The weight gradient (kernels/fp8_wgrad_ws.py): the layer's dW1 and dW2 on Hopper
# ----------------------------------------------------------------------------------------------------------------
WGRAD_CASES = [(cfg, False) for cfg in WS_WGRAD_CONFIGS] + [(WS_WGRAD_DEFAULT, True)]


@pytest.mark.parametrize(
    "cfg,tile_list", WGRAD_CASES, ids=[_config_id(c) + ("_tile_list" if t else "") for c, t in WGRAD_CASES]
)
def test_ws_wgrad_kernel_compiles_for_hopper_with_its_register_split(cfg, tile_list):
    """Every config, and the layer's with the tile list of an expert-parallel (several-segment) plan."""
    _assert_compiles_with_register_split(
        "prime_megamoe.kernels.fp8_wgrad_ws:fp8_grouped_wgrad_ws_kernel",
        cfg,
        {
            "STAGES": cfg.stages,
            "HALVES": cfg.halves,
            "SUBS": cfg.subs,
            "TMA_STORE": cfg.tma_store,
            "TILE_LIST": tile_list,
            "LOAD_REGS": WS_LOAD_REGS,
            "MMA_REGS": WS_MMA_REGS,
        },
        {"as_ptr": "*fp32", "bs_ptr": "*fp32", "c_ptr": "*bf16", "expert_tiles_ptr": "*i32", "tiles_ptr": "*i32"},
    )


def test_ws_wgrad_applicability_says_why_not():
    a = torch.empty(256, 256, dtype=fl.FP8_DTYPE)
    assert "CUDA GPU" in ws_wgrad_unavailable(a, a, mx=False)


def _cols_t_problem(index, weights, m, n, local_experts, device, seed):
    plan = build_routing_plan(
        index.to(device), weights.to(device), expert_base=0, num_local_experts=local_experts, tile_m=QTILE_M
    )
    gen = torch.Generator().manual_seed(seed)
    fmt = fl.fp8_format()
    tokens = index.shape[0]
    a_t = fl.quantize_sorted_cols_t(torch.randn(tokens, m, generator=gen).to(device), plan, fmt)
    b_t = fl.quantize_sorted_cols_t(torch.randn(tokens, n, generator=gen).to(device), plan, fmt)
    return plan, fmt, a_t, b_t, fl.expert_tile_offsets(plan)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m,n", [(256, 384), (96, 200)], ids=["whole_blocks", "partial_blocks"])
def test_ws_wgrad_matches_the_triton_kernel(m, n):
    """Ragged routing (an empty expert: zeros; a hot one with several row tiles); M = 96, N = 200 leave partial
    output blocks (stores from registers); M = 256 in bf16 takes the TMA stores. Every config, 1 and 3 programs."""
    device = "cuda"
    index, weights = ragged_routing(300, 4, 2, seed=7, hot_fraction=0.8)
    plan, fmt, a_t, b_t, tiles = _cols_t_problem(index, weights, m, n, 4, device, seed=7)
    assert int(plan.expert_offsets.diff().min()) == 0 and int((tiles[1:] - tiles[:-1]).max()) >= 2
    for out_dtype in (torch.float32, torch.bfloat16):
        ref = torch.full((4, m, n), float("nan"), dtype=out_dtype, device=device)
        fl.fp8_grouped_wgrad(a_t, b_t, plan, fmt, ref, expert_tiles=tiles, use_tma=False)
        tol = 1e-6 if out_dtype == torch.float32 else 2**-8
        for cfg in WS_WGRAD_CONFIGS:
            for programs in (None, 1, 3):
                out = torch.full_like(ref, float("nan"))  # an element left unwritten shows
                fp8_grouped_wgrad_ws(a_t, b_t, out, expert_tiles=tiles, config=cfg, programs=programs)
                torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=f"{out_dtype}, {cfg}, {programs}")
        out = torch.full_like(ref, float("nan"))
        fl.fp8_grouped_wgrad(a_t, b_t, plan, fmt, out, expert_tiles=tiles, use_ws=True)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert "not mx" in ws_wgrad_unavailable(a_t.data, b_t.data, mx=True)


@pytest.mark.gpu
@needs_hopper
def test_ws_wgrad_on_a_rank_that_receives_nothing():
    """No row for any local expert: every expert's gradient is zeros, every element written."""
    device = "cuda"
    index, weights = ragged_routing(64, 8, 2, seed=8, empty_expert=None, hot_expert=None, forbid=range(0, 4))
    plan, fmt, a_t, b_t, tiles = _cols_t_problem(index, weights, 128, 128, 4, device, seed=8)
    assert int(tiles[-1]) == 0
    out = torch.full((4, 128, 128), float("nan"), device=device)
    fp8_grouped_wgrad_ws(a_t, b_t, out, expert_tiles=tiles)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))
