"""Usage: python scripts/fp8_probe.py [--shape qwen3-30b-a3b] [--tokens 16384] [--pow2] [--ws-only] [--gemms dW1 dW2]

Every autotuning candidate of the fp8 kernels, checked and timed at a layer's shape (one GPU, EP = 1). For each GEMM
of the fp8 layer (FC1 + SwiGLU, FC2, FC2 dgrad, FC1 dgrad, the two weight gradients) each candidate of its kernel
family runs alone (the autotuner is given that one config), with pointer loads and then with TMA reads ("tma"), is
checked bitwise against the first candidate with pointer loads (configs tile rows and columns differently but sum K
in the same order) and timed. Then the quantising SwiGLU backward pass (its time past the FC2 dgrad GEMM's) and the
quantisation passes. The table ends with the best time per kernel and their sums: the kernels of one forward and one
backward, without host time.
"""

from __future__ import annotations

import argparse
import os

import torch
from triton.testing import do_bench

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels import fp8_gemm
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.fp8_ws_launch import (
    WS_CONFIGS,
    WS_WGRAD_CONFIGS,
    fp8_fc1_swiglu_ws,
    fp8_grouped_gemm_ws,
    fp8_grouped_wgrad_ws,
    ws_fc1_unavailable,
    ws_gemm_unavailable,
)
from prime_megamoe.ops.routing_plan import build_routing_plan


def single_config(kernel, cfg):
    """Make the autotuned ``kernel`` run ``cfg`` only (the autotuner skips timing with one candidate)."""
    kernel.configs = [cfg]
    kernel.cache.clear()


def snapshot(out) -> list[torch.Tensor]:
    """Copies of a launcher's outputs (tensors, QTensors, tuples of them), fp8 viewed as bytes for comparison."""
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in snapshot(o)]
    if isinstance(out, fl.QTensor):
        return snapshot(out.data) + snapshot(out.scale)
    if out is None:
        return []
    return [(out.view(torch.uint8) if out.dtype == fl.FP8_DTYPE else out).clone()]


