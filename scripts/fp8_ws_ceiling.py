"""Where the warp-specialised fp8 GEMM's time goes: the layer's kernel against variants of it without parts of its
work, on the layer's FC2 and FC1 dgrad (one Hopper GPU, EP = 1):

    python scripts/fp8_ws_ceiling.py [--shape qwen3-30b-a3b --tokens 16384]

Variants (same producer, same tiles, same two 4-warp MMA partitions on the halves of each 128-row tile):
- ``ws``: the layer's kernel (``kernels/fp8_gemm_ws.py``, default config);
- ``promote, no store``: its main loop (each step's MMA into a fresh tile, waited for, scaled by the scales the
  producer staged, added), no stores;
- ``plain``: no promotion: every step accumulates into one tile, the next step's MMA is issued before the previous
  one is waited for (the bf16 main loop: the tensor cores never wait for the scaling), stores from registers;
- ``plain, no store``: that main loop alone;
- ``rescale``: one accumulator, each step waited for and multiplied by a per-row factor before the next step's
  wgmma accumulates on it (the instruction mix of a promotion that rescales the running sum instead of adding a fresh
  tile; its values are not the GEMM's);
- ``n256 ...``: 256-column tiles with one 64 x 256 accumulator a partition (one N = 256 wgmma a step): plain and
  rescaled (the layer's 256-column tiles are two N = 128 parts, because a fresh 64 x 256 tile beside its
  accumulator spills).
``--gemm G --variant V`` runs one variant a few times untimed, for a profiler; ``--accuracy`` prints the error of the
whole K summed in the tensor cores (plain) against the layer's promotion every 128 products, against float64.
Only ``ws`` computes the layer's result; the others measure what the tile shape, the pipeline and the stores cost
on this GPU (a ceiling for this kernel's structure). Prints a table last.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.testing import do_bench

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.kernels.fp8_gemm_ws import _load_partition, _mma_step, _stage_barriers, _tile_with_end
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.fp8_ws_launch import (WS_CONFIGS, WS_GEMM_DEFAULT, WS_LOAD_REGS, WS_MMA_REGS, box_layout,
                                             fp8_grouped_gemm_ws, weight_descriptor)
from prime_megamoe.ops.launch import _num_sms
from prime_megamoe.ops.routing_plan import build_routing_plan
from prime_megamoe.ops.sizes import cdiv


@gluon.jit
def _variant_partition(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, tile_expert_ptr, tile_row_ptr,
                       num_tiles_ptr, expert_offsets_ptr, N, K, stride_cm, store, SEGS: gl.constexpr,
                       TILE_M: gl.constexpr, HALF: gl.constexpr, MODE: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [num_warps, 1], [1, 0])
    n_col_tiles = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    n_steps = SEGS * k_steps
    total = gl.load(num_tiles_ptr) * (TILE_M // (2 * BLOCK_M)) * n_col_tiles
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        row0, col0, row_end = _tile_with_end(t, n_col_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                                             2 * BLOCK_M, BLOCK_N, TILE_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        if MODE == 1:  # as the layer's kernel
            for j in range(n_steps):
                acc = _mma_step(acc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, it, mma_layout, HALF, 2, False,
                                False)
                it += 1
        elif MODE == 2:  # one accumulator, each step waited for and rescaled by row before the next accumulates
            row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
            for j in range(n_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(2 * s + HALF), b_bufs.index(s).permute((1, 0)), acc,
                                    is_async=True)
                sa = sa_bufs.index(s).slice(HALF * BLOCK_M, BLOCK_M).load(row_layout)
                sb = sb_bufs.index(s).slice(HALF * BLOCK_M, BLOCK_M).load(row_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty.index(s), count=1)
                acc = acc * (sa * sb)[:, None]
                it += 1
        else:  # one accumulator, the previous step's MMA waited for after the next one is issued
            prev = 0
            for j in range(n_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(2 * s + HALF), b_bufs.index(s).permute((1, 0)), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if j > 0:
                    mbarrier.arrive(empty.index(prev), count=1)
                prev = s
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(prev), count=1)
        if store != 0:
            out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), store_layout)
            rows_s = row0 + HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
            cols_s = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
            c_ptrs = c_ptr + rows_s.to(gl.int64)[:, None] * stride_cm + cols_s[None, :]
            gl.store(c_ptrs, out, mask=(rows_s < row_end)[:, None] & (cols_s < N)[None, :])


@gluon.jit
def ws_variant_kernel(a_desc, b_desc, as_ptr, bs_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr,
                      expert_offsets_ptr, M, N, K, NKG, stride_asm, stride_bse, stride_bsn, stride_cm, store,
                      SEGS: gl.constexpr, STAGES: gl.constexpr, TILE_M: gl.constexpr, MODE: gl.constexpr,
                      SUBS: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 2 * a_desc.block_type.shape[0]],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, SUBS * 2 * a_desc.block_type.shape[0]],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready, empty = _stage_barriers(STAGES, 2)
    gl.warp_specialize([
        (_variant_partition, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, tile_expert_ptr, tile_row_ptr,
                              num_tiles_ptr, expert_offsets_ptr, N, K, stride_cm, store, SEGS, TILE_M, 0, MODE)),
        (_variant_partition, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, tile_expert_ptr, tile_row_ptr,
                              num_tiles_ptr, expert_offsets_ptr, N, K, stride_cm, store, SEGS, TILE_M, 1, MODE)),
        # (A is read by TMA: the gather arguments, here as_ptr twice and stride 0, are not read.)
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, as_ptr, as_ptr, as_ptr,
                           bs_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, M, N, K, NKG, 0, stride_asm,
                           stride_bse, stride_bsn, SEGS, 128, TILE_M, 2, False, SUBS)),
    ], [4, 1], [MMA_REGS, LOAD_REGS])


MODES = {"plain": 0, "promote": 1, "rescale": 2}


def run_variant(aq, bq, plan, c, *, segments: int, mode: str, store: bool, block_n: int = 128) -> None:
    """mode: "promote" (the layer's main loop; 128 columns only: a fresh 64 x 256 tile beside its accumulator
    spills), "plain" or "rescale" (one accumulator of 64 x block_n a partition, one wgmma of N = block_n a step)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    cfg = WS_CONFIGS[0]  # (the 128-column, two-halves config the variants are built on)
    assert cfg.halves == 2 and cfg.block_m == 128 and cfg.subs == 1
    assert block_n in (128, 256) and not (mode == "promote" and block_n == 256)
    rows, n, k = aq.data.shape[0], bq.data.shape[1], bq.data.shape[2] // segments
    a_desc = TensorDescriptor.from_tensor(aq.data, [cfg.a_rows, 128], box_layout(cfg.a_rows))
    b_desc = weight_descriptor(bq, block_n)  # block_n-row boxes
    stages = cfg.stages if block_n == 128 else WS_GEMM_DEFAULT.stages  # (the layer's 256-column ring)
    tiles = plan.max_tiles * cdiv(n, block_n)
    grid = (min(_num_sms(c.device), tiles),)
    ws_variant_kernel[grid](
        a_desc, b_desc, aq.scale, bq.scale, c, plan.tile_expert, plan.tile_row, plan.num_tiles,
        plan.expert_offsets, rows, n, k, aq.scale.shape[1] // segments, aq.scale.stride(0), bq.scale.stride(0),
        bq.scale.stride(1), c.stride(0), int(store), SEGS=segments, STAGES=stages, TILE_M=QTILE_M,
        MODE=MODES[mode], SUBS=block_n // 128, LOAD_REGS=WS_LOAD_REGS, MMA_REGS=WS_MMA_REGS, num_warps=cfg.num_warps,
        maxnreg=cfg.maxnreg)


