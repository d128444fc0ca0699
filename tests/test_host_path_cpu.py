"""scripts/host_path_cpu.py: the layer's Hopper host path timed on a CPU, launches going to stand-in kernels."""

from __future__ import annotations

import prime_megamoe.ops.compiled_launch as compiled_launch
import prime_megamoe.ops.fp8_ws_launch as fp8_ws_launch
from tests.scripts import load_script

host_path_cpu = load_script("host_path_cpu")


def test_calls_take_the_hopper_path_through_the_compiled_launch_cache_and_the_patches_are_undone():
    originals = (fp8_ws_launch.hopper_unavailable, compiled_launch._first_launch, compiled_launch.direct_launch_enabled)
    with host_path_cpu.hopper_path_on_cpu():
        calls = host_path_cpu.steps("tiny", 64, ["bf16", "fp8"], "forward-backward")
        times = host_path_cpu.host_times(calls, rounds=3, warmup=1)
        stand_ins = [e for e in compiled_launch._CACHE.values() if isinstance(e.compiled, host_path_cpu.StandInKernel)]
        # keys start with the kernel's id, exact keys with "exact" and then the kernel's id
        kernels = {
            key[1] if key[0] == "exact" else key[0] for key, e in compiled_launch._CACHE.items() if e in stand_ins
        }
    assert set(times) == {"bf16", "fp8"} and all(len(t) == 3 and min(t) > 0 for t in times.values())
    assert stand_ins
    # the warp-specialised kernels were reached through the cache (keyed by the kernel's id), not run
    for module, name in (("fp8_fc1_ws", "fp8_fc1_swiglu_ws_kernel"), ("wgrad_ws", "bf16_grouped_wgrad_ws_kernel")):
        assert id(fp8_ws_launch.ws_kernel(module, name)) in kernels
    assert not any(isinstance(e.compiled, host_path_cpu.StandInKernel) for e in compiled_launch._CACHE.values())
    assert originals == (
        fp8_ws_launch.hopper_unavailable,
        compiled_launch._first_launch,
        compiled_launch.direct_launch_enabled,
    )
