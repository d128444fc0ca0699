"""The expert math of one piece of the expert-parallel pipeline (``ep_pipeline``), per precision.

The pipeline decides what runs when (which source rank's block, which experts, when to push and to send); these
classes decide what a piece computes and in which format blocks travel:

- ``Bf16Forward`` / ``Bf16Backward``: the unquantised kernels (``launch``). Blocks are the caller's own tensors (x,
  or the output gradient dy) in the activations' dtype; the own block is read from them (``row_base``).
- ``QuantizedForward`` / ``QuantizedBackward``: the fp8 / MXFP8 kernels (``fp8_launch``). Blocks travel as e4m3 rows
  with their scales (fp8: 1x128 fp32 or power-of-two scales; mxfp8: e8m0 per 32), half the bytes of bf16: x as FC1
  reads it, dy as the FC2 dgrad reads it. Each rank quantises its block straight into the transport's own slot (the
  routing plan's first launch does it for x), so every block, the own one too, is read from the gathered rows.
- fp8_bwd: ``Bf16Forward`` (tokens travel in bf16), then ``QuantizedBackward``.

The weight gradients reduce over every segment of the plan in segment order (``fp8_launch.expert_tile_list`` for the
quantised ones): the same sums whatever the transport. The quantised W1 weight gradient reads the tokens as they
travelled (fp8 rounded, dequantised: the one numerical difference from EP = 1, where it reads x itself); the W2 weight
gradient reads dy as it travelled (fp8) likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.transport import BlockParts, Transport
from ..kernels.fp8_gemm import QTILE_M
from . import fp8_launch as fl
from . import launch
from .qtensor import FP8_DTYPE, QFormat, QTensor
from .quantized_experts import cached_weight_operand
from .routing_plan import RoutingPlan, RowQuantization
from .sizes import cdiv


@dataclass(frozen=True)
class Recipe:
    """How a call computes: ``precision`` ("bf16", "fp8", "fp8_bwd", "mxfp8"), its quantised format (None for bf16),
    the plan's tile height and the SwiGLU clamp."""

    precision: str
    fmt: QFormat | None
    tile_m: int
    activation_clamp: float | None

    @property
    def quantized_forward(self) -> bool:
        return self.precision in ("fp8", "mxfp8")

    @property
    def quantized_backward(self) -> bool:
        return self.precision != "bf16"


def quantized_parts(hidden: int, fmt: QFormat) -> BlockParts:
    """The block of quantised rows [H] e4m3 with their scales [H / group]."""
    return BlockParts((hidden, cdiv(hidden, fmt.group)), (FP8_DTYPE, fmt.scale_dtype))


class Bf16Forward:
    """FC1 + SwiGLU and FC2 + top-k weight of a piece in the activations' dtype, into buffers of every sorted row."""

    own_from_caller = True  # the own block is read from x itself

    def __init__(self, recipe: Recipe, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, need_grad: bool):
        self.recipe, self.x, self.w1, self.w2, self.need_grad = recipe, x, w1, w2, need_grad

    def block(self):
        return (self.x,)

    def own_quantization(self, transport: Transport) -> RowQuantization | None:
        return None

    def allocate(self, plan: RoutingPlan) -> None:
        x, inter = self.x, self.w1.shape[1] // 2
        self.a = x.new_empty(plan.sorted_rows, inter)
        self.h = x.new_empty(plan.sorted_rows, 2 * inter) if self.need_grad else None
        self.y = None  # allocated after the first FC1 is issued: one host step less before it

    def piece(self, rows, piece: RoutingPlan, plan: RoutingPlan, row_base: int | None) -> torch.Tensor:
        """FC1 and FC2 of ``piece``; rows: the caller's x (``row_base`` its first source row) or the gathered
        parts. Returns the sorted outputs (every sorted row)."""
        if row_base is not None:
            source, base = self.x, row_base
        else:
            source, base = rows[0], 0
        launch.fc1_swiglu(
            source,
            self.w1,
            piece,
            save_h=self.need_grad,
            out=(self.h, self.a),
            row_base=base,
            activation_clamp=self.recipe.activation_clamp,
        )
        if self.y is None:
            self.y = self.x.new_empty(plan.sorted_rows, self.w2.shape[1])
        # FC2 by pointer reads, as in expert_compute.unquantized_forward (TMA: no faster, more host time)
        launch.grouped_gemm(
            self.a, self.w2, piece, transpose_b=True, row_scale=plan.row_weight, out=self.y, use_tma=False
        )
        return self.y


