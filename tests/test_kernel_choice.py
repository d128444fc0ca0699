"""The timed choice between kernel families (``ops/kernel_choice.py``) and the layer GEMMs that ask for it
(``launch.FASTEST``).

On the CPU the choosing is checked with a stand-in clock: the fastest candidate wins, the choice is written to the
cache file and read back by a fresh process state without timing, a torn file or a stale choice is timed again, and
nothing is timed where timing cannot be done. On a Hopper GPU the families are checked to be bitwise equal at the
layer's shapes (so a choice never changes a result) and ``use_ws=FASTEST`` to give those bits."""

from __future__ import annotations

import json

import pytest
import torch

from prime_megamoe.kernels.fp8_gemm import QTILE_M
from prime_megamoe.ops import kernel_choice, launch
from prime_megamoe.ops.routing_plan import build_routing_plan
from tests.oracle import ragged_routing

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (the warp-specialised kernels)")
BIG = 1 << 40  # multiply-adds above tuning.SMALL_PROBLEM


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_choice.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("PRIME_MEGAMOE_AUTOTUNE", raising=False)
    kernel_choice.forget()
    yield tmp_path
    kernel_choice.forget()


@pytest.fixture
def fake_clock(cache_dir, monkeypatch):
    """Timing allowed on the CPU, a fixed key per op, and times from ``clock[name]``; counts the timings."""
    clock = {"triton": 2.0, "ws": 1.0}
    timed = []

    def time_candidates(candidates):
        timed.append(sorted(candidates))
        for run in candidates.values():
            run()
        return {name: clock[name] for name in candidates}

    monkeypatch.setattr(kernel_choice, "chooses_on", lambda device: True)
    monkeypatch.setattr(kernel_choice, "may_time", lambda device, work: True)
    monkeypatch.setattr(kernel_choice, "_full_key", lambda op, key, device: f"{op} {key}")
    monkeypatch.setattr(kernel_choice, "time_candidates", time_candidates)
    return clock, timed


def _candidates(calls):
    return {"triton": lambda: calls.append("triton"), "ws": lambda: calls.append("ws")}


def test_fastest_times_once_then_reads_the_cache_file(fake_clock, cache_dir):
    clock, timed = fake_clock
    calls = []
    cpu = torch.device("cpu")
    assert kernel_choice.fastest("gemm", (1, 2), _candidates(calls), cpu, BIG) == "ws"
    assert timed == [["triton", "ws"]] and calls == ["triton", "ws"]
    entry = json.loads(kernel_choice.cache_path().read_text())["gemm (1, 2)"]
    assert entry == {"chosen": "ws", "ms": {"triton": 2.0, "ws": 1.0}}
    # The same process: no second timing, even where the clock would now say otherwise
    clock.update(triton=0.5)
    assert kernel_choice.fastest("gemm", (1, 2), _candidates(calls), cpu, BIG) == "ws"
    # A new process (nothing in memory) takes the file's choice untimed; another key is timed
    kernel_choice.forget()
    assert kernel_choice.fastest("gemm", (1, 2), _candidates(calls), cpu, BIG) == "ws"
    assert kernel_choice.fastest("gemm", (3, 4), _candidates(calls), cpu, BIG) == "triton"
    assert len(timed) == 2
    on_disk = json.loads(kernel_choice.cache_path().read_text())
    assert {k: v["chosen"] for k, v in on_disk.items()} == {"gemm (1, 2)": "ws", "gemm (3, 4)": "triton"}


def test_a_torn_cache_file_or_a_stale_choice_is_timed_again(fake_clock, cache_dir):
    _, timed = fake_clock
    path = kernel_choice.cache_path()
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the kernel-choice cache"):
        assert kernel_choice.fastest("gemm", (1,), _candidates([]), torch.device("cpu"), BIG) == "ws"
    assert json.loads(path.read_text())["gemm (1,)"]["chosen"] == "ws"
    # A choice naming a kernel the caller no longer offers
    path.write_text(json.dumps({"gemm (2,)": {"chosen": "gone", "ms": {}}}))
    kernel_choice.forget()
    assert kernel_choice.fastest("gemm", (2,), _candidates([]), torch.device("cpu"), BIG) == "ws"
    assert len(timed) == 2


def test_a_choice_made_is_used_where_no_timing_may_run(fake_clock, monkeypatch):
    """While a CUDA graph is captured (or for a small problem) a shape's choice is used, a new shape runs the first
    candidate untimed and uncached."""
    _, timed = fake_clock
    cpu = torch.device("cpu")
    assert kernel_choice.fastest("gemm", (1,), _candidates([]), cpu, BIG) == "ws"
    monkeypatch.setattr(kernel_choice, "may_time", lambda device, work: False)
    assert kernel_choice.fastest("gemm", (1,), _candidates([]), cpu, BIG) == "ws"
    calls = []
    assert kernel_choice.fastest("gemm", (2,), _candidates(calls), cpu, BIG) == "triton"
    assert calls == [] and len(timed) == 1
    assert list(json.loads(kernel_choice.cache_path().read_text())) == ["gemm (1,)"]


