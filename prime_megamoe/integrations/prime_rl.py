"""prime-rl's `mega_moe` dispatch backend: its config table and the token dispatcher its MoE layer builds.

prime-rl (not on the package index, so not imported here) builds one dispatcher per MoE layer with keyword arguments
(``num_experts, top_k, hidden_size, intermediate_size, num_shared_experts, activation_clamp, group,
max_tokens_per_rank, num_sms``), calls ``run`` from its MoE layer (or ``run_fused`` with the shared expert, as
``fuses_shared_expert`` says) and ``synchronize()`` after every layer. Its experts module (``GroupedExperts``) holds
``gate_proj`` / ``up_proj`` [E, I, H] and ``down_proj`` [E, H, I], and a fused ``gate_up_proj`` [E, 2I, H] (gate rows
first) that is None when its fusions are off; under expert parallelism these are DTensors sharded on dim 0, and under
FSDP2 mixed precision they may be fp32 while the activations are bf16. A routing score of exactly 0 marks a dropped
slot.

The layer runs as one ``torch.library.custom_op`` (``prime_megamoe::routed_experts``, with a fake implementation for
tracing) called under ``torch.compiler.disable``, so a compiled block runs it eagerly and selective activation
checkpointing can save its output. The op's forward keeps only its inputs; its backward runs the layer's forward
again with autograd and backpropagates through it. Under activation checkpointing that saves the op's output, the
recompute pass skips the op, so the experts run twice per step, as without the op. Without checkpointing, the backward
costs one more expert forward than ``fused_experts`` called directly.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field, ValidationError
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm.factory import make_transport
from ..comm.liveness import wait_bounds
from ..config import DispatchConfig, Precision
from ..functional import fused_experts
from ..ops.ep_stages import block_layouts
from ..ops.quantized_experts import quantized_format
from ..ops.sm_budget import sm_limit


class MegaMoEDispatchConfig(DispatchConfig):
    """prime-rl's ``[model.moe.dispatch]`` table for ``type = "mega_moe"``: its fields (``max_tokens_per_rank``, unset
    meaning the trainer's ``seq_len``; ``num_sms``; ``fp8``; ``capacity_factor``) with its defaults, plus this
    package's options (``precision``, which overrides ``fp8``; ``transport``; ``comm_timeout_s``; ...)."""

    type: Literal["mega_moe"] = "mega_moe"
    # "bf16" | "fp8" | "mxfp8" | "fp8_bwd"; None: "fp8" if fp8 else "bf16".
    precision: Precision | None = Field(default=None)

    @property
    def resolved_precision(self) -> str:
        if self.precision is not None:
            return self.precision
        return "fp8" if self.fp8 else "bf16"

    def to_dispatch_config(self, seq_len: int) -> DispatchConfig:
        """This package's ``DispatchConfig`` for a trainer whose sequences hold ``seq_len`` tokens (the capacity when
        ``max_tokens_per_rank`` is unset)."""
        fields = self.model_dump(exclude={"precision"})
        fields["max_tokens_per_rank"] = self.max_tokens_per_rank or seq_len
        return DispatchConfig(**fields)

    def dispatcher_options(self) -> dict:
        """The keyword arguments of ``MegaMoETokenDispatcher`` beyond prime-rl's own: ``precision`` and this
        package's backend options."""
        options = self.model_dump(exclude={"type", "max_tokens_per_rank", "num_sms", "precision", "fp8"})
        return {"precision": self.resolved_precision, **options}


# Dispatchers by the key their custom-op calls carry (an int: the op's arguments must be tensors or scalars).
_DISPATCHERS: dict[int, MegaMoETokenDispatcher] = {}
_KEYS = itertools.count()


def _to_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable: gradients flow back into the DTensor), a tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _activation_name(activation) -> str:
    return getattr(activation, "__name__", type(activation).__name__)


