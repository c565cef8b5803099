"""Sweep a kernel's variants for one GEMM problem: check numerics, time, pick a winner per token range.

The sweep returns records and never writes a DB: the caller stores each batch as it arrives
(``on_batch``, called on the caller's thread), so a killed tune keeps every finished point.
Measuring is delegated to :class:`~prepkit.tune.backend.Backend` objects.

Procedure (docs/tuning.md says why):

1. numerics: every candidate not checked before in this environment is compared with the
   reference; a failure goes to the blocklist and never reaches timing;
2. anchors: with more candidates than ``keep_per_anchor``, all are timed at a few anchor token
   counts and the best ``keep_per_anchor`` of each anchor survive;
   then (``neighbours`` given) the variants one move away from each anchor's best
   ``refine_seeds`` are checked and timed at that anchor, for up to ``refine_rounds`` rounds
   while those best few change (:func:`prepkit.tune.candidates.neighbourhood`);
3. every token point: the survivors and that point's default are timed in the same run, with
   the point's own extras (``point_extras``: GEMM1's K splits next to a decode default), which
   are checked with the candidates but timed at their point only;
4. per point, the candidates within ``retime.margin`` of the best are timed again in
   ``retime.rounds`` rounds, the order rotated each round (:mod:`prepkit.tune.retime`), and
   their medians over the rounds replace the one-shot timings (a point with a close call read
   back from the DB is left as it was: a rerun never times a stored pair again);
5. per point the default is kept unless a candidate is faster by more than ``min_gain`` *and* its
   p90 is below the default's p10 (beyond noise); equal adjacent winners merge into one
   ``[m_lo, m_hi]`` range (ceil semantics); the last range extends upward only when the sweep
   reached the top of the series.

A rerun passes what the DB already holds (``previous_*``) and only the missing pairs are measured.

A thorough search (``SweepConfig.search == "thorough"``, :mod:`prepkit.tune.thorough`) runs the
same steps on every valid variant. Its anchor phase screens (:class:`~prepkit.tune.records.Screen`)
a few variants at every anchor per job, the defaults first and only once every check is done, so
a killed run keeps each finished group; only the survivors' full timings choose a winner.

By concern: :mod:`.sweep_config` (the knobs), :mod:`.sweep_state` (a running sweep),
:mod:`.winners` (choosing per point, merging into ranges) and :mod:`.layer_sweep` (a whole layer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prepkit.tactics.keys import JsonTactic, ProblemKey, canon
from prepkit.tune.backend import Backend
from prepkit.tune.records import (
    Batch,
    Coverage,
    SweepResult,
)
from prepkit.tune.sweep_config import PreviousRecords, ProgressFn, SweepConfig
from prepkit.tune.sweep_state import Pool, SweepRun, unblocked
from prepkit.tune.winners import choose, measured_ok, ranges_from_choices

__all__ = ["PreviousRecords", "ProgressFn", "SweepConfig", "choose", "ranges_from_choices", "sweep"]


def sweep(
    problem: ProblemKey,
    candidates: Iterable[str | JsonTactic],
    default_for: Callable[[int], str | JsonTactic],
    backends: Sequence[Backend],
    *,
    config: SweepConfig | None = None,
    previous_measurements: Mapping[tuple[int, str], Mapping[str, Any]] | None = None,
    previous_checks: Mapping[str, Mapping[str, Any]] | None = None,
    blocked: Iterable[str] = (),
    on_batch: Callable[[Batch], None] | None = None,
    on_progress: ProgressFn | None = None,
    extends_up_ok: Callable[[str], bool] = lambda tactic: True,
    clock: Callable[[], float] = time.monotonic,
    check_backends: Sequence[Backend] | None = None,
    n_valid: int | None = None,
    label: str | None = None,
    neighbours: Callable[[str], Sequence[str]] | None = None,
    point_extras: Callable[[int], Sequence[str | JsonTactic]] | None = None,
) -> SweepResult:
    """Run the procedure in the module docstring. Returns every record it made or reused.

    ``previous_measurements`` maps ``(m, tactic_json)`` to a DB row (``status``, ``median_us``,
    ``p10_us``, ``p90_us``, ``mean_us``, ``n_samples``); ``previous_checks`` maps tactic JSON to a
    correctness row (``passed``, errors...). ``blocked`` tactics are neither checked nor timed.
    With several backends (GPUs), whole token points run in parallel, one backend each, so the
    candidates of one point are always compared on one device. ``check_backends`` (default: the
    timing backends) run the numerics phase: extra workers on one GPU compile candidates in
    parallel and fill Triton's cache before timing starts; a thorough search closes them when the
    phase ends (each holds a layer on the GPU; a backend starts again on its next request).
    ``n_valid``: the size of the variant space the candidates came from, for the coverage.
    ``label``: what progress and the result call the problem (default: its role and shape).
    ``neighbours``: ``tactic -> variants one move away``; the pruned search refines its anchors
    with it (none: no refinement). ``point_extras``: ``m -> variants`` checked like candidates but
    timed at that point only, next to its default (never at the anchors).
    """
    cfg = config or SweepConfig()
    points = tuple(sorted(set(cfg.points)))
    if not points or points[0] < 1:
        raise ValueError(f"token points must be positive, got {cfg.points}")
    start = clock()
    defaults = {m: canon(default_for(m)) for m in points}
    blocked_set = {canon(t) for t in blocked}
    order: dict[str, None] = {}
    for t in [*(canon(c) for c in candidates), *defaults.values()]:
        order.setdefault(t, None)
    notes = [
        f"default {t} is blocklisted here; the points it would serve use the best candidate"
        for t in sorted(set(defaults.values()) & blocked_set)
    ]
    cands = [t for t in order if t not in blocked_set]
    swept = list(order)  # what the coverage counts: the point extras are outside the space
    listed = point_extras or (lambda m: ())
    extras = {m: [t for t in map(canon, listed(m)) if t not in blocked_set] for m in points}
    extra_only = [t for t in dict.fromkeys(t for ts in extras.values() for t in ts) if t not in order]
    order.update(dict.fromkeys(extra_only))

    st = SweepRun(problem, defaults, cfg, clock, on_batch or (lambda b: None), on_progress or (lambda *a: None), label)
    n_reused = st.reuse(order, previous_measurements or {}, previous_checks or {})

    anchors: tuple[int, ...] = ()
    pool = Pool(backends)
    try:
        cpool = Pool(check_backends) if check_backends else pool
        try:
            if cfg.thorough:  # 1-2. numerics, then anchor screens of every candidate
                anchors = st.anchors(points)
                keep = st.check_and_screen(cpool, pool, cands, anchors)
            else:  # 1. numerics, before any timing
                to_check = [t for t in (*cands, *extra_only) if t not in st.checks]
                st.estimate = len(to_check) + len(points) * min(len(cands), cfg.keep_per_anchor + 1)
                st.check_all(cpool, to_check)
                # 2. anchors: prune a large candidate set on a few token counts, then refine
                passed = [t for t in cands if st.passed(t)]
                if len(passed) <= cfg.keep_per_anchor:
                    keep = passed
                else:
                    anchors = st.anchors(points)
                    keep = st.anchor_survivors(pool, passed, points)
                    if neighbours is not None and cfg.refine_rounds > 0:
                        near = unblocked(neighbours, blocked_set)
                        previous = (previous_measurements or {}, previous_checks or {}, blocked_set)
                        keep = st.refine(cpool, pool, passed, anchors, near, previous)
            if cfg.thorough:  # the point extras are checked after the candidates' screens
                st.check_all(cpool, [t for t in extra_only if t not in st.checks])
        finally:
            if cpool is not pool:
                cpool.shutdown()
                if cfg.thorough:
                    for b in check_backends or ():
                        b.close()

        # 3. every point: the survivors, that point's default and extras, in the same run
        def for_point(m: int) -> list[str]:
            own = dict.fromkeys([defaults[m], *extras[m]])  # the default first: its timing anchors the comparison
            return [t for t in own if st.passed(t) and t not in keep] + keep

        point_label = None
        if cfg.thorough:  # progress: the pairs left to time
            point_label, st.done = f"{st.label}: every point", 0
            st.estimate = sum(not st.fully_timed(m, t) and t not in st.failed for m in points for t in for_point(m))
        st.time_points(pool, points, for_point, "point", point_label)
        # 4. close calls at each point, timed again in rotated rounds before any choice
        st.retime_points(pool, points)
    finally:
        pool.shutdown()

    passed_set = {t for t, c in st.checks.items() if c.result.passed}
    choices = [
        choose(
            m, defaults[m], {t: x for (mm, t), x in st.measurements.items() if mm == m},
            passed=passed_set, failed=set(st.failed), min_gain=cfg.min_gain, disjoint=cfg.disjoint,
            retimed=cfg.retime.rounds if m in st.retimed else 0,
        )
        for m in points
    ]  # fmt: skip
    complete = not st.incomplete
    winners = ranges_from_choices(
        points, choices, extends_up=complete and points[-1] >= cfg.extend_up_from, extends_up_ok=extends_up_ok
    )
    coverage = Coverage(
        search=cfg.search, activations=problem.act_dtype, valid=n_valid, candidates=len(swept),
        checked=sum(t in st.checks for t in swept), failed=sum(t in st.failed or t in blocked_set for t in swept),
        measured=len({t for (_, t), x in st.measurements.items() if measured_ok(x) and t not in extra_only}),
        anchors=anchors,
    )  # fmt: skip
    return SweepResult(
        problem=problem, points=points, choices=choices, winners=winners,
        measurements=list(st.measurements.values()), correctness=list(st.checks.values()),
        blocked=st.new_blocked, complete=complete, elapsed_s=clock() - start, n_timed=st.n_timed,
        n_retimed=st.n_retimed,
        n_reused=n_reused, notes=notes, coverage=coverage, label=label or "",
    )  # fmt: skip
