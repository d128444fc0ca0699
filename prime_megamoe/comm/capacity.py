"""How many rows each rank's block holds in an expert-parallel exchange (``max_tokens_per_rank``).

Set: a hard capacity (more tokens on a rank is an error naming the key). Unset: the most tokens any rank of the
group has passed in one call so far, agreed on the host at every call (``collectives.host_max``: no device sync),
rounded up to a multiple of ``ROUND_ROWS``. When a call brings more, the exchange's buffers grow once: the group's
transports for the smaller capacity are released, and the next transport allocates (and, over symmetric memory,
rendezvouses) anew. That must not happen inside a CUDA graph capture (it would allocate and synchronise there): a
capture that would need it is an error asking for ``max_tokens_per_rank``.
"""

from __future__ import annotations

import logging

import torch

from .collectives import host_max
from .factory import release_transports
from .liveness import WaitBounds

log = logging.getLogger("prime_megamoe")

ROUND_ROWS = 64
_GROWN: dict[int, tuple] = {}  # id(group) -> (group, capacity so far)


def exchange_capacity(configured: int | None, group, hidden_states: torch.Tensor, bounds: WaitBounds) -> int:
    """Rows per rank's block for this call of the group's layer (see the module docstring)."""
    num_tokens = hidden_states.shape[0]
    if configured is not None:
        return configured
    most = host_max(num_tokens, group, bounds, "agreement on max_tokens_per_rank")
    _, current = _GROWN.get(id(group), (group, 0))
    if most <= current:
        return current
    if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"a call with {most} tokens on a rank needs larger expert-parallel buffers (they hold {current} rows a "
            f"rank), which cannot be allocated inside a CUDA graph capture; set [model.moe.dispatch] "
            f"max_tokens_per_rank to the most tokens a rank passes, or run a call of that size before capturing"
        )
    grown = -(-most // ROUND_ROWS) * ROUND_ROWS
    if current:
        release_transports(group)
        log.info(
            "prime_megamoe: expert-parallel buffers grow from %d to %d rows a rank (a call brought %d tokens; set "
            "[model.moe.dispatch] max_tokens_per_rank to size them once)",
            current,
            grown,
            most,
        )
    _GROWN[id(group)] = (group, grown)
    return grown
