"""The token counts the tuner measures and the tactics DB keys its ranges by.

Standard library only: the kernels' compile checks, the tuner and the runtime all read it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def _series() -> tuple[int, ...]:
    # Every integer 1-8 (decode and speculative widths), then 1.5x and 2x steps up to 8192: the
    # latency curve bends where tiles fill, and these steps land on both sides of each bend.
    pts = list(range(1, 9))
    p = 8
    while p < 8192:
        pts.extend((p + p // 2, 2 * p))
        p *= 2
    return tuple(pts)


TOKEN_POINTS: tuple[int, ...] = _series()
MAX_TOKEN_POINT = TOKEN_POINTS[-1]


def point_for(num_tokens: int, points: Sequence[int] = TOKEN_POINTS) -> int | None:
    """The tuned point that serves ``num_tokens`` under ceil semantics (None above the last)."""
    i = bisect_left(points, num_tokens)
    return points[i] if i < len(points) else None
