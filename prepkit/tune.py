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
    # Where the kernel's tile regimes change for gpt-oss (rows per expert = M*top_k/E).
    anchors: tuple[int, ...] = (1, 4, 16, 128, 1024, 4096)
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
    check_backends: Sequence[Backend] | None = None,
) -> SweepResult:
    """Run the procedure in the module docstring. Returns every record it made or reused.

    ``previous_measurements`` maps ``(m, tactic_json)`` to a DB row (``status``, ``median_us``,
    ``p10_us``, ``p90_us``, ``mean_us``, ``n_samples``); ``previous_checks`` maps tactic JSON to a
    correctness row (``passed``, errors...). ``blocked`` tactics are neither checked nor timed.
    With several backends (GPUs), whole token points run in parallel, one backend each, so the
    candidates of one point are always compared on one device. ``check_backends`` (default: the
    timing backends) run the numerics phase: extra workers on one GPU compile candidates in
    parallel and fill Triton's cache before timing starts.
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
        cpool = _Pool(check_backends) if check_backends else pool
        try:
            check_futs = [cpool.submit(lambda b, t=t: check_job(b, t)) for t in to_check]
            for fut in _completed(check_futs):
                b = fut.result()
                done += 1
                progress(label, done, est)
                if b.correctness:  # stored at once: a killed tune keeps every finished check
                    emit(b)
                    st.new_blocked += b.blocked
        finally:
            if cpool is not pool:
                cpool.shutdown()
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


# ------------------------------------------------------------------------------ a whole layer


@dataclass
class LayerPoint:
    """Whole-layer latency at one token count with the default pair and with the tuned pair."""

    m: int
    default_us: float | None
    tuned_us: float | None

    @property
    def speedup(self) -> float | None:
        return self.default_us / self.tuned_us if self.default_us and self.tuned_us else None


@dataclass
class LayerReport:
    results: list[SweepResult]
    layer_points: list[LayerPoint]
    elapsed_s: float

    def layer_geomean(self) -> float | None:
        vals = [p.speedup for p in self.layer_points if p.speedup]
        return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def tune_layer(
    problems: Sequence[ProblemKey],
    backends: Sequence[Backend],
    *,
    candidates_for: Callable[[ProblemKey], list[str]],
    default_for: Callable[[ProblemKey], Callable[[int], str]],
    config: SweepConfig,
    previous: Callable[[ProblemKey], tuple[Mapping[Any, Any], Mapping[str, Any], set[str]]] | None = None,
    on_batch: Callable[[ProblemKey, Batch], None] | None = None,
    on_result: Callable[[SweepResult], None] | None = None,
    on_progress: ProgressFn | None = None,
    compare_layer: bool = True,
    clock: Callable[[], float] = time.monotonic,
    check_backends: Sequence[Backend] | None = None,
) -> LayerReport:
    """Sweep each GEMM of a layer in turn (the other GEMM at its default), splitting the time
    budget over what is left; then, where the backend can, time the whole layer with the default
    pair and with the tuned pair at every point (the number users feel)."""
    start = clock()
    results: list[SweepResult] = []
    for i, problem in enumerate(problems):
        budget = None
        if config.budget_s is not None:
            left = config.budget_s - (clock() - start)
            # Keep a slice for the whole-layer comparison at the end.
            budget = max(0.0, left * (0.95 if compare_layer else 1.0) / (len(problems) - i))
        prev_m, prev_c, blocked = previous(problem) if previous else ({}, {}, set())
        res = sweep(
            problem, candidates_for(problem), default_for(problem), backends,
            config=SweepConfig(**{**config.__dict__, "budget_s": budget}),
            previous_measurements=prev_m, previous_checks=prev_c, blocked=blocked,
            on_batch=(lambda b, p=problem: on_batch(p, b)) if on_batch else None,
            on_progress=on_progress, clock=clock, check_backends=check_backends,
        )  # fmt: skip
        results.append(res)
        if on_result:
            on_result(res)
    points: list[LayerPoint] = []
    timer = getattr(backends[0], "time_layer", None)
    by_role = {r.problem.role: r for r in results}
    if compare_layer and timer is not None and {"gemm1", "gemm2"} <= set(by_role):
        g1, g2 = by_role["gemm1"], by_role["gemm2"]
        c1 = {c.m: c for c in g1.choices}
        c2 = {c.m: c for c in g2.choices}
        for m in g1.points:
            if m not in c2:
                continue
            default_pair = (c1[m].default, c2[m].default)
            tuned_pair = (c1[m].winner or c1[m].default, c2[m].winner or c2[m].default)
            try:
                d = timer(g1.problem, default_pair, m).median_us
                t = d if tuned_pair == default_pair else timer(g1.problem, tuned_pair, m).median_us
            except CandidateError:
                d = t = None
            points.append(LayerPoint(m, d, t))
    return LayerReport(results, points, clock() - start)


# ------------------------------------------------------------------------- candidate space


def prune_candidates(
    tactics: Sequence[str], role: str, *, max_count: int | None = None, seeds: Sequence[str] = ()
) -> list[str]:
    """Arch-independent pruning of the kernel's valid variants to a sweepable set.

    Rules (tactics.md §7.4): at least 2 stages (1 never hides the weight loads); split-K only for
    GEMM2 with small row blocks (it pays only when the grid under-fills the GPU); no ``bits``
    upcast where the same tile exists with ``asm`` (the same arithmetic in fewer instructions;
    ``bits`` stays for devices and interpreters without the PTX path); then, if more than
    ``max_count`` remain: first the ``seeds`` (the default tactics and earlier winners) and their
    neighbours, the variants that differ from a seed in one knob (up to half the budget: the local search an
    engineer would run by hand, e.g. the default tile with TMA loads or one stage more), then an
    even spread within each (block_m, upcast, weight_load) group so every tile regime stays
    represented. Fields the kernel does not have are ignored.
    """
    kept: list[tuple[dict[str, Any], str]] = []
    for t in tactics:
        d = json.loads(t)
        if d.get("num_stages", 2) < 2:
            continue
        if d.get("split_k", 1) > 1 and (role != "gemm2" or d.get("block_m", 16) > 32):
            continue
        kept.append((d, canon(t)))
    asm_tiles = {_without_upcast(d) for d, _ in kept if d.get("upcast") == "asm"}
    kept = [(d, t) for d, t in kept if d.get("upcast") != "bits" or _without_upcast(d) not in asm_tiles]
    if max_count is None or len(kept) <= max_count:
        return [t for _, t in kept]
    seed_dicts = [json.loads(t) for t in seeds]
    near = [t for d, t in kept if any(_knobs_apart(d, sd) <= 1 for sd in seed_dicts)]
    near.sort(key=lambda t: min(_knobs_apart(json.loads(t), sd) for sd in seed_dicts))  # seeds first
    out = near[: max_count // 2]
    chosen = set(out)
    rest = [(d, t) for d, t in kept if t not in chosen]
    groups: dict[tuple[Any, Any], list[str]] = {}
    for d, t in rest:
        groups.setdefault((d.get("block_m"), d.get("upcast"), d.get("weight_load")), []).append(t)
    # Round robin over the groups, each walked in an evenly spreading order, until the budget is
    # spent: every group gets its turn before any group gets a second one.
    walks = [[g[i] for i in _spread_order(len(g))] for _, g in sorted(groups.items(), key=lambda kv: str(kv[0]))]
    budget = max_count - len(out)
    for turn in range(max((len(w) for w in walks), default=0)):
        for w in walks:
            if turn < len(w) and budget > 0:
                out.append(w[turn])
                budget -= 1
    return out


def _spread_order(n: int) -> list[int]:
    """Indices ``0..n-1`` so that every prefix is spread evenly: 0, n/2, n/4, 3n/4, ..."""
    order: list[int] = []
    seen: set[int] = set()
    parts = 1
    while len(order) < n:
        for j in range(parts):
            i = j * n // parts
            if i not in seen:
                seen.add(i)
                order.append(i)
        parts *= 2
        if parts > 2 * n:
            order.extend(i for i in range(n) if i not in seen)
            break
    return order


def _knobs_apart(a: Mapping[str, Any], b: Mapping[str, Any]) -> int:
    return sum(a.get(k) != b.get(k) for k in set(a) | set(b))


def _without_upcast(d: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in d.items() if k != "upcast"}, sort_keys=True)


# ------------------------------------------------------------------------ GPU worker process


class SubprocessBackend:
    """Runs candidates of the bundled kernel in a worker process pinned to one GPU.

    The worker compiles and launches; this side only sends JSON lines. A worker that dies, hangs
    past the timeout, or reports a sticky CUDA error is killed and started again on the next
    request, and the candidate in flight is reported as ``crash``/``timeout``/``sticky_cuda_error``.
    """

    def __init__(
        self,
        gpu: int | None = None,
        *,
        check_timeout_s: float = 600.0,
        time_timeout_s: float = 300.0,
        seed: int = 0,
        env: Mapping[str, str] | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        self.gpu = gpu
        # The worker command; tests substitute a small script that crashes or hangs on demand.
        self.argv = list(argv) if argv else [sys.executable, "-m", "prepkit.tune", "--worker", "--seed", str(seed)]
        self.check_timeout_s = check_timeout_s
        self.time_timeout_s = time_timeout_s
        self.seed = seed
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self.restarts = 0

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        if self.proc is not None:
            self.restarts += 1
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._buf = b""
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the parent, which cleans up
        )
        return self.proc

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def _readline(self, proc: subprocess.Popen[bytes], timeout: float) -> bytes | None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def request(self, req: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        proc = self._start()
        assert proc.stdin is not None
        try:
            proc.stdin.write((json.dumps(req) + "\n").encode())
            proc.stdin.flush()
            line = self._readline(proc, timeout)
        except (BrokenPipeError, EOFError):
            code = proc.wait()
            self._kill()
            raise CandidateError("crash", f"worker exited with code {code}") from None
        if line is None:
            self._kill()
            raise CandidateError("timeout", f"no answer within {timeout:.0f} s")
        reply = json.loads(line)
        if not reply.get("ok"):
            if reply.get("fatal"):
                self._kill()
            raise CandidateError(reply.get("status", "launch_error"), reply.get("error", ""))
        return dict(reply["result"])

    def describe(self) -> dict[str, Any]:
        """Device and software facts of the worker's GPU (the parent never initializes CUDA)."""
        try:
            return self.request({"op": "describe"}, 300.0)
        except CandidateError as err:
            raise DeviceError(f"the tuning worker could not start on GPU {self.gpu}: {err}") from err

    def check(self, problem: ProblemKey, tactic: str) -> CheckResult:
        r = self.request({"op": "check", "problem": _pk(problem), "tactic": tactic}, self.check_timeout_s)
        return CheckResult(**{**r, "m_values": tuple(r.get("m_values", ()))})

    def time(self, problem: ProblemKey, tactic: str, m: int) -> Timing:
        r = self.request({"op": "time", "problem": _pk(problem), "tactic": tactic, "m": m}, self.time_timeout_s)
        return Timing.from_samples(r["samples_us"])

    def time_layer(self, problem: ProblemKey, pair: tuple[str, str], m: int) -> Timing:
        """Whole-layer latency with an explicit (GEMM1, GEMM2) pair, for the final report."""
        r = self.request({"op": "time", "problem": _pk(problem), "pair": list(pair), "m": m}, self.time_timeout_s)
        return Timing.from_samples(r["samples_us"])

    def bandwidth_gbps(self) -> float:
        return float(self.request({"op": "bandwidth"}, 120.0)["gbps"])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                pass
        self._kill()
        self.proc = None


