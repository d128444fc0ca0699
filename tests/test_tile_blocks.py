"""Half-tile programs of the tile-list kernels (``grouped_gemm.tile_rows``): a config may give each program BLOCK_M
rows, half a routing tile. Runs wherever the suite runs (interpreter on CPU, compiled kernels on a GPU), without the
property-testing dependency, so a GPU machine can run it as it is."""

from __future__ import annotations

import torch

from prime_megamoe.kernels import tuning
from prime_megamoe.kernels.grouped_gemm import fc1_swiglu_kernel, grouped_gemm_kernel

from .oracle import NAMES, make_problem, only_config, run_mega_moe


def test_half_tile_programs_compute_the_same(monkeypatch):
    # Configs may give a program BLOCK_M = half a routing tile (two programs a tile): the layer's output and every
    # gradient must be bitwise what whole-tile programs give, with ragged routing (tiles end mid-way, an expert
    # has no rows).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, index, weights, w1, w2, g = make_problem(45, 32, 16, 4, 2, torch.float32, seed=3, routing="ragged",
                                                device=device)
    whole = run_mega_moe(x, index, weights, w1, w2, g)
    half = tuning.tile_m() // 2
    for persistent in (False, True):
        for kernel in (fc1_swiglu_kernel, grouped_gemm_kernel):
            only_config(monkeypatch, kernel, BLOCK_M=half, PERSISTENT=persistent)
        parts = run_mega_moe(x, index, weights, w1, w2, g)
        for name, a, b in zip(NAMES, whole, parts):
            assert torch.equal(a, b), f"{name} differs with {half}-row programs (persistent={persistent})"
