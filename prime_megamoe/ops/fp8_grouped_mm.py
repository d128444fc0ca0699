"""Rowwise-scaled fp8 grouped GEMMs for the ``torch`` backend's ``precision = "fp8"`` (the baseline the fused fp8
path is measured against).

Recipe
======

Every GEMM of the expert layer (FC1 and FC2 forward, both dgrads, both weight gradients) runs with e4m3 operands and
fp32 *rowwise* scales along that GEMM's reduction dim: ``scale = amax / 448`` over the row (at least 2**-126; 1 for
an all-zero row), ``q = clamp(x / scale, -448, 448)`` rounded to nearest even, ``x ~= q * scale``. Accumulation is
fp32; master weights, activations and every gradient stay in the caller's dtypes (the quantised copies are
transients). Per grouped linear ``y = x W_e^T`` (x [P, K] rows grouped by expert, W [E, N, K]):

- forward: x scaled per row (one scale per routed row, along K), W per expert and output row (along K);
- dgrad ``dx = dy W_e``: dy per row (along N), W^T per expert and input column (along N; a transposed copy);
- wgrad ``dW_e = dy_e^T x_e``: the reduction runs over the expert's rows, so dy and x are scaled per expert and
  column (one scale per column of each expert's row group, along the tokens).

Weights are quantised at every call (no cache across calls), in the forward and again (transposed) in the backward;
the forward saves x and W in the caller's dtype, as the bf16 path's autograd does, so fp8 costs no extra memory
between forward and backward. SwiGLU, its clamp, the top-k weighting and the combine stay in the caller's dtype,
outside these GEMMs.

Which op. On an NVIDIA GPU of compute capability 9.x (Hopper) whose torch has ``torch._scaled_grouped_mm``, with K
and N multiples of 16: ``torch._scaled_grouped_mm`` with fp32 rowwise scales and a bf16 output (then cast to the
caller's dtype) -- the forward and dgrads as its 2D x 3D form (groups along M: ``a`` [P, K] row-major, ``b`` [E, N,
K] row-major passed transposed, ``scale_a`` [P], ``scale_b`` [E, N] (2D: torch's checks want one row of scales per
group for a 3D operand), ``offs`` the int32 cumulative row ends; an empty group is allowed), the
weight gradients as its 2D x 2D form (groups along K: ``a`` = dy^T [N, P'] and ``b`` = x^T [K, P'] row-major, the
latter passed transposed, ``scale_a`` [E * N], ``scale_b`` [E * K], ``offs`` along P'), where P' pads every
expert's rows to a multiple of 16 with zero rows (the kernel wants each group's start 16-byte aligned; zeros add
nothing). Everywhere else (CPU; CUDA GPUs of other generations; a torch without the op; other shapes) the same recipe
runs in a *reference form*: the same e4m3 values and scales, dequantised to fp32 and multiplied per expert in fp32.
Both forms give the same numbers up to accumulation order (and the op's bf16 output rounding, which the reference form
shares for bf16 callers). On the op's path the quantisation passes run through ``torch.compile`` (fused kernels, so the
baseline is not slowed by eager casts; eager again, with a warning, if compiling fails).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 2.0**-126  # the smallest normal fp32: 1 / scale stays finite
ALIGN = 16  # the op's alignment: K and N multiples of 16, wgrad groups starting at multiples of 16 rows

# "auto": the op where it runs (see the module docstring), the reference form elsewhere; "reference": always the
# reference form (tests compare the two on a GPU); "op": always the op (an error where it cannot run).
IMPLEMENTATION = "auto"


# -----------------------------------------------------------------------------------------------------------------
# Quantisation (shared by both forms, so they see the same e4m3 values and scales)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, (amax / FP8_MAX).clamp(min=_MIN_SCALE), torch.ones_like(amax))


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = x.to(torch.float32, copy=True)  # one fp32 transient, divided and clamped in place
    return y.div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _scale_from_amax(x.abs().amax(dim=-1, keepdim=True).float())
    return _to_e4m3(x, scale), scale.squeeze(-1)


def _quantize_group_cols(x: torch.Tensor, group_id: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    amax = torch.zeros(groups, x.shape[1], dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, group_id[:, None].expand(x.shape), x.abs().float(), reduce="amax", include_self=True)
    scale = _scale_from_amax(amax)
    return _to_e4m3(x, scale[group_id]), scale


# On the op's path the quantisation passes go through torch.compile (each a fused kernel or two instead of five eager
# passes over the operand: the baseline should not lose to its own casts); eager where compiling fails (a warning,
# once). Compiled division may round differently from eager in the last bit of fp32, which moves an e4m3 value only
# where it sits on a rounding midpoint.
COMPILE_QUANTIZATION = True
_compiled: dict[str, object] = {}


def _quantizer(fn, compiled: bool):
    if not (compiled and COMPILE_QUANTIZATION and _compiled.get("failed") is None):
        return fn
    name = fn.__name__
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    compiled_fn = _compiled[name]

    def run(*args):
        if _compiled.get("failed") is None:
            try:
                return compiled_fn(*args)
            except Exception as err:  # noqa: BLE001 - any compile failure: fall back to the same passes, eager
                _compiled["failed"] = err
                warnings.warn(
                    f"torch.compile of the fp8 quantisation failed ({type(err).__name__}: {err}); the torch backend's "
                    "fp8 quantises eagerly from now on (same values, more memory passes)",
                    stacklevel=2,
                )
        return fn(*args)

    return run


def quantize_rows(x: torch.Tensor, *, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one fp32 scale per row (along the last dim): ``q [..., K]`` (contiguous), ``scale [...]``,
    x ~= q * scale[..., None]. ``compiled``: through torch.compile (see ``COMPILE_QUANTIZATION``)."""
    q, scale = _quantizer(_quantize_rows, compiled)(x.contiguous())
    return q.contiguous(), scale.contiguous()  # (the op wants both; no copies when they already are)


