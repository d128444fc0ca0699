"""Every autotuning candidate of the weight-gradient kernel, checked and timed at a layer's shape (one GPU, bf16).

    python scripts/wgrad_probe.py [--shape qwen3-30b-a3b] [--tokens 16384] [--segments 2]

For dW1 = dh^T x[src] (x gathered) and dW2 = dy[src]^T aw, with ragged routing (expert 0 gets no rows, so its
gradient must be zeros): the error of each candidate against a float32 per-expert reference, its time and TFLOP/s.
``--segments 2`` plans the rows as two source blocks, as expert parallelism over two ranks does.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.testing import do_bench

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels.grouped_gemm import grouped_wgrad_kernel
from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops.routing_plan import build_routing_plan


def reference(a_sorted, b_sorted, plan, num_experts):
    off = plan.expert_offsets.tolist()
    out = torch.zeros(num_experts, a_sorted.shape[1], b_sorted.shape[1], device=a_sorted.device)
    for s in range(plan.num_segments):
        for e in range(num_experts):
            lo, hi = off[s * (num_experts + 1) + e], off[s * (num_experts + 1) + e + 1]
            out[e] += a_sorted[lo:hi].float().T @ b_sorted[lo:hi].float()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--segments", type=int, default=2)
    args = p.parse_args()
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, dtype=torch.bfloat16, device="cuda")
    index[index == 0] = 1  # expert 0: no rows
    num_experts = w1.shape[0]
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=num_experts, tile_m=tile_m(),
                              num_segments=args.segments)
    src = plan.row_src.long()
    dh = torch.randn(plan.sorted_rows, w1.shape[1], device="cuda", dtype=torch.bfloat16)
    aw = torch.randn(plan.sorted_rows, w2.shape[2], device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    cases = {  # name: (a, b, gather_a, gather_b, reference)
        "dW1": (dh, x, False, True, reference(dh, x[src], plan, num_experts)),
        "dW2": (dy, aw, True, False, reference(dy[src], aw, plan, num_experts)),
    }
    print(f"{'case':5s} {'config':58s} {'rel err':>9s} {'ms':>7s} {'TFLOP/s':>8s}")
    for name, (a, b, gather_a, gather_b, want) in cases.items():
        m, n = a.shape[1], b.shape[1]
        flops = 2 * plan.num_pairs * m * n
        for cfg in grouped_wgrad_kernel.configs:
            kw = cfg.kwargs
            out = torch.full((num_experts, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            grid = (triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(n, kw["BLOCK_N"]), num_experts)

            def run():
                grouped_wgrad_kernel.fn[grid](
                    a, plan.row_src, b, plan.row_src, out, plan.expert_offsets,
                    m, n, plan.num_pairs, plan.num_segments, num_experts + 1,
                    a.stride(0), b.stride(0), out.stride(0), out.stride(1), out.stride(2),
                    GATHER_A=gather_a, GATHER_B=gather_b, CAST_F32=False, IEEE=False,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw,
                )

            run()
            err = ((out.float() - want).norm() / want.norm()).item()
            zeros = bool((out[0] == 0).all())
            ms = do_bench(run, warmup=25, rep=100)
            label = f"{kw} w{cfg.num_warps} s{cfg.num_stages}"
            flag = "" if zeros and err < 1e-2 else "  WRONG"
            print(f"{name:5s} {label:58s} {err:9.2e} {ms:7.3f} {flops / ms / 1e9:8.1f}{flag}")


if __name__ == "__main__":
    main()
