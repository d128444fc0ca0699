"""The SMs the layer's kernels may use: ``[model.moe.dispatch] num_sms`` (None: every SM of the GPU).

prime-rl sets it to leave SMs free for kernels that overlap the layer (collectives of other parallelisms), as
DeepGEMM's ``set_num_sms`` does. The layer's launches come in two kinds, and each kind is bounded its own way:

- Persistent kernels launch a fixed number of programs that loop over the work: the Triton grouped GEMMs'
  PERSISTENT configs, the warp-specialised Gluon GEMMs (``fp8_ws_launch._grid``) and the one-pass SwiGLU backward.
  Their grids ask ``available_sms(device)``: the device's SM count capped by the budget in effect (``SMBudget``, in
  a context variable: one read per grid, no other host work). So a persistent kernel never has more programs than
  the SMs it may run on (more would only queue a second wave behind the first).
- Every other launch has a program per tile or row block (routing, quantisation, combine, the row passes, the
  weight-gradient kernels, non-persistent GEMM configs), which the hardware spreads over every SM whatever the
  grid. On CUDA a layer call with ``num_sms`` therefore runs on a stream of a CUDA green context of ``num_sms`` SMs
  (``GreenStream``): the driver keeps every kernel issued there on those SMs, torch's own ones included.

``SMLimit.run`` runs one layer call within a budget: the green stream waits for the caller's stream, the call runs
on it with the budget in effect, the caller's stream waits for the green one, and the tensors handed back are
recorded on the caller's stream (``Tensor.record_stream``: the caching allocator does not give their memory to the
green stream's next allocations while the caller may still read them); the inputs, read on the green stream, are
recorded on it likewise. The backward runs outside the call: each autograd Function of the layer keeps the budget on
its ``ctx`` in forward (``keeps_sm_budget``) and its backward runs within it again (``in_kept_sm_budget``). Autograd
already runs a backward on the stream its forward ran on (the green stream), after the incoming gradient's stream;
where it does not (torch versions that switch green contexts by ``set_context``, or another stream), the backward
switches there itself as the layer call does.

Without a GPU (the Triton interpreter runs the kernels; SMs do not exist) only the persistent grids are bounded:
the interpreter's "device" has ``INTERPRETER_SMS`` of them. No SM count changes a result: every tile is computed by
the same code in the same order whichever program takes it, so outputs and gradients are bitwise those of
``num_sms = None``.

Green contexts come from ``torch.cuda.green_contexts.GreenContext``, whose API moved between torch versions:
``GreenContext.create(num_sms, device_id)`` with ``set_context()`` / ``pop_context()`` (torch 2.9, 2.10: the
context made current for the call, on its default stream), the same with a ``Stream()`` of the context (2.11 on:
keyword-only ``create``), and a constructor ``GreenContext(num_sms=..., device_id=...)`` (``create`` kept), a
``Stream()`` per call and an ``sm_count`` (later versions, which need the ``cuda.bindings`` package). ``GreenStream``
takes whichever the installed torch has, preferring a stream; without any, ``num_sms`` on CUDA is an error that says
what is missing (``GreenContextUnavailable``). The driver rounds a green context's SMs to its partition granularity
(on Hopper, multiples of 8: ``num_sms = 120`` on an H200's 132 is exact); where torch reports the count it got, the
persistent grids use the smaller of the two.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from contextlib import contextmanager

import torch

INTERPRETER_SMS = 4  # the persistent grids' size under the Triton interpreter (CPU), which has no SMs
_KEY = "[model.moe.dispatch] num_sms"


class SMBudget:
    """What the launches of one layer call run within: ``sms`` persistent programs at most and, on CUDA, the green
    context's stream (``green``), with the stream of the call's caller (``caller``) that results go back to."""

    __slots__ = ("sms", "green", "caller")

    def __init__(self, sms: int, green: GreenStream | None = None, caller=None):
        self.sms, self.green, self.caller = sms, green, caller

    def reenter(self, fn: Callable, *args):
        """``fn(*args)`` within this budget again (an autograd backward, outside the call that made it); tensors it
        returns are recorded on the call's caller stream, where autograd hands them on."""
        token = _BUDGET.set(self)
        try:
            if self.green is None:
                return fn(*args)
            return self.green.run(fn, args, {}, hand_back_to=self.caller)
        finally:
            _BUDGET.reset(token)


_BUDGET: contextvars.ContextVar[SMBudget | None] = contextvars.ContextVar("prime_megamoe_sm_budget", default=None)


def current_budget() -> SMBudget | None:
    """The budget in effect here (None: every SM)."""
    return _BUDGET.get()


