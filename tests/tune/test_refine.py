"""The pruned search's local refinement: moves, rounds, anchors, resume, and what it never does."""

from __future__ import annotations

import json

import pytest

from prepkit.kernels.device import H100
from prepkit.tactics.keys import canon, gpt_oss_problems
from prepkit.tune import FunctionBackend, SweepConfig, sweep
from prepkit.tune.candidates import kernel_candidates, kernel_defaults, neighbourhood, rule_space

PROB = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3")["gemm2"]
ANCHORS = (1, 8, 64)
CONFIG = SweepConfig(points=ANCHORS, anchors=ANCHORS, keep_per_anchor=2)


def knob(t: str, **changes: object) -> str:
    return canon({**json.loads(t), **changes})


def test_a_move_turns_one_knob_or_reshapes_the_weight_tile() -> None:
    space = rule_space(PROB, H100)
    near = neighbourhood(space)
    t = next(x for x in space if json.loads(x)["block_n"] == 128 and json.loads(x)["block_k"] == 128)
    moves = near(t)
    assert moves and t not in moves and set(moves) <= set(space)
    d = json.loads(t)
    for n in moves:
        e = json.loads(n)
        changed = {k for k in d.keys() | e.keys() if d.get(k) != e.get(k)}
        if len(changed) == 2:  # the only two-knob move: the same tile area in another aspect
            assert changed == {"block_n", "block_k"} and e["block_n"] * e["block_k"] == 128 * 128
        else:
            assert len(changed) == 1
    assert knob(t, block_n=256, block_k=64) in moves or knob(t, block_n=64, block_k=256) in moves
    two_knobs = knob(t, num_stages=d["num_stages"] % 4 + 1, split_k=d["split_k"] * 2)
    assert two_knobs not in moves


class Landscape:
    """Every variant at 100 µs, with a few faster ones; records what was checked and timed."""

    def __init__(self, fast: dict[tuple[str, int], float]) -> None:
        self.fast = fast

    def backend(self) -> FunctionBackend:
        return FunctionBackend(lambda t, m: [self.fast.get((t, m), 100.0)] * 9)


def _seed_and_outside() -> tuple[list[str], str, str, str]:
    """The pruned candidates, one of them (``seed``), its neighbour outside the candidates
    (``step1``) and a neighbour of that one that is no neighbour of any candidate (``step2``)."""
    cands = kernel_candidates(PROB, H100, max_count=24, points=ANCHORS)
    near = neighbourhood(rule_space(PROB, H100))
    reachable = {n for c in cands for n in near(c)} | set(cands)
    for seed in cands:
        for step1 in near(seed):
            if step1 in cands:
                continue
            for step2 in near(step1):
                if step2 not in reachable:
                    return cands, seed, step1, step2
    raise AssertionError("no two-step path out of the candidates")


def _winners(res) -> dict[int, str]:  # type: ignore[no-untyped-def]
    return {c.m: c.winner or c.default for c in res.choices}


def test_refinement_walks_from_the_best_candidate_to_a_faster_variant_beyond_the_pruned_set() -> None:
    cands, seed, step1, step2 = _seed_and_outside()
    land = Landscape({(seed, 8): 90.0, (step1, 8): 80.0, (step2, 8): 70.0})
    defaults = kernel_defaults(PROB, H100)
    near = neighbourhood(rule_space(PROB, H100))

    plain = sweep(PROB, cands, defaults, [land.backend()], config=CONFIG)
    assert _winners(plain)[8] == seed  # the pruned set alone stops at the seed

    one_round = SweepConfig(**{**CONFIG.__dict__, "refine_rounds": 1})
    one = sweep(PROB, cands, defaults, [b := land.backend()], config=one_round, neighbours=near)
    assert _winners(one)[8] == step1  # one round: one move
    assert ("check", step1, None) in b.calls and ("check", step2, None) not in b.calls

    two = sweep(PROB, cands, defaults, [b := land.backend()], config=CONFIG, neighbours=near)
    assert _winners(two)[8] == step2  # the second round moves on from the first round's best
    assert ("time", step2, 8) in b.calls
    assert all(_winners(two)[m] == defaults(m) for m in (1, 64))


