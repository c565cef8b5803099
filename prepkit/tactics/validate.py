"""What a tactics DB or export must hold before prepkit merges it, and the damage a reader names.

``tactics merge`` takes files that users send back and that other tools may have edited. Every
check runs before the target DB is opened, so a bad import is refused whole and the target stays
as it was; the first problem found is named (file, table, row, column). The same row checks tell
``show`` and ``export`` which rows of a damaged DB to name instead of failing on them.

Standard library only, like :mod:`prepkit.tactics.schema`.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import sqlite3
from collections.abc import Iterator, Mapping
from typing import Any

from prepkit.errors import TacticsError
from prepkit.tactics import schema

EXPORT_FORMAT = "prepkit-tactics"
# Token counts beyond this are no tuned point: a range reaching past it is refused, since the
# runtime expands ranges into one slot per token count.
MAX_TUNED_TOKENS = 1 << 20

_SQL_TYPES: dict[str, tuple[str, ...]] = {"TEXT": ("text",), "INTEGER": ("integer",), "REAL": ("real", "integer")}
# What the writer stores (datetime.isoformat), with or without seconds, fraction and offset.
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?([+-]\d{2}:\d{2}|Z)?")
# How far a row's date may lie ahead of this clock (another machine's clock may run ahead).
FUTURE_SLACK = dt.timedelta(days=1)


def parse_timestamp(value: Any) -> dt.datetime | None:
    """``value`` as an aware datetime (no offset: UTC), or ``None`` if it is no ISO 8601 timestamp."""
    if not isinstance(value, str) or not _ISO.fullmatch(value):
        return None
    try:
        when = dt.datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.timezone.utc)


def timestamp_problem(value: Any, now: dt.datetime | None = None) -> str | None:
    """Why ``value`` cannot be a row's date, or ``None``: not ISO 8601, or later than now."""
    when = parse_timestamp(value)
    if when is None:
        return f"{value!r:.40} is not an ISO 8601 timestamp"
    if when > (now or dt.datetime.now(dt.timezone.utc)) + FUTURE_SLACK:
        return f"{value} lies in the future"
    return None


def _type_ok(value: Any, sql_type: str) -> bool:
    if isinstance(value, bool):
        return False
    if sql_type == "TEXT":
        return isinstance(value, str)
    if isinstance(value, int):  # SQLite stores 64-bit integers; a larger one cannot even be bound
        return -(2**63) <= value < 2**63 and sql_type in ("INTEGER", "REAL")
    return sql_type == "REAL" and isinstance(value, float) and math.isfinite(value)


def tactic_problem(params_json: Any) -> str | None:
    """Why ``params_json`` is not a tactic the bundled kernel can run, or ``None`` if it is."""
    from prepkit.kernels.tactic import GemmTactic

    if not isinstance(params_json, str):
        return "is not text"
    try:
        GemmTactic.from_json(params_json)
    except json.JSONDecodeError as err:
        return f"is not JSON ({err.msg} at character {err.pos})"
    except (ValueError, TypeError) as err:
        return f"is not a valid tactic ({err})"
    return None


# ------------------------------------------------------------------------------- exports


