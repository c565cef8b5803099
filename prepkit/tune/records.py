"""What a sweep produces: timings, numerics checks, per-point choices, winner ranges, reports.

Plain records with no behaviour beyond summaries; the store turns them into rows
(:class:`prepkit.tactics.store.RunRecorder`) and the CLI into tables.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prepkit.tactics.keys import ProblemKey
from prepkit.tactics.schema import SCREEN_KIND

OK = "ok"
# A check the GPU had no memory for (other workers held it): says nothing of the variant, which is
# neither recorded nor blocklisted; the run stays partial and a rerun checks it again.
OUT_OF_MEMORY = "out_of_memory"
# Statuses of a failed candidate; all of them put the tactic on the blocklist.
FAILURES = (
    "numerics_fail", "compile_error", "out_of_resources", "launch_error", "sticky_cuda_error",
    "crash", "timeout",
)  # fmt: skip


def geomean(values: Sequence[float]) -> float | None:
    """Geometric mean of positive values; ``None`` for none."""
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


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
class Screen:
    """A quick timing that ranks variants (a thorough search's anchors): a few samples, and none
    past the first launch when that launch is far slower than ``cutoff_us``, the best so far."""

    cutoff_us: float | None = None
    samples: int = 3
    # Cut only a launch this much slower than the cutoff, and only where one plain launch is long
    # enough that the host's share of it (argument checks, descriptors: up to a few hundred µs,
    # which a graph hides) cannot be what makes it slower. A 100 µs floor cut nearly every variant
    # at 1 token on an H100, the fastest among them.
    cut_ratio: float = 1.5
    cut_min_us: float = 1000.0

    def cuts(self, first_launch_us: float) -> bool:
        return (
            self.cutoff_us is not None
            and first_launch_us >= self.cut_min_us
            and first_launch_us > self.cut_ratio * self.cutoff_us
        )


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
    # A thorough search's quick timing: ranks variants, never chooses a winner (SCREEN_KIND).
    screen: bool = False

    def row(self) -> dict[str, Any]:
        t = self.timing
        return {
            "m": self.m, "params_json": self.tactic, "status": self.status, "error_text": self.error,
            "is_default": self.is_default, "kind": SCREEN_KIND if self.screen else None,
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

    phase: str  # 'check' | 'anchor' | 'point' | 'retime'
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
    retimed: int = 0  # rounds the close calls were timed again in before this choice (0: none)

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


@dataclass(frozen=True)
class Coverage:
    """How much of the variant space a sweep of one GEMM covered."""

    search: str  # 'pruned' | 'thorough' (prepkit.tactics.schema.SEARCHES)
    activations: str  # the problem's activation policy
    valid: int | None  # valid variants of the kernel for the problem (None: not given)
    candidates: int  # variants the search took up (all valid ones in a thorough search)
    checked: int  # candidates with a numerics result, this run's or an earlier one's
    failed: int  # candidates that failed a check or a timing, or were blocklisted before
    measured: int  # candidates timed at least once without error
    anchors: tuple[int, ...] = ()  # token counts every candidate was timed at (none: no anchor phase)

    def record(self) -> dict[str, Any]:
        return {**self.__dict__, "anchors": list(self.anchors)}


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
    coverage: Coverage | None = None
    n_retimed: int = 0  # timings of close calls in rounds, besides the n_timed pairs
    label: str = ""  # what people call the problem ("dense mxfp4 qkv 5120x2880"); empty: its describe()

    def geomean_speedup(self) -> float | None:
        """Geometric mean over token points of default / chosen latency (1.0 where kept)."""
        return geomean([c.speedup for c in self.choices if c.speedup])

    def record(self) -> dict[str, Any]:
        """What a tuning run keeps of this sweep in its notes (``tuning_run.notes``): how long it
        took, what it covered, and per token point the default's and the chosen tactic's median.
        ``winner`` is the chosen tactic's JSON (the default's where it was kept); a later run's
        winner ranges replace this run's, so a comparison of two searches reads these records."""
        return {
            "problem_hash": self.problem.problem_hash(),
            "problem": self.problem.describe(),
            **({"label": self.label} if self.label else {}),
            "role": self.problem.role,
            "act_dtype": self.problem.act_dtype,
            "elapsed_s": round(self.elapsed_s, 3),
            "complete": self.complete,
            "coverage": self.coverage.record() if self.coverage else None,
            "points": [
                {"m": c.m, "default": c.default, "default_us": c.default_us, "winner": c.winner,
                 "winner_us": c.winner_us, "why": c.why, "retimed": c.retimed}
                for c in self.choices
            ],
        }  # fmt: skip


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
        return geomean([p.speedup for p in self.layer_points if p.speedup])
