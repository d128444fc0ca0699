"""Device-side flags between the GPUs of an expert-parallel group (symmetric memory; CUDA only).

A flag holds the number of the last exchange round whose block it announces. Rounds only grow, so flags are never
reset (no reset can race a late reader): a writer stores the round number after the block it announces has landed,
with a system-scope fence before the store (a stream write-value operation, ``comm.symmetric_memory``); a reader
spins with acquire semantics at system scope until the flag reaches the round it needs. A reader that waits longer
than its timeout prints who it was waiting for and traps, which turns into a CUDA error on the host: an error, never
a hang.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def wait_flags_kernel(flags_ptr, value, rank, channel, timeout_ns, WORLD: tl.constexpr, WORLD_BLOCK: tl.constexpr):
    """Spin until flags[channel * WORLD + q] >= value for every peer q != rank (acquire, system scope); after
    ``timeout_ns`` print the rank, the first late peer, the channel and the round, then trap."""
    peers = tl.arange(0, WORLD_BLOCK)
    mask = (peers < WORLD) & (peers != rank)
    ptrs = flags_ptr + channel * WORLD + peers
    start = _now_ns()
    pending = 1
    while pending > 0:
        seen = tl.atomic_add(ptrs, tl.zeros_like(peers), mask=mask, sem="acquire", scope="sys")
        waiting = mask & (seen < value)
        pending = tl.sum(waiting.to(tl.int32), 0)
        if pending > 0:
            if _now_ns() - start > timeout_ns:
                late = tl.min(tl.where(waiting, peers, WORLD), 0)
                tl.device_print(
                    "prime_megamoe expert-parallel wait timed out (comm_timeout_s); channel 0 = a peer's rows never "
                    "published, 1 = a peer's results never returned. rank, peer, channel, round:",
                    rank,
                    late,
                    channel,
                    value,
                )
                tl.inline_asm_elementwise("mov.u32 $0, 0; trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
                pending = 0
