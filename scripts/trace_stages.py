"""Usage: python scripts/trace_stages.py DIR/profile_..._symmetric_memory.trace.json.gz

Per-stage GPU timeline of the last 2F+1B step in a benchmark trace (``--profile-dir`` of prime_megamoe.bench).
Prints each GPU operation of the last step (start and duration in us from the step's first routing kernel, the
stream, the name), then per stream: busy time, time spent in GPU-to-GPU copies, and how much of the copy time ran
while the other stream was computing.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict


def gpu_events(path: str, categories=("kernel", "gpu_memcpy", "gpu_memset")) -> list[dict]:
    """The trace's GPU operations of ``categories`` (kernels, copies, memsets), in order of their start."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in categories]
    return sorted(events, key=lambda e: e["ts"])


def main(path: str) -> None:
    events = gpu_events(path)
    starts = [i for i, e in enumerate(events) if e["name"].startswith("routing_keys_kernel")]
    if len(starts) < 2:
        raise SystemExit("no complete step in this trace (expected two routing kernels per 2F+1B step)")
    step = events[starts[-2] :]
    t0 = step[0]["ts"]
    busy, copies = defaultdict(float), defaultdict(float)
    for e in step:
        print(f"{e['ts'] - t0:9.1f} {e['dur']:8.1f}  stream {e.get('tid')!s:>3}  {e['name'][:80]}")
        busy[e.get("tid")] += e["dur"]
        if "PtoP" in e["name"] or "DtoD" in e["name"]:
            copies[e.get("tid")] += e["dur"]
    end = max(e["ts"] + e["dur"] for e in step)
    print(f"\nstep span {end - t0:.1f} us (no-grad forward, forward, backward)")
    for tid in busy:
        print(f"stream {tid}: busy {busy[tid]:.1f} us, of which GPU-to-GPU copies {copies[tid]:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1])
