"""The SFT trainer: torch and mega_moe give the same loss curve, EP and FSDP2 match one rank, resuming continues the
identical curve, bad configs fail before any work naming the key, and the loss falls on configs/tiny.toml."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_megamoe import ConfigError
from prime_megamoe.config import config_from_dict, set_dotted
from tests.distributed import run_on_ranks

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent

# The tiny preset made smaller still, so that 20 mega_moe steps in the Triton interpreter stay quick.
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_experts": 4,
}


def run_config(tmp_path: Path, name: str, *, dispatch="torch", ep=1, steps=4, batch=2, seq=16, **dotted) -> dict:
    d = {
        "model": {"name": "tiny", "overrides": dict(SMALL), "moe": {"ep": ep, "dispatch": {"type": dispatch}}},
        "train": {"steps": steps, "batch_size": batch, "seq_len": seq, "save_final": False},
        "output_dir": str(tmp_path / name),
    }
    set_dotted(d, "model.moe.dispatch.max_tokens_per_rank", batch // ep * seq if ep > 1 else batch * seq)
    for key, value in dotted.items():
        set_dotted(d, key.replace("__", "."), value)
    return d


def train_here(d: dict) -> list[dict]:
    from prime_megamoe.train import train

    return train(config_from_dict(copy.deepcopy(d)))


def _train_on_rank(rank, world, configs):
    from prime_megamoe.train import train

    return [train(config_from_dict(d)) for d in configs]


def train_on_ranks(world: int, *configs: dict) -> list[list[dict]]:
    """Run the configs one after another in the same ``world`` gloo processes (one spawn); records of each run."""
    per_rank = run_on_ranks(_train_on_rank, world, list(configs))
    for other in per_rank[1:]:
        assert [[r["loss"] for r in run] for run in other] == [[r["loss"] for r in run] for run in per_rank[0]]
    return per_rank[0]


def losses(records):
    return [r["loss"] for r in records]


# ---------------------------------------------------------------------------------------------------------------------
# Loss curves


def test_torch_and_mega_moe_same_loss_curve(tmp_path):
    curves = {b: train_here(run_config(tmp_path, b, dispatch=b, steps=8)) for b in ("torch", "mega_moe")}
    a, b = losses(curves["torch"]), losses(curves["mega_moe"])
    assert len(a) == len(b) == 8
    # fp32 model: the two backends agree to rounding; bf16 tolerance would be ~2e-2.
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    gn_a = [r["grad_norm"] for r in curves["torch"]]
    gn_b = [r["grad_norm"] for r in curves["mega_moe"]]
    assert max(abs(x - y) / x for x, y in zip(gn_a, gn_b)) < 1e-3
    assert b[-1] < b[0] - 0.5  # and it learns (5.59 -> 4.79 over these 8 steps)


def test_bf16_curves_agree_within_bf16_tolerance(tmp_path):
    curves = {
        b: losses(train_here(run_config(tmp_path, b, dispatch=b, steps=4, model__dtype="bfloat16")))
        for b in ("torch", "mega_moe")
    }
    assert max(abs(x - y) / x for x, y in zip(curves["torch"], curves["mega_moe"])) < 2e-2, curves


def test_expert_parallel_mega_moe_matches_one_rank(tmp_path):
    one = losses(train_here(run_config(tmp_path, "one", steps=3, batch=4)))
    (two,) = train_on_ranks(2, run_config(tmp_path, "two", dispatch="mega_moe", ep=2, steps=3, batch=4))
    two = losses(two)
    assert max(abs(x - y) for x, y in zip(one, two)) < 1e-4, (one, two)


def test_fsdp_matches_allreduce(tmp_path):
    """FSDP2 (fully_shard over gloo on the CPU) and the plain gradient all-reduce give the same curve."""
    base = run_config(tmp_path, "ar", ep=2, steps=4, batch=4)
    fsdp = run_config(tmp_path, "fsdp", ep=2, steps=4, batch=4, train__data_parallel="fsdp")
    a, b = (losses(run) for run in train_on_ranks(2, base, fsdp))
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def test_activation_checkpointing_gives_the_same_curve(tmp_path):
    a = losses(train_here(run_config(tmp_path, "plain", steps=3)))
    b = losses(train_here(run_config(tmp_path, "ac", steps=3, train__activation_checkpointing=True)))
    assert a == pytest.approx(b, abs=1e-6)


def test_progress_bar_on_a_terminal(tmp_path, capsys):
    from prime_megamoe.train import train

    train(config_from_dict(run_config(tmp_path, "bar", steps=2)), progress_bar=True)
    captured = capsys.readouterr()
    assert "train" in captured.err and "2/2" in captured.err  # tqdm
    assert "step 1/2" not in captured.out  # no plain lines alongside the bar


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("data_parallel", ["allreduce", "fsdp"])
def test_resume_continues_the_identical_curve(tmp_path, data_parallel):
    d = run_config(
        tmp_path,
        "run",
        ep=2,
        steps=6,
        batch=4,
        train__checkpoint_every=3,
        train__data_parallel=data_parallel,
        train__save_final=True,
    )
    out = Path(d["output_dir"])
    resumed_cfg = copy.deepcopy(d)
    resumed_cfg["output_dir"] = str(tmp_path / "resumed")
    resumed_cfg["train"]["resume_from"] = str(out / "checkpoints" / "step_00000003")
    full, resumed = train_on_ranks(2, d, resumed_cfg)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(full)[3:]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full][3:]


def test_resume_latest_in_output_dir_mega_moe(tmp_path):
    d = run_config(tmp_path, "run", dispatch="mega_moe", steps=3, train__checkpoint_every=2)
    full = train_here(d)  # the last checkpoint is step 2 (no final one): as if the run had stopped after it
    out = Path(d["output_dir"])
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    resumed = train_here({**d, "train": {**d["train"], "resume": True}})
    assert losses(resumed) == losses(full)[2:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == losses(full)
    assert set(rows[0]) == {"step", "loss", "tokens_per_s", "lr", "grad_norm"}


def test_checkpoint_layout_mismatch_is_refused(tmp_path):
    d = run_config(tmp_path, "run", steps=1, train__save_final=True)
    train_here(d)
    ckpt = Path(d["output_dir"]) / "checkpoints" / "step_00000001"
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "world": 2, "ep": 2}))  # as if written by 2 ranks, ep = 2
    other = run_config(tmp_path, "other", steps=2, train__resume_from=str(ckpt))
    with pytest.raises(ConfigError, match="same layout"):
        train_here(other)


# ---------------------------------------------------------------------------------------------------------------------
# Models and data sources


def test_local_model_directory_loads_its_weights(tmp_path):
    """A directory written by save_pretrained trains from its weights (meta build, sliced loading, rotary buffers)."""
    from transformers import AutoModelForCausalLM

    from prime_megamoe.config import ModelConfig
    from prime_megamoe.integrations.transformers import register
    from prime_megamoe.train.models import resolve_model

    register()
    source = resolve_model(ModelConfig(name="tiny", overrides=dict(SMALL)))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(source.config).save_pretrained(tmp_path / "model")
    preset = losses(train_here(run_config(tmp_path, "preset", steps=2)))
    d = run_config(tmp_path, "dir", steps=2)
    d["model"] = {"name": str(tmp_path / "model"), "moe": d["model"]["moe"]}
    assert losses(train_here(d)) == pytest.approx(preset, abs=1e-6)


def _meta_paths_on_rank(rank, world, preset, from_dir, meta_init):
    from prime_megamoe.train import models, train

    runs = [train(config_from_dict(preset)), train(config_from_dict(from_dir))]
    models.FULL_INIT_MAX_PARAMS = 0  # force the meta-device build with per-rank initialisation
    runs.append(train(config_from_dict(meta_init)))
    return runs


def test_fsdp_meta_build_and_sliced_loading_on_two_ranks(tmp_path):
    """FSDP2 + ep = 2 from a weights directory (meta build, rows of each DTensor shard read from safetensors) matches
    the preset trained with the all-reduce; a meta-initialised FSDP2 model trains too."""
    from transformers import AutoModelForCausalLM

    from prime_megamoe.config import ModelConfig
    from prime_megamoe.integrations.transformers import register
    from prime_megamoe.train.models import resolve_model

    register()
    source = resolve_model(ModelConfig(name="tiny", overrides=dict(SMALL)))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(source.config).save_pretrained(tmp_path / "model")
    preset = run_config(tmp_path, "preset", ep=2, steps=3, batch=4)
    from_dir = run_config(tmp_path, "dir", ep=2, steps=3, batch=4, train__data_parallel="fsdp")
    from_dir["model"] = {"name": str(tmp_path / "model"), "moe": from_dir["model"]["moe"]}
    meta = run_config(tmp_path, "meta", ep=2, steps=3, batch=4, train__data_parallel="fsdp")
    a, b, c = run_on_ranks(_meta_paths_on_rank, 2, preset, from_dir, meta)[0]
    assert max(abs(x - y) for x, y in zip(losses(a), losses(b))) < 1e-5, (losses(a), losses(b))
    assert all(torch.isfinite(torch.tensor(losses(c)))) and losses(c)[-1] < losses(c)[0]


def test_jsonl_prompt_completion_masks_the_prompt(tmp_path):
    from prime_megamoe.config import DataConfig
    from prime_megamoe.train.data import IGNORE, ByteTokenizer, build_data, get_batch

    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"Q{i}:", "completion": f"A{i}"} for i in range(20)] + [{"text": "plain text row"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok = ByteTokenizer()
    data = build_data(DataConfig(source="jsonl", path=str(path), tokenizer="byte"), tok, 15, seed=0)
    ids, labels = get_batch(data, 0, 4, 0, 1)
    assert ids.shape == labels.shape == (4, 15)
    trained = tok.decode([int(t) for t in labels[labels != IGNORE]])
    assert "Q" not in trained and "A" in trained
    records = train_here(
        run_config(tmp_path, "jsonl", steps=2, data__source="jsonl", data__path=str(path), data__tokenizer="byte")
    )
    assert len(records) == 2


def test_jsonl_with_a_local_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"the answer to question {i} is {i * 7}" for i in range(40)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(tmp_path / "tok")
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    records = train_here(
        run_config(
            tmp_path, "tok", steps=3, data__source="jsonl", data__path=str(path), data__tokenizer=str(tmp_path / "tok")
        )
    )
    assert len(records) == 3 and records[-1]["loss"] < records[0]["loss"]


def test_synthetic_data_is_deterministic_and_split_over_ranks():
    from prime_megamoe.config import DataConfig
    from prime_megamoe.train.data import IGNORE, ByteTokenizer, build_data, get_batch, verify

    tok = ByteTokenizer()
    data = build_data(DataConfig(task="add"), tok, 31, seed=3)
    full_ids, full_labels = get_batch(data, 5, 4, 0, 1)
    again, _ = get_batch(data, 5, 4, 0, 1)
    assert torch.equal(full_ids, again)
    halves = [get_batch(data, 5, 4, r, 2)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), full_ids)
    assert not torch.equal(get_batch(data, 6, 4, 0, 1)[0], full_ids)
    assert (full_labels != IGNORE).any()
    for task in ("add", "reverse", "sort"):
        ex = build_data(DataConfig(task=task), tok, 31, seed=0).example(0)
        assert verify(task, ex.prompt, ex.completion)
        assert not verify(task, ex.prompt, ex.completion + "x")


# ---------------------------------------------------------------------------------------------------------------------
# Bad configs fail before any work, naming the key


@pytest.fixture
def no_work(monkeypatch):
    """Any attempt to build a model or start torch.distributed fails the test."""
    import prime_megamoe.train.trainer as trainer

    def boom(*args, **kwargs):
        raise AssertionError("work started before the configuration was checked")

    monkeypatch.setattr(trainer, "build_model", boom)
    monkeypatch.setattr(trainer, "init_runtime", boom)


@pytest.mark.parametrize(
    "dotted, key",
    [
        ({"model__moe__ep": 2}, "ep"),  # one process cannot hold an EP group of 2
        ({"model__moe__ep": 3}, "ep"),
        ({"model__moe__precision": "mxfp8"}, "precision"),  # the torch backend runs bf16 and fp8 only
        ({"model__moe__precision": "fp8_bwd"}, "precision"),
        ({"model__moe__dispatch__max_tokens_per_rank": 8}, "max_tokens_per_rank"),
        ({"train__seq_len": 5000}, "train.seq_len"),
        ({"model__name": "no-such-model-anywhere"}, "model.name"),
        ({"model__overrides__not_a_field": 3}, "model.overrides.not_a_field"),
        ({"data__source": "jsonl", "data__path": "/nonexistent.jsonl"}, "data.path"),
        ({"data__tokenizer": "/nonexistent-tokenizer"}, "data.tokenizer"),
        ({"train__resume_from": "/nonexistent-ckpt"}, "train.resume_from"),
    ],
)
def test_bad_config_fails_before_work(tmp_path, no_work, dotted, key):
    d = run_config(tmp_path, "bad", **dotted)
    with pytest.raises(ConfigError) as info:
        train_here(d)
    assert key in str(info.value)
    assert not Path(d["output_dir"]).exists()


def test_torch_backend_takes_fp8(tmp_path):
    # The torch backend runs precision = "fp8" (rowwise-scaled e4m3 GEMMs); mxfp8 and fp8_bwd need mega_moe.
    from prime_megamoe.train.models import resolve_model
    from prime_megamoe.train.trainer import validate

    cfg = config_from_dict(run_config(tmp_path, "v", model__moe__precision="fp8"))
    validate(cfg, resolve_model(cfg.model), world=1, local_world=1)
    cfg = config_from_dict(run_config(tmp_path, "v", model__moe__precision="mxfp8"))
    with pytest.raises(ConfigError, match=r"precision = 'mxfp8' needs dispatch = 'mega_moe'.*'bf16' or 'fp8'"):
        validate(cfg, resolve_model(cfg.model), world=1, local_world=1)


def test_batch_must_split_over_ranks_and_ep_must_stay_in_a_node(tmp_path):
    from prime_megamoe.train.models import resolve_model
    from prime_megamoe.train.trainer import validate

    cfg = config_from_dict(run_config(tmp_path, "v", batch=3))
    with pytest.raises(ConfigError, match="train.batch_size"):
        validate(cfg, resolve_model(cfg.model), world=2, local_world=2)
    cfg = config_from_dict(run_config(tmp_path, "v", ep=4, batch=8))
    with pytest.raises(ConfigError, match=r"ep = 4 would span nodes.*LOCAL_WORLD_SIZE = 2"):
        validate(cfg, resolve_model(cfg.model), world=4, local_world=2)
    validate(cfg, resolve_model(cfg.model), world=8, local_world=4)


def test_cli_errors_name_the_key_and_do_nothing(tmp_path, capsys, no_work):
    from prime_megamoe.train.cli import main

    toml = tmp_path / "typo.toml"
    toml.write_text(f'output_dir = "{tmp_path / "out"}"\n[train]\nstepz = 3\n')
    assert main([str(toml)]) == 2
    err = capsys.readouterr().err
    assert "stepz" in err and str(toml) in err
    good = tmp_path / "good.toml"
    good.write_text(f'output_dir = "{tmp_path / "out"}"\n')
    assert main([str(good), "--train.stepz", "3"]) == 2
    assert "--train.stepz" in capsys.readouterr().err
    assert main([str(good), "--model.moe.precision", "fp4"]) == 2
    assert "fp4" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def test_cli_overrides_and_help(capsys):
    from prime_megamoe.train.cli import config_from_argv, main, parse_args

    path, overrides, wants_help = parse_args(
        [
            "configs/tiny.toml",
            "--train.steps",
            "50",
            "--output-dir",
            "runs/x",
            "--model.moe.dispatch",
            "torch",
            "--train.activation-checkpointing",
            "--optim.betas=[0.8, 0.9]",
            "--model.overrides.num_hidden_layers",
            "1",
        ]
    )
    assert path == "configs/tiny.toml" and not wants_help
    assert overrides == {
        "train.steps": 50,
        "output_dir": "runs/x",
        "model.moe.dispatch": "torch",
        "train.activation_checkpointing": True,
        "optim.betas": [0.8, 0.9],
        "model.overrides.num_hidden_layers": 1,
    }
    cfg = config_from_argv(
        [str(REPO / "configs" / "tiny.toml"), "--train.steps", "50", "--model.moe.dispatch", "torch"]
    )
    assert cfg.train.steps == 50
    assert cfg.model.moe.dispatch.type == "torch"
    assert cfg.model.moe.dispatch.max_tokens_per_rank == 32  # the table's options survive the shorthand
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in (
        "--output-dir",
        "--train.steps",
        "--model.moe.dispatch.max_tokens_per_rank",
        "--model.moe.precision",
        "--data.path",
        "--optim.lr",
        "--train.activation_checkpointing",
    ):
        assert flag in text


def _torchrun(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "prime_megamoe.train", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_loss_falls_on_the_tiny_config(tmp_path):
    """configs/tiny.toml through torchrun (2 ranks, ep = 2) with the torch backend: the loss falls well."""
    out = tmp_path / "tiny"
    proc = _torchrun(["configs/tiny.toml", "--model.moe.dispatch", "torch", "--output-dir", str(out)], tmp_path, 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) == 12
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"], [r["loss"] for r in rows]
    assert "step 1/" in proc.stdout  # plain lines when not on a terminal
    assert (out / "checkpoints" / "latest").is_file()


@pytest.mark.skipif(
    not os.environ.get("PRIME_MEGAMOE_SLOW"), reason="the full main command (minutes); set PRIME_MEGAMOE_SLOW=1"
)
def test_main_command_with_mega_moe(tmp_path):
    out = tmp_path / "tiny"
    proc = _torchrun(["configs/tiny.toml", "--output-dir", str(out)], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _metrics(out)
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"]


def test_single_process_refuses_ep_without_ranks(tmp_path):
    """python -m prime_megamoe.train with ep = 2 and no torchrun: a clear error, exit code 2."""
    cmd = [sys.executable, "-m", "prime_megamoe.train", "configs/tiny.toml", "--output-dir", str(tmp_path / "o")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "ep = 2" in proc.stderr and "torchrun" in proc.stderr
    assert not (tmp_path / "o").exists()
