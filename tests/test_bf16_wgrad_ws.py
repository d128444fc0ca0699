"""The warp-specialised Hopper weight gradient on bf16 operands (``kernels/wgrad_ws.py``,
``ops/bf16_ws_launch.bf16_grouped_wgrad_ws``).

Gluon kernels have no interpreter: on the CPU the kernel is compiled for sm_90 as the launcher runs it (no spill, no
wgmma serialisation, the ring in shared memory) and the applicability rules are checked; on a Hopper GPU both forms
the layer has (dW1: A sorted, B gathered; dW2: A gathered, B sorted) are checked against float64 torch on the same
bf16 operands and against the Triton kernel, with ragged routing (an expert without rows, one with most, experts with
fewer rows than a step), one and two segments, M not a multiple of the output box, and few persistent programs."""

from __future__ import annotations

import json

import pytest
import torch

from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops import launch
from prime_megamoe.ops.bf16_ws_launch import (
    BF16_WGRAD_WS_CONFIGS,
    WGRAD_WS_LOAD_REGS,
    WGRAD_WS_LOAD_WARPS,
    WGRAD_WS_MMA_REGS,
    bf16_grouped_wgrad_ws,
    bf16_wgrad_ws_unavailable,
)
from prime_megamoe.ops.routing_plan import build_routing_plan
from tests.oracle import ragged_routing, rel_err
from tests.test_register_check import compile_for_hopper

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90 wgmma code, no interpreter)")


@pytest.mark.parametrize(
    "cfg",
    BF16_WGRAD_WS_CONFIGS,
    ids=lambda c: f"n{c.block_n}s{c.stages}{'t' if c.tma_store else ''}{'' if c.stagger else 'u'}",
)
@pytest.mark.parametrize("transpose", [True, False], ids=["dW1", "dW2"])
def test_bf16_wgrad_ws_kernel_compiles_for_hopper_without_spills(cfg, transpose):
    sub_n = cfg.block_n // cfg.subs
    types = {
        "d_desc": f"tensordesc<bf16[64, {cfg.block_n}]>",
        "c_desc": f"tensordesc<bf16[{sub_n}, 64]>" if transpose else f"tensordesc<bf16[64, {sub_n}]>",
        "d_ptr": "*bf16",
        "g_ptr": "*bf16",
        "c_ptr": "*bf16",
        "row_src_ptr": "*i32",
        "expert_offsets_ptr": "*i32",
    }
    constexprs = {
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": 64,
        "STAGES": cfg.stages,
        "SUBS": cfg.subs,
        "TMA_STORE": cfg.tma_store,
        "TRANSPOSE_C": transpose,
        "STAGGER": cfg.stagger,
        "LOAD_WARPS": WGRAD_WS_LOAD_WARPS,
        "LOAD_REGS": WGRAD_WS_LOAD_REGS,
        "MMA_REGS": WGRAD_WS_MMA_REGS,
    }
    options = ["--warps", "4", "--maxnreg", "168", "--types", json.dumps(types)]
    ((_, registers, spill, smem, partitions, wgmma),) = compile_for_hopper(
        "prime_megamoe.kernels.wgrad_ws:bf16_grouped_wgrad_ws_kernel", constexprs, options
    )
    assert wgmma == "ok", "ptxas serialises the kernel's wgmma instructions (see register_check.wgmma_serialised)"
    assert int(registers) == 168 and int(spill) == 0, f"{spill} bytes spilled"
    ring = cfg.stages * (128 + cfg.block_n) * 64 * 2  # A's two boxes and B's, 64 rows of bf16
    assert ring + (2 * 64 * sub_n * 2 if cfg.tma_store else 0) <= int(smem) <= 227 * 1024
    assert max(int(v) for v in partitions.split(",")) >= 200