def _pk(problem: ProblemKey) -> dict[str, Any]:
    return dict(problem.__dict__)


def kernel_timing_scope() -> str:
    """``'gemm'`` when the kernel exposes its stages (each GEMM is timed alone), else ``'layer'``."""
    from prepkit.kernels import moe_mxfp4 as k

    return "gemm" if all(hasattr(k, f) for f in ("route", "gemm1_swiglu", "gemm2_combine")) else "layer"


def kernel_defaults(problem: ProblemKey, device: Any) -> Callable[[int], str]:
    """``m -> default tactic JSON`` of the bundled kernel for ``problem``'s role."""
    from prepkit.kernels.variants import default_tactics

    idx = 0 if problem.role == "gemm1" else 1

    def default_for(m: int) -> str:
        return canon(default_tactics(moe_problem(problem, m), device)[idx])

    return default_for


def kernel_candidates(
    problem: ProblemKey, device: Any, *, max_count: int | None = None, past_winners: Sequence[str] = ()
) -> list[str]:
    """The bundled kernel's valid variants for ``problem`` on ``device``, pruned for sweeping.
    ``past_winners`` (earlier winners of the same GEMM on this GPU model) seed the search next to
    the defaults where the current space still holds them; stale ones are dropped."""
    from prepkit.kernels.variants import enumerate_tactics

    space = [canon(t) for t in enumerate_tactics(problem.role, device, moe_problem(problem, MAX_TOKEN_POINT))]  # type: ignore[arg-type]
    default_for = kernel_defaults(problem, device)
    in_space = set(space)
    seeds = sorted({default_for(m) for m in TOKEN_POINTS} | (in_space & {canon(t) for t in past_winners}))
    return prune_candidates(space, problem.role, max_count=max_count, seeds=seeds)


