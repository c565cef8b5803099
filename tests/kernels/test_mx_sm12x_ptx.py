"""The MX policies' GEMMs compile for sm_120 / sm_121 on a machine without a GPU, and their PTX
holds the block-scaled MMA (e4m3 x e4m3 -> kind::mxf8f6f4, e2m1 x e2m1 -> kind::mxf4nvf4), not
a bf16 mma.sync: the operands reach ``tl.dot_scaled`` in one format on both sides."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Runs in a fresh interpreter: the kernel tests' conftest turns on TRITON_INTERPRET, under which
# @triton.jit functions cannot be compiled ahead of time.
_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from prepkit.kernels.mx import _gemm as k

PTRS = {"w_desc", "w_ptr", "s_ptr", "x_ptr", "h_ptr", "xs_ptr", "hs_ptr"}
FP32 = {"b_ptr", "topk_w_ptr", "out_ptr"}
I32 = {"counts_ptr", "sorted_ptr", "topk_ids_ptr"}


def compile_gemm(fn, consts, cap):
    sig, cst = {}, {}
    for p in fn.params:
        if p.name in consts:
            sig[p.name], cst[p.name] = "constexpr", consts[p.name]
        elif p.is_constexpr and p.has_default:  # the one-token path's constants: off, as MX runs
            sig[p.name], cst[p.name] = "constexpr", p.default
        elif p.name == "logits_ptr":
            sig[p.name] = "*bf16"
        elif p.name in PTRS:
            sig[p.name] = "*u8"
        elif p.name in FP32:
            sig[p.name] = "*fp32"
        elif p.name in I32:
            sig[p.name] = "*i32"
        elif p.name in ("alpha", "limit"):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
    src = triton.compiler.ASTSource(fn, sig, cst)
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 4, "num_stages": 3})


out = []
for cap in (120, 121):
    for act in (1, 2):
        for name, fn in (("gemm1", k._gemm1_swiglu_kernel), ("gemm2", k._gemm2_combine_kernel)):
            for bm in (16, 64):
                consts = dict(TOP_K=4, E_PAD=128, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, UPCAST=1, DOT_FP32=False,
                              SWAP=bm <= 32, JOIN=False, W_TMA=False, MASK_ALL=False, PANEL_K=256, PDL=True, ACT=act)
                if name == "gemm2":
                    consts.update(SPLIT_K=1, HAS_BIAS=True)
                ptx = compile_gemm(fn, consts, cap).asm["ptx"]
                kinds = sorted(set(re.findall(r"mma\.sync\.aligned\.\S+", ptx)))
                out.append({"cap": cap, "act": act, "gemm": name, "block_m": bm, "mma": kinds})
print(json.dumps(out))
"""


def test_mx_gemms_lower_to_block_scaled_mma_on_sm12x():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == 16
    want = {1: "kind::mxf8f6f4.block_scale", 2: "kind::mxf4nvf4.block_scale"}
    for r in results:
        label = f"sm_{r['cap']} ACT={r['act']} {r['gemm']} block_m={r['block_m']}"
        assert r["mma"], f"{label}: no mma.sync in the PTX"
        assert all(want[r["act"]] in m for m in r["mma"]), f"{label}: {r['mma']}"
        assert not any(".bf16.bf16" in m for m in r["mma"]), f"{label}: decomposed to bf16: {r['mma']}"
