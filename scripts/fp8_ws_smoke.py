"""Usage: python scripts/fp8_ws_smoke.py wgrad|fc1 [--watchdog 60] [--tokens 300] [--programs 1 3] [...]

    python scripts/fp8_ws_smoke.py wgrad [--watchdog 60] [--tokens 300] [--no-empty-expert] [--programs 1 3]
        [--configs 0 4] [--shapes 256x384]
    python scripts/fp8_ws_smoke.py fc1 [--watchdog 60] [--tokens 300] [--programs 1 3] [--stages 4 3]
        [--shapes 256x256]

The warp-specialised fp8 kernels launched once per case on small problems, each launch waited for under a watchdog,
so that a launch that never finishes shows which case it was (and where Python waited) instead of stopping a test
run at its time limit.

wgrad: ``fp8_grouped_wgrad_ws`` per WS_WGRAD_CONFIGS entry, shapes MxN of the gradient, against the Triton weight
gradient (same bits in fp32). fc1: ``fp8_fc1_swiglu_ws`` with and without h, plain and power-of-two scales, shapes
HxI, against the Triton FC1 + SwiGLU kernel (h and the quantised a compared, exact matches reported). Exits
non-zero on the first mismatch; the watchdog exits the process (code 3) after dumping every thread's stack.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.fp8_ws_launch import WS_WGRAD_CONFIGS, fp8_fc1_swiglu_ws, fp8_grouped_wgrad_ws
from prime_megamoe.ops.routing_plan import build_routing_plan
from tests.oracle import ragged_routing

EXPERTS = 4


def watched(what: str, seconds: float, launch):
    """Run ``launch`` and wait for the GPU under the watchdog; returns its result."""
    print(f"launch {what}", flush=True)
    faulthandler.dump_traceback_later(seconds, exit=True)
    start = time.perf_counter()
    out = launch()
    torch.cuda.synchronize()
    faulthandler.cancel_dump_traceback_later()
    print(f"  done in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def fail(what: str):
    print(f"FAIL {what}")
    sys.exit(1)


def smoke_wgrad(args, plan, fmt, tokens, gen):
    tiles = fl.expert_tile_offsets(plan)
    print(f"expert tiles {tiles.tolist()}", flush=True)
    for m, n in args.shapes:
        a_t = fl.quantize_sorted_cols_t(torch.randn(tokens, m, generator=gen).cuda(), plan, fmt)
        b_t = fl.quantize_sorted_cols_t(torch.randn(tokens, n, generator=gen).cuda(), plan, fmt)
        ref = torch.empty(EXPERTS, m, n, device="cuda")
        fl.fp8_grouped_wgrad(a_t, b_t, plan, fmt, ref, expert_tiles=tiles, use_tma=False)
        for out_dtype in (torch.float32, torch.bfloat16):
            for cfg in (WS_WGRAD_CONFIGS[i] for i in args.configs):
                for programs in (p or None for p in args.programs):
                    what = f"wgrad M={m} N={n} {out_dtype} {cfg} programs={programs}"
                    out = torch.full((EXPERTS, m, n), float("nan"), dtype=out_dtype, device="cuda")
                    watched(
                        what,
                        args.watchdog,
                        lambda: fp8_grouped_wgrad_ws(a_t, b_t, out, expert_tiles=tiles, config=cfg, programs=programs),
                    )
                    err = float((out.float() - ref.to(out_dtype).float()).abs().max())
                    print(f"  max diff {err:.3g}", flush=True)
                    if not err <= (0.0 if out_dtype == torch.float32 else 2**-8 * float(ref.abs().max())):
                        fail(what)


def smoke_fc1(args, plan, fmt_plain, tokens, gen):
    print(f"rows per expert {plan.expert_offsets.diff().tolist()}", flush=True)
    for hidden, inter in args.shapes:
        x = torch.randn(tokens, hidden, generator=gen).cuda()
        w1 = (torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) * hidden**-0.5).cuda()
        for fmt in (fmt_plain, fl.fp8_format(True)):
            xq, w1q = fl.quantize_rows(x, fmt), fl.quantize_w1_fwd(w1, fmt)
            h_ref, a_ref = fl.fp8_fc1_swiglu(xq, w1q, plan, fmt, inter=inter, h_dtype=torch.bfloat16)
            a_ref_f = fl.dequantize_rows(a_ref, fmt)
            for save_h, stages in ((s, n) for s in (True, False) for n in args.stages):
                for programs in (p or None for p in args.programs):
                    what = (
                        f"fc1 H={hidden} I={inter} pow2={fmt.pow2} save_h={save_h} stages={stages} programs={programs}"
                    )
                    pairs = plan.num_pairs
                    h = torch.full((pairs, 2 * inter), float("nan"), dtype=torch.bfloat16, device="cuda")
                    aq = torch.full((pairs, inter), 0x7F, dtype=torch.uint8, device="cuda").view(fl.FP8_DTYPE)
                    a_s = torch.full((pairs, inter // 128), float("nan"), device="cuda")
                    watched(
                        what,
                        args.watchdog,
                        lambda: fp8_fc1_swiglu_ws(
                            xq,
                            w1q,
                            plan,
                            h if save_h else None,
                            aq,
                            a_s,
                            inter=inter,
                            pow2=fmt.pow2,
                            programs=programs,
                            stages=stages,
                        ),
                    )
                    a_f = fl.dequantize_rows(fl.QTensor(aq, a_s), fmt)
                    a_err = float((a_f - a_ref_f).abs().max()) / max(float(a_ref_f.abs().max()), 1e-30)
                    same_a = torch.equal(aq.view(torch.uint8), a_ref.data.view(torch.uint8)) and torch.equal(
                        a_s, a_ref.scale
                    )
                    line = f"  a: same bits {same_a}, max diff / max {a_err:.3g}"
                    ok = a_err <= 2**-3
                    if save_h:
                        h_err = float((h.float() - h_ref.float()).abs().max())
                        line += f"; h: same bits {torch.equal(h, h_ref)}, max diff {h_err:.3g}"
                        ok = ok and h_err <= 2**-7 * float(h_ref.float().abs().max())
                    print(line, flush=True)
                    if not ok:
                        fail(what)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kernel", choices=["wgrad", "fc1"])
    p.add_argument("--watchdog", type=float, default=60.0, help="seconds one launch (with its compile) may take")
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--no-empty-expert", action="store_true", help="every expert gets rows")
    p.add_argument("--programs", type=int, nargs="+", default=[0, 1, 3], help="0: as many as the launcher picks")
    p.add_argument("--stages", type=int, nargs="+", default=[4, 3], help="ring stages (fc1)")
    p.add_argument(
        "--configs",
        type=int,
        nargs="+",
        default=list(range(len(WS_WGRAD_CONFIGS))),
        help="WS_WGRAD_CONFIGS indices (wgrad)",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help="wgrad: MxN of the gradient (default 256x384 96x200); fc1: HxI (default 256x256 208x384)",
    )
    args = p.parse_args()
    default_shapes = {"wgrad": ["256x384", "96x200"], "fc1": ["256x256", "208x384"]}[args.kernel]
    args.shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes or default_shapes]
    gen = torch.Generator().manual_seed(0)
    # Expert 0 empty (unless --no-empty-expert), expert 1 most rows (several row tiles), the rest a few (the GPU
    # tests' routing).
    index, weights = ragged_routing(
        args.tokens, EXPERTS, 2, seed=7, hot_fraction=0.8, empty_expert=None if args.no_empty_expert else 0
    )
    plan = build_routing_plan(index.cuda(), weights.cuda(), expert_base=0, num_local_experts=EXPERTS, tile_m=QTILE_M)
    {"wgrad": smoke_wgrad, "fc1": smoke_fc1}[args.kernel](args, plan, fl.fp8_format(), args.tokens, gen)
    print("PASS every case")


if __name__ == "__main__":
    main()
