"""The range rule: per-point winners grouped into token ranges, and ranges expanded for lookup.

Token ranges use ceil semantics: the value measured at token point M serves ``(previous point,
M]``; above the last tuned point only a range marked ``extends_up`` serves. :func:`merge_points`
and :class:`RangeTable` are the one implementation of that rule; the tuner, the store and the
runtime all use them. Standard library only.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V", bound=Hashable)


@dataclass(frozen=True)
class Range(Generic[V]):
    """``value`` serves token counts ``m_lo..m_hi`` (and above, when ``extends_up``)."""

    m_lo: int
    m_hi: int
    value: V
    extends_up: bool = False


def merge_points(points: Sequence[int], winners: Sequence[V | None]) -> list[tuple[int, int, list[int]]]:
    """Group per-point winners into ranges with ceil semantics.

    ``points`` ascending positive; ``winners[i]`` is the value chosen at ``points[i]`` (``None``:
    no winner, the range is left to the default). Adjacent points with the same value share one
    range. Returns ``(m_lo, m_hi, indices of the points in the range)`` per range.

    Raises:
        ValueError: lengths differ, or the points are not ascending positive integers.
    """
    pts = list(points)
    if len(pts) != len(winners):
        raise ValueError("points and winners differ in length")
    if any(b <= a for a, b in zip(pts, pts[1:], strict=False)) or (pts and pts[0] < 1):
        raise ValueError(f"token points must be ascending positive integers, got {pts}")
    out: list[tuple[int, int, list[int]]] = []
    group: list[int] = []
    lo = 1
    for i, w in enumerate(winners):
        prev = pts[i - 1] if i else 0
        if w is None:
            if group:
                out.append((lo, pts[group[-1]], group))
            group = []
        elif group and winners[group[-1]] == w:
            group.append(i)
        else:
            if group:
                out.append((lo, pts[group[-1]], group))
            group, lo = [i], prev + 1
    if group:
        out.append((lo, pts[group[-1]], group))
    return out


class RangeTable(Generic[V]):
    """Ranges expanded for O(1) lookup by token count."""

    def __init__(self, ranges: Sequence[Range[V]]) -> None:
        top = max((r.m_hi for r in ranges), default=0)
        dense: list[V | None] = [None] * (top + 1)
        for r in ranges:
            for m in range(r.m_lo, r.m_hi + 1):
                dense[m] = r.value
        self._dense = dense
        last = max(ranges, key=lambda r: r.m_hi, default=None)
        self._up = last.value if last is not None and last.extends_up else None

    @property
    def max_tuned(self) -> int:
        return len(self._dense) - 1

    def get(self, num_tokens: int) -> V | None:
        """The value serving ``num_tokens``, or ``None`` (the default serves it)."""
        if 0 < num_tokens < len(self._dense):
            return self._dense[num_tokens]
        if num_tokens >= len(self._dense):
            return self._up
        return None
