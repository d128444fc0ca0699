"""A prime-rl-style token dispatcher: ``run(...)`` and ``synchronize()``, built from config."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.liveness import start_heartbeat
from ..config import MoEConfig
from ..functional import fused_experts


class TokenDispatcher:
    """Routes tokens through a set of grouped experts with the configured backend and precision.

    ``experts`` is any module with ``gate_up_proj`` [E_local, 2*I, H] and ``down_proj`` [E_local, H, I]
    (``prime_megamoe.layers.GroupedExperts`` or transformers' Qwen3MoeExperts).
    """

    def __init__(self, moe: MoEConfig, group: dist.ProcessGroup | None = None):
        self.moe = moe
        self.group = group
        if group is not None and dist.get_world_size(group) > 1:
            start_heartbeat()  # the peers' waits judge this rank alive by it, from before its first layer call

    @property
    def backend(self) -> str:
        return self.moe.dispatch.type

    def run(
        self,
        x: torch.Tensor,
        top_scores: torch.Tensor,
        selected_experts_indices: torch.Tensor,
        experts: torch.nn.Module,
        *,
        score_before_experts: bool = False,
    ) -> torch.Tensor:
        """x [T, H], top_scores and selected_experts_indices [T, k] -> [T, H] (sum of weighted expert outputs)."""
        if score_before_experts:
            raise NotImplementedError(
                "score_before_experts=True (scaling expert inputs instead of outputs) is not implemented by any "
                "backend; Qwen3-MoE weights outputs: pass score_before_experts=False"
            )
        return fused_experts(
            x,
            selected_experts_indices,
            top_scores,
            experts.gate_up_proj,
            experts.down_proj,
            dispatch=self.moe.dispatch,
            precision=self.moe.precision,
            group=self.group,
        )

    def synchronize(self) -> None:
        """Block the host until the work this dispatcher issued has finished.

        Both backends issue communication in stream order, so this waits for the current device stream."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()


def build_dispatcher(moe: MoEConfig, group: dist.ProcessGroup | None = None) -> TokenDispatcher:
    """The dispatcher for ``[model.moe]``; ``group`` is the expert-parallel group (size ``moe.ep``)."""
    size = 1 if group is None else dist.get_world_size(group)
    if size != moe.ep:
        raise ValueError(
            f"[model.moe] ep = {moe.ep} but the expert-parallel group has {size} ranks; set ep to the group size "
            f"or build the group with {moe.ep} ranks"
        )
    return TokenDispatcher(moe, group)
