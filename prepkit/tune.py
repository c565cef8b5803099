"""Sweep a kernel's variants for one GEMM problem: check numerics, time, pick a winner per token range.

The sweep returns records and never writes a DB: the ``tune`` command stores each batch as it
arrives (``on_batch``, called on the caller's thread), so a killed tune keeps every finished
point. Measuring is delegated to :class:`Backend` objects: :class:`FunctionBackend` wraps plain
callables (the CPU tests drive the whole procedure with a stand-in timer), and
:class:`SubprocessBackend` runs the real kernel in a worker process per GPU, so a crash, a hang
or a sticky CUDA error costs one candidate, not the sweep.

Procedure (tactics.md §7.4):

1. numerics: every candidate not checked before in this environment is compared with the
   reference; a failure goes to the blocklist and never reaches timing;
2. anchors: with more candidates than ``keep_per_anchor``, all are timed at a few anchor token
   counts and the best ``keep_per_anchor`` of each anchor survive;
3. every token point: the survivors and that point's default are timed in the same run;
4. per point the default is kept unless a candidate is faster by more than ``min_gain`` *and* its
   p90 is below the default's p10 (beyond noise); equal adjacent winners merge into one
   ``[m_lo, m_hi]`` range (ceil semantics); the last range extends upward only when the sweep
   reached the top of the series.

A rerun passes what the DB already holds (``previous_*``) and only the missing pairs are measured.
"""

from __future__ import annotations

import json
import math
import os
import queue
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from prepkit.errors import DeviceError
from prepkit.runtime.tactics import MAX_TOKEN_POINT, TOKEN_POINTS, ProblemKey, canonical_json

OK = "ok"
# Statuses of a failed candidate; all of them put the tactic on the blocklist.
FAILURES = (
    "numerics_fail", "compile_error", "out_of_resources", "launch_error", "sticky_cuda_error",
    "crash", "timeout",
)  # fmt: skip

ProgressFn = Callable[[str, int, int], None]


def canon(tactic: str | Mapping[str, Any] | Any) -> str:
    """Canonical JSON of a tactic given as JSON text, a mapping, or an object with ``to_json``."""
    if isinstance(tactic, str):
        return canonical_json(json.loads(tactic))
    if isinstance(tactic, Mapping):
        return canonical_json(dict(tactic))
    return canonical_json(json.loads(tactic.to_json()))


def parse_tokens(spec: str | None, *, max_tokens: int | None = None) -> tuple[int, ...]:
    """``"1,2,4-8,64"`` -> sorted unique points; ``None``/``"all"`` -> :data:`TOKEN_POINTS`.

    Raises:
        ValueError: an entry is not a positive integer or range.
    """
    if spec is None or spec.strip().lower() in ("", "all", "default"):
        pts = set(TOKEN_POINTS)
    else:
        pts = set()
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                if sep:
                    a, b = int(lo), int(hi)
                    if a > b:
                        raise ValueError
                    pts.update(range(a, b + 1))
                else:
                    pts.add(int(part))
            except ValueError:
                raise ValueError(f"bad token count {part!r} (expected N or A-B, comma separated)") from None
        if not pts or min(pts) < 1:
            raise ValueError(f"token counts must be positive integers, got {spec!r}")
    if max_tokens is not None:
        pts = {p for p in pts if p <= max_tokens}
    return tuple(sorted(pts))


# ----------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Timing:
    """Per-launch latency of one candidate at one token count, in microseconds."""

    median_us: float
    p10_us: float
    p90_us: float
    mean_us: float
    n_samples: int
    samples_us: tuple[float, ...] = ()

    @classmethod
    def from_samples(cls, samples_us: Sequence[float]) -> Timing:
        if not samples_us:
            raise ValueError("no timing samples")
        s = sorted(float(x) for x in samples_us)
        return cls(
            median_us=statistics.median(s), p10_us=_quantile(s, 0.1), p90_us=_quantile(s, 0.9),
            mean_us=statistics.fmean(s), n_samples=len(s), samples_us=tuple(s),
        )  # fmt: skip


def _quantile(sorted_vals: Sequence[float], q: float) -> float:
    # Linear interpolation between closest ranks; fine for 10-100 samples.
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


