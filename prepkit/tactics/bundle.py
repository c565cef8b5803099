"""The tactics DB shipped in the package, cut from the full measurement history.

The full DB (``data/tactics-full.db`` in the repository) keeps every timing sample and every
correctness check of every tuning run, except a thorough run's screens (a hundred thousand rows
that never choose a winner). The runtime lookup, ``prepkit tactics show`` and the
tuner's seeds need only the winners and what they point at, and ``prepkit tactics plot`` needs
the default's and the winner's timing per token count. :func:`write_bundle` keeps exactly that:

- env, kernel, problem, tuning_run, winner, decode_winner and blocklist rows: all of them;
- measurement rows: only status ``ok`` rows of the default or of a tactic that wins a range of
  the same environment and problem, without their raw samples (median, p10, p90 stay);
- correctness rows: none (the blocklist already holds every tactic that failed);
- tactic rows: only those that a kept row references.

Run it after merging new runs into the full DB::

    python -m prepkit.tactics.bundle data/tactics-full.db tactics.db
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from prepkit.errors import PrepkitError, TacticsError
from prepkit.tactics import store
from prepkit.tactics.ranges import Range, RangeTable
from prepkit.tactics.store.exchange import snapshot


def _thin(tdb: store.TacticsDB) -> None:
    """Turn a migrated private copy of the full DB into the shipped one (see the module docstring)."""
    with tdb.write() as db:
        db.execute("DELETE FROM correctness")
        db.execute("DELETE FROM measurement WHERE status != 'ok'")
        # A challenger's row stays only at the token counts its winner range serves: the rows the
        # plot draws (``TacticsDB.curves``), by the lookup's own range rule.
        ranges: dict[tuple[str, str], list[Range[str]]] = {}
        for env_hash, problem_hash, m_lo, m_hi, tactic_hash, extends_up in db.execute(
            "SELECT env_hash, problem_hash, m_lo, m_hi, tactic_hash, extends_up FROM winner"
        ).fetchall():
            ranges.setdefault((env_hash, problem_hash), []).append(Range(m_lo, m_hi, tactic_hash, bool(extends_up)))
        serving = {key: RangeTable(rs) for key, rs in ranges.items()}
        drop = [
            (rowid,)
            for rowid, env_hash, problem_hash, m, tactic_hash in db.execute(
                "SELECT rowid, env_hash, problem_hash, m, tactic_hash FROM measurement WHERE is_default = 0"
            ).fetchall()
            if (env_hash, problem_hash) not in serving or serving[(env_hash, problem_hash)].get(m) != tactic_hash
        ]
        db.conn.executemany("DELETE FROM measurement WHERE rowid = ?", drop)
        db.execute("UPDATE measurement SET samples_json = NULL")
        db.execute(
            """
            DELETE FROM tactic WHERE tactic_hash NOT IN (
                SELECT tactic_hash FROM winner
                UNION SELECT runner_up_tactic_hash FROM winner WHERE runner_up_tactic_hash IS NOT NULL
                UNION SELECT tactic_hash FROM blocklist
                UNION SELECT tactic_hash FROM measurement)
            """
        )


def write_bundle(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> dict[str, int]:
    """Write the slim DB of ``src`` to ``dest`` (replaced; ``src`` is never written).

    Returns the row count per table of ``dest``.

    Raises:
        TacticsError: ``src`` is missing, corrupt, foreign or of a newer schema, or is ``dest``.
    """
    src_path, dest_path = Path(src), Path(dest)
    if dest_path.exists() and src_path.exists() and dest_path.resolve() == src_path.resolve():
        raise TacticsError(f"{dest_path}: the bundle would overwrite its own source", hint="pick another DEST")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "bundle.db"
        snapshot(src_path, work)  # a consistent private copy, migrated below
        with store.open_db(work, wal=False) as tdb:
            _thin(tdb)
            dest_path.parent.mkdir(parents=True, exist_ok=True)
            tdb.vacuum_into(dest_path)
    with store.open_db_readonly(dest_path) as shipped:
        return shipped.counts()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prepkit.tactics.bundle",
        description="Write the tactics DB shipped in the package from the full measurement history.",
    )
    parser.add_argument("src", type=Path, help="the full DB, e.g. data/tactics-full.db")
    parser.add_argument("dest", type=Path, help="the DB to write, e.g. tactics.db (the repository top)")
    args = parser.parse_args(argv)
    try:
        counts = write_bundle(args.src, args.dest)
    except PrepkitError as err:
        print(f"error: {err}" + (f"\nhint: {err.hint}" if err.hint else ""), file=sys.stderr)
        return err.exit_code
    size = args.dest.stat().st_size
    print(f"{args.dest}: {size / 1e6:.2f} MB, " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
