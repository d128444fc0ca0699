"""Autotuning choices of candidates with a pre-launch hook, kept on disk.

Triton keeps an autotuner's timings on disk only when no candidate has a pre-launch hook (it cannot store the hook),
so kernels whose candidates set their TMA boxes in one (the grouped GEMMs', the weight gradients') were timed again
in every process: a trainer's ranks spent their first step timing each GEMM shape anew. ``install`` gives an
autotuner a disk cache that keeps the choice as its position in the candidate list, under a key of what the list and
its timings depend on: Triton's version, the GPU, the kernel's source (with what it calls), the autotuning key and
every candidate with its hook's name. A changed list or kernel is timed afresh; candidates without hooks keep
Triton's own cache.
"""

from __future__ import annotations

import hashlib
import json
import types

import torch
import triton
from triton.runtime.cache import get_cache_manager
from triton.runtime.jit import JITFunction


def _jit_function(tuner) -> JITFunction:
    fn = tuner.fn
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def device_identity() -> str:
    """The current GPU's name and compute capability: timings of one GPU model are not another's."""
    device = torch.cuda.current_device()
    return f"{torch.cuda.get_device_name(device)} sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"


def cache_key(tuner, tuning_key, configs) -> str:
    parts = [triton.__version__, device_identity(), _jit_function(tuner).cache_key, str(tuning_key)]
    parts += [f"{config} hook={getattr(config.pre_hook, '__qualname__', None)}" for config in configs]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def check_disk_cache(tuner, tuning_key, configs, bench_fn) -> bool:
    """``Autotuner.check_disk_cache`` (same contract: True when the choice came from disk, else ``bench_fn`` ran and
    set ``tuner.cache[tuning_key]`` and ``tuner.configs_timings``) for candidate lists with pre-launch hooks."""
    if not tuning_key or not any(config.pre_hook for config in configs):
        return type(tuner).check_disk_cache(tuner, tuning_key, configs, bench_fn)
    cache = get_cache_manager(cache_key(tuner, tuning_key, configs))
    file_name = f"{_jit_function(tuner).__name__[:150]}.hooked_autotune.json"
    path = cache.get_file(file_name)
    if path:
        with open(path) as f:
            record = json.load(f)
        if len(record["timings"]) == len(configs) and 0 <= record["best"] < len(configs):
            tuner.configs_timings = dict(zip(configs, record["timings"]))
            tuner.cache[tuning_key] = configs[record["best"]]
            return True
    bench_fn()
    best = next(i for i, config in enumerate(configs) if config is tuner.cache[tuning_key])
    timings = [tuner.configs_timings[config] for config in configs]
    cache.put(json.dumps({"key": str(tuning_key), "best": best, "timings": timings}), file_name, binary=False)
    return False


def install(tuner):
    """``tuner`` (a ``triton.runtime.autotuner.Autotuner``) with ``check_disk_cache`` above; returns it."""
    tuner.check_disk_cache = types.MethodType(check_disk_cache, tuner)
    return tuner
