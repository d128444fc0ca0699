"""The functional core: ``fused_experts``."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .config import DISPATCH_TYPES, PRECISIONS, DispatchConfig
from .dispatch.registry import get_backend
from .ops.activation import check_activation_clamp
from .ops.sm_budget import sm_limit
from .validation import check_expert_ids, check_expert_inputs


def fused_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    dispatch: str | DispatchConfig = "mega_moe",
    precision: str = "bf16",
    group: dist.ProcessGroup | None = None,
    activation_clamp: float | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts: ``y_t = sum_j w_tj * down(silu(gate(x_t)) * up(x_t))`` over expert ``top_k_index[t, j]``.

    hidden_states [T, H]; top_k_index [T, k] (global expert ids); top_k_weights [T, k];
    gate_up_proj [E_local, 2*I, H] (gate rows, then up rows); down_proj [E_local, H, I].
    With ``group`` of size W, E = W * E_local and rank r owns experts [r*E_local, (r+1)*E_local); every rank of the
    group must call this together. Returns [T, H] in hidden_states' dtype, differentiable in hidden_states,
    top_k_weights, gate_up_proj and down_proj.

    ``dispatch`` names a backend ("mega_moe": fused Triton kernels; "torch": all_to_all + grouped GEMM baseline) or is
    a DispatchConfig with backend options. ``precision`` is one of "bf16" (the inputs' own dtype, no quantisation),
    "fp8", "mxfp8", "fp8_bwd"; the torch backend runs "bf16" and "fp8" (its own recipe: rowwise-scaled e4m3 through
    torch._scaled_grouped_mm, ``ops.fp8_grouped_mm``), mega_moe all four (blockwise fp8, ``ops.quantized_experts``).

    ``activation_clamp`` (prime-rl's experts option): None (or inf) for SwiGLU, or a limit c > 0 for the clamped
    SwiGLU ``a = silu(min(g, c)) * clamp(u, -c, c)``, g and u the gate and up halves of ``gate_up_proj`` x; its
    gradient is zero where g or u was clamped (torch.clamp's convention: it passes where g <= c and -c <= u <= c).
    Every backend and precision supports it; anything else than None or a number > 0 is an error.

    ``dispatch.num_sms`` (``[model.moe.dispatch] num_sms``; None: all): the SMs the call's kernels, and its
    backward's, may use, leaving the rest to work that overlaps the layer. The persistent kernels launch that many
    programs; on CUDA the whole call runs on a stream of a CUDA green context of that many SMs (torch's
    ``torch.cuda.green_contexts``; a torch without them is an error that says so), ordered with the caller's stream
    both ways. Results are bitwise those of ``num_sms = None``. More SMs than the GPU has is an error.
    """
    activation_clamp = check_activation_clamp(activation_clamp)
    options = dispatch if isinstance(dispatch, DispatchConfig) else None
    if options is None:
        if dispatch not in DISPATCH_TYPES:
            raise ValueError(f"dispatch = {dispatch!r} is not a backend; allowed values: {list(DISPATCH_TYPES)}")
        options = DispatchConfig(type=dispatch)
    if not options.deterministic:
        raise NotImplementedError(
            "[model.moe.dispatch] deterministic = false is not implemented: both backends sum in a fixed order "
            "(no float atomics); remove the key or set it to true"
        )
    if precision not in PRECISIONS:
        raise ValueError(f"precision = {precision!r} is not supported; allowed values: {list(PRECISIONS)}")
    shapes = check_expert_inputs(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, group, options.max_tokens_per_rank
    )
    on_host = not hidden_states.is_cuda
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    check_on_host = on_host or (options.validate_routing and not capturing)
    # mega_moe checks on the device itself (``check_ids``): its routing kernels flag out-of-range ids as they sort them
    # (skipping them as another rank's, so nothing is read out of bounds), and the assertion goes in after the layer's
    # kernels. It fails the call all the same (at the next sync), off the host's path to the first GEMM.
    check_on_device = not check_on_host and options.type == "mega_moe"
    if not check_on_device:
        check_expert_ids(top_k_index, shapes.num_experts, sync=check_on_host)
    check = {"check_ids": shapes.num_experts} if check_on_device else {}
    backend = get_backend(options.type)
    if options.num_sms is not None:  # every kernel of the call and of its backward on num_sms SMs (ops.sm_budget)
        backend = functools.partial(sm_limit(options.num_sms, hidden_states.device).run, backend)
    out = backend(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        precision=precision,
        group=group,
        options=options,
        activation_clamp=activation_clamp,
        **check,
    )
    return out
