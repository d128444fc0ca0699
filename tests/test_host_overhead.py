"""scripts/host_overhead.py's summaries of a call's blocking calls and profiler events (the GPU parts run on GPUs)."""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import torch

from tests.scripts import load_script

host_overhead = load_script("host_overhead")


def test_package_frames_keeps_the_packages_frames_in_order():
    package = host_overhead.PACKAGE_DIR
    stack = [
        traceback.FrameSummary("/usr/lib/python3/runpy.py", 10, "_run_module"),
        traceback.FrameSummary(f"{package}/ops/launch.py", 120, "fc1_swiglu"),
        traceback.FrameSummary(f"{package}_other/x.py", 5, "elsewhere"),  # a neighbour whose name starts alike
        traceback.FrameSummary(f"{package}/ops/routing_plan.py", 77, "take_plan"),
    ]
    assert host_overhead.package_frames(stack) == ["launch.py:120 fc1_swiglu", "routing_plan.py:77 take_plan"]


def test_host_events_sums_the_cpu_events_by_name_longest_first():
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, device, us):
        return SimpleNamespace(name=name, device_type=device, cpu_time_total=us)

    events = [
        event("cudaLaunchKernel", cpu, 4.0),
        event("aten::empty", cpu, 2.5),
        event("cudaLaunchKernel", cpu, 6.0),
        event("fc1_swiglu_kernel", cuda, 400.0),  # GPU time: not the host's
        event("cudaStreamSynchronize", cpu, 30.0),
    ]
    assert host_overhead.host_events(events) == [
        ("cudaStreamSynchronize", 1, 30.0),
        ("cudaLaunchKernel", 2, 10.0),
        ("aten::empty", 1, 2.5),
    ]


def test_only_synchronising_operations_count_as_syncs():
    assert host_overhead.is_sync_warning("called a synchronizing CUDA operation")
    # set_sync_debug_mode's own notice is no synchronising call
    assert not host_overhead.is_sync_warning(
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    )


def test_single_call_times_marks_the_first_fc1_launch_of_either_precision(monkeypatch):
    import prime_megamoe.ops.fp8_launch as fp8_launch
    import prime_megamoe.ops.launch as ops_launch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    monkeypatch.setattr(ops_launch, "fc1_swiglu", lambda *a, **k: calls.append("bf16"))
    monkeypatch.setattr(fp8_launch, "fp8_fc1_swiglu", lambda *a, **k: calls.append("fp8"))
    bf16_launcher, fp8_launcher = ops_launch.fc1_swiglu, fp8_launch.fp8_fc1_swiglu

    def quantised_call():  # as the layers call it: through the module's attribute
        fp8_launch.fp8_fc1_swiglu()
        ops_launch.fc1_swiglu()  # a later FC1 launch does not move the mark

    first, ends = host_overhead.single_call_times(quantised_call, 3, None)
    assert calls == ["fp8", "bf16"] * 3
    assert len(first) == len(ends) == 3
    assert all(0 <= f <= e for f, e in zip(first, ends))
    # the launchers are restored
    assert ops_launch.fc1_swiglu is bf16_launcher and fp8_launch.fp8_fc1_swiglu is fp8_launcher

    first, _ = host_overhead.single_call_times(lambda: None, 2, None)
    assert all(f != f for f in first)  # no FC1 launch: NaN, not a time
