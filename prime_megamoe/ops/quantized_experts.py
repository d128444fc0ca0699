"""Routed experts with quantised GEMMs: precisions "fp8", "fp8_bwd" and "mxfp8".

Design note
===========

Same math, inputs, outputs and gradients as ``expert_compute.routed_experts`` (see ARCHITECTURE.md); only the GEMM
operands are low precision. Accumulation is fp32 everywhere; master weights, the layer output and every gradient stay
in the caller's dtypes. Notation: x [T, H] source rows, P = T * k sorted (row, slot) pairs, W1 [E, 2I, H],
W2 [E, H, I], h = x W1^T = [g | u], a = silu(g) * u, y = sum_j w * a W2^T.

Formats. ``fp8``: e4m3 with fp32 scales (amax / 448, optionally rounded up to a power of two): activations per 1x128
block along the GEMM's reduction dim, weights per 128x128 block. ``mxfp8``: e4m3 with e8m0 scales per 1x32 block
along the reduction dim of every operand (OCP MX), through ``tl.dot_scaled``: native on Blackwell; on Hopper Triton
emulates it (operands upcast to bf16 with their scales, bf16 MMAs), so mxfp8 on an H100/H200 has MX numerics but no
fp8 speed-up. Both need an NVIDIA GPU with fp8 support (compute capability >= 8.9); anything else is a clear error.

What each GEMM quantises, and the scale layout its operands need (scales always run along the GEMM's reduction dim;
"1x128 / 1x32" = fp8 / mxfp8; weight operands come from the cache):

- FC1 + SwiGLU epilogue (reduction H): A = x [T, H], row-scaled 1x128 / 1x32 along H, quantised once per token (by
  the routing plan's first launch: ``fp8_launch.row_quantization``) and gathered per sorted row; B = W1 [E, 2I, H]
  in 128x128 blocks / 1x32 along H (gate and up halves blocked apart). The epilogue stores h (input dtype, for the
  backward) and a = silu(g) * u in fp8 with 1x128 / 1x32 row scales.
- FC2 + top-k weight epilogue (reduction I): A = a [P, I] from FC1's epilogue (no extra pass); B = W2 [E, H, I] in
  128x128 blocks / 1x32 along I. Output in the input dtype, then the deterministic combine. On Hopper (fp8) it runs
  the warp-specialised kernel of ``kernels/gemm_ws.py``.
- FC2 dgrad (reduction H): A = dy [T, H] row-scaled along H, gathered; B = the transposed copy W2^T [E, I, H]
  (K-major, as Hopper's fp8 wgmma wants), blocks / groups along H. Output g_a [P, I] in the input dtype. Then the
  SwiGLU backward pass (``kernels.swiglu_grad``) reads g_a and h and emits dh = [dg | du] twice in fp8:
  row-scaled per half [P, 2I] (for the FC1 dgrad) and column-scaled, stored transposed as dh^T (for the W1 wgrad),
  plus (w * a)^T column-scaled (for the W2 wgrad) and the top-k weight gradient <dy W2, a>: a row launch, then a
  column launch (on GPUs in Gluon, ``kernels/swiglu_grad_cols.py``, the same bits). (In the GEMM's epilogue these
  outputs made that kernel take 2.56 ms at the shape below; the GEMM and the pass now take 0.48 + 0.20 + 0.36 ms.)
- FC1 dgrad (reduction 2I, two halves): A = dh [P, 2I] row-scaled per half; B = the copy W1^T [E, H, 2I]. On
  Hopper (fp8, each half a multiple of 128) it runs the warp-specialised kernel of ``kernels/gemm_ws.py``.
- W1 wgrad, dW1[e] = dh^T x (reduction over the expert's rows): A = dh^T from that pass; B = x^T: the source rows
  gathered in sorted order and quantised per tile and column by one pass (``fl.quantize_sorted_cols_t``), written
  once and read by every output tile of the expert.
- W2 wgrad, dW2[e] = dy^T (w * a): A = dy^T, gathered and quantised by the same pass; B = (w * a)^T from the
  SwiGLU backward pass.

The wgrads reduce over tokens, so their operands carry scales along the token dim: one per column for every block
of 128 (fp8) or 32 (mx) rows of a 128-row tile. Tiles start at each expert's first row (the routing plan's tile
list), so a scale block never mixes two experts. That is why the quantised path always plans with 128-row tiles,
whatever ``tile_m`` the caller uses for the bf16 kernels. Both wgrad operands are stored transposed, the rows
contiguous (K-major: Hopper's fp8 wgmma takes no other operand order), in tile space: tile t's rows at columns
[128 t, 128 t + 128), zeros past its expert's end, so every K step of the wgrad is one aligned, unmasked 128-row
tile ([N, max_tiles * 128] with max_tiles = cdiv(P, 128) + E: at most one padding tile per expert, +12.5% at the
shape below).

Weights are quantised once per optimizer step, not per call: both orientations (the forward's and the dgrad's
transposed, K-major copy) are cached, keyed on the parameter's identity and its ``_version`` counter (in-place
optimizer updates bump it; so do ``copy_`` and friends). ``invalidate_weight_cache()`` drops everything: call it
after updates the counter cannot see (writes through ``.data``, FSDP re-gathers into the same storage) or simply after
every optimizer step. The cache holds 2 bytes per expert parameter (plus scales: 1/4096 of that for fp8 blocks,
1/32 for mx): as much as a bf16 copy of the weights.

What the forward saves: the source rows (the caller holds them anyway), W1 and W2 (references), the routing plan and h
in the input dtype (bf16 in training) for the SwiGLU backward, as the bf16 path does. At T = 16384, H = 2048, I = 768,
k = 8 (P = 131072): h = P * 2I * 2 B = 402.7 MB per layer, the plan ~1.6 MB; nothing else. Cheaper choices, not taken: h
in fp8 with 1x128 scales (208 MB, but the SwiGLU derivative then sees e4m3 noise in g and u), or only the 34 MB fp8 copy
of x and an FC1 recompute in the backward (+1/3 of the forward's FLOPs). Trainers checkpoint activations, which keeps
one layer's h alive at a time. Transients at that shape: forward x fp8 34 MB, a fp8 101 MB (+3 MB scales), the FC2
output before the combine 537 MB (as in bf16); backward (max_tiles * 128 = 147456 tile-space rows) dy fp8 34 MB (freed
after the FC2 dgrad), g_a 201 MB (freed after the SwiGLU backward pass), dh row-scaled 201 MB (freed after the FC1
dgrad), dh^T 226 MB (freed after dW1), (w * a)^T 113 MB, the K-major copies x^T then dy^T 302 MB each (one at a time,
each freed after its wgrad), scales ~27 MB, the FC1 dgrad output before the combine 537 MB.

Expert parallelism runs the same kernels in the pipeline of ``ops.ep_pipeline`` (``ops.ep_stages``): fp8 and mxfp8
send each rank's tokens as the rows FC1 reads (e4m3 with their row scales, about half the bytes of bf16), and the
output gradients as the rows the FC2 dgrad reads; fp8_bwd sends bf16 tokens (its forward is bf16) and fp8 output
gradients. The weight gradients read the blocks as they travelled (dequantised, then column-quantised per tile): the
one numerical difference from EP = 1.

``fp8_bwd`` runs the bf16 forward kernels (``ops.launch``) and the same fp8 backward as ``fp8``.

The clamped SwiGLU (``activation_clamp`` c, ``ops.activation``): FC1's epilogue clamps g and u (in fp32, before a is
quantised) after storing h unclamped, and the SwiGLU backward pass clamps them again from the saved h and zeroes dg
and du where they were clamped; every GEMM and quantisation is as without it.

Accuracy (CPU interpreter, tests/test_fp8_experts.py, H = 192, I = 96, ragged routing): against the float64
transformers oracle the output and the four gradients are 6-7.5% off (relative norm) for fp8 and mxfp8 and 3-5%
for the fp8_bwd gradients; that is e4m3's own rounding (3 mantissa bits, ~2.6% rms per quantised operand, two GEMMs
in a chain). Against a torch emulation of this exact recipe (same blocks, scales and roundings, float64 GEMMs) they
agree to ~1e-7, so the kernels add nothing beyond the recipe. The top-k weight gradient is the noisiest (a dot
product over I of two noisy factors, with cancellation): over random seeds it averages 6.6% and reaches 8%.
"""

