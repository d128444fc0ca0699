"""``[model.moe.dispatch] num_sms`` (``ops/sm_budget.py``): the budget context (nesting, the autograd backward
re-entering its forward's budget), the persistent grids within it, the layer's results bitwise unchanged by it (EP =
1 in bf16 and fp8, EP = 2 over gloo), the green-context helper on every torch API it handles (fakes stand in for
torch's class) and its errors; on a GPU (marker ``gpu``), kernels kept on the green context's SMs and the layer at
num_sms = 120 bitwise equal to num_sms = None."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from prime_megamoe import DispatchConfig, fused_experts
from prime_megamoe.ops import fp8_launch, launch, sm_budget
from prime_megamoe.ops.sm_budget import (
    INTERPRETER_SMS,
    GreenContextUnavailable,
    GreenStream,
    available_sms,
    current_budget,
    in_kept_sm_budget,
    keeps_sm_budget,
    sm_limit,
)

from .distributed import run_on_ranks
from .test_torch_backend import Case, make_problem

budget = sm_budget.sm_budget
CPU = torch.device("cpu")
NAMES = ("out", "d_hidden_states", "d_top_k_weights", "d_gate_up_proj", "d_down_proj")


# ----------------------------------------------------------------------------------------------------------------
# The budget context


def test_budget_nests_to_the_smaller_one_and_restores():
    assert current_budget() is None and available_sms(CPU) == INTERPRETER_SMS
    with budget(3):
        assert available_sms(CPU) == 3 and launch._num_sms(CPU) == 3
        with budget(8):
            assert available_sms(CPU) == 3
        with budget(2):
            assert available_sms(CPU) == 2
        with budget(None):
            assert available_sms(CPU) == 3
        assert available_sms(CPU) == 3
    assert current_budget() is None and available_sms(CPU) == INTERPRETER_SMS
    with budget(9):  # more than the device has: the device's
        assert available_sms(CPU) == INTERPRETER_SMS
    for bad in (0, -1, True, 2.5, "4"):
        with pytest.raises(ValueError, match=r"num_sms = .*positive integer"):
            with budget(bad):
                pass
    assert current_budget() is None


def test_persistent_grids_follow_the_budget():
    """The warp-specialised kernels' grids (``fp8_ws_launch._grid``) and the fp8 launchers' SM count read the budget
    too (their kernels need a GPU; their grids do not)."""
    from prime_megamoe.ops.fp8_ws_launch import _grid

    assert _grid(2, CPU, 1000, None) == (2 * INTERPRETER_SMS,)
    with budget(3):
        assert _grid(2, CPU, 1000, None) == (6,)
        assert _grid(2, CPU, 5, None) == (5,)
        assert _grid(2, CPU, 1000, 4) == (4,)
        assert fp8_launch._num_sms(CPU) == 3


class _Probe(torch.autograd.Function):
    """Records the persistent grid size its forward and backward would launch."""

    seen: list = []

    @staticmethod
    @keeps_sm_budget
    def forward(ctx, x):
        _Probe.seen.append(("forward", available_sms(x.device)))
        return x * 2

    @staticmethod
    @in_kept_sm_budget
    def backward(ctx, grad):
        _Probe.seen.append(("backward", available_sms(grad.device)))
        return grad * 2


def _probe(run_forward, run_backward=lambda y: y.sum().backward()):
    _Probe.seen.clear()
    x = torch.ones(3, requires_grad=True)
    y = run_forward(lambda: _Probe.apply(x))
    run_backward(y)
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    return list(_Probe.seen)


def test_backward_runs_within_its_forward_budget():
    def under(n):
        def run(f):
            with budget(n):
                return f()

        return run

    def backward_under(n):
        def run(y):
            with budget(n):
                y.sum().backward()

        return run

    # The backward runs after the forward's budget has ended, and in another one: the forward's comes back.
    assert _probe(under(2)) == [("forward", 2), ("backward", 2)]
    assert _probe(under(2), backward_under(3)) == [("forward", 2), ("backward", 2)]
    assert _probe(under(3), backward_under(1)) == [("forward", 3), ("backward", 3)]
    # A layer call's budget (what fused_experts enters with num_sms), kept the same way.
    assert _probe(lambda f: sm_limit(1, CPU).run(f)) == [("forward", 1), ("backward", 1)]
    # No budget in the forward: the backward runs as it is.
    assert _probe(lambda f: f()) == [("forward", INTERPRETER_SMS), ("backward", INTERPRETER_SMS)]
    assert current_budget() is None


# ----------------------------------------------------------------------------------------------------------------
# The layer: results unchanged by num_sms


def _layer(x, index, weights, w1, w2, grad_out, *, precision="bf16", num_sms=None, group=None, capacity=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)]
    opts = DispatchConfig(type="mega_moe", num_sms=num_sms, max_tokens_per_rank=capacity)
    out = fused_experts(
        leaves[0], index, leaves[1], leaves[2], leaves[3], dispatch=opts, precision=precision, group=group
    )
    out.backward(grad_out)
    return (out.detach(), *(t.grad for t in leaves))


def _spy_grids(monkeypatch_or_none=None):
    """Wrap the persistent grids' SM count (``launch._num_sms`` and the fp8 launchers' copy): every value asked."""
    seen = []
    original = launch._num_sms

    def spy(device):
        n = original(device)
        seen.append(n)
        return n

    if monkeypatch_or_none is not None:
        monkeypatch_or_none.setattr(launch, "_num_sms", spy)
        monkeypatch_or_none.setattr(fp8_launch, "_num_sms", spy)
    else:
        launch._num_sms = fp8_launch._num_sms = spy
    return seen


TINY = Case("tiny", 32, 16, 4, 2, "ragged", 24)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_layer_is_bitwise_unchanged_by_num_sms(monkeypatch, precision):
    x, weights, w1, w2, grad_out, index = make_problem(TINY, 1, torch.float32, seed=11)
    seen = _spy_grids(monkeypatch)
    plain = _layer(x, index, weights, w1, w2, grad_out, precision=precision)
    assert set(seen) <= {INTERPRETER_SMS}
    for num_sms in (1, 3):
        seen.clear()
        got = _layer(x, index, weights, w1, w2, grad_out, precision=precision, num_sms=num_sms)
        # Every persistent grid ran num_sms programs; in bf16 those are FC1 and FC2 forward and the two dgrad GEMMs
        # backward (the fp8 path has none under the interpreter).
        assert set(seen) <= {num_sms}, seen
        if precision == "bf16":
            assert len(seen) >= 4, seen
        for name, a, b in zip(NAMES, got, plain):
            assert torch.equal(a, b), f"{precision} num_sms = {num_sms}: {name} differs from num_sms = None"
    assert current_budget() is None


EP_CASE = Case("ep_tiny", 32, 16, 4, 2, "ragged", 8)


def _ep_body(rank, world):
    group = dist.group.WORLD
    x, weights, w1, w2, grad_out, index = make_problem(EP_CASE, world, torch.float32, seed=23)
    tokens = EP_CASE.tokens_per_rank(world)[rank]
    rows = slice(rank * tokens, (rank + 1) * tokens)
    local = EP_CASE.experts // world
    experts = slice(rank * local, (rank + 1) * local)
    args = (x[rows], index[rows], weights[rows], w1[experts], w2[experts], grad_out[rows])
    seen = _spy_grids()
    plain = _layer(*args, group=group, capacity=tokens)
    seen_plain = sorted(set(seen))
    seen.clear()
    limited = _layer(*args, group=group, capacity=tokens, num_sms=1)
    return {
        "equal": [torch.equal(a, b) for a, b in zip(limited, plain)],
        "seen_plain": seen_plain,
        "seen_limited": sorted(set(seen)),
        "launches_limited": len(seen),
    }


def test_expert_parallel_layer_is_bitwise_unchanged_by_num_sms():
    for rank, result in enumerate(run_on_ranks(_ep_body, 2)):
        assert all(result["equal"]), f"rank {rank}: {dict(zip(NAMES, result['equal']))}"
        assert result["seen_plain"] == [INTERPRETER_SMS]
        assert result["seen_limited"] == [1] and result["launches_limited"] >= 4, result


# ----------------------------------------------------------------------------------------------------------------
# The green-context helper, on fakes of torch's GreenContext API generations


class _Made:
    def __init__(self, kind, num_sms, device_id):
        self.kind, self.num_sms, self.device_id = kind, num_sms, device_id


class _CreateWithStream:
    """torch 2.11 on: ``GreenContext.create(*, num_sms, device_id)`` and ``Stream()``."""

    calls: list = []

    @staticmethod
    def create(*, num_sms=None, device_id=None, workqueue_scope=None):
        _CreateWithStream.calls.append((num_sms, device_id))
        made = _Made("create", num_sms, device_id)
        made.Stream = lambda: "green stream"
        return made


class _SetPopOnly:
    """torch 2.9 / 2.10: ``GreenContext.create(num_sms, device_id=0)``, ``set_context()`` / ``pop_context()``."""

    @staticmethod
    def create(num_sms, device_id=0):
        made = _Made("create", num_sms, device_id)
        made.set_context = made.pop_context = lambda: None
        return made


def _constructor_only(sm_count):
    """Later torch: ``GreenContext(num_sms=..., device_id=...)``, ``Stream()``, ``sm_count``."""

    class GreenContext:
        def __init__(self, *, num_sms=None, device_id=None, sm_partition=None):
            self.num_sms, self.device_id, self.sm_count = num_sms, device_id, sm_count

        def Stream(self):
            return "green stream"

    return GreenContext


def _failing(message):
    class GreenContext:
        @staticmethod
        def create(**kwargs):
            raise RuntimeError(message)

    return GreenContext


class _Neither:
    @staticmethod
    def create(**kwargs):
        return _Made("create", kwargs["num_sms"], kwargs["device_id"])


def _use(monkeypatch, green_context_class):
    def lookup():
        if isinstance(green_context_class, BaseException):
            raise green_context_class
        return green_context_class

    monkeypatch.setattr(sm_budget, "_green_context_class", lookup)
    monkeypatch.setattr(sm_budget, "_as_cuda_stream", lambda stream: stream)
    monkeypatch.setattr(sm_budget, "_GREEN", {})
    monkeypatch.setattr(sm_budget, "_LIMITS", {})


def test_green_context_on_each_torch_api(monkeypatch):
    _use(monkeypatch, _CreateWithStream)
    _CreateWithStream.calls.clear()
    green = GreenStream(120, 1)
    assert (green.stream, green.sms, green.index) == ("green stream", 120, 1)
    assert _CreateWithStream.calls == [(120, 1)]  # by keyword: create(*, num_sms, device_id) takes no other form

    _use(monkeypatch, _SetPopOnly)
    green = GreenStream(64, 0)
    assert green.stream is None and green.sms == 64 and green.context.num_sms == 64

    _use(monkeypatch, _constructor_only(sm_count=112))  # the driver gave fewer SMs: the grids use those
    green = GreenStream(120, 0)
    assert (green.stream, green.sms, green.context.num_sms) == ("green stream", 112, 120)
    _use(monkeypatch, _constructor_only(sm_count=128))  # rounded up: the grids keep the request
    assert GreenStream(120, 0).sms == 120


@pytest.mark.parametrize(
    "lookup, says",
    [
        (ImportError("No module named 'torch.cuda.green_contexts'"), "GreenContext is missing"),
        (_failing("PyTorch was not built with Green Context support!"), "not built with Green Context support"),
        (_failing("GreenContext requires the cuda.bindings package"), "requires the cuda.bindings package"),
        (_Neither, r"neither Stream\(\) nor set_context\(\) / pop_context\(\)"),
    ],
)
def test_a_torch_without_green_contexts_is_a_clear_error(monkeypatch, lookup, says):
    _use(monkeypatch, lookup)
    with pytest.raises(GreenContextUnavailable) as err:
        GreenStream(120, 0)
    message = str(err.value)
    for part in (
        "[model.moe.dispatch] num_sms = 120",
        f"this torch ({torch.__version__}",
        "Remove the key",
        "use a torch with green contexts",
        "pip install cuda-bindings",
    ):
        assert part in message, (part, message)
    assert re.search(says, message), message


def test_layer_limit_on_a_cuda_device(monkeypatch):
    """``sm_limit`` on a (faked) 132-SM GPU: more SMs than it has is an error, all of them needs no green context,
    fewer make one (once per device and count) or fail with the helper's error."""
    props = SimpleNamespace(multi_processor_count=132, name="NVIDIA H200")
    monkeypatch.setattr(sm_budget, "cuda_properties", lambda device: props)
    cuda0 = torch.device("cuda", 0)
    _use(monkeypatch, ImportError("no green contexts here"))
    with pytest.raises(ValueError, match=r"num_sms = 200 is more than the 132 SMs of cuda:0 \(NVIDIA H200\)"):
        sm_limit(200, cuda0)
    every = sm_limit(132, cuda0)
    assert every.green is None and every.sms == 132
    with pytest.raises(GreenContextUnavailable, match="num_sms = 120"):
        sm_limit(120, cuda0)
    _use(monkeypatch, _CreateWithStream)
    _CreateWithStream.calls.clear()
    limit = sm_limit(120, cuda0)
    assert limit is sm_limit(120, cuda0) and limit.green.stream == "green stream" and limit.sms == 120
    assert _CreateWithStream.calls == [(120, 0)]


