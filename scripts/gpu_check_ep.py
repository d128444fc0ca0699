"""Usage: torchrun --nproc-per-node 2 scripts/gpu_check_ep.py

Expert-parallel correctness on GPUs: mega_moe over NCCL against a float64 reference of the whole layer.
Both transports run (symmetric memory and NCCL collectives), each twice: results must match the reference, be
bitwise identical run to run, and bitwise identical between the transports. Then a stack of three layers (forwards
of all three, then their backwards in reverse, as in training) must give bitwise the same output and gradients over
both transports: a transport that reused a buffer a later round still reads would show up there.
Every rank draws the same global problem (all ranks' tokens, all experts), runs its shard, and compares its output,
dx and d top-k weights with the reference for its tokens, and its expert-weight gradients with the reference
gradients of its experts (which sum over every rank's tokens). Routing is ragged: the last rank's experts are never
chosen (that rank receives no rows), expert 1 takes half of all tokens, and ranks hold different token counts; in a
third case the last rank also sends no tokens. The quantised precisions (fp8, fp8_bwd, mxfp8) run the same checks
against the reference within the fp8 bound (their blocks travel as e4m3 rows with their scales).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpu_check import reference  # noqa: E402  (scripts/ is on sys.path when run as a script)

from prime_megamoe import DispatchConfig, fused_experts
from prime_megamoe.bench import torchrun_group


def main():
    torchrun_group()  # launched with two ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = True
    quantized = [(p, torch.bfloat16, 8e-2, (1024, 512, 32, 8, 2048), False) for p in ("fp8", "fp8_bwd", "mxfp8")]
    for precision, dtype, tol, (hidden, inter, experts, top_k, tokens), empty_sender in [
        ("bf16", torch.float32, 1e-5, (256, 128, 16, 4, 333), False),
        ("bf16", torch.bfloat16, 2e-2, (1024, 512, 32, 8, 2048), False),
        ("bf16", torch.float32, 1e-5, (256, 128, 16, 4, 200), True),  # the last rank sends no tokens at all
        *quantized,
    ]:
        gen = torch.Generator(device="cuda").manual_seed(1234)
        counts = [tokens - 37 * r for r in range(world)]
        if empty_sender:
            counts[-1] = 0
        xs = [torch.randn(c, hidden, device="cuda", generator=gen).to(dtype) for c in counts]
        logits = [torch.randn(c, experts, device="cuda", generator=gen) for c in counts]
        per_rank = experts // world
        for lg in logits:
            lg[:, (world - 1) * per_rank :] = -1e9  # the last rank's experts are never chosen
            lg[: lg.shape[0] // 2, 1] += 50.0  # expert 1 takes half of all tokens
        routes = [torch.softmax(lg, -1).topk(top_k) for lg in logits]
        routes = [(i, (w / w.sum(-1, keepdim=True)).to(dtype)) for w, i in routes]
        w1 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5).to(dtype)
        dys = [torch.randn(c, hidden, device="cuda", generator=gen).to(dtype) for c in counts]

        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        runs = {}
        for transport in ("symmetric_memory", "collectives"):
            for attempt in range(2):
                leaves = [t.clone().requires_grad_() for t in (xs[rank], routes[rank][1], w1[shard], w2[shard])]
                opts = DispatchConfig(
                    type="mega_moe", max_tokens_per_rank=tokens, transport=transport, comm_timeout_s=30
                )
                out = fused_experts(
                    leaves[0], routes[rank][0], *leaves[1:], dispatch=opts, precision=precision, group=dist.group.WORLD
                )
                grads = torch.autograd.grad(out, leaves, dys[rank])
                runs[transport, attempt] = [out.detach(), *grads]
                torch.cuda.synchronize()
                print(f"rank {rank}: {precision} {dtype} {transport} run {attempt} done", flush=True)
        first = runs["symmetric_memory", 0]
        same = {key: all(torch.equal(a, b) for a, b in zip(first, val)) for key, val in runs.items()}
        if not all(same.values()):
            ok = False
            print(
                f"FAIL rank {rank} {precision} {dtype}: not bitwise identical across runs/transports: {same}",
                flush=True,
            )
        out, grads = first[0], first[1:]

        dw1 = torch.zeros_like(w1, dtype=torch.float64)
        dw2 = torch.zeros_like(w2, dtype=torch.float64)
        for r in range(world):
            ref_leaves = [t.detach().double().requires_grad_() for t in (xs[r], routes[r][1], w1, w2)]
            ref = reference(ref_leaves[0], routes[r][0], *ref_leaves[1:])
            if counts[r]:
                g = torch.autograd.grad(ref, ref_leaves, dys[r].double())
            else:  # a rank without tokens: its output is empty and adds nothing to any gradient
                g = [torch.zeros_like(t) for t in ref_leaves]
            dw1 += g[2]
            dw2 += g[3]
            if r == rank:
                mine = (ref, g[0], g[1])
        pairs = list(zip(("out", "dx", "dweights"), (out, grads[0], grads[1]), mine))
        pairs += [("dW1", grads[2], dw1[shard]), ("dW2", grads[3], dw2[shard])]
        errs = {n: float((a.detach().double() - b).norm() / b.norm().clamp_min(1e-30)) for n, a, b in pairs}
        status = "PASS" if max(errs.values()) <= tol else "FAIL"
        ok &= status == "PASS"
        print(
            f"{status} rank {rank}/{world} {precision} {dtype} T={counts[rank]}: "
            + " ".join(f"{k}={v:.2e}" for k, v in errs.items()),
            flush=True,
        )
    ok &= check_layer_stack(rank, world)
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


def check_layer_stack(rank: int, world: int, layers: int = 3) -> bool:
    """Three residual MoE layers, forward through all, backward through all: both transports, bitwise equal."""
    hidden, inter, experts, top_k, tokens = 1024, 512, 32, 8, 2048 - 37 * rank
    gen = torch.Generator(device="cuda").manual_seed(99 + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    dy = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    per_rank = experts // world
    params = []
    for _ in range(layers):
        w, i = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=gen), -1).topk(top_k)
        w1 = (torch.randn(per_rank, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5).bfloat16()
        w2 = (torch.randn(per_rank, hidden, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
        params.append((i, (w / w.sum(-1, keepdim=True)).bfloat16(), w1, w2))
    runs = {}
    for transport in ("symmetric_memory", "collectives"):
        opts = DispatchConfig(type="mega_moe", max_tokens_per_rank=2048, transport=transport, comm_timeout_s=30)
        leaves = [x.clone().requires_grad_()]
        y = leaves[0]
        for index, weights, w1, w2 in params:
            layer = [t.clone().requires_grad_() for t in (weights, w1, w2)]
            leaves += layer
            y = y + fused_experts(y, index, *layer, dispatch=opts, group=dist.group.WORLD)
        runs[transport] = [y.detach(), *torch.autograd.grad(y, leaves, dy)]
        torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(runs["symmetric_memory"], runs["collectives"]))
    finite = all(bool(t.float().isfinite().all()) for t in runs["symmetric_memory"])
    status = "PASS" if same and finite else "FAIL"
    print(
        f"{status} rank {rank}/{world} stack of {layers} layers: transports bitwise equal {same}, finite {finite}",
        flush=True,
    )
    return same and finite


if __name__ == "__main__":
    main()