@dataclass(frozen=True)
class CheckResult:
    """Outcome of comparing one candidate with the reference."""

    passed: bool
    m_values: tuple[int, ...] = ()
    reference: str = ""
    max_abs_err: float | None = None
    rel_err: float | None = None
    nan_inf_count: int = 0
    tolerance: float | None = None
    error: str | None = None
    status: str = OK  # a FAILURES entry when the candidate did not run


class CandidateError(Exception):
    """A candidate could not be checked or timed (compile error, crash, timeout...)."""

    def __init__(self, status: str, text: str) -> None:
        super().__init__(f"{status}: {text}")
        self.status = status
        self.text = text


@dataclass
class Measurement:
    m: int
    tactic: str
    status: str
    timing: Timing | None = None
    error: str | None = None
    is_default: bool = False
    reused: bool = False  # read back from the DB, not measured in this run

    def row(self) -> dict[str, Any]:
        t = self.timing
        return {
            "m": self.m, "params_json": self.tactic, "status": self.status, "error_text": self.error,
            "is_default": self.is_default,
            "median_us": t.median_us if t else None, "p10_us": t.p10_us if t else None,
            "p90_us": t.p90_us if t else None, "mean_us": t.mean_us if t else None,
            "n_samples": t.n_samples if t else None, "samples_us": list(t.samples_us) if t else None,
        }  # fmt: skip


@dataclass
class Correctness:
    tactic: str
    result: CheckResult
    reused: bool = False

    def row(self) -> dict[str, Any]:
        r = self.result
        return {
            "params_json": self.tactic, "passed": r.passed, "m_values": list(r.m_values),
            "reference": r.reference, "max_abs_err": r.max_abs_err, "rel_err": r.rel_err,
            "nan_inf_count": r.nan_inf_count, "tolerance": r.tolerance,
            "error_text": r.error if r.status == OK else f"{r.status}: {r.error}",
        }  # fmt: skip


@dataclass
class Batch:
    """What one step of the sweep produced; the caller stores it in one transaction."""

    phase: str  # 'check' | 'anchor' | 'point'
    m: int | None = None
    measurements: list[Measurement] = field(default_factory=list)
    correctness: list[Correctness] = field(default_factory=list)
    blocked: list[tuple[str, str]] = field(default_factory=list)  # (tactic, reason)


@dataclass(frozen=True)
class PointChoice:
    m: int
    winner: str | None
    default: str
    winner_us: float | None
    default_us: float | None
    runner_up: str | None = None
    runner_up_gap: float | None = None
    why: str = ""

    @property
    def speedup(self) -> float | None:
        if self.winner_us and self.default_us:
            return self.default_us / self.winner_us
        return None


@dataclass(frozen=True)
class WinnerRange:
    m_lo: int
    m_hi: int
    tactic: str
    extends_up: bool
    median_us: float | None
    default_median_us: float | None
    speedup_vs_default: float | None
    runner_up: str | None
    runner_up_gap: float | None


@dataclass
class SweepResult:
    problem: ProblemKey
    points: tuple[int, ...]
    choices: list[PointChoice]
    winners: list[WinnerRange]
    measurements: list[Measurement]
    correctness: list[Correctness]
    blocked: list[tuple[str, str]]
    complete: bool
    elapsed_s: float
    n_timed: int
    n_reused: int
    notes: list[str] = field(default_factory=list)

    def geomean_speedup(self) -> float | None:
        """Geometric mean over token points of default / chosen latency (1.0 where kept)."""
        vals = [c.speedup for c in self.choices if c.speedup]
        if not vals:
            return None
        return math.exp(sum(math.log(v) for v in vals) / len(vals))


# ----------------------------------------------------------------------------------- backends


class Backend(Protocol):
    """Measures candidates of one problem on one device. Methods raise :class:`CandidateError`."""

    def check(self, problem: ProblemKey, tactic: str) -> CheckResult: ...

    def time(self, problem: ProblemKey, tactic: str, m: int) -> Timing: ...

    def close(self) -> None: ...


