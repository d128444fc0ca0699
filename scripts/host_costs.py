"""Host time of the pieces a layer call is made of, on this machine: framework ops, one compiled-kernel launch and
its parts, the routing plan's allocation, fill and segment views.

    python scripts/host_costs.py            # one GPU; prints us per piece (median of rounds of 200 calls)

A single layer call is host-bound (see BENCHMARKS.md), so these costs decide where host work is worth removing.
"""

from __future__ import annotations

import statistics
import time

import torch

from prime_megamoe.kernels.combine import sum_blocks_kernel
from prime_megamoe.ops import compiled_launch
from prime_megamoe.ops.launch import fc1_swiglu
from prime_megamoe.ops.routing_plan import allocate_routing_plan, fill_routing_plan
from prime_megamoe.validation import check_expert_inputs


def per_call_us(fn, calls: int = 200, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()  # the launch queue never fills up
    return statistics.median(samples)


def main():
    dev = torch.device("cuda", 0)
    t = torch.empty(4096, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream(dev)
    blocks = torch.randn(2, 256, 512, device=dev)
    out = torch.empty(256, 512, device=dev)
    sum_args = (blocks, out, 256, 512, blocks.stride(0), blocks.stride(1), out.stride(0))
    sum_meta = dict(NUM_BLOCKS=2, BLOCK_R=8, BLOCK_C=512, num_warps=4)

    def sum_launch():
        compiled_launch.launch(sum_blocks_kernel, (32, 1), *sum_args, **sum_meta)

    sum_launch()
    entry = next(e for k, e in compiled_launch._CACHE.items() if k[0] == id(sum_blocks_kernel))
    raw = compiled_launch._current_stream(0)

    def launcher_only():
        entry.run(32, 1, 1, raw, entry.function, entry.packed_metadata, None, None, None, *sum_args,
                  *[v for is_arg, v in entry.params[len(sum_args):]])

    experts, hidden, inter, tokens, k = 64, 2048, 768, 256, 8
    index = torch.randint(0, experts, (tokens, k), device=dev, dtype=torch.int32)
    weights = torch.rand(tokens, k, device=dev)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16)

    def plan_alloc():
        return allocate_routing_plan(tokens, k, num_local_experts=experts, tile_m=128, device=dev, num_segments=2,
                                     split_expert=experts // 2)

    plan = plan_alloc()

    def plan_fill():
        fill_routing_plan(plan, index[: tokens // 2], weights[: tokens // 2], expert_base=0, first_segment=0)

    plan_fill()
    fill_routing_plan(plan, index[tokens // 2:], weights[tokens // 2:], expert_base=0, first_segment=1)
    a = torch.empty(plan.sorted_rows, inter, device=dev, dtype=torch.bfloat16)

    def segment_view():
        plan._views.clear()
        return plan.segment(1, 0)

    piece = plan.segment(1, 0)
    event = torch.cuda.Event()
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16)
    rows = [
        ("torch.empty (cuda, int32 [4096])", lambda: torch.empty(4096, dtype=torch.int32, device=dev)),
        ("tensor slice", lambda: t[16:32]),
        ("tensor.reshape(-1)", lambda: index.reshape(-1)),
        ("small memset (zero_, int32 [4096])", lambda: t.zero_()),
        ("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev)),
        ("Event() + record", lambda: torch.cuda.Event().record(stream)),
        ("stream.wait_event", lambda: stream.wait_event(event)),
        ("input checks (check_expert_inputs)", lambda: check_expert_inputs(x, index, weights, w1, w2, None, tokens)),
        ("compiled launch, 7 args (sum_blocks)", sum_launch),
        ("  of which the launcher call", launcher_only),
        ("  of which the cache key", lambda: compiled_launch._key(sum_blocks_kernel, sum_args, sum_meta, 0)),
        ("fc1_swiglu wrapper + launch (25 args)", lambda: fc1_swiglu(x, w1, piece, save_h=False, out=(None, a))),
        ("allocate_routing_plan (2 segments, halves)", plan_alloc),
        ("fill_routing_plan (one segment)", plan_fill),
        ("RoutingPlan segment view", segment_view),
    ]
    print(f"{'piece':45s} {'us per call':>11s}")
    for name, fn in rows:
        print(f"{name:45s} {per_call_us(fn):11.1f}")


if __name__ == "__main__":
    main()
