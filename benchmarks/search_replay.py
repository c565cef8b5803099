"""Replay the pruned search on the timings a thorough search stored: no GPU needed.

A thorough run times every valid variant at its anchors. Those timings are a map of the variant
space at those token counts, and the pruned search can be run again on it, with a stand-in
backend that answers from the map: which variants it would take up, which it would pick, and how
far its picks land from the best the map holds (by the same rule, ``min_gain`` over the default).
That tests a change to the pruning or the refinement against measured data before any GPU time.

What the map is: a thorough run keeps a quick screen of every variant and, where a variant was
timed in full (the survivors and the defaults), the full timing instead
(:meth:`prepkit.tactics.store.TacticsDB.measured`). Screens read some percent off full timings, in
either direction, so a replay is a guide and a pick it predicts is confirmed on the GPU. A variant
the map lacks (a partial run) answers as never fast, and the result counts such variants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prepkit.tactics.keys import ProblemKey, canon
from prepkit.tune.backend import FunctionBackend
from prepkit.tune.candidates import kernel_candidates, kernel_defaults, neighbourhood, rule_space
from prepkit.tune.records import OK, Measurement, Timing
from prepkit.tune.sweep import SweepConfig, choose, sweep

if TYPE_CHECKING:
    from prepkit.kernels.device import DeviceInfo
    from prepkit.tactics.store import TacticsDB

# What a variant the map lacks answers: slower than anything a GPU measures.
UNMAPPED_US = 1e9


@dataclass(frozen=True)
class ReplayResult:
    problem: ProblemKey
    points: tuple[int, ...]
    picks: dict[int, str]  # the replayed search's tactic per point
    best: dict[int, str]  # the map's choice per point (the thorough search's rule)
    us: dict[tuple[int, str], float]  # the map
    checks: int  # variants the replayed search checked
    timings: int  # timings it asked for
    unmapped: int  # variants of the search space the map lacks at some point

    def miss(self, m: int) -> float:
        """How much slower the replayed pick is than the map's choice at ``m``, as a fraction."""
        return self.us.get((m, self.picks[m]), UNMAPPED_US) / self.us[(m, self.best[m])] - 1


def timing_map(measured: Mapping[tuple[int, str], Mapping[str, object]]) -> dict[tuple[int, str], float]:
    """``(m, tactic JSON) -> median µs`` of the rows :meth:`~prepkit.tactics.store.TacticsDB.measured`
    returns (the ones that ran)."""
    out: dict[tuple[int, str], float] = {}
    for (m, t), row in measured.items():
        us = row.get("median_us")
        if row.get("status") == OK and isinstance(us, int | float):
            out[(int(m), canon(t))] = float(us)
    return out


def env_device(tdb: TacticsDB, env_hash: str) -> DeviceInfo:
    """The device facts the pruning needs, as the environment ``env_hash`` recorded them.

    Raises:
        TacticsError: no such environment.
    """
    from prepkit.kernels.device import DeviceInfo

    r = tdb.env_row(env_hash)
    capability = (int(r["cc_major"]), int(r["cc_minor"]))
    return DeviceInfo(r["gpu_name"], capability, int(r["sm_count"]), int(r["smem_per_block_optin"]), int(r["l2_bytes"]))


def replay(
    problem: ProblemKey,
    device: DeviceInfo,
    us: Mapping[tuple[int, str], float],
    points: Sequence[int],
    *,
    refine: bool = True,
    max_candidates: int = 64,
    keep: int = SweepConfig.keep_per_anchor,
    past_winners: Sequence[str] = (),
    refine_seeds: int = SweepConfig.refine_seeds,
    refine_rounds: int = SweepConfig.refine_rounds,
) -> ReplayResult:
    """The pruned search (``refine``: with its local refinement, ``refine_seeds`` and
    ``refine_rounds`` as in :class:`~prepkit.tune.sweep.SweepConfig`) on the map ``us``, with
    every point an anchor (a thorough run's points are its anchors)."""
    pts = tuple(sorted(set(points)))
    default_for = kernel_defaults(problem, device)
    cands = kernel_candidates(problem, device, max_count=max_candidates, past_winners=past_winners, points=pts)

    def timer(t: str, m: int) -> Timing:
        x = us.get((m, t), UNMAPPED_US)
        return Timing(x, x, x, x, 1)

    backend = FunctionBackend(timer)
    config = SweepConfig(
        points=pts, anchors=pts, keep_per_anchor=keep, refine_seeds=refine_seeds,
        refine_rounds=refine_rounds if refine else 0,
    )  # fmt: skip
    space = rule_space(problem, device)
    res = sweep(problem, cands, default_for, [backend], config=config, neighbours=neighbourhood(space))
    best = {}
    for m in pts:
        timed = {t: Measurement(m, t, OK, Timing(x, x, x, x, 1)) for (mm, t), x in us.items() if mm == m}
        choice = choose(m, default_for(m), timed, passed=set(timed), failed=set())
        best[m] = choice.winner or choice.default
    return ReplayResult(
        problem=problem,
        points=pts,
        picks={c.m: c.winner or c.default for c in res.choices},
        best=best,
        us=dict(us),
        checks=sum(op == "check" for op, _, _ in backend.calls),
        timings=sum(op == "time" for op, _, _ in backend.calls),
        unmapped=sum(any((m, t) not in us for m in pts) for t in space),
    )
