"""The one-kernel all-reduce lowers for the GPUs prepkit targets (sm_90, sm_120, sm_121) without
one, in a fresh process (this one imports triton under the interpreter, which stops
ahead-of-time compiles): volatile reads of its own buffer, the arrival as a release at system
scope, and the wait on the kernel before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CODE = """
import json, re, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from prepkit.kernels.allreduce import _all_reduce_kernel
sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "own_ptr": "*fp32", **{f"b{i}": "*fp32" for i in range(8)},
       "epoch_ptr": "*i32", "count_ptr": "*i32", "rank": "i32", "numel": "i32", "row_stride": "i32",
       "WORLD": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"}
src = ASTSource(_all_reduce_kernel, sig, constexprs={"WORLD": 4, "BLOCK": 1024, "PDL": True})
k = triton.compile(src, target=GPUTarget("cuda", CAP, WARP), options={"num_warps": 4})
ptx = k.asm["ptx"]
print(json.dumps({"target": re.search(r"^\\.target\\s+(\\S+)", ptx, re.M).group(1),
                  "volatile": len(re.findall(r"ld\\.volatile\\.global", ptx)),
                  "atomics": sorted(set(re.findall(r"atom\\.global[.\\w]*", ptx))),
                  "griddep": ptx.count("griddepcontrol.wait")}))
"""


@pytest.mark.parametrize(("cap", "arch"), [(90, "sm_90a"), (120, "sm_120a"), (121, "sm_121a")])
def test_the_all_reduce_compiles(cap: int, arch: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = CODE.replace("CAP", str(cap)).replace("WARP", "32")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["target"] == arch
    assert res["volatile"] > 0 and res["griddep"] == 1
    assert "atom.global.sys.acq_rel.add.u32" in res["atomics"], res
