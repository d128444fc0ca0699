"""Triton kernels only (no autograd, no configs). Host-side launchers live in ``prime_megamoe.ops``."""
