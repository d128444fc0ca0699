"""Usage: torchrun --nproc-per-node 2 scripts/gpu_check_num_sms_ep.py [--num-sms N]

``[model.moe.dispatch] num_sms`` under expert parallelism on GPUs: for each transport (symmetric memory, NCCL
collectives) and precision (bf16, fp8), the layer's output and all four gradients with num_sms = N (default 120, or
half the GPU's SMs on a GPU of fewer than 128) must be bitwise those of num_sms = None. Then a stack of three layers
whose middle one has num_sms = N and the others none (forwards of all three, then their backwards in reverse, as in
training), so the transport's rounds alternate between the caller's stream and the green context's: bitwise the
output and gradients of the same stack without num_sms. Prints one PASS / FAIL line per check and rank.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from prime_megamoe import DispatchConfig, fused_experts
from prime_megamoe.bench import torchrun_group


def problem(rank, world, hidden=1024, inter=512, experts=32, top_k=8, tokens=2048, seed=77):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(world)]
    routes = [torch.softmax(torch.randn(tokens, experts, device="cuda", generator=gen), -1).topk(top_k) for _ in xs]
    routes = [(i, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)) for w, i in routes]
    w1 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5).to(torch.bfloat16)
    dy = [torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16) for _ in xs]
    shard = slice(rank * experts // world, (rank + 1) * experts // world)
    return xs[rank], routes[rank][0], routes[rank][1], w1[shard].contiguous(), w2[shard].contiguous(), dy[rank]


def layer(x, index, weights, w1, w2, dy, *, transport, precision, num_sms):
    leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    opts = DispatchConfig(
        type="mega_moe", max_tokens_per_rank=x.shape[0], transport=transport, num_sms=num_sms, comm_timeout_s=30
    )
    out = fused_experts(leaves[0], index, *leaves[1:], dispatch=opts, precision=precision, group=dist.group.WORLD)
    grads = torch.autograd.grad(out, leaves, dy)
    torch.cuda.synchronize()
    return [out.detach(), *grads]


def stack(x, index, weights, w1, w2, dy, *, transport, budgets):
    """Three layers on one set of weights, each with its own num_sms; forwards first, then the backwards."""
    leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    h = leaves[0]
    for num_sms in budgets:
        opts = DispatchConfig(
            type="mega_moe", max_tokens_per_rank=x.shape[0], transport=transport, num_sms=num_sms, comm_timeout_s=30
        )
        h = fused_experts(h, index, *leaves[1:], dispatch=opts, group=dist.group.WORLD)
    grads = torch.autograd.grad(h, leaves, dy)
    torch.cuda.synchronize()
    return [h.detach(), *grads]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--num-sms", type=int, default=None)
    args = p.parse_args()
    torchrun_group()  # launched with two ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    n = args.num_sms or (120 if total > 128 else max(8, total // 2 // 8 * 8))
    args_ = problem(rank, world)
    ok = True
    for transport in ("symmetric_memory", "collectives"):
        for precision in ("bf16", "fp8"):
            plain = layer(*args_, transport=transport, precision=precision, num_sms=None)
            limited = layer(*args_, transport=transport, precision=precision, num_sms=n)
            same = [torch.equal(a, b) for a, b in zip(plain, limited)]
            ok &= all(same)
            print(
                f"{'PASS' if all(same) else 'FAIL'} rank {rank} {transport} {precision} num_sms = {n} vs None: "
                f"bitwise {same}",
                flush=True,
            )
        plain = stack(*args_, transport=transport, budgets=(None, None, None))
        mixed = stack(*args_, transport=transport, budgets=(None, n, None))
        same = [torch.equal(a, b) for a, b in zip(plain, mixed)]
        ok &= all(same)
        print(
            f"{'PASS' if all(same) else 'FAIL'} rank {rank} {transport} stack num_sms (None, {n}, None) vs none: "
            f"bitwise {same}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
