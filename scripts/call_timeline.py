"""When the host issued each GPU operation of one layer call, and when the GPU ran it (torch.profiler, one call).

    torchrun --nproc-per-node 2 scripts/call_timeline.py --shape qwen3-30b-a3b --tokens 16384 [--grad]

After warm-up, every rank synchronises, passes a barrier and makes one call (the no-grad forward, or with --grad a
forward + backward) under the profiler. Each rank prints, in us from its first launch: each GPU operation's launch
time on the host, its start and duration on the GPU, and the wait between the two; then how long the GPU sat idle
inside the call waiting for the host (a single call is host-bound where these gaps add up).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from prime_megamoe.bench import make_workload, torchrun_group

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def timeline(trace_path: str) -> list[str]:
    with open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        return ["no GPU operations recorded"]
    t0 = min(e["ts"] for e in launches.values()) if launches else gpu[0]["ts"]
    lines = [f"{'launch':>9s} {'start':>9s} {'dur':>8s} {'queued':>8s}  stream  name"]
    idle, busy_until = 0.0, None
    for e in gpu:
        host = launches.get(e["args"].get("correlation"))
        issued = host["ts"] - t0 if host else float("nan")
        start = e["ts"] - t0
        lines.append(f"{issued:9.1f} {start:9.1f} {e['dur']:8.1f} {start - issued:8.1f}  {e.get('tid')!s:>6}  "
                     f"{e['name'][:70]}")
    # Idle time of the union of all streams between the first GPU operation and the last one's end.
    for e in gpu:
        if busy_until is not None and e["ts"] > busy_until:
            idle += e["ts"] - busy_until
        busy_until = max(busy_until or e["ts"], e["ts"] + e["dur"])
    span = busy_until - gpu[0]["ts"]
    lines.append(f"GPU span {span:.1f} us, idle inside it {idle:.1f} us; first GPU op at {gpu[0]['ts'] - t0:.1f} us "
                 f"after the first launch; last launch at {max(h['ts'] for h in launches.values()) - t0:.1f} us")
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--grad", action="store_true")
    p.add_argument("--out", default=None, help="write each rank's timeline to OUT.rankN.txt as well")
    args = p.parse_args()
    group = torchrun_group()
    rank = 0 if group is None else dist.get_rank(group)
    work = make_workload(args.shape, args.tokens, "mega_moe", "bf16", group)
    step = work.fwd_bwd if args.grad else work.fwd
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        lines = timeline(path)
    text = "\n".join(f"rank {rank} {line}" for line in lines)
    print(text, flush=True)
    if args.out:
        with open(f"{args.out}.rank{rank}.txt", "w") as fh:
            fh.write(text + "\n")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