class QuantizedForward:
    """The same with fp8 / MXFP8 GEMMs: x travels as the rows FC1 reads."""

    own_from_caller = False  # the own block is read from the gathered rows, where it was quantised

    def __init__(self, recipe: Recipe, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, need_grad: bool):
        self.recipe, self.x, self.w1, self.w2, self.need_grad = recipe, x, w1, w2, need_grad
        self.w1q = cached_weight_operand(w1, "w1_fwd", recipe.fmt)
        self.w2q = cached_weight_operand(w2, "w2_fwd", recipe.fmt)

    def block(self):
        return quantized_parts(self.x.shape[1], self.recipe.fmt)

    def own_quantization(self, transport: Transport) -> RowQuantization:
        """x quantised per row into the transport's own slot by the plan's first launch (the same bits as
        ``fl.quantize_rows``)."""
        data, scale = transport.own_block()
        return fl.row_quantization(self.x, self.recipe.fmt, out=QTensor(data, scale))[1]

    def allocate(self, plan: RoutingPlan) -> None:
        x, inter, fmt, rows = self.x, self.w1.shape[1] // 2, self.recipe.fmt, plan.sorted_rows
        self.a = QTensor(
            torch.empty(rows, inter, dtype=FP8_DTYPE, device=x.device),
            torch.empty(rows, cdiv(inter, fmt.group), dtype=fmt.scale_dtype, device=x.device),
        )
        self.h = x.new_empty(rows, 2 * inter) if self.need_grad else None
        self.y = x.new_empty(rows, self.w2.shape[1])

    def piece(self, rows, piece: RoutingPlan, plan: RoutingPlan, row_base: int | None) -> torch.Tensor:
        fmt = self.recipe.fmt
        fl.fp8_fc1_swiglu(
            QTensor(*rows),
            self.w1q,
            piece,
            fmt,
            inter=self.w1.shape[1] // 2,
            h_dtype=self.x.dtype if self.need_grad else None,
            use_ws=None,
            activation_clamp=self.recipe.activation_clamp,
            out=(self.h, self.a),
        )
        fl.fp8_grouped_gemm(
            self.a, self.w2q, piece, fmt, out_dtype=self.x.dtype, row_scale=plan.row_weight, use_ws=None, out=self.y
        )
        return self.y


class Bf16Backward:
    """FC2 dgrad + SwiGLU backward and FC1 dgrad of a piece in the activations' dtype; the weight gradients over
    every segment (``launch.grouped_wgrad`` reduces each expert's rows in segment order)."""

    own_from_caller = True

    def __init__(self, recipe, dy, w1, w2, h, plan: RoutingPlan):
        self.recipe, self.dy, self.w1, self.w2, self.h, self.plan = recipe, dy, w1, w2, h, plan
        self.buffers = launch.dswiglu_buffers(dy, w2, plan)
        self.dx_sorted = dy.new_empty(plan.sorted_rows, dy.shape[1])

    def block(self):
        return (self.dy,)

    def write_own(self, transport: Transport) -> None:
        pass  # pushed from the caller's tensor

    def piece(self, rows, piece: RoutingPlan, row_base: int | None) -> None:
        source, base = (self.dy, row_base) if row_base is not None else (rows[0], 0)
        launch.fc2_dgrad_dswiglu(
            source,
            self.w2,
            self.h,
            piece,
            out=self.buffers,
            row_base=base,
            activation_clamp=self.recipe.activation_clamp,
        )
        launch.grouped_gemm(self.buffers[1], self.w1, piece, transpose_b=False, out=self.dx_sorted)

    def dw_row(self) -> torch.Tensor:
        return self.buffers[3]

    def weight_grads(self, transport: Transport, kept, need_w1: bool, need_w2: bool):
        _, dh, aw, _ = self.buffers
        grad_w1 = grad_w2 = None
        if need_w1:
            grad_w1 = launch.grouped_wgrad(
                dh, kept[0], self.plan, torch.empty_like(self.w1), gather_a=False, gather_b=True, use_ws=None
            )
        if need_w2:
            gathered = transport.wait_rows(transport.rank)  # this weight gradient reads every block, the own one too
            grad_w2 = launch.grouped_wgrad(
                gathered[0], aw, self.plan, torch.empty_like(self.w2), gather_a=True, gather_b=False, use_ws=None
            )
        return grad_w1, grad_w2


