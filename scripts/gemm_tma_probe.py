"""The grouped GEMM's candidates with pointer loads and with TMA reads, side by side at a layer's shape (one GPU, bf16).

    python scripts/gemm_tma_probe.py [--shape qwen3-30b-a3b] [--tokens 16384] [--experts 64]

Cases: FC2 (A = SwiGLU output in sorted rows, B = W2^T, top-k weight per row), the FC2 dgrad GEMM (A = dy gathered,
B = W2) and the FC1 dgrad (A = dh in sorted rows, B = W1). ``--experts 64`` folds the routing onto 64 experts (an
EP=2 rank's rows per expert). Each candidate: its time and TFLOP/s per read path, and whether the two paths agree
bitwise.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.testing import do_bench

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels.grouped_gemm import grouped_gemm_kernel
from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops.launch import tma_descriptor, _num_sms, tma_readable
from prime_megamoe.ops.routing_plan import build_routing_plan


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--experts", type=int, default=64)
    args = p.parse_args()
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, dtype=torch.bfloat16, device="cuda")
    num_experts = args.experts or w1.shape[0]
    index = index % num_experts
    w1, w2 = w1[:num_experts].contiguous(), w2[:num_experts].contiguous()
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=num_experts, tile_m=tile_m())
    inter = w2.shape[2]
    act = torch.randn(plan.sorted_rows, inter, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(plan.sorted_rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    cases = {  # name: (a, b, transpose_b, gather, scale rows)
        "FC2": (act, w2, True, False, True),
        "FC2 dgrad": (dy, w2, False, True, False),
        "FC1 dgrad": (dh, w1, False, False, False),
    }
    num_sms = _num_sms(x.device)
    print(f"{'case':10s} {'config':52s} {'ptr ms':>7s} {'tma ms':>7s} {'ptr TF':>7s} {'tma TF':>7s} same")
    best = {}
    for name, (a, b, transpose_b, gather, scale) in cases.items():
        n, k = (b.shape[1], b.shape[2]) if transpose_b else (b.shape[2], b.shape[1])
        stride_bk, stride_bn = (b.stride(2), b.stride(1)) if transpose_b else (b.stride(1), b.stride(2))
        flops = 2 * plan.num_pairs * n * k
        b_2d = b.view(-1, b.shape[2])
        assert tma_readable(b_2d) and (gather or tma_readable(a))
        for cfg in grouped_gemm_kernel.configs:
            kw = cfg.kwargs
            times, outs = {}, {}
            for tma in (False, True):
                a_desc = b_desc = None
                if tma:
                    b_desc = tma_descriptor(b_2d)
                    bn, bk = kw["BLOCK_N"], kw["BLOCK_K"]
                    b_desc.block_shape = [bn, bk] if transpose_b else [bk, bn]
                    if not gather:
                        a_desc = tma_descriptor(a)
                        a_desc.block_shape = [kw["BLOCK_M"], kw["BLOCK_K"]]
                out = torch.zeros(plan.sorted_rows, n, device="cuda", dtype=torch.bfloat16)
                grid = ((num_sms, 1) if kw["PERSISTENT"] else
                        (triton.cdiv(n, kw["BLOCK_N"]), plan.max_tiles * (plan.tile_m // kw["BLOCK_M"])))

                def run(a_desc=a_desc, b_desc=b_desc, out=out, grid=grid, tma=tma):
                    grouped_gemm_kernel.fn[grid](
                        a_desc, b_desc, a, plan.row_src, b, out, plan.row_weight,
                        plan.tile_expert, plan.tile_row, plan.num_tiles, plan.expert_offsets,
                        n, k, plan.num_pairs, num_sms, 0,
                        a.stride(0), b.stride(0), stride_bk, stride_bn, out.stride(0),
                        GATHER_A=gather, SCALE_ROWS=scale, CAST_F32=False, IEEE=False, A_TMA=a_desc is not None,
                        B_TMA=tma, B_KMAJOR=transpose_b, TILE_M=plan.tile_m,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw,
                    )

                run()
                outs[tma] = out[: plan.num_pairs]
                times[tma] = do_bench(run, warmup=25, rep=100)
            same = bool(torch.equal(outs[False], outs[True]))
            label = f"{kw} w{cfg.num_warps} s{cfg.num_stages}"
            print(f"{name:10s} {label:52s} {times[False]:7.3f} {times[True]:7.3f} {flops / times[False] / 1e9:7.1f} "
                  f"{flops / times[True] / 1e9:7.1f} {same}", flush=True)
            for tma in (False, True):
                if times[tma] < best.get((name, tma), (float("inf"),))[0]:
                    best[(name, tma)] = (times[tma], label)
    print("\nbest per case (ms): pointers / TMA")
    for name in cases:
        print(f"  {name:10s} {best[(name, False)][0]:7.3f} / {best[(name, True)][0]:7.3f}   {best[(name, True)][1]}")


if __name__ == "__main__":
    main()