# ----------------------------------------------------------------------------------------------------------------
# On a GPU


@triton.jit
def _sm_ids_kernel(out_ptr):
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out_ptr + tl.program_id(0), smid)


def _sm_ids(programs: int) -> torch.Tensor:
    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    _sm_ids_kernel[(programs,)](out)
    return out


def _gpu_budget() -> int:
    """120 on an H200 (132 SMs), as the issue measures; on a smaller GPU a multiple of 8 well below its count."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 120 if total > 128 else max(8, total // 2 // 8 * 8)


class _SmIdsProbe(torch.autograd.Function):
    backward_ids: torch.Tensor | None = None

    @staticmethod
    @keeps_sm_budget
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @in_kept_sm_budget
    def backward(ctx, grad):
        _SmIdsProbe.backward_ids = _sm_ids(16 * 132)
        return grad


@pytest.mark.gpu
def test_gpu_kernels_of_a_limited_call_and_its_backward_stay_on_its_sms():
    """A Triton kernel of many short programs spreads over every SM; launched inside a call with num_sms (and in the
    backward of a Function whose forward ran in one), it stays on num_sms of them. Run under each way the installed
    torch offers: a green context's stream, and set_context / pop_context where torch has them."""
    n = _gpu_budget()
    dev = torch.device("cuda", torch.cuda.current_device())
    programs = 16 * torch.cuda.get_device_properties(dev).multi_processor_count
    assert _sm_ids(programs).unique().numel() > n  # unlimited: more SMs than the budget
    limit = sm_limit(n, dev)
    ids = limit.run(_sm_ids, programs)
    assert ids.min() >= 0 and ids.unique().numel() <= n
    x = torch.ones(4, device=dev, requires_grad=True)
    y = limit.run(_SmIdsProbe.apply, x)
    y.sum().backward()
    torch.cuda.synchronize()
    assert _SmIdsProbe.backward_ids.unique().numel() <= n
    if callable(getattr(limit.green.context, "set_context", None)):
        context_mode = GreenStream(n, dev.index)
        context_mode.stream = None  # the torch 2.10 way, forced
        ids = context_mode.run(_sm_ids, (programs,), {})
        assert ids.unique().numel() <= n