def test_refinement_stops_when_the_best_few_stay_the_same() -> None:
    """Three candidates lead at every anchor and no neighbour beats them: one round looks around
    them, and the next finds the same best three and stops."""
    cands, *_ = _seed_and_outside()
    near = neighbourhood(rule_space(PROB, H100))
    leaders = cands[:3]
    b = Landscape({(t, m): 50.0 + i for i, t in enumerate(leaders) for m in ANCHORS}).backend()
    five_rounds = SweepConfig(**{**CONFIG.__dict__, "refine_rounds": 5})
    sweep(PROB, cands, kernel_defaults(PROB, H100), [b], config=five_rounds, neighbours=near)
    checked = {c for o, c, _ in b.calls if o == "check"}
    around = {n for t in leaders for n in near(t)}
    assert checked - set(cands) == around - set(cands)  # one round, around the leaders only
    timed_new = {(c, m) for o, c, m in b.calls if o == "time" and c not in cands}
    assert timed_new == {(c, m) for c in around - set(cands) for m in ANCHORS}  # at every anchor


def test_refinement_skips_blocked_neighbours_and_takes_over_stored_timings() -> None:
    cands, seed, step1, step2 = _seed_and_outside()
    land = Landscape({(seed, 8): 90.0, (step1, 8): 80.0, (step2, 8): 70.0})
    near = neighbourhood(rule_space(PROB, H100))
    defaults = kernel_defaults(PROB, H100)

    blocked = sweep(PROB, cands, defaults, [b := land.backend()], config=CONFIG, neighbours=near, blocked=[step1])
    assert _winners(blocked)[8] == seed and all(c != step1 for _, c, _ in b.calls)

    stored = {"status": "ok", "median_us": 80.0, "p10_us": 80.0, "p90_us": 80.0, "mean_us": 80.0, "n_samples": 9}
    passed = {"passed": 1, "m_values": "[1, 7, 33, 256]"}
    resumed = sweep(
        PROB, cands, defaults, [b := land.backend()], config=CONFIG, neighbours=near,
        previous_measurements={(8, step1): stored}, previous_checks={step1: passed},
    )  # fmt: skip
    assert _winners(resumed)[8] == step2
    assert ("time", step1, 8) not in b.calls and ("check", step1, None) not in b.calls


# ------------------------------------------------------------------------------ the replay


def test_a_replay_on_a_timing_map_shows_what_the_refinement_finds() -> None:
    from benchmarks.search_replay import UNMAPPED_US, replay, timing_map

    cands, seed, step1, step2 = _seed_and_outside()
    space = rule_space(PROB, H100)
    rows = {(m, t): {"status": "ok", "median_us": 100.0} for m in ANCHORS for t in space}
    rows[(8, seed)] = {"status": "ok", "median_us": 90.0}
    rows[(8, step1)] = {"status": "ok", "median_us": 80.0}
    rows[(8, step2)] = {"status": "ok", "median_us": 50.0}
    rows[(64, step2)] = {"status": "launch_error", "median_us": None}  # no timing: not on the map
    us = timing_map(rows)
    assert (64, step2) not in us and us[(8, step2)] == 50.0

    plain = replay(PROB, H100, us, ANCHORS, refine=False, max_candidates=24, keep=2)
    refined = replay(PROB, H100, us, ANCHORS, max_candidates=24, keep=2)
    assert plain.best[8] == refined.best[8] == step2  # the map's choice
    assert plain.picks[8] == seed and plain.miss(8) == pytest.approx(90 / 50 - 1)
    assert refined.picks[8] == step2 and refined.miss(8) == 0
    assert plain.checks == len(cands) < refined.checks and plain.timings < refined.timings
    assert refined.unmapped == plain.unmapped == 1  # step2 lacks 64 tokens
    assert UNMAPPED_US > 1e6
