"""scripts/register_check.py compiles kernels for sm_90 without a GPU: the SwiGLU backward row pass and the plain
FC2 dgrad GEMM config that replaced the fused epilogue must fit in registers (no spills). Runs Triton's compiler in a
subprocess, outside the interpreter the rest of the CPU suite uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "register_check.py"
CASES = [
    ("prime_megamoe.kernels.swiglu_grad:swiglu_backward_rows_kernel", {"TILE_M": 128, "BLOCK_R": 16, "BLOCK_C": 128},
     ["--warps", "4"]),
    ("prime_megamoe.kernels.grouped_gemm:grouped_gemm_kernel",
     {"GATHER_A": True, "SCALE_ROWS": False, "CAST_F32": False, "IEEE": False, "TILE_M": 128, "PERSISTENT": False},
     ["--config", "128,128,64,8,4", "--ones", "stride_bn"]),
]


@pytest.mark.parametrize("kernel, constexprs, extra", CASES, ids=["swiglu_rows", "fc2_dgrad_gemm"])
def test_kernel_compiles_for_hopper_without_spills(kernel, constexprs, extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(SCRIPT), kernel, "--constexprs", json.dumps(constexprs), *extra],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()[1:] if line.strip()]
    assert rows, out.stdout
    for _, registers, spill, smem in rows:
        assert 0 < int(registers) <= 255 and int(smem) >= 0
        assert int(spill) == 0, f"{kernel} spills {spill} bytes per thread"
