"""Usage: torchrun --nproc-per-node 2 scripts/gpu_check_timeout.py

Waits over symmetric memory are bounded by the peers' liveness, not by their speed (``comm.liveness``):

1. a slow peer: rank 1 joins a round 3 x comm_timeout_s late while alive; rank 0 must complete it without an error
   (rank 1's heartbeat keeps rank 0's wait kernel from trapping);
2. a dead peer: rank 1 dies (os._exit) before the next round; rank 0's wait kernel must trap within the bound, printing
   the rank, the peer, the channel and the round (the host sees a CUDA error at its synchronize).

torchrun --nproc-per-node 2 scripts/gpu_check_timeout.py     (expected: rank 0 prints "slow peer: completed", then
                                                              "dead peer: error after <= ~3 s", and exits with 3)
Exit codes of rank 0: 3 = both checks passed; 1 = the round completed without its (dead) peer; 2 = the slow peer was
taken for a dead one (an error in check 1); 4 = the dead peer's error came later than the bound allows.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from prime_megamoe import DispatchConfig, fused_experts
from prime_megamoe.bench import torchrun_group

BOUND_S = 3.0
SLACK_S = 3.0  # the heartbeat's interval, the trap's way to the host, the launch of the call


def main():
    torchrun_group()  # launched with two ranks
    rank = dist.get_rank()
    hidden, inter, experts, top_k, tokens = 256, 128, 8, 2, 64
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, experts, (tokens, top_k), device="cuda")
    weights = torch.rand(tokens, top_k, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(experts // 2, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(experts // 2, hidden, inter, device="cuda", dtype=torch.bfloat16)
    opts = DispatchConfig(
        type="mega_moe", max_tokens_per_rank=tokens, transport="symmetric_memory", comm_timeout_s=BOUND_S
    )

    def call():
        fused_experts(x, index, weights, w1, w2, dispatch=opts, group=dist.group.WORLD)
        torch.cuda.synchronize()

    call()  # both ranks: workspace, heartbeats, round 1
    print(f"rank {rank}: first call completed", flush=True)
    dist.barrier()

    # 1. A slow peer.
    began = time.time()
    if rank == 1:
        time.sleep(3 * BOUND_S)  # alive: its heartbeat thread keeps beating
    try:
        call()
    except RuntimeError as err:
        print(f"rank {rank}: FAIL, slow peer taken for a dead one after {time.time() - began:.1f} s: {err}", flush=True)
        os._exit(2)
    print(f"rank {rank}: slow peer: completed after {time.time() - began:.1f} s (bound {BOUND_S:g} s)", flush=True)
    dist.barrier()

    # 2. A dead peer.
    if rank == 1:
        print("rank 1: dying (os._exit) without calling the layer again", flush=True)
        os._exit(0)  # exit code 0: torchrun keeps rank 0 running instead of tearing it down
    began = time.time()
    try:
        call()
    except RuntimeError as err:
        elapsed = time.time() - began
        ok = elapsed <= BOUND_S + SLACK_S
        verdict = "" if ok else f" FAIL, later than {BOUND_S + SLACK_S:g} s"
        print(f"rank 0: dead peer: error after {elapsed:.1f} s{verdict}: {str(err).splitlines()[0]}", flush=True)
        os._exit(3 if ok else 4)
    print("rank 0: FAIL, the call completed without its peer", flush=True)
    os._exit(1)


if __name__ == "__main__":
    main()
