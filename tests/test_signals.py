"""The symmetric-memory wait kernel (``kernels.signals.wait_flags_kernel``) on one GPU (skipped without one):
``scripts/gpu_check_wait.py`` plays the peers from host threads. A slow peer that keeps beating is waited for, a
silent peer traps after ``comm_timeout_s`` naming it, a live peer that never sets its flag traps after
``comm_stall_timeout_s``, and a one-rank ``SymmetricWorkspace`` runs its heartbeat."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check_wait.py"


@pytest.mark.gpu
def test_wait_kernel_bounds_on_gpu():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    verdicts = sorted(line.split(":")[0] for line in run.stdout.splitlines() if line.startswith(("ok ", "FAIL ")))
    assert verdicts == ["ok dead", "ok slow", "ok stall", "ok thread"], out[-4000:]