class MegaMoETokenDispatcher:
    """The fused routed experts of one MoE layer, as prime-rl's MoE layer calls a dispatcher.

    ``precision``: "bf16" (the activations' dtype), "fp8", "fp8_bwd" or "mxfp8"; ``options``: the fields of
    ``prime_megamoe.DispatchConfig`` (``transport``, ``comm_timeout_s``, ``fp8_pow2_scales``, ``validate_routing``,
    ``fp8``, ``capacity_factor``, ...). ``activation_clamp`` c: the clamped SwiGLU ``silu(min(g, c)) *
    clamp(u, -c, c)``; None (or inf) is plain SwiGLU. The symmetric-memory workspace of an expert-parallel group on
    CUDA is allocated here (every rank of ``group`` constructs its dispatchers together), for bf16 activations.
    ``num_sms``: the SMs the layer's kernels may use (None: all; ``DispatchConfig.num_sms``); on CUDA it is checked
    against the GPU and its green context is made here too.
    """

    fuses_shared_expert = True

    def __init__(
        self,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        num_shared_experts: int = 0,
        activation_clamp: float | None = None,
        group: dist.ProcessGroup | None,
        max_tokens_per_rank: int | None,
        num_sms: int | None = None,
        precision: str = "bf16",
        **options,
    ):
        if options.get("fp8") and precision == "bf16":
            precision = "fp8"  # prime-rl's switch; an explicit other precision wins
        try:
            self.options = DispatchConfig(
                type="mega_moe", max_tokens_per_rank=max_tokens_per_rank, num_sms=num_sms, **options
            )
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            allowed = sorted(set(DispatchConfig.model_fields) - {"type", "max_tokens_per_rank", "num_sms"})
            raise ValueError(
                f"MegaMoETokenDispatcher options: {problems}. Allowed options: {allowed} (prime_megamoe.DispatchConfig)"
            ) from None
        if activation_clamp is not None and math.isinf(activation_clamp) and activation_clamp > 0:
            activation_clamp = None
        if activation_clamp is not None and not activation_clamp > 0:
            raise ValueError(
                f"activation_clamp = {activation_clamp!r}: the SwiGLU limit must be a positive number, or None (or "
                "inf) for plain SwiGLU"
            )
        self.world = 1 if group is None else dist.get_world_size(group)
        if num_experts % self.world:
            raise ValueError(
                f"num_experts = {num_experts} is not divisible by the expert-parallel group's {self.world} ranks"
            )
        self.group = group if self.world > 1 else None
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_shared_experts = num_shared_experts
        self.activation_clamp = activation_clamp
        self.precision = precision
        self._checked_experts: set[int] = set()
        if self.options.num_sms is not None and torch.cuda.is_available():
            # Checked against the GPU's SMs and its green context made now, not in the first (checkpointed) forward
            sm_limit(self.options.num_sms, torch.device("cuda", torch.cuda.current_device()))
        self._reserve_workspace()
        self.key = next(_KEYS)
        _DISPATCHERS[self.key] = self

    def _reserve_workspace(self) -> None:
        """Allocate the group's symmetric-memory workspace now, not inside the first (checkpointed) forward."""
        if self.group is None or not torch.cuda.is_available() or dist.get_backend(self.group) == "gloo":
            return
        capacity = self.options.max_tokens_per_rank
        if capacity is None:
            return  # sized by the first call (prime-rl always passes its seq_len)
        device = torch.device("cuda", torch.cuda.current_device())
        bounds = wait_bounds(self.options.comm_timeout_s, self.options.comm_stall_timeout_s, device)
        transport = make_transport(self.options.transport, self.group, capacity, device, bounds)
        fmt = None if self.precision == "bf16" else quantized_format(self.precision, self.options.fp8_pow2_scales)
        for parts in block_layouts(self.precision, fmt, self.hidden_size, torch.bfloat16):
            transport.reserve(parts, (self.hidden_size, torch.bfloat16), self.top_k)

    def synchronize(self) -> None:
        """Nothing to wait for: the layer's work and its communication are ordered on the device streams."""

    @torch.compiler.disable
    def run(
        self,
        x: torch.Tensor,
        top_scores: torch.Tensor,
        selected_experts_indices: torch.Tensor,
        experts: nn.Module,
        *,
        score_before_experts: bool = False,
    ) -> torch.Tensor:
        """x [T, H]; top_scores and selected_experts_indices [T, k] or flat [T * k] -> [T, H]: the weighted sum of
        each token's routed experts (over the whole expert-parallel group). A score of exactly 0 drops its slot."""
        if score_before_experts:
            raise NotImplementedError(
                "score_before_experts = True (scaling the experts' inputs by the routing scores) is not implemented: "
                "the fused kernels weight the experts' outputs; set score_before_experts = false"
            )
        gate_up_proj, down_proj = self._expert_weights(experts)
        num_tokens = x.shape[0]
        if top_scores.numel() != num_tokens * self.top_k or selected_experts_indices.shape != top_scores.shape:
            raise ValueError(
                f"top_scores {tuple(top_scores.shape)} and selected_experts_indices "
                f"{tuple(selected_experts_indices.shape)} must both hold T * top_k = {num_tokens} * {self.top_k} "
                "entries ([T, k] or flat)"
            )
        weights = top_scores.reshape(num_tokens, self.top_k)
        index = selected_experts_indices.reshape(num_tokens, self.top_k)
        index = index.masked_fill(weights == 0, -1)  # a dropped slot: no expert, no contribution, no gradient
        return torch.ops.prime_megamoe.routed_experts(x, index, weights, gate_up_proj, down_proj, self.key)

    @torch.compiler.disable
    def run_fused(
        self,
        x: torch.Tensor,
        top_scores: torch.Tensor,
        selected_experts_indices: torch.Tensor,
        experts: nn.Module,
        shared_expert: nn.Module | None,
    ) -> torch.Tensor:
        """``run`` plus the shared expert's output (its own module: ``gate_proj`` / ``up_proj`` / ``down_proj``
        linears), computed beside the routed experts."""
        out = self.run(x, top_scores, selected_experts_indices, experts)
        if shared_expert is not None:
            out = out + shared_expert(x)
        return out

    def _expert_weights(self, experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj [E_l, 2I, H], down_proj [E_l, H, I]) of a prime-rl ``GroupedExperts``, local shards."""
        if id(experts) not in self._checked_experts:
            self._check_experts(experts)
            self._checked_experts.add(id(experts))
        fused = getattr(experts, "gate_up_proj", None)
        if fused is not None:
            gate_up_proj = _to_local(fused)
        else:
            gate_up_proj = torch.cat([_to_local(experts.gate_proj), _to_local(experts.up_proj)], dim=1)
        return gate_up_proj, _to_local(experts.down_proj)

    def _check_experts(self, experts: nn.Module) -> None:
        biases = [
            n for n in ("gate_proj_bias", "up_proj_bias", "down_proj_bias") if getattr(experts, n, None) is not None
        ]
        if biases:
            raise ValueError(f"the mega_moe experts have no biases, but the experts module has {biases}")
        if getattr(experts, "gate_up_proj", None) is None and getattr(experts, "gate_proj", None) is None:
            raise ValueError(
                "the mega_moe experts are gated (SwiGLU): the experts module has no gate_proj / gate_up_proj"
            )
        activation = getattr(experts, "activation", None)
        if activation is None:
            return
        name = _activation_name(activation)
        limit = getattr(activation, "limit", None)
        if "silu" not in name.lower():
            raise ValueError(
                f"the experts' activation {name} is not one the mega_moe kernels compute: they compute SwiGLU (silu) "
                "and its clamped form (activation_clamp)"
            )
        if limit is not None and limit != self.activation_clamp:
            raise ValueError(
                f"the experts' activation {name} clamps at {limit}, but the dispatcher was built with activation_clamp "
                f"= {self.activation_clamp}; build it with activation_clamp = {limit}"
            )
        if limit is None and self.activation_clamp is not None and "clamp" not in name.lower():
            raise ValueError(
                f"the dispatcher clamps SwiGLU at {self.activation_clamp}, but the experts' activation {name} does not "
                "clamp; build it with activation_clamp = None"
            )

    def forward_experts(self, x, index, weights, gate_up_proj, down_proj) -> torch.Tensor:
        """The layer itself (``fused_experts``), with the weights cast to the activations' dtype (differentiable:
        their gradients come back in the weights' own dtype)."""
        clamp = {} if self.activation_clamp is None else {"activation_clamp": self.activation_clamp}
        return fused_experts(
            x,
            index,
            weights,
            gate_up_proj.to(x.dtype),
            down_proj.to(x.dtype),
            dispatch=self.options,
            precision=self.precision,
            group=self.group,
            **clamp,
        )


