"""Usage: python scripts/fp8_gemm_once.py --gemm fc2|fc1 --kernel triton|ws [--block-m M] [--stages S] [--halves H]

Run one fp8 row-tiled GEMM of the layer a few times, for a kernel profiler (one GPU, EP = 1), e.g.

    ncu --clock-control none --kernel-name regex:fp8_grouped_gemm --launch-skip 2 --launch-count 1 \\
        python scripts/fp8_gemm_once.py --gemm fc2 --kernel ws

``--gemm fc1``: FC1 + SwiGLU (kernel names fp8_fc1_swiglu_kernel / fp8_fc1_swiglu_ws_kernel).

``--kernel triton``: the Triton kernel with its first candidate config and TMA reads (what the layer runs untuned);
``ws``: the warp-specialised Gluon kernel with ``--block-m`` / ``--stages`` / ``--halves`` (TMA stores unless
``--no-tma-store``). The operands are built as in ``scripts/fp8_probe.py``; nothing is checked here (the probe and
tests/test_fp8_gemm_ws.py do that).
"""

from __future__ import annotations

import argparse
import os

import torch

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels import fp8_gemm
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.fp8_ws_launch import WSConfig, fp8_grouped_gemm_ws
from prime_megamoe.ops.routing_plan import build_routing_plan


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--gemm", choices=["fc2", "fc1_dgrad", "fc1"], default="fc2")
    p.add_argument("--kernel", choices=["triton", "ws"], default="ws")
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--halves", type=int, default=2)
    p.add_argument("--no-tma-store", action="store_true", help="store every tile from registers")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    os.environ["PRIME_MEGAMOE_DIRECT_LAUNCH"] = "0"  # the candidate list is cut to one below
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, device="cuda")
    num_experts, hidden, inter = w2.shape
    fmt = fl.fp8_format()
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=num_experts, tile_m=fp8_gemm.QTILE_M)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.gemm == "fc1":  # FC1 + SwiGLU (its own kernels; the Triton one with its first config, W1 by TMA)
        xq, w1q = fl.quantize_rows(x, fmt), fl.quantize_w1_fwd(w1, fmt)
        fp8_gemm.fp8_fc1_swiglu_kernel.configs = fp8_gemm.fp8_fc1_swiglu_kernel.configs[:1]
        fp8_gemm.fp8_fc1_swiglu_kernel.cache.clear()
        for _ in range(args.calls):
            fl.fp8_fc1_swiglu(
                xq, w1q, plan, fmt, inter=inter, h_dtype=x.dtype, use_tma=True, use_ws=args.kernel == "ws"
            )
        torch.cuda.synchronize()
        print(f"fc1 {args.kernel}: {args.calls} calls done")
        return
    if args.gemm == "fc2":
        a = fl.quantize_rows(torch.randn(plan.num_pairs, inter, device="cuda", generator=gen), fmt)
        b, segments, row_scale = fl.quantize_w2_fwd(w2, fmt), 1, plan.row_weight
    else:
        a = fl.quantize_rows(torch.randn(plan.num_pairs, 2 * inter, device="cuda", generator=gen), fmt, segments=2)
        b, segments, row_scale = fl.quantize_w1_bwd(w1, fmt), 2, None
    kernel = fp8_gemm.fp8_grouped_gemm_kernel
    kernel.configs = kernel.configs[:1]
    kernel.cache.clear()
    for _ in range(args.calls):
        if args.kernel == "triton":
            fl.fp8_grouped_gemm(a, b, plan, fmt, out_dtype=x.dtype, segments=segments, row_scale=row_scale)
        else:
            c = torch.empty(plan.num_pairs, b.data.shape[1], dtype=x.dtype, device="cuda")
            cfg = WSConfig(args.block_m, args.stages, args.halves, tma_store=not args.no_tma_store)
            fp8_grouped_gemm_ws(a, b, plan, c, segments=segments, row_scale=row_scale, config=cfg)
    torch.cuda.synchronize()
    print(f"{args.gemm} {args.kernel}: {args.calls} calls done")


if __name__ == "__main__":
    main()