def moe_problem(problem: ProblemKey, m: int) -> Any:
    """The kernels' ``MoeProblem`` for ``m`` tokens of the layer ``problem`` belongs to."""
    from prepkit.kernels.variants import MoeProblem

    hidden, inter = _layer_dims(problem)
    return MoeProblem(m, problem.num_experts, hidden, inter, problem.top_k)


def _layer_dims(problem: ProblemKey) -> tuple[int, int]:
    """``(hidden, valid intermediate)`` of the layer from one GEMM's N and K."""
    if problem.role == "gemm1":
        return problem.k, problem.n // 2
    return problem.n, problem.k


class _GpuBench:
    """Worker side: one full-size random layer of the problem, its reference, and timers.

    Weights are random MXFP4 codes with E8M0 scales drawn from a narrow valid range (never 0xFF),
    built in checkpoint form and converted by the real layout, so the numerics check compares
    layout + kernel against the fp32 oracle of :mod:`prepkit.kernels.reference`.
    """

    CHECK_M = (1, 7, 33, 256)
    TOLERANCE = 2e-2  # relative L2 error; bf16 activations and intermediate land near 4e-3

    def __init__(self, pk: Mapping[str, Any], seed: int) -> None:
        import torch

        from prepkit.kernels.device import DeviceInfo
        from prepkit.layouts.base import ExpertWeights, LayoutOptions, ModelDims, RankSpec
        from prepkit.layouts.triton_moe import LAYOUT
        from prepkit.runtime.moe import MoeLayer

        self.torch = torch
        self.problem = ProblemKey(**pk)
        # Without CUDA (TRITON_INTERPRET=1) the same code runs tiny problems on the CPU, so the
        # whole worker path can be exercised before any GPU time is spent.
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.dev.type == "cuda":
            self.info = DeviceInfo.from_torch(self.dev)
        else:
            from prepkit.kernels.device import H100

            self.info = H100
        E, top_k = self.problem.num_experts, self.problem.top_k
        H, I = _layer_dims(self.problem)
        self.H, self.I, self.E, self.top_k = H, I, E, top_k
        g = torch.Generator(device=self.dev).manual_seed(seed)

        def codes(*shape: int) -> torch.Tensor:
            return torch.randint(0, 256, shape, generator=g, device=self.dev, dtype=torch.uint8)

        def scales(*shape: int) -> torch.Tensor:
            # 2**-8 .. 2**-5: products of fp4 values (<= 6) stay in the range real weights have.
            return torch.randint(119, 123, shape, generator=g, device=self.dev, dtype=torch.uint8)

        self.source = ExpertWeights(
            gate_up_proj_blocks=codes(E, 2 * I, H // 32, 16),
            gate_up_proj_scales=scales(E, 2 * I, H // 32),
            gate_up_proj_bias=(torch.randn(E, 2 * I, generator=g, device=self.dev) * 0.1).to(torch.bfloat16),
            down_proj_blocks=codes(E, H, I // 32, 16),
            down_proj_scales=scales(E, H, I // 32),
            down_proj_bias=(torch.randn(E, H, generator=g, device=self.dev) * 0.1).to(torch.bfloat16),
        )
        plan = LAYOUT.plan_rank(ModelDims(1, E, H, I, top_k), RankSpec(), LayoutOptions())
        tensors = LAYOUT.build(self.source, plan)
        self.layer = MoeLayer.from_tensors(
            tensors, layout_id=LAYOUT.layout_id, num_experts=E, expert_range=(0, E),
            valid_intermediate=I, top_k=top_k, facts=plan.facts,
        )  # fmt: skip
        self.layer.device_info = self.info
        self.gen = g
        self._refs: dict[int, tuple[Any, Any, Any]] = {}
        self._inputs: dict[str, Any] = {}

    def pair(self, tactic: str | None, m: int, pair: Sequence[str] | None = None) -> tuple[Any, Any]:
        from prepkit.kernels.tactic import GemmTactic
        from prepkit.kernels.variants import default_tactics

        if pair is not None:
            return GemmTactic.from_json(pair[0]), GemmTactic.from_json(pair[1])
        g1, g2 = (self._runnable(t) for t in default_tactics(moe_problem(self.problem, m), self.info))
        assert tactic is not None
        t = GemmTactic.from_json(tactic)
        return (t, g2) if self.problem.role == "gemm1" else (g1, t)

    def check(self, tactic: str) -> dict[str, Any]:
        from prepkit.kernels.reference import moe_reference, relative_error
        from prepkit.runtime.moe import moe

        torch = self.torch
        worst, max_abs, bad = 0.0, 0.0, 0
        for m in self.CHECK_M:
            if m not in self._refs:
                x = torch.randn(m, self.H, device=self.dev, generator=self.gen).to(torch.bfloat16)
                logits = torch.randn(m, self.E, device=self.dev, generator=self.gen)
                ref = moe_reference(x, logits, self.source.as_dict(), top_k=self.top_k)
                self._refs[m] = (x, logits, ref)
            x, logits, ref = self._refs[m]
            out = moe(self.layer, x, logits, tactics=self.pair(tactic, m), out_dtype=torch.float32)
            if self.dev.type == "cuda":
                torch.cuda.synchronize()
            bad += int((~torch.isfinite(out)).sum())
            worst = max(worst, relative_error(out, ref))
            max_abs = max(max_abs, float((out.double() - ref.double()).abs().max()) if out.numel() else 0.0)
        return {
            "passed": bad == 0 and worst <= self.TOLERANCE, "m_values": list(self.CHECK_M),
            "reference": "fp32_source_dequant", "max_abs_err": max_abs, "rel_err": worst,
            "nan_inf_count": bad, "tolerance": self.TOLERANCE,
        }  # fmt: skip

    ROTATE = 8  # input sets a graph cycles through: different experts each launch, cold weights

    def _launcher(self, tactic: str | None, m: int, pair: Sequence[str] | None) -> tuple[Callable[[int], Any], str]:
        """``launch(i)`` for input set ``i`` and what it covers: the swept GEMM alone when the
        kernel exposes its stages (routing and the other GEMM run once, outside the timing),
        else the whole layer."""
        from prepkit.kernels import moe_mxfp4 as k
        from prepkit.runtime.moe import moe

        torch = self.torch
        layer = self.layer
        if self._inputs.get("m") != m:
            self._inputs = {"m": m}  # one token count's buffers at a time
        if "xs" not in self._inputs:
            self._inputs["xs"] = [
                torch.randn(m, self.H, device=self.dev, generator=self.gen).to(torch.bfloat16)
                for _ in range(self.ROTATE)
            ]
            self._inputs["ls"] = [
                torch.randn(m, self.E, device=self.dev, generator=self.gen) for _ in range(self.ROTATE)
            ]
        xs, ls = self._inputs["xs"], self._inputs["ls"]
        staged = all(hasattr(k, f) for f in ("route", "gemm1_swiglu", "gemm2_combine"))
        if pair is not None or not staged:
            tactics = self.pair(tactic, m, pair)
            return (lambda i: moe(layer, xs[i], ls[i], tactics=tactics)), "layer"
        g1, _ = self.pair(None, m, [self._default(m, 0), self._default(m, 1)])
        small = layer.small_scales
        w13 = (layer.w13_blocks, layer.w13_scales, layer.w13_bias)
        if "routings" not in self._inputs:
            rs = [
                k.route(ls[i], top_k=self.top_k, expert_lo=0, num_local_experts=self.E, hidden=self.H)
                for i in range(self.ROTATE)
            ]
            h1s = [
                k.gemm1_swiglu(rs[i], xs[i], *w13, valid_intermediate=self.I, tactic=g1, small_scales=small[0])
                for i in range(self.ROTATE)
            ]
            self._inputs["routings"], self._inputs["h1s"] = rs, h1s
        rs, h1s = self._inputs["routings"], self._inputs["h1s"]
        t = self.pair(tactic, m)[0 if self.problem.role == "gemm1" else 1]
        if self.problem.role == "gemm1":

            def run_gemm1(i: int) -> Any:
                return k.gemm1_swiglu(rs[i], xs[i], *w13, valid_intermediate=self.I, tactic=t, small_scales=small[0])

            return run_gemm1, "gemm1"
        w2 = (layer.w2_blocks, layer.w2_scales, layer.w2_bias if layer.apply_down_bias else None)

        def run_gemm2(i: int) -> Any:
            return k.gemm2_combine(rs[i], h1s[i], *w2, tactic=t, small_scales=small[1])

        return run_gemm2, "gemm2"

    def _default(self, m: int, idx: int) -> str:
        from prepkit.kernels.variants import default_tactics

        return canon(self._runnable(default_tactics(moe_problem(self.problem, m), self.info)[idx]))

    def _runnable(self, t: Any) -> Any:
        # The interpreter cannot run inline PTX; on the CPU the default upcast falls back to bits.
        if self.dev.type != "cuda" and getattr(t, "upcast", None) == "asm":
            from dataclasses import replace

            return replace(t, upcast="bits")
        return t

    def time(self, tactic: str | None, m: int, pair: Sequence[str] | None = None) -> dict[str, Any]:
        """Samples of one launch: a CUDA graph of ``reps`` launches cycling through fresh inputs,
        replayed ``samples`` times; reps and samples scale with the launch's length."""
        torch = self.torch
        launch, scope = self._launcher(tactic, m, pair)
        if self.dev.type != "cuda":
            samples = []
            for i in range(3):
                t = time.perf_counter()
                launch(i % self.ROTATE)
                samples.append((time.perf_counter() - t) * 1e6)
            return {"samples_us": samples, "reps": 1, "scope": scope}
        for i in range(2):  # compile and warm up outside the graph
            launch(i)
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        launch(0)
        t1.record()
        torch.cuda.synchronize()
        est_us = max(t0.elapsed_time(t1) * 1e3, 1.0)
        reps = int(min(4 * self.ROTATE, max(1, 2000 // est_us)))
        n_samples = int(min(30, max(7, 60_000 // (est_us * reps))))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(min(reps, self.ROTATE)):  # let the allocator see the shapes first
                launch(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                launch(i % self.ROTATE)
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(n_samples):
            t0.record()
            graph.replay()
            t1.record()
            t1.synchronize()
            samples.append(t0.elapsed_time(t1) * 1e3 / reps)
        del graph
        return {"samples_us": samples, "reps": reps, "scope": scope}


def _describe() -> dict[str, Any]:
    from dataclasses import asdict

    from prepkit.kernels.device import DeviceInfo
    from prepkit.runtime.tactics import Environment

    env = Environment.current()
    kinfo = DeviceInfo.from_torch()
    return {
        "environment": asdict(env),
        "device_info": {**asdict(kinfo), "capability": list(kinfo.capability)},
    }


def _classify(err: BaseException) -> tuple[str, bool]:
    """Status of a failed request and whether the CUDA context is unusable (restart the worker)."""
    name = type(err).__name__
    text = str(err)
    if name == "OutOfResources" or "out of resource" in text.lower():
        status = "out_of_resources"
    elif "Compil" in name or "PassManager" in text or "ptxas" in text:
        status = "compile_error"
    else:
        status = "launch_error"
    try:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.zeros(1, device="cuda").add_(1).item()
    except Exception:
        return "sticky_cuda_error", True
    return status, False


def _worker_main(seed: int) -> int:
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    benches: dict[str, _GpuBench] = {}

    def bench(pk: Mapping[str, Any]) -> _GpuBench:
        key = canonical_json(dict(pk))
        if key not in benches:
            benches.clear()  # one layer's weights on the GPU at a time
            benches[key] = _GpuBench(pk, seed)
        return benches[key]

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "quit":
            break
        try:
            if op == "describe":
                result = _describe()
            elif op == "bandwidth":
                result = _bandwidth_only()
            elif op == "check":
                result = bench(req["problem"]).check(req["tactic"])
            elif op == "time":
                result = bench(req["problem"]).time(req.get("tactic"), int(req["m"]), req.get("pair"))
            else:
                raise ValueError(f"unknown op {op!r}")
            reply: dict[str, Any] = {"ok": True, "result": result}
        except Exception as err:  # every failure is data for the blocklist
            status, fatal = _classify(err)
            text = f"{type(err).__name__}: {err}"[:2000]
            reply = {"ok": False, "status": status, "fatal": fatal, "error": text}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()
        if not reply["ok"] and reply.get("fatal"):
            return 3
    return 0


def _bandwidth_only() -> dict[str, Any]:
    import torch

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        t0.record()
        b.copy_(a)
        t1.record()
        t1.synchronize()
        best = min(best, t0.elapsed_time(t1))
    return {"gbps": 2 * n / (best * 1e-3) / 1e9}  # bytes read plus bytes written


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="prepkit tuning worker (started by `prepkit tune`)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--seed", type=int, default=0)
    sys.exit(_worker_main(ap.parse_args().seed))