from __future__ import annotations

import weakref

import torch

from ..kernels import tuning
from ..kernels.fp8_gemm import QTILE_M
from . import fp8_launch as fl
from . import launch
from .activation import check_activation_clamp
from .cuda_thread import binds_cuda_context
from .expert_compute import combine_with_pair_values, unquantized_backward, unquantized_forward
from .routing_plan import PlanLease, RoutingPlan, lease_routing_plan
from .sm_budget import cuda_properties, in_kept_sm_budget, keeps_sm_budget

QUANTIZED_PRECISIONS = ("fp8", "fp8_bwd", "mxfp8")


# ----------------------------------------------------------------------------------------------------------------
# Device support
# ----------------------------------------------------------------------------------------------------------------
def _require_quantized(precision: str) -> None:
    if precision not in QUANTIZED_PRECISIONS:
        raise ValueError(
            f"precision = {precision!r} is not a quantised precision; allowed: {list(QUANTIZED_PRECISIONS)}"
        )


def check_precision_supported(precision: str, device: torch.device) -> None:
    """Raise a clear error where ``precision`` cannot run on ``device``."""
    _require_quantized(precision)
    if device.type == "cuda":
        if torch.version.hip is not None:
            raise RuntimeError(f"precision = {precision!r} is implemented for NVIDIA GPUs only; use precision = 'bf16'")
        props = cuda_properties(device)  # cached: this runs on every call's path to its first GEMM
        major, minor = props.major, props.minor
        if (major, minor) < (8, 9):
            what = "MXFP8 (native on sm_100+, emulated on sm_89/sm_90)" if precision == "mxfp8" else "fp8 e4m3 GEMMs"
            raise RuntimeError(
                f"precision = {precision!r} needs {what}, which needs compute capability >= 8.9 (Ada, Hopper, "
                f"Blackwell); this GPU is sm_{major}{minor}, which has neither a native nor an emulated path. "
                f"Use precision = 'bf16'."
            )
    elif not tuning.interpreting():
        raise RuntimeError(
            f"precision = {precision!r} runs Triton kernels on an NVIDIA GPU, but the tensors are on {device}; "
            f"on a CPU set TRITON_INTERPRET=1 (tests only) or use precision = 'bf16' with the torch backend"
        )


