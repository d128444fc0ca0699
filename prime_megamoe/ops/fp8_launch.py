"""Host-side launchers for the quantisation kernels and the fp8 / MXFP8 grouped GEMMs: layouts, grids, strides.

Formats (``QFormat``): ``fp8`` = e4m3 with fp32 scales, activations 1x128, weights 128x128 (optionally power-of-two
scales); ``mx`` = e4m3 with e8m0 scales (uint8), 1x32 blocks along the reduction dim of every GEMM operand.

A quantised GEMM operand is a ``QTensor`` (values in ``torch.float8_e4m3fn`` and scales). Layout conventions:

- rows (activations, reduction along the last dim): ``data [R, K]``, ``scale [R, n_groups]`` (two-segment rows such
  as ``[gate | up]`` keep one group range per segment: ``[R, 2 * cdiv(I, G)]``);
- weights, stored K-major for the GEMM that uses them: ``data [E, N, K]``, ``scale [E, n_blocks(N), n_groups(K)]``
  with 128-row blocks for fp8 and one row per block for mx; a dim made of gate and up halves is blocked per half;
- column-scaled activations (the wgrad operands, reduction along the sorted rows), "cols_t": stored transposed and
  K-major in tile space, ``data [N, max_tiles * 128]`` (row j of the plan's row tile t at column ``128 t + j``,
  zeros past the end of the tile's expert), ``scale [max_tiles * (128 // G_rows), N]``: one scale per column for
  every G_rows-row block of every row tile (see ``kernels/quantize.py``).

The GEMM launchers read operands through TMA tensor descriptors where the GPU has TMA (``launch.tma_readable``) and
``use_tma`` does not say otherwise; the interpreter emulates descriptors, so CPU tests can run either path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import tuning
from ..kernels.fp8_gemm import QTILE_M, fp8_fc1_swiglu_kernel, fp8_grouped_gemm_kernel, fp8_grouped_wgrad_kernel
from ..kernels.quantize import dequantize_blocks_kernel, gather_quantize_cols_t_kernel, quantize_blocks_kernel
from ..kernels.routing import expert_tile_list_kernel
from ..kernels.swiglu_grad import swiglu_backward_quantize_kernel
from .activation import clamp_kernel_args
from .compiled_launch import launch
from .fp8_ws_launch import (
    fp8_fc1_swiglu_ws,
    fp8_grouped_gemm_ws,
    fp8_grouped_wgrad_ws,
    gluon_device_unavailable,
    ws_fc1_unavailable,
    ws_gemm_unavailable,
    ws_wgrad_unavailable,
)
from .launch import _num_sms, use_form
from .qtensor import FP8_DTYPE, MX_FORMAT, QFormat, QTensor, fp8_format
from .routing_plan import RoutingPlan, RowQuantization
from .sizes import cdiv, next_power_of_2
from .tma import tma_descriptor, tma_readable

# The quantising SwiGLU backward pass in two launches: the row-scaled outputs from 32 x 128 blocks (4 warps), then the
# column-scaled ones from 128 x 16 blocks (2 warps). One launch over 128 x 128 blocks (8 warps) holds too many fp32
# tiles at once (0.767 against 0.664 ms for two, scripts/fp8_probe.py). Block shapes and warps timed alone at
# Qwen3-30B-A3B, T = 16384 (scripts/fp8_pass_probe.py, one H200): rows 0.211 ms against 0.219 for
# 16 x 128; columns 0.434 against 0.460 for 128 x 64 with 4 warps (which takes 255 registers a thread, 12% occupancy,
# yet no config reached 2.2 TB/s: the column pass's time is its instructions, not its occupancy).
DSWIGLU_ROWS_BLOCK = (32, 128, 4)  # (BLOCK_R, BLOCK_C, num_warps)
DSWIGLU_COLS_BLOCK = (QTILE_M, 16, 2)
if tuning.interpreting():  # CPU tests: a whole tile a program and wider columns (the interpreter's cost is per program)
    DSWIGLU_ROWS_BLOCK, DSWIGLU_COLS_BLOCK = (QTILE_M, 128, 4), (QTILE_M, 64, 2)
# The column launch's Gluon form (kernels/swiglu_grad_cols.py), the layer's on GPUs: BC columns, CPT columns a
# thread, num_warps. 0.318 ms against 0.439 for the Triton launch's best blocks and 0.342 for (16, 1, 4), the same
# bits (Qwen3-30B-A3B, T = 16384, one H200, scripts/fp8_pass_probe.py).
DSWIGLU_COLS_GLUON_BLOCK = (32, 2, 4)
# The one-pass form (kernels/swiglu_grad_fused.py): RB-row chunks of a 128-row tile, num_warps of its persistent
# programs (one an SM).
DSWIGLU_FUSED_BLOCK = (32, 8)
# The x^T / dy^T gather-quantise pass: a 128-row tile x GATHER_COLS_T_BLOCK[0] columns per program, [1] warps (0.241
# against 0.245 ms for 64 columns, 4 warps; scripts/fp8_pass_probe.py).
GATHER_COLS_T_BLOCK = (128, 2) if tuning.interpreting() else (32, 2)
# Its Gluon form (kernels/gather_cols_t.py), the layer's on GPUs: BC columns a program, CPT columns a thread (one
# 16-byte load), num_warps. 0.218 ms against 0.242 for the Triton launch's best blocks and 0.226-0.261 for the other
# shapes tried, the same bits (Qwen3-30B-A3B, T = 16384, one H200, scripts/fp8_pass_probe.py).
GATHER_COLS_T_GLUON_BLOCK = (64, 8, 2)


def _4d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def _quant_tile(qm: int, qk: int) -> tuple[int, int]:
    """Tile of one quantiser program: whole blocks, about 8K elements."""
    return max(qm, 64), max(qk, 128)


def quantize_view(
    src: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], *, pow2: bool, e8m0: bool
) -> None:
    """Quantise the (up to 4-D, any strides) view ``src`` [.., M, K] in blocks of block = (QM, QK) on its last two
    dims into the views ``q`` (same shape) and ``s`` [.., cdiv(M, QM), cdiv(K, QK)]."""
    src, q, s = _4d(src), _4d(q), _4d(s)
    b1, b2, m, k = src.shape
    qm, qk = block
    if src.numel() == 0:
        return
    bm, bk = _quant_tile(qm, qk)
    grid = (b1 * b2, cdiv(m, bm), cdiv(k, bk))
    launch(
        quantize_blocks_kernel,
        grid,
        src,
        q,
        s,
        b2,
        m,
        k,
        *src.stride(),
        *q.stride(),
        *s.stride(),
        QM=qm,
        QK=qk,
        BM=bm,
        BK=bk,
        POW2=pow2,
        E8M0=e8m0,
        num_warps=4,
    )


def dequantize_view(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor, block: tuple[int, int], *, e8m0: bool) -> None:
    """Inverse of ``quantize_view``: out = q * (scale of its block)."""
    q, s, out = _4d(q), _4d(s), _4d(out)
    b1, b2, m, k = q.shape
    qm, qk = block
    if q.numel() == 0:
        return
    bm, bk = _quant_tile(qm, qk)
    grid = (b1 * b2, cdiv(m, bm), cdiv(k, bk))
    launch(
        dequantize_blocks_kernel,
        grid,
        q,
        s,
        out,
        b2,
        m,
        k,
        *q.stride(),
        *s.stride(),
        *out.stride(),
        QM=qm,
        QK=qk,
        BM=bm,
        BK=bk,
        E8M0=e8m0,
        num_warps=4,
    )


# ----------------------------------------------------------------------------------------------------------------
# Public quantise / dequantise helpers
# ----------------------------------------------------------------------------------------------------------------
def quantize_rows(x: torch.Tensor, fmt: QFormat, *, segments: int = 1, out: QTensor | None = None) -> QTensor:
    """x [R, K] -> fp8 [R, K] with one scale per row and ``fmt.group`` columns (per segment when the last dim is
    ``segments`` equal parts): scale [R, segments * cdiv(K / segments, group)]; into ``out`` (row-contiguous views of
    those shapes) when given."""
    rows, k = x.shape
    seg = k // segments
    ng = cdiv(seg, fmt.group)
    if out is None:
        q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(rows, segments * ng, dtype=fmt.scale_dtype, device=x.device)
    else:
        q, s = out.data, out.scale
    quantize_view(
        x.unflatten(1, (segments, seg)).transpose(0, 1),
        q.view(rows, segments, seg).transpose(0, 1),
        s.view(rows, segments, ng).transpose(0, 1),
        (1, fmt.group),
        pow2=fmt.pow2,
        e8m0=fmt.mx,
    )
    return QTensor(q, s)


def row_quantization(x: torch.Tensor, fmt: QFormat, out: QTensor | None = None) -> tuple[QTensor, RowQuantization]:
    """``quantize_rows(x, fmt)``'s output, not yet written, and the request that has the routing plan's first launch
    write it (``routing_plan.RowQuantization``: same tiles, same bits): the quantised forward's x, with one launch
    fewer on the host's path to its first GEMM. x [R, K] with contiguous rows; ``out``: where to write (row-contiguous
    views: an exchange's own block)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(
            f"row_quantization: x must be [R, K] with contiguous rows, got shape {list(x.shape)}, "
            f"strides {list(x.stride())}"
        )
    rows, k = x.shape
    if out is None:
        q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(rows, cdiv(k, fmt.group), dtype=fmt.scale_dtype, device=x.device)
    else:
        q, s = out.data, out.scale
    block_rows, block_cols = _quant_tile(1, fmt.group)
    return QTensor(q, s), RowQuantization(x, q, s, fmt.group, block_rows, block_cols, fmt.pow2, fmt.mx)


