"""``tactics.db`` as the tuner writes it (sqlite-utils): migrations, rows, merge and export.

Rows are content-addressed: environments, kernels, problems and tactics are keyed by a hash of
their canonical JSON (:mod:`prepkit.tactics.keys`), so two DBs filled on two machines merge
without renumbering. Writers use WAL mode, a busy timeout and ``BEGIN IMMEDIATE`` transactions, so
two tuners (two GPUs) writing one file wait for each other instead of failing or losing rows. The
last writer to close switches the file back to a rollback journal, so that a read-only open (a DB
baked into a container image) can read it.
The tables themselves are defined once, in :mod:`prepkit.tactics.schema`; the runtime reads them
with the standard library only (:mod:`prepkit.tactics.lookup`).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from prepkit.errors import TacticsError
from prepkit.tactics import schema, validate
from prepkit.tactics.keys import Environment, ProblemKey, canonical_json, tactic_hash
from prepkit.tactics.lookup import Range, RangeTable
from prepkit.tactics.schema import (
    APPLICATION_ID,
    MIGRATION_SET,
    MIGRATIONS_TABLE,
    TABLES,
    AddColumn,
    CreateTables,
    Step,
    check_header,
    columns,
    open_readonly,
    step_name,
)

BUSY_TIMEOUT_S = 60.0
_PY_TYPES: dict[str, type] = {"TEXT": str, "INTEGER": int, "REAL": float}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


# ------------------------------------------------------------------------------- migrations


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


# ------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class WinnerRow:
    m_lo: int
    m_hi: int
    params_json: str
    extends_up: bool
    median_us: float | None = None
    default_median_us: float | None = None
    speedup_vs_default: float | None = None
    runner_up_json: str | None = None
    runner_up_gap: float | None = None


def env_record(device: Environment, *, package_version: str, mem_bw_gbps: float | None = None) -> dict[str, Any]:
    """The ``env`` row of a device; the hash covers identity fields, not measured ones."""
    from prepkit.tactics.keys import digest, triton_minor

    ident = device.identity(package_version)
    return {
        "env_hash": digest(ident), **ident, "arch": device.arch,
        "triton_minor": triton_minor(device.triton_version), "mem_bw_gbps": mem_bw_gbps, "created_at": _now(),
    }  # fmt: skip


# ------------------------------------------------------------------------------- the store


class TacticsDB:
    """A migrated, writable tactics DB. Use :func:`open_db`; close it (or use ``with``)."""

    def __init__(self, db: Database, path: str, *, rollback_on_close: bool = False) -> None:
        self.db = db
        self.path = path
        self.rollback_on_close = rollback_on_close

    def __enter__(self) -> TacticsDB:
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

    # -- identity rows -----------------------------------------------------------------------

    def put_env(self, env: Mapping[str, Any]) -> str:
        with self.write() as db:
            db.table("env").insert(dict(env), ignore=True)
            if env.get("mem_bw_gbps") is not None:
                db.table("env").update(env["env_hash"], {"mem_bw_gbps": env["mem_bw_gbps"]})
        return str(env["env_hash"])

    def put_problem(self, problem: ProblemKey) -> str:
        kh, ph = problem.kernel_hash(), problem.problem_hash()
        with self.write() as db:
            db.table("kernel").insert({"kernel_hash": kh, **problem.kernel_fields()}, ignore=True)
            db.table("problem").insert({"problem_hash": ph, "kernel_hash": kh, **problem.shape_fields()}, ignore=True)
        return ph

    def put_tactics(self, params_jsons: Iterable[str]) -> dict[str, str]:
        """Store tactics (canonical JSON); returns ``{params_json: tactic_hash}``."""
        out: dict[str, str] = {}
        rows = []
        for pj in params_jsons:
            th = tactic_hash(pj)
            out[pj] = th
            rows.append({"tactic_hash": th, "params_json": canonical_json(json.loads(pj))})
        if rows:
            with self.write() as db:
                db.table("tactic").insert_all(rows, ignore=True)
        return out

    # -- runs ------------------------------------------------------------------------------------

    def start_run(
        self,
        env_hash: str,
        *,
        timing_method: Mapping[str, Any],
        search_space: Mapping[str, Any],
        token_points: Iterable[int],
        cmdline: str = "",
    ) -> str:
        run_id = uuid.uuid4().hex
        with self.write() as db:
            db.table("tuning_run").insert(
                {
                    "run_id": run_id, "env_hash": env_hash, "started_at": _now(), "finished_at": None,
                    "status": "running", "timing_method": canonical_json(dict(timing_method)),
                    "search_space": canonical_json(dict(search_space)),
                    "token_points": json.dumps(list(token_points)), "cmdline": cmdline, "notes": None,
                }
            )  # fmt: skip
        return run_id

    def finish_run(self, run_id: str, status: str, notes: str | None = None) -> None:
        with self.write() as db:
            db.table("tuning_run").update(run_id, {"status": status, "finished_at": _now(), "notes": notes})

    def add_measurements(self, run_id: str, env_hash: str, problem_hash: str, rows: Iterable[Mapping[str, Any]]) -> int:
        """Rows: ``m, params_json, status, is_default`` and optional timing fields."""
        rows = list(rows)
        hashes = self.put_tactics(r["params_json"] for r in rows)
        recs = []
        for r in rows:
            samples = r.get("samples_us")
            recs.append(
                {
                    "run_id": run_id, "env_hash": env_hash, "problem_hash": problem_hash, "m": int(r["m"]),
                    "tactic_hash": hashes[r["params_json"]], "is_default": int(bool(r.get("is_default"))),
                    "status": r["status"], "error_text": r.get("error_text"),
                    "median_us": r.get("median_us"), "p10_us": r.get("p10_us"), "p90_us": r.get("p90_us"),
                    "mean_us": r.get("mean_us"), "n_samples": r.get("n_samples"),
                    "samples_json": json.dumps([round(s, 4) for s in samples]) if samples else None,
                    "measured_at": _now(), "kind": r.get("kind"),
                }
            )  # fmt: skip
        with self.write() as db:
            db.table("measurement").insert_all(recs, replace=True)
        return len(recs)

    def add_correctness(self, run_id: str, env_hash: str, problem_hash: str, rows: Iterable[Mapping[str, Any]]) -> None:
        rows = list(rows)
        hashes = self.put_tactics(r["params_json"] for r in rows)
        recs = [
            {
                "run_id": run_id, "env_hash": env_hash, "problem_hash": problem_hash,
                "tactic_hash": hashes[r["params_json"]], "m_values": json.dumps(list(r.get("m_values", ()))),
                "reference": r.get("reference", ""), "max_abs_err": r.get("max_abs_err"),
                "rel_err": r.get("rel_err"), "nan_inf_count": r.get("nan_inf_count", 0),
                "tolerance": r.get("tolerance"), "passed": int(bool(r["passed"])),
                "error_text": r.get("error_text"), "checked_at": _now(),
            }
            for r in rows
        ]  # fmt: skip
        with self.write() as db:
            db.table("correctness").insert_all(recs, replace=True)

    def add_blocklist(self, device: Environment, problem: ProblemKey, rows: Iterable[tuple[str, str]]) -> None:
        """``rows``: ``(params_json, reason)``. The first reason seen is kept."""
        rows = list(rows)
        hashes = self.put_tactics(pj for pj, _ in rows)
        kh = problem.kernel_hash()
        self.put_problem(problem)
        recs = [
            {
                "cc_major": device.cc_major, "cc_minor": device.cc_minor,
                "triton_minor": device.triton_minor, "kernel_hash": kh, "tactic_hash": hashes[pj],
                "reason": reason[:500], "first_seen": _now(),
            }
            for pj, reason in rows
        ]  # fmt: skip
        with self.write() as db:
            db.table("blocklist").insert_all(recs, ignore=True)

    def replace_winners(
        self,
        env_hash: str,
        problem_hash: str,
        run_id: str,
        winners: Iterable[WinnerRow],
        *,
        source: str = "user",
        search: str = schema.LEGACY_SEARCH,
    ) -> int:
        """Swap the whole range set of (env, problem): ranges from two runs are never mixed.
        ``search``: which search found them (one of :data:`prepkit.tactics.schema.SEARCHES`)."""
        if search not in schema.SEARCHES:
            raise ValueError(f"unknown search {search!r} (expected one of {schema.SEARCHES})")
        winners = list(winners)
        hashes = self.put_tactics(
            [w.params_json for w in winners] + [w.runner_up_json for w in winners if w.runner_up_json]
        )
        with self.write() as db:
            db.execute("DELETE FROM winner WHERE env_hash = ? AND problem_hash = ?", [env_hash, problem_hash])
            db.table("winner").insert_all(
                [
                    {
                        "env_hash": env_hash, "problem_hash": problem_hash, "m_lo": w.m_lo, "m_hi": w.m_hi,
                        "tactic_hash": hashes[w.params_json], "extends_up": int(w.extends_up),
                        "median_us": w.median_us, "default_median_us": w.default_median_us,
                        "speedup_vs_default": w.speedup_vs_default,
                        "runner_up_tactic_hash": hashes.get(w.runner_up_json) if w.runner_up_json else None,
                        "runner_up_gap": w.runner_up_gap, "run_id": run_id, "source": source,
                        "search": search,
                    }
                    for w in winners
                ]
            )  # fmt: skip
        return len(winners)

    # -- reads for resume ------------------------------------------------------------------------

    def measured(self, env_hash: str, problem_hash: str) -> dict[tuple[int, str], dict[str, Any]]:
        """Latest measurement per (m, tactic JSON) in this environment: what a rerun skips. A full
        measurement wins over a screen (:data:`~prepkit.tactics.schema.SCREEN_KIND`) of any age."""
        out: dict[tuple[int, str], dict[str, Any]] = {}
        for r in self.db.query(
            """
            SELECT m.*, t.params_json FROM measurement m JOIN tactic t USING (tactic_hash)
            WHERE m.env_hash = ? AND m.problem_hash = ? ORDER BY m.kind IS NULL, m.measured_at
            """,
            [env_hash, problem_hash],
        ):
            out[(int(r["m"]), r["params_json"])] = r
        return out

    def checked(self, env_hash: str, problem_hash: str) -> dict[str, dict[str, Any]]:
        """Latest correctness result per tactic JSON in this environment."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.db.query(
            """
            SELECT c.*, t.params_json FROM correctness c JOIN tactic t USING (tactic_hash)
            WHERE c.env_hash = ? AND c.problem_hash = ? ORDER BY c.checked_at
            """,
            [env_hash, problem_hash],
        ):
            out[r["params_json"]] = r
        return out

    def blocked(self, device: Environment, problem: ProblemKey) -> set[str]:
        """Tactic JSONs blocklisted for this compute capability, Triton minor and kernel."""
        return {
            r["params_json"]
            for r in self.db.query(
                """
                SELECT t.params_json FROM blocklist b JOIN tactic t USING (tactic_hash)
                WHERE b.cc_major = ? AND b.cc_minor = ? AND b.triton_minor = ? AND b.kernel_hash = ?
                """,
                [device.cc_major, device.cc_minor, device.triton_minor, problem.kernel_hash()],
            )
        }

    def past_winners(self, gpu_name: str, problem: ProblemKey) -> list[str]:
        """Winning tactic JSONs of the same GEMM (kernel name, role, dims, dtypes) measured on a GPU
        of this name under any kernel version or layout, newest run first. Rows of another kernel
        version never match a lookup; the tuner measures them first, so a tile that won before
        is not lost to a shorter search."""
        rows = self.db.query(
            """
            SELECT t.params_json, MAX(r.started_at) AS last_run FROM winner w
            JOIN env e USING (env_hash)
            JOIN problem p USING (problem_hash)
            JOIN kernel k ON k.kernel_hash = p.kernel_hash
            JOIN tactic t ON t.tactic_hash = w.tactic_hash
            JOIN tuning_run r ON r.run_id = w.run_id
            WHERE e.gpu_name = ? AND k.name = ? AND k.role = ? AND p.num_experts = ? AND p.top_k = ?
              AND p.n = ? AND p.k = ? AND p.act_dtype = ? AND p.w_dtype = ? AND p.out_dtype = ?
              AND p.activation = ?
            GROUP BY t.params_json ORDER BY last_run DESC, t.params_json
            """,
            [
                gpu_name, problem.kernel, problem.role, problem.num_experts, problem.top_k, problem.n,
                problem.k, problem.act_dtype, problem.w_dtype, problem.out_dtype, problem.activation,
            ],
        )  # fmt: skip
        return [r["params_json"] for r in rows]

    # -- views -------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        return {t: self.db[t].count for t in TABLES}

    def winners(self) -> list[dict[str, Any]]:
        """Winner ranges joined with their environment, problem and tactic, for show/plot."""
        return list(
            self.db.query(
                """
                SELECT e.arch, e.gpu_name, e.triton_version, k.name AS kernel, k.kernel_version,
                       k.weight_layout, k.role, p.num_experts, p.top_k, p.n, p.k, p.tp_size, p.ep_size,
                       p.act_dtype, p.w_dtype, w.m_lo, w.m_hi, w.extends_up, t.params_json, w.tactic_hash, w.median_us,
                       w.default_median_us, w.speedup_vs_default, w.env_hash, w.problem_hash, w.run_id,
                       w.source, COALESCE(w.search, ?) AS search, e.mem_bw_gbps
                FROM winner w
                JOIN env e USING (env_hash)
                JOIN problem p USING (problem_hash)
                JOIN kernel k ON k.kernel_hash = p.kernel_hash
                JOIN tactic t ON t.tactic_hash = w.tactic_hash
                ORDER BY e.arch, e.gpu_name, e.env_hash, k.role, p.n, p.k, p.tp_size, k.kernel_version,
                         p.problem_hash, w.m_lo
                """,
                [schema.LEGACY_SEARCH],
            )
        )

    def curves(self, env_hash: str, problem_hash: str) -> list[dict[str, Any]]:
        """Per measured token count: the default's median and the median of the tactic the winner
        ranges assign to it (the lookup's own rule, ``extends_up`` included)."""
        table = RangeTable(
            [
                Range(r["m_lo"], r["m_hi"], r["tactic_hash"], bool(r["extends_up"]))
                for r in self.db.query(
                    "SELECT m_lo, m_hi, tactic_hash, extends_up FROM winner WHERE env_hash = ? AND problem_hash = ?",
                    [env_hash, problem_hash],
                )
            ]
        )
        rows: dict[int, dict[tuple[str, int], float]] = {}
        for r in self.db.query(
            """
            SELECT m, tactic_hash, is_default, median_us FROM measurement
            WHERE env_hash = ? AND problem_hash = ? AND status = 'ok' ORDER BY measured_at
            """,
            [env_hash, problem_hash],
        ):
            rows.setdefault(r["m"], {})[(r["tactic_hash"], r["is_default"])] = r["median_us"]
        out = []
        for m in sorted(rows):
            chosen = table.get(m)
            d = next((v for (_, is_def), v in rows[m].items() if is_def), None)
            t = next((v for (th, _), v in rows[m].items() if th == chosen), None)
            if d is not None and t is not None:
                out.append({"m": m, "default_us": d, "tuned_us": t})
        return out

    def env_row(self, env_hash: str) -> dict[str, Any]:
        """The environment row stored under ``env_hash`` (GPU, device facts, software).

        Raises:
            TacticsError: no such environment.
        """
        rows = list(self.db.query("SELECT * FROM env WHERE env_hash = ?", [env_hash]))
        if not rows:
            raise TacticsError(f"{self.path}: no environment {env_hash}")
        return rows[0]

    def problem_key(self, problem_hash: str) -> ProblemKey:
        """The problem stored under ``problem_hash``, as the key that hashes to it.

        Raises:
            TacticsError: no such problem, or its row does not hash back to ``problem_hash``.
        """
        rows = list(
            self.db.query(
                "SELECT p.*, k.name, k.role, k.kernel_version, k.weight_layout FROM problem p "
                "JOIN kernel k USING (kernel_hash) WHERE p.problem_hash = ?",
                [problem_hash],
            )
        )
        if not rows:
            raise TacticsError(f"{self.path}: no problem {problem_hash}")
        r = rows[0]
        shape = ProblemKey.shape_field_names()
        key = ProblemKey(
            kernel=r["name"], kernel_version=r["kernel_version"], weight_layout=r["weight_layout"], role=r["role"],
            **{name: r[name] for name in shape if r.get(name) is not None},
        )  # fmt: skip
        if key.problem_hash() != problem_hash:
            raise TacticsError(f"{self.path}: problem {problem_hash} does not hash back to itself")
        return key

    def runs(self) -> list[dict[str, Any]]:
        """Every tuning run, oldest first, with its GPU and when it last stored a row
        (``last_row_at``: where a killed run stopped, since it never finished)."""
        return list(
            self.db.query(
                """
                SELECT r.run_id, r.env_hash, e.gpu_name, e.arch, r.started_at, r.finished_at, r.status,
                       r.search_space, r.token_points, r.cmdline, r.notes,
                       MAX(COALESCE((SELECT MAX(measured_at) FROM measurement m WHERE m.run_id = r.run_id), ''),
                           COALESCE((SELECT MAX(checked_at) FROM correctness c WHERE c.run_id = r.run_id), ''))
                           AS last_row_at
                FROM tuning_run r JOIN env e USING (env_hash)
                ORDER BY r.started_at, r.run_id
                """
            )
        )

    def timing_scope(self, run_id: str) -> str:
        """What a run's timings cover: ``'gemm'`` (the swept GEMM alone) or ``'layer'``."""
        row = self.db.execute("SELECT timing_method FROM tuning_run WHERE run_id = ?", [run_id]).fetchone()
        try:
            scope = json.loads(row[0]).get("scope") if row and row[0] else None
        except (ValueError, AttributeError):
            scope = None
        return "gemm" if scope == "gemm" else "layer"

    def export(self, on_damaged: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Every row of every table, for ``prepkit tactics export`` (sharing, review). JSON columns
        are JSON values; one that does not decode stays text, and ``on_damaged`` is told the row."""
        tables: dict[str, list[dict[str, Any]]] = {}
        for t in TABLES:
            rows = tables[t] = []
            key = schema.table(t).pk
            for row in self.db[t].rows:
                decoded, bad = validate.decode_json_columns(t, row)
                if bad and on_damaged:
                    on_damaged(f"{t} row ({', '.join(repr(row[k]) for k in key)}): {', '.join(bad)} is not JSON")
                rows.append(decoded)
        return {"format": validate.EXPORT_FORMAT, "schema_version": schema.SCHEMA_VERSION, "tables": tables}

    # -- merge -------------------------------------------------------------------------------

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

    def vacuum_into(self, dest: str | os.PathLike[str]) -> None:
        """Write a compact single-file copy (rollback journal, not WAL): for shipping read-only."""
        dest = Path(dest)
        if dest.exists():
            dest.unlink()
        self.conn.execute("VACUUM INTO ?", (str(dest),))
        conn = sqlite3.connect(str(dest))
        try:
            conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            conn.close()


def merge_into(dest: str | os.PathLike[str], src: str | os.PathLike[str]) -> dict[str, int]:
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


def write_failure(path: Path | str, err: OSError | sqlite3.Error) -> TacticsError:
    """The error for a tactics DB that cannot be written, by cause: read-only, full, or a path
    that cannot be a file; each names ``path``."""
    text = str(err).lower()
    code = getattr(err, "errno", None)
    if code in (errno.EROFS, errno.EACCES, errno.EPERM) or "readonly" in text or "read-only" in text:
        return TacticsError(
            f"{path}: cannot be written, it is read-only ({err})",
            hint="pass --db a writable path; `tactics show` and `export` read it as it is",
        )
    if code == errno.ENOSPC or "disk is full" in text:
        return TacticsError(
            f"{path}: no space left on the device while writing it",
            hint="free disk space and run it again: an interrupted write leaves the DB as it was",
        )
    if code in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return TacticsError(
            f"{path}: cannot be created there: a part of the path is a file, not a folder ({err})",
            hint="pass --db a path inside a folder",
        )
    return TacticsError(f"{path}: cannot be written ({err})", hint="check the path and its permissions")


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
            _snapshot(src, copy)
            open_db(copy, wal=False).close()
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
        with open_db(dest, wal=False) as tdb:
            # References are checked after the load, all at once, naming the row that dangles.
            tdb.conn.execute("PRAGMA foreign_keys = OFF")
            with tdb.write() as db:
                for table in TABLES:
                    rows = tables[table]
                    if rows:
                        cols = [c for c in columns(table) if any(c in r for r in rows)]
                        marks = ", ".join("?" for _ in cols)
                        db.conn.executemany(
                            f"INSERT OR IGNORE INTO {table} ({', '.join(cols)}) VALUES ({marks})",
                            [tuple(r.get(c) for c in cols) for r in rows],
                        )
    except sqlite3.Error as err:
        raise TacticsError(f"{src}: rows that cannot be stored ({err}); nothing was merged") from err


def _snapshot(src: Path, dest: Path) -> None:
    """Consistent copy of a possibly-live DB (WAL included) via the backup API."""
    if not src.is_file():
        raise TacticsError(f"{src}: no such tactics DB", hint="check the path")
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


def open_db(path: str | os.PathLike[str], *, create: bool = True, wal: bool = True) -> TacticsDB:
    """Open (and create or migrate) a tactics DB for writing.

    ``path=":memory:"`` gives a private in-memory DB (tests).

    Raises:
        TacticsError: missing (with ``create=False``), corrupt, foreign, or newer-schema file.
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
        if _is_busy(err):
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
    return TacticsDB(db, spath, rollback_on_close=not memory)


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
        _snapshot(p, copy)
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


def _is_busy(err: sqlite3.OperationalError) -> bool:
    text = str(err).lower()
    return "locked" in text or "busy" in text


def _prepare(conn: sqlite3.Connection, path: str, *, wal: bool) -> Database:
    """Header check, pragmas and migrations. Switching to WAL can fail at once with "locked"
    (SQLite does not wait on the busy handler there) while a second process sets up the same
    new file, so the whole step is retried until the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            check_header(conn, path)
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if wal and conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            if wal:
                # WAL + NORMAL stays consistent on a crash; only a power cut may drop the last commits.
                conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            db = Database(conn)
            _migrate(db, path)
            return db
        except sqlite3.OperationalError as err:
            if not _is_busy(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


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