def test_bf16_wgrad_ws_applicability_says_why_not():
    a, b = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64, 128, dtype=torch.bfloat16)
    out = torch.empty(2, 256, 128, dtype=torch.bfloat16)
    assert "CUDA GPU" in bf16_wgrad_ws_unavailable(a, b, out, gather_a=False)
    if HOPPER:
        a, b, out = a.cuda(), b.cuda(), out.cuda()
        assert bf16_wgrad_ws_unavailable(a, b, out, gather_a=False) is None
        assert "bf16 operands and output" in bf16_wgrad_ws_unavailable(a, b, out.float(), gather_a=True)
        assert "contiguous" in bf16_wgrad_ws_unavailable(a, b, out.transpose(1, 2), gather_a=True)
        narrow = torch.empty(2, 256, 100, dtype=torch.bfloat16, device="cuda")
        assert "16-byte pieces" in bf16_wgrad_ws_unavailable(a, b[:, :100], narrow, gather_a=False)


def test_grouped_wgrad_asks_for_the_kernel_only_where_it_applies():
    """use_ws=True where the kernel cannot run is an error naming why; use_ws=None runs the Triton kernel there, the
    same values as use_ws=False."""
    index, weights = ragged_routing(40, 4, 2, seed=11)
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=4, tile_m=tile_m())
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(plan.sorted_rows, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(40, 48, generator=gen).to(torch.bfloat16)
    out = torch.empty(4, 32, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="warp-specialised kernel cannot run here: it runs on a CUDA GPU only"):
        launch.grouped_wgrad(a, x, plan, out, gather_a=False, gather_b=True, use_ws=True)
    chosen = launch.grouped_wgrad(a, x, plan, out.clone(), gather_a=False, gather_b=True, use_ws=None)
    plain = launch.grouped_wgrad(a, x, plan, out.clone(), gather_a=False, gather_b=True, use_ws=False)
    assert torch.equal(chosen, plain)


def _reference(a_sorted, b_sorted, plan):
    """float64: out[e] = sum over the segments of A[rows of (s, e)]^T @ B[rows of (s, e)]."""
    experts = plan.num_local_experts
    off = plan.expert_offsets.tolist()
    out = torch.zeros(experts, a_sorted.shape[1], b_sorted.shape[1], dtype=torch.float64)
    for s in range(plan.num_segments):
        for e in range(experts):
            lo, hi = off[s * (experts + 1) + e], off[s * (experts + 1) + e + 1]
            out[e] += a_sorted[lo:hi].T @ b_sorted[lo:hi]
    return out


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("segments", [1, 2])
@pytest.mark.parametrize("hidden,inter", [(256, 128), (512, 80), (1024, 384)], ids=["small", "ragged_m", "wide"])
def test_bf16_wgrad_ws_matches_float64_and_the_triton_kernel(hidden, inter, segments):
    device, experts, tokens = "cuda", 12, 600
    index, weights = ragged_routing(tokens, experts, 3, seed=5 + segments, hot_fraction=0.6)
    index[(index == 11) & (torch.arange(tokens)[:, None] % 6 != 0)] = 1  # expert 11: fewer rows than a step
    plan = build_routing_plan(
        index.to(device),
        weights.to(device),
        expert_base=0,
        num_local_experts=experts,
        tile_m=tile_m(),
        num_segments=segments,
    )
    counts = plan.expert_offsets.view(segments, experts + 1).diff(dim=1)
    assert int(counts.max()) > 64 and 0 < int(counts[counts > 0].min()) < 64, counts  # several steps, and short
    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)

    x, dy = rand(tokens, hidden), rand(tokens, hidden)
    # Sorted rows no plan wrote hold NaN: a kernel that reads them gives NaN gradients.
    dh = torch.full((plan.sorted_rows, 2 * inter), float("nan"), device=device, dtype=torch.bfloat16)
    aw = torch.full((plan.sorted_rows, inter), float("nan"), device=device, dtype=torch.bfloat16)
    src = plan.row_src.long()
    written = torch.zeros(plan.sorted_rows, dtype=torch.bool, device=device)
    off = plan.expert_offsets.tolist()
    for s in range(segments):
        written[off[s * (experts + 1)] : off[s * (experts + 1) + experts]] = True
    dh[written], aw[written] = rand(int(written.sum()), 2 * inter), rand(int(written.sum()), inter)
    rows = written.nonzero().squeeze(1)
    sorted_f64 = lambda t: torch.where(written[:, None], t, 0).double().cpu()  # noqa: E731
    gathered_f64 = lambda t: torch.where(written[:, None], t[src.clamp(0, tokens - 1)], 0).double().cpu()  # noqa: E731
    assert int(rows.numel()) == plan.num_pairs
    cases = {  # name: (a, b, gather_a, float64 reference)
        "dW1": (dh, x, False, _reference(sorted_f64(dh), gathered_f64(x), plan)),
        "dW2": (dy, aw, True, _reference(gathered_f64(dy), sorted_f64(aw), plan)),
    }
    for name, (a, b, gather_a, want) in cases.items():
        m, n = a.shape[1], b.shape[1]
        assert want[0].abs().sum() == 0  # expert 0 has no rows
        triton_out = launch.grouped_wgrad(
            a, b, plan, torch.empty(experts, m, n, device=device, dtype=torch.bfloat16), gather_a=gather_a,
            gather_b=not gather_a,
        )  # fmt: skip
        assert rel_err(triton_out.cpu(), want) < 4e-3, name
        for cfg in BF16_WGRAD_WS_CONFIGS:
            for programs in (None, 1, 5):
                out = torch.full((experts, m, n), float("nan"), device=device, dtype=torch.bfloat16)
                bf16_grouped_wgrad_ws(a, b, plan, out, gather_a=gather_a, config=cfg, programs=programs)
                got = out.cpu()
                assert not got.isnan().any(), (name, cfg, programs, "NaN: unwritten output or unwritten rows read")
                assert torch.equal(got[0], torch.zeros_like(got[0])), (name, cfg, programs)
                assert rel_err(got, want) < 4e-3, (name, cfg, programs, rel_err(got, want))
        why_not = bf16_wgrad_ws_unavailable(a, b, triton_out, gather_a=gather_a)
        if not gather_a and m % 128:  # the transposed output's boxes would reach the next expert's rows
            assert "multiple of 128" in why_not, name
            with pytest.raises(ValueError, match="multiple of 128"):
                launch.grouped_wgrad(
                    a, b, plan, torch.empty_like(triton_out), gather_a=False, gather_b=True, use_ws=True
                )
            continue
        assert why_not is None, (name, why_not)
        chosen = launch.grouped_wgrad(
            a, b, plan, torch.empty(experts, m, n, device=device, dtype=torch.bfloat16), gather_a=gather_a,
            gather_b=not gather_a, use_ws=True,
        )  # fmt: skip
        assert rel_err(chosen.cpu(), triton_out.cpu()) < 4e-3, name
        again = launch.grouped_wgrad(
            a, b, plan, torch.empty_like(chosen), gather_a=gather_a, gather_b=not gather_a, use_ws=True
        )
        assert torch.equal(again, chosen), f"{name}: not bitwise repeatable"


@pytest.mark.gpu
@needs_hopper
def test_bf16_wgrad_ws_on_a_rank_that_receives_nothing():
    """Every token routed to the other rank's experts: no local rows; every gradient is zero."""
    device = "cuda"
    index, weights = ragged_routing(64, 8, 2, seed=3, empty_expert=None, hot_expert=None, forbid=range(0, 4))
    plan = build_routing_plan(index.to(device), weights.to(device), expert_base=0, num_local_experts=4, tile_m=128)
    assert int(plan.expert_offsets[-1]) == 0
    dh = torch.randn(plan.sorted_rows, 256, device=device, dtype=torch.bfloat16)
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    out = torch.full((4, 256, 128), 7.0, device=device, dtype=torch.bfloat16)
    bf16_grouped_wgrad_ws(dh, x, plan, out, gather_a=False)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))
