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
3. every token point: the survivors and that point's default are timed in the same run;
4. per point the default is kept unless a candidate is faster by more than ``min_gain`` *and* its
   p90 is below the default's p10 (beyond noise); equal adjacent winners merge into one
   ``[m_lo, m_hi]`` range (ceil semantics); the last range extends upward only when the sweep
   reached the top of the series.

A rerun passes what the DB already holds (``previous_*``) and only the missing pairs are measured.

A thorough search (``SweepConfig.search == "thorough"``, :mod:`prepkit.tune.thorough`) runs the
same steps on every valid variant. Its anchor phase screens (:class:`~prepkit.tune.records.Screen`)
a few variants at every anchor per job, the defaults first and only once every check is done, so
a killed run keeps each finished group; only the survivors' full timings choose a winner.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from prepkit.tactics.keys import JsonTactic, ProblemKey, canon
from prepkit.tactics.lookup import MAX_TOKEN_POINT, TOKEN_POINTS, merge_points
from prepkit.tactics.schema import SCREEN_KIND, SEARCHES
from prepkit.tune.backend import Backend
from prepkit.tune.records import (
    OK,
    OUT_OF_MEMORY,
    Batch,
    CandidateError,
    CheckResult,
    Correctness,
    Coverage,
    LayerPoint,
    LayerReport,
    Measurement,
    PointChoice,
    Screen,
    SweepResult,
    Timing,
    WinnerRange,
    geomean,
)

ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class SweepConfig:
    points: tuple[int, ...] = TOKEN_POINTS
    # Where the kernel's tile regimes change for gpt-oss (rows per expert = M*top_k/E).
    anchors: tuple[int, ...] = (1, 4, 16, 128, 1024, 4096)
    keep_per_anchor: int = 6
    min_gain: float = 0.03  # a challenger must beat the default by more than this fraction...
    disjoint: bool = True  # ...and its p90 must lie below the default's p10
    budget_s: float | None = None
    extend_up_from: int = MAX_TOKEN_POINT  # last range extends upward if the sweep reached this
    search: str = "pruned"  # or "thorough": every candidate at the anchors, in small stored groups
    anchor_group: int = 8  # variants per job of a thorough anchor phase (stored together)
    # The pruned search's local refinement: the variants one move away from each anchor's best
    # few, timed at that anchor, for a few rounds while those best few change (docs/tuning.md).
    refine_seeds: int = 3
    refine_rounds: int = 2

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ValueError(f"unknown search {self.search!r} (expected one of {SEARCHES})")

    @property
    def thorough(self) -> bool:
        return self.search == "thorough"


T = TypeVar("T")
# What the DB already holds for a problem: measurement rows by (m, tactic JSON), correctness rows by
# tactic JSON, and the blocklisted tactics.
PreviousRecords = tuple[Mapping[tuple[int, str], Mapping[str, Any]], Mapping[str, Mapping[str, Any]], set[str]]