def describe(cfg) -> str:
    kw = cfg.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--pow2", action="store_true", help="power-of-two scales")
    p.add_argument(
        "--ws-only",
        action="store_true",
        help="only the GEMMs the warp-specialised kernels run (FC1 + SwiGLU, FC2, the dgrads, the weight "
        "gradients): their configs against the Triton kernels' first candidate (TMA reads)",
    )
    p.add_argument(
        "--gemms",
        nargs="+",
        metavar="NAME",
        help="only these GEMMs (FC2, 'FC2 dgrad', 'FC1 dgrad', dW1, dW2, 'FC1 + SwiGLU')",
    )
    p.add_argument(
        "--configs",
        type=int,
        nargs="+",
        metavar="I",
        help="only these WS_CONFIGS entries (by index) for the warp-specialised GEMMs",
    )
    p.add_argument(
        "--device",
        default="cuda",
        help="cpu: a smoke run of the script itself (interpreter; with --shape tiny --tokens 64)",
    )
    args = p.parse_args()
    # Candidates are swapped in the autotuner between launches: launch through Triton itself, not through the
    # compiled-kernel cache (which would keep the first candidate's kernel).
    os.environ["PRIME_MEGAMOE_DIRECT_LAUNCH"] = "0"
    bench = do_bench if args.device == "cuda" else (lambda fn, **_: (fn(), 1.0)[1])  # no timing on the CPU
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, device=args.device)
    num_experts, hidden, inter = w2.shape
    fmt = fl.fp8_format(args.pow2)
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=num_experts, tile_m=fp8_gemm.QTILE_M)
    pairs = plan.num_pairs
    dy = torch.randn_like(x)
    xq, dyq = fl.quantize_rows(x, fmt), fl.quantize_rows(dy, fmt)
    w1f, w1b = fl.quantize_w1_fwd(w1, fmt), fl.quantize_w1_bwd(w1, fmt)
    w2f, w2b = fl.quantize_w2_fwd(w2, fmt), fl.quantize_w2_bwd(w2, fmt)
    h, aq = fl.fp8_fc1_swiglu(xq, w1f, plan, fmt, inter=inter, h_dtype=x.dtype)
    d = fl.fp8_fc2_dgrad_dswiglu(dyq, w2b, h, plan, fmt)
    tiles = fl.expert_tile_offsets(plan)
    x_t, dy_t = fl.quantize_sorted_cols_t(x, plan, fmt), fl.quantize_sorted_cols_t(dy, plan, fmt)
    gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)

    flop = {
        "FC1 + SwiGLU": 2 * pairs * hidden * 2 * inter,
        "FC2": 2 * pairs * inter * hidden,
        "FC2 dgrad": 2 * pairs * hidden * inter,
        "FC1 dgrad": 2 * pairs * 2 * inter * hidden,
        "dW1": 2 * pairs * 2 * inter * hidden,
        "dW2": 2 * pairs * hidden * inter,
    }
    row_tiled = [
        (
            "FC1 + SwiGLU",
            fp8_gemm.fp8_fc1_swiglu_kernel,
            lambda tma: fl.fp8_fc1_swiglu(xq, w1f, plan, fmt, inter=inter, h_dtype=x.dtype, use_tma=tma),
        ),
        (
            "FC2",
            fp8_gemm.fp8_grouped_gemm_kernel,
            lambda tma: fl.fp8_grouped_gemm(
                aq, w2f, plan, fmt, out_dtype=x.dtype, row_scale=plan.row_weight, use_tma=tma
            ),
        ),
        (
            "FC2 dgrad",
            fp8_gemm.fp8_grouped_gemm_kernel,
            lambda tma: fl.fp8_grouped_gemm(dyq, w2b, plan, fmt, out_dtype=x.dtype, gather=True, use_tma=tma),
        ),
        (
            "FC1 dgrad",
            fp8_gemm.fp8_grouped_gemm_kernel,
            lambda tma: fl.fp8_grouped_gemm(d.dh_rows, w1b, plan, fmt, out_dtype=x.dtype, segments=2, use_tma=tma),
        ),
    ]
    row_tiled += [
        (
            "dW1",
            fp8_gemm.fp8_grouped_wgrad_kernel,
            lambda tma: fl.fp8_grouped_wgrad(d.dh_t, x_t, plan, fmt, gw1, expert_tiles=tiles, use_tma=tma),
        ),
        (
            "dW2",
            fp8_gemm.fp8_grouped_wgrad_kernel,
            lambda tma: fl.fp8_grouped_wgrad(dy_t, d.aw_t, plan, fmt, gw2, expert_tiles=tiles, use_tma=tma),
        ),
    ]
    # Each GEMM with pointer loads, then with TMA reads (checked against the pointer loads' first config).
    cases = [
        (f"{name}{' tma' if tma else ''}", name, kernel, (lambda run=run, tma=tma: run(tma)))
        for name, kernel, run in row_tiled
        for tma in (False, True)
    ]
    if args.ws_only:
        cases = [
            c for c in cases if c[1] in ("FC1 + SwiGLU", "FC2", "FC2 dgrad", "FC1 dgrad", "dW1", "dW2") and c[0] != c[1]
        ]
    if args.gemms:
        cases = [c for c in cases if c[1] in args.gemms]
    print(
        f"{args.shape}, T = {args.tokens}, {pairs} rows, {num_experts} experts, H = {hidden}, I = {inter}, "
        f"fmt {fmt.name}{' pow2' if fmt.pow2 else ''}"
    )
    print(f"{'GEMM':14s} {'config':22s} {'ms':>7s} {'TFLOP/s':>8s} same")
    best = {}
    refs = {}
    for label, name, kernel, run in cases:
        candidates = list(kernel.configs)
        for cfg in candidates[:1] if args.ws_only else candidates:
            single_config(kernel, cfg)
            try:
                out = run()
                ms = bench(run, warmup=5, rep=40)
            except Exception as exc:  # a config that does not compile at this shape: say so, go on
                print(f"{label:14s} {describe(cfg):22s} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            out = snapshot(out)
            ref = refs.setdefault(name, out)
            same = all(torch.equal(a, b) for a, b in zip(out, ref))
            print(f"{label:14s} {describe(cfg):22s} {ms:7.3f} {flop[name] / ms / 1e9:8.1f} {same}")
            if name not in best or ms < best[name][0]:
                best[name] = (ms, f"{describe(cfg)}{' tma' if label != name else ''}")
        kernel.configs = candidates
        kernel.cache.clear()

    # The warp-specialised Hopper kernels where they apply, against the Triton kernels' first candidate: the row-tiled
    # GEMM (the FC2 dgrad gathering dy's rows) and the weight gradient.
    def ws_run(a, b, segments=1, row_scale=None, gather=False):
        def run(cfg):
            c = torch.empty(pairs, b.data.shape[1], dtype=x.dtype, device=x.device)
            fp8_grouped_gemm_ws(a, b, plan, c, segments=segments, row_scale=row_scale, gather=gather, config=cfg)
            return c

        return run

    def ws_wgrad_run(a_t, b_t, out):
        def run(cfg):
            fp8_grouped_wgrad_ws(a_t, b_t, out, expert_tiles=tiles, config=cfg)
            return out

        return run

    ws_cases = [
        ("FC2", ws_run(aq, w2f, row_scale=plan.row_weight)),
        ("FC2 dgrad", ws_run(dyq, w2b, gather=True)),
        ("FC1 dgrad", ws_run(d.dh_rows, w1b, segments=2)),
        ("dW1", ws_wgrad_run(d.dh_t, x_t, gw1)),
        ("dW2", ws_wgrad_run(dy_t, d.aw_t, gw2)),
    ]
    ws_cases = [case for case in ws_cases if case[0] in refs]  # the GEMMs run above (--gemms)
    why_not = ws_gemm_unavailable(dyq.data, w2b.data, mx=False, gather=False, segments=1, k=hidden)
    fc1_why_not = ws_fc1_unavailable(
        xq.data, w1f.data, mx=False, group=fmt.group, weight_rows=fmt.weight_rows, inter=inter
    )
    for stages in (4, 3) if "FC1 + SwiGLU" in refs and fc1_why_not is None else ():  # h, a against the Triton's

        def fc1_ws():
            h = torch.empty(pairs, 2 * inter, dtype=x.dtype, device=x.device)
            a = fl.QTensor(
                torch.empty(pairs, inter, dtype=fl.FP8_DTYPE, device=x.device),
                torch.empty(pairs, inter // 128, device=x.device),
            )
            fp8_fc1_swiglu_ws(xq, w1f, plan, h, a.data, a.scale, inter=inter, pow2=fmt.pow2, stages=stages)
            return h, a

        out = snapshot(fc1_ws())
        ms = bench(fc1_ws, warmup=5, rep=40)
        name = "FC1 + SwiGLU"
        same = [torch.equal(a, b) for a, b in zip(out, refs[name])]
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, refs[name]))
        desc = f"128x(128+128)x128 w4+4+4 s{stages}"
        print(
            f"{'FC1+SwiGLU ws':14s} {desc:32s} {ms:7.3f} {flop[name] / ms / 1e9:8.1f} "
            f"{all(same)} (h, a, scales: {same}; max diff {diff:.3g})"
        )
        if ms < best[name][0]:
            best[name] = (ms, f"ws {desc}")
    for (name, run), cfg in (
        (case, cfg)
        for case in ws_cases
        for cfg in (WS_WGRAD_CONFIGS if case[0].startswith("dW") else WS_CONFIGS)
        if args.configs is None or WS_CONFIGS.index(cfg) in args.configs
    ):
        label = f"{name} ws"
        if why_not is not None:
            print(f"{label:14s} skipped: {why_not}")
            break
        out = snapshot(run(cfg))
        ms = bench(lambda: run(cfg), warmup=5, rep=40)
        ref = refs[name]
        same = all(torch.equal(a, b) for a, b in zip(out, ref))
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, ref))
        desc = (
            f"{cfg.block_m}x{cfg.block_n}x128 w{cfg.num_warps}{'+4' if cfg.halves == 2 else ''}+1 s{cfg.stages}"
            f"{' tmast' if cfg.tma_store else ''}{' sfirst' if cfg.scales_first else ''}"
        )
        print(f"{label:14s} {desc:32s} {ms:7.3f} {flop[name] / ms / 1e9:8.1f} {same} (max diff {diff:.3g})")
        if ms < best[name][0]:
            best[name] = (ms, f"ws {desc}")

    if args.ws_only or args.gemms:
        for name, (ms, cfg) in best.items():
            print(f"  {name:16s} {ms:7.3f}  {cfg}")
        return

    # The quantising SwiGLU backward pass alone (g_a from the FC2 dgrad above), a few warp counts.
    g_a = fl.fp8_grouped_gemm(dyq, w2b, plan, fmt, out_dtype=x.dtype, gather=True)
    ref = fl.fp8_fc2_dgrad_dswiglu(dyq, w2b, h, plan, fmt)
    moved = g_a.numel() * 2 + h.numel() * 2 + ref.dh_rows.data.numel() + ref.dh_t.data.numel() + ref.aw_t.data.numel()
    written = int(plan.num_tiles[0]) * fp8_gemm.QTILE_M  # tile-space columns past the tile count are never written
    out = fl.fp8_fc2_dgrad_dswiglu(dyq, w2b, h, plan, fmt)
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            snapshot([out.dh_rows, out.dh_t.data[:, :written], out.aw_t.data[:, :written], out.dw_row]),
            snapshot([ref.dh_rows, ref.dh_t.data[:, :written], ref.aw_t.data[:, :written], ref.dw_row]),
        )
    )
    both = bench(lambda: fl.fp8_fc2_dgrad_dswiglu(dyq, w2b, h, plan, fmt), warmup=5, rep=40)
    gemm = bench(lambda: fl.fp8_grouped_gemm(dyq, w2b, plan, fmt, out_dtype=x.dtype, gather=True), warmup=5, rep=40)
    print(
        f"{'SwiGLU bwd':14s} {'pass (GEMM + pass - GEMM)':26s} {both - gemm:7.3f} "
        f"{moved / max(both - gemm, 1e-9) / 1e6:6.0f} GB/s {same} (repeatable)"
    )
    best["SwiGLU bwd pass"] = (both - gemm, "")

    quant = {
        "quantise x": lambda: fl.quantize_rows(x, fmt),
        "x^T cols_t": lambda: fl.quantize_sorted_cols_t(x, plan, fmt),
    }
    for name, fn in quant.items():
        ms = bench(fn, warmup=5, rep=40)
        print(f"{name:14s} {'':22s} {ms:7.3f}")
        best[name] = (ms, "")
    fwd = ("quantise x", "FC1 + SwiGLU", "FC2")
    bwd = ("quantise x", "FC2 dgrad", "SwiGLU bwd pass", "FC1 dgrad", "x^T cols_t", "dW1", "x^T cols_t", "dW2")
    print("\nbest per kernel (ms):")
    for name, (ms, cfg) in best.items():
        print(f"  {name:16s} {ms:7.3f}  {cfg}")
    print(
        f"forward kernels {sum(best[n][0] for n in fwd):.3f} ms, backward kernels {sum(best[n][0] for n in bwd):.3f}"
        f" ms (quantise dy and dy^T timed as x; combines not included)"
    )


if __name__ == "__main__":
    main()
