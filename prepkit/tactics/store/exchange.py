"""A source to merge, made safe to read: a private, migrated, checked copy of a DB or an export."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from prepkit.errors import TacticsError
from prepkit.tactics import schema, validate
from prepkit.tactics.schema import TABLES, check_header, columns
from prepkit.tactics.store.busy import BUSY_TIMEOUT_S
from prepkit.tactics.store.migrate import connect


def _is_json(path: Path) -> bool:
    """Whether ``path`` holds JSON (an export, or something else JSON) rather than a SQLite DB."""
    try:
        with path.open("rb") as f:
            return f.read(64).lstrip()[:1] in (b"{", b"[")
    except OSError:
        return False


def checked_copy(src: Path, tmp: Path) -> Path:
    """A private, migrated copy in ``tmp`` of the DB or export ``src``, checked whole
    (:mod:`prepkit.tactics.validate`); ``src`` is only read.

    Raises:
        TacticsError: ``src`` is missing, unreadable, or fails a check (the first problem named).
    """
    copy = tmp / "src.db"
    try:
        if _is_json(src):
            _db_from_export(src, copy)
        else:
            snapshot(src, copy)
            connect(copy, wal=False).close()
        conn = sqlite3.connect(str(copy))
        try:
            validate.check_db(conn, str(src))
        finally:
            conn.close()
    except OSError as err:
        raise TacticsError(f"{src}: cannot be read or copied ({err})") from err
    return copy


def _db_from_export(src: Path, dest: Path) -> None:
    """A DB at ``dest`` holding the rows of the ``prepkit tactics export`` JSON ``src``, so that a
    shared export merges like a DB file."""
    try:
        data = json.loads(src.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise TacticsError(f"{src}: not a readable tactics export ({err})") from err
    except RecursionError as err:
        raise TacticsError(f"{src}: not a readable tactics export (nested too deep)") from err
    tables = validate.export_rows(data, str(src))
    try:
        db = connect(dest, wal=False)
        try:
            # References are checked after the load, all at once, naming the row that dangles.
            db.conn.execute("PRAGMA foreign_keys = OFF")
            with db.conn:  # one transaction
                for table in TABLES:
                    rows = tables[table]
                    if rows:
                        cols = [c for c in columns(table) if any(c in r for r in rows)]
                        marks = ", ".join("?" for _ in cols)
                        db.conn.executemany(
                            f"INSERT OR IGNORE INTO {table} ({', '.join(cols)}) VALUES ({marks})",
                            [tuple(r.get(c) for c in cols) for r in rows],
                        )
        finally:
            db.close()
    except sqlite3.Error as err:
        raise TacticsError(f"{src}: rows that cannot be stored ({err}); nothing was merged") from err


def snapshot(src: Path, dest: Path) -> None:
    """Consistent copy of a possibly-live DB (WAL included) via the backup API."""
    if not src.is_file():
        raise TacticsError(f"{src}: no such tactics DB", hint="check the path")
    schema.check_no_pending_log(src)
    s = sqlite3.connect(schema.readonly_uri(src), uri=True, timeout=BUSY_TIMEOUT_S)
    try:
        check_header(s, str(src))
        d = sqlite3.connect(str(dest))
        try:
            s.backup(d)
        finally:
            d.close()
    except sqlite3.DatabaseError as err:
        raise TacticsError(f"{src}: not a readable SQLite database ({err})") from err
    finally:
        s.close()
