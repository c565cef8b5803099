"""``TacticsDB`` and its openers, and a merge into a DB under its lock."""

from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlite_utils import Database

from prepkit.errors import TacticsError
from prepkit.tactics import schema, validate
from prepkit.tactics.schema import open_readonly
from prepkit.tactics.store.busy import BUSY_TIMEOUT_S, write_failure
from prepkit.tactics.store.exchange import checked_copy, snapshot
from prepkit.tactics.store.merge import MergeSummary, Merging
from prepkit.tactics.store.migrate import connect
from prepkit.tactics.store.writes import Writes


class TacticsDB(Writes, Merging):
    """A migrated, writable tactics DB. Use :func:`open_db`; close it (or use ``with``)."""

    def __enter__(self) -> TacticsDB:
        return self


def open_db(path: str | os.PathLike[str], *, create: bool = True, wal: bool = False) -> TacticsDB:
    """Open (and create or migrate) a tactics DB for writing, in rollback-journal mode unless
    ``wal`` (:func:`~prepkit.tactics.store.migrate.connect` says why).

    ``path=":memory:"`` gives a private in-memory DB (tests).

    Raises:
        TacticsError: missing (with ``create=False``), corrupt, foreign, or newer-schema file.
    """
    db = connect(path, create=create, wal=wal)
    return TacticsDB(db, str(path), rollback_on_close=str(path) != ":memory:")


@contextmanager
def open_db_readonly(path: str | os.PathLike[str]) -> Iterator[TacticsDB]:
    """Read a tactics DB without writing to it (``show``, ``export``, ``plot`` of a shipped file).

    A DB of the current schema is opened ``mode=ro``; an older one is read through a migrated
    private copy, so the file itself never changes.

    Raises:
        TacticsError: missing, corrupt, foreign or newer-schema file.
    """
    p = Path(path)
    conn, version = open_readonly(p, timeout_s=BUSY_TIMEOUT_S)
    if version == schema.SCHEMA_VERSION:
        tdb = TacticsDB(Database(conn), str(p))
        try:
            _require_tables(tdb, p)
            yield tdb
        finally:
            tdb.close()
        return
    conn.close()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / p.name
        snapshot(p, copy)
        with open_db(copy, wal=False) as tdb:
            _require_tables(tdb, p)
            yield tdb


def _require_tables(tdb: TacticsDB, path: Path) -> None:
    missing = validate.missing_tables(tdb.conn)
    if missing:
        raise TacticsError(
            f"{path}: tables {missing} are missing, so it is not a whole tactics DB",
            hint="another tool changed it; re-create it with `prepkit tune`, or pass another --db",
        )


def merge_into(dest: str | os.PathLike[str], src: str | os.PathLike[str]) -> MergeSummary:
    """Merge ``src`` into ``dest`` (created if missing) while holding ``DEST.merge-lock``: a second
    merge into the same DB is refused at once, naming the holder's pid. ``src`` is checked whole
    before ``dest`` is opened, so a refused import leaves ``dest`` as it was (or absent).

    Raises:
        TacticsError: another merge holds ``dest``, ``src`` fails a check, or either DB cannot be
            read or written.
    """
    from prepkit.locks import busy_error, exclusive

    dest, src = Path(dest), Path(src)
    if dest.exists() and src.exists() and src.resolve() == dest.resolve():
        raise TacticsError(f"cannot merge {src} into itself")

    def busy(pid: int | None) -> TacticsError:
        hint = "wait for it to finish, then merge again"
        return busy_error(TacticsError, pid, command="`prepkit tactics merge`", target=dest, hint=hint)

    with tempfile.TemporaryDirectory() as tmp:
        copy = checked_copy(src, Path(tmp))
        try:
            with exclusive(dest.with_name(dest.name + ".merge-lock"), busy=busy), open_db(dest) as tdb:
                return tdb.merge_checked(copy)
        except sqlite3.OperationalError as err:
            raise write_failure(dest, err) from err
        except OSError as err:
            raise write_failure(dest, err) from err
