"""Usage: torchrun --nproc-per-node 2 scripts/call_timeline.py [--shape qwen3-30b-a3b] [--tokens 16384]
        [--grad | --forward-grad] [--host-sections [--deep] [--busy-ms MS] | --profiler | --pace] [--repeat K]
        [--precision fp8]
    python scripts/call_timeline.py --precision fp8 [--grad]      # one GPU (EP = 1)

When the host issued each kernel of one layer call, and when its stream reached it. After warm-up, every rank
synchronises, passes a barrier and makes one call (the no-grad forward, or with --grad a forward + backward), timed
as the benchmark times a call (CUDA events from just before it).

Default: every Triton launch records a CUDA event just before it, on the stream it launches on. Each rank prints,
per launch, in us from the call's start: when the host issued it, when its stream got there (the work before it
done), and the kernel. Where the two are close, the GPU waited for the host; where the stream time runs ahead, the
GPU was busy (or waited on another stream or rank). No profiler overhead distorts the host times.

--host-sections: where the host's time goes inside one call, without CUDA events: entry and exit of the layer's
host-side steps (checks, transport, plan, each launcher), nested, in us from the call's start. With --busy-ms MS
the stream is first given MS of GPU work (a spin kernel), so that it is still busy while the host issues the call:
a step that waits for the GPU (a sync, an allocation that frees memory, a copy from pageable memory) then takes about
the rest of those MS, where with an idle GPU it does not. Compare the two per step.

--pace: who sets the pace of calls issued back to back (as in training, and the benchmark's --repeat): --repeat K
calls after one sync, with a CUDA event before the first and after the last only; the host us per call (to the last
call's return) and the GPU us per call. Where the two are about equal, the host sets the pace.

--profiler: torch.profiler instead: every GPU operation (also torch's), its start and duration on the GPU, and the
host launch time where the trace links it (the profiler slows the host by tens of us per torch op).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import prime_megamoe.comm.symmetric_memory as symmetric_memory
import prime_megamoe.ops.bf16_ws_launch as bf16_ws_launch
import prime_megamoe.ops.fp8_launch as fp8_launch
import prime_megamoe.ops.fp8_ws_launch as fp8_ws_launch
import prime_megamoe.ops.launch as ops_launch
import prime_megamoe.ops.routing_plan as routing_plan
import prime_megamoe.validation as validation
from prime_megamoe.bench import make_workload, torchrun_group
from prime_megamoe.ops import compiled_launch

# The modules that launch through compiled_launch (validation: the expert-parallel layer's id check).
LAUNCHING_MODULES = (ops_launch, routing_plan, symmetric_memory, fp8_launch, fp8_ws_launch, bf16_ws_launch, validation)

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def timeline(trace_path: str) -> list[str]:
    with open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
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
        lines.append(
            f"{issued:9.1f} {start:9.1f} {e['dur']:8.1f} {start - issued:8.1f}  {e.get('tid')!s:>6}  {e['name'][:70]}"
        )
    # Idle time of the union of all streams between the first GPU operation and the last one's end.
    for e in gpu:
        if busy_until is not None and e["ts"] > busy_until:
            idle += e["ts"] - busy_until
        busy_until = max(busy_until or e["ts"], e["ts"] + e["dur"])
    span = busy_until - gpu[0]["ts"]
    lines.append(
        f"GPU span {span:.1f} us, idle inside it {idle:.1f} us; first GPU op at {gpu[0]['ts'] - t0:.1f} us "
        f"after the first launch; last launch at {max(h['ts'] for h in launches.values()) - t0:.1f} us"
    )
    return lines


def event_timeline(step, repeat: int = 1) -> list[str]:
    marks = []

    def launch(kernel, grid, *args, **constexprs):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        name = getattr(getattr(kernel, "fn", kernel), "__name__", None) or str(kernel)
        marks.append((time.perf_counter(), event, torch.cuda.current_stream().stream_id, name))
        compiled_launch.launch(kernel, grid, *args, **constexprs)

    for module in LAUNCHING_MODULES:
        module.launch = launch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    for i in range(repeat):
        if repeat > 1:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(
                (
                    time.perf_counter(),
                    event,
                    torch.cuda.current_stream().stream_id,
                    f"-- call {i} of {repeat} back to back",
                )
            )
        step()
    host_done = time.perf_counter()
    end.record()
    end.synchronize()
    for module in LAUNCHING_MODULES:
        module.launch = compiled_launch.launch
    lines = [f"{'host':>9s} {'stream':>9s}  stream_id  kernel   (us from the call's start)"]
    for t, event, stream, name in marks:
        lines.append(f"{(t - began) * 1e6:9.1f} {start.elapsed_time(event) * 1e3:9.1f}  {stream:9d}  {name}")
    lines.append(
        f"call: {start.elapsed_time(end) * 1e3:.1f} us on the GPU; the host returned after "
        f"{(host_done - began) * 1e6:.1f} us"
    )
    return lines


def pace(step, repeat: int) -> list[str]:
    """Host and GPU time per call of ``repeat`` calls of ``step`` issued back to back (no events between them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    for _ in range(repeat):
        step()
    host_done = time.perf_counter()
    end.record()
    end.synchronize()
    host, gpu = (host_done - began) * 1e6 / repeat, start.elapsed_time(end) * 1e3 / repeat
    ratio = host / gpu
    return [f"{repeat} calls back to back, per call: host {host:.1f} us, GPU {gpu:.1f} us (host / GPU {ratio:.2f})"]


@functools.cache
def spin_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per ms of GPU time, timed once per process against CUDA events."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # the first launch of the spin kernel loads it: outside the timing
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def busy_gpu(ms: float) -> None:
    """Queue about ``ms`` of GPU work on the current stream: a spin kernel of that many ms of clock cycles."""
    torch.cuda._sleep(int(ms * spin_cycles_per_ms()))


def host_sections(step, deep: bool = False, busy_ms: float = 0.0) -> list[str]:
    import prime_megamoe.dispatch.mega_moe as mega_moe
    import prime_megamoe.functional as functional
    import prime_megamoe.ops.ep_pipeline as ep_pipeline
    import prime_megamoe.ops.quantized_experts as quantized_experts
    from prime_megamoe.comm.symmetric_memory import SymmetricMemoryTransport
    from prime_megamoe.ops.routing_plan import RoutingPlan

    marks, depth = [], [0]

    def wrap(fn, name):
        def wrapped(*args, **kwargs):
            depth[0] += 1
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                marks.append((began, time.perf_counter(), depth[0], name))

        return wrapped

    targets = [
        (functional, "check_expert_inputs"),
        (functional, "check_expert_ids"),
        (functional, "get_backend"),
        (mega_moe, "make_transport"),
        (mega_moe, "check_group_within_node"),
        (mega_moe, "expert_parallel_experts"),
        (ep_pipeline, "lease_forward_plan"),
        (ep_pipeline, "fill_routing_plan"),
        (ops_launch, "fc1_swiglu"),
        (ops_launch, "grouped_gemm"),
        (ops_launch, "combine_rows"),
        (ops_launch, "sum_blocks"),
        (ops_launch, "fc2_dgrad_dswiglu"),
        (ops_launch, "grouped_wgrad"),
        (ops_launch, "dswiglu_buffers"),
        (ops_launch, "_dswiglu_pass_buffers"),
        (SymmetricMemoryTransport, "start"),
        (SymmetricMemoryTransport, "_push"),
        (SymmetricMemoryTransport, "_await_peers"),
        (SymmetricMemoryTransport, "routing"),
        (SymmetricMemoryTransport, "wait_rows"),
        (SymmetricMemoryTransport, "partial_buffers"),
        (SymmetricMemoryTransport, "send"),
        (SymmetricMemoryTransport, "finish"),
        (RoutingPlan, "segment"),
        (RoutingPlan, "assert_ids_in_range"),
        (routing_plan, "take_plan"),
        (quantized_experts, "check_precision_supported"),
        (quantized_experts, "_plan"),
        (quantized_experts, "cached_weight_operand"),
        (quantized_experts, "combine_with_pair_values"),
        (fp8_launch, "quantize_rows"),
        (fp8_launch, "row_quantization"),
        (fp8_launch, "fp8_fc1_swiglu"),
        (fp8_launch, "fp8_grouped_gemm"),
        (fp8_launch, "fp8_fc2_dgrad_dswiglu"),
        (fp8_launch, "quantize_sorted_cols_t"),
        (fp8_launch, "fp8_grouped_wgrad"),
        (fp8_launch, "expert_tile_offsets"),
    ]
    if deep:  # the pieces of the quantised path's steps, down to each launch, allocation and TMA descriptor
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        targets += [
            (routing_plan, "allocate_routing_plan"),
            (routing_plan, "fill_routing_plan"),
            (routing_plan, "routing_keys"),
            (fp8_launch, "quantize_view"),
            (fp8_launch, "ws_fc1_unavailable"),
            (fp8_launch, "ws_gemm_unavailable"),
            (fp8_launch, "fp8_fc1_swiglu_ws"),
            (fp8_launch, "fp8_grouped_gemm_ws"),
            (fp8_ws_launch, "_descriptors"),
            (fp8_ws_launch, "_grid"),
            (TensorDescriptor, "from_tensor"),
            (torch, "empty"),
            (torch, "empty_like"),
            (torch.Tensor, "new_empty"),
        ] + [(module, "launch") for module in LAUNCHING_MODULES]
    if busy_ms:  # before the wrappers: its own launches are not the call's
        busy_gpu(busy_ms)
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in targets]
    for obj, attr, fn in saved:
        label = f"{obj.__name__.rsplit('.', 1)[-1]}.launch" if attr == "launch" else attr
        setattr(obj, attr, wrap(fn, label))
    try:
        began = time.perf_counter()
        step()
        ended = time.perf_counter()
        torch.cuda.synchronize()
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
    lines = [f"{'enter':>9s} {'exit':>9s} {'us':>8s}  step   (host, us from the call's start)"]
    if busy_ms:
        lines.insert(0, f"the stream was given {busy_ms:g} ms of GPU work just before the call")
    for t0, t1, d, name in sorted(marks):
        lines.append(f"{(t0 - began) * 1e6:9.1f} {(t1 - began) * 1e6:9.1f} {(t1 - t0) * 1e6:8.1f}  {'  ' * d}{name}")
    lines.append(f"call: the host returned after {(ended - began) * 1e6:.1f} us")
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--grad", action="store_true", help="forward + backward instead of the no-grad forward")
    p.add_argument(
        "--forward-grad",
        action="store_true",
        help="the forward with autograd alone (what the benchmark subtracts from forward + backward)",
    )
    p.add_argument("--precision", default="bf16", help="the layer's precision (bf16, fp8, fp8_bwd, mxfp8)")
    p.add_argument("--profiler", action="store_true", help="torch.profiler timeline instead of launch events")
    p.add_argument("--host-sections", action="store_true", help="host time per step of the call, no CUDA events")
    p.add_argument("--pace", action="store_true", help="host and GPU us per call of --repeat calls back to back")
    p.add_argument(
        "--deep",
        action="store_true",
        help="with --host-sections: also the steps' pieces (each launch, allocation, descriptor, plan part)",
    )
    p.add_argument(
        "--busy-ms",
        type=float,
        default=0.0,
        help="with --host-sections: queue this many ms of GPU work before the call (which steps wait for the GPU)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="calls issued back to back per timeline (as the benchmark's --repeat); events and --pace only",
    )
    p.add_argument("--out", default=None, help="write each rank's timeline to OUT.rankN.txt as well")
    args = p.parse_args()
    if args.busy_ms and not args.host_sections:
        p.error("--busy-ms applies to --host-sections only: add --host-sections, or drop --busy-ms")
    group = torchrun_group()
    rank = 0 if group is None else dist.get_rank(group)
    work = make_workload(args.shape, args.tokens, "mega_moe", args.precision, group)
    step = work.fwd_bwd if args.grad else work.fwd_grad if args.forward_grad else work.fwd
    for _ in range(3):
        step()
    if args.profiler:
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
    else:
        lines = []
        for i in range(3):  # three samples (single calls, or --repeat calls), each from an idle GPU after a barrier
            torch.cuda.synchronize()
            if group is not None:
                dist.barrier(group)
            if args.pace:
                lines += pace(step, args.repeat)
            else:
                lines += [f"call {i}"] + (
                    host_sections(step, args.deep, args.busy_ms)
                    if args.host_sections
                    else event_timeline(step, args.repeat)
                )
    text = "\n".join(f"rank {rank} {line}" for line in lines)
    print(text, flush=True)
    if args.out:
        with open(f"{args.out}.rank{rank}.txt", "w") as fh:
            fh.write(text + "\n")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
