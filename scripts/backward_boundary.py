"""Usage: python scripts/backward_boundary.py [--shape qwen3-30b-a3b] [--tokens 2048] [--precision bf16] [--calls 20]

Host time at the boundary between one layer call's forward and its backward (one GPU), where single calls at small T
leave the GPU idle (BENCHMARKS.md): per call, after a sync, the median host us of

- the forward with autograd (the call to its return),
- from the forward's return to the entry of the layer's autograd backward (``y.backward`` through torch's autograd
  engine, which runs a CUDA graph's backward on a thread of its own),
- the backward itself (its entry to its return), and ``y.backward`` in all;
- on the GPU (CUDA events on the layer's stream, recorded at the call's start, at the forward's return, at the
  backward's entry and after its return): when the stream finished the forward's work, when it reached the
  backward's entry (later than the forward's end by the time it waited for the host), and the call's end;

and two points of comparison: a trivial autograd Function on a CUDA tensor (``backward()`` called to its backward's
entry), and one small Triton launch's host time through ``compiled_launch.launch`` in the main thread against inside
an autograd backward (the first launch of each backward, then the later ones).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prime_megamoe.bench import make_workload
from prime_megamoe.kernels.combine import combine_rows_kernel
from prime_megamoe.ops.compiled_launch import launch
from prime_megamoe.ops.ep_pipeline import ExpertParallelExperts
from prime_megamoe.ops.expert_compute import RoutedExperts
from prime_megamoe.ops.quantized_experts import QuantizedRoutedExperts

LAYER_FUNCTIONS = (RoutedExperts, QuantizedRoutedExperts, ExpertParallelExperts)


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _timed_backwards(marks: dict) -> list:
    """Wraps the layer Functions' backwards to record their entry and return times (and a CUDA event at the entry);
    returns what to restore."""
    saved = []
    for cls in LAYER_FUNCTIONS:
        original = cls.backward

        def backward(ctx, *grads, _original=original):
            marks["entry"] = time.perf_counter()
            marks["entry event"] = _event()
            try:
                return _original(ctx, *grads)
            finally:
                marks["return"] = time.perf_counter()

        saved.append((cls, original))
        cls.backward = staticmethod(backward)
    return saved


def layer_boundary(shape: str, tokens: int, precision: str, calls: int) -> dict[str, float]:
    work = make_workload(shape, tokens, "mega_moe", precision, None)
    dy = torch.randn_like(work.fwd_grad())
    marks: dict = {}
    saved = _timed_backwards(marks)
    samples = []
    try:
        for i in range(calls + 3):  # the first three warm up
            work.clear_grads()  # as the benchmark's forward + backward: gradients written, not accumulated
            torch.cuda.synchronize()
            marks.clear()
            start = _event()
            began = time.perf_counter()
            y = work.fwd_grad()
            returned = time.perf_counter()
            forward_done = _event()
            y.backward(dy)
            done = time.perf_counter()
            end = _event()
            torch.cuda.synchronize()
            if i >= 3:
                samples.append(
                    {
                        "forward with autograd": returned - began,
                        "forward return -> backward entry": marks["entry"] - returned,
                        "backward entry -> its return": marks["return"] - marks["entry"],
                        "y.backward in all": done - returned,
                        "GPU, from the call's start, forward done": start.elapsed_time(forward_done) / 1e3,
                        "GPU, from the call's start, backward's entry": start.elapsed_time(marks["entry event"]) / 1e3,
                        "GPU, from the call's start, call's end": start.elapsed_time(end) / 1e3,
                        "host, from the call's start, backward's entry": marks["entry"] - began,
                    }
                )
    finally:
        for cls, original in saved:
            cls.backward = staticmethod(original)
    return {name: statistics.median(s[name] for s in samples) * 1e6 for name in samples[0]}


def launch_points(repeats: int = 8) -> dict[str, float]:
    src = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(8, 2, dtype=torch.int32, device="cuda")
    out = torch.empty(8, 128, device="cuda", dtype=torch.bfloat16)

    def one():  # the launch primitive itself (ops.launch.combine_rows would add its checks to what is timed)
        launch(
            combine_rows_kernel,
            (8, 1),
            src,
            pos,
            out,
            src,
            out,
            8,
            128,
            128,
            128,
            TOP_K=2,
            BLOCK_R=1,
            BLOCK_H=128,
            PAIR_VALUES=False,
            K_BLOCK=2,
            num_warps=4,
        )

    def per_launch(n: int = 50) -> float:
        began = time.perf_counter()
        for _ in range(n):
            one()
        return (time.perf_counter() - began) / n

    one()
    torch.cuda.synchronize()
    main = statistics.median(per_launch() for _ in range(5))
    seen: dict[str, list] = {"entry": [], "first": [], "later": []}
    called = [0.0]

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            seen["entry"].append(time.perf_counter() - called[0])
            began = time.perf_counter()
            one()
            seen["first"].append(time.perf_counter() - began)
            seen["later"].append(per_launch())
            return grad

    x = torch.randn(4, device="cuda", requires_grad=True)
    for _ in range(repeats + 1):
        y = Trivial.apply(x).sum()
        torch.cuda.synchronize()
        called[0] = time.perf_counter()
        y.backward()
        torch.cuda.synchronize()
    med = {name: statistics.median(values[1:]) * 1e6 for name, values in seen.items()}  # the first one warms up
    return {
        "trivial Function: backward() called -> its backward's entry": med["entry"],
        "small launch, main thread": main * 1e6,
        "small launch, a backward's first": med["first"],
        "small launch, a backward's later ones": med["later"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--precision", default="bf16", help="the layer's precision (bf16, fp8, fp8_bwd, mxfp8)")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us, medians")
    rows = layer_boundary(args.shape, args.tokens, args.precision, args.calls)
    print(f"{args.shape} T={args.tokens} {args.precision}, {args.calls} single calls:")
    for name, us in rows.items():
        print(f"  {name:60s} {us:8.1f}")
    for name, us in launch_points().items():
        print(f"  {name:60s} {us:8.1f}")


if __name__ == "__main__":
    main()
