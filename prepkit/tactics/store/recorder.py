"""What a sweep reports, stored one transaction per batch: the recorder and the record shapes it takes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from prepkit.tactics import schema
from prepkit.tactics.keys import Environment, ProblemKey
from prepkit.tactics.store.db import TacticsDB
from prepkit.tactics.store.writes import WinnerRow


class RowRecord(Protocol):
    """A sweep record that is one DB row (a measurement or a correctness check)."""

    def row(self) -> Mapping[str, Any]: ...


class BatchRecord(Protocol):
    """What :meth:`RunRecorder.batch` stores of a sweep's batch (``prepkit.tune.sweep.Batch``)."""

    @property
    def measurements(self) -> Sequence[RowRecord]: ...

    @property
    def correctness(self) -> Sequence[RowRecord]: ...

    @property
    def blocked(self) -> Sequence[tuple[str, str]]: ...  # (tactic JSON, reason)


class WinnerRecord(Protocol):
    """One winner range of a sweep result (``prepkit.tune.records.WinnerRange``)."""

    @property
    def m_lo(self) -> int: ...

    @property
    def m_hi(self) -> int: ...

    @property
    def tactic(self) -> str: ...

    @property
    def extends_up(self) -> bool: ...

    @property
    def median_us(self) -> float | None: ...

    @property
    def default_median_us(self) -> float | None: ...

    @property
    def speedup_vs_default(self) -> float | None: ...

    @property
    def runner_up(self) -> str | None: ...

    @property
    def runner_up_gap(self) -> float | None: ...


class ResultRecord(Protocol):
    """What :meth:`RunRecorder.result` stores of a sweep result (``prepkit.tune.records.SweepResult``)."""

    @property
    def problem(self) -> ProblemKey: ...

    @property
    def winners(self) -> Sequence[WinnerRecord]: ...


class RunRecorder:
    """Stores what a sweep reports, one transaction per batch (a killed tune keeps whole points).

    Takes the sweep's records by shape (``.row()``, ``.blocked``, winner ranges), so this module
    needs nothing from the tuner or the kernels.
    """

    def __init__(
        self, tdb: TacticsDB, run_id: str, env_hash: str, device: Environment, *, search: str = schema.LEGACY_SEARCH
    ) -> None:
        self.tdb = tdb
        self.run_id = run_id
        self.env_hash = env_hash
        self.device = device
        self.search = search  # which search the run is: stored with each winner range

    def batch(self, problem: ProblemKey, batch: BatchRecord) -> None:
        ph = self.tdb.put_problem(problem)
        with self.tdb.write():
            if batch.correctness:
                self.tdb.add_correctness(self.run_id, self.env_hash, ph, [c.row() for c in batch.correctness])
            if batch.measurements:
                self.tdb.add_measurements(self.run_id, self.env_hash, ph, [x.row() for x in batch.measurements])
            if batch.blocked:
                self.tdb.add_blocklist(self.device, problem, batch.blocked)

    def result(self, result: ResultRecord, *, source: str = "user") -> int:
        """Replace the winner ranges of the result's problem (only if it produced any)."""
        if not result.winners:
            return 0
        ph = self.tdb.put_problem(result.problem)
        rows = [
            WinnerRow(
                m_lo=w.m_lo, m_hi=w.m_hi, params_json=w.tactic, extends_up=w.extends_up,
                median_us=w.median_us, default_median_us=w.default_median_us,
                speedup_vs_default=w.speedup_vs_default, runner_up_json=w.runner_up,
                runner_up_gap=w.runner_up_gap,
            )
            for w in result.winners
        ]  # fmt: skip
        return self.tdb.replace_winners(self.env_hash, ph, self.run_id, rows, source=source, search=self.search)

    def previous(
        self, problem: ProblemKey
    ) -> tuple[dict[tuple[int, str], dict[str, Any]], dict[str, dict[str, Any]], set[str]]:
        """What a rerun skips: measurements and checks of this environment, and the blocklist."""
        ph = problem.problem_hash()
        return (
            self.tdb.measured(self.env_hash, ph),
            self.tdb.checked(self.env_hash, ph),
            self.tdb.blocked(self.device, problem),
        )
