"""Variants a sweep times at one token count only (GEMM1's K splits next to the decode defaults):
checked like candidates, never timed at the anchors, chosen where they win."""

from __future__ import annotations

import json

import pytest

from prepkit.kernels.device import GB10, H100, RTX_PRO_6000
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import invalid_reason
from prepkit.tactics.keys import canon, gpt_oss_problems
from prepkit.tune import FunctionBackend, SweepConfig, sweep
from prepkit.tune.candidates import (
    SPLIT_SIBLING_MAX_TOKENS,
    gemm1_split_siblings,
    kernel_defaults,
    kernel_space,
)

PROBS = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3")
POINTS = (1, 2, 8, 64, 512)


def tac(bm: int, bn: int = 64, sk: int = 1) -> str:
    return canon({"block_m": bm, "block_n": bn, "num_stages": 3, "split_k": sk})


def split_of(t: str) -> int:
    return int(json.loads(t).get("split_k", 1))


@pytest.mark.parametrize("search", ["pruned", "thorough"])
def test_point_extras_are_timed_at_their_point_only_and_win_there(search: str) -> None:
    default, split2, split4 = tac(16), tac(16, sk=2), tac(16, sk=4)
    cands = [tac(bm, bn) for bm in (16, 32, 64) for bn in (64, 128)]
    extras = {1: [split2, split4], 2: [split2]}

    def timer(t: str, m: int) -> list[float]:
        us = 40.0 if t == split2 and m == 1 else 50.0 + m + (3.0 if t != default else 0.0)
        return [us * (1 + 0.001 * (i - 4)) for i in range(9)]

    backend = FunctionBackend(timer)
    cfg = SweepConfig(points=POINTS, anchors=(1, 512), keep_per_anchor=2, search=search)
    res = sweep(
        PROBS["gemm2"], cands, lambda m: default, [backend], config=cfg, point_extras=lambda m: extras.get(m, [])
    )
    timed = [(t, m) for op, t, m in backend.calls if op in ("time", "screen")]
    checked = [t for op, t, _ in backend.calls if op == "check"]
    assert {split2, split4} <= set(checked)  # checked like any candidate
    assert {m for t, m in timed if t == split4} == {1}
    assert {m for t, m in timed if t == split2} == {1, 2}
    assert {c.m: c.winner for c in res.choices}[1] == split2
    assert {c.m: c.winner for c in res.choices}[2] == default  # kept where no extra beats it


def test_a_point_extra_failing_its_check_is_never_timed() -> None:
    default, bad = tac(16), tac(16, sk=8)
    backend = FunctionBackend(lambda t, m: [30.0] * 9, checker=lambda t: t != bad)
    res = sweep(
        PROBS["gemm2"], [default], lambda m: default, [backend], config=SweepConfig(points=(1, 2)),
        point_extras=lambda m: [bad],
    )  # fmt: skip
    assert not [t for op, t, _ in backend.calls if op == "time" and t == bad]
    assert bad in {t for t, _ in res.blocked}


@pytest.mark.parametrize("device", [H100, RTX_PRO_6000, GB10])
def test_gemm1_siblings_are_the_defaults_other_valid_k_splits_at_decode_counts(device) -> None:
    problem = PROBS["gemm1"]
    siblings = gemm1_split_siblings(problem, device)
    assert siblings is not None
    default_for = kernel_defaults(problem, device)
    space = set(kernel_space(problem, device))
    for m in (1, 2, 4, SPLIT_SIBLING_MAX_TOKENS):
        d = json.loads(default_for(m))
        sib = siblings(m)
        assert sib, m
        assert split_of(default_for(m)) not in {split_of(t) for t in sib}
        for t in sib:
            e = json.loads(t)
            assert {k for k in d.keys() | e.keys() if d.get(k) != e.get(k)} <= {"split_k"}
            assert invalid_reason(GemmTactic.from_json(t), "gemm1", device, "bf16") is None
            assert split_of(t) == 1 or t not in space  # the swept space holds no GEMM1 split
    assert siblings(SPLIT_SIBLING_MAX_TOKENS + 1) == []


def test_only_a_bf16_gemm1_has_split_siblings() -> None:
    assert gemm1_split_siblings(PROBS["gemm2"], H100) is None
    mx = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3", act_dtype="mxfp8")
    assert gemm1_split_siblings(mx["gemm1"], H100) is None
