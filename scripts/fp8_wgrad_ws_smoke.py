"""The warp-specialised fp8 weight gradient launched once per config on small problems, each launch waited for
under a watchdog, so that a launch that never finishes shows which config and problem it was (and where Python
waited) instead of stopping a test run at its time limit:

    python scripts/fp8_wgrad_ws_smoke.py [--watchdog 60] [--tokens 300] [--no-empty-expert] [--programs 1 3]
        [--configs 0 4] [--shapes 256x384]

Each launch is compared with the Triton weight gradient (same bits in fp32). Exits non-zero on the first mismatch;
the watchdog exits the process (code 3) after dumping every thread's stack.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.fp8_ws_launch import WS_CONFIGS, fp8_grouped_wgrad_ws
from prime_megamoe.ops.routing_plan import build_routing_plan
from tests.oracle import ragged_routing


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--watchdog", type=float, default=60.0, help="seconds one launch (with its compile) may take")
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--no-empty-expert", action="store_true", help="every expert gets rows")
    p.add_argument("--programs", type=int, nargs="+", default=[0, 1, 3], help="0: as many as the launcher picks")
    p.add_argument("--configs", type=int, nargs="+", default=list(range(len(WS_CONFIGS))), help="WS_CONFIGS indices")
    p.add_argument("--shapes", nargs="+", default=["256x384", "96x200"], help="MxN of the weight gradient")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    tokens, experts = args.tokens, 4
    # Expert 0 empty (unless --no-empty-expert), expert 1 most rows (several row tiles), the rest a few (the GPU
    # test's routing).
    index, weights = ragged_routing(tokens, experts, 2, seed=7, hot_fraction=0.8,
                                    empty_expert=None if args.no_empty_expert else 0)
    plan = build_routing_plan(index.cuda(), weights.cuda(), expert_base=0, num_local_experts=experts, tile_m=QTILE_M)
    fmt = fl.fp8_format()
    tiles = fl.expert_tile_offsets(plan)
    print(f"expert tiles {tiles.tolist()}", flush=True)
    for m, n in (tuple(int(v) for v in shape.split("x")) for shape in args.shapes):
        a_t = fl.quantize_sorted_cols_t(torch.randn(tokens, m, generator=gen).cuda(), plan, fmt)
        b_t = fl.quantize_sorted_cols_t(torch.randn(tokens, n, generator=gen).cuda(), plan, fmt)
        ref = torch.empty(experts, m, n, device="cuda")
        fl.fp8_grouped_wgrad(a_t, b_t, plan, fmt, ref, expert_tiles=tiles, use_tma=False)
        for out_dtype in (torch.float32, torch.bfloat16):
            for cfg in (WS_CONFIGS[i] for i in args.configs):
                for programs in (p or None for p in args.programs):
                    what = f"M={m} N={n} {out_dtype} {cfg} programs={programs}"
                    print(f"launch {what}", flush=True)
                    faulthandler.dump_traceback_later(args.watchdog, exit=True)
                    start = time.perf_counter()
                    out = torch.full((experts, m, n), float("nan"), dtype=out_dtype, device="cuda")
                    fp8_grouped_wgrad_ws(a_t, b_t, out, expert_tiles=tiles, config=cfg, programs=programs)
                    torch.cuda.synchronize()
                    faulthandler.cancel_dump_traceback_later()
                    err = float((out.float() - ref.to(out_dtype).float()).abs().max())
                    print(f"  done in {time.perf_counter() - start:.1f} s, max diff {err:.3g}", flush=True)
                    if not err <= (0.0 if out_dtype == torch.float32 else 2**-8 * float(ref.abs().max())):
                        print(f"FAIL {what}")
                        sys.exit(1)
    print("PASS every config")


if __name__ == "__main__":
    main()
