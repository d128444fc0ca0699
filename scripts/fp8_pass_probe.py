"""Usage: python scripts/fp8_pass_probe.py [--shape qwen3-30b-a3b] [--tokens 16384]

The fp8 backward's memory-bound passes, each in several block shapes and warp counts, checked and timed at a layer's
shape (one GPU, EP = 1). The passes: the quantising SwiGLU backward's row outputs (``dswiglu_rows``) and column
outputs (``dswiglu_cols_t``: the Triton launch, and on a GPU its Gluon form, compared with the Triton launch), and the
x^T gather-quantise pass (``quantize_sorted_cols_t``: the same two forms). Each config's outputs are compared bitwise
with the default config's (a block shape changes no sum: same bits expected) and its time turned into GB/s of bytes
read and written. The table ends with the best config per pass.

Timing: CUDA events around back-to-back launches of the pass alone (as the layer issues them; no L2 flush between
them), outputs allocated by the launcher as in the layer.
"""

from __future__ import annotations

import argparse

import torch
from fp8_probe import snapshot  # (scripts/ is on sys.path when run as a script)

from prime_megamoe.bench import make_inputs
from prime_megamoe.kernels import fp8_gemm
from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.routing_plan import build_routing_plan

# (BLOCK_R, BLOCK_C, warps) of the SwiGLU pass's two launches; (columns, warps) of the gather-quantise pass.
ROWS_CONFIGS = [(16, 128, 4), (16, 128, 2), (32, 128, 4), (32, 128, 8), (8, 128, 2)]
COLS_CONFIGS = [
    (128, 64, 4),
    (128, 64, 8),
    (128, 64, 16),
    (128, 32, 4),
    (128, 32, 8),
    (128, 16, 4),
    (128, 16, 2),
    (128, 8, 4),
    (128, 128, 16),
]
GATHER_CONFIGS = [(64, 4), (64, 8), (32, 4), (32, 2), (16, 4), (128, 8), (128, 16)]
# (BC, CPT, warps) of the column pass's Gluon form (kernels/swiglu_grad_cols.py), compared with the Triton launch.
GLUON_COLS_CONFIGS = [(16, 1, 4), (32, 2, 4), (64, 2, 8), (16, 2, 2), (32, 4, 2)]
# (RB, warps) of the one-pass kernel (kernels/swiglu_grad_fused.py), compared with the two launches.
FUSED_CONFIGS = [(32, 8), (32, 16)]
# (BC, CPT, warps) of the gather pass's Gluon form (kernels/gather_cols_t.py), compared with the Triton launch.
GLUON_GATHER_CONFIGS = [(32, 4, 2), (16, 2, 2), (32, 2, 4), (64, 4, 4), (64, 8, 2), (16, 4, 1)]


