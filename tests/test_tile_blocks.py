"""Half-tile programs of the tile-list kernels (``grouped_gemm.tile_rows``): a config may give each program BLOCK_M
rows, half a routing tile. Runs wherever the suite runs (interpreter on CPU, compiled kernels on a GPU), without the
property-testing dependency, so a GPU machine can run it as it is."""

from __future__ import annotations

import torch

from prime_megamoe.kernels import tuning
from prime_megamoe.kernels.grouped_gemm import fc1_swiglu_kernel, grouped_gemm_kernel

from .oracle import NAMES, make_problem, only_config, rel_err, run_mega_moe

# _HOST_BLAS: under the interpreter (CPU) tl.dot runs on the host's BLAS, whose summation order may depend on the
# block's rows: on some CPUs whole and half tiles then differ in the last bits (relative error ~1e-7). The GPU
# kernels are checked bitwise.


def test_half_tile_programs_compute_the_same(monkeypatch):
    # Configs may give a program BLOCK_M = half a routing tile (two programs a tile): the layer's output and every
    # gradient must be bitwise what whole-tile programs give, with ragged routing (tiles end mid-way, an expert
    # has no rows).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, index, weights, w1, w2, g = make_problem(
        45, 32, 16, 4, 2, torch.float32, seed=3, routing="ragged", device=device
    )
    whole = run_mega_moe(x, index, weights, w1, w2, g)
    half = tuning.tile_m() // 2
    for persistent in (False, True):
        for kernel in (fc1_swiglu_kernel, grouped_gemm_kernel):
            only_config(monkeypatch, kernel, BLOCK_M=half, PERSISTENT=persistent)
        parts = run_mega_moe(x, index, weights, w1, w2, g)
        for name, a, b in zip(NAMES, whole, parts):
            if device == "cuda":
                assert torch.equal(a, b), f"{name} differs with {half}-row programs (persistent={persistent})"
            else:  # the interpreter's dots go through the host's BLAS (see _HOST_BLAS)
                assert rel_err(a, b) < 1e-6, f"{name} differs with {half}-row programs (persistent={persistent})"


def test_fc1_gate_and_up_in_one_dot_compute_the_same(monkeypatch):
    # FC1 configs may compute gate and up as one MMA over interleaved weight rows (ONE_DOT) and split the
    # accumulator: the layer's output and gradients must match the two-accumulator programs, whole and half tiles,
    # with ragged routing and a column count that is not a multiple of the block (I = 24, blocks of 16).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, index, weights, w1, w2, g = make_problem(
        45, 32, 24, 4, 2, torch.float32, seed=4, routing="ragged", device=device
    )
    two = run_mega_moe(x, index, weights, w1, w2, g)
    for block_m in (tuning.tile_m(), tuning.tile_m() // 2):
        only_config(monkeypatch, fc1_swiglu_kernel, BLOCK_M=block_m, ONE_DOT=True)
        one = run_mega_moe(x, index, weights, w1, w2, g)
        for name, a, b in zip(NAMES, two, one):
            if device == "cuda":
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"{name} with ONE_DOT, BLOCK_M={block_m}")
            else:  # (see _HOST_BLAS)
                assert rel_err(a, b) < 1e-6, f"{name} with ONE_DOT, BLOCK_M={block_m}"
