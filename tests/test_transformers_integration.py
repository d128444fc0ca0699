"""transformers integration: experts_implementation="mega_moe" / "torch" match "eager"; expert-parallel sharding and
sliced loading over gloo ranks match the unsharded model."""

from __future__ import annotations

import pytest
import torch

from prime_megamoe import DispatchConfig, MoEConfig
from prime_megamoe.integrations import transformers as hf
from tests.distributed import run_on_ranks
from tests.oracle import rel_err

pytest.importorskip("transformers")

TOKENS_PER_RANK = 16  # batch 2 x seq 8


def small_config(experts_implementation: str = "eager"):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.2,  # large enough that routing and expert outputs matter in the logits
    )
    cfg._experts_implementation = experts_implementation
    cfg._attn_implementation = "eager"
    return cfg


def build(impl: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    hf.register()
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(small_config(impl)).float()


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 8), generator=g)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_register_adds_both_implementations():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    hf.register()
    hf.register()  # idempotent
    assert "mega_moe" in ALL_EXPERTS_FUNCTIONS and "torch" in ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS["mega_moe"] is hf.mega_moe_experts_forward


@pytest.mark.parametrize("impl", ["mega_moe", "torch"])
def test_matches_eager_logits_and_gradients(impl):
    ref = build("eager")
    model = build(impl)
    model.load_state_dict(ref.state_dict())
    assert model.config._experts_implementation == impl
    ids = batch(1)
    ref_logits, ref_grads = loss_and_grads(ref, ids)
    logits, grads = loss_and_grads(model, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < 1e-5, name
    # The expert weights really receive gradients through our path.
    assert any("experts.gate_up_proj" in n for n in grads)


def test_from_config_accepts_mega_moe():
    from transformers import AutoModelForCausalLM

    hf.register()
    model = AutoModelForCausalLM.from_config(small_config("eager"), experts_implementation="mega_moe")
    assert model.config._experts_implementation == "mega_moe"


def test_from_pretrained_with_mega_moe(tmp_path):
    from transformers import AutoModelForCausalLM

    ref = build("eager")
    ref.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="mega_moe", dtype=torch.float32)
    assert model.config._experts_implementation == "mega_moe"
    ids = batch(2)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_options_come_from_the_moe_config():
    model = build("torch")
    moe = MoEConfig(dispatch=DispatchConfig(type="torch", max_tokens_per_rank=4))
    assert hf.configure_experts(model, moe) == 2
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        model(input_ids=batch(0))
    # The implementation name picks the backend; the precision comes from the config too.
    model = build("torch")
    hf.configure_experts(model, MoEConfig(precision="mxfp8"))
    with pytest.raises(NotImplementedError, match="precision = 'mxfp8'"):
        model(input_ids=batch(0))


def test_unsupported_experts_layout_is_refused():
    class BiasedExperts(torch.nn.Module):
        has_bias = True

        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 4))

    with pytest.raises(NotImplementedError, match="has_bias"):
        hf.mega_moe_experts_forward(
            BiasedExperts(), torch.zeros(3, 4), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
        )


def test_shard_experts_single_rank_and_errors():
    model = build("torch")
    full = {n: p.clone() for n, p in model.named_parameters()}
    names = hf.shard_experts(model, None)
    assert len(names) == 2
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, full[n])
    assert hf.expert_parameter_names(model) == {f"{n}.{a}" for n in names for a in ("gate_up_proj", "down_proj")}
    with pytest.raises(ValueError, match="already sharded"):
        hf.shard_experts(model, None)


def test_expert_parallel_layout_errors_name_ep():
    from prime_megamoe import ConfigError

    with pytest.raises(ConfigError, match=r"ep = 4.*span nodes.*LOCAL_WORLD_SIZE = 2"):
        hf.check_expert_parallel_layout(4, 8, 2)
    with pytest.raises(ConfigError, match=r"ep = 3 does not divide"):
        hf.check_expert_parallel_layout(3, 4, 4)
    hf.check_expert_parallel_layout(2, 8, 4)


# ---------------------------------------------------------------------------------------------------------------------
# Expert parallelism over gloo ranks