def quantized_format(precision: str, pow2_scales: bool) -> fl.QFormat:
    return fl.MX_FORMAT if precision == "mxfp8" else fl.fp8_format(pow2_scales)


# ----------------------------------------------------------------------------------------------------------------
# Weight cache: quantised once per optimizer step
# ----------------------------------------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("ref", "state", "operands")

    def __init__(self, ref, state):
        self.ref = ref
        self.state = state
        self.operands: dict = {}


_WEIGHT_CACHE: dict[int, _Entry] = {}
_CACHE_STATS = {"hits": 0, "misses": 0}

_QUANTIZERS = {
    "w1_fwd": fl.quantize_w1_fwd,
    "w1_bwd": fl.quantize_w1_bwd,
    "w2_fwd": fl.quantize_w2_fwd,
    "w2_bwd": fl.quantize_w2_bwd,
}


def _state(w: torch.Tensor):
    # _version catches in-place updates; the rest catches a parameter whose storage was swapped.
    return (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)


def _evict(wid: int):
    def callback(ref):
        entry = _WEIGHT_CACHE.get(wid)
        if entry is not None and entry.ref is ref:
            del _WEIGHT_CACHE[wid]

    return callback


def cached_weight_operand(w: torch.Tensor, kind: str, fmt: fl.QFormat) -> fl.QTensor:
    """The quantised GEMM operand ``kind`` ("w1_fwd", "w1_bwd", "w2_fwd", "w2_bwd") of weight ``w`` in ``fmt``,
    computed once and reused until ``w`` changes (its ``_version`` or storage) or the cache is invalidated."""
    quantize = _QUANTIZERS[kind]
    try:
        state = _state(w)
    except RuntimeError:  # inference-mode tensors have no version counter: nothing to key on
        _CACHE_STATS["misses"] += 1
        return quantize(w.detach(), fmt)
    wid = id(w)
    entry = _WEIGHT_CACHE.get(wid)
    if entry is None or entry.ref() is not w:
        entry = _Entry(weakref.ref(w, _evict(wid)), state)
        _WEIGHT_CACHE[wid] = entry
    elif entry.state != state:
        entry.state = state
        entry.operands.clear()
    key = (kind, fmt)
    op = entry.operands.get(key)
    if op is None:
        _CACHE_STATS["misses"] += 1
        with torch.no_grad():
            op = quantize(w.detach(), fmt)
        entry.operands[key] = op
    else:
        _CACHE_STATS["hits"] += 1
    return op


