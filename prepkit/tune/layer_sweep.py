"""Sweeping a whole layer: both GEMM problems of the MoE layer (and the dense ones) one after
another under one budget, then the layer's latency with the default and the tuned pairs."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from prepkit.tactics.keys import ProblemKey, canon
from prepkit.tune.backend import Backend
from prepkit.tune.records import (
    Batch,
    CandidateError,
    LayerPoint,
    LayerReport,
    SweepResult,
    Timing,
)
from prepkit.tune.sweep import sweep
from prepkit.tune.sweep_config import PreviousRecords, ProgressFn, SweepConfig
from prepkit.tune.winners import timed_at_every


def tune_layer(
    problems: Sequence[ProblemKey],
    backends: Sequence[Backend],
    *,
    candidates_for: Callable[[ProblemKey], list[str]],
    default_for: Callable[[ProblemKey], Callable[[int], str]],
    config: SweepConfig,
    previous: Callable[[ProblemKey], PreviousRecords] | None = None,
    on_batch: Callable[[ProblemKey, Batch], None] | None = None,
    on_result: Callable[[SweepResult], object] | None = None,
    on_progress: ProgressFn | None = None,
    compare_layer: bool = True,
    clock: Callable[[], float] = time.monotonic,
    check_backends: Sequence[Backend] | None = None,
    valid_for: Callable[[ProblemKey], int] | None = None,
    label_for: Callable[[ProblemKey], str | None] | None = None,
    neighbours_for: Callable[[ProblemKey], Callable[[str], Sequence[str]] | None] | None = None,
    point_extras_for: Callable[[ProblemKey], Callable[[int], Sequence[str]] | None] | None = None,
) -> LayerReport:
    """Sweep each GEMM of a layer in turn (the other GEMM at its default), splitting the time
    budget over what is left; then, where the backend can, time the whole layer with the default
    pair and with the tuned pair at every point (the number users feel). ``valid_for``: the size
    of each problem's variant space, for the coverage; ``label_for``: what progress calls each;
    ``point_extras_for``: each problem's variants timed at one point only (:func:`.sweep.sweep`)."""
    start = clock()
    results: list[SweepResult] = []
    # A thorough search shares the budget by the work each GEMM has left (a resumed run gives its
    # time to the GEMM that needs it); the pruned one shares it equally. What a GEMM leaves over
    # goes to the next, so the first one's share errs large.
    work = [work_left(p, candidates_for, previous, config) if config.thorough else 1 for p in problems]
    for i, problem in enumerate(problems):
        budget = None
        if config.budget_s is not None:
            left = config.budget_s - (clock() - start)
            # Keep a slice for the whole-layer comparison at the end.
            budget = max(0.0, left * (0.95 if compare_layer else 1.0) * work[i] / sum(work[i:]))
        prev_m, prev_c, blocked = previous(problem) if previous else ({}, {}, set())
        res = sweep(
            problem, candidates_for(problem), default_for(problem), backends,
            config=SweepConfig(**{**config.__dict__, "budget_s": budget}),
            previous_measurements=prev_m, previous_checks=prev_c, blocked=blocked,
            on_batch=functools.partial(on_batch, problem) if on_batch else None,
            on_progress=on_progress, clock=clock, check_backends=check_backends,
            n_valid=valid_for(problem) if valid_for else None, label=label_for(problem) if label_for else None,
            neighbours=neighbours_for(problem) if neighbours_for else None,
            point_extras=point_extras_for(problem) if point_extras_for else None,
        )  # fmt: skip
        results.append(res)
        if on_result:
            on_result(res)
    points = _layer_points(results, getattr(backends[0], "time_layer", None)) if compare_layer else []
    return LayerReport(results, points, clock() - start)


def work_left(
    problem: ProblemKey,
    candidates_for: Callable[[ProblemKey], list[str]],
    previous: Callable[[ProblemKey], PreviousRecords] | None,
    config: SweepConfig,
) -> int:
    """The work a thorough sweep of ``problem`` has left: the candidates it has yet to screen at
    every anchor (at least 1: the final phase is work too), each weighted by the GEMM's N x K, as
    a screen's time grows with it. By the variants alone, gpt-oss-120b's GEMM1 (3,384 variants,
    N = 5760) got 20 % of an H200 run's budget and needed 28 %."""
    measured, _, blocked = previous(problem) if previous else ({}, {}, set())
    timed = {(int(m), canon(t)) for (m, t) in measured}
    done = {canon(t) for t in blocked}
    cands = [canon(t) for t in candidates_for(problem)]
    left = sum(t not in done and not timed_at_every(t, config.anchors, timed) for t in cands)
    return max(1, left) * problem.n * problem.k


def _layer_points(results: Sequence[SweepResult], timer: Callable[..., Timing] | None) -> list[LayerPoint]:
    """Whole-layer latency with the default pair and with the tuned pair at every point."""
    by_role = {r.problem.role: r for r in results}
    if timer is None or not {"gemm1", "gemm2"} <= set(by_role):
        return []
    g1, g2 = by_role["gemm1"], by_role["gemm2"]
    c1 = {c.m: c for c in g1.choices}
    c2 = {c.m: c for c in g2.choices}
    points: list[LayerPoint] = []
    for m in g1.points:
        if m not in c2:
            continue
        default_pair = (c1[m].default, c2[m].default)
        tuned_pair = (c1[m].winner or c1[m].default, c2[m].winner or c2[m].default)
        d: float | None
        t: float | None
        try:
            d = timer(g1.problem, default_pair, m).median_us
            t = d if tuned_pair == default_pair else timer(g1.problem, tuned_pair, m).median_us
        except CandidateError:
            d = t = None
        points.append(LayerPoint(m, d, t))
    return points
