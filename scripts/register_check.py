"""Usage: python scripts/register_check.py MODULE:KERNEL [--constexprs JSON] [--config BM,BN,BK,WARPS,STAGES ...]
        [--ones NAME ...] [--types JSON] [--sass] [--listing FILE]
       python scripts/register_check.py --serve

Compile a package kernel for Hopper (sm_90) on a machine without a GPU and print its registers, spills and shared
memory, per config: a register-pressure check before spending GPU time. For example:

    python scripts/register_check.py prime_megamoe.kernels.grouped_gemm:grouped_gemm_kernel \\
        --constexprs '{"GATHER_A": true, "SCALE_ROWS": true, "CAST_F32": false, "IEEE": false, "TILE_M": 128,
                       "PERSISTENT": false}' \\
        --config 128,128,64,8,4 --config 128,256,64,8,3 --ones stride_bn

Each --config is BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages (for kernels with those block names); constexprs with a
default in the kernel's signature take it unless given. Arguments are
typed by name: ``*_ptr`` are pointers (int32 for index-like names, fp32 for weights / scales, else --dtype);
``clamp_limit`` is an fp32 scalar; other non-constexpr arguments are int32, divisible by 16 unless named in --ones
(specialised to 1, as a unit stride is at run time); --types overrides any of these by name (a TMA descriptor:
"tensordesc<bf16[64, 256]>"; a descriptor the config leaves unused: null in --constexprs). --sass adds the kernel's
static SASS instruction count by opcode (loops counted once: for unrolled kernels it is what a program issues) and
each loop body's instruction count (a trip's, for kernels with loops); --listing FILE writes the SASS listing there.
Uses Triton's own ptxas and cuobjdump; needs TRITON_INTERPRET unset. --serve answers many checks in one process
(the CPU tests' compile checks): one JSON list of the arguments above a line on stdin, one JSON line back,
{"ok": true, "out": the printed table} or {"ok": false, "out": the error}.

Gluon kernels (``@gluon.jit``) compile the same way; a descriptor type without a layout gets the default NVMMA shared
layout of its block, ``num_warps`` comes from --warps and --maxnreg caps the launch-time registers (warp-specialised
kernels raise their MMA partition's registers from there). For them the registers column is the launch-time count
and "partition" lists each ``setmaxnreg`` target in the PTX.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT_POINTERS = ("src", "tile_", "offsets", "num_tiles", "pair_pos", "index", "counts", "order", "key")
FLOAT_POINTERS = ("weight", "scale", "dw_partial")
FLOAT_SCALARS = ("clamp_limit",)  # fp32 runtime scalars (the clamped SwiGLU's limit)


def pointer_type(name: str, dtype: str) -> str:
    if any(t in name for t in INT_POINTERS):
        return "*i32"
    if any(t in name for t in FLOAT_POINTERS):
        return "*fp32"
    return "*" + dtype


def jit_function(kernel):
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn
    return kernel


def is_gluon(fn) -> bool:
    from triton.experimental.gluon._runtime import GluonJITFunction

    return isinstance(fn, GluonJITFunction)


def gluon_descriptor_type(ty: str) -> str:
    """'tensordesc<fp8e4nv[128, 128]>' -> the same with the block's default NVMMA shared layout, as Gluon needs."""
    from triton.experimental.gluon import language as gl

    inner = ty[len("tensordesc<") : -1]
    if "]," in inner:
        return ty  # a layout is given
    dtype, shape = inner.split("[")
    block = [int(v) for v in shape.rstrip("]").split(",")]
    element = {"fp8e4nv": gl.float8e4nv, "bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype.strip()]
    layout = gl.NVMMASharedLayout.get_default_for(block, element)
    return f"tensordesc<{inner},{layout!r}>"


def resource_usage(
    kernel,
    constexprs: dict,
    num_warps: int,
    num_stages: int,
    dtype: str,
    ones=(),
    types: dict | None = None,
    maxnreg: int | None = None,
    sass: bool = False,
) -> dict:
    """Compile for sm_90 and return {"registers", "spill_bytes", "shared_bytes", "partition_registers"} (and with
    ``sass`` "sass_counts": {opcode: static count}); ``types`` overrides argument types by name (e.g. {"as_ptr":
    "*fp32"})."""
    fn = jit_function(kernel)
    gluon = is_gluon(fn)
    if gluon:
        constexprs = {**constexprs, "num_warps": num_warps}
        types = {n: gluon_descriptor_type(t) if t.startswith("tensordesc") else t for n, t in (types or {}).items()}
    constexprs = {**constexprs, **{name: 1 for name in ones}}
    names = fn.arg_names
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs}  # constexprs with a default in the signature may be left out
    missing = [n for n in names if n not in constexprs and fn.params[names.index(n)].is_constexpr]
    if missing:
        raise SystemExit(f"give these constexprs (--constexprs / --config): {missing}")
    signature = {
        n: "constexpr"
        if n in constexprs
        else pointer_type(n, dtype)
        if n.endswith("_ptr")
        else "fp32"
        if n in FLOAT_SCALARS
        else "i32"
        for n in names
    }
    signature.update({n: t for n, t in (types or {}).items() if n in signature and signature[n] != "constexpr"})
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if signature[n] not in ("constexpr", "fp32") and not signature[n].startswith("tensordesc")
    }
    constants = {(names.index(k),): v for k, v in constexprs.items() if k in names}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, signature, constants, attrs)
    else:
        src = ASTSource(fn, signature, constants, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
        listing = (
            subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
            if sass
            else ""
        )
    fields = dict(
        item.split(":", 1) for item in next(line for line in out.splitlines() if "REG:" in line).split() if ":" in item
    )
    partitions = sorted(
        {int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])}
    )
    use = {
        "registers": int(fields["REG"]),
        "spill_bytes": int(fields["STACK"]),
        "shared_bytes": int(compiled.metadata.shared),
        "partition_registers": partitions,
        "wgmma_serialised": wgmma_serialised(compiled.asm["ptx"]),
    }
    if sass:
        use["sass_counts"] = sass_counts(listing)
        use["sass_loops"] = sass_loops(listing)
        use["sass_listing"] = listing
    return use


