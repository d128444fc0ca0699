"""Quantised GEMM operands: the formats (``QFormat``) and an fp8 tensor with its scales (``QTensor``).

``fp8`` = e4m3 with fp32 scales, activations 1x128, weights 128x128 (optionally power-of-two scales); ``mx`` = e4m3
with e8m0 scales (uint8), 1x32 blocks along the reduction dim of every GEMM operand. The layouts each launcher
expects are in ``fp8_launch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class QFormat:
    """How operands are quantised: block along the reduction dim, weight block along the other dim, scale type."""

    name: str  # "fp8" or "mx"
    group: int  # elements per scale along a reduction dim (128 or 32)
    weight_rows: int  # weight block height across the reduction dim (128 for fp8, 1 for mx)
    pow2: bool  # power-of-two scales (always true for mx)

    @property
    def mx(self) -> bool:
        return self.name == "mx"

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8 if self.mx else torch.float32


def fp8_format(pow2: bool = False) -> QFormat:
    return QFormat("fp8", 128, 128, pow2)


MX_FORMAT = QFormat("mx", 32, 1, True)


@dataclass
class QTensor:
    data: torch.Tensor  # float8_e4m3fn
    scale: torch.Tensor  # fp32 (fp8 format) or uint8 e8m0 (mx format)
    # TMA descriptors over ``data`` made so far, by box and layout: a cached weight operand keeps its own, so the
    # launchers do not rebuild them on every call (``fp8_ws_launch.weight_descriptor``)
    descriptors: dict = field(default_factory=dict, repr=False, compare=False)
