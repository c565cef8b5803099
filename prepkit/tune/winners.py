"""Reading a sweep's measurements: which variant wins each token point (:func:`choose`), the
winner ranges they merge into, and what a sweep has timed."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence

from prepkit.tactics.lookup import merge_points
from prepkit.tune.records import OK, Measurement, PointChoice, WinnerRange, geomean


def measured_ok(meas: Measurement | None) -> bool:
    return meas is not None and meas.status == OK and meas.timing is not None


def median_us(meas: Measurement | None) -> float:
    """The median of a measurement :func:`measured_ok` accepted."""
    assert meas is not None and meas.timing is not None
    return meas.timing.median_us


def choose(
    m: int,
    default: str,
    timed: Mapping[str, Measurement],
    *,
    passed: set[str],
    failed: set[str],
    min_gain: float = 0.03,
    disjoint: bool = True,
    retimed: int = 0,
) -> PointChoice:
    """The tactic for token point ``m``: the default unless beaten beyond noise.

    Only candidates that passed the numerics check, never failed, and were timed OK in full (not
    only screened) compete.
    """
    ok = {t: x for t, x in timed.items() if measured_ok(x) and not x.screen and t in passed and t not in failed}
    if not ok:
        return PointChoice(m, None, default, None, None, why="nothing measured", retimed=retimed)
    ranked = sorted(ok, key=lambda t: (median_us(ok[t]), t))
    best = ranked[0]
    dm = ok.get(default)
    bt = ok[best].timing
    assert bt is not None
    if dm is None and default in passed and default not in failed:
        # A run cut short before it timed the default has nothing to compare with: no choice yet.
        return PointChoice(m, None, default, None, None, why="default not timed yet", retimed=retimed)
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
    gap = median_us(ok[ru]) / wt.median_us - 1.0 if ru else None
    return PointChoice(
        m, winner, default, wt.median_us, dm.timing.median_us if dm and dm.timing else None,
        runner_up=ru, runner_up_gap=gap, why=why, retimed=retimed,
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


def timed_at_every(tactic: str, anchors: Iterable[int], timed: Container[tuple[int, str]]) -> bool:
    """Whether ``timed`` (pairs of token count and tactic) holds ``tactic`` at each anchor: the one
    rule for what a thorough sweep has screened and what a refinement has explored."""
    return all((m, tactic) in timed for m in anchors)
