"""scripts/call_timeline.py's pace of back-to-back calls and its busy-stream host sections, on CPU with stand-ins
for the CUDA events and the spin kernel (the script's GPU parts run on GPUs)."""

from __future__ import annotations

import re

import pytest
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


def test_busy_gpu_queues_the_spin_cycles_calibrated_per_ms(monkeypatch):
    sleeps = []

    def fake_sleep(cycles):
        sleeps.append(cycles)
        FakeEvent.clock[0] += cycles / 5e6  # this fake GPU spins 5e6 cycles a ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", fake_sleep)
    call_timeline.spin_cycles_per_ms.cache_clear()
    try:
        call_timeline.busy_gpu(3.0)
        call_timeline.busy_gpu(0.5)
    finally:
        call_timeline.spin_cycles_per_ms.cache_clear()  # no fake calibration outlives the test
    # Two calibration spins (load, then timed), then 3 ms and 0.5 ms of cycles; calibrated once.
    assert sleeps[2:] == [15_000_000, 2_500_000]
    assert len(sleeps) == 4


def test_host_sections_busies_the_gpu_before_the_call(monkeypatch):
    order = []
    monkeypatch.setattr(call_timeline, "busy_gpu", lambda ms: order.append(("busy", ms)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: order.append(("sync",)))
    lines = call_timeline.host_sections(lambda: order.append(("step",)), busy_ms=20.0)
    assert order == [("busy", 20.0), ("step",), ("sync",)]
    assert lines[0] == "the stream was given 20 ms of GPU work just before the call"
    assert lines[-1].startswith("call: the host returned after ")

    order.clear()
    lines = call_timeline.host_sections(lambda: order.append(("step",)))
    assert order == [("step",), ("sync",)]  # no --busy-ms: no GPU work first
    assert lines[0].startswith("    enter")


def test_busy_ms_without_host_sections_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["call_timeline.py", "--busy-ms", "20"])
    with pytest.raises(SystemExit) as err:
        call_timeline.main()
    assert err.value.code == 2
    assert "--busy-ms applies to --host-sections only" in capsys.readouterr().err


def test_deep_host_sections_stamp_the_allocations_and_restore_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    originals = (torch.empty, torch.empty_like, torch.Tensor.new_empty)
    base = torch.zeros(1)

    def step():
        torch.empty(2)
        torch.empty_like(base)
        assert base.new_empty(3).shape == (3,)  # the wrapped method still binds its tensor

    lines = call_timeline.host_sections(step, deep=True)
    steps = [line.split()[-1] for line in lines[1:-1]]
    assert steps == ["empty", "empty_like", "new_empty"]
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == originals
