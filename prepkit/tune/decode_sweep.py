"""Sweep a decode kernel's variants for one problem: check each against the kernel's reference,
time those that pass, retime the close calls in rounds, and pick the fastest.

A decode problem fixes its batch, so there are no token points or ranges: one winner per
(device, kernel, problem), stored by the caller (:meth:`~prepkit.tactics.store.TacticsDB.put_decode_winner`)
and read at run time by :func:`prepkit.tactics.decode_lookup.decode_variant`. Measuring is
delegated to a :class:`DecodeBackend`: a GPU worker process, or
:class:`~prepkit.tune.decode_bench.LocalDecodeBackend` in this process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prepkit.kernels.decode.variants import DecodeKernel, DecodeProblem
from prepkit.tactics.decode_lookup import decode_kernel_version
from prepkit.tactics.store.writes import DecodeWinnerRow
from prepkit.tune.records import CandidateError, CheckResult, Timing
from prepkit.tune.retime import close_calls, retime
from prepkit.tune.sweep_config import RETIME, ProgressFn, RetimeConfig


class DecodeBackend(Protocol):
    """Checks and times decode variants (by :meth:`DecodeVariant.name`) on one device. Methods
    raise :class:`CandidateError` for a variant that does not run."""

    def check_decode(self, problem: DecodeProblem, variant: str) -> CheckResult: ...

    def time_decode(self, problem: DecodeProblem, variant: str) -> Timing: ...


@dataclass
class DecodeResult:
    """What the sweep of one decode problem found."""

    problem: DecodeProblem
    label: str
    default: str
    winner: str | None  # None: no variant passed and was timed
    winner_us: float | None
    default_us: float | None
    retimed: int  # rounds the close calls were timed again in (0: none)
    checks: dict[str, CheckResult] = field(default_factory=dict)
    timings: dict[str, Timing] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # variant -> why it is out
    complete: bool = True
    elapsed_s: float = 0.0

    @property
    def speedup(self) -> float | None:
        return self.default_us / self.winner_us if self.default_us and self.winner_us else None

    def record(self) -> dict[str, Any]:
        """The sweep as plain data (``prepkit tune --json``, the run's notes)."""
        return {
            "kernel": self.problem.kernel, "problem": self.problem.key(), "name": self.label,
            "default": self.default, "default_us": self.default_us, "winner": self.winner,
            "winner_us": self.winner_us, "speedup": self.speedup, "retimed": self.retimed,
            "checked": len(self.checks), "timed": len(self.timings), "failed": len(self.failed),
            "complete": self.complete, "elapsed_s": round(self.elapsed_s, 3),
        }  # fmt: skip


def _reason(r: CheckResult) -> str:
    if r.error:
        return r.error
    nans = f", {r.nan_inf_count} NaN/Inf" if r.nan_inf_count else ""
    return f"numerics_fail: rel_err={r.rel_err} > {r.tolerance}{nans}"


def sweep_decode(
    problem: DecodeProblem,
    kernel: DecodeKernel,
    backend: DecodeBackend,
    *,
    retime_config: RetimeConfig = RETIME,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    label: str | None = None,
) -> DecodeResult:
    """Check every candidate of ``kernel`` for ``problem`` (the default first), time those that
    pass, time the close calls again in rotated rounds, and pick the fastest median. A variant
    that fails its check or its timing is never the winner. Past ``deadline`` (on ``clock``) the
    sweep stops and says it is incomplete."""
    start = clock()
    default = kernel.default(problem).name()
    names = list(dict.fromkeys([default, *(v.name() for v in kernel.candidates(problem))]))
    res = DecodeResult(problem, label or problem.key(), default, None, None, None, 0)
    for name in names:
        if deadline is not None and clock() > deadline:
            res.complete = False
            break
        try:
            check = backend.check_decode(problem, name)
        except CandidateError as err:
            res.failed[name] = f"{err.status}: {err.text}"
            continue
        res.checks[name] = check
        if not check.passed:
            res.failed[name] = _reason(check)
            continue
        try:
            timing = backend.time_decode(problem, name)
        except CandidateError as err:
            res.failed[name] = f"{err.status}: {err.text}"
            continue
        if not (timing.median_us > 0 and math.isfinite(timing.median_us)):
            res.failed[name] = f"launch_error: implausible time {timing.median_us} us"
            continue
        res.timings[name] = timing
    close = close_calls({n: t.median_us for n, t in res.timings.items()}, retime_config.margin)
    if retime_config.enabled and len(close) > 1 and (deadline is None or clock() <= deadline):
        try:
            res.timings.update(retime(close, lambda n: backend.time_decode(problem, n), retime_config.rounds))
            res.retimed = retime_config.rounds
        except CandidateError:
            pass  # a variant that fails now: the one-shot timings stand
    if res.timings:
        res.winner = min(res.timings, key=lambda n: (res.timings[n].median_us, n))
        res.winner_us = res.timings[res.winner].median_us
    res.default_us = res.timings[default].median_us if default in res.timings else None
    res.elapsed_s = clock() - start
    return res


def decode_winner_row(result: DecodeResult, kernel: DecodeKernel) -> DecodeWinnerRow | None:
    """The row a finished sweep stores; none for a sweep cut short (it would replace a complete
    one's winner with the best of a part) or one where no variant passed."""
    if not result.complete or result.winner is None or result.winner_us is None:
        return None
    return DecodeWinnerRow(
        kernel=result.problem.kernel, problem_key=result.problem.key(), variant=result.winner,
        kernel_version=decode_kernel_version(kernel), median_us=result.winner_us, default_variant=result.default,
        default_median_us=result.default_us, retimed=result.retimed,
    )  # fmt: skip


def tune_decode(
    targets: Sequence[Any],
    kernels: Mapping[str, DecodeKernel],
    backend: DecodeBackend,
    *,
    budget_s: float | None = None,
    retime_config: RetimeConfig = RETIME,
    on_result: Callable[[DecodeResult], object] | None = None,
    on_progress: ProgressFn | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[DecodeResult], list[str]]:
    """Sweep each target (a :class:`~prepkit.tune.decode_problems.DecodeTarget`: ``problem`` and
    ``label``) whose kernel is registered, in turn, under one budget. Returns the results and a
    note per kernel that is not registered (its problems are left out)."""
    deadline = None if budget_s is None else clock() + budget_s
    missing = sorted({t.problem.kernel for t in targets if t.problem.kernel not in kernels})
    notes = [f"decode kernel {k!r} is not registered: its problems were not tuned" for k in missing]
    todo = [t for t in targets if t.problem.kernel in kernels]
    results: list[DecodeResult] = []
    for i, t in enumerate(todo):
        if on_progress:
            on_progress("decode kernels", i, len(todo))
        res = sweep_decode(
            t.problem, kernels[t.problem.kernel], backend, retime_config=retime_config, deadline=deadline,
            clock=clock, label=t.label,
        )  # fmt: skip
        results.append(res)
        if on_result:
            on_result(res)
    if on_progress and todo:
        on_progress("decode kernels", len(todo), len(todo))
    return results, notes
