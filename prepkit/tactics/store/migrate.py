"""Opening a tactics DB for writing: header check, pragmas and the schema's migrations (sqlite-utils).

The steps themselves are defined once, in :mod:`prepkit.tactics.schema`.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from prepkit.errors import TacticsError
from prepkit.tactics import schema
from prepkit.tactics.schema import (
    APPLICATION_ID,
    MIGRATION_SET,
    MIGRATIONS_TABLE,
    AddColumn,
    CreateTables,
    Step,
    check_header,
    step_name,
)
from prepkit.tactics.store.busy import BUSY_TIMEOUT_S, is_busy, write_failure

_PY_TYPES: dict[str, type] = {"TEXT": str, "INTEGER": int, "REAL": float}


def _apply_step(db: Database, step: Step) -> None:
    if isinstance(step, CreateTables):
        for t in step.tables:
            db.table(t.name).create(
                {name: _PY_TYPES[sql_type] for name, sql_type in t.columns},
                pk=t.pk[0] if len(t.pk) == 1 else t.pk,
                not_null=list(t.not_null) or None,
                foreign_keys=list(t.foreign_keys) or None,
            )
            for columns in t.indexes:
                db.table(t.name).create_index(list(columns))
        if step is schema.STEPS[0]:
            db.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    elif isinstance(step, AddColumn):
        db.table(step.table).add_column(step.column, _PY_TYPES[step.sql_type])


def make_migrations(steps: tuple[Step, ...]) -> Migrations:
    """The sqlite-utils migration set that applies ``steps`` (one migration per step). Built from
    :data:`prepkit.tactics.schema.STEPS` at each open, so the schema module stays the one source."""
    migrations = Migrations(MIGRATION_SET)
    for step in steps:
        migrations(name=step_name(step))(lambda db, step=step: _apply_step(db, step))
    return migrations


def _applied_names(conn: sqlite3.Connection) -> list[str]:
    exists = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (MIGRATIONS_TABLE,)).fetchone()
    if not exists:
        return []
    return [r[0] for r in conn.execute(f"SELECT name FROM {MIGRATIONS_TABLE} WHERE migration_set=?", (MIGRATION_SET,))]


def connect(path: str | os.PathLike[str], *, create: bool = True, wal: bool = False) -> Database:
    """A migrated connection to the tactics DB at ``path`` (created if missing, unless ``create``
    is false). ``":memory:"`` gives a private in-memory DB (tests).

    Writes run in rollback-journal mode (``wal=False``): once a commit returns, the file alone
    holds it, so a writer killed right after leaves nothing for a reader to apply, and a
    read-only folder reads it as it is. Writers wait for each other on the busy timeout.

    Raises:
        TacticsError: missing (with ``create=False``), corrupt, foreign, newer-schema or unwritable file.
    """
    spath = str(path)
    memory = spath == ":memory:"
    if not memory:
        p = Path(spath)
        if not p.exists() and not create:
            raise TacticsError(f"{p}: no such tactics DB", hint="run `prepkit tune --db` to create it")
        if p.is_dir():
            raise TacticsError(f"{p}: is a directory, expected a tactics DB file")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise write_failure(p, err) from err
    try:
        conn = sqlite3.connect(spath, timeout=BUSY_TIMEOUT_S)
    except sqlite3.Error as err:
        raise TacticsError(
            f"{spath}: cannot open or create it ({err})", hint="check the folder and its permissions"
        ) from err
    try:
        db = _prepare(conn, spath, wal=wal and not memory)
    except sqlite3.OperationalError as err:
        conn.close()
        if is_busy(err):
            raise TacticsError(
                f"{spath}: locked by another process for more than {BUSY_TIMEOUT_S:.0f} s ({err})",
                hint="wait for the other tune to finish, or use another --db and merge later",
            ) from err
        if "readonly" in str(err) or "unable to open" in str(err) or "disk is full" in str(err):
            raise write_failure(spath, err) from err
        raise TacticsError(f"{spath}: not a readable SQLite database ({err})") from err
    except sqlite3.DatabaseError as err:
        conn.close()
        raise TacticsError(
            f"{spath}: not a readable SQLite database ({err})",
            hint=f"move it away; `prepkit tune --db {spath}` then starts a new one",
        ) from err
    except BaseException:
        conn.close()
        raise
    return db


def _prepare(conn: sqlite3.Connection, path: str, *, wal: bool) -> Database:
    """Header check, pragmas and migrations. Switching to WAL can fail at once with "locked"
    (SQLite does not wait on the busy handler there) while a second process sets up the same
    new file, so the whole step is retried until the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            check_header(conn, path)
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            if wal and mode != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            if wal:
                # WAL + NORMAL stays consistent on a crash; only a power cut may drop the last commits.
                conn.execute("PRAGMA synchronous=NORMAL")
            elif mode == "wal":
                _leave_wal(conn)
            conn.execute("PRAGMA foreign_keys=ON")
            db = Database(conn)
            _migrate(db, path)
            return db
        except sqlite3.OperationalError as err:
            if not is_busy(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _leave_wal(conn: sqlite3.Connection) -> None:
    """Switch a file left in WAL mode (an older prepkit, a killed writer) back to a rollback
    journal, applying its log. Only the sole connection may: while another process holds the file
    it stays WAL, and the last one to close switches it (:meth:`StoreBase.close`)."""
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    except sqlite3.OperationalError as err:
        if not is_busy(err):
            raise
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")


def _migrate(db: Database, path: str) -> None:
    conn = db.conn
    # Check and apply under the write lock: two processes opening a new file must not both migrate.
    conn.execute("BEGIN IMMEDIATE")
    try:
        check_header(conn, path)  # again, now that no one else can be writing
        steps = schema.STEPS
        known = {step_name(s) for s in steps}
        unknown = [n for n in _applied_names(conn) if n not in known]
        if unknown:
            raise TacticsError(
                f"{path}: written by a newer prepkit (schema steps {unknown} unknown here)",
                hint="upgrade prepkit, or use a DB written by this version",
            )
        migrations = make_migrations(steps)
        if migrations.pending(db):
            migrations.apply(db)
            conn.execute(f"PRAGMA user_version = {len(steps)}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
