"""scripts/gemm_ceiling.py: the six GEMM shapes it times are the layer's, by their operands and their FLOPs."""

from __future__ import annotations

import pytest

from prime_megamoe.bench import SHAPES
from tests.scripts import load_script


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
@pytest.mark.parametrize("tokens", [4096, 16384])
def test_layer_gemms_are_the_forward_and_backward_of_the_layer(shape, tokens):
    hidden, inter, experts, top_k = SHAPES[shape]
    rows = tokens * top_k // experts
    gemms = load_script("gemm_ceiling").layer_gemms(hidden, inter, rows)
    flops = {name: 2 * experts * m * k * n for name, (m, k, n) in gemms.items()}
    forward = tokens * top_k * 6 * hidden * inter  # the benchmark's count (prime_megamoe.bench)
    assert flops["FC1 (x W1^T)"] + flops["FC2 (a W2^T)"] == forward
    assert sum(flops.values()) == 3 * forward  # the backward does twice the forward's work
    # dW1 reduces over the expert's rows into [2I, H], dW2 into [H, I]; each dgrad maps back to its GEMM's input
    assert gemms["dW1 (dh^T x)"] == (2 * inter, rows, hidden)
    assert gemms["dW2 (dy^T aw)"] == (hidden, rows, inter)
    assert gemms["FC1 dgrad (dh W1)"][1:] == (2 * inter, hidden)
    assert gemms["FC2 dgrad (dy W2)"][1:] == (hidden, inter)
