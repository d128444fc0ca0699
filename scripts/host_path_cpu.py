"""Usage: python scripts/host_path_cpu.py [--shape qwen3-30b-a3b] [--tokens 2048] [--precisions bf16 fp8]
        [--step forward|forward-grad|forward-backward] [--calls 300] [--profile fp8] [--lines 30]

The layer's host path as a Hopper GPU runs it, timed on a CPU (no GPU needed). The warp-specialised and Gluon
kernels' device checks pass on CPU tensors, and every launch goes through ``ops/compiled_launch.launch`` (its keys and
caches: the package's own Python) to a stand-in compiled kernel that does nothing. Left out: Triton's launcher (its
Python and the driver's launch), the GPU's allocator (CPU allocations stand in, dearer for large tensors) and all GPU
work; the routing ids are checked on the host, as in any call on CPU tensors (a GPU checks them in its routing
kernels). For comparing host-path changes and precisions, not for absolute times: the precisions alternate call by call
in one process, and each one's median and minimum host us per call are printed. ``--profile P``: cProfile of
precision P's calls instead, by own time.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU's kernels: set before any kernel is defined

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import prime_megamoe.ops.bf16_ws_launch as bf16_ws_launch  # noqa: E402
import prime_megamoe.ops.compiled_launch as compiled_launch  # noqa: E402
import prime_megamoe.ops.fp8_launch as fp8_launch  # noqa: E402
import prime_megamoe.ops.fp8_ws_launch as fp8_ws_launch  # noqa: E402
import prime_megamoe.ops.launch as ops_launch  # noqa: E402
import prime_megamoe.ops.tma as tma  # noqa: E402
from prime_megamoe.bench import make_workload  # noqa: E402
from prime_megamoe.env import env_get  # noqa: E402


class StandInKernel:
    """What ``compiled_launch`` keeps of a compiled kernel, launching nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args):
        return None


def stand_in_first_launch(kernel, grid, args, constexprs):
    """``compiled_launch._first_launch`` without compiling or launching: an autotuned kernel's first candidate stands
    in for the one autotuning would choose."""
    configs = getattr(kernel, "configs", None)
    return compiled_launch.entry_for(kernel, StandInKernel(), len(args), constexprs, configs[0] if configs else None)


@contextlib.contextmanager
def hopper_path_on_cpu():
    """Within it the layer takes a Hopper GPU's branches on CPU tensors, its launches going to stand-in kernels."""
    saved = []

    def patch(module, name, value):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    for module in (fp8_ws_launch, bf16_ws_launch):
        patch(module, "hopper_unavailable", lambda device: None)
    patch(fp8_launch, "gluon_device_unavailable", lambda device: None)
    for module in (tma, ops_launch, fp8_launch, fp8_ws_launch, bf16_ws_launch):
        patch(module, "tma_readable", tma.tma_layout)  # its layout checks, without the GPU's
    # as on a GPU: the environment read, without the interpreter's veto
    patch(compiled_launch, "direct_launch_enabled", lambda: env_get("PRIME_MEGAMOE_DIRECT_LAUNCH", "1") != "0")
    patch(compiled_launch, "_first_launch", stand_in_first_launch)
    patch(compiled_launch, "_current_device", lambda: 0)
    patch(compiled_launch, "_current_stream", lambda device: 0)
    cached = dict(compiled_launch._CACHE)
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
        compiled_launch._CACHE.clear()  # no stand-in outlives the context
        compiled_launch._CACHE.update(cached)


def steps(shape: str, tokens: int, precisions: list[str], step: str) -> dict:
    """Per precision, the call to time: the no-grad forward, the forward with autograd, or forward + backward."""
    out = {}
    for precision in precisions:
        work = make_workload(shape, tokens, "mega_moe", precision, None, device="cpu")
        out[precision] = {"forward": work.fwd, "forward-grad": work.fwd_grad, "forward-backward": work.fwd_bwd}[step]
    return out


def host_times(calls: dict, rounds: int, warmup: int = 3) -> dict[str, list[float]]:
    """Host us of each call, the calls alternating round by round."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            began = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - began) * 1e6)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--step", default="forward-grad", choices=("forward", "forward-grad", "forward-backward"))
    p.add_argument("--calls", type=int, default=300, help="calls per precision")
    p.add_argument("--profile", metavar="PRECISION", help="cProfile this precision's calls instead of timing")
    p.add_argument("--lines", type=int, default=30, help="functions to print with --profile")
    args = p.parse_args()
    with hopper_path_on_cpu():
        precisions = [args.profile] if args.profile else args.precisions
        calls = steps(args.shape, args.tokens, precisions, args.step)
        if args.profile:
            host_times(calls, 1)
            prof = cProfile.Profile()
            prof.enable()
            host_times(calls, args.calls, warmup=0)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.lines)
            return
        times = host_times(calls, args.calls)
    print(f"{args.shape} T={args.tokens} {args.step}, {args.calls} calls each, host us on this CPU:")
    for name, values in times.items():
        print(f"  {name:8s} median {statistics.median(values):8.1f}  min {min(values):8.1f}")


if __name__ == "__main__":
    main()
