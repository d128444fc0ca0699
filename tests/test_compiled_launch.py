"""The compiled-kernel launch cache (``ops.compiled_launch``): which launches reuse a compiled kernel, and how its
arguments and grid are assembled. Runs on the CPU with a stand-in for Triton's launch and compiled kernel; the GPU
tests run the layer through the real one."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from prime_megamoe.ops import compiled_launch


@triton.jit
def _kernel(x_ptr, n, size, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


class _Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        self.log.append(("direct", (g0, g1, g2), stream, args))
        self.hooked = (launch_metadata, enter)


class _Autotuned:
    """Stands in for triton.autotune: the key argument ``size``, a chosen config, launches logged."""

    def __init__(self):
        self.fn, self.keys, self.log = _kernel, ["size"], []
        self.best_config = triton.Config({"BLOCK": 32})

    def __getitem__(self, grid):
        def first(*args, **kwargs):
            meta = {**kwargs, **self.best_config.all_kwargs()}
            self.log.append(("first", grid(meta) if callable(grid) else grid, args, kwargs))
            return _Compiled(self.log)

        return first


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(compiled_launch, "direct_launch_enabled", lambda: True)
    monkeypatch.setattr(compiled_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(compiled_launch, "_current_stream", lambda device: 77)
    monkeypatch.setattr(compiled_launch, "_CACHE", {})
    monkeypatch.setattr(compiled_launch, "_SIGNATURES", {})
    return _Autotuned()


def test_a_repeat_launch_calls_the_compiled_kernel_with_every_parameter(kernel):
    x = torch.zeros(64)
    grid = lambda meta: (triton.cdiv(100, meta["BLOCK"]),)  # noqa: E731
    compiled_launch.launch(kernel, grid, x, 48, 5, FLAG=True, num_warps=4)
    compiled_launch.launch(kernel, grid, x, 48, 5, FLAG=True, num_warps=4)
    first, second = kernel.log
    assert first[0] == "first" and first[1] == (4,)
    # Parameters in the kernel's order: the arguments, then the constexprs and the config autotuning chose; the grid
    # from the chosen config; the stream of the current device.
    # Tensors as their addresses (the launcher takes those as they are).
    assert second == ("direct", (4, 1, 1), 77, (x.data_ptr(), 48, 5, 32, True))


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that says it is a CUDA tensor: stands in for one on a machine without a GPU."""

    is_cuda = property(lambda self: True)


@pytest.mark.parametrize("change", ["alignment", "dtype", "device", "int class", "key value", "constexpr", "option"])
def test_a_launch_another_specialisation_would_compile_differently_goes_the_regular_way(kernel, change):
    x = torch.zeros(64)
    args, kwargs = [x, 48, 5], {"FLAG": True, "num_warps": 4}
    compiled_launch.launch(kernel, (1,), *args, **kwargs)
    if change == "alignment":
        args[0] = x[1:]  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args[0] = x.double()
    elif change == "device":  # a CUDA tensor after a CPU one (or the reverse): never the other's compiled kernel
        args[0] = torch.Tensor._make_subclass(_ReportsCuda, x)
        assert args[0].is_cuda and args[0].data_ptr() == x.data_ptr()
    elif change == "int class":
        args[1] = 49  # no longer divisible by 16
    elif change == "key value":
        args[2] = 6  # the autotuning key's argument: its value counts
    elif change == "constexpr":
        kwargs["FLAG"] = False
    else:
        kwargs["num_warps"] = 8
    compiled_launch.launch(kernel, (1,), *args, **kwargs)
    assert [entry[0] for entry in kernel.log] == ["first", "first"]


def test_values_inside_one_specialisation_reuse_the_compiled_kernel(kernel):
    x = torch.zeros(64)
    compiled_launch.launch(kernel, (1,), x, 48, 5, FLAG=True)
    compiled_launch.launch(kernel, (1,), x[4:], 64, 5, FLAG=True)  # 16 bytes on; another multiple of 16
    assert [entry[0] for entry in kernel.log] == ["first", "direct"]
    passed = kernel.log[1][3]
    assert passed == (x[4:].data_ptr(), 64, 5, 32, True)


def test_repeat_launches_find_their_exact_key_and_a_new_specialisation_still_compiles(kernel):
    # The second launch maps its exact values to the specialisation's entry; the third finds them directly (the same
    # parameters passed); a misaligned tensor afterwards still goes the regular way.
    x = torch.zeros(64)
    for _ in range(3):
        compiled_launch.launch(kernel, (1,), x, 48, 5, FLAG=True)
    assert [entry[0] for entry in kernel.log] == ["first", "direct", "direct"]
    assert kernel.log[1][3] == kernel.log[2][3] == (x.data_ptr(), 48, 5, 32, True)
    assert sum(key[0] == "exact" for key in compiled_launch._CACHE) == 1
    compiled_launch.launch(kernel, (1,), x[1:], 48, 5, FLAG=True)
    compiled_launch.launch(kernel, (1,), x, 48, 6, FLAG=True)  # the autotuning key's value
    assert [entry[0] for entry in kernel.log] == ["first", "direct", "direct", "first", "first"]


