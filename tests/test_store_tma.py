"""Output blocks stored by TMA (``STORE_TMA`` candidates of the FC1 and grouped-GEMM kernels): a block whose rows are
all its expert's (and, in FC1, whose columns end by I) is stored through a TMA descriptor, any other by pointer.
Runs wherever the suite runs: the interpreter's emulated descriptors on CPU, compiled kernels on a GPU (bitwise)."""

from __future__ import annotations

import pytest
import torch

from prime_megamoe.kernels import tuning
from prime_megamoe.kernels.grouped_gemm import fc1_swiglu_kernel, grouped_gemm_kernel
from prime_megamoe.ops.launch import fc1_swiglu, grouped_gemm
from prime_megamoe.ops.routing_plan import build_routing_plan

from .oracle import only_config, rel_err


def _ragged_ids(rows, k, num_local, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_local, generator=gen)[:k] for _ in range(rows)])
    ids[ids == 2] = 0  # expert 2 gets nothing, expert 0 most
    return ids, torch.rand(rows, k, generator=gen)


@pytest.mark.parametrize("persistent", [False, True])
def test_tma_stores_match_pointer_stores(monkeypatch, persistent):
    # The outputs must be what pointer stores give, with no row of a neighbouring expert or column of the up half
    # written over. Ragged routing: an expert with no rows, one with most (whole blocks and a partial one), I not a
    # multiple of the column block; h saved and not. A STORE_TMA config launched without descriptors (as the
    # autotuner's cached choice may be) stores by pointer.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = tuning.tile_m()
    rows, k, num_local = 5 * m // 2, 2, 4
    hidden, inter = (40, 40) if device == "cpu" else (128, 96)  # GPU: blocks of 64 columns, the last one partial
    ids, weights = _ragged_ids(rows, k, num_local, seed=11)
    plan = build_routing_plan(ids, weights, expert_base=0, num_local_experts=num_local, tile_m=m)
    sizes = (plan.expert_offsets[1:] - plan.expert_offsets[:-1]).tolist()
    assert sizes[2] == 0 and sizes[0] > 2 * m and any(s % m for s in sizes)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(rows, hidden, generator=gen)
    w1 = torch.randn(num_local, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_local, hidden, inter, generator=gen) / inter**0.5
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, w1, w2 = (t.to(device, dtype) for t in (x, w1, w2))
    plan = build_routing_plan(ids.to(device), weights.to(device), expert_base=0, num_local_experts=num_local, tile_m=m)
    # GPU: column blocks of 64 keep the stores' buffers within shared memory beside the pipeline's
    blocks = {} if device == "cpu" else {"BLOCK_N": 64}
    got = {}
    for config_tma, descriptors in ((False, False), (True, True), (True, False)):
        only_config(monkeypatch, grouped_gemm_kernel, PERSISTENT=persistent, STORE_TMA=config_tma, **blocks)
        only_config(
            monkeypatch,
            fc1_swiglu_kernel,
            pre_hook=tuning.fc1_store_boxes,
            PERSISTENT=persistent,
            STORE_TMA=config_tma,
            **blocks,
        )
        h = torch.full((plan.sorted_rows, 2 * inter), float("nan"), device=device, dtype=dtype)
        a = torch.full((plan.sorted_rows, inter), float("nan"), device=device, dtype=dtype)
        fc1_swiglu(x, w1, plan, True, out=(h, a), store_tma=descriptors)
        _, a_only = fc1_swiglu(x, w1, plan, False, store_tma=descriptors)
        y = grouped_gemm(a, w2, plan, transpose_b=True, row_scale=plan.row_weight, store_tma=descriptors)
        got[config_tma, descriptors] = (h, a, a_only, y)
    used = plan.num_pairs
    for run in ((True, True), (True, False)):
        for name, want, have in zip(("h", "a", "a without h", "fc2"), got[False, False], got[run]):
            if device == "cuda":
                assert torch.equal(have[:used], want[:used]), f"{name}, {run}"
            else:  # the interpreter's dots go through the host's BLAS (tests/test_tile_blocks.py, _HOST_BLAS)
                torch.testing.assert_close(have[:used], want[:used], rtol=1e-5, atol=1e-5, msg=f"{name}, {run}")
    h, a = got[True, True][0][:used].double().cpu(), got[True, True][1][:used].double().cpu()
    src, off = plan.row_src.long().cpu(), plan.expert_offsets.tolist()
    tol = 1e-6 if device == "cpu" else 1e-2
    for e in range(num_local):
        lo, hi = off[e], off[e + 1]
        assert rel_err(h[lo:hi], x[src[lo:hi]].double().cpu() @ w1[e].double().cpu().T) < tol
    g, u = h[:, :inter], h[:, inter:]
    assert rel_err(a, torch.nn.functional.silu(g) * u) < tol