@torch.library.custom_op("prime_megamoe::routed_experts", mutates_args=())
def _routed_experts_op(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    dispatcher_key: int,
) -> torch.Tensor:
    with torch.no_grad():
        return _DISPATCHERS[dispatcher_key].forward_experts(x, top_k_index, top_k_weights, gate_up_proj, down_proj)


@_routed_experts_op.register_fake
def _routed_experts_fake(x, top_k_index, top_k_weights, gate_up_proj, down_proj, dispatcher_key):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    x, top_k_index, top_k_weights, gate_up_proj, down_proj, dispatcher_key = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up_proj, down_proj)
    ctx.dispatcher_key = dispatcher_key


_DIFFERENTIABLE = (0, 2, 3, 4)  # x, top_k_weights, gate_up_proj, down_proj among the op's inputs


def _backward(ctx, grad_out):
    """The forward again, with autograd, then its backward: gradients of x, the scores and both weights."""
    inputs = list(ctx.saved_tensors)
    wanted = [i for i in _DIFFERENTIABLE if ctx.needs_input_grad[i]]
    for i in _DIFFERENTIABLE:
        inputs[i] = inputs[i].detach().requires_grad_(i in wanted)
    with torch.enable_grad():
        out = _DISPATCHERS[ctx.dispatcher_key].forward_experts(*inputs)
        grads = torch.autograd.grad(out, [inputs[i] for i in wanted], grad_out)
    result = [None] * 6
    for i, grad in zip(wanted, grads):
        result[i] = grad
    return tuple(result)


_routed_experts_op.register_autograd(_backward, setup_context=_setup_context)