class FunctionBackend:
    """A backend from two callables: ``timer(tactic_json, m) -> Timing | samples`` and
    ``checker(tactic_json) -> CheckResult | bool``. Used with stand-ins on the CPU."""

    def __init__(
        self,
        timer: Callable[[str, int], Timing | Sequence[float]],
        checker: Callable[[str], CheckResult | bool] | None = None,
    ) -> None:
        self.timer = timer
        self.checker = checker
        self.calls: list[tuple[str, str, int | None]] = []

    def check(self, problem: ProblemKey, tactic: str) -> CheckResult:
        self.calls.append(("check", tactic, None))
        if self.checker is None:
            return CheckResult(passed=True, reference="none")
        r = self.checker(tactic)
        return r if isinstance(r, CheckResult) else CheckResult(passed=bool(r), reference="stand-in")

    def time(self, problem: ProblemKey, tactic: str, m: int) -> Timing:
        self.calls.append(("time", tactic, m))
        r = self.timer(tactic, m)
        return r if isinstance(r, Timing) else Timing.from_samples(r)

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------- sweep


@dataclass(frozen=True)
class SweepConfig:
    points: tuple[int, ...] = TOKEN_POINTS
    anchors: tuple[int, ...] = (1, 8, 64, 512, 4096)
    keep_per_anchor: int = 6
    min_gain: float = 0.03  # a challenger must beat the default by more than this fraction...
    disjoint: bool = True  # ...and its p90 must lie below the default's p10
    budget_s: float | None = None
    extend_up_from: int = MAX_TOKEN_POINT  # last range extends upward if the sweep reached this


