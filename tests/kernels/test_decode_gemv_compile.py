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
from prepkit.kernels.decode.variants import DecodeVariant

# gpt-oss's projection shapes of the decode step: (N, K).
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "router": (128, 2880), "lm_head": (201088, 2880)}


def test_decode_candidates_are_each_ops_distinct_defaults() -> None:
    cands = cc.decode_candidates(SHAPES)
    keys = [(c.op, c.fmt, c.batch, c.variant) for c in cands]
    assert len(keys) == len(set(keys))
    assert {c.op for c in cands} == {"norm_linear", "linear_residual", "linear"}
    assert {c.fmt for c in cands} == {"bf16", "mxfp8", "mxfp4"}
    assert {c.batch for c in cands} == {1, 8}
    # The router's few rows take K splits; the big projections do not.
    assert any(c.variant.split_k > 1 and "router" in c.origin for c in cands)
    for c in cands:
        assert (
            c.origin.startswith(f"default {c.op} {c.fmt} ") and DecodeVariant.parse(c.origin.split()[-1]) == c.variant
        )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm90", "sm120", "sm121"])
def test_decode_projections_compile(arch: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json\n"
        "from prepkit.kernels import compile_check as cc\n"
        "cands = cc.decode_candidates({'qkv': (5120, 2880), 'router': (128, 2880)}, batches=(1, 8))\n"
        f"r = cc.compile_decode({arch!r}, cands)\n"
        "print(json.dumps({'reports': [x.to_dict() for x in r], 'failures': cc.check_failures(r)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1500)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["failures"] == []
    reports = res["reports"]
    assert {r["origin"].split()[1] for r in reports} == {"norm_linear", "linear_residual", "linear"}
    for r in reports:
        assert r["status"] == "compiled" and r["kernel"] == "_gemv_kernel", r
        assert r["spill_bytes"] == 0, r
        assert r["ptx_target"] == arch.replace("sm", "sm_") + "a"
