"""The connection a tactics DB object holds and its one write transaction."""

from __future__ import annotations

import datetime as _dt
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from sqlite_utils import Database


def now() -> str:
    """The time stored in a row: UTC, ISO 8601 with microseconds."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


class StoreBase:
    """A migrated tactics DB connection; :class:`prepkit.tactics.store.TacticsDB` adds the rows."""

    def __init__(self, db: Database, path: str, *, rollback_on_close: bool = False) -> None:
        self.db = db
        self.path = path
        self.rollback_on_close = rollback_on_close

    def __enter__(self) -> StoreBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.rollback_on_close:
            # Back to a rollback journal: a WAL file cannot be read where -shm cannot be created. Only
            # the last connection may switch; while another tuner has the file open it stays WAL
            # (busy at once, no waiting), and that tuner switches it when it closes.
            try:
                self.conn.execute("PRAGMA busy_timeout = 0")
                self.conn.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.Error:
                pass
        self.db.close()

    @property
    def conn(self) -> sqlite3.Connection:
        return self.db.conn

    @contextmanager
    def write(self) -> Iterator[Database]:
        """One write transaction that takes the write lock up front (``BEGIN IMMEDIATE``), so a
        second writer waits on the busy timeout instead of failing on a lock upgrade."""
        if self.conn.in_transaction:
            with self.db.atomic():
                yield self.db
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
