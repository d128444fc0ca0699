"""scripts/config_sweep.py: its extra candidates are valid and new, and its report ranks what the autotuner timed."""

from __future__ import annotations

from prime_megamoe.kernels import tuning
from tests.scripts import load_script


def _kwargs(configs):
    return [(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in configs]


def test_extra_candidates_fit_the_row_tile_and_are_not_listed_already():
    sweep = load_script("config_sweep")
    gemm, fc1 = sweep.extra_configs()
    assert len(gemm) == len(sweep.EXTRA_GEMM) and len(fc1) == len(sweep.EXTRA_FC1)
    for c in (*gemm, *fc1):
        assert 128 % c.kwargs["BLOCK_M"] == 0  # a program takes a 128-row tile or a part of one
    assert all(c.pre_hook is tuning.gemm_tma_boxes for c in gemm)  # boxes follow the config, as the listed ones
    # none repeats another extra one; the package's own (GPU) lists are built from the same tuples
    assert len(set(_kwargs(gemm))) == len(gemm) and len(set(_kwargs(fc1))) == len(fc1)


def test_report_ranks_each_gemm_and_names_the_best_listed_config():
    sweep = load_script("config_sweep")
    a, b, c = (tuning._cfg(128, n, 64, 8, 3, PERSISTENT=False) for n in (64, 128, 256))
    records = {
        ("grouped_gemm_kernel", (2048, 768, 32768), (("GATHER_A", False),)): [(300.0, a), (250.0, b), (280.0, c)],
        ("fc1_swiglu_kernel", (768, 2048, 32768), (("SAVE_H", True),)): [(400.0, c)],
    }
    lines = sweep.report(records, listed={id(a), id(c)}, top=2)
    assert lines[0] == (
        "grouped_gemm_kernel N,K,rows=(2048, 768, 32768) GATHER_A=0: best listed 280.0 us, best 250.0 us"
    )
    assert lines[1].split()[:2] == ["250.0", "extra"] and lines[2].split()[:2] == ["280.0", "listed"]
    assert len(lines) == 3 + 2  # top 2 of the first GEMM, then the second GEMM's header and its one config
    assert lines[3].endswith("best listed 400.0 us, best 400.0 us")
    assert sweep.report({("k", (1,), ()): [(5.0, a)]}, listed=set())[0].endswith("best listed none timed, best 5.0 us")
