"""Usage: python scripts/wgrad_probe.py [--shape qwen3-30b-a3b] [--tokens 16384] [--segments 2] [--experts 64]
    [--extra 128,128,64,8,2 ...] [--ws] [--triton all|none]

Every autotuning candidate of the weight-gradient kernel, checked and timed at a layer's shape (one GPU, bf16).
For dW1 = dh^T x[src] (x gathered) and dW2 = dy[src]^T aw, with ragged routing (expert 0 gets no rows, so its
gradient must be zeros): the error of each candidate against a float32 per-expert reference, its time and TFLOP/s.
``--segments 2`` plans the rows as two source blocks, as expert parallelism over two ranks does; ``--experts 64``
folds the routing onto 64 experts (an EP=2 rank's rows per expert). Every candidate runs with the sorted operand read
through pointers and, where the GPU has TMA, through a tensor descriptor.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels.grouped_gemm import grouped_wgrad_kernel
from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops.bf16_ws_launch import BF16_WGRAD_WS_CONFIGS, bf16_grouped_wgrad_ws
from prime_megamoe.ops.launch import tma_readable
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
    p.add_argument("--experts", type=int, default=0, help="fold the routing onto this many experts")
    p.add_argument("--ws", action="store_true", help="also the warp-specialised kernel's configs (Hopper)")
    p.add_argument("--triton", default="all", choices=["all", "none"], help="time the Triton candidates or not")
    p.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="more candidates to time beside the autotuner's, each BLOCK_M,BLOCK_N,BLOCK_K,warps,stages",
    )
    args = p.parse_args()
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, dtype=torch.bfloat16, device="cuda")
    num_experts = w1.shape[0]
    if args.experts:
        index, num_experts = index % args.experts, args.experts
    index[index == 0] = 1  # expert 0: no rows
    plan = build_routing_plan(
        index, weights, expert_base=0, num_local_experts=num_experts, tile_m=tile_m(), num_segments=args.segments
    )
    src = plan.row_src.long()
    dh = torch.randn(plan.sorted_rows, w1.shape[1], device="cuda", dtype=torch.bfloat16)
    aw = torch.randn(plan.sorted_rows, w2.shape[2], device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    cases = {  # name: (a, b, gather_a, gather_b, reference)
        "dW1": (dh, x, False, True, reference(dh, x[src], plan, num_experts)),
        "dW2": (dy, aw, True, False, reference(dy[src], aw, plan, num_experts)),
    }
    candidates = list(grouped_wgrad_kernel.configs) if args.triton == "all" else []
    for spec in args.extra:
        bm, bn, bk, warps, stages = (int(v) for v in spec.split(","))
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}
        candidates.append(triton.Config(meta, num_warps=warps, num_stages=stages))
    print(f"{'case':5s} {'config':64s} {'rel err':>9s} {'ms':>7s} {'TFLOP/s':>8s} {'smem KB':>7s} {'regs':>4s}")
    best = {}
    for name, (a, b, gather_a, _gather_b, want) in cases.items():
        m, n = a.shape[1], b.shape[1]
        flops = 2 * plan.num_pairs * m * n
        dense, gathered = (b, a) if gather_a else (a, b)
        for use_tma in (False, True) if tma_readable(dense) else (False,):
            for cfg in candidates:
                kw = cfg.kwargs
                out = torch.full((num_experts, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                grid = (triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(n, kw["BLOCK_N"]), num_experts)
                desc = None
                if use_tma:
                    desc = TensorDescriptor(
                        dense,
                        list(dense.shape),
                        list(dense.stride()),
                        [kw["BLOCK_K"], kw["BLOCK_M"] if not gather_a else kw["BLOCK_N"]],
                    )

                def run(kw=kw, cfg=cfg, out=out, grid=grid, desc=desc, use_tma=use_tma):
                    return grouped_wgrad_kernel.fn[grid](
                        desc,
                        dense,
                        gathered,
                        plan.row_src,
                        out,
                        plan.expert_offsets,
                        m,
                        n,
                        plan.num_pairs,
                        plan.num_segments,
                        num_experts + 1,
                        dense.stride(0),
                        gathered.stride(0),
                        out.stride(0),
                        out.stride(1),
                        out.stride(2),
                        DENSE_A=not gather_a,
                        USE_TMA=use_tma,
                        CAST_F32=False,
                        IEEE=False,
                        num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages,
                        **kw,
                    )

                compiled = run()
                err = ((out.float() - want).norm() / want.norm()).item()
                zeros = bool((out[0] == 0).all())
                ms = do_bench(run, warmup=25, rep=100)
                label = f"{'tma' if use_tma else 'ptr'} {kw} w{cfg.num_warps} s{cfg.num_stages}"
                flag = "" if zeros and err < 1e-2 else "  WRONG"
                smem, regs = compiled.metadata.shared / 1024, compiled.n_regs
                print(
                    f"{name:5s} {label:64s} {err:9.2e} {ms:7.3f} {flops / ms / 1e9:8.1f} {smem:7.1f} {regs:4d}{flag}",
                    flush=True,
                )
                if not flag and ms < best.get(name, (float("inf"),))[0]:
                    best[name] = (ms, label)
        if args.ws:
            for cfg in BF16_WGRAD_WS_CONFIGS:
                out = torch.full((num_experts, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)

                def run_ws(out=out, cfg=cfg, a=a, b=b, gather_a=gather_a):
                    bf16_grouped_wgrad_ws(a, b, plan, out, gather_a=gather_a, config=cfg)

                run_ws()
                err = ((out.float() - want).norm() / want.norm()).item()
                zeros = bool((out[0] == 0).all())
                ms = do_bench(run_ws, warmup=25, rep=100)
                label = f"ws {cfg}"
                flag = "" if zeros and err < 1e-2 else "  WRONG"
                print(f"{name:5s} {label:64s} {err:9.2e} {ms:7.3f} {flops / ms / 1e9:8.1f}{flag}", flush=True)
                if not flag and ms < best.get(name, (float("inf"),))[0]:
                    best[name] = (ms, label)
    print("\nbest:")
    for name, (ms, label) in best.items():
        print(f"  {name} {ms:7.3f} ms  {label}")


if __name__ == "__main__":
    main()
