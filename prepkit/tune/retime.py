"""Close calls timed again: the candidates within a margin of the best are timed in rounds, the
order rotated each round so that a clock drifting within a round favours none of them, and each is
judged by its median over the rounds (:class:`~prepkit.tune.sweep_config.RetimeConfig`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar

from prepkit.tune.records import Timing

T = TypeVar("T")


def close_calls(medians: Mapping[str, float], margin: float) -> list[str]:
    """The candidates whose median lies within ``margin`` (a fraction) of the best, best first
    (ties by name, so the order depends on the timings alone)."""
    if not medians:
        return []
    best = min(medians.values())
    near = [t for t, us in medians.items() if us <= best * (1.0 + margin)]
    return sorted(near, key=lambda t: (medians[t], t))


def rotated(order: Sequence[T], r: int) -> list[T]:
    """``order`` started at its ``r``-th entry (round ``r`` of a retime)."""
    start = r % len(order)
    return [*order[start:], *order[:start]]


def over_rounds(timings: Sequence[Timing]) -> Timing:
    """One timing of several rounds: the median of the rounds' medians; spread, mean and count
    from every sample of every round."""
    if not timings:
        raise ValueError("no rounds to combine")
    pooled = [s for t in timings for s in (t.samples_us or (t.median_us,))]
    return replace(Timing.from_samples(pooled), median_us=statistics.median(t.median_us for t in timings))


def retime(candidates: Sequence[str], time_one: Callable[[str], Timing], rounds: int) -> dict[str, Timing]:
    """Time each of ``candidates`` once per round, for ``rounds`` rounds, round ``r`` starting at
    the ``r``-th candidate; returns each one's :func:`over_rounds` timing. ``time_one``'s errors
    pass through (a caller keeps the one-shot timings then)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    taken: dict[str, list[Timing]] = {t: [] for t in candidates}
    for r in range(rounds):
        for t in rotated(list(taken), r):
            taken[t].append(time_one(t))
    return {t: over_rounds(ts) for t, ts in taken.items()}
