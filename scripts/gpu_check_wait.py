"""The symmetric-memory wait kernel's two bounds on one GPU (``kernels.signals.wait_flags_kernel``), its peers played by
host threads: symmetric memory needs a GPU per rank, this needs one GPU in all.

Rank 0 of W = 4 waits for the flags of peers 1, 2, 3 in ordinary device memory; a thread writes the peers' heartbeats
and flags with stream write-value operations, as ``comm.symmetric_memory`` does into a peer's workspace. Cases:

    slow    the peers set their flags 3 x comm_timeout_s late, beating all along (peers 1 and 3 from a host thread:
            row 0; peer 2 as a spinning wait kernel would: row 1): the wait completes, no trap; the kernel's own beat
            reached every peer's row 1
    dead    peer 2 never beats (peers 1 and 3 do): a trap after about comm_timeout_s that names peer 2
    stall   every peer beats, none sets its flag: a trap after comm_stall_timeout_s
    thread  ``SymmetricWorkspace``'s heartbeat on a one-rank group: the thread's stream writes land (smoke test of the
            workspace's region, views and beat)

    python scripts/gpu_check_wait.py        (expected: one "ok" line per case, exit 0)

Each case runs in a subprocess of its own (a trap ends the CUDA context).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

WORLD, CHANNEL, ROUND = 4, 0, 7


def _setup():
    from prime_megamoe.kernels.signals import KERNEL_BEAT_NS, wait_flags_kernel
    from prime_megamoe.ops.compiled_launch import launch

    dev = torch.device("cuda", 0)
    flags = torch.zeros(2, WORLD, dtype=torch.int32, device=dev)
    beats = torch.zeros(2, WORLD, dtype=torch.int32, device=dev)  # this rank's heartbeat region
    regions = [torch.zeros(2, WORLD, dtype=torch.int32, device=dev) for _ in range(WORLD)]  # "the peers' regions"
    regions[0] = beats
    peer_beats = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64, device=dev)

    def wait(silence_s, stall_s, value=ROUND):
        launch(
            wait_flags_kernel,
            (1,),
            flags,
            beats,
            peer_beats,
            value,
            0,
            CHANNEL,
            int(silence_s * 1e9),
            int(stall_s * 1e9),
            WORLD=WORLD,
            WORLD_BLOCK=WORLD,
            BEAT_NS=KERNEL_BEAT_NS,
            num_warps=1,
        )

    wait(1.0, 1.0, value=0)  # compiled here, not in a timed wait (round 0: nothing to wait for)
    torch.cuda.synchronize()
    return dev, flags, beats, regions, wait


def _peers(dev, flags, beats, rows: dict[int, int], publish_after: float | None, stop: threading.Event):
    """A thread: every 0.2 s, each peer q in ``rows`` advances its slot of ``beats`` row rows[q]; after
    ``publish_after`` s every peer sets its flag. Stream writes on a stream of the thread's own."""
    words_beats = beats.view(torch.uint32).view(-1)
    words_flags = flags.view(torch.uint32).view(-1)
    stream = torch.cuda.Stream(device=dev, priority=-1)

    def run():
        began, count, publish = time.monotonic(), 0, publish_after
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            while not stop.is_set():
                count += 1
                for q, row in rows.items():
                    torch.ops.symm_mem.stream_write_value32_(words_beats, row * WORLD + q, count)
                if publish is not None and time.monotonic() - began > publish:
                    for q in range(1, WORLD):
                        torch.ops.symm_mem.stream_write_value32_(words_flags, CHANNEL * WORLD + q, ROUND)
                    publish = None
                stop.wait(0.2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def case_slow():
    dev, flags, beats, regions, wait = _setup()
    bound = 1.0
    stop = threading.Event()
    _peers(dev, flags, beats, {1: 0, 2: 1, 3: 0}, 3 * bound, stop)
    began = time.monotonic()
    wait(bound, 60.0)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    elapsed = time.monotonic() - began
    stop.set()
    own = [int(regions[q][1, 0]) for q in range(1, WORLD)]
    assert elapsed >= 3 * bound - 0.1, f"the wait ended after {elapsed:.2f} s, before the flags were set"
    assert all(v != 0 for v in own), f"the kernel's beat did not reach the peers' row 1: {own}"
    print(f"ok slow: waited {elapsed:.2f} s (bound {bound:g} s) without a trap; kernel beats {own}", flush=True)


def case_dead():
    dev, flags, beats, _, wait = _setup()
    stop = threading.Event()
    _peers(dev, flags, beats, {1: 0, 3: 1}, None, stop)  # peer 2 is silent
    began = time.monotonic()
    wait(1.0, 60.0)
    try:
        torch.cuda.synchronize()
    except RuntimeError as err:
        print(f"trapped after {time.monotonic() - began:.2f} s: {str(err).splitlines()[0]}", flush=True)
        os._exit(3)
    print("FAIL: the wait completed", flush=True)
    os._exit(1)


def case_stall():
    dev, flags, beats, _, wait = _setup()
    stop = threading.Event()
    _peers(dev, flags, beats, {1: 0, 2: 0, 3: 1}, None, stop)
    began = time.monotonic()
    wait(1.0, 2.5)
    try:
        torch.cuda.synchronize()
    except RuntimeError as err:
        print(f"trapped after {time.monotonic() - began:.2f} s: {str(err).splitlines()[0]}", flush=True)
        os._exit(3)
    print("FAIL: the wait completed", flush=True)
    os._exit(1)


def case_thread():
    import torch.distributed as dist

    from prime_megamoe.comm.liveness import WaitBounds
    from prime_megamoe.comm.symmetric_memory import SymmetricWorkspace
    from prime_megamoe.comm.transport import BlockParts

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    parts = BlockParts((64,), (torch.bfloat16,))  # one bf16 part of 64 columns
    ws = SymmetricWorkspace(dist.group.WORLD, 8, parts, (64, torch.bfloat16), 2, torch.device("cuda", 0))
    time.sleep(1.0)  # the heartbeat thread beats (into no peer: one rank)
    ws.wait(0, 0, WaitBounds(1.0, 5.0))  # no peer to wait for: returns at once
    torch.cuda.synchronize()
    words = [w.numel() for w in ws.beat_words]
    print(f"ok thread: workspace with its heartbeat region, {len(words)} peers to beat, wait returned", flush=True)
    dist.destroy_process_group()


CASES = {"slow": case_slow, "dead": case_dead, "stall": case_stall, "thread": case_thread}
EXPECT = {"dead": (3, 1.0), "stall": (3, 2.5)}  # exit code, seconds to the trap


def main():
    if len(sys.argv) > 1:
        CASES[sys.argv[1]]()
        return
    failed = 0
    for name in CASES:
        began = time.monotonic()
        out = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - began
        text = out.stdout + out.stderr
        if name in EXPECT:
            code, bound = EXPECT[name]
            lines = [line for line in text.splitlines() if "trapped after" in line]
            trapped = float(lines[0].split("trapped after ")[1].split(" s")[0]) if lines else None
            printed = [line for line in text.splitlines() if "prime_megamoe expert-parallel wait" in line]
            # the device print: one line per operand and thread; the operands are rank, peer, channel, round
            operands = sorted({line.split("(operand ")[1].replace(")", "") for line in printed if "(operand " in line})
            ok = out.returncode == code and trapped is not None and bound - 0.1 <= trapped <= bound + 2.0
            verdict = "ok" if ok else "FAIL"
            print(f"{verdict} {name}: exit {out.returncode}, trapped after {trapped} s (bound {bound:g} s)")
            print(f"    device print ({len(printed)} lines): {printed[0][:400] if printed else '(none)'}")
            print(f"    operands (index value): {operands}")
            if not ok:
                print(text[-3000:])
            failed += not ok
        else:
            ok = out.returncode == 0 and f"ok {name}" in text
            print(text.strip() if ok else f"FAIL {name} (exit {out.returncode}, {elapsed:.1f} s):\n{text[-3000:]}")
            failed += not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
