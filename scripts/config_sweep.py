"""Usage: python scripts/config_sweep.py [--shape qwen3-30b-a3b] [--tokens 4096 16384] [--extra]

Every autotuning candidate of the bf16 Triton FC1 + SwiGLU and grouped GEMM, timed by the autotuner itself at the
layer's shapes: one bf16 forward and forward + backward of the layer per (shape, T), with the autotuner's timing of
each config recorded as it runs (Triton's do_bench, in us). Per GEMM (kernel, autotuning key N, K, rows bucket, and
the launch's flags) it prints the fastest configs, marking those of the package's lists. ``--extra`` adds the
candidates of ``EXTRA_GEMM`` and ``EXTRA_FC1`` to the lists for the run, to see whether any would lead.

Needs a GPU and a fresh autotuning cache for the kernels it reports (set TRITON_CACHE_DIR to an empty directory):
choices cached on disk are not timed again.
"""

from __future__ import annotations

import argparse
import collections

from prime_megamoe.kernels import tuning

M, HALF = 128, 64
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, persistent)
EXTRA_GEMM = (
    (M, 128, 64, 8, 5, False),
    (M, 128, 128, 8, 3, False),
    (M, 128, 64, 4, 4, False),
    (M, 256, 32, 8, 5, False),
    (M, 128, 128, 8, 3, True),
    (M, 128, 64, 8, 5, True),
    (HALF, 128, 64, 4, 5, False),
    (HALF, 256, 64, 8, 3, False),
    (M, 64, 128, 4, 4, False),
    (M, 256, 128, 8, 2, False),
    (M, 128, 256, 8, 2, False),
)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, persistent, one_dot)
EXTRA_FC1 = (
    (M, 64, 64, 4, 4, False, True),
    (M, 64, 64, 4, 5, False, True),
    (M, 64, 128, 8, 3, False, True),
    (M, 128, 32, 8, 5, False, True),
    (M, 128, 64, 8, 5, False, False),
    (HALF, 128, 64, 4, 5, False, True),
    (M, 128, 128, 8, 2, False, True),
    (M, 64, 64, 4, 4, True, True),
    (HALF, 256, 64, 8, 3, False, False),
    (M, 128, 32, 8, 6, False, False),
    (M, 64, 128, 4, 3, False, False),
)
FLAGS = ("GATHER_A", "SCALE_ROWS", "A_TMA", "B_TMA", "B_KMAJOR", "SAVE_H")


def extra_configs() -> tuple[list, list]:
    """The extra candidates as triton.Configs: (grouped GEMM's, FC1's)."""
    gemm = [tuning._cfg(*t, PERSISTENT=p, pre_hook=tuning.gemm_tma_boxes) for *t, p in EXTRA_GEMM]
    fc1 = [tuning._cfg(*t, PERSISTENT=p, ONE_DOT=o) for *t, p, o in EXTRA_FC1]
    return gemm, fc1


def report(records: dict, listed: set, top: int = 5) -> list[str]:
    """Lines per GEMM: the fastest listed config, the fastest of all, and the ``top`` fastest. ``records``: (kernel,
    key, flags) -> [(us, config)]; ``listed``: ids of the package's own configs."""
    lines = []
    for (kernel, key, flags), timings in records.items():
        timings = sorted(timings, key=lambda r: r[0])
        own = [t for t, c in timings if id(c) in listed]
        best_own = f"{own[0]:.1f} us" if own else "none timed"
        flag_text = " ".join(f"{k}={int(v)}" for k, v in flags)
        lines.append(f"{kernel} N,K,rows={key} {flag_text}: best listed {best_own}, best {timings[0][0]:.1f} us")
        for t, c in timings[:top]:
            lines.append(f"  {t:9.1f}  {'listed' if id(c) in listed else 'extra '}  {c}")
    return lines


def main() -> None:
    import torch
    from triton.runtime import autotuner

    from prime_megamoe.bench import SHAPES, make_workload
    from prime_megamoe.kernels import grouped_gemm

    p = argparse.ArgumentParser()
    p.add_argument("--shape", nargs="+", default=["qwen3-30b-a3b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--extra", action="store_true", help="also time EXTRA_GEMM and EXTRA_FC1")
    args = p.parse_args()

    gemm, fc1 = grouped_gemm.grouped_gemm_kernel, grouped_gemm.fc1_swiglu_kernel
    listed = {id(c) for c in (*gemm.configs, *fc1.configs)}
    if args.extra:
        extra_gemm, extra_fc1 = extra_configs()
        gemm.configs = [*gemm.configs, *extra_gemm]
        fc1.configs = [*fc1.configs, *extra_fc1]

    records = collections.defaultdict(list)
    bench = autotuner.Autotuner._bench

    def timed(self, *a, config, **meta):
        t = bench(self, *a, config=config, **meta)
        named = dict(zip(self.arg_names, a))
        key = tuple(named.get(k, meta.get(k)) for k in self.keys)
        flags = tuple((k, meta[k]) for k in FLAGS if k in meta)
        median = t[0] if isinstance(t, (list, tuple)) else t
        records[(self.base_fn.__name__, key, flags)].append((median * 1e3, config))
        return t

    autotuner.Autotuner._bench = timed
    for shape in args.shape:
        for tokens in args.tokens:
            work = make_workload(shape, tokens, "mega_moe", "bf16", None)
            work.fwd()
            work.fwd_bwd()
            torch.cuda.synchronize()
            print(f"== {shape}, T = {tokens}")
            print("\n".join(report(records, listed)), flush=True)
            records.clear()


if __name__ == "__main__":
    main()
