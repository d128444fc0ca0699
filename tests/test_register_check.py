"""scripts/register_check.py compiles kernels for sm_90 without a GPU: the SwiGLU backward row pass and the plain
FC2 dgrad GEMM config that replaced the fused epilogue must fit in registers (no spills), and the kernels the
interpreter alone cannot vouch for must compile. Runs Triton's compiler in a subprocess, outside the interpreter the
rest of the CPU suite uses."""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "register_check.py"
CASES = [
    (
        "prime_megamoe.kernels.swiglu_grad:swiglu_backward_rows_kernel",
        {"TILE_M": 128, "BLOCK_R": 16, "BLOCK_C": 128, "CLAMP": False},
        ["--warps", "4"],
    ),
    (  # the clamped SwiGLU's backward (activation_clamp): two masks more, still no spill
        "prime_megamoe.kernels.swiglu_grad:swiglu_backward_rows_kernel",
        {"TILE_M": 128, "BLOCK_R": 16, "BLOCK_C": 128, "CLAMP": True},
        ["--warps", "4"],
    ),
    (
        "prime_megamoe.kernels.grouped_gemm:grouped_gemm_kernel",
        {
            "a_desc": None,
            "b_desc": None,
            "GATHER_A": True,
            "SCALE_ROWS": False,
            "CAST_F32": False,
            "IEEE": False,
            "A_TMA": False,
            "B_TMA": False,
            "B_KMAJOR": False,
            "TILE_M": 128,
            "PERSISTENT": False,
        },
        ["--config", "128,128,64,8,4", "--ones", "stride_bn"],
    ),
]


