"""A short CPU training run: a tiny LM-like model whose MoE layer runs in fp8 tracks the same model in bf16.

Task: next-token prediction on sequences from a fixed random bigram chain (vocabulary 64). Model: embedding ->
RMSNorm -> router (softmax top-2 of 4 experts) -> SwiGLU experts (residual) -> RMSNorm -> unembedding. The expert
weights are bf16 parameters updated in place by AdamW, so every step bumps their ``_version`` and the fp8 run
re-quantises them once per step through the weight cache.

The bf16 reference runs the experts through the project's ``torch`` backend (the same math in bf16 with plain torch
ops; the interpreted bf16 Triton kernels are much slower on a CPU and are checked against the oracle elsewhere).
Both runs see the same batches from the same initial weights.
"""

import torch
import torch.nn.functional as F

from prime_megamoe import fused_experts
from prime_megamoe.kernels import tuning
from prime_megamoe.ops.quantized_experts import routed_experts_quantized, weight_cache_info
from prime_megamoe.routing import softmax_top_k

VOCAB, TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 128, 128, 4, 2
STEPS, LR = 8, 5e-3


def _chain():
    gen = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 2.5, dim=-1)


def _batch(chain, step):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(TOKENS + 1, dtype=torch.long)
    tokens[0] = torch.randint(0, VOCAB, (1,), generator=gen)
    for i in range(TOKENS):
        tokens[i + 1] = torch.multinomial(chain[tokens[i]], 1, generator=gen)
    return tokens[:-1], tokens[1:]


def _init():
    gen = torch.Generator().manual_seed(1)
    return {
        "emb": torch.randn(VOCAB, HIDDEN, generator=gen),
        "router": torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN**0.5,
        "w1": (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16(),
        "w2": (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5).bfloat16(),
        "unemb": torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5,
    }


def _train(precision: str) -> list[float]:
    chain = _chain()
    params = {name: torch.nn.Parameter(t.clone()) for name, t in _init().items()}
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        inputs, targets = _batch(chain, step)
        h = params["emb"][inputs]
        xn = F.rms_norm(h, (HIDDEN,))
        weights, index = softmax_top_k(xn @ params["router"].T, TOP_K)
        args = (xn.bfloat16(), index, weights.bfloat16(), params["w1"], params["w2"])
        if precision == "bf16":
            y = fused_experts(*args, dispatch="torch", precision="bf16")
        else:
            y = routed_experts_quantized(
                *args, expert_base=0, tile_m=tuning.tile_m(), precision=precision, pow2_scales=False
            )
        logits = F.rms_norm(h + y.float(), (HIDDEN,)) @ params["unemb"].T
        loss = F.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fp8_loss_tracks_bf16():
    reference = _train("bf16")
    before = weight_cache_info()
    fp8 = _train("fp8")
    rebuilt = weight_cache_info()["misses"] - before["misses"]
    print("\nbf16 " + " ".join(f"{v:.4f}" for v in reference) + "\nfp8  " + " ".join(f"{v:.4f}" for v in fp8))
    # Learning happens (the first loss is ~ln 64 = 4.16, the chain's entropy ~2).
    assert sum(reference[-3:]) / 3 < 0.9 * sum(reference[:3]) / 3
    # The fp8 curve stays within 2% of the bf16 one at every step (the same batches and initial weights).
    for step, (a, b) in enumerate(zip(fp8, reference)):
        assert abs(a - b) / b < 0.02, f"step {step}: fp8 loss {a:.4f} vs bf16 {b:.4f}"
    # In-place optimizer updates invalidate the quantised weights: four operands rebuilt per step, no more.
    assert rebuilt == 4 * STEPS
