"""Usage: python scripts/gemm_ceiling.py [--shape qwen3-30b-a3b ...] [--tokens 4096 16384] [--iters 20]

cuBLAS at the layer's GEMM shapes: each of the six grouped GEMMs of a forward and backward (FC1, FC2, the two dgrads,
the two weight gradients) as ``torch.bmm`` over the experts with T * k / E rows each (uniform routing, no gather, no
epilogue), and ``torch._grouped_mm`` with per-expert offsets for the four whose rows are the grouped dimension. A
ceiling for the layer's kernels, which also gather rows, apply SwiGLU or the top-k weight and take ragged routing:
compare them with ``python -m prime_megamoe.bench ... --profile-dir DIR`` and ``scripts/trace_stages.py`` run on
the same machine. Also an 8192^3 matrix product, the machine's dense bf16 rate. Median of CUDA-event timings, each
call from an idle GPU after 3 warm-up calls (``prime_megamoe.bench._events_median``).
"""

from __future__ import annotations

import argparse

import torch

from prime_megamoe.bench import SHAPES, _events_median


def layer_gemms(hidden: int, inter: int, rows: int) -> dict[str, tuple[int, int, int]]:
    """Per-expert (M, K, N) of the layer's six GEMMs with ``rows`` rows an expert."""
    return {
        "FC1 (x W1^T)": (rows, hidden, 2 * inter),
        "FC2 (a W2^T)": (rows, inter, hidden),
        "FC2 dgrad (dy W2)": (rows, hidden, inter),
        "FC1 dgrad (dh W1)": (rows, 2 * inter, hidden),
        "dW1 (dh^T x)": (2 * inter, rows, hidden),
        "dW2 (dy^T aw)": (hidden, rows, inter),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", nargs="+", default=["qwen3-30b-a3b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms (TFLOP/s)")
    for shape in args.shape:
        hidden, inter, experts, top_k = SHAPES[shape]
        for tokens in args.tokens:
            rows = tokens * top_k // experts
            for name, (m, k, n) in layer_gemms(hidden, inter, rows).items():
                a = torch.randn(experts, m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(experts, k, n, device="cuda", dtype=torch.bfloat16)
                flops = 2 * experts * m * k * n
                ms = _events_median(lambda: torch.bmm(a, b), args.iters, 3, None)
                line = f"{shape} T={tokens} {name:20s} bmm {ms:.3f} ({flops / ms / 1e9:.0f})"
                if not name.startswith("dW"):
                    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * m
                    a2d = a.reshape(experts * m, k)
                    ms = _events_median(lambda: torch._grouped_mm(a2d, b, offs=offs), args.iters, 3, None)
                    line += f" | grouped_mm {ms:.3f} ({flops / ms / 1e9:.0f})"
                print(line, flush=True)
                del a, b
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _events_median(lambda: a @ b, args.iters, 3, None)
    print(f"8192^3 matmul {ms:.3f} ({2 * 8192**3 / ms / 1e9:.0f})")


if __name__ == "__main__":
    main()