def _ep_body(rank, world, impls):
    """Each implementation's errors against the unsharded eager model, one after another in the same processes."""
    return {impl: _ep_errors(rank, world, impl) for impl in impls}


def _ep_errors(rank, world, impl):
    import torch.distributed as dist

    ep = hf.init_expert_parallel(world)
    moe = MoEConfig(dispatch=DispatchConfig(type=impl, max_tokens_per_rank=TOKENS_PER_RANK), ep=world)
    ref = build("eager")
    model = build(impl)
    model.load_state_dict(ref.state_dict())
    hf.shard_experts(model, ep.ep_group)
    hf.configure_experts(model, moe, ep.ep_group)
    experts = hf.expert_parameter_names(model)

    ids = [batch(10 + r) for r in range(world)]
    logits, grads = loss_and_grads(model, ids[rank])
    for name, g in grads.items():  # replicated weights: sum over ranks; experts already hold every rank's share
        if name not in experts:
            dist.all_reduce(g)

    ref.zero_grad(set_to_none=True)
    ref_logits = []
    for r in range(world):
        out = ref(input_ids=ids[r], use_cache=False).logits
        torch.nn.functional.cross_entropy(out.flatten(0, 1)[:-1], ids[r].flatten()[1:]).backward()
        ref_logits.append(out.detach())
    errors = {"logits": rel_err(logits, ref_logits[rank])}
    ref_params = dict(ref.named_parameters())
    for name, g in grads.items():
        want = ref_params[name].grad
        if name in experts:
            local = want.shape[0] // world
            want = want[rank * local : (rank + 1) * local]
        errors[name] = rel_err(g, want)
    return errors


EP_IMPLS = ("torch", "mega_moe")
_EP_RESULTS: list = []


@pytest.mark.parametrize("impl", EP_IMPLS)
def test_expert_parallel_matches_unsharded(impl):
    if not _EP_RESULTS:  # both implementations in one spawn
        _EP_RESULTS.extend(run_on_ranks(_ep_body, 2, EP_IMPLS))
    for per_impl in _EP_RESULTS:
        errors = per_impl[impl]
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-5, (worst, errors[worst])


def _load_body(rank, world, path):
    import safetensors

    ep = hf.init_expert_parallel(world)
    moe = MoEConfig(dispatch=DispatchConfig(type="torch"), ep=world)
    read = []
    original = hf._Reader.rows

    def spy(self, key, lo=None, hi=None):
        read.append((key, lo, hi))
        return original(self, key, lo, hi)

    hf._Reader.rows = spy
    try:
        model = hf.from_pretrained_expert_parallel(path, moe=moe, group=ep.ep_group, dtype=torch.float32)
    finally:
        hf._Reader.rows = original
    ref = build("eager")
    num_local = 4 // world
    mine = range(rank * num_local, (rank + 1) * num_local)
    foreign = []
    for key, lo, hi in read:
        tail = key.split(".experts.")[1] if ".experts." in key else None
        if tail is None:
            continue
        if tail in ("gate_up_proj", "down_proj"):  # fused layout: a slice of the experts dimension
            if (lo, hi) != (mine.start, mine.stop):
                foreign.append((key, lo, hi))
        elif int(tail.split(".")[0]) not in mine:  # per-expert layout
            foreign.append(key)
    ids = batch(20 + rank)
    with torch.no_grad():
        err = rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    shapes = [tuple(m.gate_up_proj.shape) for _, m in hf.experts_modules(model)]
    assert safetensors is not None
    return foreign, err, shapes


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_loading_reads_only_this_ranks_experts(tmp_path, layout):
    model = build("eager")
    model.save_pretrained(tmp_path)  # transformers writes the Hub layout: experts.{e}.gate_proj.weight, ...
    if layout == "fused":
        from safetensors.torch import save_file

        for f in tmp_path.glob("*.safetensors"):
            f.unlink()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    for foreign, err, shapes in run_on_ranks(_load_body, 2, str(tmp_path)):
        assert foreign == [], f"read other ranks' experts: {foreign[:3]}"
        assert err < 1e-6
        assert shapes == [(2, 32, 32)] * 2
