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
