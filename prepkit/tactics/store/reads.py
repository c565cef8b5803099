"""What a tactics DB is read for: a rerun's skips, past winners, and the views of show, plot and export."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prepkit.errors import TacticsError
from prepkit.tactics import schema, validate
from prepkit.tactics.keys import Environment, ProblemKey
from prepkit.tactics.ranges import Range, RangeTable
from prepkit.tactics.schema import TABLES
from prepkit.tactics.store.base import StoreBase


class Reads(StoreBase):
    """Read methods of :class:`prepkit.tactics.store.TacticsDB`."""

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

    def decode_winners(self) -> list[dict[str, Any]]:
        """Every decode winner with its GPU and Triton, by GPU, kernel and problem."""
        return [
            dict(r)
            for r in self.db.query(
                """
                SELECT d.*, e.gpu_name, e.arch, e.cc_major, e.cc_minor, e.triton_version, e.package_version
                FROM decode_winner d JOIN env e ON e.env_hash = d.env_hash
                ORDER BY e.gpu_name, d.kernel, d.problem_key
                """
            )
        ]

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