def accuracy(name, a, b, plan, fmt, segments: int, experts: int = 4) -> None:
    """Relative errors (max over the elements / max of the reference, and Frobenius) on the rows of the first
    ``experts`` experts, fp32 outputs: plain (the fp8 products of the whole K summed in the tensor cores, unscaled,
    against the float64 sum of the same products) for 128 and 256 columns, and the layer's promotion (each 128-deep
    step's product scaled and added in fp32) against float64 on the dequantised operands."""
    r0, r1 = (int(v) for v in plan.expert_offsets[[0, experts]])
    n = b.data.shape[1]
    # Only the rows and experts compared are dequantised.
    a_q = a.data[r0:r1].float().double()
    a_deq = fl.dequantize_rows(fl.QTensor(a.data[r0:r1], a.scale[r0:r1]), fmt, segments=segments).double()
    b_deq = fl.dequantize_weight(fl.QTensor(b.data[:experts], b.scale[:experts]), fmt, k_halves=segments).double()
    cases = []
    for label, mode, block_n in (("plain", "plain", 128), ("n256 plain", "plain", 256), ("promote", "promote", 128)):
        c = torch.full((plan.num_pairs, n), float("nan"), device=a.data.device)
        run_variant(a, b, plan, c, segments=segments, mode=mode, store=True, block_n=block_n)
        ref = torch.empty(r1 - r0, n, dtype=torch.float64, device=c.device)
        for e in range(experts):
            e0, e1 = (int(v) - r0 for v in plan.expert_offsets[[e, e + 1]])
            ops = (a_q, b.data[e].float().double()) if mode == "plain" else (a_deq, b_deq[e])
            ref[e0:e1] = ops[0][e0:e1] @ ops[1].T
        diff = c[r0:r1].double() - ref
        cases.append(f"{label} {float(diff.abs().max() / ref.abs().max()):.2e} / "
                     f"{float(diff.norm() / ref.norm()):.2e}")
    print(f"{name} ({r1 - r0} rows, K = {b.data.shape[2]}): relative error max / Frobenius: " + ", ".join(cases))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--gemm", choices=["FC2", "FC1 dgrad"], default=None, help="only this GEMM")
    p.add_argument("--variant", default=None,
                   help="only this variant, run --calls times untimed (for a profiler), e.g. 'n256 plain, no store'")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--accuracy", action="store_true",
                   help="instead of timing: the error of the whole K summed in the tensor cores (plain) against the "
                        "layer's promotion every 128, both against float64")
    args = p.parse_args()
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, device="cuda")
    num_experts, hidden, inter = w2.shape
    fmt = fl.fp8_format()
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=num_experts, tile_m=QTILE_M)
    gen = torch.Generator(device="cuda").manual_seed(0)
    gemms = {
        "FC2": (fl.quantize_rows(torch.randn(plan.num_pairs, inter, device="cuda", generator=gen), fmt),
                fl.quantize_w2_fwd(w2, fmt), 1),
        "FC1 dgrad": (fl.quantize_rows(torch.randn(plan.num_pairs, 2 * inter, device="cuda", generator=gen), fmt,
                                       segments=2), fl.quantize_w1_bwd(w1, fmt), 2),
    }
    rows = []
    for name, (a, b, segments) in gemms.items():
        if args.gemm not in (None, name):
            continue
        if args.accuracy:
            accuracy(name, a, b, plan, fmt, segments)
            continue
        flop = 2 * plan.num_pairs * b.data.shape[1] * b.data.shape[2]
        c = torch.empty(plan.num_pairs, b.data.shape[1], dtype=x.dtype, device="cuda")
        runs = {
            "ws (layer)": lambda: fp8_grouped_gemm_ws(a, b, plan, c, segments=segments, row_scale=None),
            "promote, no store": lambda: run_variant(a, b, plan, c, segments=segments, mode="promote", store=False),
            "plain": lambda: run_variant(a, b, plan, c, segments=segments, mode="plain", store=True),
            "plain, no store": lambda: run_variant(a, b, plan, c, segments=segments, mode="plain", store=False),
            "rescale, no store": lambda: run_variant(a, b, plan, c, segments=segments, mode="rescale", store=False),
            "n256 plain, no store": lambda: run_variant(a, b, plan, c, segments=segments, mode="plain", store=False,
                                                        block_n=256),
            "n256 rescale, no st": lambda: run_variant(a, b, plan, c, segments=segments, mode="rescale",
                                                       store=False, block_n=256),
            "n256 rescale": lambda: run_variant(a, b, plan, c, segments=segments, mode="rescale", store=True,
                                                block_n=256),
        }
        if args.variant is not None:
            for _ in range(args.calls):
                runs[args.variant]()
            torch.cuda.synchronize()
            print(f"{name}: {args.variant} ran {args.calls} times")
            continue
        ref = torch.empty_like(c)
        fp8_grouped_gemm_ws(a, b, plan, ref, segments=segments, row_scale=None)
        run_variant(a, b, plan, c, segments=segments, mode="promote", store=True)
        # The variant with promotion and stores is the layer's kernel without the row scale: the same bits.
        print(f"{name}: promote + store variant equals the layer's kernel: {torch.equal(c, ref)}")
        for label, fn in runs.items():
            ms = do_bench(fn, warmup=5, rep=40)
            rows.append((name, label, ms, flop / ms / 1e9))
    if args.variant is not None or args.accuracy:
        return
    print(f"\n{args.shape}, T = {args.tokens}, {plan.num_pairs} rows, one {torch.cuda.get_device_name()}")
    print(f"{'GEMM':10s} {'variant':21s} {'ms':>7s} {'TFLOP/s':>8s}")
    for name, label, ms, tflops in rows:
        print(f"{name:10s} {label:21s} {ms:7.3f} {tflops:8.1f}")


if __name__ == "__main__":
    main()
