"""The SFT loop: build, parallelise, train, log, checkpoint."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import TORCH_PRECISIONS, Config, ConfigError, OptimConfig
from ..integrations import transformers as hf
from ..ops.quantized_experts import invalidate_weight_cache
from . import checkpoint as ckpt
from .data import IGNORE, build_data, build_tokenizer, get_batch
from .models import build_model, decoder_blocks, initialize, num_experts_of, resolve_model
from .parallel import (
    Runtime,
    all_reduce_sum,
    apply_activation_checkpointing,
    apply_fsdp,
    clip_grad_norm,
    init_runtime,
    split_parameters,
    sync_gradients,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def lr_at(step: int, optim: OptimConfig, total: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    span = max(1, total - optim.warmup_steps - 1)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    floor = optim.min_lr_ratio
    return optim.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _launch_world() -> tuple[int, int]:
    """(ranks, ranks per node) of this launch, known before torch.distributed is initialised."""
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def validate(cfg: Config, source, world: int, local_world: int) -> None:
    """Checks that need the model config or the launch, all before any work; each error names its key."""
    moe = cfg.model.moe
    hf.check_expert_parallel_layout(moe.ep, world, local_world)
    experts = num_experts_of(source.config)
    if experts is None:
        raise ConfigError(f"model.name = {cfg.model.name!r} is not a Mixture-of-Experts model (no num_experts)")
    if experts % moe.ep:
        raise ConfigError(
            f"[model.moe] ep = {moe.ep} does not divide the model's {experts} experts; choose a divisor of {experts}"
        )
    if cfg.train.batch_size % world:
        raise ConfigError(
            f"train.batch_size = {cfg.train.batch_size} is not divisible by the {world} ranks; every rank takes "
            "batch_size / ranks sequences"
        )
    tokens = cfg.train.batch_size // world * cfg.train.seq_len
    if moe.dispatch.max_tokens_per_rank is not None and tokens > moe.dispatch.max_tokens_per_rank:
        raise ConfigError(
            f"{tokens} tokens per rank per step (train.batch_size / ranks * train.seq_len) exceed "
            f"[model.moe.dispatch] max_tokens_per_rank = {moe.dispatch.max_tokens_per_rank}; raise it or use a "
            "smaller batch"
        )
    max_pos = getattr(source.config, "max_position_embeddings", None)
    if max_pos is not None and cfg.train.seq_len > max_pos:
        raise ConfigError(f"train.seq_len = {cfg.train.seq_len} exceeds the model's max_position_embeddings {max_pos}")
    if moe.dispatch.type == "torch" and moe.precision not in TORCH_PRECISIONS:
        raise ConfigError(
            f"[model.moe] precision = {moe.precision!r} needs dispatch = 'mega_moe'; the torch backend runs "
            f"precision = {' or '.join(map(repr, TORCH_PRECISIONS))} only"
        )
    if cfg.train.resume_from is not None and not Path(cfg.train.resume_from).is_dir():
        raise ConfigError(f"train.resume_from = {cfg.train.resume_from!r} is not a directory")


class _Progress:
    """A tqdm bar on a terminal, plain lines otherwise; only on rank 0."""

    def __init__(self, enabled: bool, total: int, initial: int, every: int, bar: bool | None):
        self.enabled = enabled
        self.every = every
        self.total = total
        self.bar = None
        if enabled and (sys.stderr.isatty() if bar is None else bar):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def update(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if rec["step"] % self.every == 0 or rec["step"] == self.total:
                self.bar.set_postfix(
                    loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", tok_s=f"{rec['tokens_per_s']:.0f}"
                )
        elif rec["step"] % self.every == 0 or rec["step"] == self.total:
            print(
                f"step {rec['step']}/{self.total} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                f"grad_norm {rec['grad_norm']:.3f} tokens/s {rec['tokens_per_s']:.0f}",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _report_workspaces(rt: Runtime) -> None:
    """After the first step: the symmetric-memory buffers the expert-parallel layers allocated (none off CUDA)."""
    from ..comm.symmetric_memory import workspace_info

    for ws in workspace_info():
        _log(
            rt,
            f"symmetric-memory workspace: ep {ws['ep']}, max_tokens_per_rank {ws['max_tokens_per_rank']}, "
            f"H {ws['hidden']}, k {ws['top_k']}, {ws['dtype']}: {ws['bytes_per_rank'] / 2**20:.1f} MiB per rank",
        )


def _log(rt: Runtime, msg: str) -> None:
    if rt.is_main:
        print(msg, flush=True)


def train(cfg: Config, *, progress_bar: bool | None = None) -> list[dict]:
    """Run the configured training; returns the per-step metrics (the same on every rank)."""
    world, local_world = _launch_world()
    source = resolve_model(cfg.model)
    validate(cfg, source, world, local_world)
    tok = build_tokenizer(cfg.data, source.local_dir)
    vocab = getattr(source.config, "vocab_size", None)
    if vocab is not None and tok.vocab_size > vocab:
        raise ConfigError(
            f"data.tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab}; use the model's "
            "tokenizer or set model.overrides.vocab_size"
        )
    dataset = build_data(cfg.data, tok, cfg.train.seq_len, cfg.train.seed)
    out_dir = Path(cfg.output_dir)
    resume_path = Path(cfg.train.resume_from) if cfg.train.resume_from else None
    if resume_path is None and cfg.train.resume:
        resume_path = ckpt.latest_checkpoint(out_dir)

    rt = init_runtime(cfg.train.device, cfg.model.moe.ep, cfg.train.data_parallel)
    try:
        return _run(cfg, rt, source, dataset, out_dir, resume_path, progress_bar)
    finally:
        if rt.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def _run(cfg: Config, rt: Runtime, source, dataset, out_dir: Path, resume_path, progress_bar) -> list[dict]:
    compute_dtype = DTYPES[cfg.model.dtype]
    moe = cfg.model.moe
    if moe.dispatch.max_tokens_per_rank is None:  # unset: this run's tokens per rank, as prime-rl reads it
        moe.dispatch.max_tokens_per_rank = cfg.train.batch_size // rt.world * cfg.train.seq_len
    model, needs_init = build_model(
        source,
        experts_implementation=moe.dispatch.type,
        param_dtype=torch.float32 if rt.fsdp else compute_dtype,
        ep_group=rt.ep.ep_group,
        seed=cfg.train.seed,
        ep_rank=rt.ep.ep_rank,
    )
    hf.configure_experts(model, moe, rt.ep.ep_group)
    blocks = decoder_blocks(model)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(blocks)
    if rt.fsdp:
        apply_fsdp(model, blocks, rt, compute_dtype)
    elif not needs_init:
        model.to(rt.device)
    if needs_init:
        initialize(model, source, rt.device, seed=cfg.train.seed, ep_rank=rt.ep.ep_rank)
    model.train()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False

    dense, experts = split_parameters(model)
    o = cfg.optim
    groups = [
        {"params": [p for p in dense if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in dense if p.dim() < 2], "weight_decay": 0.0},
        {"params": experts, "weight_decay": o.weight_decay},
    ]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )

    start = 0
    metrics_path = out_dir / "metrics.jsonl"
    if resume_path is not None:
        meta = ckpt.load_checkpoint(resume_path, model, optimizer, rt)
        start = meta["step"]
        _log(rt, f"resumed from {resume_path} at step {start}")
    elif cfg.train.resume:
        _log(rt, f"train.resume: no checkpoint in {ckpt.checkpoint_root(out_dir)}, starting from step 0")
    if rt.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if start and metrics_path.is_file():
            kept = [
                line for line in metrics_path.read_text().splitlines() if line and json.loads(line)["step"] <= start
            ]
        metrics_path.write_text("".join(line + "\n" for line in kept))
        (out_dir / "config.json").write_text(cfg.model_dump_json(indent=2))

    n_params = sum(p.numel() for p in dense) + rt.ep.ep * sum(p.numel() for p in experts)
    _log(
        rt,
        f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, {len(blocks)} blocks | ranks {rt.world}, "
        f"ep {rt.ep.ep}, {'fsdp' if rt.fsdp else 'all-reduce'} data parallel on {rt.device.type} | experts "
        f"{moe.dispatch.type} ({moe.precision}) | {cfg.train.steps} steps of {cfg.train.batch_size} x "
        f"{cfg.train.seq_len} tokens",
    )

    steps, batch, seq = cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len
    progress = _Progress(rt.is_main, steps, start, cfg.train.log_every, progress_bar)
    records: list[dict] = []
    began = time.perf_counter()
    for step in range(start, steps):
        t0 = time.perf_counter()
        input_ids, labels = get_batch(dataset, step, batch, rt.rank, rt.world)
        input_ids, labels = input_ids.to(rt.device), labels.to(rt.device)
        lr = lr_at(step, o, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr

        logits = model(input_ids=input_ids, use_cache=False).logits
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        counted = all_reduce_sum((labels != IGNORE).sum().to(torch.float32))
        loss = loss_sum / counted.clamp(min=1.0)
        loss.backward()
        sync_gradients(dense, experts, rt)
        grad_norm = clip_grad_norm(dense, experts, o.max_grad_norm, rt)
        optimizer.step()
        # Quantised precisions cache fp8 weights per parameter version; FSDP2 may re-gather into the same storage
        # without bumping it, so drop the cache once per step (a no-op for bf16).
        invalidate_weight_cache()
        optimizer.zero_grad(set_to_none=True)
        global_loss = float(all_reduce_sum(loss.detach().clone()))
        elapsed = time.perf_counter() - t0

        rec = {
            "step": step + 1,
            "loss": global_loss,
            "tokens_per_s": batch * seq / elapsed,
            "lr": lr,
            "grad_norm": grad_norm,
        }
        records.append(rec)
        if step == start:
            _report_workspaces(rt)
        if rt.is_main:
            with metrics_path.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
        progress.update(rec)
        done = step + 1
        every = cfg.train.checkpoint_every
        if (every and done % every == 0 and done != steps) or (done == steps and cfg.train.save_final):
            path = ckpt.save_checkpoint(out_dir, done, model, optimizer, rt, {"config": cfg.model_dump(mode="json")})
            if done != steps:
                _log(rt, f"saved {path}")
            elif progress.bar is None:
                _log(rt, f"saved {path}")
    progress.close()
    if records:
        _log(
            rt,
            f"done: {len(records)} steps in {time.perf_counter() - began:.1f}s, loss {records[0]['loss']:.4f} -> "
            f"{records[-1]['loss']:.4f}; metrics in {metrics_path}",
        )
    return records
