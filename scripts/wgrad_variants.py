"""Weight-gradient kernel variants side by side at a layer's shape (one GPU, bf16), each checked and timed.

    python scripts/wgrad_variants.py [--shape qwen3-30b-a3b] [--tokens 16384] [--segments 2] [--experts 64]

Cases dW1 = dh^T x[src] and dW2 = dy[src]^T aw, rows planned in ``--segments`` source blocks as expert parallelism
plans them (expert 0 gets no rows: its gradient must be zeros). Variants:

- ``package``: the package's ``grouped_wgrad_kernel``, per candidate config.
- ``one segment``: the same kernel on a one-segment plan of the same rows (what the per-segment loop costs).
- ``split``: a loop over each segment's whole BLOCK_K chunks with no row masks, then one masked tail chunk; the
  dense operand through pointers or (``tma``) a host tensor descriptor, so its chunks arrive by TMA.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels.grouped_gemm import grouped_wgrad_kernel
from prime_megamoe.kernels.tuning import tile_m
from prime_megamoe.ops.routing_plan import build_routing_plan


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


@triton.jit
def wgrad_split_kernel(
    d_desc, d_ptr, g_ptr, g_src_ptr, c_ptr, expert_offsets_ptr,
    M, N, num_segments, offsets_per_segment,
    stride_dm, stride_gm, stride_ce, stride_cm, stride_cn,
    DENSE_A: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[e] = A^T B over expert e's rows; one operand dense (D, sorted rows), the other gathered (G, rows src[r])."""
    expert = tl.program_id(1)
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if DENSE_A:
        d_cols, d_cols_mask, d_col0 = offs_m, offs_m < M, pid_m * BLOCK_M
        g_cols, g_cols_mask = offs_n, offs_n < N
    else:
        d_cols, d_cols_mask, d_col0 = offs_n, offs_n < N, pid_n * BLOCK_N
        g_cols, g_cols_mask = offs_m, offs_m < M
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for seg in range(0, num_segments):
        start = tl.load(expert_offsets_ptr + seg * offsets_per_segment + expert)
        end = tl.load(expert_offsets_ptr + seg * offsets_per_segment + expert + 1)
        full_end = start + ((end - start) // BLOCK_K) * BLOCK_K
        rg = tl.load(g_src_ptr + start + ks, mask=start + ks < end, other=0).to(tl.int64)
        for k0 in range(start, full_end, BLOCK_K):
            if USE_TMA:
                d = d_desc.load([k0, d_col0])
            else:
                d = tl.load(d_ptr + (k0 + ks).to(tl.int64)[:, None] * stride_dm + d_cols[None, :],
                            mask=d_cols_mask[None, :], other=0.0)
            g = tl.load(g_ptr + rg[:, None] * stride_gm + g_cols[None, :], mask=g_cols_mask[None, :], other=0.0)
            rg = tl.load(g_src_ptr + k0 + BLOCK_K + ks, mask=k0 + BLOCK_K + ks < end, other=0).to(tl.int64)
            if DENSE_A:
                acc = tl.dot(tl.trans(d), g, acc)
            else:
                acc = tl.dot(tl.trans(g), d, acc)
        if full_end < end:  # the last, partial chunk: rows past the expert's end masked in both operands
            r_mask = full_end + ks < end
            d = tl.load(d_ptr + (full_end + ks).to(tl.int64)[:, None] * stride_dm + d_cols[None, :],
                        mask=r_mask[:, None] & d_cols_mask[None, :], other=0.0)
            g = tl.load(g_ptr + rg[:, None] * stride_gm + g_cols[None, :], mask=r_mask[:, None] & g_cols_mask[None, :],
                        other=0.0)
            if DENSE_A:
                acc = tl.dot(tl.trans(d), g, acc)
            else:
                acc = tl.dot(tl.trans(g), d, acc)
    c_ptrs = c_ptr + expert.to(tl.int64) * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def reference(a_sorted, b_sorted, plan, num_experts):
    off = plan.expert_offsets.tolist()
    out = torch.zeros(num_experts, a_sorted.shape[1], b_sorted.shape[1], device=a_sorted.device)
    for s in range(plan.num_segments):
        for e in range(num_experts):
            lo, hi = off[s * (num_experts + 1) + e], off[s * (num_experts + 1) + e + 1]
            out[e] += a_sorted[lo:hi].float().T @ b_sorted[lo:hi].float()
    return out


PACKAGE_CONFIGS = None  # the package kernel's own candidate list
SPLIT_CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
                 (128, 128, 64, 8, 4), (256, 128, 64, 8, 3)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--segments", type=int, default=2)
    p.add_argument("--experts", type=int, default=0,
                   help="fold the routing onto this many local experts (64: an EP=2 rank's rows per expert)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-time", action="store_true", help="check only (interpreter)")
    args = p.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, dtype=dtype, device=dev)
    num_experts = w1.shape[0]
    if args.experts:
        index = index % args.experts
        num_experts = args.experts
    index[index == 0] = 1  # expert 0: no rows
    plans = {
        s: build_routing_plan(index, weights, expert_base=0, num_local_experts=num_experts, tile_m=tile_m(),
                              num_segments=s) for s in sorted({1, args.segments})}
    plan = plans[args.segments]
    torch.manual_seed(1)
    dh = torch.randn(plan.sorted_rows, w1.shape[1], device=dev, dtype=dtype)
    aw = torch.randn(plan.sorted_rows, w2.shape[2], device=dev, dtype=dtype)
    dy = torch.randn_like(x)
    src = plan.row_src.long()
    cases = {"dW1": (dh, x, True), "dW2": (dy, aw, False)}  # (a, b, dense operand is A)
    print(f"{'case':5s} {'variant':14s} {'config':22s} {'rel err':>9s} {'ms':>7s} {'TFLOP/s':>8s}")
    rows = []

    def report(name, variant, label, out, want, run, flops):
        err = ((out.float() - want).norm() / want.norm()).item()
        ok = bool((out[0] == 0).all()) and err < 1e-2
        ms = float("nan") if args.no_time else do_bench(run, warmup=25, rep=100)
        line = f"{name:5s} {variant:14s} {label:22s} {err:9.2e} {ms:7.3f} {flops / ms / 1e9:8.1f}{'' if ok else '  WRONG'}"
        print(line, flush=True)
        rows.append((name, variant, label, ms, ok))

    for name, (a, b, dense_a) in cases.items():
        a_sorted = a if dense_a else a[src]
        b_sorted = b[src] if dense_a else b
        want = reference(a_sorted, b_sorted, plan, num_experts)
        m, n = a.shape[1], b.shape[1]
        flops = 2 * plan.num_pairs * m * n
        for variant, vplan in (("package", plan), ("one segment", plans[1])):
            if variant == "one segment":
                # the same rows as one segment: the sorted order differs, so take the dense operand in that order
                a_v = a_sorted_of(a, b, dense_a, plan, vplan, "a")
                b_v = a_sorted_of(a, b, dense_a, plan, vplan, "b")
            else:
                a_v, b_v = a, b
            for cfg in grouped_wgrad_kernel.configs:
                kw = cfg.kwargs
                out = torch.full((num_experts, m, n), float("nan"), device=dev, dtype=dtype)
                grid = (triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(n, kw["BLOCK_N"]), num_experts)

                def run(kw=kw, cfg=cfg, out=out, grid=grid, vplan=vplan, a_v=a_v, b_v=b_v):
                    grouped_wgrad_kernel.fn[grid](
                        a_v, vplan.row_src, b_v, vplan.row_src, out, vplan.expert_offsets,
                        m, n, vplan.num_pairs, vplan.num_segments, num_experts + 1,
                        a_v.stride(0), b_v.stride(0), out.stride(0), out.stride(1), out.stride(2),
                        GATHER_A=not dense_a, GATHER_B=dense_a, CAST_F32=dev != "cuda", IEEE=False,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw,
                    )

                run()
                report(name, variant, f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}",
                       out, want, run, flops)
        dense, gathered = (a, b) if dense_a else (b, a)
        for use_tma in (False, True):
            for bm, bn, bk, warps, stages in SPLIT_CONFIGS if dev == "cuda" else [(16, 16, 16, 1, 1)]:
                out = torch.full((num_experts, m, n), float("nan"), device=dev, dtype=dtype)
                grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), num_experts)
                desc = None
                if use_tma:
                    from triton.tools.tensor_descriptor import TensorDescriptor
                    desc = TensorDescriptor.from_tensor(dense, [bk, bm if dense_a else bn])

                def run(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, out=out, grid=grid, desc=desc,
                        use_tma=use_tma):
                    wgrad_split_kernel[grid](
                        desc, dense, gathered, plan.row_src, out, plan.expert_offsets,
                        m, n, plan.num_segments, num_experts + 1,
                        dense.stride(0), gathered.stride(0), out.stride(0), out.stride(1), out.stride(2),
                        DENSE_A=dense_a, USE_TMA=use_tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                        num_warps=warps, num_stages=stages,
                    )

                try:
                    run()
                except Exception as e:  # a variant that does not compile is reported, the sweep goes on
                    print(f"{name:5s} {'split tma' if use_tma else 'split':14s} {bm}x{bn}x{bk} w{warps} s{stages}: "
                          f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                report(name, "split tma" if use_tma else "split", f"{bm}x{bn}x{bk} w{warps} s{stages}", out, want,
                       run, flops)
    print("\nbest per case and variant (ms):")
    for name in cases:
        for variant in ("package", "one segment", "split", "split tma"):
            got = [r for r in rows if r[0] == name and r[1] == variant and r[4]]
            if got:
                best = min(got, key=lambda r: r[3])
                print(f"  {name} {variant:12s} {best[3]:7.3f}  {best[2]}")


def a_sorted_of(a, b, dense_a, plan, vplan, which):
    """The dense operand re-ordered from ``plan``'s sorted rows to ``vplan``'s (the gathered one is read through the
    plan's source rows and needs nothing)."""
    dense_is_this = (which == "a") == dense_a
    t = a if which == "a" else b
    if not dense_is_this:
        return t
    # sorted row of each (source row, slot) pair in both plans: pair_pos maps pair -> sorted row
    out = torch.zeros(vplan.sorted_rows, t.shape[1], device=t.device, dtype=t.dtype)
    out[vplan.pair_pos.long().flatten()] = t[plan.pair_pos.long().flatten()]
    return out


if __name__ == "__main__":
    main()
