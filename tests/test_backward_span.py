"""scripts/backward_span.py: the backward's kernels found in a synthetic trace of two steps."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.scripts import load_script


def _script():
    return load_script("backward_span")


def _trace(path: Path, names: list[str]) -> None:
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": 10.0 * i, "dur": 4.0} for i, n in enumerate(names)]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 5.0, "dur": 1.0})
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)


def test_backward_is_what_follows_the_last_forwards_combine(tmp_path, capsys):
    step = [
        "routing_keys_kernel",
        "fc1",
        "fc2",
        "combine_rows_kernel",
        "quantize_blocks_kernel",
        "dgrad",
        "combine_rows_kernel",
        "wgrad",
    ]
    path = tmp_path / "t.trace.json.gz"
    _trace(path, step + step)
    script = _script()
    bwd = script.backward_kernels(str(path))
    assert [e["name"] for e in bwd] == ["quantize_blocks_kernel", "dgrad", "combine_rows_kernel", "wgrad"]
    script.main([str(path)])
    out = capsys.readouterr().out
    assert "backward GPU span 0.034 ms, kernels 0.016 ms" in out  # (from 120 us to 150 + 4 us; four 4-us kernels)


def test_a_forward_only_trace_is_refused(tmp_path):
    path = tmp_path / "f.trace.json.gz"
    _trace(path, ["routing_keys_kernel", "fc1", "combine_rows_kernel"])
    with pytest.raises(SystemExit, match="no backward"):
        _script().backward_kernels(str(path))