def invalidate_weight_cache() -> None:
    """Drop every cached quantised weight (they are rebuilt on next use). Call after optimizer steps that update
    weights in ways ``Tensor._version`` does not see, or simply after every step."""
    _WEIGHT_CACHE.clear()


def weight_cache_info() -> dict:
    """Counters for tests and debugging: cached weights, cached operands, hits and misses since start."""
    return {
        "weights": len(_WEIGHT_CACHE),
        "operands": sum(len(e.operands) for e in _WEIGHT_CACHE.values()),
        **_CACHE_STATS,
    }


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------
def _plan(
    top_k_index,
    top_k_weights,
    num_local_experts: int,
    expert_base: int,
    tile_m: int,
    quantize=None,
    check_ids: int | None = None,
) -> PlanLease:
    """The filled routing plan on a lease from the pool of plans of its sizes (no allocation on the host's path to the
    first GEMM); whoever keeps the plan for the backward keeps the lease with it. ``quantize``: rows the fill's first
    launch also quantises (``fp8_launch.row_quantization``); ``check_ids``: the fill also checks the ids' range."""
    return lease_routing_plan(
        top_k_index,
        top_k_weights,
        expert_base=expert_base,
        num_local_experts=num_local_experts,
        tile_m=tile_m,
        quantize=quantize,
        check_ids_below=check_ids,
    )


def _forward(
    rows,
    top_k_index,
    top_k_weights,
    w1,
    w2,
    expert_base: int,
    tile_m: int,
    precision: str,
    pow2_scales: bool,
    need_grad: bool,
    activation_clamp: float | None = None,
    quantized_backward: bool = True,
    check_ids: int | None = None,
):
    """The layer's forward: (out [R, H], and for the backward (None unless ``need_grad``): the plan's lease, h).
    ``quantized_backward``: whether the backward will run the quantised GEMMs (else the bf16 ones, on the plan the
    forward used). ``check_ids``: see ``routed_experts_quantized``."""
    check_precision_supported(precision, rows.device)
    rows = rows.contiguous()
    num_local, inter = w1.shape[0], w1.shape[1] // 2
    fmt = quantized_format(precision, pow2_scales)
    if precision == "fp8_bwd":
        # bf16 forward: the bf16 kernels' own tile height, then (if it differs) the 128-row plan for the backward.
        # Both plans sort the rows identically, so h lines up with either.
        lease = _plan(top_k_index, top_k_weights, num_local, expert_base, tile_m, check_ids=check_ids)
        out, h = unquantized_forward(rows, w1, w2, lease.plan, save_h=need_grad, activation_clamp=activation_clamp)
        if check_ids is not None:
            lease.plan.assert_ids_in_range(check_ids)
        if need_grad and quantized_backward and tile_m != QTILE_M:
            lease = _plan(top_k_index, top_k_weights, num_local, expert_base, QTILE_M)
    else:
        # x quantised per row by the plan's first launch (the same bits as fl.quantize_rows, one launch fewer).
        xq, x_quantization = fl.row_quantization(rows, fmt)
        lease = _plan(
            top_k_index, top_k_weights, num_local, expert_base, QTILE_M, quantize=x_quantization, check_ids=check_ids
        )
        plan = lease.plan
        w1q = cached_weight_operand(w1, "w1_fwd", fmt)
        w2q = cached_weight_operand(w2, "w2_fwd", fmt)
        h, aq = fl.fp8_fc1_swiglu(
            xq,
            w1q,
            plan,
            fmt,
            inter=inter,
            h_dtype=rows.dtype if need_grad else None,
            use_ws=None,
            activation_clamp=activation_clamp,
        )
        out_sorted = fl.fp8_grouped_gemm(
            aq, w2q, plan, fmt, out_dtype=rows.dtype, row_scale=plan.row_weight, use_ws=None
        )
        out = launch.combine_rows(out_sorted, plan.pair_pos, rows.dtype)
        if check_ids is not None:  # after the GEMMs' launches: off the host's path to the first one
            plan.assert_ids_in_range(check_ids)
    return (out, lease, h) if need_grad else (out, None, None)


