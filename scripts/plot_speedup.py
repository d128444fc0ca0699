"""Usage: python scripts/plot_speedup.py [--results benchmarks/results] [--out benchmarks/speedup.png]

Draws mega_moe's speed-up over the ``torch`` backend (torch ms / mega_moe ms, both from the same benchmark run) for
the forward, the backward and 2F+1B, per shape, expert-parallel size, precision and tokens per rank, from the
results JSON files that BENCHMARKS.md cites (listed in ``CASES`` below). Needs matplotlib, which is not a package
dependency: ``pip install matplotlib``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (shape, label, results file, tokens per rank, EP, precision, transport) for each mega_moe case drawn; the baseline is
# the torch row of the same file, tokens and precision (fp8 against the torch backend's fp8), or the torch bf16 row for
# a precision the torch backend lacks (as in the benchmark's table).
S30, S235 = "qwen3-30b-a3b", "qwen3-235b-a22b"
CASES = [
    (S30, "EP=1 bf16\nT=4096", "qwen3-30b_ep1_bf16.json", 4096, 1, "bf16", ""),
    (S30, "EP=1 bf16\nT=16384", "qwen3-30b_ep1_bf16.json", 16384, 1, "bf16", ""),
    (S30, "EP=1 fp8\nT=16384 (vs torch fp8)", "qwen3-30b_ep1_t16384_all.json", 16384, 1, "fp8", ""),
    (S30, "EP=2 bf16\nT=4096", "qwen3-30b_ep2_bf16_s10_final.json", 4096, 2, "bf16", "symmetric_memory"),
    (S30, "EP=2 bf16\nT=16384", "qwen3-30b_ep2_bf16_s10_final.json", 16384, 2, "bf16", "symmetric_memory"),
    (S235, "EP=1 bf16\nT=4096", "qwen3-235b_ep1_bf16.json", 4096, 1, "bf16", ""),
    (S235, "EP=1 bf16\nT=16384", "qwen3-235b_ep1_bf16.json", 16384, 1, "bf16", ""),
    (S235, "EP=2 bf16\nT=4096", "qwen3-235b_ep2_bf16_s4.json", 4096, 2, "bf16", "symmetric_memory"),
    (S235, "EP=2 bf16\nT=16384", "qwen3-235b_ep2_bf16_s10.json", 16384, 2, "bf16", "symmetric_memory"),
]
TITLES = {
    S30: "Qwen3-30B-A3B layer (H=2048, I=768, 128 experts, top-8)",
    S235: "Qwen3-235B-A22B layer (H=4096, I=1536, 128 experts, top-8)",
}
STEPS = (("forward_ms", "forward"), ("backward_ms", "backward"), ("f2b1_ms", "2F+1B"))


def speedups(results: Path) -> dict[str, list[tuple[str, list[float]]]]:
    """Per shape: (label, [forward, backward, 2F+1B speed-up]) for each case, in ``CASES`` order."""
    out: dict[str, list[tuple[str, list[float]]]] = {}
    for shape, label, name, tokens, ep, precision, transport in CASES:
        rows = [r for r in json.loads((results / name).read_text())["results"] if r["tokens_per_rank"] == tokens]
        torch_rows = [r for r in rows if r["backend"] == "torch"]
        base = [r for r in torch_rows if r["precision"] == precision] or [
            r for r in torch_rows if r["precision"] == "bf16"
        ]
        ours = [
            r
            for r in rows
            if r["backend"] == "mega_moe"
            and r["precision"] == precision
            and r["ep"] == ep
            and r.get("transport", "") == transport
        ]
        if len(base) != 1 or len(ours) != 1:
            raise SystemExit(f"{name}: expected one torch and one mega_moe row for {label!r}")
        out.setdefault(shape, []).append((label, [base[0][k] / ours[0][k] for k, _ in STEPS]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "speedup.png")
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = speedups(args.results)
    fig, axes = plt.subplots(
        len(data), 1, figsize=(11, 4.2 * len(data)), gridspec_kw={"height_ratios": [1] * len(data)}
    )
    colors = ("#4C72B0", "#DD8452", "#55A868")
    width = 0.26
    for ax, (shape, cases) in zip(axes, data.items()):
        for i, (_, step) in enumerate(STEPS):
            xs = [c + (i - 1) * width for c in range(len(cases))]
            ys = [values[i] for _, values in cases]
            bars = ax.bar(xs, ys, width, label=step, color=colors[i])
            ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=1)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cases)), [label for label, _ in cases], fontsize=8)
        ax.set_ylabel("speed-up over torch (x)")
        ax.set_title(TITLES.get(shape, shape), fontsize=10)
        ax.set_ylim(0, max(max(v) for _, v in cases) * 1.15)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "mega_moe over the torch backend of the same precision in the same run, one call (H200; EP=2: two GPUs, "
        "symmetric memory)",
        fontsize=11,
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
