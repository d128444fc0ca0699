"""Launching Triton kernels with less host time: the compiled kernel a regular launch chose, called directly.

A forward of the expert-parallel layer issues about 15 Triton launches. Through ``kernel[grid](...)`` each one binds
its ~25 arguments, recomputes Triton's specialisation key and (for autotuned kernels) the autotuning key, which adds up
to a large share of the host time of a call: single calls are host-bound (see BENCHMARKS.md). ``launch`` does the
first launch of each specialisation the regular way (compiling and autotuning as usual), keeps the compiled kernel and
the config autotuning chose, and afterwards calls that compiled kernel straight away. Tensor descriptors (TMA,
Triton's and Gluon's) pass through to the launcher, which fills them with the compiled kernel's block shape. The
warp-specialised Gluon kernels launch this way too (``fp8_ws_launch``).

The cache key holds everything the compiled kernel depends on, so a hit can only reuse a kernel Triton itself would
have picked: each tensor's dtype, 16-byte alignment and whether it is a CUDA tensor (a CPU tensor never reaches a
compiled kernel as a bare address, which would fault on the GPU: its first launch is Triton's, which rejects it with
an error), each integer's specialisation class (== 1, divisible by 16, 64-bit) or, for the autotuning key's
arguments, its value, the constexpr and launch options, and the device. Computing that key per argument in Python
took 20-30 us a launch on an H200 host (a layer call makes 10-16 launches): a launch first looks for its exact key
(every integer's value, the addresses' low bits; from C-level getters and maps, built once per pattern of argument
types), which the first launch with those values maps to the entry of its specialisation key.

The key does not hold the autotuner's candidate list: code that swaps ``kernel.configs`` between launches (tests
pinning one config, ``scripts/fp8_probe.py``) sets ``PRIME_MEGAMOE_DIRECT_LAUNCH=0``, or it would keep running the
kernel compiled first. (Keying on the list's identity would cost every launch host time, and a freed list's id can
come back for another.)

Under the interpreter (CPU tests) kernels have no compiled form: ``launch`` is ``kernel[grid](...)`` there. So is it
with ``PRIME_MEGAMOE_DIRECT_LAUNCH=0`` (for comparing the two paths).
"""

from __future__ import annotations

import operator

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..env import env_get
from ..kernels.tuning import interpreting

try:  # Gluon's descriptors (the warp-specialised Hopper kernels) carry their block shape and shared layout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # a Triton without Gluon: no such arguments
    GluonTensorDescriptor = None

_I32 = (-(2**31), 2**31)


class _Entry:
    __slots__ = ("compiled", "params", "constants", "meta", "run", "function", "packed_metadata")

    def __init__(self, compiled, params, meta):
        self.compiled = compiled  # triton.compiler.CompiledKernel
        self.params = params  # per kernel parameter: (True, index into args) or (False, its constant value)
        # The arguments come first, in order (``_first_launch``): the launcher's parameters are they, then these
        self.constants = tuple(value for is_arg, value in params if not is_arg)
        self.meta = meta  # constexprs and the chosen config, for the grid function
        # Read once: on some Triton versions each is a property that re-checks the loaded module on every access.
        self.run, self.function = compiled.run, compiled.function
        self.packed_metadata = compiled.packed_metadata


_CACHE: dict[tuple, _Entry] = {}
_SIGNATURES: dict[int, tuple[list[str], frozenset]] = {}  # per kernel: parameter names, autotuning key arguments


def direct_launch_enabled() -> bool:
    return not interpreting() and env_get("PRIME_MEGAMOE_DIRECT_LAUNCH", "1") != "0"


def _signature(kernel) -> tuple[list[str], frozenset]:
    """The kernel's parameter names (from the jitted function under autotuning / heuristics wrappers) and the
    positions of its autotuning key's arguments, looked up once per kernel."""
    found = _SIGNATURES.get(id(kernel))
    if found is None:
        fn = kernel
        while not hasattr(fn, "arg_names"):
            fn = fn.fn
        keys = set(getattr(kernel, "keys", ()))
        found = _SIGNATURES[id(kernel)] = (fn.arg_names, frozenset(i for i, n in enumerate(fn.arg_names) if n in keys))
    return found


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)  # what Triton's own launches use


