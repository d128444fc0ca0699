"""Usage: python scripts/backward_span.py DIR/profile_..._fp8.trace.json.gz [...]

The backward's GPU span in a benchmark trace (``--profile-dir`` of prime_megamoe.bench, one GPU). The last step of
the trace (from its last routing kernel: the forward with grad, then the backward): the backward is every kernel
after the forward's combine. Prints its span (first start to last end), the kernels' summed time, and each kernel
name's summed time, largest first.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from trace_stages import gpu_events  # (scripts/ is on sys.path when run as a script)


def backward_kernels(path: str) -> list[dict]:
    events = gpu_events(path, ("kernel",))
    starts = [i for i, e in enumerate(events) if e["name"].startswith("routing_keys_kernel")]
    if not starts:
        raise SystemExit(f"{path}: no routing kernel, not a layer trace")
    step = events[starts[-1] :]
    combines = [i for i, e in enumerate(step) if e["name"].startswith("combine_rows_kernel")]
    if len(combines) < 2:
        raise SystemExit(f"{path}: the last step has no backward (one combine a forward, one a backward expected)")
    return step[combines[0] + 1 :]


def main(paths: list[str]) -> None:
    for path in paths:
        bwd = backward_kernels(path)
        span = bwd[-1]["ts"] + bwd[-1]["dur"] - bwd[0]["ts"]
        per_name = defaultdict(float)
        for e in bwd:
            per_name[e["name"].split("(")[0][:48]] += e["dur"]
        print(f"{path}\n  backward GPU span {span / 1000:.3f} ms, kernels {sum(per_name.values()) / 1000:.3f} ms")
        for name, us in sorted(per_name.items(), key=lambda kv: -kv[1]):
            print(f"    {us:8.1f} us  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
