"""What the weight-gradient kernel pays for its row gather: times the grouped wgrad at the Qwen3-30B-A3B shape with
the gathered operand as it runs in the layer and with a dense copy of the same rows (one GPU, bf16).

    python scripts/wgrad_probe.py [--tokens 16384]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops import launch
from prime_megamoe.ops.routing_plan import build_routing_plan


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args()
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, dtype=torch.bfloat16, device="cuda")
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=w1.shape[0], tile_m=tile_m())
    dh = torch.randn(plan.sorted_rows, w1.shape[1], device="cuda", dtype=torch.bfloat16)
    aw = torch.randn(plan.sorted_rows, w2.shape[2], device="cuda", dtype=torch.bfloat16)
    x_sorted = x[plan.row_src.long()]
    dy = torch.randn_like(x)
    dy_sorted = dy[plan.row_src.long()]
    flops1 = 2 * plan.num_pairs * w1.shape[1] * w1.shape[2]
    flops2 = 2 * plan.num_pairs * w2.shape[1] * w2.shape[2]
    cases = {
        "W1 wgrad, x gathered": (lambda: launch.grouped_wgrad(dh, x, plan, torch.empty_like(w1), gather_a=False,
                                                              gather_b=True), flops1),
        "W1 wgrad, x dense": (lambda: launch.grouped_wgrad(dh, x_sorted, plan, torch.empty_like(w1), gather_a=False,
                                                           gather_b=False), flops1),
        "W2 wgrad, dy gathered": (lambda: launch.grouped_wgrad(dy, aw, plan, torch.empty_like(w2), gather_a=True,
                                                               gather_b=False), flops2),
        "W2 wgrad, dy dense": (lambda: launch.grouped_wgrad(dy_sorted, aw, plan, torch.empty_like(w2),
                                                            gather_a=False, gather_b=False), flops2),
    }
    print(f"{'case':28s} {'ms':>8s} {'TFLOP/s':>8s}")
    for name, (fn, flops) in cases.items():
        ms = do_bench(fn, warmup=50, rep=200)
        print(f"{name:28s} {ms:8.3f} {flops / ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
