"""Usage: torchrun --nproc-per-node 2 scripts/host_overhead.py [--shape qwen3-30b-a3b] [--tokens 16384]
        [--grad | --forward-grad] [--no-profile | --blocking] [--sort tottime] [--calls N] [--precision fp8]
        [--lines 30]

Where the host time of one MoE layer call goes (cProfile), for a benchmark workload. Rank 0 prints the functions with
the most cumulative (or, with ``--sort tottime``, own) host time over ``--calls`` calls, after warm-up (compiled and
autotuned kernels). ``--no-profile`` only times single calls, each after a sync and a barrier as the benchmark's
one-call figures are: every rank prints the median host time from the call's start to the return of its first FC1
launch (until then the GPU has nothing long to run) and to the call's return. The GPU work is not timed here; see
prime_megamoe.bench.

``--blocking``: what in one call could hold the host beyond its own Python: every call that synchronises with the GPU
(``torch.cuda.set_sync_debug_mode``), printed with the package's frames of its stack, then the CUDA runtime and
driver calls and the torch operators of one call with their count and host us (``torch.profiler``, which slows each
operator by some us: compare the two precisions, not the totals with the timed ones).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import prime_megamoe.ops.fp8_launch as fp8_launch
import prime_megamoe.ops.launch as ops_launch
from prime_megamoe.bench import make_workload, torchrun_group

# The FC1 launchers of every precision: the first one a call reaches is its first FC1 launch
FC1_LAUNCHERS = ((ops_launch, "fc1_swiglu"), (fp8_launch, "fp8_fc1_swiglu"))


def single_call_times(step, calls: int, group) -> tuple[list[float], list[float]]:
    """Host us from each single call's start to the return of its first FC1 launch (bf16's ``launch.fc1_swiglu`` or
    the quantised ``fp8_launch.fp8_fc1_swiglu``), and to the call's return."""
    first, ends = [], []
    seen = []
    originals = [(module, getattr(module, name)) for module, name in FC1_LAUNCHERS]

    def timed(original):
        def timed_fc1(*args, **kwargs):
            out = original(*args, **kwargs)
            if not seen:
                seen.append(time.perf_counter())
            return out

        return timed_fc1

    for (module, name), (_, original) in zip(FC1_LAUNCHERS, originals):
        setattr(module, name, timed(original))  # the layers call them through their modules' attributes
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            if group is not None:
                dist.barrier(group)
            seen.clear()
            began = time.perf_counter()
            step()
            ends.append((time.perf_counter() - began) * 1e6)
            first.append((seen[0] - began) * 1e6 if seen else float("nan"))
    finally:
        for (module, name), (_, original) in zip(FC1_LAUNCHERS, originals):
            setattr(module, name, original)
    torch.cuda.synchronize()
    return first, ends


PACKAGE_DIR = str(Path(__file__).resolve().parent.parent / "prime_megamoe")


def package_frames(stack: list[traceback.FrameSummary]) -> list[str]:
    """The frames of ``stack`` inside the package, innermost last, as ``file:line function``."""
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack if f.filename.startswith(PACKAGE_DIR + "/")]


# What torch warns with in sync debug mode when an operation synchronises (its other warning, that the mode is a
# prototype, is no such call)
SYNC_WARNING = "called a synchronizing CUDA operation"


def is_sync_warning(message) -> bool:
    return SYNC_WARNING in str(message)


def syncing_calls(step) -> list[tuple[str, list[str]]]:
    """(the warning, the package frames of its stack) for each call of ``step()`` that synchronises with the GPU."""
    seen = []

    def record(message, category, filename, lineno, file=None, line=None):
        if is_sync_warning(message):
            seen.append((str(message).splitlines()[0], package_frames(traceback.extract_stack()[:-1])))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return seen


def host_events(events) -> list[tuple[str, int, float]]:
    """(name, count, host us) of profiler ``events`` run on the CPU (operators, CUDA runtime and driver calls; an
    operator's us include the calls it makes), the most host time first."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU:
            total = totals[e.name]
            total[0] += 1
            total[1] += e.cpu_time_total
    return sorted(((name, n, us) for name, (n, us) in totals.items()), key=lambda row: -row[2])


def print_blocking(step, lines: int) -> None:
    synced = syncing_calls(step)
    print(f"calls that synchronise with the GPU in one call: {len(synced)}")
    for message, frames in synced:
        print(f"  {message}")
        for frame in frames[-6:]:
            print(f"      {frame}")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()  # the call alone: a sync of this tool's would count the GPU's remaining work as host time
    torch.cuda.synchronize()
    print("host events of one call (count, host us), the longest first:")
    for name, n, us in host_events(prof.events())[:lines]:
        print(f"  {name[:80]:80s} {n:5d} {us:10.1f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--grad", action="store_true", help="profile forward + backward instead of the no-grad forward")
    p.add_argument(
        "--forward-grad",
        action="store_true",
        help="the forward with autograd alone (what the benchmark subtracts from forward + backward)",
    )
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="only time single calls: host time to the first FC1 launch and to the call's return",
    )
    p.add_argument(
        "--blocking",
        action="store_true",
        help="the calls that synchronise with the GPU, and the CUDA runtime calls and operators of one call",
    )
    p.add_argument("--sort", default="cumulative", choices=("cumulative", "tottime"), help="cProfile order")
    p.add_argument("--precision", default="bf16", help="the layer's precision (bf16, fp8, fp8_bwd, mxfp8)")
    p.add_argument("--lines", type=int, default=30, help="functions to print")
    args = p.parse_args()
    group = torchrun_group()
    rank = 0 if group is None else dist.get_rank(group)
    work = make_workload(args.shape, args.tokens, "mega_moe", args.precision, group)
    step = work.fwd_bwd if args.grad else work.fwd_grad if args.forward_grad else work.fwd
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.blocking:
        if rank == 0:
            print_blocking(step, args.lines)
        else:
            step()
            step()
        if group is not None:
            dist.destroy_process_group()
        return
    if args.no_profile:
        first, ends = single_call_times(step, args.calls, group)
        print(
            f"rank {rank}: {args.calls} single calls, host us (median, min): first FC1 launched "
            f"{statistics.median(first):.1f} ({min(first):.1f}), call returned {statistics.median(ends):.1f} "
            f"({min(ends):.1f})",
            flush=True,
        )
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
    if rank == 0:
        print(f"host ms per call (profiled): {host_ms:.3f}")
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.lines)
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
