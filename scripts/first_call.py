"""Usage: python scripts/first_call.py [--shape qwen3-30b-a3b] [--tokens 4096] [--precision bf16] [--calls 2]

Wall time of a process's first layer calls (forward + backward of ``mega_moe``, one GPU, the benchmark's inputs):
what a trainer's first step waits for beyond the step itself. The first call compiles the kernels not in Triton's
cache (TRITON_CACHE_DIR) and times the autotuning candidates of each GEMM shape whose choice is not cached on disk;
later calls only run. Run it twice with one cache directory to see what a second process pays. Prints each call's
seconds and, per autotuned kernel, how many shapes it chose a candidate for.
"""

from __future__ import annotations

import argparse
import time

import torch

from prime_megamoe.bench import SHAPES, make_workload
from prime_megamoe.kernels import grouped_gemm


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--calls", type=int, default=2)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = make_workload(args.shape, args.tokens, "mega_moe", args.precision, None, device=device)
    seconds = []
    for i in range(args.calls):
        _sync(device)
        start = time.perf_counter()
        work.fwd_bwd()
        _sync(device)
        seconds.append(time.perf_counter() - start)
        print(f"{args.shape} T={args.tokens} {args.precision} call {i}: {seconds[-1]:.3f} s", flush=True)
    for name in ("fc1_swiglu_kernel", "grouped_gemm_kernel", "grouped_wgrad_kernel"):
        print(f"{name}: a choice for {len(getattr(grouped_gemm, name).cache)} shape(s)")
    return seconds


if __name__ == "__main__":
    main()