class QuantizedBackward:
    """The same with fp8 / MXFP8 GEMMs (fp8, mxfp8 and fp8_bwd): dy travels as the rows the FC2 dgrad reads. The
    column-scaled operands of the weight gradients are written segment by segment into the whole plan's tile space
    (``fl.cols_t_of_segment``), and each expert reduces over its tiles of every segment (``fl.expert_tile_list``)."""

    own_from_caller = False

    def __init__(self, recipe, dy, w1, w2, h, plan: RoutingPlan):
        self.recipe, self.dy, self.w1, self.w2, self.h, self.plan = recipe, dy, w1, w2, h, plan
        fmt, rows, inter, device = recipe.fmt, plan.sorted_rows, w2.shape[2], dy.device
        self.w2q = cached_weight_operand(w2, "w2_bwd", fmt)
        self.w1q = cached_weight_operand(w1, "w1_bwd", fmt)
        self.g_a = dy.new_empty(rows, inter)
        self.dh_buffers = fl.dswiglu_rows_buffers(rows, inter, fmt, device)
        self.dx_sorted = dy.new_empty(rows, dy.shape[1])
        self._dw_row = None

    def block(self):
        return quantized_parts(self.dy.shape[1], self.recipe.fmt)

    def write_own(self, transport: Transport) -> None:
        data, scale = transport.own_block()
        fl.quantize_rows(self.dy, self.recipe.fmt, out=QTensor(data, scale))
        transport.block_written()

    def piece(self, rows, piece: RoutingPlan, row_base: int | None) -> None:
        fmt = self.recipe.fmt
        fl.fp8_fc2_dgrad(QTensor(*rows), self.w2q, piece, fmt, self.dy.dtype, out=self.g_a)
        dh_rows, self._dw_row = fl.dswiglu_rows(
            self.g_a, self.h, piece, fmt, activation_clamp=self.recipe.activation_clamp, out=self.dh_buffers
        )
        fl.fp8_grouped_gemm(
            dh_rows, self.w1q, piece, fmt, out_dtype=self.dy.dtype, segments=2, use_ws=None, out=self.dx_sorted
        )

    def dw_row(self) -> torch.Tensor:
        return self._dw_row

    def _cols_t(self, rows: torch.Tensor) -> QTensor:
        """The column-scaled operand of source rows [W*C, K] (every block) over the whole plan's tiles."""
        whole = fl.empty_cols_t(rows.shape[1], self.plan, self.recipe.fmt, rows.device)
        for s in range(self.plan.num_segments):
            fl.quantize_sorted_cols_t(rows, self.plan.segment(s), self.recipe.fmt, out=whole)
        return whole

    def _rows(self, parts) -> torch.Tensor:
        """Gathered rows in the activations' dtype: as they are, or fp8 rows dequantised."""
        if len(parts) == 1:
            return parts[0]
        return fl.dequantize_rows(QTensor(*parts), self.recipe.fmt, dtype=self.dy.dtype)

    def weight_grads(self, transport: Transport, kept, need_w1: bool, need_w2: bool):
        plan, fmt, inter = self.plan, self.recipe.fmt, self.w2.shape[2]
        if not (need_w1 or need_w2):
            return None, None
        dh_t = fl.empty_cols_t(2 * inter, plan, fmt, self.dy.device)
        aw_t = fl.empty_cols_t(inter, plan, fmt, self.dy.device)
        for s in range(plan.num_segments):
            fl.dswiglu_cols_t(
                self.g_a, self.h, plan.segment(s), fmt, activation_clamp=self.recipe.activation_clamp, out=(dh_t, aw_t)
            )
        offsets, tiles = fl.expert_tile_list(plan)
        grad_w1 = grad_w2 = None
        if need_w1:
            x_t = self._cols_t(self._rows(kept))
            grad_w1 = fl.fp8_grouped_wgrad(
                dh_t, x_t, plan, fmt, torch.empty_like(self.w1), expert_tiles=offsets, tile_list=tiles, use_ws=None
            )
            del x_t
        if need_w2:
            dy_t = self._cols_t(self._rows(transport.wait_rows(transport.rank)))
            grad_w2 = fl.fp8_grouped_wgrad(
                dy_t, aw_t, plan, fmt, torch.empty_like(self.w2), expert_tiles=offsets, tile_list=tiles, use_ws=None
            )
        return grad_w1, grad_w2


def block_layouts(recipe_precision: str, fmt: QFormat | None, hidden: int, dtype: torch.dtype) -> set[BlockParts]:
    """The layouts a precision's blocks travel in (forward, backward): what a transport's workspace must hold."""
    plain = BlockParts((hidden,), (dtype,))
    if recipe_precision == "bf16":
        return {plain}
    quantized = quantized_parts(hidden, fmt)
    return {plain, quantized} if recipe_precision == "fp8_bwd" else {quantized}


def tile_height(precision: str, bf16_tile_m: int) -> int:
    """The plan's tile height: the quantised kernels' (their scale blocks follow the tiles) for every quantised
    precision, fp8_bwd's bf16 forward included (its backward reads the same plan)."""
    return bf16_tile_m if precision == "bf16" else QTILE_M
