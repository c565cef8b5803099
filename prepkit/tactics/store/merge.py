"""Merging another DB's rows into this one: unions, and winner range sets by the newer run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from prepkit.errors import TacticsError
from prepkit.tactics.schema import TABLES, columns
from prepkit.tactics.store.exchange import checked_copy
from prepkit.tactics.store.reads import Reads


class Merging(Reads):
    """Merge methods of :class:`prepkit.tactics.store.TacticsDB`."""

    def merge_from(self, other: str | os.PathLike[str]) -> dict[str, int]:
        """Copy every row of ``other`` that this DB lacks; returns rows added per table.

        Identity rows, runs, measurements and the blocklist are unions (content hashes make equal
        rows collide). Winner range sets are per (env, problem): the set from the newer run wins,
        whole, so ranges of two runs never interleave. ``other`` is checked whole first
        (:mod:`prepkit.tactics.validate`); a bad one is refused before this DB is written.

        Raises:
            TacticsError: ``other`` is missing, corrupt, foreign, of a newer schema, or fails a check.
        """
        if Path(other).resolve() == Path(self.path).resolve():
            raise TacticsError(f"cannot merge {other} into itself")
        with tempfile.TemporaryDirectory() as tmp:
            return self.merge_checked(checked_copy(Path(other), Path(tmp)))

    def merge_checked(self, copy: Path) -> dict[str, int]:
        """Merge a copy that :func:`checked_copy` made and checked."""
        before = self.counts()
        # ATTACH cannot run inside a transaction; the merge itself is one transaction.
        self.conn.execute("ATTACH DATABASE ? AS src", (str(copy),))
        try:
            with self.write() as db:
                for t in TABLES:
                    if t == "winner":
                        continue
                    cols = ", ".join(columns(t))
                    db.conn.execute(f"INSERT OR IGNORE INTO main.{t} ({cols}) SELECT {cols} FROM src.{t}")
                self._merge_winners()
        finally:
            self.conn.execute("DETACH DATABASE src")
        after = self.counts()
        return {t: after[t] - before[t] for t in TABLES}

    def _merge_winners(self) -> None:
        cols = ", ".join(columns("winner"))
        pairs = self.conn.execute(
            """
            SELECT DISTINCT w.env_hash, w.problem_hash, MAX(r.finished_at), MAX(r.started_at)
            FROM src.winner w LEFT JOIN src.tuning_run r ON r.run_id = w.run_id
            GROUP BY w.env_hash, w.problem_hash
            """
        ).fetchall()
        for env_hash, problem_hash, src_done, src_start in pairs:
            mine = self.conn.execute(
                """
                SELECT MAX(r.finished_at), MAX(r.started_at), COUNT(*)
                FROM main.winner w LEFT JOIN main.tuning_run r ON r.run_id = w.run_id
                WHERE w.env_hash = ? AND w.problem_hash = ?
                """,
                (env_hash, problem_hash),
            ).fetchone()
            if mine[2] and (mine[0] or mine[1] or "") >= (src_done or src_start or ""):
                continue
            self.conn.execute(
                "DELETE FROM main.winner WHERE env_hash = ? AND problem_hash = ?", (env_hash, problem_hash)
            )
            self.conn.execute(
                f"INSERT INTO main.winner ({cols}) SELECT {cols} FROM src.winner "
                "WHERE env_hash = ? AND problem_hash = ?",
                (env_hash, problem_hash),
            )
