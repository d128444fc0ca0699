"""scripts/call_timeline.py's pace of back-to-back calls (its GPU parts run on GPUs)."""

from __future__ import annotations

import re

import torch

from tests.scripts import load_script

call_timeline = load_script("call_timeline")


class FakeEvent:
    """A CUDA event stand-in: the GPU time between two events is what the test's clock says it is."""

    clock = [0.0]  # GPU ms, advanced by the fake calls

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = FakeEvent.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.at - self.at


def test_pace_divides_host_and_gpu_time_by_the_calls(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    calls = []

    def step():
        calls.append(1)
        FakeEvent.clock[0] += 0.5  # each call: 500 GPU us

    (line,) = call_timeline.pace(step, 4)
    assert len(calls) == 4
    pattern = r"4 calls back to back, per call: host ([\d.]+) us, GPU ([\d.]+) us \(host / GPU ([\d.]+)\)"
    found = re.fullmatch(pattern, line)
    assert found, line
    host, gpu, ratio = map(float, found.groups())
    assert gpu == 500.0
    assert host > 0 and abs(ratio - host / gpu) < 0.01
