"""Tile sizes and autotuning candidates.

Row tiles of the expert-sorted GEMMs have a fixed height (``tile_m()``) because the device-side tile list is built
for it; a config may give each program the whole tile or half of it (BLOCK_M = tile_m() / 2). Autotuning picks that,
the other block sizes, warps and pipeline depth per shape, and Triton caches the choice on disk. Under the
interpreter (CPU tests) one small configuration is used (tests launch the half-tile path explicitly).
"""

from __future__ import annotations

import os

import triton

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tile_m() -> int:
    return 16 if interpreting() else 128


# Problems with fewer multiply-adds than this (M * N * K over the autotuning key) run the first candidate untimed:
# compiling and timing every candidate takes seconds each and would cost more than any choice saves (a tiny model's
# first step would take minutes).
SMALL_PROBLEM = 1 << 30
_SIZE_KEYS = ("M", "N", "K", "M_BUCKET")


def prune_small_problems(*dims: str):
    """An ``early_config_prune`` keeping only the first candidate when the product of ``dims`` is small, or for every
    problem when PRIME_MEGAMOE_AUTOTUNE=0 (correctness checks: one compiled kernel per shape, nothing timed)."""

    def prune(configs, named_args, **kwargs):
        if os.environ.get("PRIME_MEGAMOE_AUTOTUNE", "1") == "0":
            return configs[:1]
        size = 1
        for name in dims:
            size *= max(int(named_args[name]), 1)
        return configs[:1] if size < SMALL_PROBLEM else configs

    return prune


def autotune(configs: list[triton.Config], key: list[str]):
    """``triton.autotune`` as every kernel of the package uses it: choices cached on disk, keyed on ``key``, and
    candidates pruned by ``prune_small_problems`` over the key's size arguments."""
    dims = [name for name in key if name in _SIZE_KEYS]
    return triton.autotune(configs=configs, key=key, cache_results=True,
                           prune_configs_by={"early_config_prune": prune_small_problems(*dims)})


def _cfg(bm, bn, bk, warps, stages, **extra):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_warps=warps, num_stages=stages)


def autotune_configs(kind: str) -> list[triton.Config]:
    """Candidates for one kernel family; evaluated when the module is imported (TRITON_INTERPRET is read then)."""
    if interpreting():
        extra = {"GROUP_M": 2} if kind == "wgrad" else {"PERSISTENT": True}
        if kind == "fc1":
            extra["ONE_DOT"] = False
        return [_cfg(16, 16, 16, 1, 1, **extra)]
    m = tile_m()
    h = m // 2  # half-tile programs (grouped_gemm.tile_rows): fewer accumulator registers, wider column blocks
    if kind == "fc1":  # gate and up per tile: two accumulators, or one twice as wide (ONE_DOT; at Qwen3-30B-A3B,
        # T = 16384, EP = 2 the persistent ONE_DOT program leads: 0.549 against 0.634 ms a piece, BENCHMARKS.md)
        return [
            _cfg(m, 128, 64, 8, 3, PERSISTENT=False, ONE_DOT=False),
            _cfg(m, 128, 64, 8, 3, PERSISTENT=True, ONE_DOT=False),
            _cfg(m, 128, 64, 8, 4, PERSISTENT=True, ONE_DOT=False),
            _cfg(m, 64, 64, 8, 4, PERSISTENT=False, ONE_DOT=False),
            _cfg(h, 256, 64, 8, 3, PERSISTENT=False, ONE_DOT=False),
            _cfg(h, 128, 64, 4, 4, PERSISTENT=False, ONE_DOT=False),
            _cfg(m, 128, 64, 8, 3, PERSISTENT=False, ONE_DOT=True),
            _cfg(m, 128, 64, 8, 4, PERSISTENT=False, ONE_DOT=True),
            _cfg(m, 128, 64, 8, 3, PERSISTENT=True, ONE_DOT=True),
            _cfg(m, 128, 64, 8, 4, PERSISTENT=True, ONE_DOT=True),
            _cfg(m, 64, 64, 8, 4, PERSISTENT=False, ONE_DOT=True),
            _cfg(h, 128, 64, 4, 4, PERSISTENT=False, ONE_DOT=True),
        ]
    if kind == "gemm":
        return [
            _cfg(m, 128, 64, 8, 4, PERSISTENT=False),
            _cfg(m, 256, 64, 8, 3, PERSISTENT=False),
            _cfg(m, 128, 64, 8, 4, PERSISTENT=True),
            _cfg(m, 256, 64, 8, 3, PERSISTENT=True),
            _cfg(m, 64, 64, 4, 5, PERSISTENT=False),
            _cfg(h, 256, 64, 4, 4, PERSISTENT=False),
        ]
    if kind == "wgrad":
        # At Qwen3-30B-A3B, T = 16384, 128 x 128 x 64 leads (scripts/wgrad_probe.py; a persistent variant and one
        # loop over all segments' rows were 10-40% slower); the wider tiles stay for the larger shapes.
        return [
            _cfg(128, 128, 64, 8, 3, GROUP_M=8),
            _cfg(128, 128, 32, 4, 4, GROUP_M=8),
            _cfg(128, 256, 64, 8, 4, GROUP_M=8),
            _cfg(256, 128, 64, 8, 3, GROUP_M=8),
            _cfg(128, 256, 32, 8, 4, GROUP_M=8),
        ]
    raise ValueError(f"unknown kernel family {kind!r}")
