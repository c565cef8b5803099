"""How a sweep runs (:class:`SweepConfig`) and what it is told of the DB (:data:`PreviousRecords`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prepkit.tactics.lookup import MAX_TOKEN_POINT, TOKEN_POINTS
from prepkit.tactics.schema import SEARCHES

ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class RetimeConfig:
    """Close calls: where a sweep picks a winner, the candidates within ``margin`` of the best
    median are timed again in ``rounds`` rounds, the order rotated each round, and compared by
    their median over the rounds. One-shot timings drift 4-13 % within a sweep at large token
    counts (docs/tuning.md), more than the gap between the best few variants."""

    margin: float = 0.05
    rounds: int = 3

    def __post_init__(self) -> None:
        if not self.margin >= 0.0:
            raise ValueError(f"retime margin must be a fraction >= 0, got {self.margin}")
        if self.rounds < 1:
            raise ValueError(f"retime rounds must be at least 1, got {self.rounds}")

    @property
    def enabled(self) -> bool:
        """One round would only repeat the one-shot timing."""
        return self.rounds > 1


# The one setting every sweep (MoE, dense and decode) retimes its close calls with.
RETIME = RetimeConfig()


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
    search: str = "pruned"  # or "thorough": every candidate at the anchors, in small stored groups
    anchor_group: int = 8  # variants per job of a thorough anchor phase (stored together)
    # The pruned search's local refinement: the variants one move away from each anchor's best
    # few, timed at that anchor, for a few rounds while those best few change (docs/tuning.md).
    refine_seeds: int = 3
    refine_rounds: int = 2
    retime: RetimeConfig = RETIME  # close calls at each point, timed again in rotated rounds

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ValueError(f"unknown search {self.search!r} (expected one of {SEARCHES})")

    @property
    def thorough(self) -> bool:
        return self.search == "thorough"


# What the DB already holds for a problem: measurement rows by (m, tactic JSON), correctness rows by
# tactic JSON, and the blocklisted tactics.
PreviousRecords = tuple[Mapping[tuple[int, str], Mapping[str, Any]], Mapping[str, Mapping[str, Any]], set[str]]
