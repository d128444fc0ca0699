"""Tile sizes and autotuning candidates.

Row tiles of the expert-sorted GEMMs have a fixed height (``tile_m()``) because the device-side tile list is built
for it; a config may give each program the whole tile or half of it (BLOCK_M = tile_m() / 2). Autotuning picks that,
the other block sizes, warps and pipeline depth per shape, and the choice is cached on disk (Triton's cache, or
``autotune_cache`` where candidates set their TMA boxes in a pre-launch hook). Under the interpreter (CPU tests) one
small configuration is used for each of the two row tiles plans have there (tests launch the half-tile path
explicitly).
"""

from __future__ import annotations

import triton

from ..env import env_get
from . import autotune_cache


def interpreting() -> bool:
    return env_get("TRITON_INTERPRET", "0") not in ("", "0")


def tile_m() -> int:
    """Row tile of the unquantised layer's routing plans."""
    return 16 if interpreting() else 128


QTILE_M = 128  # row tile of every quantised layer's plan (and so of its bf16 backward) = the wgrad scales' row block


# Problems with fewer multiply-adds than this (M * N * K over the autotuning key) run the first candidate untimed:
# compiling and timing every candidate takes seconds each and would cost more than any choice saves (a tiny model's
# first step would take minutes).
SMALL_PROBLEM = 1 << 30
_SIZE_KEYS = ("M", "N", "K", "M_BUCKET")


def prune_candidates(*dims: str):
    """An ``early_config_prune``: candidates whose BLOCK_M does not divide the launch's row tile (TILE_M) are
    dropped; of the rest only the first is kept when the product of ``dims`` is small, or for every problem when
    PRIME_MEGAMOE_AUTOTUNE=0 (correctness checks: one compiled kernel per shape, nothing timed)."""

    def prune(configs, named_args, **kwargs):
        tile = kwargs.get("TILE_M")
        if tile is not None:
            configs = [c for c in configs if tile % c.kwargs.get("BLOCK_M", 1) == 0]
            if not configs:
                raise ValueError(f"no autotuning candidate has a BLOCK_M that divides the row tile {tile}")
        if env_get("PRIME_MEGAMOE_AUTOTUNE", "1") == "0":
            return configs[:1]
        size = 1
        for name in dims:
            size *= max(int(named_args[name]), 1)
        return configs[:1] if size < SMALL_PROBLEM else configs

    return prune


def autotune(configs: list[triton.Config], key: list[str]):
    """``triton.autotune`` as every kernel of the package uses it: choices cached on disk (also those among
    candidates with pre-launch hooks: ``autotune_cache``), keyed on ``key``, and candidates pruned by
    ``prune_candidates`` (the launch's row tile, and the key's size arguments)."""
    dims = [name for name in key if name in _SIZE_KEYS]
    decorator = triton.autotune(
        configs=configs,
        key=key,
        cache_results=True,
        prune_configs_by={"early_config_prune": prune_candidates(*dims)},
    )
    return lambda fn: autotune_cache.install(decorator(fn))


def _cfg(bm, bn, bk, warps, stages, pre_hook=None, **extra):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_warps=warps, num_stages=stages, pre_hook=pre_hook
    )


def dense_chunk_shape(nargs) -> None:
    """A weight-gradient config's pre-launch hook: the dense operand's tensor descriptor (when the launch has one)
    gets the config's chunk shape, [BLOCK_K rows, the output tile's extent along the dense operand's columns]."""
    desc = nargs["d_desc"]
    if desc is not None:
        desc.block_shape = [nargs["BLOCK_K"], nargs["BLOCK_M"] if nargs["DENSE_A"] else nargs["BLOCK_N"]]


def gemm_tma_boxes(nargs) -> None:
    """A GEMM config's pre-launch hook: the TMA descriptors of the launch (where it has them) get the config's boxes,
    A [BLOCK_M, BLOCK_K] and B [BLOCK_N, BLOCK_K] (K-major, as every B of a kernel without a B_KMAJOR argument is)
    or [BLOCK_K, BLOCK_N]."""
    if nargs.get("a_desc") is not None:
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    if nargs.get("b_desc") is not None:
        bn, bk = nargs["BLOCK_N"], nargs["BLOCK_K"]
        nargs["b_desc"].block_shape = [bn, bk] if nargs.get("B_KMAJOR", True) else [bk, bn]


def autotune_configs(kind: str) -> list[triton.Config]:
    """Candidates for one kernel family; evaluated when the module is imported (TRITON_INTERPRET is read then)."""
    if interpreting():
        extra = {
            "fc1": {"PERSISTENT": True, "ONE_DOT": False},
            "gemm": {"PERSISTENT": True, "pre_hook": gemm_tma_boxes},
            "wgrad": {"GROUP_M": 2, "pre_hook": dense_chunk_shape},
        }
        if kind not in extra:
            raise ValueError(f"unknown kernel family {kind!r}")
        # Wider columns and K steps than 16 cut the interpreter's per-program Python work and still leave ragged
        # column and K edges at the tests' sizes.
        if kind == "wgrad":  # [BLOCK_M, BLOCK_N] blocks of each expert's weight gradient: four times fewer programs
            return [_cfg(32, 64, 32, 1, 1, **extra[kind])]
        # One program a row tile, the unquantised plans' (tile_m()) or the quantised ones' (QTILE_M, whose bf16
        # backward runs these kernels; 16-row programs there were eight a tile, mostly past its expert's rows, and
        # ~7x the time): prune_candidates keeps the first whose BLOCK_M divides the launch's TILE_M.
        return [_cfg(bm, 32, 32, 1, 1, **extra[kind]) for bm in (QTILE_M, tile_m())]
    m = tile_m()
    h = m // 2  # half-tile programs (grouped_gemm.tile_rows): fewer accumulator registers, wider column blocks
    if kind == "fc1":  # gate and up per tile: two accumulators, or one twice as wide (ONE_DOT; at Qwen3-30B-A3B,
        # T = 16384, EP = 2 the persistent ONE_DOT program leads: 0.549 against 0.634 ms a piece, autotuner timings)
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
    if kind == "gemm":  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, persistent)
        tiles = (
            (m, 128, 64, 8, 4, False),
            (m, 256, 64, 8, 3, False),
            (m, 128, 64, 8, 4, True),
            (m, 256, 64, 8, 3, True),
            (m, 64, 64, 4, 5, False),
            (h, 256, 64, 4, 4, False),
        )
        return [_cfg(*t, PERSISTENT=persistent, pre_hook=gemm_tma_boxes) for *t, persistent in tiles]
    if kind == "wgrad":
        # At Qwen3-30B-A3B, T = 16384, an EP=2 rank's rows (scripts/wgrad_probe.py, one H200), with the
        # sorted operand read by TMA: 256 x 128 leads for dW1 and 128 x 256 for dW2 (the sorted operand on the wide
        # side, the gathered one on the narrow), 7-8% ahead of the best pointer-loaded program; the other two are
        # the runners-up. The first fits fp32 operands too (GPU tests run it alone). The two wide tiles also with a
        # fourth stage (196 KB of shared memory, no spills: scripts/register_check.py).
        return [
            _cfg(*t, GROUP_M=8, pre_hook=dense_chunk_shape)
            for t in (
                (128, 128, 64, 8, 3),
                (256, 128, 64, 8, 3),
                (128, 256, 64, 8, 3),
                (128, 128, 32, 4, 4),
                (256, 128, 64, 8, 4),
                (128, 256, 64, 8, 4),
            )
        ]
    raise ValueError(f"unknown kernel family {kind!r}")
