"""Usage: python scripts/graph_probe.py [--shape qwen3-30b-a3b] [--tokens 16384] [--precisions fp8 bf16] [--iters 20]

Can the layer's no-grad forward be captured in a CUDA graph, and what does a replay take against an eager call?
One GPU, EP = 1, the benchmark's inputs (``bench.make_workload``). Per precision: the eager forward is warmed up on a
side stream (autotuning, compiled launches, pooled plans), its output kept, then one forward is captured with
``torch.cuda.graph``. A capture that fails prints its error (the step of the forward that cannot be captured: a host
sync, a dependency on work outside the capture) and where in the package it was raised, and the probe stops: a failed
capture leaves the process's CUDA generator unusable (probe the next precision in a process of its own). A captured
graph is replayed and its output compared bitwise with the eager one; then both are timed one call at a time
(synchronised before each call, CUDA events, median) and back to back (``--iters`` calls between two events). A table
comes last.

A single forward waits on the host for a few hundred microseconds before its first GEMM; a replay issues the whole
forward in one launch, so this probe measures what capture would give a trainer that captures the layer.
"""

from __future__ import annotations

import argparse
import traceback

import torch

from prime_megamoe.bench import _events_median, make_workload


def probe(shape: str, tokens: int, precision: str, iters: int, error_mode: str) -> tuple[str, bool]:
    """The table's row for ``precision``, and whether the forward was captured."""
    work = make_workload(shape, tokens, "mega_moe", precision, None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            eager_out = work.fwd()
    torch.cuda.current_stream().wait_stream(side)
    eager_out = eager_out.clone()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=error_mode):
            graph_out = work.fwd()
    except Exception as exc:  # what stops capture is the finding: report it and where in the package it happened
        frames = [
            f"{f.filename.split('prime_megamoe/')[-1]}:{f.lineno} {f.name}"
            for f in traceback.extract_tb(exc.__traceback__)
            if "prime_megamoe/" in f.filename
        ]
        print(f"{precision}: capture failed at {' <- '.join(reversed(frames[-4:]))}", flush=True)
        return f"{precision:8s} capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", False
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(graph_out, eager_out)
    # One call: the median of single calls, each on an idle GPU; back to back: iters calls between two events.
    eager_one, graph_one = (_events_median(fn, iters, 0, None) for fn in (work.fwd, graph.replay))
    eager_b2b, graph_b2b = (_events_median(fn, 1, 0, None, repeat=iters) for fn in (work.fwd, graph.replay))
    graph.replay()  # the timed calls ran eager forwards in between: the graph's output must still be right
    torch.cuda.synchronize()
    same = same and torch.equal(graph_out, eager_out)
    return f"{precision:8s} {eager_one:9.3f} {graph_one:9.3f} {eager_b2b:9.3f} {graph_b2b:9.3f} {same}", True


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--precisions", nargs="+", default=["fp8", "bf16"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--error-mode",
        default="global",
        choices=["global", "thread_local", "relaxed"],
        help="the capture's error mode (relaxed lets calls that are unsafe during capture through)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_probe.py captures CUDA graphs: it needs a CUDA GPU")
    rows = []
    for precision in args.precisions:
        row, captured = probe(args.shape, args.tokens, precision, args.iters, args.error_mode)
        rows.append(row)
        if not captured:
            break
    print(f"{args.shape}, T = {args.tokens}, EP = 1, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'prec':8s} {'eager 1':>9s} {'graph 1':>9s} {'eager b2b':>9s} {'graph b2b':>9s} same (ms; 1 = one call)")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
