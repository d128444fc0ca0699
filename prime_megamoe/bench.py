"""Layer benchmark: forward, backward and 2F+1B of the MoE expert layer per backend, in one run.

    python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 16384 --backends torch mega_moe
    torchrun --nproc-per-node 2 -m prime_megamoe.bench ...        # expert parallelism over the launched ranks
    python -m prime_megamoe.bench --backends mega_moe --num-sms all 120   # what leaving 12 SMs free costs

``--num-sms`` runs each case at each ``[model.moe.dispatch] num_sms`` given ("all": unset), both backends alike: the
table's ratios compare backends at one value, and its backend column shows the value after an @.

Forward is timed without autograd; backward = (forward + backward) - forward with autograd on; 2F+1B is a no-grad
forward followed by a forward and backward (activation checkpointing), timed as one region. Each figure is the median
of CUDA-event timings after warm-up; with several ranks, the slowest rank's median. Each sample starts from an idle
GPU and (with several ranks) host-synchronised ranks, so host launch time shows in short calls; ``--repeat K`` times
K calls issued back to back per sample instead, as a training step sees them. TFLOP/s counts the expert GEMMs only:
forward T*k*6*H*I per rank, backward twice that. Results go to JSON with the GPU, versions and command.

Baselines compare like with like: mega_moe runs every ``--precisions`` entry, the torch backend those it has (bf16,
fp8), and each row's speed-up ratios ("x fwd", ...) and its error are against the torch row of the same precision
(``--backends torch mega_moe --precisions fp8``: fp8 against fp8). A precision the torch backend lacks (fp8_bwd,
mxfp8) is measured against the torch bf16 row, which then runs too; the table marks such rows (``bf16*`` in its
``base`` column) and says so below it. The torch rows' own error is against the torch bf16 output.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .config import TORCH_PRECISIONS, DispatchConfig
from .functional import fused_experts
from .ops import launch
from .routing import softmax_top_k

SHAPES = {
    # name: (hidden, moe_intermediate, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "tiny": (256, 128, 16, 4),
    "micro": (48, 40, 6, 3),  # CPU smoke tests
}


@dataclass
class Result:
    shape: str
    tokens_per_rank: int
    ep: int
    backend: str
    precision: str
    forward_ms: float
    backward_ms: float
    f2b1_ms: float
    forward_tflops: float
    backward_tflops: float
    f2b1_tflops: float
    peak_mem_gib: float
    host_fwd_ms: float
    max_rel_err_vs_torch: float | None = None  # relative to the output of the torch row named by err_vs
    transport: str = ""  # mega_moe with ep > 1: how blocks move between ranks
    # The two measurements backward_ms is the difference of: the forward with autograd, and forward + backward
    forward_grad_ms: float | None = None
    forward_backward_ms: float | None = None
    num_sms: int | None = None  # [model.moe.dispatch] num_sms of the run (None: every SM)
    err_vs: str = ""  # the torch row max_rel_err_vs_torch compares with: "torch/<precision>", "" without one


def torch_precisions(precisions: list[str]) -> list[str]:
    """What the torch backend runs for ``--precisions``: those it has, and bf16 as the baseline of the others; bf16
    first (the reference of the torch rows' own error)."""
    own = [p for p in TORCH_PRECISIONS if p in precisions]
    if "bf16" not in own and (not own or any(p not in TORCH_PRECISIONS for p in precisions)):
        own.insert(0, "bf16")
    return own


def baseline_precision(precision: str, torch_ran: set[str] | list[str] | dict) -> str | None:
    """The precision of the torch row that a row of ``precision`` is compared with: the same one when the torch
    backend ran it, else bf16; None when there is neither."""
    if precision in torch_ran:
        return precision
    return "bf16" if "bf16" in torch_ran else None


def reference_precision(backend: str, precision: str, torch_outputs: dict) -> str | None:
    """Whose output a row's error is measured against: ``baseline_precision`` for mega_moe rows; for torch rows the
    torch bf16 output (None for the bf16 row itself)."""
    if backend == "torch":
        return "bf16" if precision != "bf16" and "bf16" in torch_outputs else None
    return baseline_precision(precision, torch_outputs)


def _events_median(fn, iters: int, warmup: int, group, repeat: int = 1) -> float:
    """Median over ``iters`` samples of the CUDA-event time per call; a sample issues ``repeat`` calls back to back
    (repeat > 1: the host runs ahead of the GPU after the first call, as in a training step)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeat)
    med = statistics.median(times)
    if group is not None:
        t = torch.tensor([med], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        med = float(t.item())
    return med


def make_inputs(shape: str, tokens: int, rank: int, world: int, seed: int, dtype=torch.bfloat16, device="cuda"):
    hidden, inter, experts, top_k = SHAPES[shape]
    if experts % world:
        raise ValueError(f"{experts} experts do not split over {world} ranks")
    gen = torch.Generator(device=device).manual_seed(seed + 1000 * rank)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    logits = torch.randn(tokens, experts, device=device, dtype=torch.float32, generator=gen)
    weights, index = softmax_top_k(logits, top_k, norm_topk_prob=True)
    wgen = torch.Generator(device=device).manual_seed(seed + 7 + rank)
    local = experts // world
    w1 = torch.randn(local, 2 * inter, hidden, device=device, dtype=dtype, generator=wgen) * hidden**-0.5
    w2 = torch.randn(local, hidden, inter, device=device, dtype=dtype, generator=wgen) * inter**-0.5
    return x, index, weights.to(dtype), w1, w2


@dataclass
class Workload:
    """One benchmark case on this rank: the no-grad forward, the forward with autograd, and forward + backward."""

    fwd: Callable[[], torch.Tensor]
    fwd_grad: Callable[[], torch.Tensor]
    fwd_bwd: Callable[[], None]
    clear_grads: Callable[[], None]

    def f2b1(self) -> None:  # activation checkpointing: a no-grad forward, then forward + backward
        self.fwd()
        self.fwd_bwd()


def make_workload(
    shape,
    tokens,
    backend,
    precision,
    group,
    max_tokens=None,
    device="cuda",
    transport="auto",
    num_sms=None,
    fp8_backward_min_expert_work=None,
) -> Workload:
    rank = 0 if group is None else dist.get_rank(group)
    world = 1 if group is None else dist.get_world_size(group)
    x, index, weights, w1, w2 = make_inputs(shape, tokens, rank, world, seed=0, device=device)
    fp8_threshold = (
        {} if fp8_backward_min_expert_work is None else {"fp8_backward_min_expert_work": fp8_backward_min_expert_work}
    )
    options = DispatchConfig(
        type=backend, max_tokens_per_rank=max_tokens or tokens, transport=transport, num_sms=num_sms, **fp8_threshold
    )
    dy = torch.randn_like(x)
    xg, wg, w1g, w2g = (t.detach().clone().requires_grad_() for t in (x, weights, w1, w2))

    def fwd():
        with torch.no_grad():
            return fused_experts(x, index, weights, w1, w2, dispatch=options, precision=precision, group=group)

    def fwd_grad():
        return fused_experts(xg, index, wg, w1g, w2g, dispatch=options, precision=precision, group=group)

    def clear_grads():  # as optimizer.zero_grad() does: the next backward writes the gradients, not adds to them
        for t in (xg, wg, w1g, w2g):
            t.grad = None

    def fwd_bwd():
        clear_grads()
        fwd_grad().backward(dy)

    return Workload(fwd, fwd_grad, fwd_bwd, clear_grads)


def bench_one(
    shape,
    tokens,
    backend,
    precision,
    group,
    iters,
    warmup,
    reference=None,
    max_tokens=None,
    transport="auto",
    repeat=1,
    num_sms=None,
    err_vs="",
    fp8_backward_min_expert_work=None,
):
    world = 1 if group is None else dist.get_world_size(group)
    hidden, inter, _, top_k = SHAPES[shape]
    work = make_workload(
        shape,
        tokens,
        backend,
        precision,
        group,
        max_tokens,
        transport=transport,
        num_sms=num_sms,
        fp8_backward_min_expert_work=fp8_backward_min_expert_work,
    )
    fwd = work.fwd
    out = fwd()
    fwd()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd()
    host_ms = (time.perf_counter() - t0) * 1e3  # host time to issue one forward (includes any host sync)
    err = None
    if reference is not None:
        err = float((out.float() - reference.float()).norm() / reference.float().norm())
        if group is not None:
            t = torch.tensor([err], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            err = float(t.item())
    work.fwd_bwd()  # the backward's first call autotunes its kernels (timing buffers): keep that out of the peak
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated()
    t_f = _events_median(fwd, iters, warmup, group, repeat)
    t_fg = _events_median(work.fwd_grad, iters, warmup, group, repeat)
    t_fb = _events_median(work.fwd_bwd, iters, warmup, group, repeat)
    t_2f1b = _events_median(work.f2b1, iters, warmup, group, repeat)
    peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
    flops = tokens * top_k * 6 * hidden * inter
    t_b = max(t_fb - t_fg, 1e-6)
    res = Result(
        shape,
        tokens,
        world,
        backend,
        precision,
        round(t_f, 4),
        round(t_b, 4),
        round(t_2f1b, 4),
        round(flops / t_f / 1e9, 1),
        round(2 * flops / t_b / 1e9, 1),
        round(4 * flops / t_2f1b / 1e9, 1),
        round(peak, 3),
        round(host_ms, 3),
        None if err is None else round(err, 6),
        transport if backend == "mega_moe" and world > 1 else "",
        round(t_fg, 4),
        round(t_fb, 4),
        num_sms,
        err_vs if err is not None else "",
    )
    return res, out


def hidden_transfer_time(trace_path: str) -> dict:
    """From a profiler trace: GPU time spent in memory copies between GPUs (peer-to-peer and device-to-device copies,
    excluding the copies on the stream that runs the kernels) and how much of it ran while a kernel was running on
    another stream, i.e. hidden under compute."""
    with open(trace_path) as fh:
        events = [e for e in json.load(fh).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events if e.get("cat") == "kernel"]
    copies = [
        (e["ts"], e["ts"] + e["dur"], e.get("tid"))
        for e in events
        if e.get("cat") == "gpu_memcpy" and any(k in e.get("name", "") for k in ("PtoP", "DtoD"))
    ]
    total = hidden = 0.0
    for start, end, stream in copies:
        spans = sorted((max(s, start), min(e, end)) for s, e, t in kernels if t != stream and s < end and e > start)
        covered, cursor = 0.0, start
        for s, e in spans:  # length of the union of kernel spans inside [start, end)
            s = max(s, cursor)
            if e > s:
                covered += e - s
                cursor = e
        total += end - start
        hidden += covered
    return {
        "copy_us": round(total, 1),
        "hidden_us": round(hidden, 1),
        "hidden_fraction": round(hidden / total, 3) if total else None,
    }


def profile_one(shape, tokens, backend, precision, group, path, transport="auto", num_sms=None):
    """Per-kernel CUDA times of one forward+backward (torch.profiler), written as a text table to ``path``, with
    the Chrome trace beside it and, with expert parallelism, how much GPU-to-GPU copy time compute hid."""
    rank = 0 if group is None else dist.get_rank(group)
    world = 1 if group is None else dist.get_world_size(group)
    step = make_workload(shape, tokens, backend, precision, group, transport=transport, num_sms=num_sms).f2b1

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    if rank == 0:
        trace = path.replace(".txt", ".trace.json")
        prof.export_chrome_trace(trace)
        overlap = hidden_transfer_time(trace) if world > 1 else None
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            dst.write(src.read())
        os.remove(trace)
        with open(path, "w") as fh:
            fh.write(
                f"# {shape} T={tokens} ep={world} {backend} {precision} {transport} num_sms={num_sms}: 3 x (no-grad "
                f"forward, forward + backward)\n"
            )
            if overlap is not None:
                fh.write(f"# GPU-to-GPU copies: {json.dumps(overlap)}\n")
                print(
                    f"transfers {shape} T={tokens} ep={world} {backend} {transport}: {json.dumps(overlap)}", flush=True
                )
            fh.write(f"{table}\n")
    return table


def environment() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpus_visible": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


_TRANSPORT_TAG = {"symmetric_memory": "/sm", "collectives": "/nc", "auto": "/auto"}


def format_table(results: list[Result]) -> str:
    """One line per result; the ratio columns are the torch row's time over this row's, taking the torch row of the
    same shape, tokens, EP and precision, or the torch bf16 row where the torch backend did not run that precision
    (``base`` shows which: ``bf16*``, with a note under the table)."""
    head = (
        f"{'shape':16} {'T':>6} {'ep':>2} {'backend':12} {'prec':7} {'base':5} {'fwd ms':>8} {'bwd ms':>8} "
        f"{'2F+1B':>8} {'fwd TF':>7} {'bwd TF':>7} {'x fwd':>6} {'x bwd':>6} {'x 2F1B':>6} {'mem GiB':>7} "
        f"{'host ms':>7} {'err':>9}"
    )
    lines = [head]
    base = {(r.shape, r.tokens_per_rank, r.ep, r.num_sms, r.precision): r for r in results if r.backend == "torch"}
    fallbacks = set()
    for r in results:
        key = (r.shape, r.tokens_per_rank, r.ep, r.num_sms)
        base_prec = baseline_precision(r.precision, {p for (*k, p) in base if tuple(k) == key})
        b = base.get((*key, base_prec)) if base_prec is not None else None
        base_tag = "n/a"
        if b is not None:
            base_tag = base_prec if base_prec == r.precision else base_prec + "*"
            if base_prec != r.precision:
                fallbacks.add(r.precision)

        def ratio(a, c, b=b):
            return f"{a / c:6.2f}" if b else "   n/a"

        backend = r.backend + _TRANSPORT_TAG.get(r.transport, "") + ("" if r.num_sms is None else f"@{r.num_sms}")
        lines.append(
            f"{r.shape:16} {r.tokens_per_rank:6d} {r.ep:2d} {backend:12} {r.precision:7} {base_tag:5} "
            f"{r.forward_ms:8.3f} {r.backward_ms:8.3f} {r.f2b1_ms:8.3f} "
            f"{r.forward_tflops:7.1f} {r.backward_tflops:7.1f} "
            f"{ratio(b.forward_ms, r.forward_ms) if b else '   n/a'} "
            f"{ratio(b.backward_ms, r.backward_ms) if b else '   n/a'} "
            f"{ratio(b.f2b1_ms, r.f2b1_ms) if b else '   n/a'} {r.peak_mem_gib:7.2f} {r.host_fwd_ms:7.3f} "
            f"{'' if r.max_rel_err_vs_torch is None else f'{r.max_rel_err_vs_torch:9.2e}'}"
        )
    if fallbacks:
        lines.append(
            f"* base bf16*: ratios against the torch bf16 row: the torch backend did not run "
            f"{', '.join(sorted(fallbacks))} here (it has {', '.join(TORCH_PRECISIONS)})"
        )
    return "\n".join(lines)


def torchrun_group():
    """Under torchrun with several ranks: bind this process to its GPU (LOCAL_RANK) and join the NCCL group; returns
    the world group, or None in a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.group.WORLD


def _sm_count(value: str) -> int | None:
    """A ``--num-sms`` value: a positive SM count, or "all" (the key unset)."""
    if value.lower() in ("all", "none"):
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive SM count or 'all'")
    return count


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["qwen3-30b-a3b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384], help="tokens per rank")
    p.add_argument("--backends", nargs="+", default=["torch", "mega_moe"])
    p.add_argument(
        "--precisions",
        nargs="+",
        default=["bf16"],
        help="precisions to measure: mega_moe runs each, torch the ones it has (bf16, fp8) plus bf16 as the baseline "
        "of the others; every row is compared with the torch row of its own precision where there is one",
    )
    p.add_argument(
        "--transports",
        nargs="+",
        default=["auto"],
        help="mega_moe with expert parallelism: auto, symmetric_memory, collectives",
    )
    p.add_argument(
        "--num-sms",
        nargs="+",
        type=_sm_count,
        default=[None],
        help="[model.moe.dispatch] num_sms: run every case at each value ('all': every SM, the default)",
    )
    p.add_argument(
        "--fp8-backward-min-expert-work",
        type=int,
        default=None,
        help="[model.moe.dispatch] fp8_backward_min_expert_work of the mega_moe runs (unset: the default; 0: the "
        "fp8 backward at every size)",
    )
    p.add_argument(
        "--bf16-gemms",
        choices=["triton", "fastest"],
        default=None,
        help="the one-rank bf16 layer's FC1, FC2 and dgrad kernels: the Triton ones, or per shape the faster of them "
        "and the warp-specialised ones (ops/kernel_choice.py; timed at the first call, cached on disk). Unset: the "
        "package's default",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="calls per timed sample, issued back to back (1: each call starts from an idle GPU and a "
        "synchronised host, so host launch time shows; >1: the host runs ahead, as in training)",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--profile-dir", default=None, help="write per-kernel profiler tables and traces here")
    p.add_argument("--profile-backends", nargs="+", default=["mega_moe"])
    p.add_argument("--profile-tokens", nargs="+", type=int, default=[16384])
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU")
    if args.bf16_gemms is not None:
        launch.LAYER_FC1_WS = launch.LAYER_WS = False if args.bf16_gemms == "triton" else launch.FASTEST
    group = torchrun_group()
    rank = 0 if group is None else dist.get_rank()

    results: list[Result] = []
    # torch first: its rows are the baselines (and its outputs the references) of the others.
    backends = sorted(args.backends, key=lambda b: b != "torch")
    for shape in args.shape:
        for tokens, num_sms in itertools.product(args.tokens, args.num_sms):
            references: dict[str, torch.Tensor] = {}  # torch output per precision
            for backend in backends:
                precisions = torch_precisions(args.precisions) if backend == "torch" else args.precisions
                transports = args.transports if backend == "mega_moe" and group is not None else ["auto"]
                for precision, transport in [(p, t) for p in precisions for t in transports]:
                    ref_prec = reference_precision(backend, precision, references)
                    reference = None if ref_prec is None else references[ref_prec]
                    try:
                        res, out = bench_one(
                            shape,
                            tokens,
                            backend,
                            precision,
                            group,
                            args.iters,
                            args.warmup,
                            reference=reference,
                            transport=transport,
                            repeat=args.repeat,
                            num_sms=num_sms,
                            err_vs=f"torch/{ref_prec}" if reference is not None else "",
                            fp8_backward_min_expert_work=args.fp8_backward_min_expert_work,
                        )
                    except Exception as err:  # noqa: BLE001 - report the failure, measure the rest
                        if rank == 0:
                            msg = str(err).strip().splitlines()
                            print(
                                f"FAILED {shape} T={tokens} {backend} {precision} {transport} num_sms={num_sms}: "
                                f"{type(err).__name__}: {' | '.join(msg[-6:])}",
                                flush=True,
                            )
                        torch.cuda.empty_cache()
                        continue
                    if backend == "torch":
                        references[precision] = out
                    results.append(res)
                    if rank == 0:
                        print(json.dumps(asdict(res)), flush=True)
                    if args.profile_dir and backend in args.profile_backends and tokens in args.profile_tokens:
                        os.makedirs(args.profile_dir, exist_ok=True)
                        tag = (f"_{transport}" if res.transport else "") + (f"_sms{num_sms}" if num_sms else "")
                        path = os.path.join(
                            args.profile_dir, f"profile_{shape}_T{tokens}_ep{res.ep}_{backend}_{precision}{tag}.txt"
                        )
                        profile_one(
                            shape, tokens, backend, precision, group, path, transport=transport, num_sms=num_sms
                        )
                    del out, reference
                    torch.cuda.empty_cache()
    if rank == 0:
        from .comm.symmetric_memory import workspace_info

        payload = {
            "command": " ".join(["python -m prime_megamoe.bench", *sys.argv[1:]]),
            "env": environment(),
            "calls_per_sample": args.repeat,
            "results": [asdict(r) for r in results],
            "symmetric_workspaces": workspace_info(),
        }
        for ws in workspace_info():
            print(f"symmetric-memory workspace: {json.dumps(ws)}", flush=True)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(payload, fh, indent=2)
        print(format_table(results), flush=True)
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
