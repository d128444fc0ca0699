"""The `torch` backend: what a trainer uses today, and the speed baseline.

Sort (token, slot) pairs by expert, exchange split sizes and rows with all_to_all (host-synced splits), run the
experts as grouped GEMMs, send the rows back and take the weighted sum. Autograd runs through all of it.

Precisions:

- ``bf16``: the GEMMs in the inputs' dtype: ``torch._grouped_mm`` on a GPU in bf16, an exact per-expert loop
  elsewhere.
- ``fp8``: every grouped GEMM (FC1 and FC2 forward, both dgrads, both weight gradients) with e4m3 operands and fp32
  **rowwise** scales (amax / 448 per row along that GEMM's reduction dim; per expert and column along the tokens for
  the weight gradients), through ``torch._scaled_grouped_mm`` (2D x 3D for forward and dgrads, 2D x 2D for the
  weight gradients) on Hopper, and in a reference form elsewhere (the same e4m3 values and scales, dequantised and
  multiplied per expert in fp32); see ``ops.fp8_grouped_mm``. This is the recipe of a torch all_to_all + fp8 grouped
  GEMM baseline (torchao's rowwise fp8 MoE training), not the fused backend's blockwise one (1x128 activations,
  128x128 weights: ``ops.quantized_experts``). Weights, activations and gradients stay in the caller's dtypes;
  SwiGLU (clamped or not) and the weighting run in them too.
- ``fp8_bwd`` and ``mxfp8``: not here (an error that says so).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.collectives import all_to_all_variable
from ..config import TORCH_PRECISIONS, DispatchConfig
from ..ops.fp8_grouped_mm import fp8_grouped_linear
from .registry import register_backend


def _use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm runs bf16 on Hopper and later; other dtypes and the CPU take the exact loop.
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9 and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], precision: str = "bf16") -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows each) times ``weight[e].T`` -> [sum(counts), N]."""
    if precision == "fp8":
        return fp8_grouped_linear(x, weight, counts)
    if _use_grouped_mm(x, weight):
        offs = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    chunks = torch.split(x, counts)
    outs = [F.linear(chunk, weight[e]) for e, chunk in enumerate(chunks)]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


def swiglu_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    counts: list[int],
    activation_clamp: float | None = None,
    precision: str = "bf16",
):
    """FC1, SwiGLU (clamped: silu(min(g, c)) * clamp(u, -c, c) with c = ``activation_clamp``), FC2 over rows already
    grouped by local expert; the GEMMs in ``precision`` ("bf16": the inputs' dtype, or "fp8")."""
    gate, up = grouped_linear(x, gate_up_proj, counts, precision).chunk(2, dim=-1)
    if activation_clamp is not None:
        # torch.clamp's gradient passes where g <= c and -c <= u <= c, the fused kernels' convention.
        gate = gate.clamp(max=activation_clamp)
        up = up.clamp(min=-activation_clamp, max=activation_clamp)
    return grouped_linear(F.silu(gate) * up, down_proj, counts, precision)


@register_backend("torch")
def torch_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    precision: str,
    group: dist.ProcessGroup | None,
    options: DispatchConfig,
    activation_clamp: float | None = None,
) -> torch.Tensor:
    if precision not in TORCH_PRECISIONS:
        raise NotImplementedError(
            f"precision = {precision!r} is not implemented by the torch backend, which runs 'bf16' (the inputs' "
            "dtype) and 'fp8' (rowwise-scaled e4m3 GEMMs) only; use [model.moe.dispatch] type = 'mega_moe' for "
            f"{precision!r}, or precision = 'fp8' or 'bf16' with the torch backend"
        )
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    num_local = gate_up_proj.shape[0]
    world = 1 if group is None else dist.get_world_size(group)
    num_experts = num_local * world

    # Empty slots (id -1) sort last, under a key past every expert, and are left out of the exchange and the GEMMs.
    flat_expert = top_k_index.reshape(-1).long()
    flat_expert = torch.where(flat_expert < 0, num_experts, flat_expert)
    order = torch.argsort(flat_expert, stable=True)  # (token, slot) pairs grouped by expert, then by pair index
    counts_per_expert = torch.bincount(flat_expert, minlength=num_experts + 1)[:num_experts]
    counts = counts_per_expert.tolist()  # a host sync, as the split sizes below need anyway
    order = order[: sum(counts)]
    token_of_pair = order // top_k
    send_rows = hidden_states[token_of_pair]

    if world == 1:
        out_sorted = swiglu_experts(send_rows, gate_up_proj, down_proj, counts, activation_clamp, precision)
    else:
        # Exchange how many rows each rank sends to each of the receiver's local experts.
        recv_counts = torch.empty_like(counts_per_expert)
        dist.all_to_all_single(recv_counts, counts_per_expert, group=group)
        send_counts = counts_per_expert.view(world, num_local)
        recv_counts = recv_counts.view(world, num_local)  # [source rank, local expert]
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        recv_rows = all_to_all_variable(send_rows, recv_splits, send_splits, group)
        # Received rows are ordered (source rank, local expert); the GEMMs want (local expert, source rank).
        source_major = torch.arange(recv_counts.numel(), device=recv_rows.device).view(world, num_local)
        segment_id = torch.repeat_interleave(
            source_major.reshape(-1), recv_counts.reshape(-1), output_size=sum(recv_splits)
        )
        segment_key = (segment_id % num_local) * world + segment_id // num_local
        expert_major = torch.argsort(segment_key, stable=True)
        out_expert_major = swiglu_experts(
            recv_rows[expert_major],
            gate_up_proj,
            down_proj,
            recv_counts.sum(0).tolist(),
            activation_clamp,
            precision,
        )
        out_recv = torch.empty_like(out_expert_major).index_copy(0, expert_major, out_expert_major)
        out_sorted = all_to_all_variable(out_recv, send_splits, recv_splits, group)

    out_pairs = out_sorted.new_zeros(num_tokens * top_k, hidden).index_copy(0, order, out_sorted)
    out_pairs = out_pairs.view(num_tokens, top_k, hidden)
    weighted = out_pairs * top_k_weights.to(out_pairs.dtype).unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)
