"""Input validation of ``fused_experts`` and the MoE block: every bad input is an error that says what is wrong."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from prime_megamoe import DispatchConfig, MoEBlock, MoEConfig, fused_experts
from prime_megamoe.config import DISPATCH_TYPES, PRECISIONS
from prime_megamoe.dispatch import get_backend
from prime_megamoe.validation import check_expert_ids, check_expert_inputs, expert_ids_in_range

from .distributed import run_on_ranks

T, H, I, E, K = 6, 16, 8, 4, 2


def make_inputs(seed=0, num_tokens=T, dtype=torch.float32, num_experts=E):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, K, generator=gen).to(dtype)
    w1 = (torch.randn(num_experts, 2 * I, H, generator=gen) * H**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, H, I, generator=gen) * I**-0.5).to(dtype)
    return x, index, weights, w1, w2


def call(x, index, weights, w1, w2, **kw):
    kw.setdefault("dispatch", "torch")
    kw.setdefault("precision", "bf16")
    return fused_experts(x, index, weights, w1, w2, **kw)


def test_valid_inputs_pass():
    out = call(*make_inputs())
    assert out.shape == (T, H)
    assert torch.isfinite(out).all()
    shapes = check_expert_inputs(*make_inputs(), group=None)
    assert (shapes.num_tokens, shapes.hidden, shapes.intermediate, shapes.top_k) == (T, H, I, K)
    assert (shapes.num_local_experts, shapes.world, shapes.rank, shapes.num_experts) == (E, 1, 0, E)


# ---------------------------------------------------------------------------------------------------------------
# Expert ids


@pytest.mark.parametrize("dispatch", DISPATCH_TYPES)
@pytest.mark.parametrize("bad_id", [E, E + 7, -2])
def test_expert_id_out_of_range(dispatch, bad_id):
    x, index, weights, w1, w2 = make_inputs(seed=1)
    index[T // 2, 1] = bad_id
    with pytest.raises(ValueError) as info:
        call(x, index, weights, w1, w2, dispatch=dispatch)
    msg = str(info.value)
    assert f"[0, {E})" in msg
    assert str(bad_id) in msg


def test_expert_id_int32_accepted_and_checked():
    x, index, weights, w1, w2 = make_inputs(seed=2)
    ref = call(x, index, weights, w1, w2)
    out = call(x, index.to(torch.int32), weights, w1, w2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    index[0, 0] = E
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        call(x, index.to(torch.int32), weights, w1, w2)


def test_expert_id_checked_on_host_for_cpu_tensors_even_without_validate_routing():
    # validate_routing = False only changes the GPU check (device-side assertion); CPU inputs are checked on the host.
    x, index, weights, w1, w2 = make_inputs(seed=3)
    index[-1, 0] = E + 1
    options = DispatchConfig(type="torch", validate_routing=False)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        call(x, index, weights, w1, w2, dispatch=options)


def test_expert_id_device_assertion():
    ids = torch.tensor([[0, 5]])
    with pytest.raises(RuntimeError, match=r"outside \[0, 4\)"):
        check_expert_ids(ids, 4, sync=False)


def test_check_expert_ids_direct():
    ids = torch.tensor([[0, 3], [2, 1]])
    check_expert_ids(ids, 4, sync=True)
    check_expert_ids(ids, 4, sync=False)
    check_expert_ids(torch.empty(0, 2, dtype=torch.long), 4, sync=True)
    with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
        check_expert_ids(ids, 3, sync=True)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_expert_ids_in_range_flag(dtype):
    # The device-side check's kernel: one flag over every id, ragged lengths past its block of 64 ids.
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 6, (67, 3), generator=gen).to(dtype)
    if torch.cuda.is_available():  # compiled on a GPU machine, interpreted on CPU
        ids = ids.cuda()
    assert expert_ids_in_range(ids, 6).tolist() == [1]
    for where, bad in (((66, 2), 6), ((0, 0), -2), ((40, 1), 1000)):  # last id, first id, one in between
        wrong = ids.clone()
        wrong[where] = bad
        assert expert_ids_in_range(wrong, 6).tolist() == [0], (where, bad)
    assert expert_ids_in_range(ids[:1, :1], 6).tolist() == [1]
    empty = ids.clone()
    empty[(3, 1)] = -1  # an empty slot is a valid id
    assert expert_ids_in_range(empty, 6).tolist() == [1]


# ---------------------------------------------------------------------------------------------------------------
# Shapes


def _shape_cases():
    x, index, weights, w1, w2 = make_inputs(seed=4)
    return [
        ("hidden_3d", (x.view(2, T // 2, H), index, weights, w1, w2), "2-D"),
        ("index_1d", (x, index[:, 0], weights[:, 0], w1, w2), "2-D"),
        ("weights_k_mismatch", (x, index, weights[:, :1], w1, w2), "top_k_weights"),
        ("tokens_mismatch", (x, index[:-1], weights[:-1], w1, w2), f"T = {T}"),
        ("w1_hidden_mismatch", (x, index, weights, w1[:, :, :-1], w2), "gate_up_proj"),
        ("w1_odd_rows", (x, index, weights, w1[:, :-1], w2), "gate_up_proj"),
        ("w1_2d", (x, index, weights, w1[0], w2), "gate_up_proj"),
        ("w2_inter_mismatch", (x, index, weights, w1, w2[:, :, :-1]), "down_proj"),
        ("w2_hidden_mismatch", (x, index, weights, w1, w2[:, :-1]), "down_proj"),
        ("w2_experts_mismatch", (x, index, weights, w1, w2[:-1]), "down_proj"),
    ]


@pytest.mark.parametrize("dispatch", DISPATCH_TYPES)
@pytest.mark.parametrize("case", _shape_cases(), ids=lambda c: c[0])
def test_shape_mismatch(dispatch, case):
    _, args, needle = case
    with pytest.raises(ValueError) as info:
        call(*args, dispatch=dispatch)
    assert needle in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Dtypes and devices


def _dtype_cases():
    x, index, weights, w1, w2 = make_inputs(seed=5)
    return [
        ("index_float", (x, index.float(), weights, w1, w2), "top_k_index"),
        ("index_int16", (x, index.to(torch.int16), weights, w1, w2), "top_k_index"),
        ("hidden_int", (x.to(torch.int32), index, weights, w1, w2), "hidden_states"),
        ("hidden_float64", (x.double(), index, weights, w1.double(), w2.double()), "hidden_states"),
        ("weights_int", (x, index, index.clone(), w1, w2), "top_k_weights"),
        ("w1_dtype", (x, index, weights, w1.bfloat16(), w2), "gate_up_proj"),
        ("w2_dtype", (x, index, weights, w1, w2.bfloat16()), "down_proj"),
        ("hidden_vs_weights", (x.bfloat16(), index, weights, w1, w2), "hidden_states' dtype"),
    ]


@pytest.mark.parametrize("dispatch", DISPATCH_TYPES)
@pytest.mark.parametrize("case", _dtype_cases(), ids=lambda c: c[0])
def test_dtype_mismatch(dispatch, case):
    _, args, needle = case
    with pytest.raises(TypeError) as info:
        call(*args, dispatch=dispatch)
    assert needle in str(info.value)


def test_device_mismatch():
    x, index, weights, w1, w2 = make_inputs(seed=6)
    with pytest.raises(ValueError, match="one device"):
        call(x, index, weights, w1.to("meta"), w2)


# ---------------------------------------------------------------------------------------------------------------
# Capacity


@pytest.mark.parametrize("dispatch", DISPATCH_TYPES)
def test_tokens_above_capacity(dispatch):
    x, index, weights, w1, w2 = make_inputs(seed=7, num_tokens=5)
    options = DispatchConfig(type=dispatch, max_tokens_per_rank=4)
    with pytest.raises(ValueError) as info:
        call(x, index, weights, w1, w2, dispatch=options)
    msg = str(info.value)
    assert "max_tokens_per_rank" in msg
    assert "5" in msg and "4" in msg


def test_tokens_at_capacity_pass():
    x, index, weights, w1, w2 = make_inputs(seed=8, num_tokens=4)
    options = DispatchConfig(type="torch", max_tokens_per_rank=4)
    ref = call(x, index, weights, w1, w2)
    torch.testing.assert_close(call(x, index, weights, w1, w2, dispatch=options), ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Backend and precision names


@pytest.mark.parametrize("name", ["deepep", "Torch", "mega-moe", ""])
def test_unknown_dispatch_name(name):
    with pytest.raises(ValueError) as info:
        call(*make_inputs(), dispatch=name)
    msg = str(info.value)
    assert repr(name) in msg
    for allowed in DISPATCH_TYPES:
        assert allowed in msg


@pytest.mark.parametrize("dispatch", DISPATCH_TYPES)
@pytest.mark.parametrize("name", ["fp16", "int8", "BF16"])
def test_unknown_precision_name(dispatch, name):
    with pytest.raises(ValueError) as info:
        call(*make_inputs(), dispatch=dispatch, precision=name)
    msg = str(info.value)
    assert repr(name) in msg
    for allowed in PRECISIONS:
        assert allowed in msg


def test_registry_unknown_backend():
    with pytest.raises(ValueError, match="registered backends"):
        get_backend("no_such_backend")


@pytest.mark.parametrize("precision", ["fp8_bwd", "mxfp8"])
def test_torch_backend_rejects_quantised_precision(precision):
    # fp8 runs on the torch backend (tests/test_torch_backend_fp8.py); the other quantised precisions do not.
    with pytest.raises(NotImplementedError, match=rf"precision = '{precision}'.*type = 'mega_moe'"):
        call(*make_inputs(), dispatch="torch", precision=precision)


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism: E must divide over the group; ids are global


def test_moe_block_single_rank_any_expert_count():
    block = MoEBlock(H, I, 3, 2, MoEConfig(dispatch="torch"))
    assert block.experts.gate_up_proj.shape == (3, 2 * I, H)


def _ep_validation_body(rank, world):
    group = dist.group.WORLD
    # 5 experts do not split over 2 ranks.
    try:
        MoEBlock(H, I, 5, 2, MoEConfig(dispatch="torch", ep=world), group=group)
    except ValueError as err:
        divisible_msg = str(err)
    else:
        divisible_msg = None
    block = MoEBlock(H, I, 4, 2, MoEConfig(dispatch="torch", ep=world), group=group)
    local_shape = tuple(block.experts.gate_up_proj.shape)

    # Global ids: with 2 local experts per rank and 2 ranks, id 4 is out of range, id 3 is not.
    x, index, weights, w1, w2 = make_inputs(seed=10 + rank, num_experts=4)
    w1, w2 = w1[2 * rank : 2 * rank + 2], w2[2 * rank : 2 * rank + 2]
    index[0, 0] = 3 if index[0, 1] != 3 else 2
    ok = call(x, index, weights, w1, w2, group=group).shape
    index[1, 1] = 4
    try:
        call(x, index, weights, w1, w2, group=group)
    except ValueError as err:
        range_msg = str(err)
    else:
        range_msg = None
    return divisible_msg, local_shape, tuple(ok), range_msg


def test_expert_parallel_validation():
    results = run_on_ranks(_ep_validation_body, 2)
    for divisible_msg, local_shape, ok_shape, range_msg in results:
        assert divisible_msg is not None, "MoEBlock accepted 5 experts over 2 ranks"
        assert "num_experts = 5" in divisible_msg and "2" in divisible_msg
        assert local_shape == (2, 2 * I, H)
        assert ok_shape == (T, H)
        assert range_msg is not None and "[0, 4)" in range_msg


def test_options_that_are_not_implemented_raise():
    x, index, weights, w1, w2 = make_inputs(seed=4)
    with pytest.raises(NotImplementedError, match="deterministic"):
        call(x, index, weights, w1, w2, dispatch=DispatchConfig(type="torch", deterministic=False))


def test_num_sms_is_accepted_and_changes_no_result():
    """num_sms is implemented (tests/test_sm_budget.py): both backends take it; the torch backend on CPU has
    nothing it bounds, and computes the same bits."""
    x, index, weights, w1, w2 = make_inputs(seed=4)
    plain = call(x, index, weights, w1, w2, dispatch=DispatchConfig(type="torch"))
    assert torch.equal(call(x, index, weights, w1, w2, dispatch=DispatchConfig(type="torch", num_sms=8)), plain)
    with pytest.raises(ValueError, match="num_sms"):
        DispatchConfig(num_sms=0)
