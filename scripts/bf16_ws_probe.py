"""Usage: python scripts/bf16_ws_probe.py [--shape qwen3-30b-a3b] [--tokens 16384] [--iters 20] [--gemms fc2 ...]

Times each bf16 grouped GEMM of a layer's shape (FC2 with the top-k weights, the FC1 dgrad, the FC2 dgrad gathering
dy, FC1's GEMM gathering x) on the Triton kernel, launched as the layer launches it (FC2 by pointer reads), and on
the warp-specialised kernel in each of its configs
(``ops/bf16_ws_launch.py``), on random top-k routing; prints ms, TFLOP/s and each config's relative difference from
the Triton kernel's output. ``fc1_swiglu``: FC1 + SwiGLU, h saved and not, on the Triton kernel and on the
warp-specialised one (``kernels/fc1_ws.py``) with 4 and 3 stages. One Hopper GPU.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from prime_megamoe.bench import SHAPES, make_inputs
from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.ops import launch
from prime_megamoe.ops.bf16_ws_launch import BF16_WS_CONFIGS, bf16_fc1_swiglu_ws, bf16_grouped_gemm_ws
from prime_megamoe.ops.routing_plan import build_routing_plan

GEMMS = ("fc2", "fc1_dgrad", "fc2_dgrad", "fc1", "fc1_swiglu")


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_fc1_swiglu(x, w1, plan, iters: int) -> None:
    """FC1 + SwiGLU on the Triton kernel and the warp-specialised one, h saved and not; each line also gives the
    relative difference of the ws kernel's h and a from the Triton kernel's."""
    pairs, inter = plan.num_pairs, w1.shape[1] // 2
    flop = 2 * pairs * 2 * inter * x.shape[1]
    for save_h in (True, False):
        h_ref, a_ref = launch.fc1_swiglu(x, w1, plan, True)
        ms = median_ms(lambda: launch.fc1_swiglu(x, w1, plan, save_h), iters)  # noqa: B023
        line = f"FC1 + SwiGLU, save_h={save_h}: triton {ms:.4f} ms ({flop / ms / 1e9:.0f} TFLOP/s)"
        for stages in (4, 3):
            h = torch.empty(plan.sorted_rows, 2 * inter, device="cuda", dtype=torch.bfloat16) if save_h else None
            a = torch.empty(plan.sorted_rows, inter, device="cuda", dtype=torch.bfloat16)
            ms = median_ms(lambda: bf16_fc1_swiglu_ws(x, w1, plan, h, a, stages=stages), iters)  # noqa: B023
            diff = ((a[:pairs].float() - a_ref[:pairs].float()).norm() / a_ref[:pairs].float().norm()).item()
            if save_h:
                ref = h_ref[:pairs].float()
                diff = max(diff, ((h[:pairs].float() - ref).norm() / ref.norm()).item())
            line += f" | ws s{stages} {ms:.4f} ms ({flop / ms / 1e9:.0f} TFLOP/s, diff {diff:.1e})"
        print(line, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--gemms", nargs="+", default=list(GEMMS), choices=list(GEMMS), help="the GEMMs to time")
    args = p.parse_args()
    # The benchmark's inputs (one rank): tokens, routing and weights
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, rank=0, world=1, seed=0)
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=w1.shape[0], tile_m=QTILE_M)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rand(*size):
        return torch.randn(*size, device="cuda", generator=gen).to(torch.bfloat16)

    inter = w2.shape[2]
    dy, act, dh = rand(*x.shape), rand(plan.sorted_rows, inter), rand(plan.sorted_rows, 2 * inter)
    # (name, A, B, transpose_b, gather, row scale, the Triton kernel's use_tma as the layer calls it: FC2 by pointer)
    cases = {
        "fc2": ("FC2", act, w2, True, False, plan.row_weight, False),
        "fc1_dgrad": ("FC1 dgrad", dh, w1, False, False, None, None),
        "fc2_dgrad": ("FC2 dgrad", dy, w2, False, True, None, None),
        "fc1": ("FC1 GEMM (no SwiGLU)", x, w1, True, True, None, None),
    }
    if "fc1_swiglu" in args.gemms:
        time_fc1_swiglu(x, w1, plan, args.iters)
    cases = [cases[g] for g in args.gemms if g != "fc1_swiglu"]
    pairs = plan.num_pairs
    for name, a, b, transpose_b, gather, row_scale, use_tma in cases:
        n, k = (b.shape[1], b.shape[2]) if transpose_b else (b.shape[2], b.shape[1])
        flop = 2 * pairs * n * k
        kw = dict(transpose_b=transpose_b, gather=gather, row_scale=row_scale)
        ref = launch.grouped_gemm(a, b, plan, use_tma=use_tma, **kw)[:pairs].float()
        ms = median_ms(lambda: launch.grouped_gemm(a, b, plan, use_tma=use_tma, **kw), args.iters)  # noqa: B023
        line = f"{name}: triton {ms:.4f} ms ({flop / ms / 1e9:.0f} TFLOP/s)"
        for cfg in BF16_WS_CONFIGS:
            c = torch.empty(plan.sorted_rows, n, device="cuda", dtype=torch.bfloat16)
            ms = median_ms(lambda: bf16_grouped_gemm_ws(a, b, plan, c, config=cfg, **kw), args.iters)  # noqa: B023
            diff = ((c[:pairs].float() - ref).norm() / ref.norm()).item()
            tag = f"n{cfg.block_n} s{cfg.stages}{' tma' if cfg.tma_store else ''}{' stagger' if cfg.stagger else ''}"
            line += f" | ws {tag} {ms:.4f} ms ({flop / ms / 1e9:.0f} TFLOP/s, diff {diff:.1e})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
