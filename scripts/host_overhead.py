"""Usage: torchrun --nproc-per-node 2 scripts/host_overhead.py [--shape qwen3-30b-a3b] [--tokens 16384]
        [--grad | --forward-grad] [--no-profile | --blocking | --launches] [--sort tottime] [--calls N]
        [--precision fp8] [--lines 30]

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

``--launches``: rank 0's host timeline of single calls, each after a sync, with one CUDA event at the call's start and
one at its end and none between: for every kernel launch (in call order) the median host us from the call's start to
the launch and spent inside it, then the call's return and its GPU span. Then ``--calls`` calls back to back (the host
running ahead, as in training): host us and GPU us per call. Where the two are equal the host sets the pace.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import prime_megamoe.ops.compiled_launch as compiled_launch
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


def kernel_name(kernel) -> str:
    """A launched kernel's name, under any autotuning or heuristics wrappers."""
    while not hasattr(kernel, "__name__") and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return getattr(kernel, "__name__", type(kernel).__name__)


@contextlib.contextmanager
def stamped_launches(stamps: list):
    """Within it every launch through ``compiled_launch.launch`` by the package's modules (which call it through
    their own ``launch`` attribute) appends (host start, host end, kernel name) to ``stamps``."""
    original = compiled_launch.launch

    def stamped(kernel, grid, *args, **kwargs):
        began = time.perf_counter()
        original(kernel, grid, *args, **kwargs)
        stamps.append((began, time.perf_counter(), kernel_name(kernel)))

    modules = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("prime_megamoe") and getattr(m, "launch", None) is original
    ]
    for m in modules:
        m.launch = stamped
    try:
        yield
    finally:
        for m in modules:
            m.launch = original


def launch_timeline(step, calls: int, events: bool = True) -> list[tuple[str, float, float]]:
    """(kernel name, median host us from the call's start to its launch, median host us inside the launch) for each
    launch of single calls of ``step``, each after a sync, then ("return", host us to the call's return, GPU us
    from the call's start to its end: two CUDA events, with ``events``; else NaN)."""
    stamps: list = []
    rows, names = [], None
    with stamped_launches(stamps):
        for _ in range(calls):
            torch.cuda.synchronize()
            if events:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stamps.clear()
            began = time.perf_counter()
            if events:
                start.record()
            step()
            if events:
                end.record()
            returned = time.perf_counter()
            torch.cuda.synchronize()
            call_names = [name for _, _, name in stamps]
            if names is not None and call_names != names:
                raise RuntimeError(f"the calls launched different kernels: {names} and {call_names}")
            names = call_names
            span = start.elapsed_time(end) * 1e3 if events else float("nan")
            rows.append([((s - began) * 1e6, (e - s) * 1e6) for s, e, _ in stamps] + [((returned - began) * 1e6, span)])
    columns = list(zip(*rows))
    return [
        (name, statistics.median(c[0] for c in col), statistics.median(c[1] for c in col))
        for name, col in zip([*names, "return"], columns)
    ]


def back_to_back(step, calls: int) -> tuple[float, float]:
    """(host us, GPU us) per call of ``calls`` calls of ``step`` issued back to back after a sync."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    for _ in range(calls):
        step()
    end.record()
    host = (time.perf_counter() - began) * 1e6 / calls
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) * 1e3 / calls


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
    p.add_argument(
        "--launches",
        action="store_true",
        help="every launch's host time in single calls, then host and GPU time per call back to back",
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
    if args.launches:
        if rank == 0:
            print(f"{args.calls} single calls, medians: host us at the launch, host us inside it, kernel")
            for name, at, inside in launch_timeline(step, args.calls):
                last = name == "return"
                print(f"{at:9.1f}  return; GPU span {inside:.1f}" if last else f"{at:9.1f} {inside:7.1f}  {name}")
            host, gpu = back_to_back(step, args.calls)
            print(f"{args.calls} calls back to back, per call: host {host:.1f} us, GPU {gpu:.1f} us", flush=True)
        else:
            for _ in range(2 * args.calls):
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
