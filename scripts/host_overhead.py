"""Where the host time of one MoE layer call goes (cProfile), for a benchmark workload.

    torchrun --nproc-per-node 2 scripts/host_overhead.py --shape qwen3-30b-a3b --tokens 16384 [--grad] [--no-profile]

Rank 0 prints the functions with the most cumulative host time over ``--calls`` calls, after warm-up (compiled and
autotuned kernels). The GPU work is not timed here; see prime_megamoe.bench.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.distributed as dist

from prime_megamoe.bench import make_workload, torchrun_group


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--grad", action="store_true", help="profile forward + backward instead of the no-grad forward")
    p.add_argument("--no-profile", action="store_true",
                   help="only time it: the median host time to issue one call, the GPU idle before each call")
    args = p.parse_args()
    group = torchrun_group()
    work = make_workload(args.shape, args.tokens, "mega_moe", "bf16", group)
    step = work.fwd_bwd if args.grad else work.fwd
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.no_profile:
        samples = []
        for _ in range(args.calls):
            torch.cuda.synchronize()
            began = time.perf_counter()
            step()
            samples.append((time.perf_counter() - began) * 1e3)
        torch.cuda.synchronize()
        if group is None or dist.get_rank() == 0:
            print(f"host ms per call (not profiled, median of {args.calls}): {statistics.median(samples):.3f}")
        if group is not None:
            dist.destroy_process_group()
        return
    prof = cProfile.Profile()
    began = time.perf_counter()
    prof.enable()
    for _ in range(args.calls):
        step()
    prof.disable()
    host_ms = (time.perf_counter() - began) * 1e3 / args.calls
    torch.cuda.synchronize()
    if group is None or dist.get_rank() == 0:
        print(f"host ms per call (profiled): {host_ms:.3f}")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