def _int_class(v: int) -> int:
    """An integer's specialisation class: 8 + (== 1, divisible by 16, 32-bit) as bits, never equal to a bool or None
    in the same position of a key."""
    return 8 | (v == 1) | (not v & 15) << 1 | (_I32[0] <= v < _I32[1]) << 2


def _key(kernel, args, constexprs, device: int) -> tuple[tuple, list]:
    """(cache key, argument values for the launcher): tensors go to the launcher as their addresses, which it takes
    as they are; given a tensor it would call ``data_ptr`` and check the address with the driver, per argument and
    launch. Runs on every launch: type tests by identity first, an integer's class packed into one int."""
    parts = [id(kernel), device]
    append = parts.append
    values = list(args)
    names, exact = _signature(kernel)
    for i, a in enumerate(args):
        kind = type(a)
        if kind is bool or a is None:
            append(a)
        elif kind is int or isinstance(a, int):
            append(a if i in exact else _int_class(a))  # exact (autotuning key): the value
        elif isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            values[i] = ptr
            append(a.dtype)
            append(not ptr & 15)
            append(a.is_cuda)
        elif isinstance(a, float):
            append(float)
        elif kind is TensorDescriptor or kind is GluonTensorDescriptor:
            # The launcher builds the TMA descriptor from the compiled kernel's block shape; what can vary between
            # calls of one compiled kernel is the tensor, its shape and strides (integers, classed as above). A
            # Gluon descriptor's block shape and shared layout are part of the kernel's signature: keyed too.
            append(a.base.dtype)
            append(getattr(a, "padding", None))  # (fields of newer Triton versions)
            append(getattr(a, "round_f32_to_tf32", None))
            if kind is GluonTensorDescriptor:
                append(tuple(a.block_shape))
                append(a.layout)
            for v in (*a.shape, *a.strides):
                append(_int_class(v))
        else:
            raise TypeError(f"launch: argument {names[i]} of {names} has unsupported type {kind.__name__}")
    parts.extend(constexprs.items())  # keyword order is a call site's own: another order is only another entry
    return tuple(parts), values


class _Layout:
    """Where a kernel's arguments of one type pattern sit: getters for its tensors, integers, descriptors and other
    values (bools, None, floats), built once per (kernel, argument types)."""

    __slots__ = ("tensor_pos", "tensors", "ints", "descriptors", "others")

    def __init__(self, types: tuple):
        def getter(positions):  # itemgetter of one position returns the item itself: always a tuple here
            if not positions:
                return lambda args: ()
            if len(positions) == 1:
                (i,) = positions
                return lambda args: (args[i],)
            return operator.itemgetter(*positions)

        kinds = {"tensor": [], "int": [], "descriptor": [], "other": []}
        for i, kind in enumerate(types):
            if kind is bool or kind is float or kind is type(None):
                kinds["other"].append(i)
            elif issubclass(kind, int):
                kinds["int"].append(i)
            elif issubclass(kind, torch.Tensor):
                kinds["tensor"].append(i)
            else:  # _key accepted it: a tensor descriptor
                kinds["descriptor"].append(i)
        self.tensor_pos = tuple(kinds["tensor"])
        self.tensors, self.ints = getter(kinds["tensor"]), getter(kinds["int"])
        self.descriptors, self.others = getter(kinds["descriptor"]), getter(kinds["other"])


_LAYOUTS: dict[tuple, _Layout] = {}
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_IS_CUDA = operator.attrgetter("is_cuda")
_LOW_BITS = (15).__and__
_EXACT_ENTRIES = 1 << 14  # exact keys kept at most (distinct shapes x kernels); past it they start over


def _descriptor_values(d) -> tuple:
    return (
        d.base.dtype,
        tuple(d.shape),
        tuple(d.strides),
        getattr(d, "padding", None),
        getattr(d, "round_f32_to_tf32", None),
        tuple(d.block_shape),
        getattr(d, "layout", None),
    )


