"""Where a single call's host time goes before its first GEMM, and what the host's basic operations cost.

    torchrun --nproc-per-node 2 scripts/host_profile.py --shape qwen3-30b-a3b --tokens 16384 [--calls 20]

A single call is host-bound at its start: its GPU idles until the host has issued the first expert GEMM. Each rank
prints:
- per-operation costs on this host (a tensor view, an allocation, an event record, a stream lookup, a process-group
  query, the input checks), each the median of many repetitions, in us;
- for ``--calls`` single forward + backward calls (each after a sync and a barrier): the host time from the call's
  start to the return of the first ``fc1_swiglu`` launch and to the call's end (medians);
- a cProfile of those calls: the functions and torch methods with the most own time (cProfile slows every Python
  call, so read it for shares, not for absolute times).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import prime_megamoe.ops.ep_pipeline as ep_pipeline
import prime_megamoe.ops.launch as ops_launch
from prime_megamoe.bench import make_workload, torchrun_group
from prime_megamoe.validation import check_expert_inputs


def per_op_costs(group) -> list[str]:
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(4096, 8, device="cuda", dtype=torch.int64)
    w = torch.rand(4096, 8, device="cuda")
    w1 = torch.randn(4, 1536, 2048, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(4, 2048, 768, device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(256, device="cuda", dtype=torch.int32)
    stream = torch.cuda.current_stream()
    ops = {
        "python: empty function call": lambda: None,
        "tensor.reshape(-1)": lambda: ids.reshape(-1),
        "tensor[a:b]": lambda: ids[2:5],
        "tensor.data_ptr()": lambda: x.data_ptr(),
        "tensor.shape[0]": lambda: x.shape[0],
        "x.new_empty(1000, 2048)": lambda: x.new_empty(1000, 2048),
        "small.zero_() (a memset)": lambda: small.zero_(),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch.cuda.Event() + record": lambda: torch.cuda.Event().record(stream),
        "torch.is_grad_enabled()": lambda: torch.is_grad_enabled(),
        "dist.get_rank(group)": lambda: dist.get_rank(group),
        "dist.get_world_size(group)": lambda: dist.get_world_size(group),
        "check_expert_inputs": lambda: check_expert_inputs(x, ids, w, w1, w2, group, 4096),
    }
    lines = [f"{'us':>8s}  operation (median of 200 x 50)"]
    for name, fn in ops.items():
        samples = []
        for _ in range(200):
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            samples.append((time.perf_counter() - t0) / 50 * 1e6)
        lines.append(f"{statistics.median(samples):8.2f}  {name}")
    torch.cuda.synchronize()
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=45)
    args = p.parse_args()
    group = torchrun_group()
    rank = 0 if group is None else dist.get_rank(group)
    lines = per_op_costs(group)
    work = make_workload(args.shape, args.tokens, "mega_moe", "bf16", group)
    for _ in range(3):
        work.fwd_bwd()

    first_fc1 = []
    original = ops_launch.fc1_swiglu

    def timed_fc1(*a, **kw):
        out = original(*a, **kw)
        if first_fc1[-1] is None:
            first_fc1[-1] = time.perf_counter()
        return out

    ep_pipeline.launch.fc1_swiglu = timed_fc1  # the pipeline calls it as launch.fc1_swiglu
    to_fc1, to_end, fwd_end = [], [], []
    profiler = cProfile.Profile()
    try:
        for profiled in (False, True):
            for _ in range(args.calls):
                torch.cuda.synchronize()
                if group is not None:
                    dist.barrier(group)
                first_fc1.append(None)
                if profiled:
                    profiler.enable()
                t0 = time.perf_counter()
                work.fwd_bwd()
                t1 = time.perf_counter()
                if profiled:
                    profiler.disable()
                else:
                    to_fc1.append((first_fc1[-1] - t0) * 1e6)
                    to_end.append((t1 - t0) * 1e6)
            if not profiled:  # the no-grad forward's host time too
                for _ in range(args.calls):
                    torch.cuda.synchronize()
                    if group is not None:
                        dist.barrier(group)
                    first_fc1.append(None)
                    t0 = time.perf_counter()
                    work.fwd()
                    fwd_end.append((time.perf_counter() - t0) * 1e6)
    finally:
        ep_pipeline.launch.fc1_swiglu = original
    torch.cuda.synchronize()
    lines.append(f"forward + backward, {args.calls} single calls (host, us, median): first fc1_swiglu launched "
                 f"{statistics.median(to_fc1):.1f} (min {min(to_fc1):.1f}), call returned "
                 f"{statistics.median(to_end):.1f}; no-grad forward returned {statistics.median(fwd_end):.1f}")
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("tottime").print_stats(args.top)
    lines += [f"cProfile of {args.calls} forward + backward calls, by own time:"] + buf.getvalue().splitlines()
    text = "\n".join(f"rank {rank} {line}" for line in lines)
    print(text, flush=True)
    if group is not None:
        dist.barrier(group)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
