"""Integer helpers for launch grids and block sizes on the host's hot path.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions on recent Triton: called from host code each
goes through Triton's call machinery (about 3 us), and a layer call computes a few dozen of them.
"""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
