"""The benchmark's CPU-side pieces: the hidden-transfer measure read from a profiler trace, the table, the arguments."""

from __future__ import annotations

import argparse
import json

import pytest

from prime_megamoe.bench import Result, _sm_count, format_table, hidden_transfer_time, main


def _event(name, cat, ts, dur, tid):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}


def test_hidden_transfer_time_counts_copy_time_under_other_streams_kernels(tmp_path):
    events = [
        _event("fc1_swiglu_kernel", "kernel", 0, 100, 7),
        _event("grouped_gemm_kernel", "kernel", 150, 100, 7),
        _event("Memcpy PtoP (Device -> Device)", "gpu_memcpy", 50, 150, 25),  # covered on [50, 100) + [150, 200)
        _event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 300, 40, 25),  # nothing runs meanwhile
        _event("wait_flags_kernel", "kernel", 210, 5, 25),  # a kernel on the copy's own stream hides nothing
        _event("Memcpy HtoD (Host -> Device)", "gpu_memcpy", 0, 500, 9),  # not a GPU-to-GPU copy
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = hidden_transfer_time(str(path))
    assert got == {"copy_us": 190.0, "hidden_us": 100.0, "hidden_fraction": round(100 / 190, 3)}


def test_hidden_transfer_time_without_copies(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_event("k", "kernel", 0, 10, 7)]}))
    assert hidden_transfer_time(str(path)) == {"copy_us": 0.0, "hidden_us": 0.0, "hidden_fraction": None}


def test_table_names_the_transport_and_ratios_to_torch():
    common = dict(
        shape="qwen3-30b-a3b",
        tokens_per_rank=16384,
        ep=2,
        precision="bf16",
        f2b1_ms=1.0,
        forward_tflops=1.0,
        backward_tflops=1.0,
        f2b1_tflops=1.0,
        peak_mem_gib=1.0,
        host_fwd_ms=1.0,
    )
    rows = [
        Result(backend="torch", forward_ms=8.0, backward_ms=10.0, **common),
        Result(backend="mega_moe", forward_ms=4.0, backward_ms=5.0, transport="symmetric_memory", **common),
    ]
    lines = format_table(rows).splitlines()
    assert "mega_moe/sm" in lines[2] and "2.00" in lines[2]
    assert lines[1].split()[3] == "torch"


def test_benchmark_needs_a_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA GPU"):
        main([])


def test_num_sms_argument(monkeypatch):
    """``--num-sms`` takes SM counts and "all" (unset); anything else is a usage error before any GPU is asked for."""
    assert [_sm_count(v) for v in ("120", "all", "ALL", "none")] == [120, None, None, None]
    for bad in ("0", "-8", "many", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive SM count"):
            _sm_count(bad)
    with pytest.raises(SystemExit) as err:
        main(["--num-sms", "0"])
    assert err.value.code == 2  # argparse's usage error
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA GPU"):
        main(["--num-sms", "all", "120"])


def test_table_shows_num_sms_and_compares_backends_at_the_same_value():
    common = dict(
        shape="qwen3-30b-a3b",
        tokens_per_rank=16384,
        ep=1,
        precision="bf16",
        f2b1_ms=1.0,
        forward_tflops=1.0,
        backward_tflops=1.0,
        f2b1_tflops=1.0,
        peak_mem_gib=1.0,
        host_fwd_ms=1.0,
    )
    rows = [
        Result(backend="torch", forward_ms=8.0, backward_ms=10.0, **common),
        Result(backend="torch", forward_ms=9.0, backward_ms=12.0, num_sms=120, **common),
        Result(backend="mega_moe", forward_ms=4.0, backward_ms=5.0, **common),
        Result(backend="mega_moe", forward_ms=4.5, backward_ms=6.0, num_sms=120, **common),
    ]
    lines = format_table(rows).splitlines()
    assert lines[3].split()[3] == "mega_moe" and lines[3].split()[10:12] == ["2.00", "2.00"]
    assert lines[4].split()[3] == "mega_moe@120" and lines[4].split()[10:12] == ["2.00", "2.00"]
    assert lines[2].split()[3] == "torch@120"