def _group_ids(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    counts_t = torch.tensor(list(counts), dtype=torch.long).to(device)
    return torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t, output_size=sum(counts))


def quantize_group_cols(
    x: torch.Tensor, counts: Sequence[int], group_id: torch.Tensor | None = None, *, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one fp32 scale per column of each row group (``counts[g]`` consecutive rows each, along the rows):
    ``q [P, n]``, ``scale [G, n]``, x[r] ~= q[r] * scale[group of r]. A group without rows gets scale 1."""
    if group_id is None:
        group_id = _group_ids(counts, x.device)
    q, scale = _quantizer(_quantize_group_cols, compiled)(x.contiguous(), group_id, len(counts))
    return q.contiguous(), scale.contiguous()


# -----------------------------------------------------------------------------------------------------------------
# The two grouped GEMM shapes, in both forms


def can_use_scaled_grouped_mm(device: torch.device, k: int, n: int) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs a grouped linear of reduction K and output N on ``device``."""
    if device.type != "cuda" or torch.version.hip is not None or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9 and k % ALIGN == 0 and n % ALIGN == 0


def _use_op(device: torch.device, k: int, n: int) -> bool:
    if IMPLEMENTATION == "reference":
        return False
    if IMPLEMENTATION == "op":
        if not can_use_scaled_grouped_mm(device, k, n):
            raise RuntimeError(
                f"torch._scaled_grouped_mm cannot run here (device {device}, K = {k}, N = {n}): it needs a Hopper GPU "
                f"(compute capability 9.x), a torch that has the op and K, N multiples of {ALIGN}"
            )
        return True
    return can_use_scaled_grouped_mm(device, k, n)


def grouped_mm_rows(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    counts: Sequence[int],
    out_dtype: torch.dtype,
    *,
    use_op: bool,
) -> torch.Tensor:
    """Groups along M: out[rows of g] = (a_q * a_scale[:, None])[rows of g] @ (b_q[g] * b_scale[g][:, None])^T.

    a_q [P, K] e4m3 (rows grouped: ``counts[g]`` rows for group g), a_scale [P]; b_q [G, N, K] e4m3 (contiguous),
    b_scale [G, N]. Returns [P, N] in ``out_dtype``."""
    num_rows, n = a_q.shape[0], b_q.shape[1]
    if num_rows == 0:
        return torch.zeros(0, n, dtype=out_dtype, device=a_q.device)
    if use_op:
        offs = torch.tensor(list(counts), dtype=torch.int32).to(a_q.device).cumsum(0, dtype=torch.int32)
        out = torch._scaled_grouped_mm(
            a_q, b_q.transpose(-2, -1), a_scale, b_scale, offs=offs, out_dtype=torch.bfloat16
        )
        return out.to(out_dtype)
    a = a_q.float() * a_scale[:, None]
    b = b_q.float() * b_scale[:, :, None]
    outs = [chunk @ b[g].T for g, chunk in enumerate(torch.split(a, list(counts))) if chunk.shape[0]]
    return torch.cat(outs).to(out_dtype)


def _padded_t(q: torch.Tensor, dst: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Rows of ``q`` [P, n] (e4m3) placed at rows ``dst`` of a zero [padded_rows, n], returned transposed and
    row-major: [n, padded_rows] (moved as bytes: index_copy is not implemented for e4m3 everywhere)."""
    out = torch.zeros(padded_rows, q.shape[1], dtype=torch.uint8, device=q.device)
    out.index_copy_(0, dst, q.view(torch.uint8))
    return out.t().contiguous().view(FP8)


def grouped_mm_cols(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    counts: Sequence[int],
    out_dtype: torch.dtype,
    *,
    use_op: bool,
    group_id: torch.Tensor | None = None,
) -> torch.Tensor:
    """Groups along the reduction (the rows): out[g] = (a_q * a_scale[g])[rows of g]^T @ (b_q * b_scale[g])[rows of g].

    a_q [P, m], b_q [P, n] e4m3 with rows grouped (``counts[g]`` rows for group g); a_scale [G, m], b_scale [G, n]
    (one per column of each group, from ``quantize_group_cols``). Returns [G, m, n] in ``out_dtype``; a group
    without rows gives zeros."""
    groups, m, n = len(counts), a_q.shape[1], b_q.shape[1]
    if sum(counts) == 0:
        return torch.zeros(groups, m, n, dtype=out_dtype, device=a_q.device)
    if use_op:
        # Each group's rows start at a multiple of ALIGN (zero rows in between) in the transposed, row-major operands.
        padded = [-(-c // ALIGN) * ALIGN for c in counts]
        starts = [0] * groups
        for g in range(1, groups):
            starts[g] = starts[g - 1] + padded[g - 1]
        shift = torch.tensor([s - sum(counts[:g]) for g, s in enumerate(starts)], dtype=torch.long).to(a_q.device)
        if group_id is None:
            group_id = _group_ids(counts, a_q.device)
        dst = torch.arange(a_q.shape[0], device=a_q.device) + shift[group_id]
        a_t = _padded_t(a_q, dst, sum(padded))  # [m, P'] row-major
        b_t = _padded_t(b_q, dst, sum(padded))  # [n, P'] row-major, passed transposed (column-major [P', n])
        offs = torch.tensor(padded, dtype=torch.int32).to(a_q.device).cumsum(0, dtype=torch.int32)
        out = torch._scaled_grouped_mm(
            a_t, b_t.t(), a_scale.reshape(-1), b_scale.reshape(-1), offs=offs, out_dtype=torch.bfloat16
        )
        empty = [g for g, c in enumerate(counts) if c == 0]
        if empty:  # a group without rows (an empty K range): zeros, whatever the kernel writes there
            out[empty] = 0
        return out.to(out_dtype)
    if group_id is None:
        group_id = _group_ids(counts, a_q.device)
    a = a_q.float() * a_scale[group_id]
    b = b_q.float() * b_scale[group_id]
    out = a.new_zeros(groups, m, n)
    for g, (a_g, b_g) in enumerate(zip(torch.split(a, list(counts)), torch.split(b, list(counts)))):
        if a_g.shape[0]:
            out[g] = a_g.T @ b_g
    return out.to(out_dtype)


# -----------------------------------------------------------------------------------------------------------------
# The differentiable grouped linear


class Fp8GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ W[e]^T with every GEMM (forward, dgrad, wgrad) in rowwise-scaled e4m3."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        k, n = weight.shape[2], weight.shape[1]
        use_op = _use_op(x.device, k, n)
        x_q, x_scale = quantize_rows(x, compiled=use_op)
        w_q, w_scale = quantize_rows(weight, compiled=use_op)
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        ctx.use_op = use_op
        return grouped_mm_rows(x_q, x_scale, w_q, w_scale, counts, x.dtype, use_op=use_op)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        counts, use_op = ctx.counts, ctx.use_op
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_q, g_scale = quantize_rows(grad_out, compiled=use_op)  # along N
            wt_q, wt_scale = quantize_rows(weight.transpose(1, 2), compiled=use_op)  # W^T [E, K, N], along N
            grad_x = grouped_mm_rows(g_q, g_scale, wt_q, wt_scale, counts, x.dtype, use_op=use_op)
        if ctx.needs_input_grad[1]:
            group_id = _group_ids(counts, x.device)
            g_q, g_scale = quantize_group_cols(grad_out, counts, group_id, compiled=use_op)  # along each expert's rows
            x_q, x_scale = quantize_group_cols(x, counts, group_id, compiled=use_op)
            grad_w = grouped_mm_cols(g_q, g_scale, x_q, x_scale, counts, weight.dtype, use_op=use_op, group_id=group_id)
        return grad_x, grad_w, None


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Rows of ``x`` [P, K] grouped by expert (``counts[e]`` rows each) times ``weight[e]^T`` ([E, N, K]) -> [P, N] in
    x's dtype, every GEMM of forward and backward in rowwise-scaled e4m3 (see the module docstring)."""
    return Fp8GroupedLinear.apply(x, weight, tuple(int(c) for c in counts))
