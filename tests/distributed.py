"""Run a test body on several CPU processes joined by gloo (expert parallelism without GPUs)."""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prime_megamoe.kernels.interpreter_speed import install as install_interpreter_speed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from a server process that has imported these once (multiprocessing's forkserver): a fresh
# interpreter importing torch, Triton and the package costs each rank ~5 s of CPU, most of a small test's time. The
# server has only imported them (no threads, no CUDA, no process group), so forking it is safe.
_PRELOAD = ["torch", "triton", "prime_megamoe", "prime_megamoe.ops.ep_pipeline", "transformers", "pytest", __name__]


def _worker(rank, world, port, fn, args, queue, environ, released):
    os.environ.clear()  # the parent's environment as it is now (the server's is the one it started with)
    os.environ.update(environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    install_interpreter_speed()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # Serialise to bytes here: a tensor put on the queue as-is is shared through a file descriptor that the
        # parent can only open while this process is alive, and the worker exits right after.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # The process group (rank 0 hosts its store) stays up until the parent has every rank's result: a rank that
        # finished first must not take the store away from peers still reading it (a peer that went away is
        # identified through its heartbeat there).
        released.wait(timeout=120)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world: int, *args, timeout: float = 240.0, may_exit: tuple[int, ...] = ()) -> list:
    """Call ``fn(rank, world, *args)`` on ``world`` gloo processes; return the per-rank results in rank order.

    ``fn`` must be a module-level function (it is pickled); results must be picklable (CPU tensors are). A rank in
    ``may_exit`` may end its process without a result (a test that kills it, or freezes it): its result is None, and
    once every other rank has its result it is killed if still running. Any other rank that exits without a result
    fails the test as soon as that is seen, instead of after ``timeout``. No rank tears its process group down before
    the parent has every result: a peer still setting up a group (``new_group``) or reading the store is not failed
    by one that finished first."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results_queue = ctx.Queue()
    released = ctx.Event()
    port = _free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, results_queue, environ, released))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout
    try:
        while any(r not in results for r in range(world) if r not in may_exit):
            try:
                _take(results_queue.get(timeout=0.5), results, errors)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"distributed test: no result within {timeout:g} s from ranks "
                        f"{sorted(set(range(world)) - set(results))}"
                    ) from None
                _collect_exited(procs, results, results_queue, errors, may_exit)
        for r in may_exit:
            if r not in results:
                procs[r].kill()
                results[r] = None
    finally:
        released.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def _collect_exited(procs, results: dict, results_queue, errors: list, may_exit) -> None:
    """Ranks whose process has exited without a result: None for those in ``may_exit``, an error for the others. What
    an exited process put on the queue is read first (it is in the pipe once the process is gone)."""
    exited = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
    if not exited:
        return
    while True:
        try:
            _take(results_queue.get(timeout=1.0), results, errors)
        except queue.Empty:
            break
    for r in exited:
        if r not in results:
            results[r] = None
            if r not in may_exit:
                errors.append(f"rank {r}: its process exited with code {procs[r].exitcode} without a result")


def _take(item, results: dict, errors: list) -> None:
    rank, status, payload = item
    if status == "error":
        errors.append(f"rank {rank}:\n{payload}")
    else:
        payload = torch.load(io.BytesIO(payload), weights_only=False)
    results[rank] = payload
