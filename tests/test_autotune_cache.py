"""Disk cache of autotuning choices among candidates with pre-launch hooks (``kernels.autotune_cache``): a second
process (a fresh autotuner) takes the first one's choice without timing, and anything the timings depend on (the GPU,
the candidate list, the kernel) times afresh. The cache is driven directly: the interpreter runs no autotuning."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from prime_megamoe.kernels import autotune_cache, tuning


def _copy_kernel(src, dst, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < N), mask=offs < N)


def _other_kernel(src, dst, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < N) + 1, mask=offs < N)


def _box_hook(nargs):  # stands in for the TMA box hooks
    pass


def _tuner(blocks=(32, 64, 128), kernel=_copy_kernel, hook=_box_hook):
    # jitted here, with the interpreter off (the fixture): the compiled kernels' form, whose source hash keys the cache
    configs = [triton.Config({"BLOCK": b}, pre_hook=hook) for b in blocks]
    return tuning.autotune(configs, key=["N"])(triton.jit(kernel))


def _bench_choosing(tuner, key, position, calls):
    def bench():
        calls.append(key)
        tuner.configs_timings = {c: [float(i + 1), 0.0, 0.0] for i, c in enumerate(tuner.configs)}
        tuner.configs_timings[tuner.configs[position]] = [0.5, 0.0, 0.0]
        tuner.cache[key] = tuner.configs[position]

    return bench


def _must_not_time():
    raise AssertionError("timed again: the choice on disk was not used")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(autotune_cache, "device_identity", lambda: "GPU A sm_90")
    return tmp_path


def test_a_fresh_autotuner_takes_the_choice_from_disk(cache_dir):
    key, calls = (4096, "torch.bfloat16"), []
    first = _tuner()
    assert isinstance(first, Autotuner)
    assert first.check_disk_cache(key, first.configs, _bench_choosing(first, key, 1, calls)) is False
    assert calls == [key] and list(cache_dir.rglob("*.hooked_autotune.json"))
    again = _tuner()  # another process: new autotuner, new (equal) candidates
    assert again.check_disk_cache(key, again.configs, _must_not_time) is True
    assert again.cache[key] is again.configs[1]
    assert again.configs_timings[again.configs[1]][0] == 0.5
    # another key of the same kernel is timed
    other = (8192, "torch.bfloat16")
    assert again.check_disk_cache(other, again.configs, _bench_choosing(again, other, 2, calls)) is False
    assert calls == [key, other]


def test_what_the_timings_depend_on_times_afresh(cache_dir, monkeypatch):
    key, calls = (4096,), []
    first = _tuner()
    first.check_disk_cache(key, first.configs, _bench_choosing(first, key, 0, calls))
    for tuner in (_tuner(blocks=(32, 64)), _tuner(kernel=_other_kernel), _tuner(hook=lambda nargs: None)):
        assert tuner.check_disk_cache(key, tuner.configs, _bench_choosing(tuner, key, 0, calls)) is False
    monkeypatch.setattr(autotune_cache, "device_identity", lambda: "GPU B sm_90")
    tuner = _tuner()
    assert tuner.check_disk_cache(key, tuner.configs, _bench_choosing(tuner, key, 0, calls)) is False
    assert len(calls) == 5


def test_candidates_without_hooks_keep_tritons_cache(cache_dir, monkeypatch):
    seen = []
    monkeypatch.setattr(Autotuner, "check_disk_cache", lambda self, *args: seen.append(args) or True)
    tuner = _tuner(hook=None)
    assert tuner.check_disk_cache((1,), tuner.configs, _must_not_time) is True
    assert len(seen) == 1 and not list(cache_dir.rglob("*.hooked_autotune.json"))
