"""Usage: python scripts/dswiglu_probe.py [--shape qwen3-30b-a3b] [--tokens 16384] [--world 2]

The FC2 dgrad + SwiGLU backward at a layer's expert-parallel shape, timed on one GPU (bf16): the FC2 dgrad GEMM
(autotuned ``grouped_gemm_kernel``), then the SwiGLU backward row pass (``kernels.swiglu_grad``) with several block
shapes, each checked against the layer's own launch (dh, aw, dw) and timed. Rows are planned as rank 0 of
``--world`` ranks sees them (its local experts, one segment per source rank) and run piece by piece in the
pipeline's order.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels import tuning
from prime_megamoe.kernels.swiglu_grad import swiglu_backward_rows_kernel
from prime_megamoe.ops import launch
from prime_megamoe.ops.routing_plan import build_routing_plan


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (interpreter, micro shape)")
    args = p.parse_args()
    dev = args.device
    bench = do_bench if dev == "cuda" else (lambda fn, **_: (fn(), 1.0)[1])  # no timing on the CPU
    blocks = [make_inputs(args.shape, args.tokens, r, args.world, seed=0, device=dev) for r in range(args.world)]
    w2 = blocks[0][4]
    num_local, hidden, inter = w2.shape
    index = torch.cat([b[1] for b in blocks])
    weights = torch.cat([b[2] for b in blocks])
    plan = build_routing_plan(
        index,
        weights,
        expert_base=0,
        num_local_experts=num_local,
        tile_m=tuning.tile_m(),
        num_segments=args.world,
        split_expert=num_local // 2,
    )
    pieces = [plan.segment(0, 0), *[plan.segment(s) for s in range(1, args.world)], plan.segment(0, 1)]
    dy = torch.randn(args.world * args.tokens, hidden, device=dev, dtype=torch.bfloat16)
    h = torch.randn(plan.sorted_rows, 2 * inter, device=dev, dtype=torch.bfloat16)
    pos = plan.pair_pos.long()
    used = pos[pos >= 0]

    buffers = launch.dswiglu_buffers(dy, w2, plan)

    def split():
        for piece in pieces:
            launch.fc2_dgrad_dswiglu(dy, w2, h, piece, out=buffers)

    split()
    _, dh_ref, aw_ref, dw_ref = (t.clone() for t in buffers)
    rows_used = used.numel()
    print(f"rank 0 of {args.world}: {rows_used} rows on {num_local} experts, I = {inter}, H = {hidden}")
    print(f"{'variant':64s} {'ms':>7s} {'TFLOP/s':>8s} {'err dh':>8s}")
    ms = bench(split, warmup=5, rep=50)
    rows_flops = 2 * rows_used * hidden * inter
    print(f"{'split (autotuned GEMM + row pass 16x128, 4 warps)':64s} {ms:7.3f} {rows_flops / ms / 1e9:8.1f}")
    g_a = buffers[0]

    def gemm_only():
        for piece in pieces:
            launch.grouped_gemm(dy, w2, piece, transpose_b=False, gather=True, out=g_a)

    ms = bench(gemm_only, warmup=5, rep=50)
    print(f"{'  GEMM alone':64s} {ms:7.3f} {rows_flops / ms / 1e9:8.1f}")
    row_configs = (
        [(16, 128, 4), (8, 256, 4), (32, 128, 8), (16, 256, 8), (4, 256, 2)] if dev == "cuda" else [(8, 16, 1)]
    )
    for block_r, block_c, warps in row_configs:
        dh, aw, dw = (torch.full_like(t, float("nan")) for t in buffers[1:])

        def rows_pass():
            for piece in pieces:
                swiglu_backward_rows_kernel[(piece.max_tiles * (piece.tile_m // block_r),)](
                    g_a,
                    h,
                    piece.row_weight,
                    dh,
                    aw,
                    dw,
                    piece.tile_expert,
                    piece.tile_row,
                    piece.num_tiles,
                    piece.expert_offsets,
                    inter,
                    g_a.stride(0),
                    h.stride(0),
                    dh.stride(0),
                    aw.stride(0),
                    0.0,  # clamp_limit (unread without CLAMP)
                    TILE_M=piece.tile_m,
                    BLOCK_R=block_r,
                    BLOCK_C=block_c,
                    CLAMP=False,
                    num_warps=warps,
                )

        rows_pass()
        err = max(rel(dh[used], dh_ref[used]), rel(aw[used], aw_ref[used]), rel(dw[used], dw_ref[used]))
        ms = bench(rows_pass, warmup=5, rep=50)
        gbytes = rows_used * inter * 2 * 6 / 1e9  # read g_a, h (2I); write dh (2I), aw
        print(
            f"{f'  row pass BLOCK_R={block_r} BLOCK_C={block_c} warps={warps}':64s} {ms:7.3f} "
            f"{gbytes / ms * 1e3:5.0f} GB/s {err:8.1e}"
        )


if __name__ == "__main__":
    main()