def sass_counts(listing: str) -> dict[str, int]:
    """Static instruction counts by opcode (its first name, without modifiers or predicate) of a ``cuobjdump -sass``
    listing, most frequent first."""
    counts: dict[str, int] = {}
    for match in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", listing):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def sass_loops(listing: str) -> list[tuple[int, int]]:
    """(first address, instructions) of each loop body in a ``cuobjdump -sass`` listing: the instructions from a
    backward branch's target through the branch, in address order (a body counts its inner loops' once)."""
    addresses = [int(a, 16) for a in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?[A-Z]", listing)]
    loops = []
    for branch, target in re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\S*\s+`?\(?\.?L?_?x?_?(?:0x)?"
        r"([0-9a-f]+)",
        listing,
    ):
        branch, target = int(branch, 16), int(target, 16)
        if target < branch:
            loops.append((target, sum(target <= a <= branch for a in addresses)))
    return sorted(loops)


def wgmma_serialised(ptx: str) -> bool:
    """Whether ptxas serialises the kernel's wgmma instructions (its C7514 / C7515 performance notes: accumulator
    registers read or written while a wgmma runs), which makes every wgmma wait for the one before."""
    if "wgmma.mma_async" not in ptx:
        return False
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas Triton itself compiled the kernel with
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "kernel.o")], capture_output=True, text=True
        )
    return "wgmma.mma_async instructions are serialized" in out.stdout + out.stderr


def report(argv: list[str]) -> str:
    """The table this script prints for the arguments ``argv``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", help="module:name, e.g. prime_megamoe.kernels.grouped_gemm:grouped_gemm_kernel")
    p.add_argument("--constexprs", default="{}", help="JSON object of constexpr values")
    p.add_argument("--config", action="append", default=[], help="BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages")
    p.add_argument("--warps", type=int, default=4, help="num_warps when no --config is given")
    p.add_argument("--stages", type=int, default=3, help="num_stages when no --config is given")
    p.add_argument("--dtype", default="bf16", help="element type of data pointers (bf16, fp16, fp32, fp8e4nv)")
    p.add_argument("--ones", nargs="*", default=[], help="integer arguments specialised to 1 (unit strides)")
    p.add_argument("--types", default="{}", help='JSON object of argument types by name, e.g. {"as_ptr": "*fp32"}')
    p.add_argument("--maxnreg", type=int, default=None, help="launch-time register cap (warp-specialised kernels)")
    p.add_argument("--sass", action="store_true", help="also print static SASS instruction counts by opcode")
    p.add_argument("--listing", default=None, help="with --sass: write the SASS listing to this file")
    args = p.parse_args(argv)
    module, name = args.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    base = json.loads(args.constexprs)
    runs = []
    for config in args.config or [None]:
        if config is None:
            runs.append(("-", base, args.warps, args.stages))
            continue
        bm, bn, bk, warps, stages = (int(v) for v in config.split(","))
        runs.append((config, {**base, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, warps, stages))
    lines = [f"{'config':22s} {'registers':>9s} {'spill B':>8s} {'smem B':>8s} {'partition':>15s} wgmma"]
    for label, constexprs, warps, stages in runs:
        use = resource_usage(
            kernel,
            constexprs,
            warps,
            stages,
            args.dtype,
            args.ones,
            json.loads(args.types),
            args.maxnreg,
            sass=args.sass,
        )
        parts = ",".join(str(r) for r in use["partition_registers"]) or "-"
        wgmma = "serialised" if use["wgmma_serialised"] else "ok"
        lines.append(
            f"{label:22s} {use['registers']:9d} {use['spill_bytes']:8d} {use['shared_bytes']:8d} {parts:>15s} {wgmma}"
        )
        if args.sass:
            counts = use["sass_counts"]
            lines.append(
                f"  SASS: {sum(counts.values())} instructions; " + ", ".join(f"{k} {v}" for k, v in counts.items())
            )
            loops = ", ".join(f"{n} at {first:#x}" for first, n in use["sass_loops"]) or "none"
            lines.append(f"  loops (instructions a trip, first address): {loops}")
            if args.listing:
                with open(args.listing, "w") as f:
                    f.write(use["sass_listing"])
    return "\n".join(lines) + "\n"


def serve() -> None:
    """--serve: a report per JSON argument list read from stdin, one JSON line each (see the module docstring)."""
    for line in sys.stdin:
        try:
            reply = {"ok": True, "out": report(json.loads(line))}
        except BaseException:  # noqa: BLE001 - argparse's exit and compile errors alike go back to the caller
            reply = {"ok": False, "out": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


def main():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter has no compiled kernels")
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print(report(sys.argv[1:]), end="")


if __name__ == "__main__":
    main()
