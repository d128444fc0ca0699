"""``[model.moe.dispatch] transport``: the transport object of a group, made once and reused by every call."""

from __future__ import annotations

import torch

from .liveness import WaitBounds, start_heartbeat
from .symmetric_memory import SymmetricMemoryTransport, release_workspaces
from .transport import CollectiveTransport, Transport

_TRANSPORTS: dict[tuple, tuple] = {}


def make_transport(name: str, group, capacity: int, device: torch.device, bounds: WaitBounds) -> Transport:
    """The transport named by ``[model.moe.dispatch] transport`` for this group and device, made once per (name,
    group, capacity, device, wait bounds) and reused by every call (a round starts and ends inside one call, so calls
    never share a round; a single call is host-bound, so the per-call setup is worth saving). Starts this process's
    heartbeat (``comm.liveness``), by which the peers' waits judge it alive."""
    key = (name, id(group), capacity, device, bounds)
    found = _TRANSPORTS.get(key)
    if found is not None:
        return found[1]
    start_heartbeat()
    transport = _make_transport(name, group, capacity, device, bounds)
    _TRANSPORTS[key] = (group, transport)  # the group is kept alive with its entry, so its id is never reused
    return transport


def release_transports(group) -> None:
    """Forget the transports (and their symmetric-memory workspaces) of ``group``: the next call makes new ones.
    Rounds in flight keep theirs alive until their autograd graphs are freed."""
    for key in [key for key, (g, _) in _TRANSPORTS.items() if g is group]:
        del _TRANSPORTS[key]
    release_workspaces(group)


def _make_transport(name: str, group, capacity: int, device: torch.device, bounds: WaitBounds) -> Transport:
    if name == "auto":
        name = "symmetric_memory" if device.type == "cuda" else "collectives"
    if name == "collectives":
        return CollectiveTransport(group, capacity, device, bounds)
    if name == "symmetric_memory":
        if device.type != "cuda":
            raise ValueError(
                f"[model.moe.dispatch] transport = 'symmetric_memory' needs CUDA tensors, but the layer runs on "
                f"{device}; use transport = 'collectives' (or 'auto')"
            )
        return SymmetricMemoryTransport(group, capacity, device, bounds)
    raise ValueError(f"[model.moe.dispatch] transport = {name!r}; allowed: 'auto', 'symmetric_memory', 'collectives'")
