"""The state of one running sweep (:class:`SweepRun`): the candidates checked and timed so far, the
worker pool that measures them, and the batches handed to the caller."""

from __future__ import annotations

import functools
import math
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from prepkit.tactics.keys import ProblemKey, canon
from prepkit.tactics.schema import SCREEN_KIND
from prepkit.tune.backend import Backend
from prepkit.tune.records import (
    OK,
    OUT_OF_MEMORY,
    Batch,
    CandidateError,
    CheckResult,
    Correctness,
    Measurement,
    Screen,
    Timing,
)
from prepkit.tune.retime import close_calls, retime
from prepkit.tune.sweep_config import PreviousRecords, ProgressFn, SweepConfig
from prepkit.tune.winners import measured_ok, median_us, timed_at_every

T = TypeVar("T")


class Pool:
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


class SweepRun:
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
        self.n_retimed = 0  # timings of close calls in rounds (not in n_timed: no new pair)
        self.retimed: set[int] = set()  # token points whose close calls were timed again in rounds
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

    def check_all(self, pool: Pool, to_check: Sequence[str], label: str | None = None) -> None:
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
        pool: Pool,
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

    def close_at(self, m: int) -> list[str]:
        """The candidates at ``m`` that may win (checked, timed in full, never failed) within the
        retime margin of the best; none where one of them was read back from the DB: a rerun never
        times again a pair an earlier run stored (that run retimed it if it got that far)."""
        ok = {
            t: median_us(x)
            for (mm, t), x in self.measurements.items()
            if mm == m and measured_ok(x) and not x.screen and self.passed(t) and t not in self.failed
        }
        close = close_calls(ok, self.cfg.retime.margin)
        if len(close) < 2 or any(self.measurements[(m, t)].reused for t in close):
            return []
        return close

    def retime_job(self, b: Backend, m: int, tactics: Sequence[str]) -> Batch:
        """Time the close calls ``tactics`` at ``m`` again in rotated rounds; their timings become
        the medians over the rounds. A timing that fails now leaves the one-shot timings standing."""
        out = Batch("retime", m)
        if self.over_budget():
            return out

        def one(t: str) -> Timing:
            timing = b.time(self.problem, t, m)
            if not (timing.median_us > 0 and math.isfinite(timing.median_us)):
                raise CandidateError("launch_error", f"implausible time {timing.median_us} us")
            return timing

        rounds = self.cfg.retime.rounds
        try:
            got = retime(tactics, one, rounds)
        except CandidateError:
            return out
        for t, timing in got.items():
            out.measurements.append(Measurement(m, t, OK, timing, is_default=self.defaults[m] == t))
        with self.lock:
            for meas in out.measurements:
                self.record(meas)
            self.n_retimed += rounds * len(got)
            self.retimed.add(m)
        return out

    def retime_points(self, pool: Pool, ms: Sequence[int]) -> None:
        """Retime the close calls of every point in ``ms`` (:meth:`close_at`), a point per job."""
        if not self.cfg.retime.enabled:
            return
        jobs = {m: close for m in ms if (close := self.close_at(m))}
        self.estimate += sum(self.cfg.retime.rounds * len(c) for c in jobs.values())
        futs = [pool.submit(functools.partial(self.retime_job, m=m, tactics=c)) for m, c in jobs.items()]
        for fut in _completed(futs):
            batch = fut.result()
            if batch.measurements:
                self.done += self.cfg.retime.rounds * len(batch.measurements)
                self.progress(self.label, self.done, max(self.estimate, self.done))
                self.emit(batch)

    def fully_timed(self, m: int, t: str) -> bool:
        had = self.measurements.get((m, t))
        return had is not None and not had.screen

    def record(self, meas: Measurement) -> None:
        """Keep ``meas`` as the timing of its pair (call under ``lock``)."""
        self.measurements[(meas.m, meas.tactic)] = meas
        if measured_ok(meas):
            us = median_us(meas)
            self.fastest[meas.m] = min(us, self.fastest.get(meas.m, us))

    def anchors(self, points: tuple[int, ...]) -> tuple[int, ...]:
        """The anchors among the token points; the first and last point where none is."""
        return tuple(a for a in self.cfg.anchors if a in self.defaults) or tuple(sorted({points[0], points[-1]}))

    def anchor_survivors(self, pool: Pool, passed: list[str], points: tuple[int, ...]) -> list[str]:
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
            ok = [t for t in passed if measured_ok(self.measurements.get((m, t)))]
            medians = {t: median_us(self.measurements[(m, t)]) for t in ok}
            ok.sort(key=medians.__getitem__)
            for t in ok[: cfg.keep_per_anchor]:
                kept.setdefault(t, None)
        return [t for t in passed if t in kept]

    def refine(
        self,
        cpool: Pool,
        pool: Pool,
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
        ok = [t for t in timed if measured_ok(self.measurements.get((m, t)))]
        ok.sort(key=lambda t: (median_us(self.measurements[(m, t)]), t))
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

    def check_and_screen(self, cpool: Pool, pool: Pool, cands: Sequence[str], anchors: Sequence[int]) -> list[str]:
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


def unblocked(neighbours: Callable[[str], Sequence[str]], blocked: set[str]) -> Callable[[str], list[str]]:
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
