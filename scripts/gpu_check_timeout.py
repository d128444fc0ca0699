"""Usage: torchrun --nproc-per-node 2 scripts/gpu_check_timeout.py

A peer that never arrives is an error, not a hang: rank 1 skips the layer, rank 0 must fail after its timeout
(expected: rank 0 exits non-zero within seconds, printing the timed-out wait's rank and peer).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from prime_megamoe import DispatchConfig, fused_experts
from prime_megamoe.bench import torchrun_group


def main():
    torchrun_group()  # launched with two ranks
    rank = dist.get_rank()
    hidden, inter, experts, top_k, tokens = 256, 128, 8, 2, 64
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, experts, (tokens, top_k), device="cuda")
    weights = torch.rand(tokens, top_k, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(experts // 2, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(experts // 2, hidden, inter, device="cuda", dtype=torch.bfloat16)
    opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=tokens, transport="symmetric_memory", comm_timeout_s=3)
    fused_experts(x, index, weights, w1, w2, dispatch=opts, group=dist.group.WORLD)  # both ranks: workspace, round 1
    torch.cuda.synchronize()
    print(f"rank {rank}: first call completed", flush=True)
    dist.barrier()
    if rank == 1:
        time.sleep(30)  # never joins round 2
        print("rank 1: exiting without calling the layer again", flush=True)
        os._exit(0)
    began = time.time()
    try:
        fused_experts(x, index, weights, w1, w2, dispatch=opts, group=dist.group.WORLD)
        torch.cuda.synchronize()
    except RuntimeError as err:
        print(f"rank 0: error after {time.time() - began:.1f} s: {str(err).splitlines()[0]}", flush=True)
        os._exit(3)
    print("rank 0: FAIL, the call completed without its peer", flush=True)
    os._exit(1)


if __name__ == "__main__":
    main()
