"""The one definition of ``tactics.db``: its identity, its tables, and every schema step.

The schema is a list of steps (:data:`STEPS`): the first creates the version-1 tables, each later
one adds to them. A step that has shipped is never edited, only followed, so a DB written by any
older prepkit migrates forward one step at a time. ``PRAGMA user_version`` holds the number of
steps applied, ``PRAGMA application_id`` marks the file as ours.

Adding a column is one line here: append ``AddColumn("problem", "my_field", "TEXT")`` to
:data:`STEPS`. :mod:`prepkit.tactics.store` applies it to old and new DBs alike, and
:func:`columns` (what a merge copies) includes it.

Standard library only: the runtime reads DBs through :func:`open_readonly` without sqlite-utils.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from prepkit.distribution import install_hint
from prepkit.errors import TacticsError

# Identifies a prepkit tactics DB (PRAGMA application_id): ASCII "PKTD".
APPLICATION_ID = 0x504B5444
# The sqlite-utils migration set and its bookkeeping table.
MIGRATION_SET = "prepkit.tactics"
MIGRATIONS_TABLE = "_sqlite_migrations"


@dataclass(frozen=True)
class Table:
    """One table as created: columns (name -> SQL type), primary key, foreign keys, indexes."""

    name: str
    columns: tuple[tuple[str, str], ...]
    pk: tuple[str, ...]
    not_null: tuple[str, ...] = ()
    foreign_keys: tuple[tuple[str, str, str], ...] = ()  # (column, other table, other column)
    indexes: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class CreateTables:
    """A step that creates tables (the first step)."""

    name: str
    tables: tuple[Table, ...]


@dataclass(frozen=True)
class AddColumn:
    """A step that adds one nullable column (SQLite cannot add NOT NULL without a default)."""

    table: str
    column: str
    sql_type: str  # 'TEXT', 'INTEGER', 'REAL'
    name: str = field(default="")

    @property
    def step_name(self) -> str:
        return self.name or f"add_{self.table}_{self.column}"


Step = CreateTables | AddColumn


def _cols(spec: str) -> tuple[tuple[str, str], ...]:
    """``"env_hash TEXT, cc_major INTEGER"`` -> ``(("env_hash", "TEXT"), ("cc_major", "INTEGER"))``."""
    out = []
    for part in spec.split(","):
        name, sql_type = part.split()
        out.append((name, sql_type))
    return tuple(out)


_V1 = (
    Table(
        "env",
        _cols(
            "env_hash TEXT, cc_major INTEGER, cc_minor INTEGER, arch TEXT, gpu_name TEXT, sm_count INTEGER, "
            "l2_bytes INTEGER, smem_per_block_optin INTEGER, mem_bytes INTEGER, driver_version TEXT, "
            "cuda_version TEXT, torch_version TEXT, triton_version TEXT, triton_minor TEXT, "
            "package_version TEXT, mem_bw_gbps REAL, created_at TEXT"
        ),
        pk=("env_hash",),
        not_null=("cc_major", "cc_minor", "arch", "gpu_name", "triton_version", "created_at"),
    ),
    Table(
        "kernel",
        _cols("kernel_hash TEXT, name TEXT, role TEXT, kernel_version TEXT, weight_layout TEXT"),
        pk=("kernel_hash",),
        not_null=("name", "role", "kernel_version", "weight_layout"),
    ),
    Table(
        "problem",
        _cols(
            "problem_hash TEXT, kernel_hash TEXT, num_experts INTEGER, top_k INTEGER, n INTEGER, k INTEGER, "
            "act_dtype TEXT, w_dtype TEXT, out_dtype TEXT, activation TEXT, tp_size INTEGER, ep_size INTEGER"
        ),
        pk=("problem_hash",),
        not_null=("kernel_hash", "num_experts", "top_k", "n", "k"),
        foreign_keys=(("kernel_hash", "kernel", "kernel_hash"),),
    ),
    Table("tactic", _cols("tactic_hash TEXT, params_json TEXT"), pk=("tactic_hash",), not_null=("params_json",)),
    Table(
        "tuning_run",
        _cols(
            "run_id TEXT, env_hash TEXT, started_at TEXT, finished_at TEXT, status TEXT, timing_method TEXT, "
            "search_space TEXT, token_points TEXT, cmdline TEXT, notes TEXT"
        ),
        pk=("run_id",),
        not_null=("env_hash", "started_at", "status"),
        foreign_keys=(("env_hash", "env", "env_hash"),),
    ),
    Table(
        "measurement",
        _cols(
            "run_id TEXT, env_hash TEXT, problem_hash TEXT, m INTEGER, tactic_hash TEXT, is_default INTEGER, "
            "status TEXT, error_text TEXT, median_us REAL, p10_us REAL, p90_us REAL, mean_us REAL, "
            "n_samples INTEGER, samples_json TEXT, measured_at TEXT"
        ),
        pk=("run_id", "problem_hash", "m", "tactic_hash"),
        not_null=("env_hash", "status"),
        foreign_keys=(
            ("run_id", "tuning_run", "run_id"),
            ("env_hash", "env", "env_hash"),
            ("problem_hash", "problem", "problem_hash"),
            ("tactic_hash", "tactic", "tactic_hash"),
        ),
        indexes=(("env_hash", "problem_hash", "m"),),
    ),
    Table(
        "correctness",
        _cols(
            "run_id TEXT, env_hash TEXT, problem_hash TEXT, tactic_hash TEXT, m_values TEXT, reference TEXT, "
            "max_abs_err REAL, rel_err REAL, nan_inf_count INTEGER, tolerance REAL, passed INTEGER, "
            "error_text TEXT, checked_at TEXT"
        ),
        pk=("run_id", "problem_hash", "tactic_hash"),
        not_null=("env_hash", "passed"),
        foreign_keys=(
            ("run_id", "tuning_run", "run_id"),
            ("env_hash", "env", "env_hash"),
            ("problem_hash", "problem", "problem_hash"),
            ("tactic_hash", "tactic", "tactic_hash"),
        ),
        indexes=(("env_hash", "problem_hash"),),
    ),
    Table(
        "winner",
        _cols(
            "env_hash TEXT, problem_hash TEXT, m_lo INTEGER, m_hi INTEGER, tactic_hash TEXT, extends_up INTEGER, "
            "median_us REAL, default_median_us REAL, speedup_vs_default REAL, runner_up_tactic_hash TEXT, "
            "runner_up_gap REAL, run_id TEXT, source TEXT"
        ),
        pk=("env_hash", "problem_hash", "m_lo"),
        not_null=("m_hi", "tactic_hash", "extends_up", "run_id", "source"),
        foreign_keys=(
            ("env_hash", "env", "env_hash"),
            ("problem_hash", "problem", "problem_hash"),
            ("tactic_hash", "tactic", "tactic_hash"),
            ("run_id", "tuning_run", "run_id"),
        ),
    ),
    Table(
        "blocklist",
        _cols(
            "cc_major INTEGER, cc_minor INTEGER, triton_minor TEXT, kernel_hash TEXT, tactic_hash TEXT, "
            "reason TEXT, first_seen TEXT"
        ),
        pk=("cc_major", "cc_minor", "triton_minor", "kernel_hash", "tactic_hash"),
        not_null=("reason", "first_seen"),
        foreign_keys=(("kernel_hash", "kernel", "kernel_hash"), ("tactic_hash", "tactic", "tactic_hash")),
    ),
)

# The decode kernels' winners (prepkit.kernels.decode): one variant per (device, kernel, problem),
# no token ranges (a decode problem fixes its batch). ``problem_key`` is DecodeProblem.key(),
# ``variant`` DecodeVariant.name(); ``kernel_version`` the kernel's, so rows of an older kernel never
# serve a newer one; ``retimed`` the rounds the close calls were timed again in (0: none).
DECODE_WINNER = Table(
    "decode_winner",
    _cols(
        "env_hash TEXT, kernel TEXT, problem_key TEXT, variant TEXT, kernel_version TEXT, median_us REAL, "
        "default_variant TEXT, default_median_us REAL, retimed INTEGER, run_id TEXT, timed_at TEXT"
    ),
    pk=("env_hash", "kernel", "problem_key"),
    not_null=("variant", "kernel_version", "median_us", "run_id", "timed_at"),
    foreign_keys=(("env_hash", "env", "env_hash"), ("run_id", "tuning_run", "run_id")),
)

# Every schema step, oldest first. Append only.
STEPS: tuple[Step, ...] = (
    CreateTables("create_v1", _V1),
    # Which search found a winner range: one of SEARCHES (NULL in rows written before the column).
    AddColumn("winner", "search", "TEXT"),
    # How a timing was taken: NULL a full measurement, 'screen' a thorough search's quick one.
    AddColumn("measurement", "kind", "TEXT"),
    # The decode kernels' winners, in a table of their own.
    CreateTables("create_decode_winner", (DECODE_WINNER,)),
)

# PRAGMA user_version written after the newest step; readers refuse newer files.
SCHEMA_VERSION = len(STEPS)
# Oldest schema whose winner/env/tactic/blocklist tables the readers understand.
MIN_READABLE_SCHEMA = 1

# Every table of every step, in creation order (a merge copies them in this order: referenced rows first).
TABLES: tuple[str, ...] = tuple(t.name for step in STEPS if isinstance(step, CreateTables) for t in step.tables)

# The searches ``prepkit tune`` runs: the pruned sweep, and ``--thorough`` (every valid variant).
SEARCHES: tuple[str, ...] = ("pruned", "thorough")
# A thorough search's quick timing (few samples, cut short when far slower than the best so far):
# good for ranking variants, never for choosing a winner (the ``kind`` of a measurement row).
SCREEN_KIND = "screen"
# What a winner row without ``search`` was found by: before the column only the pruned sweep existed.
LEGACY_SEARCH = "pruned"

# TEXT columns that hold JSON: an export writes them as JSON values, never as JSON inside strings.
JSON_COLUMNS: dict[str, tuple[str, ...]] = {
    "tactic": ("params_json",),
    "tuning_run": ("timing_method", "search_space", "token_points"),
    "measurement": ("samples_json",),
    "correctness": ("m_values",),
}
# Columns holding when a row was written: ISO 8601 text (a merge compares run dates by them).
TIMESTAMP_COLUMNS: dict[str, tuple[str, ...]] = {
    "env": ("created_at",),
    "tuning_run": ("started_at", "finished_at"),
    "measurement": ("measured_at",),
    "correctness": ("checked_at",),
    "blocklist": ("first_seen",),
    "decode_winner": ("timed_at",),
}
# Columns holding timings or ratios of timings: finite and never negative.
TIMING_COLUMNS: dict[str, tuple[str, ...]] = {
    "measurement": ("median_us", "p10_us", "p90_us", "mean_us"),
    "winner": ("median_us", "default_median_us", "speedup_vs_default"),
    "decode_winner": ("median_us", "default_median_us"),
}
# A reference that is not a declared foreign key (SQLite cannot declare a nullable one usefully).
EXTRA_REFERENCES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "winner": (("runner_up_tactic_hash", "tactic", "tactic_hash"),),
}


def table(name: str) -> Table:
    """The table ``name`` as the step that creates it creates it."""
    for step in STEPS:
        if isinstance(step, CreateTables):
            for t in step.tables:
                if t.name == name:
                    return t
    raise KeyError(f"no table {name!r} in the tactics schema")


def column_types(name: str) -> dict[str, str]:
    """Column -> SQL type of ``name`` once every step has run."""
    out = dict(table(name).columns)
    for step in STEPS:
        if isinstance(step, AddColumn) and step.table == name:
            out[step.column] = step.sql_type
    return out


def references(name: str) -> tuple[tuple[str, str, str], ...]:
    """Every ``(column, other table, other column)`` that a row of ``name`` points through."""
    return table(name).foreign_keys + EXTRA_REFERENCES.get(name, ())


def step_name(step: Step) -> str:
    return step.name if isinstance(step, CreateTables) else step.step_name


def columns(table: str) -> tuple[str, ...]:
    """The columns of ``table`` once every step has run, in creation order."""
    out: list[str] = []
    for step in STEPS:
        if isinstance(step, CreateTables):
            out += [c for t in step.tables if t.name == table for c, _ in t.columns]
        elif step.table == table:
            out.append(step.column)
    if not out:
        raise KeyError(f"no table {table!r} in the tactics schema")
    return tuple(out)


def check_header(conn: sqlite3.Connection, path: str) -> int:
    """Validate application id and schema version; return the schema version (0: empty file).

    Raises:
        TacticsError: not a SQLite file, a foreign SQLite DB, or a newer schema.
        sqlite3.OperationalError: the file is locked (the caller may wait and retry).
    """
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        n_tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.OperationalError as err:
        if "locked" in str(err) or "busy" in str(err):
            raise
        raise TacticsError(f"{path}: not a readable SQLite database ({err})") from err
    except sqlite3.DatabaseError as err:
        raise TacticsError(
            f"{path}: not a readable SQLite database ({err})",
            hint=f"move it away and re-create it with `prepkit tune`, or pass another --db (file: {path})",
        ) from err
    if app_id != APPLICATION_ID:
        if app_id == 0 and n_tables == 0:
            return 0
        raise TacticsError(
            f"{path}: a SQLite database but not a prepkit tactics DB "
            f"(application_id {app_id:#x}, expected {APPLICATION_ID:#x})",
            hint="point --db / PREPKIT_TACTICS_DB at a tactics DB; prepkit never writes into foreign DBs",
        )
    if version > SCHEMA_VERSION:
        raise TacticsError(
            f"{path}: schema version {version} is newer than this prepkit understands ({SCHEMA_VERSION})",
            hint=f"upgrade prepkit ({install_hint(upgrade=True)}), or use a DB written by this version",
        )
    return int(version)


def folder_writable(folder: Path) -> bool:
    """Whether files can be created in ``folder`` (where SQLite puts -journal, -wal and -shm)."""
    return os.access(folder, os.W_OK)


def readonly_uri(path: Path) -> str:
    """The URI that opens ``path`` without writing. Where the folder cannot be written, no one can
    change the DB either, so it is opened ``immutable``: SQLite then wants no -shm or -wal file
    beside it, which a DB left in WAL mode would otherwise need."""
    path = path.resolve()
    uri = f"{path.as_uri()}?mode=ro"
    return uri if folder_writable(path.parent) else f"{uri}&immutable=1"


def check_no_pending_log(path: Path) -> None:
    """Refuse to read ``path`` from a read-only folder while a non-empty ``-wal`` or ``-journal``
    beside it holds a write SQLite has not applied (a writer killed after, or during, a commit):
    an immutable open would ignore it and read stale or half-written pages.

    Raises:
        TacticsError: naming the file and how to apply it.
    """
    if folder_writable(path.resolve().parent):
        return  # SQLite applies the log itself on open
    for suffix, how in (
        ("-wal", "PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode=DELETE;"),
        ("-journal", "PRAGMA integrity_check;"),
    ):
        log = path.with_name(path.name + suffix)
        try:
            pending = log.stat().st_size > 0
        except OSError:
            continue
        if pending:
            kind = "write-ahead log" if suffix == "-wal" else "rollback journal of an interrupted write"
            raise TacticsError(
                f"{path}: {log.name} beside it is a {kind} SQLite has not applied, and the folder is "
                "read-only, so it cannot be applied here (reading without it would give stale rows)",
                hint=f"copy the folder somewhere writable and run there: sqlite3 COPY/{path.name} '{how}'; "
                "then use or ship that copy (or make the folder writable and run it in place)",
            )


def open_readonly(path: str | os.PathLike[str], *, timeout_s: float = 5.0) -> tuple[sqlite3.Connection, int]:
    """Open a tactics DB without writing to it (:func:`readonly_uri`); returns the connection and its
    schema version (0 for an empty file). The one read-only opener of the package.

    Raises:
        TacticsError: missing, unreadable, busy, foreign or newer-schema DB, or one whose pending
            log a read-only folder keeps from being applied.
    """
    p = Path(path)
    if not p.is_file():
        raise TacticsError(f"{p}: no such tactics DB", hint="run `prepkit tune` first, or pass another --db")
    check_no_pending_log(p)
    try:
        conn = sqlite3.connect(readonly_uri(p), uri=True, timeout=timeout_s)
    except sqlite3.Error as err:
        raise TacticsError(f"{p}: cannot open ({err})") from err
    try:
        version = check_header(conn, str(p))
    except sqlite3.OperationalError as err:
        conn.close()
        raise TacticsError(f"{p}: busy, another process holds it ({err})") from err
    except BaseException:
        conn.close()
        raise
    return conn, version