def export_rows(data: Any, src: str) -> dict[str, list[dict[str, Any]]]:
    """The rows of a ``prepkit tactics export`` document, checked: format and schema version,
    known tables and columns, one object per row, values of the column's type, required columns
    present. JSON columns given as JSON values are stored as text again.

    Raises:
        TacticsError: the first problem, naming ``src`` and the table, row and column.
    """
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT or not isinstance(data.get("tables"), dict):
        kind = "a JSON array" if isinstance(data, list) else "JSON"
        raise TacticsError(
            f"{src}: {kind} but not a prepkit tactics export (no 'format': '{EXPORT_FORMAT}' with 'tables')",
            hint="merge a file written by `prepkit tactics export`, or a tactics DB",
        )
    version = data.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version > schema.SCHEMA_VERSION:
        raise TacticsError(
            f"{src}: export of tactics schema {version!r}; this prepkit reads up to {schema.SCHEMA_VERSION}",
            hint="upgrade prepkit",
        )
    if version < schema.MIN_READABLE_SCHEMA:
        raise TacticsError(f"{src}: export of tactics schema {version}, older than any prepkit wrote")
    unknown = sorted(set(data) - {"format", "schema_version", "tables"})
    if unknown:
        raise TacticsError(f"{src}: unknown top-level keys {unknown} in a tactics export")
    tables: dict[str, Any] = data["tables"]
    for name in tables:
        if name not in schema.TABLES:
            raise TacticsError(f"{src}: unknown table {name!r} (a tactics export has {', '.join(schema.TABLES)})")
    out: dict[str, list[dict[str, Any]]] = {}
    for name in schema.TABLES:
        rows = tables.get(name, [])
        if not isinstance(rows, list):
            raise TacticsError(f"{src}: tables.{name} is not a list of rows")
        out[name] = [_export_row(src, name, i, row) for i, row in enumerate(rows)]
    return out


def _export_row(src: str, name: str, i: int, row: Any) -> dict[str, Any]:
    where = f"{src}: tables.{name}[{i}]"
    if not isinstance(row, dict):
        raise TacticsError(f"{where} is not an object")
    types = schema.column_types(name)
    unknown = sorted(set(row) - set(types))
    if unknown:
        raise TacticsError(f"{where}: unknown columns {unknown}")
    t = schema.table(name)
    out: dict[str, Any] = {}
    for col, value in row.items():
        if col in schema.JSON_COLUMNS.get(name, ()) and isinstance(value, dict | list):
            value = _json_text(value)
        if value is None:
            if col in t.not_null or col in t.pk:
                raise TacticsError(f"{where}.{col} is null; it is required")
        elif not _type_ok(value, types[col]):
            raise TacticsError(f"{where}.{col} is {type(value).__name__} {value!r:.60}; expected {types[col]}")
        out[col] = value
    missing = [c for c in (*t.pk, *t.not_null) if c not in out]
    if missing:
        raise TacticsError(f"{where}: required columns {missing} are missing")
    return out


def _json_text(value: dict[str, Any] | list[Any]) -> str:
    """The stored text of a JSON column: canonical for objects (tactic hashes are taken over
    that form), ``json.dumps`` spacing for lists, as the tuner writes them."""
    from prepkit.tactics.keys import canonical_json

    return canonical_json(value) if isinstance(value, dict) else json.dumps(value)


