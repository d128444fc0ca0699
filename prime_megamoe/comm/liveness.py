"""Liveness of the peers of an expert-parallel group: heartbeats, and the two bounds on every cross-rank wait.

A wait for a peer's block can last long for two reasons: the peer is slow (the Triton interpreter on a starved CPU, a
long backward, a host hiccup), or it is gone (killed, crashed). Only the second is an error, so a wait is not bounded
by how long it took but by how long a peer has shown no sign of life:

- Every process publishes a heartbeat: a counter that a daemon thread (``Heartbeat``) advances every
  ``HEARTBEAT_INTERVAL_S`` whatever the main thread is doing (computing, waiting, compiling). Over gloo
  (``comm.collectives``) it is a counter in the default process group's store, key
  ``prime_megamoe/heartbeat/<global rank>``; over symmetric memory (``comm.symmetric_memory``) a region of the
  workspace, written into every peer's copy, that the waiting kernel reads locally.
- ``WaitBounds.silence_s`` (``[model.moe.dispatch] comm_timeout_s``): a wait fails once a peer it waits for has not
  advanced its heartbeat for this long: that peer is gone. The error names this rank, the peer and the block. A slow
  but live peer never trips it. Defaults: ``SILENCE_DEFAULT_GPU_S`` on a GPU; ``SILENCE_DEFAULT_INTERPRETED_S`` under
  the Triton interpreter or on the CPU, where several processes share few cores and a heartbeat thread may wait
  seconds for one.
- ``WaitBounds.stall_s`` (``comm_stall_timeout_s``): no single wait lasts longer, even with every peer alive. A peer
  that lives but never joins the exchange (ranks that call the layer a different number of times) is then an error,
  not a hang; like NCCL's watchdog, it is generous (30 minutes by default), far above any healthy wait.

Heartbeats start with the first expert-parallel transport, dispatcher or trainer runtime of a process
(``start_heartbeat``); a peer whose heartbeat has not been seen yet counts as silent from the start of the wait.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..kernels.tuning import interpreting

log = logging.getLogger("prime_megamoe")

SILENCE_DEFAULT_GPU_S = 10.0
SILENCE_DEFAULT_INTERPRETED_S = 300.0
STALL_DEFAULT_S = 1800.0
HEARTBEAT_INTERVAL_S = 0.2
# After the transport itself reported a failure (gloo: a connection closed by a peer that died), how long to watch the
# heartbeats to tell which peer went away: many beats, far less than the silence bound.
IDENTIFY_S = 2.0
_WAIT_SLICE_S = 0.1  # a blocked gloo wait looks at the heartbeats this often (and sleeps in between)


@dataclass(frozen=True)
class WaitBounds:
    """The two bounds on a cross-rank wait (see the module docstring)."""

    silence_s: float  # a peer silent (no heartbeat) this long is gone: comm_timeout_s
    stall_s: float  # no wait lasts longer, even with every peer alive: comm_stall_timeout_s


def default_silence_s(device: torch.device | None) -> float:
    """``comm_timeout_s`` when the config leaves it unset: seconds on a GPU, far longer interpreted or on the CPU."""
    if device is not None and device.type == "cuda" and not interpreting():
        return SILENCE_DEFAULT_GPU_S
    return SILENCE_DEFAULT_INTERPRETED_S


def wait_bounds(silence_s: float | None, stall_s: float, device: torch.device | None) -> WaitBounds:
    """The bounds from ``[model.moe.dispatch] comm_timeout_s`` (None: the device's default) and
    ``comm_stall_timeout_s``."""
    return WaitBounds(default_silence_s(device) if silence_s is None else float(silence_s), float(stall_s))


class ExpertParallelWaitError(RuntimeError):
    """A cross-rank wait of the expert-parallel layer failed: a peer is gone, or never joined the exchange."""


# ---------------------------------------------------------------------------------------------------------------------
# The heartbeat thread


class Heartbeat:
    """One daemon thread per process that calls every registered beat with a growing counter each
    ``HEARTBEAT_INTERVAL_S``. A beat does almost nothing on the host (a store increment, a few stream writes), so the
    thread holds the GIL for microseconds per interval; it sleeps in between. A beat that fails (the store or a peer
    went away) is logged once and retried: the peers judge the silence."""

    def __init__(self):
        self._beats: dict[object, Callable[[int], None]] = {}
        self._failed: set = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.count = 0

    def add(self, key, beat: Callable[[int], None]) -> None:
        """Call ``beat(count)`` every interval from now on (first right away); one beat per ``key``."""
        with self._lock:
            self._beats[key] = beat
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="prime_megamoe-heartbeat", daemon=True)
                self._thread.start()

    def has(self, key) -> bool:
        return key in self._beats

    def remove(self, key) -> None:
        with self._lock:
            self._beats.pop(key, None)

    def stop(self) -> None:
        """Stop the thread (at exit: no beat may run while the interpreter shuts down)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * HEARTBEAT_INTERVAL_S + 1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.count = self.count % (2**31 - 1) + 1  # int32 on the devices; never 0 (a region's initial value)
            with self._lock:
                beats = list(self._beats.items())
            for key, beat in beats:
                try:
                    beat(self.count)
                except Exception as err:  # noqa: BLE001 - a peer or the store that went away: the waiters judge it
                    if key not in self._failed:
                        self._failed.add(key)
                        log.debug("prime_megamoe: heartbeat %r failed (retrying): %s", key, err)
            self._stop.wait(HEARTBEAT_INTERVAL_S)


_HEARTBEAT = Heartbeat()
atexit.register(lambda: _HEARTBEAT.stop())


def _reset_after_fork() -> None:  # a forked child has no thread: start afresh
    global _HEARTBEAT
    _HEARTBEAT = Heartbeat()
    _ENTERED.clear()
    _PUBLISHED.clear()
    _STORE[:] = [None, None]  # the parent's client connection is not this process's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def heartbeat() -> Heartbeat:
    """The process's heartbeat thread (beats are added by ``start_heartbeat`` and the symmetric-memory workspaces)."""
    return _HEARTBEAT


# ---------------------------------------------------------------------------------------------------------------------
# The store heartbeat (gloo / collectives)

_STORE_BEAT = "store"
_ENTERED: dict[str, int] = {}  # per group name: the exchanges this rank has entered
_PUBLISHED: dict[str, int] = {}  # per group name: how many of them the store holds
_STORE: list = [None, None]  # (the default process group's store, the client the heartbeats use with it)


def _store():
    """The store of the heartbeats (every rank of every group reaches it), or None: the default process group's store,
    through a client connection of its own where that store is a TCPStore (torch serialises the operations of one
    client, so a blocking wait of its own on the shared one, as in ``new_group``, would hold up every beat)."""
    if not dist.is_initialized():
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    default = get() if get is not None else None
    if default is not _STORE[0]:  # a new process group: a new client, and the published counts start afresh
        _STORE[:] = [default, _own_client(default)]
        _PUBLISHED.clear()
    return _STORE[1]


def _own_client(store):
    """A client of the server behind ``store`` (under any prefixes: the keys here are the server's own), else the
    store under its prefixes itself (a file or hash store: no server to connect to)."""
    base = store
    while base is not None and hasattr(base, "underlying_store"):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        try:
            return dist.TCPStore(
                base.host, base.port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False
            )
        except Exception as err:  # noqa: BLE001 - the shared client still reaches the same keys
            log.debug("prime_megamoe: no heartbeat client of its own (%s); sharing the default store's", err)
    return base


def _beat_key(global_rank: int) -> str:
    return f"prime_megamoe/heartbeat/{global_rank}"


def _entered_key(group_name: str, global_rank: int) -> str:
    return f"prime_megamoe/entered/{group_name}/{global_rank}"


def _store_beat(count: int) -> None:
    store = _store()
    if store is None:
        return
    rank = dist.get_rank()
    store.add(_beat_key(rank), 1)
    for name, entered in list(_ENTERED.items()):
        published = _PUBLISHED.get(name, 0)
        if entered != published:
            store.add(_entered_key(name, rank), entered - published)
            _PUBLISHED[name] = entered


def start_heartbeat() -> None:
    """Start publishing this process's heartbeat in the default process group's store (idempotent, cheap to call
    again). The layer starts it at its first expert-parallel call; a trainer may call it right after
    ``init_process_group``, so that a rank slow to reach its first MoE layer is already seen alive."""
    if _HEARTBEAT.has(_STORE_BEAT) or _store() is None:
        return
    _HEARTBEAT.add(_STORE_BEAT, _store_beat)


def entered_exchange(group) -> None:
    """Count an exchange of ``group`` this rank enters (published with the heartbeat; a stalled wait names the peers
    that entered fewer)."""
    name = _group_name(group)
    _ENTERED[name] = _ENTERED.get(name, 0) + 1


def _group_name(group) -> str:
    name = getattr(group, "group_name", None)
    return str(name) if name is not None else str(id(group))


class PeerWatch:
    """The peers' heartbeats as this rank sees them during one wait: when each one last advanced."""

    def __init__(self, group, since: float):
        self.group = group
        self.rank = dist.get_rank()
        self.peers = [p for p in dist.get_process_group_ranks(group) if p != self.rank]  # global ranks
        self.beats: dict[int, int | None] = {p: None for p in self.peers}
        self.heard = {p: since for p in self.peers}  # silent from the start of the wait until seen to advance
        self.read_at = float("-inf")
        self.error: Exception | None = None

    def look(self, now: float) -> None:
        """Read the peers' heartbeats (at most twice per heartbeat interval)."""
        if now - self.read_at < HEARTBEAT_INTERVAL_S / 2:
            return
        self.read_at = now
        try:
            store = _store()
            if store is None:
                raise RuntimeError("no default process group store")
            values = {p: store.add(_beat_key(p), 0) for p in self.peers}  # add 0: a read that never blocks
        except Exception as err:  # noqa: BLE001 - the store's host is gone: no peer is heard from
            self.error = err
            return
        self.error = None
        for p, value in values.items():
            if self.beats[p] is not None and value != self.beats[p]:
                self.heard[p] = now
            self.beats[p] = value

    def silent(self, now: float, bound: float) -> list[int]:
        return [p for p in self.peers if now - self.heard[p] >= bound]

    def behind(self) -> tuple[int, dict[int, int]]:
        """(exchanges of this group this rank entered, {peer: exchanges it entered}) as published."""
        name = _group_name(self.group)
        mine = _ENTERED.get(name, 0)
        try:
            store = _store()
            theirs = {p: store.add(_entered_key(name, p), 0) for p in self.peers}
        except Exception:  # noqa: BLE001
            theirs = {}
        return mine, theirs


# ---------------------------------------------------------------------------------------------------------------------
# The bounded wait for a gloo work


def _who(group) -> str:
    return f"rank {dist.get_rank(group)} of the expert-parallel group (global rank {dist.get_rank()})"


def wait_for_work(work, group, what: str, bounds: WaitBounds) -> None:
    """Wait for ``work`` (an async collective of ``group``) with the peers' liveness as the bound: raise once a peer
    has shown no heartbeat for ``bounds.silence_s``, once the wait has lasted ``bounds.stall_s`` with every peer
    alive, or (naming the peer that went away) once the transport itself reports a failure. Sleeps in slices of
    ``_WAIT_SLICE_S`` inside the work's own wait (no spinning; returns as soon as the work completes)."""
    begun = time.monotonic()
    watch: PeerWatch | None = None
    while True:
        try:
            if work.wait(timeout=timedelta(seconds=_WAIT_SLICE_S)) is not False:
                return
        except RuntimeError:  # a slice that ran out ("timed out"), or the work failed
            if work.is_completed():  # failed, or completed just after its slice ran out: its own wait tells which
                try:
                    work.wait()
                    return
                except RuntimeError as err:
                    _raise_failed(work, group, what, bounds, watch or PeerWatch(group, begun), err)
        now = time.monotonic()
        watch = watch or PeerWatch(group, begun)
        watch.look(now)
        gone = watch.silent(now, bounds.silence_s)
        if gone:
            unread = f"; the heartbeats could not be read: {watch.error}" if watch.error is not None else ""
            raise ExpertParallelWaitError(
                f"{_who(group)}: waiting for the {what}, peer(s) (global ranks) {gone} showed no sign of life for "
                f"{bounds.silence_s:g} s (their heartbeat stood still{unread}): their blocks never arrived and they "
                f"are presumed gone (crashed or killed); check their logs. A live peer starved of CPU for that long "
                f"needs a larger [model.moe.dispatch] comm_timeout_s."
            )
        if now - begun >= bounds.stall_s:
            mine, theirs = watch.behind()
            late = [p for p, n in theirs.items() if n < mine] or watch.peers
            raise ExpertParallelWaitError(
                f"{_who(group)}: the {what} did not complete within comm_stall_timeout_s = {bounds.stall_s:g} s, "
                f"though every peer is alive (heartbeats advancing): peer(s) (global ranks) {late} never joined it "
                f"(exchanges of this group entered: this rank {mine}, peers {theirs}). Check that every rank of the "
                f"group calls the MoE layer the same number of times, or raise [model.moe.dispatch] "
                f"comm_stall_timeout_s."
            )


def _raise_failed(work, group, what: str, bounds: WaitBounds, watch: PeerWatch, err: Exception) -> None:
    """The transport reported a failure (gloo: a peer's connection closed): name the peers whose heartbeat stopped,
    watching them for a few beats (at most ``IDENTIFY_S``, or the silence bound if shorter)."""
    failed_at = time.monotonic()
    window = min(IDENTIFY_S, bounds.silence_s)
    watch.look(failed_at)
    while True:
        time.sleep(HEARTBEAT_INTERVAL_S / 2)
        now = time.monotonic()
        watch.look(now)
        quiet = [p for p in watch.peers if watch.heard[p] <= failed_at]
        if not quiet or now - failed_at >= window:
            break
    cause = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    if watch.error is not None:
        first = str(watch.error).splitlines()[0][:200] if str(watch.error) else type(watch.error).__name__
        verdict = (
            f"the peers' heartbeats could not be read ({first}): the process hosting the process group's store (the "
            f"rank at MASTER_ADDR:MASTER_PORT, or torchrun's agent) is gone too, so which peer went first is unknown"
        )
    elif quiet:
        verdict = (
            f"peer(s) (global ranks) {quiet} stopped their heartbeat ({window:g} s without a beat): they are gone "
            f"(crashed or killed) and their blocks never arrived; check their logs"
        )
    else:
        verdict = "every peer's heartbeat is alive, so no peer is known to be gone"
    raise ExpertParallelWaitError(
        f"{_who(group)}: the {what} failed: {cause}; {verdict} (comm_timeout_s = {bounds.silence_s:g} s)"
    ) from err