def _gpu_layer(precision, num_sms, seed=0, stream=None):
    T, H, I, E, K = 2048, 2048, 768, 128, 8  # the Qwen3-30B-A3B layer at a modest token count
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    x = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
    weights, index = torch.softmax(torch.randn(T, E, generator=gen), -1).topk(K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dev, torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dev, torch.bfloat16)
    grad_out = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
    if stream is None:
        return _layer(x, index.to(dev), weights, w1, w2, grad_out, precision=precision, num_sms=num_sms)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = _layer(x, index.to(dev), weights, w1, w2, grad_out, precision=precision, num_sms=num_sms)
    torch.cuda.current_stream().wait_stream(stream)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_layer_with_num_sms_is_bitwise_that_without(precision):
    """num_sms = 120 on an H200: outputs and every gradient bitwise those of num_sms = None, called from the default
    stream and from a side stream (the green stream waits for the caller's and the caller for it, both ways)."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9 or later")
    n = _gpu_budget()
    plain = _gpu_layer(precision, None)
    for stream in (None, torch.cuda.Stream()):
        got = _gpu_layer(precision, n, stream=stream)
        torch.cuda.synchronize()
        for name, a, b in zip(NAMES, got, plain):
            assert torch.equal(a, b), f"{precision} num_sms = {n} (caller stream {stream}): {name} differs"


@pytest.mark.multigpu
def test_gpu_expert_parallel_with_num_sms_is_bitwise_that_without():
    """Two GPUs, both transports, bf16 and fp8: num_sms = 120 bitwise num_sms = None, also in a stack of layers
    whose rounds alternate between the caller's stream and the green context's (scripts/gpu_check_num_sms_ep.py)."""
    from .test_mega_moe_ep_gpu import _torchrun

    run = _torchrun("gpu_check_num_sms_ep.py", timeout=900)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert len(lines) == 12 and all(ln.startswith("PASS") for ln in lines), run.stdout
