"""The SwiGLU backward as a row pass after the FC2 dgrad GEMM (bf16 / fp32 path).

For each expert-sorted row r with routing weight w and saved FC1 output h = [g | u]:

    g_a = dy[src] @ W2[e]                        (the GEMM before this pass: the gradient reaching a = silu(g) * u)
    dw[r] = <g_a, a>                             (the top-k weight gradient of the pair; no stored FC2 output)
    da = w * g_a;  dh = [da * u * silu'(g) | da * silu(g)];  aw = w * a   (aw feeds the FC2 weight gradient)

Why not in the GEMM's epilogue: loading h and writing three outputs next to the accumulators needed more registers
than a Hopper thread has (ptxas spilled in every candidate config). This pass streams g_a and h once; the GEMM keeps
a plain epilogue.

Rows are walked through the routing plan's tile list, so a segment's pass touches only its rows. Each row's dw is
summed over its columns in a fixed order (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .grouped_gemm import tile_rows


@triton.jit
def swiglu_backward_rows_kernel(
    ga_ptr, h_ptr, row_weight_ptr, dh_ptr, aw_ptr, dw_ptr,
    tile_expert_ptr, tile_row_ptr, num_tiles_ptr, expert_offsets_ptr,
    N, stride_gam, stride_hm, stride_dhm, stride_awm,
    TILE_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program per BLOCK_R rows of a routing tile (programs past the device-side tile count return)."""
    pid = tl.program_id(0)
    if pid < tl.load(num_tiles_ptr) * (TILE_M // BLOCK_R):
        _, rows, row_mask = tile_rows(tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, pid, BLOCK_R, TILE_M)
        rows64 = rows.to(tl.int64)
        w = tl.load(row_weight_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, N, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < N)[None, :]
            ga = tl.load(ga_ptr + rows64[:, None] * stride_gam + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
            g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(h_ptrs + N, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            silu = g * sig
            act = silu * u
            dw += tl.sum(ga * act, axis=1)
            da = ga * w
            dh_ptrs = dh_ptr + rows64[:, None] * stride_dhm + cols[None, :]
            tl.store(dh_ptrs, (da * u * (sig + silu * (1.0 - sig))).to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(dh_ptrs + N, (da * silu).to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(aw_ptr + rows64[:, None] * stride_awm + cols[None, :], (act * w).to(aw_ptr.dtype.element_ty),
                     mask=mask)
        tl.store(dw_ptr + rows, dw, mask=row_mask)
