"""The decode attention kernel compiles for sm_90, sm_120 and sm_121 without a GPU (in a fresh
process: the kernel tests' conftest imports triton under TRITON_INTERPRET, which stops
ahead-of-time compiles in this one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prepkit.kernels.compile_check import attention_candidates

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import sys
from prepkit.kernels import compile_check as cc

by_origin = {c.origin: c for c in cc.attention_candidates()}
cands = [by_origin[origin] for origin in sys.argv[2:]]
print(cc.reports_to_json(cc.compile_attention(sys.argv[1], cands)))
"""


def test_candidates_cover_full_and_sliding_layers_and_the_split_paths() -> None:
    cands = attention_candidates()
    assert {c.window for c in cands} == {None, 128}
    assert {c.variant.split_k for c in cands} >= {1, 16}
    assert len({(c.variant, c.window) for c in cands}) == len(cands)


@pytest.mark.parametrize(("arch", "target"), [("sm90", "sm_90a"), ("sm120", "sm_120a"), ("sm121", "sm_121a")])
def test_attention_lowers_for_each_arch(arch: str, target: str) -> None:
    cands = attention_candidates()
    # The split combine with full attention, one split with a window, and the largest tile.
    picked = [
        next(c for c in cands if c.window is None and c.variant.split_k > 1),
        next(c for c in cands if c.window is not None and c.variant.split_k == 1),
        next(c for c in cands if c.origin.startswith("largest")),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, arch, *(c.origin for c in picked)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    reports = json.loads(r.stdout)
    assert [rep["origin"] for rep in reports] == [c.origin for c in picked]
    for rep in reports:
        assert rep["status"] == "compiled", rep["message"]
        assert rep["stage"] == "attention" and rep["ptx_target"] == target
        assert rep["mma"] in ("mma.sync bf16", "wgmma"), rep  # the score and value products on tensor cores
        assert rep["spill_bytes"] in (0, None), rep