class QuantizedRoutedExperts(torch.autograd.Function):
    """Like ``expert_compute.RoutedExperts`` with fp8 / MXFP8 GEMMs; ``precision`` in QUANTIZED_PRECISIONS. The
    backward runs within the SM budget its forward ran in (``sm_budget``)."""

    @staticmethod
    @keeps_sm_budget
    def forward(
        ctx,
        rows,
        top_k_index,
        top_k_weights,
        w1,
        w2,
        expert_base: int,
        tile_m: int,
        precision: str,
        pow2_scales: bool,
        grad_enabled: bool,
        activation_clamp: float | None = None,
        quantized_backward: bool = True,
        check_ids: int | None = None,
    ):
        need_grad = grad_enabled and any(ctx.needs_input_grad[i] for i in (0, 2, 3, 4))
        rows = rows.contiguous()
        out, lease, h = _forward(
            rows,
            top_k_index,
            top_k_weights,
            w1,
            w2,
            expert_base,
            tile_m,
            precision,
            pow2_scales,
            need_grad,
            activation_clamp,
            quantized_backward,
            check_ids,
        )
        ctx.activation_clamp = activation_clamp
        ctx.quantized_backward = quantized_backward
        if need_grad:
            ctx.save_for_backward(rows, w1, w2, h)
            ctx.plan, ctx.plan_lease = lease.plan, lease  # the lease (and its plan) held until the graph is freed
            ctx.fmt = quantized_format(precision, pow2_scales)
        ctx.weights_dtype = top_k_weights.dtype
        return out

    @staticmethod
    @binds_cuda_context
    @in_kept_sm_budget
    def backward(ctx, grad_out):
        rows, w1, w2, h = ctx.saved_tensors
        plan: RoutingPlan = ctx.plan
        if not ctx.quantized_backward:
            grads = unquantized_backward(
                grad_out,
                rows,
                w1,
                w2,
                h,
                plan,
                ctx.needs_input_grad,
                weights_dtype=ctx.weights_dtype,
                activation_clamp=ctx.activation_clamp,
            )
            return grads[0], None, *grads[1:], *(None,) * 8
        fmt: fl.QFormat = ctx.fmt
        grad_out = grad_out.contiguous().to(rows.dtype)
        dyq = fl.quantize_rows(grad_out, fmt)
        w2q = cached_weight_operand(w2, "w2_bwd", fmt)
        d = fl.fp8_fc2_dgrad_dswiglu(dyq, w2q, h, plan, fmt, activation_clamp=ctx.activation_clamp)
        del dyq

        grad_rows = grad_weights = grad_w1 = grad_w2 = None
        if ctx.needs_input_grad[0]:
            w1q = cached_weight_operand(w1, "w1_bwd", fmt)
            # The warp-specialised Hopper kernel where it applies: 0.841 against 1.065 ms for the Triton kernel at
            # Qwen3-30B-A3B, T = 16384 (scripts/fp8_probe.py --ws-only, one H200).
            dx_sorted = fl.fp8_grouped_gemm(d.dh_rows, w1q, plan, fmt, out_dtype=rows.dtype, segments=2, use_ws=None)
            grad_rows, grad_weights = combine_with_pair_values(
                dx_sorted, d.dw_row, plan, rows.dtype, ctx.weights_dtype if ctx.needs_input_grad[2] else None
            )
            del dx_sorted
        elif ctx.needs_input_grad[2]:
            grad_weights = plan.pair_values(d.dw_row, ctx.weights_dtype)
        d.dh_rows = None
        # Weight gradients from K-major fp8 operands; the gathered [H, tiles * 128] copies of x and dy are made one
        # at a time, each freed after its GEMM. The warp-specialised Hopper kernel where it applies: dW1 1.001 and
        # dW2 0.536 ms against 1.244 and 0.693 for the Triton kernel (scripts/fp8_probe.py --ws-only).
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            tiles = fl.expert_tile_offsets(plan)
            if ctx.needs_input_grad[3]:
                x_t = fl.quantize_sorted_cols_t(rows, plan, fmt)
                grad_w1 = fl.fp8_grouped_wgrad(
                    d.dh_t, x_t, plan, fmt, torch.empty_like(w1), expert_tiles=tiles, use_ws=None
                )
                del x_t
            d.dh_t = None
            if ctx.needs_input_grad[4]:
                dy_t = fl.quantize_sorted_cols_t(grad_out, plan, fmt)
                grad_w2 = fl.fp8_grouped_wgrad(
                    dy_t, d.aw_t, plan, fmt, torch.empty_like(w2), expert_tiles=tiles, use_ws=None
                )
        return grad_rows, None, grad_weights, grad_w1, grad_w2, *(None,) * 8