class _CompileServer:
    """One ``register_check.py --serve`` process for every compile check of this process: Python, torch and Triton
    are imported once, not once per kernel."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        atexit.register(self.close)

    def close(self) -> None:
        """Stops the server and closes its pipes (an exiting process left them to the garbage collector's warnings)."""
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def ask(self, argv: list[str], timeout: float = 300.0) -> dict:
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"register_check.py --serve gave no answer within {timeout:g} s for {argv}"
        line = self.proc.stdout.readline()
        assert line, f"register_check.py --serve exited ({self.proc.poll()}) on {argv}"
        return json.loads(line)


_SERVER: list[_CompileServer] = []


def compile_for_hopper(kernel: str, constexprs: dict, extra: list[str]) -> list[list[str]]:
    """The script's rows (config, registers, spill bytes, shared bytes) for ``kernel``; fails on a compile error."""
    if not _SERVER or _SERVER[0].proc.poll() is not None:
        _SERVER[:] = [_CompileServer()]
    reply = _SERVER[0].ask([kernel, "--constexprs", json.dumps(constexprs), *extra])
    assert reply["ok"], reply["out"][-2000:]
    rows = [line.split() for line in reply["out"].splitlines()[1:] if line.strip()]
    assert rows, reply["out"]
    return rows


@pytest.mark.parametrize("kernel, constexprs, extra", CASES, ids=["swiglu_rows", "swiglu_rows_clamp", "fc2_dgrad_gemm"])
def test_kernel_compiles_for_hopper_without_spills(kernel, constexprs, extra):
    for _, registers, spill, smem, *_ in compile_for_hopper(kernel, constexprs, extra):
        assert 0 < int(registers) <= 255 and int(smem) >= 0
        assert int(spill) == 0, f"{kernel} spills {spill} bytes per thread"


# Kernels whose compiled form the interpreter cannot vouch for (it accepts, for one, a name bound to two shapes in
# the two branches of an if, which the compiler rejects): each must compile for sm_90.
ROUTING = {
    "TOP_K": 8,
    "NUM_LOCAL": 64,
    "EXPERT_BLOCK": 64,
    "TILE_M": 128,
    "BLOCK": 1024,
    "TILE_BLOCK": 32,
    "HIST_BLOCK": 16,
}
COMPILES = [
    (
        "prime_megamoe.kernels.routing:routing_keys_kernel",
        {
            "NUM_LOCAL": 64,
            "NUM_BINS": 128,
            "SKIP": 64,
            "BLOCK": 1024,
            "COPY_ROUTING": True,
            "CHECK_IDS": True,
            "QUANT_ROWS": False,
            "QK": 1,
            "BM": 1,
            "BK": 1,
            "POW2": False,
            "E8M0": False,
        },
        ["--types", '{"index_ptr": "*i64", "hist_ptr": "*i32", "weights_ptr": "*bf16", "id_check_ptr": "*i32"}'],
    ),
    (
        "prime_megamoe.kernels.routing:routing_keys_kernel",  # with the forward's rows quantised in the same launch
        {
            "NUM_LOCAL": 128,
            "NUM_BINS": 256,
            "SKIP": 128,
            "BLOCK": 1024,
            "COPY_ROUTING": False,
            "CHECK_IDS": False,
            "QUANT_ROWS": True,
            "QK": 128,
            "BM": 64,
            "BK": 128,
            "POW2": False,
            "E8M0": False,
        },
        [
            "--types",
            '{"index_ptr": "*i64", "hist_ptr": "*i32", "x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", '
            '"id_check_ptr": "*i32"}',
        ],
    ),
    (
        "prime_megamoe.kernels.routing:routing_place_kernel",
        {**ROUTING, "NUM_BINS": 128, "SKIP": 64, "HALVES": True, "CHECK_IDS": True},
        ["--types", '{"weights_ptr": "*bf16", "row_weight_ptr": "*fp32", "hist_ptr": "*i32", "id_check_ptr": "*i32"}'],
    ),
    (
        "prime_megamoe.kernels.routing:routing_place_kernel",
        {**ROUTING, "NUM_BINS": 256, "SKIP": 128, "HALVES": False, "CHECK_IDS": False},
        ["--types", '{"weights_ptr": "*fp32", "row_weight_ptr": "*fp32", "hist_ptr": "*i32", "id_check_ptr": "*i32"}'],
    ),
    ("prime_megamoe.kernels.routing:expert_ids_in_range_kernel", {"BLOCK": 4096}, ["--types", '{"index_ptr": "*i64"}']),
    (
        "prime_megamoe.kernels.combine:combine_rows_kernel",
        {"TOP_K": 8, "BLOCK_R": 1, "BLOCK_H": 1024, "PAIR_VALUES": True, "K_BLOCK": 8},
        ["--types", '{"pair_src_ptr": "*fp32", "pair_out_ptr": "*fp32"}'],
    ),
    (
        "prime_megamoe.kernels.grouped_gemm:fc1_swiglu_kernel",
        {
            "SAVE_H": True,
            "CLAMP": False,
            "CAST_F32": False,
            "IEEE": False,
            "TILE_M": 128,
            "PERSISTENT": True,
            "ONE_DOT": True,
        },
        ["--config", "128,128,64,8,3", "--ones", "stride_wk"],
    ),
    (
        "prime_megamoe.kernels.grouped_gemm:grouped_gemm_kernel",
        {
            "GATHER_A": False,
            "SCALE_ROWS": True,
            "CAST_F32": False,
            "IEEE": False,
            "A_TMA": True,
            "B_TMA": True,
            "B_KMAJOR": True,
            "TILE_M": 128,
            "PERSISTENT": True,
        },
        [
            "--config",
            "128,256,64,8,3",
            "--ones",
            "stride_bk",
            "--types",
            '{"a_desc": "tensordesc<bf16[128, 64]>", "b_desc": "tensordesc<bf16[256, 64]>"}',
        ],
    ),
    (
        "prime_megamoe.kernels.grouped_gemm:grouped_gemm_kernel",
        {
            "a_desc": None,
            "GATHER_A": True,
            "SCALE_ROWS": False,
            "CAST_F32": False,
            "IEEE": False,
            "A_TMA": False,
            "B_TMA": True,
            "B_KMAJOR": False,
            "TILE_M": 128,
            "PERSISTENT": False,
        },
        ["--config", "128,128,64,8,4", "--ones", "stride_bn", "--types", '{"b_desc": "tensordesc<bf16[64, 128]>"}'],
    ),
    (
        "prime_megamoe.kernels.grouped_gemm:grouped_wgrad_kernel",
        {"DENSE_A": True, "USE_TMA": True, "CAST_F32": False, "IEEE": False, "GROUP_M": 8},
        ["--config", "256,128,64,8,3", "--ones", "stride_cn", "--types", '{"d_desc": "tensordesc<bf16[64, 256]>"}'],
    ),
    (
        "prime_megamoe.kernels.grouped_gemm:grouped_wgrad_kernel",
        {"d_desc": None, "DENSE_A": False, "USE_TMA": False, "CAST_F32": False, "IEEE": False, "GROUP_M": 8},
        ["--config", "128,256,64,8,3", "--ones", "stride_cn"],
    ),
    (
        "prime_megamoe.kernels.signals:wait_flags_kernel",  # the symmetric-memory wait, with the peers' heartbeats
        {"WORLD": 8, "WORLD_BLOCK": 8, "BEAT_NS": 1 << 20},
        [
            "--warps",
            "1",
            "--types",
            '{"flags_ptr": "*i32", "beats_ptr": "*i32", "peer_beats_ptr": "*i64", "silence_ns": "i64", '
            '"stall_ns": "i64"}',
        ],
    ),
]


@pytest.mark.parametrize(
    "kernel, constexprs, extra",
    COMPILES,
    ids=[
        "routing_keys",
        "routing_keys_quant_rows",
        "routing_place_halves",
        "routing_place",
        "expert_ids",
        "combine_pairs",
        "fc1_one_dot",
        "gemm_tma_both",
        "gemm_tma_weights",
        "wgrad_tma",
        "wgrad_pointers",
        "wait_flags",
    ],
)
def test_kernel_compiles_for_hopper(kernel, constexprs, extra):
    rows = compile_for_hopper(kernel, constexprs, extra)
    assert all(0 < int(registers) <= 255 for _, registers, *_ in rows), rows


def test_sass_counts_name_each_opcode_once_per_instruction():
    script = load_script("register_check")
    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                         /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 FMUL.FTZ R2, R3, R4 ;                          /* 0x0000000403027220 */
        /*0020*/                   FMUL R5, R6, R7 ;                              /* 0x0000000706057220 */
        /*0030*/              @UP0 LDG.E.64 R8, desc[UR4][R8.64] ;                /* 0x0000000408087981 */
    """
    assert script.sass_counts(listing) == {"FMUL": 2, "LDC": 1, "LDG": 1}


def test_sass_loops_count_each_backward_branch_body():
    script = load_script("register_check")
    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                         /* 0x00000a00ff017b82 */
        /*0010*/                   FMUL R5, R6, R7 ;                              /* 0x0000000706057220 */
        /*0020*/                   FADD R5, R6, R7 ;                              /* 0x0000000706057220 */
        /*0030*/               @P1 BRA 0x20 ;                                     /* 0xffffffc000441947 */
        /*0040*/              @!P6 BRA 0x10 ;                                     /* 0xffffff740064e947 */
        /*0050*/                   BRA 0x70 ;                                     /* 0x0000000000087947 */
        /*0060*/                   EXIT ;                                         /* 0x000000000000794d */
        /*0070*/                   BRA 0x70;                                      /* 0xfffffffc00fc7947 */
    """
    # The inner loop (0x20-0x30: 2 instructions), the outer one (0x10-0x40: 4); forward branches and the final
    # self-branch are not loops.
    assert script.sass_loops(listing) == [(0x10, 4), (0x20, 2)]


def test_the_script_prints_sass_counts():
    kernel, constexprs, extra = CASES[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, str(SCRIPT), kernel, "--constexprs", json.dumps(constexprs), *extra, "--sass"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    sass = next(line for line in out.stdout.splitlines() if line.strip().startswith("SASS:"))
    assert int(sass.split()[1]) > 100 and "FMUL" in sass and "STG" in sass
    assert any(line.strip().startswith("loops (instructions a trip") for line in out.stdout.splitlines())