def time_ms(fn, iters: int = 20) -> float:
    """Mean GPU time of ``fn`` over ``iters`` back-to-back calls (CUDA events), after three warm-up calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument(
        "--device",
        default="cuda",
        help="cpu: a smoke run of the script itself (TRITON_INTERPRET=1; with --shape tiny --tokens 64)",
    )
    args = p.parse_args()
    bench = time_ms if args.device == "cuda" else (lambda fn: (fn(), 1.0)[1])  # no timing on the CPU
    x, index, weights, w1, w2 = make_inputs(args.shape, args.tokens, 0, 1, seed=0, device=args.device)
    num_experts, hidden, inter = w2.shape
    fmt = fl.fp8_format()
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=num_experts, tile_m=fp8_gemm.QTILE_M)
    xq, dyq = fl.quantize_rows(x, fmt), fl.quantize_rows(torch.randn_like(x), fmt)
    h, _ = fl.fp8_fc1_swiglu(xq, fl.quantize_w1_fwd(w1, fmt), plan, fmt, inter=inter, h_dtype=x.dtype)
    g_a = fl.fp8_fc2_dgrad(dyq, fl.quantize_w2_bwd(w2, fmt), plan, fmt, x.dtype)
    # Tile-space columns (and their scale rows) past the device-side tile count are never written: compared up to it.
    written = int(plan.num_tiles[0]) * fp8_gemm.QTILE_M

    def cols_t(*operands):
        return [t for q in operands for t in snapshot(fl.QTensor(q.data[:, :written], q.scale[: written // fmt.group]))]

    def cols_triton():
        return fl.dswiglu_cols_t(g_a, h, plan, fmt, gluon=False)

    def cols_gluon():
        return fl.dswiglu_cols_t(g_a, h, plan, fmt, gluon=True)

    def gather_triton():
        return fl.quantize_sorted_cols_t(x, plan, fmt, gluon=False)

    # (pass, knob, configs, launch (timed), its outputs as compared copies, bytes read, the reference launch: the
    # first config's where None). The column pass's Gluon form is compared with the Triton launch.
    cases = [
        (
            "SwiGLU rows",
            "DSWIGLU_ROWS_BLOCK",
            ROWS_CONFIGS,
            lambda: fl.dswiglu_rows(g_a, h, plan, fmt),
            snapshot,
            nbytes([g_a, h]),
            None,
        ),
        (
            "SwiGLU cols",
            "DSWIGLU_COLS_BLOCK",
            COLS_CONFIGS,
            cols_triton,
            lambda out: cols_t(*out),
            nbytes([g_a, h]),
            None,
        ),
        ("x^T gather", "GATHER_COLS_T_BLOCK", GATHER_CONFIGS, gather_triton, cols_t, plan.num_pairs * hidden * 2, None),
    ]
    if fl.gluon_gather_unavailable(x, fmt) is None:
        cases.append(
            (
                "gather Gluon",
                "GATHER_COLS_T_GLUON_BLOCK",
                GLUON_GATHER_CONFIGS,
                lambda: fl.quantize_sorted_cols_t(x, plan, fmt, gluon=True),
                cols_t,
                plan.num_pairs * hidden * 2,
                gather_triton,
            )
        )
    if fl.gluon_cols_unavailable(g_a, h, fmt) is None:
        cases.insert(
            2,
            (
                "cols Gluon",
                "DSWIGLU_COLS_GLUON_BLOCK",
                GLUON_COLS_CONFIGS,
                cols_gluon,
                lambda out: cols_t(*out),
                nbytes([g_a, h]),
                cols_triton,
            ),
        )
    print(f"{args.shape}, T = {args.tokens}, {plan.num_pairs} rows, H = {hidden}, I = {inter}")
    print(f"{'pass':12s} {'config':14s} {'ms':>7s} {'GB/s':>6s} same")
    best = {}
    for name, knob, configs, run, outputs, read, reference in cases:
        default = getattr(fl, knob)
        ref = outputs((reference or run)())
        written_bytes = nbytes(ref)
        for cfg in configs:
            setattr(fl, knob, cfg)
            try:
                out = outputs(run())
                ms = bench(run)
            except Exception as exc:  # a config that does not compile: say so, go on
                print(f"{name:12s} {str(cfg):14s} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            same = all(torch.equal(a, b) for a, b in zip(out, ref))
            print(f"{name:12s} {str(cfg):14s} {ms:7.3f} {(read + written_bytes) / ms / 1e6:6.0f} {same}")
            if same and ms < best.get(name, (1e9, None))[0]:
                best[name] = (ms, cfg)
        setattr(fl, knob, default)
    # The one-pass Gluon kernel against the two launches (each as the layer runs it), same inputs.
    if fl.fused_dswiglu_unavailable(g_a, h, fmt) is None:
        two = lambda: fl.fp8_dswiglu(g_a, h, plan, fmt, fused=False)  # noqa: E731
        one = lambda: fl.fp8_dswiglu(g_a, h, plan, fmt, fused=True)  # noqa: E731
        default, ref = fl.DSWIGLU_FUSED_BLOCK, None
        for label, run, cfg in [("two launches", two, default)] + [(f"one pass {c}", one, c) for c in FUSED_CONFIGS]:
            fl.DSWIGLU_FUSED_BLOCK = cfg
            d = run()
            out = snapshot([d.dh_rows]) + cols_t(d.dh_t, d.aw_t)
            ms = bench(run)
            ref = ref or out
            same = all(torch.equal(a, b) for a, b in zip(out, ref))
            print(f"{'SwiGLU bwd':12s} {label:14s} {ms:7.3f} {(nbytes([g_a, h]) + nbytes(out)) / ms / 1e6:6.0f} {same}")
        fl.DSWIGLU_FUSED_BLOCK = default
    print("\nbest per pass (ms):")
    for name, (ms, cfg) in best.items():
        print(f"  {name:12s} {ms:7.3f}  {cfg}")


if __name__ == "__main__":
    main()