def routed_experts_quantized(
    rows,
    top_k_index,
    top_k_weights,
    w1,
    w2,
    *,
    expert_base: int,
    tile_m: int,
    precision: str,
    pow2_scales: bool = False,
    activation_clamp: float | None = None,
    backward_min_expert_work: int = 0,
    check_ids: int | None = None,
) -> torch.Tensor:
    """``expert_compute.routed_experts`` with quantised GEMMs (same inputs, output and gradients).

    rows [R, H], top_k_index [R, k] (global ids; ids outside [expert_base, expert_base + E_local) are skipped),
    top_k_weights [R, k], w1 [E_local, 2I, H], w2 [E_local, H, I] -> [R, H] in rows' dtype, differentiable in rows,
    top_k_weights, w1 and w2 (gradients in their own dtypes).

    precision: "fp8" (e4m3, 1x128 activation / 128x128 weight blocks, fp32 scales; ``pow2_scales`` rounds them up to
    powers of two), "fp8_bwd" (the bf16 forward, fp8 backward GEMMs), "mxfp8" (OCP MX, 1x32 blocks, e8m0 scales;
    native on Blackwell, emulated by Triton on Hopper: MX numerics at bf16 speed; ``pow2_scales`` is implied).
    tile_m is the row tile of the bf16 kernels (the fp8_bwd forward); the quantised GEMMs always use 128-row tiles.
    activation_clamp: the clamped SwiGLU's limit (``ops.activation``; None: plain SwiGLU).
    backward_min_expert_work (fp8, fp8_bwd; ``[model.moe.dispatch] fp8_backward_min_expert_work``): the backward runs
    the quantised GEMMs when an expert's average work, routed rows / E_local x H x I (the multiply-adds of its FC2),
    is at least this, else the bf16 backward kernels (``expert_compute.unquantized_backward``) on the same saved
    tensors: on small GEMMs, quantising the backward's operands costs more host and GPU time than its fp8 GEMMs save.
    mxfp8 always runs its own backward (its point is the MX numerics). 0: always quantised.
    check_ids: as ``expert_compute.routed_experts``'s (the ids' range checked by the plan's kernels, asserted on the
    device).
    """
    _require_quantized(precision)
    if backward_min_expert_work < 0:
        raise ValueError(
            f"[model.moe.dispatch] fp8_backward_min_expert_work = {backward_min_expert_work}: must be >= 0 "
            f"(0: the fp8 backward at every size)"
        )
    activation_clamp = check_activation_clamp(activation_clamp)
    if not torch.is_grad_enabled():
        # Nothing to record (inference, the first forward under activation checkpointing): the forward alone,
        # without autograd's bookkeeping on the host's path to the first GEMM (single calls are host-bound).
        return _forward(
            rows,
            top_k_index,
            top_k_weights,
            w1,
            w2,
            expert_base,
            tile_m,
            precision,
            bool(pow2_scales),
            need_grad=False,
            activation_clamp=activation_clamp,
            check_ids=check_ids,
        )[0]
    # routed rows x H x I against the threshold x E_local: integers, no rounding at the boundary
    work = rows.shape[0] * top_k_index.shape[1] * rows.shape[1] * (w1.shape[1] // 2)
    quantized_backward = precision == "mxfp8" or work >= backward_min_expert_work * w1.shape[0]
    return QuantizedRoutedExperts.apply(
        rows,
        top_k_index,
        top_k_weights,
        w1,
        w2,
        expert_base,
        tile_m,
        precision,
        bool(pow2_scales),
        True,
        activation_clamp,
        quantized_backward,
        check_ids,
    )