def dequantize_rows(qt: QTensor, fmt: QFormat, dtype=torch.float32, *, segments: int = 1) -> torch.Tensor:
    rows, k = qt.data.shape
    seg = k // segments
    ng = qt.scale.shape[1] // segments
    out = torch.empty(rows, k, dtype=dtype, device=qt.data.device)
    dequantize_view(
        qt.data.view(rows, segments, seg).transpose(0, 1),
        qt.scale.view(rows, segments, ng).transpose(0, 1),
        out.view(rows, segments, seg).transpose(0, 1),
        (1, fmt.group),
        e8m0=fmt.mx,
    )
    return out


def _weight_views(w: torch.Tensor, fmt: QFormat, *, n_halves: int, k_halves: int, transpose: bool):
    """Views for quantising weight ``w`` [E, A, B] into the K-major operand [E, N, K] where (N, K) = (A, B), or
    (B, A) with ``transpose``; the N dim is split into ``n_halves`` and the K dim into ``k_halves`` blocked parts."""
    e = w.shape[0]
    src = w.transpose(1, 2) if transpose else w  # [E, N, K] (a strided view when transposed)
    n, k = src.shape[1], src.shape[2]
    halves = max(n_halves, k_halves)
    n_part, k_part = n // n_halves, k // k_halves
    rows_blk = fmt.weight_rows
    nb, kg = cdiv(n_part, rows_blk), cdiv(k_part, fmt.group)
    q = torch.empty(e, n, k, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(e, n_halves * nb, k_halves * kg, dtype=fmt.scale_dtype, device=w.device)
    if n_halves == 2:  # [E, 2, n_part, K]
        views = (src.unflatten(1, (2, n_part)), q.view(e, 2, n_part, k), s.view(e, 2, nb, kg))
    elif k_halves == 2:  # [E, 2, N, k_part]
        views = (
            src.unflatten(2, (2, k_part)).transpose(1, 2),
            q.view(e, n, 2, k_part).transpose(1, 2),
            s.view(e, nb, 2, kg).transpose(1, 2),
        )
    else:
        views = (src.unsqueeze(1), q.unsqueeze(1), s.unsqueeze(1))
    assert halves in (1, 2)
    return q, s, views


def quantize_weight(
    w: torch.Tensor, fmt: QFormat, *, n_halves: int = 1, k_halves: int = 1, transpose: bool = False
) -> QTensor:
    """Weight [E, A, B] -> K-major fp8 operand [E, N, K] ((N, K) = (A, B), or (B, A) with ``transpose``) with scales
    [E, n_halves * cdiv(N / n_halves, weight_rows), k_halves * cdiv(K / k_halves, group)]."""
    q, s, (src, qv, sv) = _weight_views(w, fmt, n_halves=n_halves, k_halves=k_halves, transpose=transpose)
    quantize_view(src, qv, sv, (fmt.weight_rows, fmt.group), pow2=fmt.pow2, e8m0=fmt.mx)
    return QTensor(q, s)


def dequantize_weight(
    qt: QTensor, fmt: QFormat, dtype=torch.float32, *, n_halves: int = 1, k_halves: int = 1
) -> torch.Tensor:
    """Inverse of ``quantize_weight`` in the K-major layout [E, N, K]."""
    e, n, k = qt.data.shape
    n_part, k_part = n // n_halves, k // k_halves
    nb, kg = cdiv(n_part, fmt.weight_rows), cdiv(k_part, fmt.group)
    out = torch.empty(e, n, k, dtype=dtype, device=qt.data.device)
    if n_halves == 2:
        views = (qt.data.view(e, 2, n_part, k), qt.scale.view(e, 2, nb, kg), out.view(e, 2, n_part, k))
    elif k_halves == 2:
        views = (
            qt.data.view(e, n, 2, k_part).transpose(1, 2),
            qt.scale.view(e, nb, 2, kg).transpose(1, 2),
            out.view(e, n, 2, k_part).transpose(1, 2),
        )
    else:
        views = (qt.data.unsqueeze(1), qt.scale.unsqueeze(1), out.unsqueeze(1))
    dequantize_view(*views, (fmt.weight_rows, fmt.group), e8m0=fmt.mx)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The expert weights as GEMM operands
# ----------------------------------------------------------------------------------------------------------------
def quantize_w1_fwd(w1: torch.Tensor, fmt: QFormat) -> QTensor:
    """W1 [E, 2I, H] as FC1's B (K = H): [E, 2I, H], gate and up blocked separately."""
    return quantize_weight(w1, fmt, n_halves=2)


def quantize_w1_bwd(w1: torch.Tensor, fmt: QFormat) -> QTensor:
    """W1 as the FC1 dgrad's B (K = 2I in two halves): W1^T [E, H, 2I]."""
    return quantize_weight(w1, fmt, k_halves=2, transpose=True)


def quantize_w2_fwd(w2: torch.Tensor, fmt: QFormat) -> QTensor:
    """W2 [E, H, I] as FC2's B (K = I): [E, H, I]."""
    return quantize_weight(w2, fmt)


def quantize_w2_bwd(w2: torch.Tensor, fmt: QFormat) -> QTensor:
    """W2 as the FC2 dgrad's B (K = H): W2^T [E, I, H]."""
    return quantize_weight(w2, fmt, transpose=True)


# ----------------------------------------------------------------------------------------------------------------
# Weight-gradient operands: column-scaled, transposed, in tile space ("cols_t")
# ----------------------------------------------------------------------------------------------------------------
def _check_plan(plan: RoutingPlan) -> None:
    if plan.tile_m != QTILE_M:
        raise ValueError(f"quantised grouped GEMMs need a routing plan with tile_m = {QTILE_M}, got {plan.tile_m}")


def _check_one_segment(plan: RoutingPlan) -> None:
    # The tile-list kernels take one segment's tiles: a whole one-segment plan, or a view (a segment, or a half).
    _check_plan(plan)
    if plan.num_segments != 1:
        raise ValueError(
            f"a quantised tile-list kernel takes one segment of a routing plan (plan.segment(s)); got "
            f"{plan.num_segments} segments"
        )


def _check_tile_space_plan(plan: RoutingPlan) -> None:
    # The tile-list kernels take one segment's tiles (a whole one-segment plan, or a segment's view); cols_t outputs
    # are indexed by the plan's tile numbers (a view's first tile is ``first_tile`` of its plan).
    _check_plan(plan)
    if plan.num_segments != 1 or plan.first_tile is None:
        raise ValueError(
            f"a quantised tile-list pass takes one segment of a routing plan (a plan of one segment, or "
            f"plan.segment(s)); got {plan.num_segments} segments"
            + ("" if plan.first_tile is not None else " (a half's view: its tiles are not the plan's tile numbers)")
        )


def empty_cols_t(n: int, plan: RoutingPlan, fmt: QFormat, device) -> QTensor:
    """Uninitialised cols_t operand of n columns: data [n, max_tiles * 128], scale [max_tiles * 128 / G, n]."""
    return QTensor(
        torch.empty(n, plan.max_tiles * QTILE_M, dtype=FP8_DTYPE, device=device),
        torch.empty(plan.max_tiles * (QTILE_M // fmt.group), n, dtype=fmt.scale_dtype, device=device),
    )


def cols_t_of_segment(whole: QTensor, plan: RoutingPlan, fmt: QFormat) -> QTensor:
    """The part of a cols_t operand of a whole plan (``empty_cols_t(n, whole_plan)``) that the tiles of ``plan``, one
    of its segments, write: a view starting at the segment's first tile, so a pass run on the segment's view (its
    tiles numbered from 0) writes them where the whole plan's weight gradient reads them."""
    first, tiles, blocks = plan.first_tile, plan.max_tiles, QTILE_M // fmt.group
    return QTensor(
        whole.data[:, first * QTILE_M : (first + tiles) * QTILE_M],
        whole.scale[first * blocks : (first + tiles) * blocks],
    )


def _cols_t_out(n: int, plan: RoutingPlan, fmt: QFormat, device, out: QTensor | None) -> QTensor:
    return empty_cols_t(n, plan, fmt, device) if out is None else cols_t_of_segment(out, plan, fmt)


def gluon_gather_unavailable(x: torch.Tensor, fmt: QFormat) -> str | None:
    """Why the gather pass's Gluon form (``kernels/gather_cols_t.py``) cannot run, or None when it can."""
    why_not = gluon_device_unavailable(x.device)
    if why_not is not None:
        return why_not
    if fmt.mx or fmt.group != QTILE_M:
        return f"it takes the fp8 format ({QTILE_M}-row column groups, fp32 scales), not mx"
    return None


def quantize_sorted_cols_t(
    x: torch.Tensor, plan: RoutingPlan, fmt: QFormat, *, gluon: bool | None = None, out: QTensor | None = None
) -> QTensor:
    """Source rows x [R, K] -> the wgrad operand of the sorted rows x[row_src] in the cols_t layout (K-major
    [K, max_tiles * 128], one scale per column for every ``fmt.group`` rows of each 128-row tile): gathered and
    quantised in one pass, with exactly the numerics of the in-epilogue column quantiser. ``gluon`` None: the Gluon
    form (``kernels/gather_cols_t.py``, the same bits) where ``gluon_gather_unavailable`` says it applies, else the
    Triton launch; True: the Gluon form or an error saying why not; False: the Triton launch. ``plan`` may be a
    segment's view of a larger plan, with ``out`` the whole plan's operand (``empty_cols_t``): its tiles are written
    there (x: all the plan's source rows)."""
    use_gluon = use_form(gluon, "gluon", "the Gluon gather pass", gluon_gather_unavailable, x, fmt)
    _check_tile_space_plan(plan)
    if x.dim() != 2 or x.shape[0] * plan.top_k != plan.sorted_rows:
        raise ValueError(
            f"x must be [{plan.sorted_rows // plan.top_k}, K] (the plan's source rows), got {list(x.shape)}"
        )
    x = x.contiguous()
    k = x.shape[1]
    out = _cols_t_out(k, plan, fmt, x.device, out)
    if use_gluon:
        from ..kernels.gather_cols_t import gather_cols_t_kernel

        bc, cpt, warps = GATHER_COLS_T_GLUON_BLOCK
        launch(
            gather_cols_t_kernel,
            (cdiv(k, bc), plan.max_tiles),
            x,
            plan.row_src,
            out.data,
            out.scale,
            *_tile_args(plan),
            k,
            x.stride(0),
            out.data.stride(0),
            out.scale.stride(0),
            POW2=fmt.pow2,
            TILE_M=QTILE_M,
            BC=bc,
            CPT=cpt,
            num_warps=warps,
        )
        return out
    block_k, warps = GATHER_COLS_T_BLOCK
    launch(
        gather_quantize_cols_t_kernel,
        (cdiv(k, block_k), plan.max_tiles),
        x,
        plan.row_src,
        out.data,
        out.scale,
        *_tile_args(plan),
        k,
        x.stride(0),
        out.data.stride(0),
        out.scale.stride(0),
        POW2=fmt.pow2,
        E8M0=fmt.mx,
        GROUP_R=fmt.group,
        TILE=QTILE_M,
        BK=block_k,
        num_warps=warps,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Grouped GEMMs
# ----------------------------------------------------------------------------------------------------------------


def _tile_grid(plan: RoutingPlan, n: int):
    return lambda meta: (cdiv(n, meta["BLOCK_N"]), plan.max_tiles * (QTILE_M // meta["BLOCK_M"]))


def _tile_args(plan: RoutingPlan):
    return plan.tile_expert, plan.tile_row, plan.num_tiles, plan.expert_offsets


def _fmt_args(fmt: QFormat) -> dict:
    return {"MX": fmt.mx, "GROUP_K": fmt.group, "B_GROUP_N": fmt.weight_rows}


def _weight_descriptor(bq: QTensor, use_tma: bool | None):
    """A TMA descriptor over the K-major weights viewed as [E * N, K] (its box is set by the chosen config's
    pre-launch hook), or None for pointer loads. ``use_tma`` None: where ``launch.tma_readable`` says the GPU can."""
    w_2d = bq.data.view(-1, bq.data.shape[2])
    if use_tma is None:
        use_tma = tma_readable(w_2d)
    return tma_descriptor(w_2d) if use_tma else None


def fp8_fc1_swiglu(
    xq: QTensor,
    w1q: QTensor,
    plan: RoutingPlan,
    fmt: QFormat,
    *,
    inter: int,
    h_dtype: torch.dtype | None,
    use_tma: bool = False,
    use_ws: bool | None = False,
    activation_clamp: float | None = None,
    out: tuple[torch.Tensor | None, QTensor] | None = None,
):
    """xq [R, H] (source rows, row-scaled), w1q = quantize_w1_fwd(W1) -> (h [P, 2I] in h_dtype or None,
    a = silu(g) * u as a row-scaled QTensor [P, I]) in expert-sorted row order; with ``activation_clamp`` c,
    a = silu(min(g, c)) * clamp(u, -c, c) (``ops.activation``; h stays unclamped). ``use_ws=True``: the
    warp-specialised Hopper kernel (``kernels/fp8_fc1_ws.py``; an error where ``fp8_ws_launch.ws_fc1_unavailable``
    says it does not apply), ``None``: that kernel where it applies (the layer asks for that: 0.899 against 1.164 ms
    at Qwen3-30B-A3B, T = 16384, scripts/fp8_probe.py). Otherwise the Triton kernel, with ``use_tma``:
    read W1 by TMA; off by default: for FC1 pointer loads measured as fast or faster (1.172 / 1.166 ms against
    1.205 / 1.168 with TMA at Qwen3-30B-A3B, T = 16384, two runs of scripts/fp8_probe.py). ``out`` = (h or None,
    a): buffers of every sorted row of the plan a segment's view ``plan`` belongs to (its tiles' rows are written)."""
    clamp_limit, clamp = clamp_kernel_args(activation_clamp)
    _check_one_segment(plan)
    num_pairs, hidden = plan.num_pairs, xq.data.shape[1]
    ng_out = cdiv(inter, fmt.group)
    save_h = h_dtype is not None
    if out is None:
        rows, device = plan.sorted_rows, xq.data.device
        aq = torch.empty(rows, inter, dtype=FP8_DTYPE, device=device)
        a_s = torch.empty(rows, ng_out, dtype=fmt.scale_dtype, device=device)
        h = torch.empty(rows, 2 * inter, dtype=h_dtype, device=device) if save_h else a_s
    else:
        h, (aq, a_s) = out[0], (out[1].data, out[1].scale)
        h = h if save_h else a_s
    if use_form(
        use_ws,
        "use_ws",
        "the warp-specialised fp8 FC1 + SwiGLU",
        ws_fc1_unavailable,
        xq.data,
        w1q.data,
        mx=fmt.mx,
        group=fmt.group,
        weight_rows=fmt.weight_rows,
        inter=inter,
    ):
        fp8_fc1_swiglu_ws(
            xq, w1q, plan, h if save_h else None, aq, a_s, inter=inter, pow2=fmt.pow2, activation_clamp=activation_clamp
        )
        return (h if save_h else None), QTensor(aq, a_s)
    up_scale_off = cdiv(inter, fmt.weight_rows)
    b_desc = _weight_descriptor(w1q, use_tma)
    launch(
        fp8_fc1_swiglu_kernel,
        _tile_grid(plan, inter),
        b_desc,
        xq.data,
        xq.scale,
        plan.row_src,
        w1q.data,
        w1q.scale,
        h,
        aq,
        a_s,
        *_tile_args(plan),
        inter,
        hidden,
        cdiv(hidden, fmt.group),
        ng_out,
        up_scale_off,
        num_pairs,
        xq.data.stride(0),
        xq.scale.stride(0),
        w1q.data.stride(0),
        w1q.data.stride(1),
        w1q.scale.stride(0),
        w1q.scale.stride(1),
        h.stride(0),
        aq.stride(0),
        a_s.stride(0),
        clamp_limit,
        SAVE_H=save_h,
        CLAMP=clamp,
        POW2=fmt.pow2,
        B_TMA=b_desc is not None,
        TILE_M=QTILE_M,
        **_fmt_args(fmt),
    )
    return (h if save_h else None), QTensor(aq, a_s)


def fp8_grouped_gemm(
    aq: QTensor,
    bq: QTensor,
    plan: RoutingPlan,
    fmt: QFormat,
    *,
    out_dtype: torch.dtype,
    segments: int = 1,
    gather: bool = False,
    row_scale: torch.Tensor | None = None,
    use_tma: bool | None = None,
    use_ws: bool | None = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C[r] = scale[r] * A[src[r] if gather else r] @ B[e]^T with B the K-major operand [E, N, segments * K], into
    ``out`` (every sorted row of the plan a segment's view ``plan`` belongs to) when given.
    ``use_ws=True``: run the warp-specialised Hopper kernel (``kernels/gemm_ws.py``, same bits); where it does
    not apply (``fp8_ws_launch.ws_gemm_unavailable``) that is an error. ``use_ws=None``: that kernel where it
    applies, else the Triton one (the layer's FC2 and FC1 dgrad ask for that: scripts/fp8_probe.py). Otherwise the
    Triton kernel, with ``use_tma``: read B by TMA, and A too where it is not gathered and each segment's K is a
    multiple of 128 (a box must not run into the next segment); default: where the GPU can."""
    _check_one_segment(plan)
    n, k_total = bq.data.shape[1], bq.data.shape[2]
    k = k_total // segments
    c = torch.empty(plan.sorted_rows, n, dtype=out_dtype, device=aq.data.device) if out is None else out
    if use_form(
        use_ws,
        "use_ws",
        "the warp-specialised fp8 GEMM",
        ws_gemm_unavailable,
        aq.data,
        bq.data,
        mx=fmt.mx,
        gather=gather,
        segments=segments,
        k=k,
    ):
        fp8_grouped_gemm_ws(aq, bq, plan, c, segments=segments, row_scale=row_scale, gather=gather)
        return c
    b_desc = _weight_descriptor(bq, use_tma)
    a_tma = b_desc is not None and not gather and (segments == 1 or k % 128 == 0) and (use_tma or tma_readable(aq.data))
    a_desc = tma_descriptor(aq.data) if a_tma else None
    launch(
        fp8_grouped_gemm_kernel,
        _tile_grid(plan, n),
        a_desc,
        b_desc,
        aq.data,
        aq.scale,
        plan.row_src,
        bq.data,
        bq.scale,
        c,
        row_scale if row_scale is not None else plan.row_weight,
        *_tile_args(plan),
        n,
        k,
        cdiv(k, fmt.group),
        plan.num_pairs,
        aq.data.stride(0),
        aq.scale.stride(0),
        bq.data.stride(0),
        bq.data.stride(1),
        bq.scale.stride(0),
        bq.scale.stride(1),
        c.stride(0),
        SEGS=segments,
        GATHER_A=gather,
        SCALE_ROWS=row_scale is not None,
        A_TMA=a_tma,
        B_TMA=b_desc is not None,
        TILE_M=QTILE_M,
        **_fmt_args(fmt),
    )
    return c


@dataclass
class DSwiGLUOut:
    dh_rows: QTensor | None  # [P, 2I], row scales [P, 2 * cdiv(I, G)]: A of the FC1 dgrad
    dh_t: QTensor | None  # dh^T in cols_t layout [2I, max_tiles * 128]: A of the W1 wgrad
    aw_t: QTensor | None  # (w * a)^T in cols_t layout [I, max_tiles * 128]: B of the W2 wgrad
    dw_row: torch.Tensor  # [P] fp32: <dy W2, a> per sorted row (the top-k weight gradient)


def fp8_fc2_dgrad(
    dyq: QTensor,
    w2q_bwd: QTensor,
    plan: RoutingPlan,
    fmt: QFormat,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp8 FC2 dgrad GEMM g_a = dy[src] @ W2[e] [P, I] in ``out_dtype``, from dyq [R, H] (row-scaled source rows)
    and w2q_bwd = quantize_w2_bwd(W2) [E, I, H]. The warp-specialised Hopper kernel where it applies (its producer
    warps gather dy's rows by cp.async): 0.490 against 0.542 ms for the Triton kernel at Qwen3-30B-A3B, T = 16384
    (scripts/fp8_probe.py --ws-only, one H200)."""
    _check_one_segment(plan)
    return fp8_grouped_gemm(dyq, w2q_bwd, plan, fmt, out_dtype=out_dtype, gather=True, use_ws=None, out=out)


def _dswiglu_launch(
    g_a: torch.Tensor,
    h: torch.Tensor,
    plan: RoutingPlan,
    fmt: QFormat,
    *,
    rows_out: bool,
    dh_rows: QTensor,
    dh_t: QTensor,
    aw_t: QTensor,
    dw_partial: torch.Tensor,
    activation_clamp: float | None,
) -> None:
    clamp_limit, clamp = clamp_kernel_args(activation_clamp)
    inter = g_a.shape[1]
    ng = cdiv(inter, fmt.group)
    args = (g_a, h, plan.row_weight, dh_rows.data, dh_rows.scale, dh_t.data, dh_t.scale, aw_t.data, aw_t.scale)
    strides = (
        inter,
        ng,
        g_a.stride(0),
        h.stride(0),
        dh_rows.data.stride(0),
        dh_rows.scale.stride(0),
        dh_t.data.stride(0),
        dh_t.scale.stride(0),
        aw_t.data.stride(0),
        aw_t.scale.stride(0),
    )
    fmt_args = {"MX": fmt.mx, "POW2": fmt.pow2, "GROUP_K": fmt.group, "GROUP_R": fmt.group, "TILE_M": QTILE_M}
    block_r, block_c, warps = DSWIGLU_ROWS_BLOCK if rows_out else DSWIGLU_COLS_BLOCK
    launch(
        swiglu_backward_quantize_kernel,
        (cdiv(inter, block_c), plan.max_tiles * (QTILE_M // block_r)),
        *args,
        dw_partial,
        *_tile_args(plan),
        *strides,
        dw_partial.stride(0),
        clamp_limit,
        ROWS_OUT=rows_out,
        COLS_OUT=not rows_out,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        CLAMP=clamp,
        num_warps=warps,
        **fmt_args,
    )


def dswiglu_rows_buffers(rows: int, inter: int, fmt: QFormat, device) -> tuple[QTensor, torch.Tensor]:
    """(dh [rows, 2I] row-scaled, dw partial sums) for ``dswiglu_rows(out=...)``."""
    ng = cdiv(inter, fmt.group)
    dh_rows = QTensor(
        torch.empty(rows, 2 * inter, dtype=FP8_DTYPE, device=device),
        torch.empty(rows, 2 * ng, dtype=fmt.scale_dtype, device=device),
    )
    return dh_rows, torch.empty(cdiv(inter, DSWIGLU_ROWS_BLOCK[1]), rows, dtype=torch.float32, device=device)


def dswiglu_rows(
    g_a: torch.Tensor,
    h: torch.Tensor,
    plan: RoutingPlan,
    fmt: QFormat,
    *,
    activation_clamp: float | None = None,
    out: tuple[QTensor, torch.Tensor] | None = None,
) -> tuple[QTensor, torch.Tensor]:
    """The quantising SwiGLU backward pass's row outputs (``kernels.swiglu_grad.swiglu_backward_quantize_kernel``,
    ROWS_OUT): from g_a [P, I] (``fp8_fc2_dgrad``) and h = [g | u] [P, 2I], dh row-scaled [P, 2I] (the A of the FC1
    dgrad) and dw_row [P] fp32 (the top-k weight gradient per sorted row). ``activation_clamp``: the forward's
    clamped SwiGLU limit (``ops.activation``): a is the clamped one, dh zero where g or u was clamped. ``out`` = (dh,
    dw partial sums [cdiv(I, DSWIGLU_ROWS_BLOCK[1]), rows]) over every sorted row of the plan a segment's view
    ``plan`` belongs to (``dswiglu_rows_buffers``): the pieces of a plan fill them in turn, and the dw_row returned
    is valid on every row written so far."""
    _check_one_segment(plan)
    dh_rows, dw_partial = out or dswiglu_rows_buffers(plan.sorted_rows, g_a.shape[1], fmt, g_a.device)
    _dswiglu_launch(
        g_a,
        h,
        plan,
        fmt,
        rows_out=True,
        dh_rows=dh_rows,
        dh_t=dh_rows,
        aw_t=dh_rows,
        dw_partial=dw_partial,
        activation_clamp=activation_clamp,
    )
    return dh_rows, dw_partial.sum(0)


def gluon_cols_unavailable(g_a: torch.Tensor, h: torch.Tensor, fmt: QFormat) -> str | None:
    """Why the column launch's Gluon form (``kernels/swiglu_grad_cols.py``) cannot run, or None when it can: the
    gather pass's reasons (the same kind of kernel), then contiguous rows."""
    why_not = gluon_gather_unavailable(g_a, fmt)
    if why_not is None and (g_a.stride(1) != 1 or h.stride(1) != 1):
        return "g_a's and h's rows must be contiguous"
    return why_not


def dswiglu_cols_t(
    g_a: torch.Tensor,
    h: torch.Tensor,
    plan: RoutingPlan,
    fmt: QFormat,
    *,
    gluon: bool | None = None,
    activation_clamp: float | None = None,
    out: tuple[QTensor, QTensor] | None = None,
) -> tuple[QTensor, QTensor]:
    """The same pass's column outputs (COLS_OUT): dh^T [2I, max_tiles * 128] and (w * a)^T [I, ..] in the cols_t
    layout, the K-major operands of the two weight gradients. ``gluon`` None: the Gluon form
    (``kernels/swiglu_grad_cols.py``, the same bits) where ``gluon_cols_unavailable`` says it applies, else the
    Triton launch; True: the Gluon form or an error saying why not; False: the Triton launch. ``activation_clamp``:
    as in ``dswiglu_rows``. ``plan`` may be a segment's view of a larger plan with ``out`` = (dh^T, (w * a)^T) of the
    whole plan (``empty_cols_t``): the segment's tiles are written there (``cols_t_of_segment``); the views written
    are returned."""
    use_gluon = use_form(gluon, "gluon", "the Gluon column pass", gluon_cols_unavailable, g_a, h, fmt)
    _check_tile_space_plan(plan)
    inter, device = g_a.shape[1], g_a.device
    dh_t = _cols_t_out(2 * inter, plan, fmt, device, None if out is None else out[0])
    aw_t = _cols_t_out(inter, plan, fmt, device, None if out is None else out[1])
    if use_gluon:
        from ..kernels.swiglu_grad_cols import swiglu_backward_cols_kernel

        clamp_limit, clamp = clamp_kernel_args(activation_clamp)

        bc, cpt, warps = DSWIGLU_COLS_GLUON_BLOCK
        launch(
            swiglu_backward_cols_kernel,
            (cdiv(inter, bc), plan.max_tiles),
            g_a,
            h,
            plan.row_weight,
            dh_t.data,
            dh_t.scale,
            aw_t.data,
            aw_t.scale,
            *_tile_args(plan),
            inter,
            g_a.stride(0),
            h.stride(0),
            dh_t.data.stride(0),
            dh_t.scale.stride(0),
            aw_t.data.stride(0),
            aw_t.scale.stride(0),
            clamp_limit,
            POW2=fmt.pow2,
            TILE_M=QTILE_M,
            BC=bc,
            CPT=cpt,
            CLAMP=clamp,
            num_warps=warps,
        )
        return dh_t, aw_t
    unused_dw = torch.empty(1, 1, dtype=torch.float32, device=device)  # (the row outputs are not written here)
    _dswiglu_launch(
        g_a,
        h,
        plan,
        fmt,
        rows_out=False,
        dh_rows=dh_t,
        dh_t=dh_t,
        aw_t=aw_t,
        dw_partial=unused_dw,
        activation_clamp=activation_clamp,
    )
    return dh_t, aw_t


def fused_dswiglu_unavailable(g_a: torch.Tensor, h: torch.Tensor, fmt: QFormat) -> str | None:
    """Why the one-pass SwiGLU backward (``kernels/swiglu_grad_fused.py``) cannot run, or None when it can."""
    why_not = gluon_device_unavailable(g_a.device)
    if why_not is not None:
        return why_not
    if fmt.mx or fmt.group != QTILE_M:
        return f"it takes the fp8 format (1 x {QTILE_M} groups, fp32 scales), not mx"
    if g_a.shape[1] % QTILE_M:
        return f"the intermediate size must be a multiple of {QTILE_M} (got {g_a.shape[1]})"
    if g_a.stride(1) != 1 or h.stride(1) != 1:
        return "g_a's and h's rows must be contiguous"
    return None


def fp8_dswiglu(
    g_a: torch.Tensor,
    h: torch.Tensor,
    plan: RoutingPlan,
    fmt: QFormat,
    *,
    fused: bool | None = False,
    activation_clamp: float | None = None,
) -> DSwiGLUOut:
    """The quantising SwiGLU backward from g_a [P, I] (``fp8_fc2_dgrad``) and h = [g | u] [P, 2I]: every output of
    ``DSwiGLUOut``. ``fused=False`` (the layer's choice): two launches, ``dswiglu_rows`` then ``dswiglu_cols_t``
    (its Gluon form where it applies); True: the one-pass Gluon kernel (``kernels/swiglu_grad_fused.py``, g_a and h
    read once, the same bits but for dw's last bits) or an error saying why not (``fused_dswiglu_unavailable``);
    None: that kernel where it applies. It is slower: 0.771 against 0.525 ms for the two launches in
    ``scripts/fp8_pass_probe.py``, the layer's backward GPU span 4.115 against 3.869 ms (Qwen3-30B-A3B, T = 16384,
    one H200; scripts/backward_span.py on the profiled benchmark's trace). ``activation_clamp``: the forward's
    clamped SwiGLU limit (``ops.activation``), in every form."""
    if use_form(fused, "fused", "the one-pass SwiGLU backward", fused_dswiglu_unavailable, g_a, h, fmt):
        from ..kernels.swiglu_grad_fused import swiglu_backward_fused_kernel

        clamp_limit, clamp = clamp_kernel_args(activation_clamp)

        _check_tile_space_plan(plan)
        num_pairs, inter, device = plan.num_pairs, g_a.shape[1], g_a.device
        ng = inter // fmt.group
        dh_rows = QTensor(
            torch.empty(num_pairs, 2 * inter, dtype=FP8_DTYPE, device=device),
            torch.empty(num_pairs, 2 * ng, dtype=fmt.scale_dtype, device=device),
        )
        dh_t = empty_cols_t(2 * inter, plan, fmt, device)
        aw_t = empty_cols_t(inter, plan, fmt, device)
        dw_partial = torch.empty(ng, num_pairs, dtype=torch.float32, device=device)
        rb, warps = DSWIGLU_FUSED_BLOCK
        launch(
            swiglu_backward_fused_kernel,
            (max(1, min(_num_sms(device), ng * plan.max_tiles)),),
            g_a,
            h,
            plan.row_weight,
            dh_rows.data,
            dh_rows.scale,
            dh_t.data,
            dh_t.scale,
            aw_t.data,
            aw_t.scale,
            dw_partial,
            *_tile_args(plan),
            inter,
            ng,
            g_a.stride(0),
            h.stride(0),
            dh_rows.data.stride(0),
            dh_rows.scale.stride(0),
            dh_t.data.stride(0),
            dh_t.scale.stride(0),
            aw_t.data.stride(0),
            aw_t.scale.stride(0),
            dw_partial.stride(0),
            clamp_limit,
            POW2=fmt.pow2,
            TILE_M=QTILE_M,
            RB=rb,
            CLAMP=clamp,
            num_warps=warps,
        )
        return DSwiGLUOut(dh_rows, dh_t, aw_t, dw_partial.sum(0))
    dh_rows, dw_row = dswiglu_rows(g_a, h, plan, fmt, activation_clamp=activation_clamp)
    dh_t, aw_t = dswiglu_cols_t(g_a, h, plan, fmt, activation_clamp=activation_clamp)
    return DSwiGLUOut(dh_rows, dh_t, aw_t, dw_row)


def fp8_fc2_dgrad_dswiglu(
    dyq: QTensor,
    w2q_bwd: QTensor,
    h: torch.Tensor,
    plan: RoutingPlan,
    fmt: QFormat,
    *,
    fused: bool | None = False,
    activation_clamp: float | None = None,
) -> DSwiGLUOut:
    """``fp8_fc2_dgrad``, then the quantising SwiGLU backward (``fp8_dswiglu``, clamped with ``activation_clamp``):
    every output below."""
    g_a = fp8_fc2_dgrad(dyq, w2q_bwd, plan, fmt, h.dtype)
    return fp8_dswiglu(g_a, h, plan, fmt, fused=fused, activation_clamp=activation_clamp)


def expert_tile_offsets(plan: RoutingPlan) -> torch.Tensor:
    """[E + 1] int32: expert e owns row tiles [out[e], out[e+1]) of a one-segment plan (written by the plan's fill,
    ``RoutingPlan.expert_tiles``: no launch here)."""
    if plan.num_segments != 1 or plan.expert_tiles is None:
        raise ValueError("expert_tile_offsets: a one-segment plan (or a segment's view) is needed")
    return plan.expert_tiles


def expert_tile_list(plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [E + 1], tiles [max_tiles]) int32 of a plan of several segments: expert e reduces over row tiles
    tiles[offsets[e] : offsets[e + 1]], its tiles of every segment in segment order (a fixed order: the weight
    gradients of an expert-parallel call are bitwise the same whatever the transport). One small launch."""
    experts, device = plan.num_local_experts, plan.expert_tiles.device
    offsets = torch.empty(experts + 1, dtype=torch.int32, device=device)
    tiles = torch.empty(plan.max_tiles, dtype=torch.int32, device=device)
    launch(
        expert_tile_list_kernel,
        (experts,),
        plan.expert_tiles,
        offsets,
        tiles,
        plan.max_tiles // plan.num_segments,
        NUM_SEGMENTS=plan.num_segments,
        NUM_LOCAL=experts,
        EXPERT_BLOCK=next_power_of_2(experts),
        BLOCK=128,
        num_warps=1,
    )
    return offsets, tiles


def fp8_grouped_wgrad(
    a_t: QTensor,
    b_t: QTensor,
    plan: RoutingPlan,
    fmt: QFormat,
    out: torch.Tensor,
    *,
    expert_tiles: torch.Tensor,
    tile_list: torch.Tensor | None = None,
    use_tma: bool | None = None,
    use_ws: bool | None = False,
) -> torch.Tensor:
    """out[e] = A[rows of e]^T @ B[rows of e] in fp8 with fp32 accumulation, out [E, M, N] (any dtype and strides).
    Both operands come in the cols_t layout (``quantize_sorted_cols_t`` or ``fp8_fc2_dgrad_dswiglu``): a_t [M, T128],
    b_t [N, T128], T128 = max_tiles * 128. A one-segment plan: ``expert_tiles`` = ``expert_tile_offsets(plan)``
    (each expert's tiles are consecutive); several segments: (``expert_tiles``, ``tile_list``) =
    ``expert_tile_list(plan)``. ``use_ws=True``: the warp-specialised Hopper kernel (``kernels/fp8_wgrad_ws.py``, same
    bits; an error where it does not apply), ``None``: that kernel where it applies (the layer's choice). Otherwise
    the Triton kernel, with ``use_tma``: read both by TMA (default: where the GPU can)."""
    _check_plan(plan)
    if (plan.num_segments != 1) != (tile_list is not None):
        raise ValueError(
            f"fp8_grouped_wgrad: a plan of {plan.num_segments} segments needs tile_list (expert_tile_list(plan)) "
            "exactly when it has more than one"
        )
    m, n = a_t.data.shape[0], b_t.data.shape[0]
    width = plan.max_tiles * QTILE_M
    blocks = plan.max_tiles * (QTILE_M // fmt.group)
    for name, op, cols in (("a_t", a_t, m), ("b_t", b_t, n)):
        if (
            op.data.shape != (cols, width)
            or op.data.stride(1) != 1
            or op.scale.shape != (blocks, cols)
            or op.scale.stride(1) != 1
            or op.scale.dtype != fmt.scale_dtype
        ):
            raise ValueError(
                f"{name} is not a cols_t operand of this plan and format: data {list(op.data.shape)} (want "
                f"[{cols}, {width}], rows contiguous), scale {list(op.scale.shape)} {op.scale.dtype} (want "
                f"[{blocks}, {cols}] {fmt.scale_dtype})"
            )
    if out.shape != (plan.num_local_experts, m, n):
        raise ValueError(f"out must be [{plan.num_local_experts}, {m}, {n}], got {list(out.shape)}")
    if use_form(
        use_ws,
        "use_ws",
        "the warp-specialised fp8 weight gradient",
        ws_wgrad_unavailable,
        a_t.data,
        b_t.data,
        mx=fmt.mx,
    ):
        fp8_grouped_wgrad_ws(a_t, b_t, out, expert_tiles=expert_tiles, tile_list=tile_list)
        return out
    if use_tma is None:
        use_tma = tma_readable(a_t.data) and tma_readable(b_t.data)
    a_desc, b_desc = (tma_descriptor(a_t.data), tma_descriptor(b_t.data)) if use_tma else (None, None)
    grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), plan.num_local_experts)
    launch(
        fp8_grouped_wgrad_kernel,
        grid,
        a_desc,
        b_desc,
        a_t.data,
        a_t.scale,
        b_t.data,
        b_t.scale,
        out,
        expert_tiles,
        expert_tiles if tile_list is None else tile_list,
        m,
        n,
        plan.num_pairs,
        a_t.data.stride(0),
        a_t.scale.stride(0),
        b_t.data.stride(0),
        b_t.scale.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        MX=fmt.mx,
        TILE_LIST=tile_list is not None,
        GROUP_R=fmt.group,
        USE_TMA=use_tma,
    )
    return out


__all__ = [
    "FP8_DTYPE",
    "MX_FORMAT",
    "QFormat",
    "QTensor",
    "DSwiGLUOut",
    "fp8_format",
    "tuning",
    "quantize_rows",
    "dequantize_rows",
    "quantize_weight",
    "dequantize_weight",
    "empty_cols_t",
    "quantize_sorted_cols_t",
    "quantize_w1_fwd",
    "quantize_w1_bwd",
    "quantize_w2_fwd",
    "quantize_w2_bwd",
    "fp8_fc1_swiglu",
    "fp8_grouped_gemm",
    "fp8_fc2_dgrad",
    "dswiglu_rows",
    "dswiglu_cols_t",
    "fp8_dswiglu",
    "fused_dswiglu_unavailable",
    "fp8_fc2_dgrad_dswiglu",
    "fp8_grouped_wgrad",
    "expert_tile_offsets",
    "expert_tile_list",
]
