"""Entry point of ``python -m prime_megamoe.train`` (and ``torchrun ... -m prime_megamoe.train``)."""

import os
import sys


def _use_triton_interpreter() -> None:
    """Without CUDA the Triton kernels must run in the interpreter, which Triton decides when a kernel is defined.
    The parent package (imported before this module) has defined them already, so start the process again with
    TRITON_INTERPRET=1; under torchrun the process keeps its pid and environment."""
    if "TRITON_INTERPRET" in os.environ or any(a in ("-h", "--help") for a in sys.argv[1:]):
        return
    import torch

    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    kernels_defined = any(name.startswith("prime_megamoe.kernels") for name in sys.modules)
    if kernels_defined:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


_use_triton_interpreter()

from prime_megamoe.kernels.interpreter_speed import install  # noqa: E402

install()  # (under the interpreter only)

from prime_megamoe.train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
