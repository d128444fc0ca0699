"""Device-side flags between the GPUs of an expert-parallel group (symmetric memory; CUDA only).

A flag holds the number of the last exchange round whose block it announces. Rounds only grow, so flags are never
reset (no reset can race a late reader): a writer stores the round number after the block it announces has landed,
with a system-scope fence before the store (a stream write-value operation, ``comm.symmetric_memory``); a reader
spins with acquire semantics at system scope until the flag reaches the round it needs.

A reader judges the peers it waits for by their heartbeats, not by the time it has waited: each peer advances its
slot of this rank's heartbeat region (row 0 from a host thread, row 1 from its own wait kernels, which this kernel
also does for the peers while it spins), and a peer's clock restarts whenever either changes. A reader whose peer has
been silent for ``silence_ns`` (gone), or that has waited ``stall_ns`` in all (a live peer never joined), prints who it
was waiting for and traps, which turns into a CUDA error on the host: an error, never a hang, and never for a peer
that is merely slow.
"""

from __future__ import annotations

import triton
import triton.language as tl

KERNEL_BEAT_NS = 1 << 20  # how often a spinning wait kernel advances its rank's heartbeat (about a millisecond)


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("mov.u32 $0, 0; trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_flags_kernel(
    flags_ptr,
    beats_ptr,
    peer_beats_ptr,
    value,
    rank,
    channel,
    silence_ns,
    stall_ns,
    WORLD: tl.constexpr,
    WORLD_BLOCK: tl.constexpr,
    BEAT_NS: tl.constexpr,
):
    """Spin until flags[channel * WORLD + q] >= value for every peer q != rank (acquire, system scope).

    beats_ptr: this rank's heartbeat region [2, WORLD] int32 (slot q of each row written by peer q); peer_beats_ptr:
    [WORLD] int64, the address of each peer's region, whose row 1 slot ``rank`` this kernel advances every
    ``BEAT_NS`` (``KERNEL_BEAT_NS``) while it spins (this rank is alive, waiting). A peer waited for whose heartbeat
    stood still for ``silence_ns``: print the rank, that peer, the channel and the round, then trap; likewise after
    ``stall_ns`` of waiting in all."""
    peers = tl.arange(0, WORLD_BLOCK)
    mask = (peers < WORLD) & (peers != rank)
    zeros = tl.zeros_like(peers)
    ptrs = flags_ptr + channel * WORLD + peers
    host_beats = beats_ptr + peers
    kernel_beats = beats_ptr + WORLD + peers
    own_slots = tl.load(peer_beats_ptr + peers, mask=mask, other=0).to(tl.pointer_type(tl.int32)) + WORLD + rank
    start = _now_ns()
    host = tl.atomic_add(host_beats, zeros, mask=mask, sem="relaxed", scope="sys")
    kernel = tl.atomic_add(kernel_beats, zeros, mask=mask, sem="relaxed", scope="sys")
    heard = tl.zeros([WORLD_BLOCK], dtype=tl.int64) + start  # when each peer's heartbeat last changed
    beat_at = start - BEAT_NS - 1  # beat at the first wait
    pending = 1
    while pending > 0:
        seen = tl.atomic_add(ptrs, zeros, mask=mask, sem="acquire", scope="sys")
        waiting = mask & (seen < value)
        pending = tl.sum(waiting.to(tl.int32), 0)
        if pending > 0:
            now = _now_ns()
            if now - beat_at > BEAT_NS:
                tl.atomic_xchg(own_slots, zeros + (now >> 20).to(tl.int32), mask=mask, sem="relaxed", scope="sys")
                beat_at = now
            host_now = tl.atomic_add(host_beats, zeros, mask=mask, sem="relaxed", scope="sys")
            kernel_now = tl.atomic_add(kernel_beats, zeros, mask=mask, sem="relaxed", scope="sys")
            heard = tl.where((host_now != host) | (kernel_now != kernel), now, heard)
            host = host_now
            kernel = kernel_now
            silent = waiting & (now - heard > silence_ns)
            if tl.sum(silent.to(tl.int32), 0) > 0:
                gone = tl.min(tl.where(silent, peers, WORLD), 0)
                tl.device_print(
                    "prime_megamoe expert-parallel wait: a peer showed no heartbeat for comm_timeout_s (it is gone); "
                    "channel 0 = its rows never published, 1 = its results never returned. rank, peer, channel, round:",
                    rank,
                    gone,
                    channel,
                    value,
                )
                _trap()
                pending = 0
            elif now - start > stall_ns:
                late = tl.min(tl.where(waiting, peers, WORLD), 0)
                tl.device_print(
                    "prime_megamoe expert-parallel wait outlasted comm_stall_timeout_s with the peer alive (it never "
                    "joined: do all ranks call the layer equally often?); channel 0 = rows, 1 = results. "
                    "rank, peer, channel, round:",
                    rank,
                    late,
                    channel,
                    value,
                )
                _trap()
                pending = 0