def test_no_timing_where_it_cannot_be_done_or_would_not_pay(cache_dir, monkeypatch):
    calls = []
    cpu = torch.device("cpu")
    assert not kernel_choice.chooses_on(cpu) and not kernel_choice.may_time(cpu, BIG)  # off CUDA
    assert kernel_choice.fastest("gemm", (1,), _candidates(calls), cpu, BIG) == "triton"
    assert calls == [] and not kernel_choice.cache_path().exists()
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        assert not kernel_choice.may_time(gpu, 1000)  # below tuning.SMALL_PROBLEM
        monkeypatch.setenv("PRIME_MEGAMOE_AUTOTUNE", "0")
        assert not kernel_choice.chooses_on(gpu) and not kernel_choice.may_time(gpu, BIG)


def test_fastest_falls_back_to_the_triton_kernel_where_ws_cannot_run(fake_clock):
    """On the CPU the warp-specialised kernel does not apply: FASTEST runs the Triton kernel, times nothing."""
    _, timed = fake_clock
    index, weights = ragged_routing(40, 4, 2, seed=11)
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=4, tile_m=16)
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(plan.sorted_rows, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(4, 48, 32, generator=gen).to(torch.bfloat16)
    got = launch.grouped_gemm(a, b, plan, transpose_b=True, use_ws=launch.FASTEST)
    assert torch.equal(got, launch.grouped_gemm(a, b, plan, transpose_b=True, use_ws=False))
    assert timed == []


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("hidden,inter", [(2048, 768), (4096, 1536)], ids=["qwen3-30b", "qwen3-235b"])
def test_the_families_are_bitwise_equal_and_fastest_gives_their_bits(hidden, inter, cache_dir):
    """The layer's GEMMs (FC1 + SwiGLU, FC2 with the top-k weights, the gathered FC2 dgrad, the FC1 dgrad) at the
    Qwen3 MoE shapes, 16 experts and ragged routing: the warp-specialised and the Triton kernels give the same bits,
    so ``use_ws=FASTEST`` (timed here: the problems are large) does too, and its choice reaches the cache file."""
    device, experts, tokens = "cuda", 16, 4096
    index, weights = ragged_routing(tokens, experts, 8, seed=5, hot_fraction=0.3)
    plan = build_routing_plan(
        index.to(device), weights.to(device), expert_base=0, num_local_experts=experts, tile_m=QTILE_M
    )
    gen = torch.Generator(device=device).manual_seed(5)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    x, dy = rand(tokens, hidden), rand(tokens, hidden)
    act, dh = rand(plan.sorted_rows, inter), rand(plan.sorted_rows, 2 * inter)
    w1, w2 = rand(experts, 2 * inter, hidden, scale=hidden**-0.5), rand(experts, hidden, inter, scale=inter**-0.5)
    pairs = plan.num_pairs
    cases = [
        ("FC2", act, w2, dict(transpose_b=True, row_scale=plan.row_weight, use_tma=False)),
        ("FC2 dgrad", dy, w2, dict(transpose_b=False, gather=True)),
        ("FC1 dgrad", dh, w1, dict(transpose_b=False)),
    ]
    for name, a, b, kw in cases:
        outs = [launch.grouped_gemm(a, b, plan, use_ws=ws, **kw)[:pairs] for ws in (False, True, launch.FASTEST)]
        assert torch.equal(outs[0], outs[1]), (name, (outs[0].float() - outs[1].float()).abs().max().item())
        assert torch.equal(outs[0], outs[2]), name
    for save_h in (True, False):
        outs = [launch.fc1_swiglu(x, w1, plan, save_h=save_h, use_ws=ws) for ws in (False, True, launch.FASTEST)]
        for h, a in outs[1:]:
            assert torch.equal(a[:pairs], outs[0][1][:pairs]), ("FC1 + SwiGLU", save_h)
            if save_h:
                assert torch.equal(h[:pairs], outs[0][0][:pairs]), ("FC1 + SwiGLU h", save_h)
    chosen = {k.split(" ")[0]: v["chosen"] for k, v in json.loads(kernel_choice.cache_path().read_text()).items()}
    assert set(chosen) == {"grouped_gemm", "fc1_swiglu"} and set(chosen.values()) <= {"triton", "ws"}


def test_the_layer_asking_for_fastest_gives_the_triton_layers_bits_on_the_cpu(fake_clock, monkeypatch):
    """The one-rank layer with its GEMMs on ``FASTEST`` (FC1 + SwiGLU, FC2, both dgrads): where the warp-specialised
    kernels cannot run it is the Triton layer, forward and every gradient, and nothing is timed."""
    from prime_megamoe.kernels.tuning import tile_m
    from prime_megamoe.ops.expert_compute import routed_experts

    _, timed = fake_clock
    tokens, hidden, inter, experts = 24, 32, 16, 4
    index, weights = ragged_routing(tokens, experts, 2, seed=3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    dy = torch.randn(tokens, hidden, generator=gen)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
        y = routed_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], expert_base=0, tile_m=tile_m())
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    want = run()
    monkeypatch.setattr(launch, "LAYER_WS", launch.FASTEST)
    monkeypatch.setattr(launch, "LAYER_FC1_WS", launch.FASTEST)
    got = run()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert timed == []