class _Pool:
    """One thread per backend; each job borrows a free backend for its whole run."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        if not backends:
            raise ValueError("at least one backend is needed")
        self.free: queue.Queue[Backend] = queue.Queue()
        for b in backends:
            self.free.put(b)
        self.ex = ThreadPoolExecutor(max_workers=len(backends), thread_name_prefix="tune")

    def submit(self, fn: Callable[[Backend], Any]) -> Future[Any]:
        def run() -> Any:
            b = self.free.get()
            try:
                return fn(b)
            finally:
                self.free.put(b)

        return self.ex.submit(run)

    def shutdown(self) -> None:
        self.ex.shutdown(wait=True, cancel_futures=True)


def sweep(
    problem: ProblemKey,
    candidates: Iterable[str | Any],
    default_for: Callable[[int], str | Any],
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
) -> SweepResult:
    """Run the procedure in the module docstring. Returns every record it made or reused.

    ``previous_measurements`` maps ``(m, tactic_json)`` to a DB row (``status``, ``median_us``,
    ``p10_us``, ``p90_us``, ``mean_us``, ``n_samples``); ``previous_checks`` maps tactic JSON to a
    correctness row (``passed``, errors...). ``blocked`` tactics are neither checked nor timed.
    With several backends (GPUs), whole token points run in parallel, one backend each, so the
    candidates of one point are always compared on one device.
    """
    cfg = config or SweepConfig()
    points = tuple(sorted(set(cfg.points)))
    if not points or points[0] < 1:
        raise ValueError(f"token points must be positive, got {cfg.points}")
    start = clock()
    deadline = None if cfg.budget_s is None else start + cfg.budget_s
    emit = on_batch or (lambda b: None)
    progress = on_progress or (lambda label, done, total: None)
    label = f"{problem.role} N={problem.n} K={problem.k}"

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

    st = _State()
    for (m, t), row in (previous_measurements or {}).items():
        tc = canon(t)
        if int(m) in defaults and tc in order:
            st.measurements[(int(m), tc)] = _measurement_from_row(int(m), tc, row, defaults[int(m)] == tc)
    for t, row in (previous_checks or {}).items():
        tc = canon(t)
        if tc in order:
            st.checks[tc] = Correctness(tc, _check_from_row(row), reused=True)
            if not st.checks[tc].result.passed:
                st.failed.setdefault(tc, _reason(st.checks[tc].result))
    for (_m, t), meas in st.measurements.items():
        if meas.status != OK:
            st.failed.setdefault(t, f"{meas.status}: {meas.error or ''}")
    n_reused = len(st.measurements)

    def over_budget() -> bool:
        return deadline is not None and clock() > deadline

    def check_job(b: Backend, t: str) -> Batch:
        out = Batch("check")
        if over_budget():
            st.incomplete = True
            return out
        res = _safe_check(b, problem, t)
        c = Correctness(t, res)
        out.correctness.append(c)
        with st.lock:
            st.checks[t] = c
            if not res.passed and t not in st.failed:
                st.failed[t] = _reason(res)
                out.blocked.append((t, st.failed[t]))
        return out

    def point_job(b: Backend, m: int, tactics: Sequence[str], phase: str) -> Batch:
        out = Batch(phase, m)
        for t in tactics:
            with st.lock:
                if (m, t) in st.measurements or t in st.failed:
                    continue
            if over_budget():
                st.incomplete = True
                break
            meas = _safe_time(b, problem, t, m)
            meas.is_default = defaults[m] == t
            out.measurements.append(meas)
            with st.lock:
                st.measurements[(m, t)] = meas
                st.n_timed += 1
                if meas.status != OK and t not in st.failed:
                    st.failed[t] = f"{meas.status} at M={m}: {meas.error or ''}".strip()
                    out.blocked.append((t, st.failed[t]))
        return out

    pool = _Pool(backends)
    done = 0
    try:
        # 1. numerics, before any timing
        to_check = [t for t in cands if t not in st.checks]
        est = len(to_check) + len(points) * min(len(cands), cfg.keep_per_anchor + 1)
        merged = Batch("check")
        for fut in _completed([pool.submit(lambda b, t=t: check_job(b, t)) for t in to_check]):
            b = fut.result()
            merged.correctness += b.correctness
            merged.blocked += b.blocked
            done += 1
            progress(label, done, est)
        if merged.correctness:
            emit(merged)
            st.new_blocked += merged.blocked
        passed = [t for t in cands if t in st.checks and st.checks[t].result.passed]

        def run_points(ms: Sequence[int], tactics_for: Callable[[int], list[str]], phase: str) -> None:
            nonlocal done
            futs = [pool.submit(lambda b, m=m: point_job(b, m, tactics_for(m), phase)) for m in ms]
            for fut in _completed(futs):
                b = fut.result()
                done += len(b.measurements)
                progress(label, done, max(est, done))
                if b.measurements:
                    emit(b)
                    st.new_blocked += b.blocked

        # 2. anchors: prune a large candidate set on a few token counts
        keep = list(passed)
        if len(passed) > cfg.keep_per_anchor:
            anchors = [a for a in cfg.anchors if a in defaults] or sorted({points[0], points[-1]})
            est = done + len(anchors) * len(passed) + len(points) * (cfg.keep_per_anchor + 1)
            run_points(anchors, lambda m: list(passed), "anchor")
            survivors: dict[str, None] = {}
            for m in anchors:
                ok = [t for t in passed if _ok(st.measurements.get((m, t)))]
                ok.sort(key=lambda t, m=m: st.measurements[(m, t)].timing.median_us)  # type: ignore[union-attr]
                for t in ok[: cfg.keep_per_anchor]:
                    survivors.setdefault(t, None)
            keep = [t for t in passed if t in survivors]

        # 3. every point: the survivors and that point's default, in the same run
        def for_point(m: int) -> list[str]:
            d = defaults[m]
            extra = [d] if d in st.checks and st.checks[d].result.passed and d not in keep else []
            return extra + keep  # the default first: its timing anchors the comparison

        run_points(points, for_point, "point")
    finally:
        pool.shutdown()

    choices = [
        choose(
            m, defaults[m], {t: x for (mm, t), x in st.measurements.items() if mm == m},
            passed={t for t, c in st.checks.items() if c.result.passed}, failed=set(st.failed),
            min_gain=cfg.min_gain, disjoint=cfg.disjoint,
        )
        for m in points
    ]  # fmt: skip
    complete = not st.incomplete
    winners = ranges_from_choices(
        points, choices, extends_up=complete and points[-1] >= cfg.extend_up_from, extends_up_ok=extends_up_ok
    )
    return SweepResult(
        problem=problem, points=points, choices=choices, winners=winners,
        measurements=list(st.measurements.values()), correctness=list(st.checks.values()),
        blocked=st.new_blocked, complete=complete, elapsed_s=clock() - start, n_timed=st.n_timed,
        n_reused=n_reused, notes=notes,
    )  # fmt: skip


@dataclass
class _State:
    measurements: dict[tuple[int, str], Measurement] = field(default_factory=dict)
    checks: dict[str, Correctness] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    new_blocked: list[tuple[str, str]] = field(default_factory=list)
    n_timed: int = 0
    incomplete: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _completed(futs: Sequence[Future[Any]]) -> Iterable[Future[Any]]:
    """Futures in completion order (results are consumed on the caller's thread)."""
    pending = set(futs)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        yield from sorted(done, key=futs.index)


def _safe_check(b: Backend, problem: ProblemKey, t: str) -> CheckResult:
    try:
        return b.check(problem, t)
    except CandidateError as err:
        return CheckResult(passed=False, status=err.status, error=err.text)


def _safe_time(b: Backend, problem: ProblemKey, t: str, m: int) -> Measurement:
    try:
        timing = b.time(problem, t, m)
    except CandidateError as err:
        return Measurement(m, t, err.status, error=err.text)
    if not (timing.median_us > 0 and math.isfinite(timing.median_us)):
        return Measurement(m, t, "launch_error", error=f"implausible time {timing.median_us} us")
    return Measurement(m, t, OK, timing)


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


def _measurement_from_row(m: int, t: str, row: Mapping[str, Any], is_default: bool) -> Measurement:
    if row.get("status") == OK and row.get("median_us") is not None:
        med = float(row["median_us"])
        timing = Timing(
            median_us=med, p10_us=float(row.get("p10_us") or med), p90_us=float(row.get("p90_us") or med),
            mean_us=float(row.get("mean_us") or med), n_samples=int(row.get("n_samples") or 0),
        )  # fmt: skip
        return Measurement(m, t, OK, timing, is_default=is_default, reused=True)
    return Measurement(m, t, str(row.get("status")), error=row.get("error_text"), is_default=is_default, reused=True)


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

    Only candidates that passed the numerics check, never failed, and were timed OK compete.
    """
    ok = {t: x for t, x in timed.items() if _ok(x) and t in passed and t not in failed}
    if not ok:
        return PointChoice(m, None, default, None, None, why="nothing measured")
    ranked = sorted(ok, key=lambda t: (ok[t].timing.median_us, t))  # type: ignore[union-attr]
    best = ranked[0]
    dm = ok.get(default)
    bt = ok[best].timing
    assert bt is not None
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
    gap = ok[ru].timing.median_us / wt.median_us - 1.0 if ru else None  # type: ignore[union-attr]
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
    """Merge per-point choices into ``[m_lo, m_hi]`` ranges (ceil semantics: the tactic measured
    at M serves ``(previous point, M]``). A point without a winner leaves its range to the
    default; the last range extends upward only if ``extends_up`` and it ends at the last point."""
    by_m = {c.m: c for c in choices}
    out: list[WinnerRange] = []
    prev = 0
    group: list[PointChoice] = []

    def flush(lo: int) -> None:
        if not group:
            return
        last = group[-1]
        sp = [c.speedup for c in group if c.speedup]
        out.append(
            WinnerRange(
                m_lo=lo, m_hi=last.m, tactic=last.winner or "", extends_up=False,
                median_us=last.winner_us, default_median_us=last.default_us,
                speedup_vs_default=math.exp(sum(map(math.log, sp)) / len(sp)) if sp else None,
                runner_up=last.runner_up, runner_up_gap=last.runner_up_gap,
            )
        )  # fmt: skip

    lo = 1
    for m in sorted(points):
        c = by_m.get(m)
        if c is None or c.winner is None:
            flush(lo)
            group = []
            lo = m + 1
        elif group and group[-1].winner == c.winner and group[-1].m == prev:
            group.append(c)
        else:
            flush(lo)
            group = [c]
            lo = prev + 1
        prev = m
    flush(lo)
    if out and extends_up and out[-1].m_hi == max(points) and extends_up_ok(out[-1].tactic):
        last = out[-1]
        out[-1] = WinnerRange(**{**last.__dict__, "extends_up": True})
    return out
