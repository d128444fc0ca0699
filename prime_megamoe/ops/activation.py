"""The experts' activation: SwiGLU, or the clamped SwiGLU of ``activation_clamp`` (prime-rl's experts option).

With limit c: ``a = silu(min(g, c)) * clamp(u, -c, c)`` (g, u: the gate and up halves of h = x W1^T); its gradient
is zero where an input was clamped, with torch.clamp's convention (it passes where ``g <= c`` and where
``-c <= u <= c``). ``None`` or ``+inf`` is plain SwiGLU. The kernels take the clamp as a constexpr (``CLAMP``) and the
limit as a runtime fp32 argument, so plain SwiGLU runs exactly the kernels it ran before the option existed.
"""

from __future__ import annotations

import math
import numbers

FP32_MAX = 3.4028234663852886e38


def check_activation_clamp(value) -> float | None:
    """``activation_clamp`` as the kernels take it: None (plain SwiGLU: None, +inf, or a limit above every finite
    fp32 value) or a float > 0; anything else is an error that names the option."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"activation_clamp must be a number > 0 (the clamped SwiGLU's limit) or None (plain SwiGLU), got "
            f"{type(value).__name__} {value!r}"
        )
    limit = float(value)
    if math.isnan(limit) or limit <= 0:
        raise ValueError(
            f"activation_clamp = {value!r}: the clamped SwiGLU's limit must be > 0 (a = silu(min(g, c)) * "
            f"clamp(u, -c, c)); use None (or inf) for plain SwiGLU"
        )
    return None if limit > FP32_MAX else limit


def clamp_kernel_args(activation_clamp) -> tuple[float, bool]:
    """(clamp_limit, CLAMP) for a kernel launch: the runtime fp32 limit (0.0, never read, without the clamp) and the
    constexpr that switches the clamp on."""
    if activation_clamp is None:  # the common case first: one test on the host's path to the launch
        return 0.0, False
    limit = check_activation_clamp(activation_clamp)
    return (0.0, False) if limit is None else (limit, True)
