"""Test setup: without a GPU the Triton kernels run in the interpreter; GPU tests are skipped there."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One pytest-xdist worker per core: one thread each (torch's pool, and the BLAS behind the interpreter's dots;
    # both read these when they load, so before torch is imported).
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Must be set before Triton compiles anything (the package reads it when kernels are defined).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from prime_megamoe.kernels.interpreter_speed import install as _install_interpreter_speed  # noqa: E402

_install_interpreter_speed()

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
