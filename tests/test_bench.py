"""The benchmark's CPU-side pieces: the hidden-transfer measure read from a profiler trace, the table, and which torch
row each row is compared with (fp8 with fp8, bf16 with bf16; bf16 where the torch backend lacks the precision)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from prime_megamoe.bench import Result, _sm_count, format_table, hidden_transfer_time, main, torch_precisions


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


def _row(backend, precision, fwd, **kw):
    common = dict(
        shape="qwen3-30b-a3b",
        tokens_per_rank=4096,
        ep=1,
        backward_ms=2 * fwd,
        f2b1_ms=4 * fwd,
        forward_tflops=1.0,
        backward_tflops=1.0,
        f2b1_tflops=1.0,
        peak_mem_gib=1.0,
        host_fwd_ms=1.0,
    )
    return Result(backend=backend, precision=precision, forward_ms=fwd, **{**common, **kw})


def test_torch_runs_its_own_precisions_and_bf16_as_the_fallback_baseline():
    assert torch_precisions(["fp8"]) == ["fp8"]
    assert torch_precisions(["fp8", "bf16"]) == ["bf16", "fp8"]
    assert torch_precisions(["fp8", "mxfp8"]) == ["bf16", "fp8"]
    assert torch_precisions(["fp8_bwd"]) == ["bf16"]
    assert torch_precisions(["bf16"]) == ["bf16"]


def test_table_pairs_each_precision_with_the_torch_row_of_that_precision():
    rows = [
        _row("torch", "bf16", 10.0),
        _row("torch", "fp8", 6.0),
        _row("mega_moe", "bf16", 5.0),
        _row("mega_moe", "fp8", 3.0),  # against torch fp8: 6 / 3, not torch bf16's 10 / 3
        _row("mega_moe", "mxfp8", 4.0),  # no torch mxfp8: against torch bf16, marked
    ]
    lines = format_table(rows).splitlines()
    fields = [line.split() for line in lines[1:6]]  # shape T ep backend prec base fwd bwd 2F+1B TF TF x x x ...
    assert [f[5] for f in fields] == ["bf16", "fp8", "bf16", "fp8", "bf16*"]
    ratios = [f[11:14] for f in fields]  # x fwd, x bwd, x 2F1B
    assert ratios[1] == ["1.00"] * 3  # the torch fp8 row is its own precision's baseline
    assert ratios[2] == ["2.00"] * 3
    assert ratios[3] == ["2.00"] * 3
    assert ratios[4] == ["2.50"] * 3
    assert lines[6].startswith("* base bf16*") and "mxfp8" in lines[6]
    # Without a torch row of its precision nor a bf16 one: no ratios, no note.
    lines = format_table([_row("torch", "fp8", 6.0), _row("mega_moe", "mxfp8", 4.0)]).splitlines()
    assert lines[2].split()[5] == "n/a" and lines[2].split()[11] == "n/a" and len(lines) == 3


def test_benchmark_compares_fp8_with_fp8(monkeypatch):
    """``--backends mega_moe torch --precisions fp8 mxfp8`` (no GPU: the measurement is faked): torch runs first, in
    bf16 and fp8; mega_moe fp8's error is against torch fp8's output, mxfp8's against torch bf16's."""
    import prime_megamoe.bench as bench

    calls = []

    def fake_bench_one(shape, tokens, backend, precision, group, iters, warmup, reference=None, err_vs="", **kw):
        out = torch.full((2, 2), float(len(calls)))
        calls.append((backend, precision, None if reference is None else float(reference[0, 0]), err_vs))
        return _row(backend, precision, 1.0, err_vs=err_vs), out

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.empty_cache", lambda: None)
    monkeypatch.setattr(bench, "bench_one", fake_bench_one)
    monkeypatch.setattr(bench, "environment", lambda: {})
    main(["--shape", "micro", "--tokens", "8", "--backends", "mega_moe", "torch", "--precisions", "fp8", "mxfp8"])
    assert calls == [
        ("torch", "bf16", None, ""),
        ("torch", "fp8", 0.0, "torch/bf16"),  # the torch fp8 row's error: against torch bf16 (output 0)
        ("mega_moe", "fp8", 1.0, "torch/fp8"),  # against torch fp8 (output 1)
        ("mega_moe", "mxfp8", 0.0, "torch/bf16"),
    ]


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
    assert lines[3].split()[3] == "mega_moe" and lines[3].split()[11:13] == ["2.00", "2.00"]
    assert lines[4].split()[3] == "mega_moe@120" and lines[4].split()[11:13] == ["2.00", "2.00"]
    assert lines[2].split()[3] == "torch@120"


def test_bf16_gemms_argument_sets_the_layers_kernel_families(monkeypatch):
    """``--bf16-gemms fastest`` makes the one-rank bf16 layer ask for the timed choice, ``triton`` for the Triton
    kernels; other values are usage errors."""
    from prime_megamoe import bench
    from prime_megamoe.ops import launch

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    monkeypatch.setattr(launch, "LAYER_WS", launch.LAYER_WS)  # restored after the test
    monkeypatch.setattr(launch, "LAYER_FC1_WS", launch.LAYER_FC1_WS)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(bench, "torchrun_group", stop)
    with pytest.raises(Stop):
        main(["--bf16-gemms", "fastest"])
    assert launch.LAYER_WS == launch.LAYER_FC1_WS == launch.FASTEST
    with pytest.raises(Stop):
        main(["--bf16-gemms", "triton"])
    assert launch.LAYER_WS is False and launch.LAYER_FC1_WS is False
    with pytest.raises(SystemExit) as err:
        main(["--bf16-gemms", "ws"])
    assert err.value.code == 2
