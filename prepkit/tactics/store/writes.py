"""The rows a tune writes: identities, runs, measurements, checks, the blocklist and winner ranges."""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prepkit.tactics import schema
from prepkit.tactics.keys import Environment, ProblemKey, canonical_json, tactic_hash
from prepkit.tactics.store.base import StoreBase, now


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


@dataclass(frozen=True)
class DecodeWinnerRow:
    """The winner of one decode problem (:data:`prepkit.tactics.schema.DECODE_WINNER`)."""

    kernel: str
    problem_key: str
    variant: str
    kernel_version: str
    median_us: float
    default_variant: str | None = None
    default_median_us: float | None = None
    retimed: int = 0


def env_record(device: Environment, *, package_version: str, mem_bw_gbps: float | None = None) -> dict[str, Any]:
    """The ``env`` row of a device; the hash covers identity fields, not measured ones."""
    from prepkit.tactics.keys import digest, triton_minor

    ident = device.identity(package_version)
    return {
        "env_hash": digest(ident), **ident, "arch": device.arch,
        "triton_minor": triton_minor(device.triton_version), "mem_bw_gbps": mem_bw_gbps, "created_at": now(),
    }  # fmt: skip


class Writes(StoreBase):
    """Write methods of :class:`prepkit.tactics.store.TacticsDB`."""

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
                    "run_id": run_id, "env_hash": env_hash, "started_at": now(), "finished_at": None,
                    "status": "running", "timing_method": canonical_json(dict(timing_method)),
                    "search_space": canonical_json(dict(search_space)),
                    "token_points": json.dumps(list(token_points)), "cmdline": cmdline, "notes": None,
                }
            )  # fmt: skip
        return run_id

    def finish_run(self, run_id: str, status: str, notes: str | None = None) -> None:
        with self.write() as db:
            db.table("tuning_run").update(run_id, {"status": status, "finished_at": now(), "notes": notes})

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
                    "measured_at": now(), "kind": r.get("kind"),
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
                "error_text": r.get("error_text"), "checked_at": now(),
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
                "reason": reason[:500], "first_seen": now(),
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

    def put_decode_winner(self, env_hash: str, run_id: str, row: DecodeWinnerRow) -> None:
        """Store the winner of one decode problem on one environment, replacing an earlier one."""
        with self.write() as db:
            db.table("decode_winner").insert(
                {**row.__dict__, "env_hash": env_hash, "run_id": run_id, "timed_at": now()}, replace=True
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
