"""The clamped SwiGLU's clamp, shared by the Triton kernels that evaluate SwiGLU (the FC1 epilogues and the SwiGLU
backward passes; the Gluon kernels carry their own copies, in their language).

With limit c: ``a = silu(min(g, c)) * clamp(u, -c, c)``. Its gradient is zero where an input was clamped, with
torch.clamp's convention: it passes where ``g <= c`` and where ``-c <= u <= c`` (bounds included), and not at a NaN.
A NaN input stays NaN (as torch.clamp keeps it), so a diverging run shows up as it does without the clamp.

Every kernel takes the clamp as a constexpr ``CLAMP`` and the limit as a runtime fp32 ``clamp_limit`` (its last
runtime argument): with CLAMP False the limit is never read and the kernel compiles to what it was without the clamp.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def clamp_gate_up(g, u, limit):
    """(min(g, limit), clamp(u, -limit, limit)), NaN kept. (The clamp as a maximum and a minimum, as the Gluon kernels
    write it: their language has no clamp in every Triton version the package runs on; exact either way.)"""
    g_c = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    u_c = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    return g_c, u_c


@triton.jit
def gate_passes(g, limit):
    """Where the gradient passes the clamp of g: ``g <= limit`` (not at a NaN)."""
    return g <= limit


@triton.jit
def up_passes(u, limit):
    """Where the gradient passes the clamp of u: ``-limit <= u <= limit`` (not at a NaN)."""
    return (u >= -limit) & (u <= limit)
