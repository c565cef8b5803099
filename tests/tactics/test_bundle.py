"""The tactics DB shipped with the package: cut from the full history, it serves the same winners.

The repository keeps every tuning run in ``data/tactics-full.db``; ``tactics.db`` at its top is
what ``python -m prepkit.tactics.bundle`` writes from it. These tests hold the shipped file to
the full one: same lookups for every problem and environment, same ``tactics show`` rows, same
plot curves, same tuner seeds, and the same rows a fresh bundle writes.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from prepkit.errors import TacticsError
from prepkit.tactics import bundle, store
from prepkit.tactics.keys import Environment, ProblemKey
from prepkit.tactics.lookup import TOKEN_POINTS, TacticTable, bundled_db_path
from prepkit.tactics.schema import SCHEMA_VERSION, TABLES
from prepkit.tactics.store import WinnerRow, env_record, open_db
from tests.tactics.test_db import G1, H100, tac

ROOT = Path(__file__).resolve().parents[2]
FULL_DB = ROOT / "data" / "tactics-full.db"
NOWHERE = "/nonexistent/prepkit-user/tactics.db"


def shipped() -> Path:
    path = bundled_db_path()
    assert path is not None, "tactics.db (the repository top) is missing"
    return path


def envs_and_problems(path: Path) -> tuple[list[Environment], list[tuple[str, ProblemKey]]]:
    """Every environment and every problem of a DB, rebuilt as the runtime would pass them."""
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        envs = [
            Environment(cc_major=cc_major, cc_minor=cc_minor, name=gpu, triton_version=tv)
            for cc_major, cc_minor, gpu, tv in conn.execute(
                "SELECT cc_major, cc_minor, gpu_name, triton_version FROM env ORDER BY env_hash"
            )
        ]
        problems = [
            (
                problem_hash,
                ProblemKey(
                    kernel=name,
                    kernel_version=kv,
                    weight_layout=layout,
                    role=role,
                    num_experts=e,
                    top_k=top_k,
                    n=n,
                    k=k,
                    act_dtype=act,
                    w_dtype=w_dtype,
                    out_dtype=out_dtype,
                    activation=activation,
                    tp_size=tp,
                    ep_size=ep,
                ),
            )  # fmt: skip
            for problem_hash, name, kv, layout, role, e, top_k, n, k, act, w_dtype, out_dtype, activation, tp, ep in (
                conn.execute(
                    """
                    SELECT p.problem_hash, k.name, k.kernel_version, k.weight_layout, k.role, p.num_experts,
                           p.top_k, p.n, p.k, p.act_dtype, p.w_dtype, p.out_dtype, p.activation, p.tp_size,
                           p.ep_size
                    FROM problem p JOIN kernel k USING (kernel_hash) ORDER BY p.problem_hash
                    """
                )
            )
        ]
    finally:
        conn.close()
    return envs, problems


def table_rows(path: Path) -> dict[str, list[tuple]]:
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in TABLES}
    finally:
        conn.close()


# ------------------------------------------------------------------ the shipped DB vs the full one


def test_every_lookup_of_the_full_db_gives_the_same_table_from_the_shipped_one() -> None:
    envs, problems = envs_and_problems(FULL_DB)
    assert envs and problems
    served = 0
    for problem_hash, problem in problems:
        assert problem.problem_hash() == problem_hash  # the key is rebuilt exactly
        for env in envs:
            full = TacticTable.load(problem, env, user_db=NOWHERE, bundled_db=FULL_DB)
            slim = TacticTable.load(problem, env, user_db=NOWHERE, bundled_db=shipped())
            assert (slim.source, slim.tier, slim.env_hash, slim.ranges) == (
                full.source,
                full.tier,
                full.env_hash,
                full.ranges,
            ), (problem, env)
            served += bool(full.ranges)
    assert served > 0  # the comparison covered tuned tables, not only misses


def test_the_default_lookup_finds_the_shipped_db() -> None:
    path = shipped()
    assert path == ROOT / "tactics.db"  # a source checkout reads the top's (a wheel, its prepkit/data/)
    _, problems = envs_and_problems(path)
    h100 = Environment(cc_major=9, cc_minor=0, name="NVIDIA H100 80GB HBM3", triton_version="3.6.0")
    tables = [TacticTable.load(p, h100, user_db=NOWHERE) for _, p in problems]
    assert any(t.ranges for t in tables)
    assert {t.source for t in tables if t.ranges} == {"bundled"}
    assert {t.db_path for t in tables if t.ranges} == {str(path)}


def test_show_rows_plot_curves_and_tuner_seeds_are_those_of_the_full_db() -> None:
    with store.open_db_readonly(FULL_DB) as full, store.open_db_readonly(shipped()) as slim:
        assert slim.winners() == full.winners()
        pairs = sorted({(w["env_hash"], w["problem_hash"]) for w in full.winners()})
        for env_hash, problem_hash in pairs:
            curve = full.curves(env_hash, problem_hash)
            assert curve and slim.curves(env_hash, problem_hash) == curve
        _, problems = envs_and_problems(FULL_DB)
        gpus = {w["gpu_name"] for w in full.winners()}
        for gpu in gpus:
            for _, problem in problems:
                assert slim.past_winners(gpu, problem) == full.past_winners(gpu, problem)
        assert slim.counts()["blocklist"] == full.counts()["blocklist"]


def test_the_shipped_db_is_what_the_bundle_writes_from_the_full_one(tmp_path: Path) -> None:
    """Catches a full DB merged without re-running the bundle (``make tactics-bundle``)."""
    fresh = tmp_path / "tactics.db"
    counts = bundle.write_bundle(FULL_DB, fresh)
    assert table_rows(fresh) == table_rows(shipped())
    assert counts["correctness"] == 0 and counts["winner"] > 0
    assert fresh.stat().st_size < FULL_DB.stat().st_size / 4


def test_the_shipped_db_is_a_single_current_schema_file() -> None:
    conn = sqlite3.connect(f"{shipped().as_uri()}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # no -wal beside it
        assert conn.execute("SELECT count(*) FROM measurement WHERE samples_json IS NOT NULL").fetchone()[0] == 0
    finally:
        conn.close()


# ----------------------------------------------------------------------------- the thinning rule


def test_bundle_keeps_defaults_and_each_winner_only_where_it_serves(tmp_path: Path) -> None:
    src, dest = tmp_path / "full.db", tmp_path / "slim.db"
    small, big, loser, failed = tac(16), tac(128), tac(64), tac(32)
    with open_db(src) as tdb:
        env_hash = tdb.put_env(env_record(H100, package_version="0.1.0"))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=TOKEN_POINTS)
        ph = tdb.put_problem(G1)
        rows = []
        for m in (1, 8, 64, 512):
            rows.append({"m": m, "params_json": small, "status": "ok", "is_default": True, "median_us": 10.0 + m})
            for t, us in ((big, 9.0 + m), (loser, 12.0 + m)):
                rows.append({"m": m, "params_json": t, "status": "ok", "median_us": us, "samples_us": [us, us]})
            rows.append({"m": m, "params_json": failed, "status": "error", "error_text": "out of resources"})
        tdb.add_measurements(run, env_hash, ph, rows)
        tdb.add_correctness(run, env_hash, ph, [{"params_json": loser, "passed": True, "m_values": [1, 7]}])
        tdb.add_blocklist(H100, G1, [(tac(256), "wrong results")])
        # ``big`` serves 9..512 and above; ``small`` (the default) serves 1..8.
        tdb.replace_winners(
            env_hash, ph, run, [WinnerRow(1, 8, small, False), WinnerRow(9, 512, big, True, runner_up_json=loser)]
        )
        tdb.finish_run(run, "complete")
        full_curve = tdb.curves(env_hash, ph)

    counts = bundle.write_bundle(src, dest)
    with store.open_db_readonly(dest) as slim:
        kept = sorted(
            (r["m"], json.loads(r["params_json"])["block_m"], r["is_default"])
            for r in slim.db.query("SELECT m.*, t.params_json FROM measurement m JOIN tactic t USING (tactic_hash)")
        )
        assert slim.curves(env_hash, ph) == full_curve
        tactics = {json.loads(r["params_json"])["block_m"] for r in slim.db.query("SELECT params_json FROM tactic")}
    # the default at every point, the winner only at the points its range serves, nothing else
    assert kept == [(1, 16, 1), (8, 16, 1), (64, 16, 1), (64, 128, 0), (512, 16, 1), (512, 128, 0)]
    assert counts["correctness"] == 0 and counts["blocklist"] == 1
    # the runner-up and the blocklisted tactic stay; the failed one, referenced by nothing kept, goes
    assert tactics == {16, 128, 64, 256}
    assert TacticTable.load(G1, H100, user_db=NOWHERE, bundled_db=dest).ranges == (
        TacticTable.load(G1, H100, user_db=NOWHERE, bundled_db=src).ranges
    )


def test_bundle_refuses_to_overwrite_its_source_and_reports_a_bad_source(tmp_path: Path) -> None:
    src = tmp_path / "full.db"
    open_db(src).close()
    before = src.read_bytes()
    with pytest.raises(TacticsError, match="its own source"):
        bundle.write_bundle(src, src)
    assert src.read_bytes() == before
    with pytest.raises(TacticsError, match="no such tactics DB"):
        bundle.write_bundle(tmp_path / "missing.db", tmp_path / "out.db")
    assert bundle.main([str(tmp_path / "missing.db"), str(tmp_path / "out.db")]) == 3
    assert not (tmp_path / "out.db").exists()
