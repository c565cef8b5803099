"""The decode projections lower for the GPUs they target (sm_90, sm_120, sm_121) without one: the
compile check's stand-in target, in a fresh process (this one imports triton under the
interpreter, which stops ahead-of-time compiles)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prepkit.kernels import compile_check as cc
from prepkit.kernels.compile_check.sass import stream_loop
from prepkit.kernels.decode.variants import DecodeVariant

# gpt-oss's projection shapes of the decode step: (N, K).
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "router": (128, 2880), "lm_head": (201088, 2880)}


def test_decode_candidates_are_each_ops_distinct_defaults() -> None:
    cands = cc.decode_candidates(SHAPES)
    keys = [(c.op, c.fmt, c.batch, c.variant) for c in cands]
    assert len(keys) == len(set(keys))
    assert {c.op for c in cands} == {"norm_linear", "linear_residual", "linear", "add_norm"}
    assert {c.fmt for c in cands} == {"bf16", "mxfp8", "mxfp4"}
    assert {c.batch for c in cands} == {1, 8}
    # The router's few rows take K splits; the big projections do not.
    assert any(c.variant is not None and c.variant.split_k > 1 and "router" in c.origin for c in cands)
    # The norm alone, once a batch, for the mxfp4 lm_head the tensor cores run.
    norms = [c for c in cands if c.op == "add_norm"]
    assert [(c.fmt, c.k, c.batch, c.variant) for c in norms] == [("mxfp4", 2880, 1, None), ("mxfp4", 2880, 8, None)]
    assert not [c for c in cc.decode_candidates(SHAPES, formats=("bf16", "mxfp8")) if c.op == "add_norm"]
    for c in cands:
        assert c.origin.startswith(f"default {c.op} {c.fmt} ")
        if c.variant is not None:
            assert DecodeVariant.parse(c.origin.split()[-1]) == c.variant


def _sass(lines: list[str]) -> str:
    out, addr = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{addr:04x}*/                   {line} ;")
            addr += 16
    return "\n".join(out)


def test_stream_loop_is_the_longest_loop_that_stores_nothing() -> None:
    listing = _sass(
        [
            ".L_x_0:",  # a prologue row loop: 3 instructions
            "LDG.E.U16 R2, desc[UR4][R4.64]",
            "FFMA R6, R2, R2, R6",
            "@P0 BRA `(.L_x_0)",
            ".L_x_1:",  # the K loop: 5 instructions, no store
            "LDG.E.128 R8, desc[UR4][R10.64]",
            "FFMA R12, R8, R9, R12",
            "FFMA R13, R8, R9, R13",
            "IADD3 R10, R10, 0x100, RZ",
            "@P1 BRA `(.L_x_1)",
            ".L_x_2:",  # an epilogue row loop: longer, but it stores
            "LDG.E.U16 R2, desc[UR4][R4.64]",
            "FADD R3, R2, R2",
            "F2FP.BF16.F32.PACK_AB R3, RZ, R3",
            "FMUL R7, R3, R3",
            "STG.E.U16 desc[UR4][R14.64], R3",
            "@P2 BRA `(.L_x_2)",
            "EXIT",
        ]
    )
    assert stream_loop(listing) == 5
    assert cc.k_loop(listing) is None  # no matrix instruction: the MoE rule finds nothing
    assert stream_loop(_sass(["STG.E [R2.64], R3", "EXIT"])) is None


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm90", "sm120", "sm121"])
def test_decode_projections_compile(arch: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json\n"
        "from prepkit.kernels import compile_check as cc\n"
        "cands = cc.decode_candidates({'qkv': (5120, 2880), 'router': (128, 2880), 'lm_head': (201088, 2880)},\n"
        "    batches=(1, 8))\n"
        "cands = [c for c in cands if 'lm_head' not in c.origin or c.op == 'add_norm']\n"
        f"r = cc.compile_decode({arch!r}, cands)\n"
        "print(json.dumps({'reports': [x.to_dict() for x in r], 'failures': cc.check_failures(r)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1500)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["failures"] == []
    reports = res["reports"]
    assert {r["origin"].split()[1] for r in reports} == {"norm_linear", "linear_residual", "linear", "add_norm"}
    for r in reports:
        norm = r["origin"].split()[1] == "add_norm"
        assert r["status"] == "compiled" and r["kernel"] == ("_add_norm_kernel" if norm else "_gemv_kernel"), r
        assert r["spill_bytes"] == 0, r
        assert norm or (r["k_step_instructions"] and r["k_step_mma"] == 0), r
        assert r["ptx_target"] == arch.replace("sm", "sm_") + "a"