class _Pool:
    """One thread per backend; each job borrows a free backend for its whole run."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        if not backends:
            raise ValueError("at least one backend is needed")
        self.free: queue.Queue[Backend] = queue.Queue()
        for b in backends:
            self.free.put(b)
        self.ex = ThreadPoolExecutor(max_workers=len(backends), thread_name_prefix="tune")

    def submit(self, fn: Callable[[Backend], T]) -> Future[T]:
        def run() -> T:
            b = self.free.get()
            try:
                return fn(b)
            finally:
                self.free.put(b)

        return self.ex.submit(run)

    def shutdown(self) -> None:
        self.ex.shutdown(wait=True, cancel_futures=True)


def _completed(futs: Sequence[Future[T]]) -> Iterable[Future[T]]:
    """Futures in completion order (results are consumed on the caller's thread)."""
    pending = set(futs)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        yield from sorted(done, key=futs.index)


class _Sweep:
    """The state of one sweep. Jobs run on backend threads and touch the state under ``lock``;
    batches are emitted and progress reported on the caller's thread."""

    def __init__(
        self,
        problem: ProblemKey,
        defaults: dict[int, str],
        cfg: SweepConfig,
        clock: Callable[[], float],
        emit: Callable[[Batch], None],
        progress: ProgressFn,
        label: str | None = None,
    ) -> None:
        self.problem = problem
        self.defaults = defaults
        self.cfg = cfg
        self.clock = clock
        self.deadline = None if cfg.budget_s is None else clock() + cfg.budget_s
        self.emit = emit
        self.progress = progress
        self.label = label or f"{problem.role} N={problem.n} K={problem.k}"
        self.measurements: dict[tuple[int, str], Measurement] = {}
        self.fastest: dict[int, float] = {}  # the fastest median timed at each token count
        self.checks: dict[str, Correctness] = {}
        self.failed: dict[str, str] = {}
        self.new_blocked: list[tuple[str, str]] = []
        self.n_timed = 0
        self.incomplete = False
        self.done = 0
        self.estimate = 0  # progress total, refined as the phases learn how much is left
        self.lock = threading.Lock()

    def reuse(
        self,
        order: Mapping[str, None],
        measurements: Mapping[tuple[int, str], Mapping[str, Any]],
        checks: Mapping[str, Mapping[str, Any]],
    ) -> int:
        """Take over what an earlier run stored; returns how many measurements were reused."""
        for (m, t), row in measurements.items():
            tc = canon(t)
            if int(m) in self.defaults and tc in order:
                self.record(_measurement_from_row(int(m), tc, row, self.defaults[int(m)] == tc))
        for t, row in checks.items():
            tc = canon(t)
            if tc in order:
                self.checks[tc] = Correctness(tc, _check_from_row(row), reused=True)
                if not self.checks[tc].result.passed:
                    self.failed.setdefault(tc, _reason(self.checks[tc].result))
        for (_m, t), meas in self.measurements.items():
            if meas.status != OK:
                self.failed.setdefault(t, f"{meas.status}: {meas.error or ''}")
        return len(self.measurements)

    def over_budget(self) -> bool:
        return self.deadline is not None and self.clock() > self.deadline

    def passed(self, t: str) -> bool:
        return t in self.checks and self.checks[t].result.passed

    # -- jobs (backend threads) ------------------------------------------------------------

    def check_job(self, b: Backend, t: str) -> Batch:
        out = Batch("check")
        if self.over_budget():
            self.incomplete = True
            return out
        res = _safe_check(b, self.problem, t)
        if res.status == OUT_OF_MEMORY:
            self.incomplete = True  # not the variant's fault: checked again by the next run
            return out
        c = Correctness(t, res)
        out.correctness.append(c)
        with self.lock:
            self.checks[t] = c
            if not res.passed and t not in self.failed:
                self.failed[t] = _reason(res)
                out.blocked.append((t, self.failed[t]))
        return out

    def point_job(self, b: Backend, m: int, tactics: Sequence[str], phase: str, screen: bool = False) -> Batch:
        """Time ``tactics`` at ``m``: fully, or with a quick :class:`Screen` cut against the best
        timing at ``m`` so far. A pair timed before is skipped, but a screen is no full timing."""
        out = Batch(phase, m)
        for t in tactics:
            with self.lock:
                timed = (m, t) in self.measurements if screen else self.fully_timed(m, t)
                if t in self.failed or timed:
                    continue
                cutoff = self.fastest.get(m) if screen else None
            if self.over_budget():
                self.incomplete = True
                break
            meas = _safe_time(b, self.problem, t, m, Screen(cutoff) if screen else None)
            if meas.status == OUT_OF_MEMORY:  # other workers hold the memory: timed again by the next run
                self.incomplete = True
                break
            meas.is_default = self.defaults[m] == t
            out.measurements.append(meas)
            with self.lock:
                self.record(meas)
                self.n_timed += 1
                if meas.status != OK and t not in self.failed:
                    self.failed[t] = f"{meas.status} at M={m}: {meas.error or ''}".strip()
                    out.blocked.append((t, self.failed[t]))
        return out

    # -- phases (caller's thread) ----------------------------------------------------------

    def check_all(self, pool: _Pool, to_check: Sequence[str], label: str | None = None) -> None:
        for fut in _completed([pool.submit(functools.partial(self.check_job, t=t)) for t in to_check]):
            batch = fut.result()
            if not batch.correctness:
                continue  # skipped (budget spent, or no GPU memory): not checked, not counted
            self.done += 1
            self.progress(label or self.label, self.done, self.estimate)
            if batch.correctness:  # stored at once: a killed tune keeps every finished check
                self.emit(batch)
                self.new_blocked += batch.blocked

    def time_points(
        self,
        pool: _Pool,
        ms: Sequence[int],
        tactics_for: Callable[[int], list[str]],
        phase: str,
        label: str | None = None,
    ) -> None:
        def job(m: int) -> Callable[[Backend], Batch]:
            return lambda b: self.point_job(b, m, tactics_for(m), phase)

        futs = [pool.submit(job(m)) for m in ms]
        for fut in _completed(futs):
            batch = fut.result()
            self.done += len(batch.measurements)
            if label is None or self.done:  # a thorough sweep with every pair timed already says nothing
                self.progress(label or self.label, self.done, max(self.estimate, self.done))
            if batch.measurements:
                self.emit(batch)
                self.new_blocked += batch.blocked

    def fully_timed(self, m: int, t: str) -> bool:
        had = self.measurements.get((m, t))
        return had is not None and not had.screen

    def record(self, meas: Measurement) -> None:
        """Keep ``meas`` as the timing of its pair (call under ``lock``)."""
        self.measurements[(meas.m, meas.tactic)] = meas
        if _ok(meas):
            us = _median_us(meas)
            self.fastest[meas.m] = min(us, self.fastest.get(meas.m, us))

    def anchors(self, points: tuple[int, ...]) -> tuple[int, ...]:
        """The anchors among the token points; the first and last point where none is."""
        return tuple(a for a in self.cfg.anchors if a in self.defaults) or tuple(sorted({points[0], points[-1]}))

    def anchor_survivors(self, pool: _Pool, passed: list[str], points: tuple[int, ...]) -> list[str]:
        """Time every passed candidate at the anchors; keep the best few of each anchor."""
        cfg = self.cfg
        anchors = self.anchors(points)
        self.estimate = self.done + len(anchors) * len(passed) + len(points) * (cfg.keep_per_anchor + 1)
        self.time_points(pool, anchors, lambda m: list(passed), "anchor")
        return self.survivors(passed, anchors)

    def survivors(self, passed: Sequence[str], anchors: Sequence[int]) -> list[str]:
        """The best ``keep_per_anchor`` timed candidates of each anchor, in ``passed`` order."""
        cfg = self.cfg
        kept: dict[str, None] = {}
        for m in anchors:
            ok = [t for t in passed if _ok(self.measurements.get((m, t)))]
            medians = {t: _median_us(self.measurements[(m, t)]) for t in ok}
            ok.sort(key=medians.__getitem__)
            for t in ok[: cfg.keep_per_anchor]:
                kept.setdefault(t, None)
        return [t for t in passed if t in kept]

    def refine(
        self,
        cpool: _Pool,
        pool: _Pool,
        timed: list[str],
        anchors: Sequence[int],
        neighbours: Callable[[str], Sequence[str]],
        previous: PreviousRecords,
    ) -> list[str]:
        """Local search around each anchor's best ``refine_seeds`` (ties by tactic, so the seeds
        depend on the timings alone): their neighbours not taken up yet are checked, then timed at
        every anchor, as the candidates were; a round repeats, up to ``refine_rounds``, while the
        seeds of some anchor changed. A variant an earlier run timed at every anchor (and that
        passed) counts as taken up, so a rerun of a finished search times nothing new. Returns
        the survivors of everything timed."""
        earlier = self._timed_before(previous, anchors, set(timed))
        self.reuse(dict.fromkeys(earlier), previous[0], previous[1])
        timed = list(timed) + [t for t in earlier if self.passed(t)]
        tried = set(timed)
        seeds: dict[int, list[str]] = {}
        for _ in range(self.cfg.refine_rounds):
            best = {m: self._best_at(m, timed) for m in anchors}
            if best == seeds or self.over_budget():
                break
            seeds = best
            new = [
                n for n in dict.fromkeys(n for m in anchors for t in seeds[m] for n in neighbours(t)) if n not in tried
            ]
            tried.update(new)
            self.reuse(dict.fromkeys(new), previous[0], previous[1])
            to_check = [t for t in new if t not in self.checks and t not in self.failed]
            self.estimate += len(to_check) + len(new) * len(anchors)
            self.check_all(cpool, to_check)
            ready = [t for t in new if self.passed(t)]
            self.time_points(pool, anchors, lambda m: ready, "anchor")  # noqa: B023 (called before the loop moves on)
            timed += ready
        return self.survivors(timed, anchors)

    def _best_at(self, m: int, timed: Sequence[str]) -> list[str]:
        ok = [t for t in timed if _ok(self.measurements.get((m, t)))]
        ok.sort(key=lambda t: (_median_us(self.measurements[(m, t)]), t))
        return ok[: self.cfg.refine_seeds]

    def _timed_before(self, previous: PreviousRecords, anchors: Sequence[int], known: set[str]) -> list[str]:
        """Variants beyond ``known`` that an earlier run timed in full, and OK, at every anchor and
        whose stored check passed: what an earlier refinement explored."""
        rows, checks, blocked = previous
        full = {
            (int(m), canon(t))
            for (m, t), row in rows.items()
            if row.get("status") == OK and row.get("kind") != SCREEN_KIND
        }
        passed = {canon(t) for t, row in checks.items() if row.get("passed")}
        return sorted(t for t in passed - known - blocked if timed_at_every(t, anchors, full))

    # -- the thorough search's anchor phase ------------------------------------------------

    def settled(self, t: str, anchors: Sequence[int]) -> bool:
        """Whether ``t`` needs no more anchor timings: timed at each anchor, or failed."""
        return t in self.failed or timed_at_every(t, anchors, self.measurements)

    def group_job(self, b: Backend, tactics: Sequence[str], anchors: Sequence[int]) -> Batch:
        """Screen ``tactics`` at every anchor, one anchor after the other (a worker keeps one token
        count's inputs at a time), as one batch: the unit a killed run keeps."""
        out = Batch("anchor")
        for m in anchors:
            part = self.point_job(b, m, tactics, "anchor", screen=True)
            out.measurements += part.measurements
            out.blocked += part.blocked
            if self.incomplete:
                break
        return out

    def check_and_screen(self, cpool: _Pool, pool: _Pool, cands: Sequence[str], anchors: Sequence[int]) -> list[str]:
        """The thorough search's first phases: every variant is checked on a check worker (which
        compiles it); then those that passed are screened at every anchor in groups of
        ``anchor_group`` on the timing workers, the defaults first, so that a run cut short still
        compares with them and the screens' cutoffs start from them. No screen shares the GPU
        with a check (docs/tuning.md says what the first runs saw).

        A variant checked by an earlier run but not screened at every anchor is checked again:
        the check compiles it, so the timing worker loads a binary instead of compiling it.
        Progress counts variants checked, then variants measured out of those that passed.
        Returns the survivors (the best ``keep_per_anchor`` of each anchor)."""
        firsts = {t: None for t in self.defaults.values() if t in cands}
        ordered = [*firsts, *(t for t in cands if t not in firsts)]
        to_check = [t for t in ordered if t not in self.failed and not (self.passed(t) and self.settled(t, anchors))]
        self.done, self.estimate = len(ordered) - len(to_check), len(ordered)
        self.progress(f"{self.label}: variants checked", self.done, self.estimate)
        self.check_all(cpool, to_check, f"{self.label}: variants checked")

        label = f"{self.label}: variants measured"
        passed = [t for t in ordered if self.passed(t)]
        todo = [t for t in passed if not self.settled(t, anchors)]
        measured = len(passed) - len(todo)
        self.progress(label, measured, len(passed))
        size = max(1, self.cfg.anchor_group)
        groups = [todo[i : i + size] for i in range(0, len(todo), size)]
        futs = [pool.submit(functools.partial(self.group_job, tactics=g, anchors=anchors)) for g in groups]
        group_of = dict(zip(futs, groups, strict=True))
        for fut in _completed(futs):
            batch = fut.result()
            if batch.measurements:
                self.emit(batch)
                self.new_blocked += batch.blocked
            measured += sum(self.settled(t, anchors) for t in group_of[fut])
            self.progress(label, measured, len(passed))
        return self.survivors(passed, anchors)


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
    with it (none: no refinement).
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

    st = _Sweep(problem, defaults, cfg, clock, on_batch or (lambda b: None), on_progress or (lambda *a: None), label)
    n_reused = st.reuse(order, previous_measurements or {}, previous_checks or {})

    anchors: tuple[int, ...] = ()
    pool = _Pool(backends)
    try:
        cpool = _Pool(check_backends) if check_backends else pool
        try:
            if cfg.thorough:  # 1-2. numerics, then anchor screens of every candidate
                anchors = st.anchors(points)
                keep = st.check_and_screen(cpool, pool, cands, anchors)
            else:  # 1. numerics, before any timing
                to_check = [t for t in cands if t not in st.checks]
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
                        near = _unblocked(neighbours, blocked_set)
                        previous = (previous_measurements or {}, previous_checks or {}, blocked_set)
                        keep = st.refine(cpool, pool, passed, anchors, near, previous)
        finally:
            if cpool is not pool:
                cpool.shutdown()
                if cfg.thorough:
                    for b in check_backends or ():
                        b.close()

        # 3. every point: the survivors and that point's default, in the same run
        def for_point(m: int) -> list[str]:
            d = defaults[m]
            extra = [d] if st.passed(d) and d not in keep else []
            return extra + keep  # the default first: its timing anchors the comparison

        point_label = None
        if cfg.thorough:  # progress: the pairs left to time
            point_label, st.done = f"{st.label}: every point", 0
            st.estimate = sum(not st.fully_timed(m, t) and t not in st.failed for m in points for t in for_point(m))
        st.time_points(pool, points, for_point, "point", point_label)
    finally:
        pool.shutdown()

    passed_set = {t for t, c in st.checks.items() if c.result.passed}
    choices = [
        choose(
            m, defaults[m], {t: x for (mm, t), x in st.measurements.items() if mm == m},
            passed=passed_set, failed=set(st.failed), min_gain=cfg.min_gain, disjoint=cfg.disjoint,
        )
        for m in points
    ]  # fmt: skip
    complete = not st.incomplete
    winners = ranges_from_choices(
        points, choices, extends_up=complete and points[-1] >= cfg.extend_up_from, extends_up_ok=extends_up_ok
    )
    coverage = Coverage(
        search=cfg.search, activations=problem.act_dtype, valid=n_valid, candidates=len(order),
        checked=sum(t in st.checks for t in order), failed=sum(t in st.failed or t in blocked_set for t in order),
        measured=len({t for (_, t), x in st.measurements.items() if _ok(x)}), anchors=anchors,
    )  # fmt: skip
    return SweepResult(
        problem=problem, points=points, choices=choices, winners=winners,
        measurements=list(st.measurements.values()), correctness=list(st.checks.values()),
        blocked=st.new_blocked, complete=complete, elapsed_s=clock() - start, n_timed=st.n_timed,
        n_reused=n_reused, notes=notes, coverage=coverage, label=label or "",
    )  # fmt: skip


def _unblocked(neighbours: Callable[[str], Sequence[str]], blocked: set[str]) -> Callable[[str], list[str]]:
    return lambda t: [n for n in (canon(x) for x in neighbours(t)) if n not in blocked]


def _safe_check(b: Backend, problem: ProblemKey, t: str) -> CheckResult:
    try:
        return b.check(problem, t)
    except CandidateError as err:
        return CheckResult(passed=False, status=err.status, error=err.text)


def _safe_time(b: Backend, problem: ProblemKey, t: str, m: int, screen: Screen | None = None) -> Measurement:
    try:
        timing = b.time(problem, t, m, screen) if screen is not None else b.time(problem, t, m)
    except CandidateError as err:
        return Measurement(m, t, err.status, error=err.text, screen=screen is not None)
    if not (timing.median_us > 0 and math.isfinite(timing.median_us)):
        return Measurement(m, t, "launch_error", error=f"implausible time {timing.median_us} us")
    return Measurement(m, t, OK, timing, screen=screen is not None)


def _reason(r: CheckResult) -> str:
    if r.status != OK:
        return f"{r.status}: {r.error or ''}".strip()
    parts = [f"numerics_fail vs {r.reference or 'reference'}"]
    if r.rel_err is not None:
        parts.append(f"rel_err={r.rel_err:.3g}" + (f" > {r.tolerance:.3g}" if r.tolerance is not None else ""))
    if r.nan_inf_count:
        parts.append(f"{r.nan_inf_count} NaN/Inf")
    if r.error:
        parts.append(r.error)
    return ", ".join(parts)


def _ok(meas: Measurement | None) -> bool:
    return meas is not None and meas.status == OK and meas.timing is not None


def _median_us(meas: Measurement | None) -> float:
    """The median of a measurement :func:`_ok` accepted."""
    assert meas is not None and meas.timing is not None
    return meas.timing.median_us


def _measurement_from_row(m: int, t: str, row: Mapping[str, Any], is_default: bool) -> Measurement:
    screened = row.get("kind") == SCREEN_KIND
    if row.get("status") == OK and row.get("median_us") is not None:
        med = float(row["median_us"])
        timing = Timing(
            median_us=med, p10_us=float(row.get("p10_us") or med), p90_us=float(row.get("p90_us") or med),
            mean_us=float(row.get("mean_us") or med), n_samples=int(row.get("n_samples") or 0),
        )  # fmt: skip
        return Measurement(m, t, OK, timing, is_default=is_default, reused=True, screen=screened)
    return Measurement(
        m, t, str(row.get("status")), error=row.get("error_text"), is_default=is_default, reused=True, screen=screened
    )


def _check_from_row(row: Mapping[str, Any]) -> CheckResult:
    return CheckResult(
        passed=bool(row.get("passed")), reference=str(row.get("reference") or ""),
        max_abs_err=row.get("max_abs_err"), rel_err=row.get("rel_err"),
        nan_inf_count=int(row.get("nan_inf_count") or 0), tolerance=row.get("tolerance"),
        error=row.get("error_text"),
    )  # fmt: skip


def choose(
    m: int,
    default: str,
    timed: Mapping[str, Measurement],
    *,
    passed: set[str],
    failed: set[str],
    min_gain: float = 0.03,
    disjoint: bool = True,
) -> PointChoice:
    """The tactic for token point ``m``: the default unless beaten beyond noise.

    Only candidates that passed the numerics check, never failed, and were timed OK in full (not
    only screened) compete.
    """
    ok = {t: x for t, x in timed.items() if _ok(x) and not x.screen and t in passed and t not in failed}
    if not ok:
        return PointChoice(m, None, default, None, None, why="nothing measured")
    ranked = sorted(ok, key=lambda t: (_median_us(ok[t]), t))
    best = ranked[0]
    dm = ok.get(default)
    bt = ok[best].timing
    assert bt is not None
    if dm is None and default in passed and default not in failed:
        # A run cut short before it timed the default has nothing to compare with: no choice yet.
        return PointChoice(m, None, default, None, None, why="default not timed yet")
    if dm is None:
        winner, why = best, "default unavailable"
    elif best == default:
        winner, why = default, "default fastest"
    else:
        dt = dm.timing
        assert dt is not None
        faster = bt.median_us < dt.median_us * (1.0 - min_gain)
        clear = bt.p90_us < dt.p10_us if disjoint else True
        if faster and clear:
            winner, why = best, "beats default beyond noise"
        else:
            winner, why = default, "default kept (gain within noise)"
    others = [t for t in ranked if t != winner]
    wt = ok[winner].timing
    assert wt is not None
    ru = others[0] if others else None
    gap = _median_us(ok[ru]) / wt.median_us - 1.0 if ru else None
    return PointChoice(
        m, winner, default, wt.median_us, dm.timing.median_us if dm and dm.timing else None,
        runner_up=ru, runner_up_gap=gap, why=why,
    )  # fmt: skip


def ranges_from_choices(
    points: Sequence[int],
    choices: Sequence[PointChoice],
    *,
    extends_up: bool,
    extends_up_ok: Callable[[str], bool] = lambda tactic: True,
) -> list[WinnerRange]:
    """Merge per-point choices into winner ranges by :func:`prepkit.tactics.lookup.merge_points`
    (the lookup's own ceil rule). A point without a winner leaves its range to the default; the
    last range extends upward only if ``extends_up`` and it ends at the last point."""
    by_m = {c.m: c for c in choices}
    pts = sorted(points)
    picked = [by_m[m] if m in by_m and by_m[m].winner is not None else None for m in pts]
    out: list[WinnerRange] = []
    for lo, hi, idx in merge_points(pts, [c.winner if c else None for c in picked]):
        group = [picked[i] for i in idx]
        last = group[-1]
        assert last is not None
        out.append(
            WinnerRange(
                m_lo=lo, m_hi=hi, tactic=last.winner or "", extends_up=False,
                median_us=last.winner_us, default_median_us=last.default_us,
                speedup_vs_default=geomean([c.speedup for c in group if c and c.speedup]),
                runner_up=last.runner_up, runner_up_gap=last.runner_up_gap,
            )
        )  # fmt: skip
    if out and extends_up and out[-1].m_hi == max(points) and extends_up_ok(out[-1].tactic):
        last_range = out[-1]
        out[-1] = WinnerRange(**{**last_range.__dict__, "extends_up": True})
    return out


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
) -> LayerReport:
    """Sweep each GEMM of a layer in turn (the other GEMM at its default), splitting the time
    budget over what is left; then, where the backend can, time the whole layer with the default
    pair and with the tuned pair at every point (the number users feel). ``valid_for``: the size
    of each problem's variant space, for the coverage; ``label_for``: what progress calls each."""
    start = clock()
    results: list[SweepResult] = []
    # A thorough search shares the budget by the work each GEMM has left (a resumed run gives its
    # time to the GEMM that needs it); the pruned one shares it equally. What a GEMM leaves over
    # goes to the next, so the first one's share errs large.
    work = [_work_left(p, candidates_for, previous, config) if config.thorough else 1 for p in problems]
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
        )  # fmt: skip
        results.append(res)
        if on_result:
            on_result(res)
    points = _layer_points(results, getattr(backends[0], "time_layer", None)) if compare_layer else []
    return LayerReport(results, points, clock() - start)


def _work_left(
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


def timed_at_every(tactic: str, anchors: Iterable[int], timed: Container[tuple[int, str]]) -> bool:
    """Whether ``timed`` (pairs of token count and tactic) holds ``tactic`` at each anchor: the one
    rule for what a thorough sweep has screened and what a refinement has explored."""
    return all((m, tactic) in timed for m in anchors)


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
