"""The benchmark's CPU-side pieces: the hidden-transfer measure read from a profiler trace, and the table."""

from __future__ import annotations

import json

import pytest

from prime_megamoe.bench import Result, format_table, hidden_transfer_time, main


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
