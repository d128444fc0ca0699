"""The faster of two kernel families for one GEMM shape, timed on the device at its first call and kept on disk.

Where the warp-specialised bf16 kernels (``bf16_ws_launch``) and the Triton ones compute the same GEMM with the same
bits, which of them is faster depends on the shape and the GPU (a few percent either way at Qwen3-30B-A3B, more at
Qwen3-235B-A22B). ``fastest`` times each candidate on the call's own inputs (a warm-up call, which compiles and
autotunes, then the best of a few rounds of back-to-back calls), remembers the winner for the process and writes it
to ``kernel_choices.json`` under ``PRIME_MEGAMOE_CACHE_DIR`` (default ``~/.cache/prime_megamoe``), so a new process
on the same GPU model, SM budget and versions reuses it. A choice never changes a result: the candidates are bitwise
equal (``tests/test_kernel_choice.py`` checks it on a Hopper GPU at the Qwen3 MoE shapes).

The first candidate runs off CUDA (the interpreter) and with PRIME_MEGAMOE_AUTOTUNE=0 (correctness runs). A shape
with no choice yet runs it untimed, and nothing is cached, while a CUDA graph is being captured and for problems below
``tuning.SMALL_PROBLEM`` multiply-adds.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..env import env_get
from ..kernels import tuning
from .sm_budget import available_sms, cuda_properties

CACHE_DIR_ENV = "PRIME_MEGAMOE_CACHE_DIR"
CACHE_FILE = "kernel_choices.json"
# Raise when a kernel changes enough that choices timed before it no longer hold.
CHOICE_FORMAT = 1
_ROUNDS, _CALLS = 3, 3

_chosen: dict[str, str] = {}  # this process's choices, by full key
_disk: dict[str, dict] | None = None  # the file's entries, read once


def cache_path() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "prime_megamoe"
    return Path(root) / CACHE_FILE


@functools.cache
def _versions() -> str:
    import triton

    return f"format {CHOICE_FORMAT}, torch {torch.__version__}, triton {triton.__version__}"


def _full_key(op: str, key: tuple, device: torch.device) -> str:
    # Built on every call that asks: the device's name comes from torch's cached properties, the SM count from the
    # budget in effect (it may differ between calls)
    gpu = cuda_properties(device).name
    return f"{op} {key} on {gpu}, {available_sms(device)} SMs ({_versions()})"


def _read_disk() -> dict[str, dict]:
    global _disk
    if _disk is None:
        try:
            _disk = json.loads(cache_path().read_text())
        except FileNotFoundError:
            _disk = {}
        except (OSError, ValueError) as err:  # unreadable or torn: time again, and overwrite it
            warnings.warn(f"prime_megamoe: ignoring the kernel-choice cache {cache_path()}: {err}", stacklevel=3)
            _disk = {}
    return _disk


def _write_disk(full_key: str, entry: dict) -> None:
    disk = _read_disk()
    disk[full_key] = entry
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # what other processes (ranks) wrote since this one read the file, under this one's entries
            on_file = json.loads(path.read_text())
        except (OSError, ValueError):
            on_file = {}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**on_file, **disk}, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    except OSError as err:
        warnings.warn(f"prime_megamoe: could not write the kernel-choice cache {path}: {err}", stacklevel=3)


def chooses_on(device: torch.device) -> bool:
    """Whether ``fastest`` chooses at all on ``device``: CUDA, not the interpreter, autotuning not turned off."""
    autotune = env_get("PRIME_MEGAMOE_AUTOTUNE", "1") != "0"
    return device.type == "cuda" and not tuning.interpreting() and autotune


def may_time(device: torch.device, work: int) -> bool:
    """Whether ``fastest`` may time candidates for a problem of ``work`` multiply-adds on ``device`` (a choice
    already made is used wherever a device is, a CUDA graph's capture included)."""
    if not chooses_on(device) or work < tuning.SMALL_PROBLEM:
        return False
    return not torch.cuda.is_current_stream_capturing()


def time_candidates(candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    """ms per call of each candidate on the current stream: one warm-up call each, then the best of ``_ROUNDS``
    rounds (the candidates take turns, so drift of the clocks falls on all of them) of ``_CALLS`` calls."""
    for run in candidates.values():
        run()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(_ROUNDS):
        for name, run in candidates.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(_CALLS):
                run()
            end.record()
            end.synchronize()
            best[name] = min(best[name], start.elapsed_time(end) / _CALLS)
    return best


def fastest(op: str, key: tuple, candidates: dict[str, Callable[[], object]], device: torch.device, work: int) -> str:
    """The name of the fastest of ``candidates`` (callables that compute the same result into the same outputs) for
    ``op`` at ``key`` (what the time depends on besides the device: sizes, layout flags), ``work`` multiply-adds.
    The caller runs the one named (the timing calls leave their outputs as any call would)."""
    default = next(iter(candidates))
    if not chooses_on(device):
        return default
    full_key = _full_key(op, key, device)
    name = _chosen.get(full_key)
    if name is None:
        entry = _read_disk().get(full_key)
        if entry is not None and entry.get("chosen") in candidates:
            name = entry["chosen"]
        elif may_time(device, work):
            times = time_candidates(candidates)
            name = min(times, key=times.get)
            _write_disk(full_key, {"chosen": name, "ms": {k: round(v, 5) for k, v in times.items()}})
        else:
            return default
        _chosen[full_key] = name
    return name


def forget() -> None:
    """Drop this process's choices and its copy of the file (tests; a changed cache directory)."""
    global _disk
    _chosen.clear()
    _disk = None
