"""Two lanes for the quantised backward: its compute-bound GEMMs beside its bandwidth-bound passes.

The fp8 backward issues four GEMMs (FC2 dgrad, FC1 dgrad, dW1, dW2) and four passes that only move memory (the
SwiGLU backward's column outputs, the x^T and dy^T gather-quantise passes, the combine). One after another the passes
cost ~1.1 ms of a ~4.2 ms backward (Qwen3-30B-A3B, T = 16384, one H200). The warp-specialised GEMMs are persistent
kernels that fill each SM they run on (registers and shared memory), so a pass cannot share an SM with them; given
``programs`` = SMs - ``side_sms`` they leave that many SMs to the passes, which run on the caller's stream while the
GEMMs run on a high-priority stream of their own (the priority makes the GEMM's programs start first when both lanes
have work waiting, so the passes take the SMs left over, and all of them between GEMMs).

``PRIME_MEGAMOE_BACKWARD_SIDE_SMS`` sets ``side_sms`` (default ``DEFAULT_SIDE_SMS``); 0 issues everything on the
caller's stream in order (the lanes do nothing). On the CPU the lanes do nothing.

Memory across streams: a tensor one lane allocates and the other uses must not be reused by its own lane's next
allocation while the other lane may still read it; ``used_by_gemms`` / ``used_by_passes`` record such uses with the
caching allocator (``Tensor.record_stream``).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from .launch import _num_sms

SIDE_SMS_ENV = "PRIME_MEGAMOE_BACKWARD_SIDE_SMS"
DEFAULT_SIDE_SMS = 16


def side_sms() -> int:
    """SMs the backward's GEMMs leave to the passes beside them (``PRIME_MEGAMOE_BACKWARD_SIDE_SMS``)."""
    raw = os.environ.get(SIDE_SMS_ENV, str(DEFAULT_SIDE_SMS))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{SIDE_SMS_ENV}={raw!r}: must be a whole number of SMs >= 0 (0: no second lane)")
    return value


@functools.lru_cache(maxsize=None)
def _gemm_stream(device_index: int) -> torch.cuda.Stream:
    high, _ = torch.cuda.Stream.priority_range()  # (greatest priority, least): lower numbers run first
    return torch.cuda.Stream(device=device_index, priority=high)


class BackwardLanes:
    """``with lanes.gemms(): ...`` issues work on the GEMM lane after everything issued so far on the caller's stream;
    ``lanes.passes_wait()`` makes the caller's stream (the pass lane) wait for everything issued on the GEMM lane so
    far; ``lanes.close()`` joins the lanes at the end. ``programs`` bounds the GEMMs' persistent grids (None: no
    bound, the lanes are off)."""

    def __init__(self, device: torch.device):
        spare = side_sms() if device.type == "cuda" else 0
        sms = _num_sms(device) if spare else 0
        if spare >= sms > 0:
            raise ValueError(f"{SIDE_SMS_ENV}={spare}: the GPU has {sms} SMs; leave at least one to the GEMMs")
        self.enabled = spare > 0
        self.programs = sms - spare if self.enabled else None
        if self.enabled:
            self.passes = torch.cuda.current_stream(device)
            self.gemm = _gemm_stream(device.index if device.index is not None else torch.cuda.current_device())

    @contextlib.contextmanager
    def gemms(self):
        if not self.enabled:
            yield
            return
        self.gemm.wait_stream(self.passes)
        with torch.cuda.stream(self.gemm):
            yield

    def passes_wait(self) -> None:
        if self.enabled:
            self.passes.wait_stream(self.gemm)

    def _record(self, stream, tensors) -> None:
        if not self.enabled:
            return
        for t in tensors:
            if t is None:
                continue
            for part in (t.data, t.scale) if hasattr(t, "scale") else (t,):
                part.record_stream(stream)

    def used_by_gemms(self, *tensors) -> None:
        """Tensors (or QTensors) from the pass lane that the GEMM lane reads."""
        self._record(getattr(self, "gemm", None), tensors)

    def used_by_passes(self, *tensors) -> None:
        """Tensors (or QTensors) from the GEMM lane that the pass lane reads."""
        self._record(getattr(self, "passes", None), tensors)

    def close(self) -> None:
        self.passes_wait()
