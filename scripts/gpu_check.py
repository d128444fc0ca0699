"""Usage: python scripts/gpu_check.py [--shape qwen3-30b-a3b] [--tokens 4096]

Quick correctness check of the fused path on a GPU against a float64 reference (prints one line per case).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from prime_megamoe import fused_experts
from prime_megamoe.bench import SHAPES, make_inputs


def reference(x, index, weights, w1, w2):
    """float64 per-expert reference with autograd (index_add over each expert's rows)."""
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = torch.where(index == e)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[e].T
        o = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T
        out = out.index_add(0, tok, o * weights[tok, slot, None])
    return out


def check(shape, tokens, dtype, tol, device):
    x, index, weights, w1, w2 = make_inputs(shape, tokens, 0, 1, seed=tokens, dtype=dtype, device=device)
    # Ragged: expert 0 gets no rows, expert 1 half of all tokens (a token may then hold expert 1 twice, which the
    # math allows).
    index[index == 0] = 2
    index[: tokens // 2, 0] = 1
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)]
    dy = torch.randn_like(x)
    out = fused_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], dispatch="mega_moe")
    grads = torch.autograd.grad(out, leaves, dy)
    out2 = fused_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], dispatch="mega_moe")
    grads2 = torch.autograd.grad(out2, leaves, dy)
    bitwise = torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, weights, w1, w2)]
    ref = reference(ref_leaves[0], index, *ref_leaves[1:])
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    names = ["out", "dx", "dweights", "dW1", "dW2"]
    errs = []
    for name, a, b in zip(names, (out, *grads), (ref, *ref_grads)):
        errs.append((name, float((a.double() - b).norm() / b.norm())))
    worst = max(e for _, e in errs)
    status = "PASS" if worst <= tol and bitwise else "FAIL"
    print(
        f"{status} {shape} T={tokens} {dtype}: " + " ".join(f"{n}={e:.2e}" for n, e in errs) + f" bitwise={bitwise}",
        flush=True,
    )
    return status == "PASS"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 333, 4096])
    p.add_argument("--fp32-shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    ok = True
    for tokens in args.tokens:
        ok &= check(args.fp32_shape, tokens, torch.float32, 1e-5, args.device)
        ok &= check(args.shape, tokens, torch.bfloat16, 2e-2, args.device)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