def cuda_properties(device: torch.device):
    return _cuda_properties_at(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_properties_at(index: int):  # asked on every launch: keep it off the host's hot path
    return torch.cuda.get_device_properties(index)


def device_sms(device: torch.device) -> int:
    """The SMs of ``device`` (``INTERPRETER_SMS`` for a CPU device: the interpreter's persistent grids)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return cuda_properties(device).multi_processor_count


def available_sms(device: torch.device) -> int:
    """How many programs a persistent grid on ``device`` launches: its SMs, capped by the budget in effect."""
    budget = _BUDGET.get()
    sms = device_sms(device)
    return sms if budget is None or budget.sms >= sms else budget.sms


def _check_count(num_sms) -> int:
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"{_KEY} = {num_sms!r}: the SM budget must be a positive integer, or None for every SM")
    return num_sms


@contextmanager
def sm_budget(num_sms: int | None):
    """Persistent grids of at most ``num_sms`` programs inside the block (None: the budget stays as it is). Budgets
    nest to the smaller one. This bounds the grids only; ``SMLimit.run`` also keeps a CUDA call's other kernels on
    the SMs (the layer's ``num_sms``)."""
    if num_sms is None:
        yield _BUDGET.get()
        return
    num_sms = _check_count(num_sms)
    outer = _BUDGET.get()
    budget = SMBudget(num_sms) if outer is None else SMBudget(min(num_sms, outer.sms), outer.green, outer.caller)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def keeps_sm_budget(forward: Callable) -> Callable:
    """Decorates an autograd Function's ``forward``: the budget in effect is kept on ``ctx.sm_budget`` (one context
    variable read; None without a budget) for its backward (``in_kept_sm_budget``)."""

    @functools.wraps(forward)
    def wrapper(ctx, *args, **kwargs):
        ctx.sm_budget = _BUDGET.get()
        return forward(ctx, *args, **kwargs)

    return wrapper


def in_kept_sm_budget(backward: Callable) -> Callable:
    """Decorates an autograd Function's ``backward``: it runs within the budget its forward kept
    (``keeps_sm_budget``), on the forward's green stream where there was one; without a budget, as it is."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        budget = getattr(ctx, "sm_budget", None)
        if budget is None:
            return backward(ctx, *grads)
        return budget.reenter(backward, ctx, *grads)

    return wrapper


def _record(value, stream) -> None:
    """``record_stream(stream)`` on the CUDA tensors of ``value`` (a tensor, or a tuple / list holding some)."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(stream)


class GreenContextUnavailable(RuntimeError):
    """``num_sms`` on CUDA needs a CUDA green context, which the installed torch cannot make."""


def _green_context_class():
    """torch's ``GreenContext`` class (an ImportError or AttributeError where torch has none)."""
    from torch.cuda.green_contexts import GreenContext

    return GreenContext


def _unavailable(num_sms: int, index: int, reason: str) -> GreenContextUnavailable:
    return GreenContextUnavailable(
        f"{_KEY} = {num_sms} keeps the layer's kernels on {num_sms} SMs of cuda:{index} with a CUDA green context, "
        f"which this torch ({torch.__version__}, CUDA {torch.version.cuda}) cannot make: {reason}. Remove the key "
        "(the layer then uses every SM), or use a torch with green contexts (torch.cuda.green_contexts.GreenContext: "
        "torch >= 2.10 built for CUDA >= 12.8 with a driver as recent; torch versions whose green contexts are built "
        "on cuda.bindings also need that package: pip install cuda-bindings)"
    )


def _as_cuda_stream(stream) -> torch.cuda.Stream:
    """A ``torch.cuda.Stream`` for the stream ``GreenContext.Stream()`` returned (some versions give a
    ``torch.Stream``)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.Stream(
        stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
    )


class GreenStream:
    """A CUDA green context of ``num_sms`` SMs on one device, and the way the installed torch runs work in it: on
    a stream of the context (``GreenContext.Stream()``), or, where torch has none, with the context made current
    (``set_context()`` / ``pop_context()``, which switch to the context's default stream and back, each waiting for
    the other's work). ``sms``: what the persistent grids may use (the count the driver gave, where torch says)."""

    def __init__(self, num_sms: int, index: int):
        try:
            green_context = _green_context_class()
        except (ImportError, AttributeError) as err:
            raise _unavailable(num_sms, index, f"torch.cuda.green_contexts.GreenContext is missing ({err})") from None
        create = getattr(green_context, "create", None) or green_context
        try:
            context = create(num_sms=num_sms, device_id=index)
        except Exception as err:  # noqa: BLE001 - torch built without them, no cuda.bindings, an old driver, ...
            raise _unavailable(
                num_sms,
                index,
                f"creating one failed with {type(err).__name__}: {str(err).strip()} (where torch has green contexts, "
                "a count the driver cannot partition fails so too: it rounds up to its granularity, on Hopper "
                "multiples of 8)",
            ) from err
        self.context, self.index = context, index
        self.stream: torch.cuda.Stream | None = None
        if callable(getattr(context, "Stream", None)):
            try:
                self.stream = _as_cuda_stream(context.Stream())
            except Exception as err:  # noqa: BLE001
                raise _unavailable(
                    num_sms, index, f"GreenContext.Stream() failed with {type(err).__name__}: {str(err).strip()}"
                ) from err
        elif not (callable(getattr(context, "set_context", None)) and callable(getattr(context, "pop_context", None))):
            raise _unavailable(
                num_sms, index, "its GreenContext has neither Stream() nor set_context() / pop_context()"
            )
        self.sms = num_sms
        try:
            got = getattr(context, "sm_count", None)
        except Exception:  # noqa: BLE001 - a version whose query fails: keep the request
            got = None
        if isinstance(got, int) and 0 < got < num_sms:
            self.sms = got
        self._entered: contextvars.ContextVar[bool] = contextvars.ContextVar(f"green_{id(self)}", default=False)

    def run(self, fn: Callable, args: tuple, kwargs: dict, hand_back_to=None, caller=None):
        """``fn(*args, **kwargs)`` in the green context, ordered after the current stream's work and before its
        next; the tensor inputs are recorded on the green stream and the tensors returned on the current stream
        and on ``hand_back_to``. Already on the green stream (autograd runs a backward on its forward's stream): a
        plain call. ``caller``: the current stream, where the caller has it already."""
        if self.stream is None:
            return self._run_in_context(fn, args, kwargs, hand_back_to)
        stream = self.stream
        if caller is None:
            caller = torch.cuda.current_stream(self.index)
        if caller == stream:
            out = fn(*args, **kwargs)
        else:
            stream.wait_stream(caller)
            _record(args, stream)  # read on the green stream: their memory outlives those reads
            try:
                with torch.cuda.stream(stream):
                    out = fn(*args, **kwargs)
            finally:
                caller.wait_stream(stream)
            _record(out, caller)
        if hand_back_to is not None and hand_back_to != caller:
            _record(out, hand_back_to)
        return out

    def _run_in_context(self, fn: Callable, args: tuple, kwargs: dict, hand_back_to):
        """torch versions without ``GreenContext.Stream()``: the context is current (this thread) for the call; its
        stream is torch's default stream, which the context maps to its own. Entered once per thread."""
        if self._entered.get():
            return fn(*args, **kwargs)
        caller = torch.cuda.current_stream(self.index)
        self.context.set_context()
        token = self._entered.set(True)
        try:
            inner = torch.cuda.current_stream(self.index)
            if inner != caller:
                _record(args, inner)
            out = fn(*args, **kwargs)
        finally:
            self._entered.reset(token)
            self.context.pop_context()
        if inner != caller:
            _record(out, caller)
        if hand_back_to is not None and hand_back_to != caller:
            _record(out, hand_back_to)
        return out


_GREEN: dict[tuple[int, int], GreenStream] = {}


def green_stream(num_sms: int, index: int) -> GreenStream:
    """The green context of ``num_sms`` SMs on CUDA device ``index`` (made once, then reused by every call)."""
    green = _GREEN.get((index, num_sms))
    if green is None:
        green = _GREEN[(index, num_sms)] = GreenStream(num_sms, index)
    return green


class SMLimit:
    """``num_sms`` for whole layer calls on one device: ``run`` calls the layer within it."""

    __slots__ = ("sms", "green", "grid_budget")

    def __init__(self, num_sms: int, device: torch.device):
        num_sms = _check_count(num_sms)
        self.green = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            props = cuda_properties(torch.device("cuda", index))
            if num_sms > props.multi_processor_count:
                raise ValueError(
                    f"{_KEY} = {num_sms} is more than the {props.multi_processor_count} SMs of cuda:{index} "
                    f"({props.name}): use at most {props.multi_processor_count}, or remove the key to use them all"
                )
            if num_sms < props.multi_processor_count:  # all of them: nothing to limit, no green context
                self.green = green_stream(num_sms, index)
                num_sms = self.green.sms
        self.sms = num_sms
        self.grid_budget = SMBudget(num_sms)

    def run(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a layer call) within the budget: see the module docstring."""
        outer = _BUDGET.get()
        green = self.green
        if green is None:
            budget = self.grid_budget if outer is None or outer.sms >= self.sms else SMBudget(outer.sms)
            token = _BUDGET.set(budget)
            try:
                return fn(*args, **kwargs)
            finally:
                _BUDGET.reset(token)
        sms = self.sms if outer is None else min(self.sms, outer.sms)
        caller = torch.cuda.current_stream(green.index)
        token = _BUDGET.set(SMBudget(sms, green, caller))
        try:
            return green.run(fn, args, kwargs, caller=caller)
        finally:
            _BUDGET.reset(token)


_LIMITS: dict[tuple, SMLimit] = {}


def sm_limit(num_sms: int, device: torch.device) -> SMLimit:
    """The ``SMLimit`` of ``num_sms`` on ``device``, made once (checked against the device's SMs, its green context
    created) and cached."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index, num_sms)
    limit = _LIMITS.get(key)
    if limit is None:
        limit = _LIMITS[key] = SMLimit(num_sms, device)
    return limit
