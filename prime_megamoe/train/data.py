"""Training data: a byte-level tokenizer, a verifiable synthetic task, JSONL files, and packed batches.

Every batch is a pure function of (seed, step): sequence ``i`` of the stream is built from its own RNG (synthetic)
or from a seeded per-epoch permutation (JSONL), so a resumed run sees exactly the batches it would have seen, and
rank ``r`` of ``W`` takes rows ``[r*B/W, (r+1)*B/W)`` of the global batch of ``B`` sequences.

Examples are packed into rows of ``seq_len + 1`` tokens (inputs are the first ``seq_len``, labels the last
``seq_len``); the loss covers completion tokens only (every token for plain text), padding never counts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..config import ConfigError, DataConfig

IGNORE = -100


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then <pad> = 256, <bos> = 257, <eos> = 258. ``vocab_size`` = 260 (rounded up)."""

    vocab_size = 260
    pad_id = 256
    bos_id = 257
    eos_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local transformers tokenizer directory (no download)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id
        self.bos_id = self.tok.bos_token_id
        pad = self.tok.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def build_tokenizer(data: DataConfig, model_dir: str | None) -> Tokenizer:
    """``data.tokenizer``: 'byte', a local directory, or (unset) the model directory's tokenizer if it has one."""
    name = data.tokenizer
    if name is None:
        if model_dir is not None and any(
            (Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            return HFTokenizer(model_dir)
        return ByteTokenizer()
    if name == "byte":
        return ByteTokenizer()
    if not Path(name).is_dir():
        raise ConfigError(
            f"data.tokenizer = {name!r} is not a local directory (nor 'byte'); give a tokenizer directory"
        )
    return HFTokenizer(name)


# ---------------------------------------------------------------------------------------------------------------------
# The synthetic task


@dataclass(frozen=True)
class Example:
    prompt: str
    completion: str


def _task_add(rng: random.Random) -> Example:
    a, b = rng.randrange(1000), rng.randrange(1000)
    return Example(f"{a}+{b}=", str(a + b))


def _task_reverse(rng: random.Random) -> Example:
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
    return Example(f"reverse {word}:", word[::-1])


def _task_sort(rng: random.Random) -> Example:
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
    return Example(f"sort {letters}:", "".join(sorted(letters)))


TASKS: dict[str, Callable[[random.Random], Example]] = {"add": _task_add, "reverse": _task_reverse, "sort": _task_sort}


def verify(task: str, prompt: str, completion: str) -> bool:
    """Is ``completion`` the right answer to ``prompt``? (The synthetic tasks are checkable.)"""
    completion = completion.strip()
    if task == "add":
        a, b = prompt.rstrip("=").split("+")
        return completion == str(int(a) + int(b))
    word = prompt.split(" ", 1)[1].rstrip(":")
    if task == "reverse":
        return completion == word[::-1]
    if task == "sort":
        return completion == "".join(sorted(word))
    raise ValueError(f"unknown task {task!r}; tasks: {sorted(TASKS)}")


def _encode_example(tok: Tokenizer, prompt: str, completion: str) -> tuple[list[int], list[bool]]:
    """Token ids of one example and which of them are trained on (completion and end-of-sequence)."""
    ids, train = [], []
    if tok.bos_id is not None:
        ids.append(tok.bos_id)
        train.append(False)
    p = tok.encode(prompt)
    c = tok.encode(completion)
    ids += p + c
    train += [False] * len(p) + [True] * len(c)
    if tok.eos_id is not None:
        ids.append(tok.eos_id)
        train.append(True)
    return ids, train


def _pack(examples, tok: Tokenizer, length: int) -> tuple[list[int], list[bool], int]:
    """Fill one row of ``length`` tokens with whole examples (the first one truncated if longer), pad the rest.
    Returns (ids, trained mask, examples used)."""
    ids: list[int] = []
    train: list[bool] = []
    used = 0
    for e_ids, e_train in examples:
        if ids and len(ids) + len(e_ids) > length:
            break
        ids += e_ids
        train += e_train
        used += 1
        if len(ids) >= length:
            break
    ids, train = ids[:length], train[:length]
    pad = length - len(ids)
    return ids + [tok.pad_id] * pad, train + [False] * pad, used


def _to_tensors(rows: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of seq_len + 1 tokens -> (input_ids [B, S], labels [B, S]) with labels[t] = token[t+1] where trained."""
    tokens = torch.tensor([r[0] for r in rows], dtype=torch.long)
    trained = torch.tensor([r[1] for r in rows], dtype=torch.bool)
    labels = torch.where(trained[:, 1:], tokens[:, 1:], torch.full_like(tokens[:, 1:], IGNORE))
    return tokens[:, :-1].contiguous(), labels.contiguous()


class SyntheticData:
    """Row ``i`` of the stream: examples of ``task`` drawn from ``Random(seed, i mod num_examples)``, packed."""

    def __init__(self, data: DataConfig, tok: Tokenizer, seq_len: int, seed: int):
        self.task = data.task
        self.make = TASKS[data.task]
        self.tok = tok
        self.length = seq_len + 1
        self.seed = seed
        self.num_examples = data.num_examples

    def row(self, index: int) -> tuple[list[int], list[bool]]:
        rng = random.Random(f"{self.seed}/{index % self.num_examples}")

        def examples():
            while True:
                ex = self.make(rng)
                yield _encode_example(self.tok, ex.prompt, ex.completion)

        ids, train, _ = _pack(examples(), self.tok, self.length)
        return ids, train

    def example(self, index: int) -> Example:
        """A held-out example (a separate stream) to check generations against."""
        return self.make(random.Random(f"eval/{self.seed}/{index}"))


class JsonlData:
    """Lines ``{"text": ...}`` (all tokens trained) or ``{"prompt": ..., "completion": ...}`` (completion trained),
    packed greedily in file order into rows; rows are visited in a seeded permutation per epoch."""

    def __init__(self, data: DataConfig, tok: Tokenizer, seq_len: int, seed: int):
        path = Path(data.path or "")
        if not path.is_file():
            raise ConfigError(f"data.path = {data.path!r} is not a file")
        self.tok = tok
        self.length = seq_len + 1
        self.seed = seed
        encoded = []
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"data.path = {data.path}: line {lineno} is not JSON ({err})") from None
                if "text" in obj:
                    ids = tok.encode(obj["text"])
                    if tok.eos_id is not None:
                        ids.append(tok.eos_id)
                    encoded.append((ids, [True] * len(ids)))
                elif "prompt" in obj and "completion" in obj:
                    encoded.append(_encode_example(tok, obj["prompt"], obj["completion"]))
                else:
                    raise ConfigError(
                        f"data.path = {data.path}: line {lineno} needs a 'text' key or 'prompt' and 'completion' keys"
                    )
        if not encoded:
            raise ConfigError(f"data.path = {data.path} holds no examples")
        self.rows = []
        i = 0
        while i < len(encoded):
            ids, train, used = _pack(iter(encoded[i:]), tok, self.length)
            self.rows.append((ids, train))
            i += used
        self._perms: dict[int, list[int]] = {}

    def row(self, index: int) -> tuple[list[int], list[bool]]:
        epoch, pos = divmod(index, len(self.rows))
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perms = {epoch: torch.randperm(len(self.rows), generator=g).tolist()}
        return self.rows[self._perms[epoch][pos]]


def build_data(data: DataConfig, tok: Tokenizer, seq_len: int, seed: int):
    if data.source == "synthetic":
        return SyntheticData(data, tok, seq_len, seed)
    return JsonlData(data, tok, seq_len, seed)


def get_batch(dataset, step: int, batch_size: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (input_ids, labels) of global batch ``step``."""
    per_rank = batch_size // world
    first = step * batch_size + rank * per_rank
    return _to_tensors([dataset.row(first + j) for j in range(per_rank)])