def decode_json_columns(name: str, row: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``row`` with its JSON columns decoded for an export, and the columns left as text because
    they do not decode (a DB damaged by another tool)."""
    out = dict(row)
    bad = []
    for col in schema.JSON_COLUMNS.get(name, ()):
        value = out.get(col)
        if isinstance(value, str):
            try:
                out[col] = json.loads(value)
            except ValueError:
                bad.append(col)
    return out, bad


# ------------------------------------------------------------------------------- databases


def missing_tables(conn: sqlite3.Connection, db: str = "main") -> list[str]:
    """The schema's tables that ``db`` lacks."""
    have = {r[0] for r in conn.execute(f"SELECT name FROM {db}.sqlite_master WHERE type = 'table'")}
    return [t for t in schema.TABLES if t not in have]


def db_problems(conn: sqlite3.Connection) -> Iterator[str]:
    """Every problem of the DB behind ``conn``, first the structure, then row by row: unknown or
    missing tables and columns, values of another type, missing required values, references to
    rows that do not exist, tactics that do not decode, token ranges out of order."""
    have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    ours = {*schema.TABLES, schema.MIGRATIONS_TABLE}
    extra = sorted(t for t in have if t not in ours and not t.startswith("sqlite_"))
    if extra:
        yield f"unknown tables {extra}"
    missing = [t for t in schema.TABLES if t not in have]
    if missing:
        yield f"tables {missing} are missing"
        return
    for name in schema.TABLES:
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({name})")]
        types = schema.column_types(name)
        if set(cols) != set(types):
            yield (
                f"table {name}: columns differ from the schema (unknown {sorted(set(cols) - set(types))}, "
                f"missing {sorted(set(types) - set(cols))})"
            )
            return
    for name in schema.TABLES:
        yield from _row_problems(conn, name)


def _row_problems(conn: sqlite3.Connection, name: str) -> Iterator[str]:
    t = schema.table(name)
    key = ", ".join(t.pk)
    for col, sql_type in schema.column_types(name).items():
        allowed = _SQL_TYPES[sql_type] + (() if col in t.not_null or col in t.pk else ("null",))
        marks = ", ".join("?" for _ in allowed)
        for row in conn.execute(
            f"SELECT {key}, typeof({col}) FROM {name} WHERE typeof({col}) NOT IN ({marks}) LIMIT 1", allowed
        ):
            yield f"{name} row ({_key(row[:-1])}): {col} is {row[-1]}, expected {sql_type}"
    for col, other, other_col in schema.references(name):
        for row in conn.execute(
            f"SELECT {key}, {col} FROM {name} WHERE {col} IS NOT NULL "
            f"AND {col} NOT IN (SELECT {other_col} FROM {other} WHERE {other_col} IS NOT NULL) LIMIT 1"
        ):
            yield f"{name} row ({_key(row[:-1])}): {col} {row[-1]!r} names no {other} row"
    if name == "tactic":
        from prepkit.tactics.keys import tactic_hash

        for th, pj in conn.execute("SELECT tactic_hash, params_json FROM tactic"):
            why = tactic_problem(pj)
            if why:
                yield f"tactic row {th!r}: params_json {why}"
            elif tactic_hash(pj) != th:
                # A row whose hash names other params would serve them wherever the hash is used.
                yield f"tactic row {th!r}: tactic_hash does not match its params_json (hash {tactic_hash(pj)!r})"
    now = dt.datetime.now(dt.timezone.utc)
    for col in schema.TIMESTAMP_COLUMNS.get(name, ()):
        for row in conn.execute(f"SELECT {key}, {col} FROM {name} WHERE {col} IS NOT NULL"):
            why = timestamp_problem(row[-1], now)
            if why:
                yield f"{name} row ({_key(row[:-1])}): {col} {why}"
                break
    for col in schema.TIMING_COLUMNS.get(name, ()):
        # SQLite stores NaN as NULL; infinities compare above any finite double.
        for row in conn.execute(
            f"SELECT {key}, {col} FROM {name} WHERE {col} < 0 OR abs({col}) > 1.7976931348623157e308 LIMIT 1"
        ):
            yield f"{name} row ({_key(row[:-1])}): {col} {row[-1]!r} is no possible timing"
    if name == "winner":
        for row in conn.execute(
            f"SELECT {key}, m_hi FROM winner WHERE m_lo < 1 OR m_hi < m_lo OR m_hi > ? LIMIT 1", (MAX_TUNED_TOKENS,)
        ):
            yield f"winner row ({_key(row[:-1])}): token range {row[-2]}-{row[-1]} is not within 1-{MAX_TUNED_TOKENS}"
        marks = ", ".join("?" for _ in schema.SEARCHES)
        for row in conn.execute(
            f"SELECT {key}, search FROM winner WHERE search IS NOT NULL AND search NOT IN ({marks}) LIMIT 1",
            schema.SEARCHES,
        ):
            yield f"winner row ({_key(row[:-1])}): search {row[-1]!r} is none of {', '.join(schema.SEARCHES)}"


def _key(values: tuple[Any, ...]) -> str:
    return ", ".join(repr(v) for v in values)


def check_db(conn: sqlite3.Connection, src: str) -> None:
    """Refuse the DB behind ``conn`` (a private copy of ``src``) at its first problem.

    Raises:
        TacticsError: naming ``src`` and the problem.
    """
    try:
        first = next(db_problems(conn), None)
    except sqlite3.DatabaseError as err:
        raise TacticsError(f"{src}: cannot be read as a tactics DB ({err})") from err
    if first is not None:
        raise TacticsError(
            f"{src}: {first}; nothing was merged",
            hint="merge a DB written by `prepkit tune` or a file written by `prepkit tactics export`",
        )