def test_an_argument_of_unknown_type_is_an_error(kernel):
    with pytest.raises(TypeError, match="unsupported type"):
        compiled_launch.launch(kernel, (1,), torch.zeros(4), "48", 5, FLAG=True)


def test_launch_metadata_is_built_only_for_a_launch_hook(kernel, monkeypatch):
    # Without an enter hook (no profiler) the launcher gets no metadata, as Triton's own launches do; with one, the
    # compiled kernel's metadata for this grid and stream.
    x = torch.zeros(64)
    compiled = []
    first = kernel.__getitem__

    def keep(grid):
        launch = first(grid)
        return lambda *a, **k: compiled.append(launch(*a, **k)) or compiled[-1]

    monkeypatch.setattr(type(kernel), "__getitem__", lambda self, grid: keep(grid))
    compiled_launch.launch(kernel, (2,), x, 48, 5, FLAG=True)
    compiled_launch.launch(kernel, (2,), x, 48, 5, FLAG=True)
    assert compiled[0].hooked[0] is None  # (the hook slot holds None, or newer Triton's empty hook chain)

    def hook(metadata):
        pass

    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    compiled_launch.launch(kernel, (2,), x, 48, 5, FLAG=True)
    assert compiled[0].hooked == (("metadata", (2,), 77), hook)


def test_tensor_descriptors_pass_through_keyed_on_dtype_and_integer_classes(kernel):
    # A TMA descriptor goes to the launcher as the object (the launcher fills the TMA descriptor from the compiled
    # kernel's block shape and the tensor's address): another tensor or block shape of the same dtype and shape /
    # stride classes reuses the compiled kernel; another dtype or a shape that changes class does not.
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t, block=(16, 16)):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))

    a, b = torch.zeros(64, 32), torch.zeros(128, 32)
    first, same_class = desc(a), desc(b, (32, 16))
    compiled_launch.launch(kernel, (1,), first, 48, 5, FLAG=True)
    compiled_launch.launch(kernel, (1,), same_class, 48, 5, FLAG=True)
    assert [entry[0] for entry in kernel.log] == ["first", "direct"]
    assert kernel.log[1][3][0] is same_class
    compiled_launch.launch(kernel, (1,), desc(a.double()), 48, 5, FLAG=True)
    compiled_launch.launch(kernel, (1,), desc(torch.zeros(65, 32)), 48, 5, FLAG=True)  # 65 rows: not a multiple of 16
    assert [entry[0] for entry in kernel.log] == ["first", "direct", "first", "first"]


def test_gluon_descriptors_are_keyed_on_their_block_shape_and_layout_too(kernel):
    # A Gluon descriptor's block shape and shared layout are part of the kernel's signature (the warp-specialised
    # kernels read them at compile time): another block shape or layout compiles again; another tensor of the same
    # dtype and classes with the same block and layout reuses the compiled kernel.
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    def desc(t, block=(16, 16), swizzle=32):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=2)
        return gluon_hopper.TensorDescriptor.from_tensor(t, list(block), layout)

    a, b = torch.zeros(64, 32), torch.zeros(128, 32)
    compiled_launch.launch(kernel, (1,), desc(a), 48, 5, FLAG=True)
    same = desc(b)
    compiled_launch.launch(kernel, (1,), same, 48, 5, FLAG=True)
    assert [entry[0] for entry in kernel.log] == ["first", "direct"]
    assert kernel.log[1][3][0] is same
    compiled_launch.launch(kernel, (1,), desc(b, (32, 16)), 48, 5, FLAG=True)
    compiled_launch.launch(kernel, (1,), desc(b, swizzle=64), 48, 5, FLAG=True)
    assert [entry[0] for entry in kernel.log] == ["first", "direct", "first", "first"]


@triton.jit
def _fill_ones(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.full((BLOCK,), 1.0, tl.float32), mask=offs < n)


@pytest.mark.gpu
def test_a_cpu_tensor_after_a_cuda_one_is_an_error_not_a_fault(monkeypatch):
    """A CPU tensor where a compiled kernel ran on a CUDA one of the same dtype and alignment: Triton's own launch
    rejects it (with the address alone the kernel would fault and take the CUDA context with it)."""
    monkeypatch.setattr(compiled_launch, "_CACHE", {})
    x = torch.zeros(64, device="cuda")
    for _ in range(2):  # the second one calls the compiled kernel
        compiled_launch.launch(_fill_ones, (1,), x, 64, BLOCK=64)
    with pytest.raises(ValueError, match="cpu tensor"):
        compiled_launch.launch(_fill_ones, (1,), torch.zeros(64), 64, BLOCK=64)
    torch.cuda.synchronize()
    assert (x == 1).all()
