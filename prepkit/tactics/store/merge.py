"""Merging another DB's rows into this one: unions, and winner range sets by the newer run."""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prepkit.errors import TacticsError
from prepkit.tactics.schema import TABLES, columns
from prepkit.tactics.store.exchange import checked_copy
from prepkit.tactics.store.reads import Reads
from prepkit.tactics.validate import parse_timestamp


class Merging(Reads):
    """Merge methods of :class:`prepkit.tactics.store.TacticsDB`."""

    def merge_from(self, other: str | os.PathLike[str]) -> MergeSummary:
        """Copy every row of ``other`` that this DB lacks; returns what was added and replaced.

        Identity rows, runs, measurements and the blocklist are unions (content hashes make equal
        rows collide). Winner range sets are per (env, problem): the set from the newer run wins,
        whole, so ranges of two runs never interleave; a run this DB already holds is dated by
        this DB's row. ``other`` is checked whole first
        (:mod:`prepkit.tactics.validate`); a bad one is refused before this DB is written.

        Raises:
            TacticsError: ``other`` is missing, corrupt, foreign, of a newer schema, or fails a check.
        """
        if Path(other).resolve() == Path(self.path).resolve():
            raise TacticsError(f"cannot merge {other} into itself")
        with tempfile.TemporaryDirectory() as tmp:
            return self.merge_checked(checked_copy(Path(other), Path(tmp)))

    def merge_checked(self, copy: Path) -> MergeSummary:
        """Merge a copy that :func:`checked_copy` made and checked."""
        before = self.counts()
        # ATTACH cannot run inside a transaction; the merge itself is one transaction.
        self.conn.execute("ATTACH DATABASE ? AS src", (str(copy),))
        try:
            with self.write() as db:
                for t in TABLES:
                    if t in ("winner", "decode_winner"):
                        continue
                    cols = ", ".join(columns(t))
                    db.conn.execute(f"INSERT OR IGNORE INTO main.{t} ({cols}) SELECT {cols} FROM src.{t}")
                new_ranges, replaced = self._merge_winners()
                self._merge_decode_winners()
        finally:
            self.conn.execute("DETACH DATABASE src")
        after = self.counts()
        added = {t: after[t] - before[t] for t in TABLES}
        added["winner"] = new_ranges
        return MergeSummary(added, replaced)

    def _merge_winners(self) -> tuple[int, int]:
        """Per (env, problem) of the source, its range set replaces this DB's when its run is newer.
        Returns the ranges added for pairs this DB lacked and the ranges of this DB replaced."""
        cols = ", ".join(columns("winner"))
        pairs = self.conn.execute("SELECT DISTINCT env_hash, problem_hash FROM src.winner").fetchall()
        added = replaced = 0
        for env_hash, problem_hash in pairs:
            mine = self._newest_run("main", env_hash, problem_hash)
            if mine is not None and mine >= (self._newest_run("src", env_hash, problem_hash) or _NEVER):
                continue
            gone = self.conn.execute(
                "DELETE FROM main.winner WHERE env_hash = ? AND problem_hash = ?", (env_hash, problem_hash)
            ).rowcount
            put = self.conn.execute(
                f"INSERT INTO main.winner ({cols}) SELECT {cols} FROM src.winner "
                "WHERE env_hash = ? AND problem_hash = ?",
                (env_hash, problem_hash),
            ).rowcount
            if mine is None:
                added += put
            replaced += gone
        return added, replaced

    def _merge_decode_winners(self) -> None:
        """A decode winner of the source replaces this DB's of the same (env, kernel, problem) when
        it was timed later."""
        cols = columns("decode_winner")
        keys = ("env_hash", "kernel", "problem_key")
        updates = ", ".join(f"{c} = excluded.{c}" for c in cols if c not in keys)
        self.conn.execute(
            f"INSERT INTO main.decode_winner ({', '.join(cols)}) SELECT {', '.join(cols)} FROM src.decode_winner "
            f"WHERE true ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {updates} "
            "WHERE excluded.timed_at > main.decode_winner.timed_at"
        )

    def _newest_run(self, db: str, env_hash: str, problem_hash: str) -> dt.datetime | None:
        """When the newest run behind ``db``'s ranges of (env, problem) finished (else started);
        ``None`` where it has none. A run this DB holds is dated by this DB's row, whatever the
        source's copy says: a source cannot re-date a run to win."""
        newest = None
        for held, mine, theirs in self.conn.execute(
            f"""
            SELECT m.run_id IS NOT NULL, COALESCE(m.finished_at, m.started_at), COALESCE(s.finished_at, s.started_at)
            FROM {db}.winner w
            LEFT JOIN main.tuning_run m ON m.run_id = w.run_id
            LEFT JOIN src.tuning_run s ON s.run_id = w.run_id
            WHERE w.env_hash = ? AND w.problem_hash = ?
            """,
            (env_hash, problem_hash),
        ):
            when = parse_timestamp(mine if held else theirs) or _NEVER
            newest = when if newest is None else max(newest, when)
        return newest


@dataclass(frozen=True)
class MergeSummary:
    """What a merge changed: rows added per table (winner: ranges of (GPU, problem) pairs the DB
    lacked) and the DB's winner ranges replaced by the source's newer run."""

    added: dict[str, int]
    replaced: int

    def describe(self) -> str:
        text = ", ".join(f"+{v} {k}" for k, v in self.added.items())
        return text + f", {self.replaced} winner {'range' if self.replaced == 1 else 'ranges'} replaced"


# The date of a run that has none (an older DB's row): older than any real one.
_NEVER = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