def _exact_key(kernel, args, constexprs, device: int, types: tuple, layout: _Layout) -> tuple[tuple, tuple]:
    """(a key of the arguments' exact values, the tensors' addresses): finer than ``_key``'s (every integer's value,
    the addresses' low four bits, descriptors' shapes and strides), so two launches with one exact key have one
    ``_key`` too. Most of it is computed by C-level getters and maps: a fraction of ``_key``'s host time."""
    tensors = layout.tensors(args)
    ptrs = tuple(map(_DATA_PTR, tensors))
    return (
        (
            "exact",
            id(kernel),
            device,
            types,
            layout.ints(args),
            tuple(map(_DTYPE, tensors)),
            tuple(map(_IS_CUDA, tensors)),
            tuple(map(_LOW_BITS, ptrs)),
            tuple(map(_descriptor_values, layout.descriptors(args))),
            layout.others(args),
            tuple(constexprs.items()),
        ),
        ptrs,
    )


def _first_launch(kernel, grid, args, constexprs) -> _Entry:
    compiled = kernel[grid](*args, **constexprs)
    if not (hasattr(compiled, "run") and hasattr(compiled, "function")):
        raise RuntimeError(
            f"triton {triton.__version__}: a launch did not return a compiled kernel; set "
            f"PRIME_MEGAMOE_DIRECT_LAUNCH=0 to launch through kernel[grid] only"
        )
    # autotuned kernels: the config this launch ran
    return entry_for(kernel, compiled, len(args), constexprs, getattr(kernel, "best_config", None))


def entry_for(kernel, compiled, num_args: int, constexprs: dict, config=None) -> _Entry:
    """The cache entry of ``compiled``, what a launch of ``kernel`` with ``num_args`` leading arguments,
    ``constexprs`` and the autotuning ``config`` (None: not autotuned) compiled: where each of the launcher's
    parameters comes from."""
    meta = {**constexprs, **(config.all_kwargs() if config is not None else {})}
    names, _ = _signature(kernel)
    params = []
    for i, name in enumerate(names):
        if i < num_args:
            params.append((True, i))
        elif name in meta:
            params.append((False, meta[name]))
        else:
            raise TypeError(f"launch: kernel parameter {name} was not given")
    return _Entry(compiled, tuple(params), meta)


def launch(kernel, grid, *args, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs)`` (kernel: a ``triton.jit``, ``gluon.jit`` or autotuned kernel; args:
    its leading parameters in order; constexprs: the rest by name, and launch options), through the compiled-kernel
    cache."""
    if not direct_launch_enabled():
        kernel[grid](*args, **constexprs)
        return
    device = _current_device()
    types = tuple(map(type, args))
    layout = _LAYOUTS.get((id(kernel), types))
    entry = None
    if layout is not None:
        exact, ptrs = _exact_key(kernel, args, constexprs, device, types, layout)
        entry = _CACHE.get(exact)
    if entry is None:
        # The first launch of these exact values: keyed by specialisation (``_key``), then remembered by exact key
        key, values = _key(kernel, args, constexprs, device)
        entry = _CACHE.get(key)
        if entry is None:
            _CACHE[key] = _first_launch(kernel, grid, args, constexprs)
            return
        if layout is None:
            layout = _LAYOUTS[(id(kernel), types)] = _Layout(types)
        exact, _ = _exact_key(kernel, args, constexprs, device, types, layout)
        if len(_CACHE) > _EXACT_ENTRIES:
            _CACHE.clear()  # (the compiled kernels stay in Triton's cache: each comes back by one regular launch)
        _CACHE[exact] = entry
    else:
        values = list(args)
        for i, ptr in zip(layout.tensor_pos, ptrs):
            values[i] = ptr
    if callable(grid):
        grid = grid(entry.meta)
    grid0, grid1, grid2 = (tuple(grid) + (1, 1))[:3]
    stream = _current_stream(device)
    hooks = triton.knobs.runtime
    enter = hooks.launch_enter_hook
    # Launch metadata only feeds the enter hook (profilers): skip building it when there is none (None, or newer
    # Triton's empty hook chain, which the launcher calls with the metadata unused). A hook sees the tensors.
    hooked = enter is not None and getattr(enter, "calls", True)
    metadata = None
    if hooked:
        metadata = entry.compiled.launch_metadata(grid, stream, *[args[v] if arg else v for arg, v in entry.params])
    entry.run(
        grid0,
        grid1,
        grid2,
        stream,
        entry.function,
        entry.packed_metadata,
        metadata,
        enter,
        hooks.launch_exit_hook,
        *values,
        *entry.constants,
    )
