"""tactics.db: schema, migrations, bad files, merge, concurrent writers, and the runtime lookup."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepkit.dims import ModelDims
from prepkit.errors import TacticsError
from prepkit.layer import rank_layer
from prepkit.layouts.base import RankSpec
from prepkit.tactics import keys, lookup, resolver, schema, store
from prepkit.tactics.keys import Environment, gpt_oss_problems, layer_problems
from prepkit.tactics.lookup import (
    TOKEN_POINTS,
    Range,
    RangeTable,
    TacticResolver,
    TacticsDBWarning,
    TacticTable,
    merge_points,
    point_for,
)
from prepkit.tactics.schema import SCHEMA_VERSION
from prepkit.tactics.store import RunRecorder, WinnerRow, env_record, open_db

H100 = Environment(cc_major=9, cc_minor=0, name="NVIDIA H100 80GB HBM3", sm_count=132, triton_version="3.6.0")
PROBS = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3")
G1, G2 = PROBS["gemm1"], PROBS["gemm2"]
GPT_OSS_120B_TP1 = rank_layer(ModelDims(36, 128, 2880, 2880, 4))
# Every schema step this prepkit applies, in order: a new file records each once.
STEP_NAMES = ["create_v1", "add_winner_search", "add_measurement_kind", "create_decode_winner"]


def tac(bm: int, **kw: int) -> str:
    return json.dumps({"block_m": bm, "block_n": 64, "num_stages": 3, **kw}, sort_keys=True)


def fill(path: Path | str, env: Environment = H100, winners: list[WinnerRow] | None = None, problem=G1) -> str:
    """A DB holding one environment, one run and the given winner ranges; returns the env hash."""
    with open_db(path) as tdb:
        env_hash = tdb.put_env(env_record(env, package_version="0.1.0", mem_bw_gbps=3000.0))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=TOKEN_POINTS)
        tdb.put_problem(problem)
        rows = winners or [
            WinnerRow(1, 8, tac(16), False, 10.0, 12.0, 1.2),
            WinnerRow(9, 512, tac(32), False, 20.0, 22.0, 1.1),
            WinnerRow(513, 8192, tac(128), True, 900.0, 950.0, 1.05),
        ]
        tdb.replace_winners(env_hash, problem.problem_hash(), run, rows)
        tdb.finish_run(run, "complete")
    return env_hash


# ------------------------------------------------------------------------- schema, bad files


def test_new_file_gets_schema_rollback_journal_and_application_id(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with open_db(path) as tdb:
        assert tdb.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert tdb.conn.execute("PRAGMA application_id").fetchone()[0] == schema.APPLICATION_ID
        assert tdb.conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert set(tdb.counts()) >= {"env", "kernel", "problem", "measurement", "correctness", "winner"}
    with open_db(path) as tdb:  # reopening applies nothing twice
        names = [r[0] for r in tdb.conn.execute("SELECT name FROM _sqlite_migrations ORDER BY id")]
    assert names == STEP_NAMES


def test_in_memory_db_for_tests() -> None:
    with open_db(":memory:") as tdb:
        assert tdb.counts()["winner"] == 0


def test_refuses_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    open_db(path).close()
    with sqlite3.connect(path) as c:
        c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(TacticsError, match="newer") as info:
        open_db(path)
    assert "upgrade prepkit" in (info.value.hint or "")
    with pytest.raises(TacticsError, match="newer"):
        schema.open_readonly(path)


def test_refuses_unknown_migration_step(tmp_path: Path) -> None:
    path = tmp_path / "step.db"
    open_db(path).close()
    with sqlite3.connect(path) as c:
        c.execute(
            "INSERT INTO _sqlite_migrations (migration_set, name, applied_at) VALUES ('prepkit.tactics', 'v99', 'x')"
        )
    with pytest.raises(TacticsError, match="v99"):
        open_db(path)


def test_refuses_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.db"
    path.write_bytes(b"this is not sqlite at all, just text" * 200)
    before = path.read_bytes()
    with pytest.raises(TacticsError, match="not a readable SQLite"):
        open_db(path)
    with pytest.raises(TacticsError, match="not a readable SQLite"):
        schema.open_readonly(path)
    assert path.read_bytes() == before


def test_refuses_truncated_db(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    fill(path)
    with sqlite3.connect(path) as c:  # fold the WAL in so the main file holds everything
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = path.read_bytes()
    path.write_bytes(data[:1024] + b"\x00" * 100)
    with pytest.raises(TacticsError), open_db(path, create=False) as tdb:
        tdb.winners()


def test_refuses_foreign_sqlite_and_leaves_it_alone(tmp_path: Path) -> None:
    path = tmp_path / "foreign.db"
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE notes (x TEXT)")
        c.execute("INSERT INTO notes VALUES ('keep me')")
    before = path.read_bytes()
    with pytest.raises(TacticsError, match="not a prepkit tactics DB"):
        open_db(path)
    assert path.read_bytes() == before
    assert not Path(str(path) + "-wal").exists()


def test_empty_file_is_initialized(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    with open_db(path) as tdb:
        assert tdb.counts()["env"] == 0


def test_missing_file_without_create(tmp_path: Path) -> None:
    with pytest.raises(TacticsError, match="no such tactics DB"):
        open_db(tmp_path / "nope.db", create=False)


# ------------------------------------------------------------------------------- the lookup


def test_lookup_expands_ranges_with_ceil_semantics(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    fill(path)
    table = TacticTable.load(G1, H100, user_db=path, bundled_db=False)
    assert (table.source, table.tier) == ("user", "exact")
    assert table.tactic_for(1) == table.tactic_for(8) == keys.canonical_json(json.loads(tac(16)))
    assert json.loads(table.tactic_for(9))["block_m"] == 32
    assert json.loads(table.tactic_for(512))["block_m"] == 32
    assert json.loads(table.tactic_for(513))["block_m"] == 128
    assert json.loads(table.tactic_for(100_000))["block_m"] == 128  # the last range extends up
    assert table.tactic_for(0) is None
    assert (table.hits, table.misses) == (6, 1)


def test_no_extends_up_means_default_above(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    fill(path, winners=[WinnerRow(1, 64, tac(16), False)])
    res = TacticResolver(user_db=path, bundled_db=False)
    assert res.lookup(G1, 64, H100) is not None
    with pytest.warns(TacticsDBWarning, match="covers 1-64"):
        assert res.lookup(G1, 65, H100) is None
    assert res.stats()["misses"] == 1


@pytest.mark.parametrize(
    "device,problem",
    [
        (replace(H100, cc_major=12, cc_minor=0, name="RTX PRO 6000"), G1),  # other compute capability
        (replace(H100, cc_minor=1), G1),
        (H100, replace(G1, kernel_version="2")),  # other kernel version
        (H100, replace(G1, weight_layout="triton_moe_v1")),  # other layout
        (H100, replace(G1, role="gemm2")),
        (H100, replace(G1, n=2880)),  # no nearest-shape matching
    ],
)
def test_never_uses_a_row_of_another_arch_kernel_or_layout(tmp_path: Path, device, problem) -> None:
    path = tmp_path / "u.db"
    fill(path)
    res = TacticResolver(user_db=path, bundled_db=False)
    with pytest.warns(TacticsDBWarning, match=r"prepkit tune --arch sm\d+"):
        assert res.lookup(problem, 4, device) is None


def test_miss_warns_once_and_names_the_command(tmp_path: Path) -> None:
    res = TacticResolver(user_db=tmp_path / "none.db", bundled_db=False)
    sm121 = Environment(cc_major=12, cc_minor=1, name="NVIDIA GB10", triton_version="3.6.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (1, 2, 3, 4000):
            assert res.lookup(G2, m, sm121) is None
    msgs = [str(w.message) for w in caught if issubclass(w.category, TacticsDBWarning)]
    assert len(msgs) == 1
    assert "prepkit tune --arch sm121 --model gpt-oss-120b --tp 1" in msgs[0]
    assert res.stats()["misses"] == 4 and res.stats()["hits"] == 0


def test_triton_minor_mismatch_needs_a_smoke_check(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    fill(path)
    newer = replace(H100, triton_version="3.7.1")
    assert TacticTable.load(G1, newer, user_db=path, bundled_db=False).ranges == ()
    seen: list[tuple[list[str], list[int]]] = []

    def smoke(tactics, ms) -> bool:
        seen.append((list(tactics), list(ms)))
        return True

    t = TacticTable.load(G1, newer, user_db=path, bundled_db=False, smoke_check=smoke)
    assert t.tier == "triton_minor" and len(t.ranges) == 3
    assert seen and seen[0][1] == [1, 8192] and len(seen[0][0]) == 3
    refused = TacticTable.load(G1, newer, user_db=path, bundled_db=False, smoke_check=lambda t, m: False)
    assert refused.ranges == () and any("smoke check" in n for n in refused.notes)
    # The same minor with another patch release is exact.
    assert TacticTable.load(G1, replace(H100, triton_version="3.6.9"), user_db=path, bundled_db=False).tier == "exact"


def test_user_db_wins_over_bundled_then_bundled_serves(tmp_path: Path) -> None:
    user, bundled = tmp_path / "user.db", tmp_path / "bundled.db"
    fill(bundled, winners=[WinnerRow(1, 8192, tac(64), True)])
    t = TacticTable.load(G1, H100, user_db=user, bundled_db=bundled)
    assert t.source == "bundled" and json.loads(t.tactic_for(3))["block_m"] == 64
    fill(user, winners=[WinnerRow(1, 8192, tac(16), True)])
    t = TacticTable.load(G1, H100, user_db=user, bundled_db=bundled)
    assert t.source == "user" and json.loads(t.tactic_for(3))["block_m"] == 16


def test_corrupt_user_db_is_skipped_with_a_warning(tmp_path: Path) -> None:
    user, bundled = tmp_path / "user.db", tmp_path / "bundled.db"
    user.write_bytes(b"garbage" * 500)
    fill(bundled)
    with pytest.warns(TacticsDBWarning, match="not a readable SQLite"):
        t = TacticTable.load(G1, H100, user_db=user, bundled_db=bundled)
    assert t.source == "bundled"


def test_same_gpu_model_preferred_among_environments(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    fill(path, env=replace(H100, name="NVIDIA H200"), winners=[WinnerRow(1, 8192, tac(64), True)])
    fill(path, env=H100, winners=[WinnerRow(1, 8192, tac(32), True)])
    fill(
        path,
        env=replace(H100, name="NVIDIA H200", driver_version="999"),
        winners=[WinnerRow(1, 8192, tac(16), True)],
    )
    t = TacticTable.load(G1, H100, user_db=path, bundled_db=False)
    assert json.loads(t.tactic_for(1))["block_m"] == 32
    h200 = TacticTable.load(G1, replace(H100, name="NVIDIA H200"), user_db=path, bundled_db=False)
    assert json.loads(h200.tactic_for(1))["block_m"] in (16, 64)


def test_blocklisted_winner_is_not_served(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    fill(path)
    with open_db(path) as tdb:
        tdb.add_blocklist(H100, G1, [(tac(32), "numerics_fail on a later check")])
    t = TacticTable.load(G1, H100, user_db=path, bundled_db=False)
    assert t.tactic_for(100) is None and t.tactic_for(1) is not None
    assert any("blocklisted" in n for n in t.notes)
    # The blocklist is per Triton minor: another minor's blocklist does not apply.
    other = replace(H100, triton_version="3.7.0")
    assert TacticTable.load(G1, other, user_db=path, bundled_db=False, smoke_check=lambda *a: True).tactic_for(100)


@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_ranges_from_points_cover_every_token_count(data) -> None:
    n = data.draw(st.integers(1, len(TOKEN_POINTS)))
    points = sorted(data.draw(st.sets(st.sampled_from(TOKEN_POINTS), min_size=n, max_size=n)))
    winners = [data.draw(st.sampled_from(["a", "b", "c"])) for _ in points]
    ranges = [Range(lo, hi, winners[idx[-1]]) for lo, hi, idx in merge_points(points, winners)]
    assert ranges[0].m_lo == 1 and ranges[-1].m_hi == points[-1]
    assert all(a.m_hi + 1 == b.m_lo and a.value != b.value for a, b in zip(ranges, ranges[1:], strict=False))
    table = RangeTable(ranges)
    for m in range(1, points[-1] + 1, max(1, points[-1] // 200)):
        p = point_for(m, points)
        owner = next(r for r in ranges if r.m_lo <= m <= r.m_hi)
        assert owner.value == winners[points.index(p)] == table.get(m)
    assert table.get(points[-1] + 1) is None  # nothing extends upward unless marked


def test_token_series_is_the_documented_one() -> None:
    assert TOKEN_POINTS[:10] == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
    assert TOKEN_POINTS[10:] == (
        24,
        32,
        48,
        64,
        96,
        128,
        192,
        256,
        384,
        512,
        768,
        1024,
        1536,
        2048,
        3072,
        4096,
        6144,
        8192,
    )


def test_adapter_for_the_moe_runtime(tmp_path: Path) -> None:
    from prepkit.kernels.device import H100 as KH100
    from prepkit.kernels.tactic import GemmTactic
    from prepkit.kernels.variants import default_tactics
    from prepkit.tactics.choose import MoeCall, choose

    path = tmp_path / "u.db"
    g1 = GemmTactic(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4)
    fill(path, env=Environment.of(KH100), winners=[WinnerRow(1, 8192, g1.to_json(), True)])
    tactic_lookup = lookup.make_tactic_lookup(resolver=TacticResolver(user_db=path, bundled_db=False), kernel_version=1)
    prob = GPT_OSS_120B_TP1.problem(7)
    with pytest.warns(TacticsDBWarning):  # GEMM2 has no rows: the chooser's default fills it, warned once
        pair = tactic_lookup(prob, KH100)
    assert pair == (g1, None)
    chosen = choose(MoeCall(prob, tactic_lookup), KH100, "bf16", on_cuda=True)
    assert chosen.tactics == (g1, default_tactics(prob, KH100)[1]) and chosen.tuned
    other = lookup.make_tactic_lookup(resolver=TacticResolver(user_db=path, bundled_db=False), kernel_version=2)
    with pytest.warns(TacticsDBWarning):
        assert other(prob, KH100) is None


# ------------------------------------------------------------------------------------ merge


def test_past_winners_span_kernel_versions_not_gpus_or_shapes(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    fill(path, winners=[WinnerRow(1, 8, tac(16), False), WinnerRow(9, 8192, tac(64), True)])
    fill(path, winners=[WinnerRow(1, 8192, tac(32), True)], problem=replace(G1, kernel_version="2"))
    fill(path, env=replace(H100, name="NVIDIA H200"), winners=[WinnerRow(1, 8192, tac(128), True)])
    fill(path, winners=[WinnerRow(1, 8192, tac(256), True)], problem=G2)
    with open_db(path) as tdb:

        def past(gpu: str, problem: Any) -> list[int]:
            return [json.loads(t)["block_m"] for t in tdb.past_winners(gpu, problem)]

        got = past(H100.name, replace(G1, kernel_version="3"))
        assert got[0] == 32  # the newest run first
        assert sorted(got) == [16, 32, 64]
        assert past("NVIDIA H200", G1) == [128]
        assert past("NVIDIA GB10", G1) == []


def test_merge_unions_rows_and_keeps_newer_winner_sets(tmp_path: Path) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    env_a = fill(a, winners=[WinnerRow(1, 8, tac(16), False), WinnerRow(9, 64, tac(32), False)])
    fill(b, env=replace(H100, name="NVIDIA H200"), winners=[WinnerRow(1, 8192, tac(64), True)])
    # b also re-tuned a's environment later: its range set replaces a's as a whole
    fill(b, env=H100, winners=[WinnerRow(1, 4, tac(128), False)])
    b_before = b.read_bytes()
    with open_db(a) as tdb:
        summary = tdb.merge_from(b)
        added = summary.added
        assert summary.replaced == 2  # a's two ranges gave way to b's newer one
        assert added["env"] == 1 and added["tuning_run"] == 2
        rows = tdb.db.execute("SELECT m_lo, m_hi FROM winner WHERE env_hash = ? ORDER BY m_lo", [env_a]).fetchall()
        assert rows == [(1, 4)]
        assert tdb.counts()["winner"] == 2
        again = tdb.merge_from(b)
        assert set(again.added.values()) == {0} and again.replaced == 0
        with pytest.raises(TacticsError, match="itself"):
            tdb.merge_from(a)
    assert b.read_bytes() == b_before


def test_merge_keeps_own_newer_winners(tmp_path: Path) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    fill(b, winners=[WinnerRow(1, 4, tac(128), False)])
    env = fill(a, winners=[WinnerRow(1, 8, tac(16), False)])  # later run
    with open_db(a) as tdb:
        tdb.merge_from(b)
        rows = tdb.db.execute("SELECT m_hi FROM winner WHERE env_hash = ?", [env]).fetchall()
    assert rows == [(8,)]


def test_merge_refuses_bad_source(tmp_path: Path) -> None:
    a, bad = tmp_path / "a.db", tmp_path / "bad.db"
    bad.write_bytes(b"nope" * 1000)
    with open_db(a) as tdb, pytest.raises(TacticsError):
        tdb.merge_from(bad)


def test_export_holds_every_table(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    fill(path)
    with open_db(path) as tdb:
        out = tdb.export()
    assert out["schema_version"] == SCHEMA_VERSION
    assert len(out["tables"]["winner"]) == 3 and len(out["tables"]["env"]) == 1
    json.dumps(out)


# ------------------------------------------------------------------------ concurrent writers


def _writer(path: str, worker: int, n: int, start: Any) -> None:
    start.wait(60)  # both open the new file (and migrate it) at the same moment
    with open_db(path) as tdb:
        env = replace(H100, name=f"GPU{worker}")
        env_hash = tdb.put_env(env_record(env, package_version="0"))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=[1])
        rec = RunRecorder(tdb, run, env_hash, env)
        for i in range(n):  # one transaction per row: as many lock hand-overs as possible
            tdb.add_measurements(
                run,
                env_hash,
                rec.tdb.put_problem(G1),
                [{"m": i + 1, "params_json": tac(16, w=worker), "status": "ok", "median_us": 1.0}],
            )


def test_two_processes_writing_one_db_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.db")  # not created yet: both race through the migration too
    # spawn, not fork: a forked child can inherit a lock another test thread held and hang.
    ctx = multiprocessing.get_context("spawn")
    n = 100
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(path, w, n, start)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with open_db(path) as tdb:
        assert tdb.counts()["measurement"] == 2 * n
        assert tdb.counts()["env"] == 2 and tdb.counts()["tuning_run"] == 2
        names = [r[0] for r in tdb.conn.execute("SELECT name FROM _sqlite_migrations ORDER BY id")]
    assert names == STEP_NAMES


def test_runtime_lookup_imports_only_the_standard_library() -> None:
    """The modules the runtime reads tactics with pull in no sqlite-utils, click, rich or torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import prepkit.tactics.lookup, prepkit.tactics.keys, prepkit.tactics.schema\n"
        "heavy = {'sqlite_utils', 'click', 'rich', 'torch', 'triton'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------------- schema evolution


def test_adding_a_column_is_one_schema_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``AddColumn`` appended to ``schema.STEPS`` migrates an existing DB (rows kept) and a
    new one alike; inserts and exports see the column; an older prepkit then refuses the file."""
    path = tmp_path / "old.db"
    fill(path)
    with open_db(path) as tdb:
        before = tdb.counts()
    step = schema.AddColumn("problem", "act_block", "INTEGER")
    monkeypatch.setattr(schema, "STEPS", (*schema.STEPS, step))
    monkeypatch.setattr(schema, "SCHEMA_VERSION", len(schema.STEPS))
    assert schema.columns("problem")[-1] == "act_block"
    for p in (path, tmp_path / "new.db"):
        with open_db(p) as tdb:
            assert "act_block" in {c.name for c in tdb.db["problem"].columns}
            assert tdb.conn.execute("PRAGMA user_version").fetchone()[0] == len(STEP_NAMES) + 1
            names = [r[0] for r in tdb.conn.execute("SELECT name FROM _sqlite_migrations ORDER BY id")]
            assert names == [*STEP_NAMES, "add_problem_act_block"]
            assert tdb.export()["schema_version"] == len(STEP_NAMES) + 1
    with open_db(path) as tdb:
        assert tdb.counts() == before
    monkeypatch.undo()
    with pytest.raises(TacticsError, match="newer"):
        open_db(path)


def test_a_version_1_db_opens_and_its_winners_were_found_by_the_pruned_search(tmp_path: Path) -> None:
    """A DB written before ``winner.search`` existed migrates in place (rows kept) and reads
    read-only through a migrated copy (the file unchanged); its ranges came from the pruned sweep,
    the only search then. New rows record the search they are written with."""
    path = tmp_path / "v1.db"
    fill(path)
    with sqlite3.connect(path) as c:  # back to the file a version-1 prepkit wrote
        c.execute("ALTER TABLE winner DROP COLUMN search")
        c.execute("DELETE FROM _sqlite_migrations WHERE name = 'add_winner_search'")
        c.execute("PRAGMA user_version = 1")
    c.close()
    before = path.read_bytes()
    with store.open_db_readonly(path) as tdb:
        assert {w["search"] for w in tdb.winners()} == {"pruned"} and len(tdb.winners()) == 3
    assert path.read_bytes() == before
    table = TacticTable.load(G1, H100, user_db=path, bundled_db=False)  # the runtime reads it unmigrated
    assert json.loads(table.tactic_for(3))["block_m"] == 16
    with open_db(path) as tdb:
        assert tdb.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert [r[0] for r in tdb.conn.execute("SELECT search FROM winner")] == [None] * 3
        env_hash = tdb.conn.execute("SELECT env_hash FROM env").fetchone()[0]
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=TOKEN_POINTS)
        tdb.put_problem(G2)
        tdb.replace_winners(env_hash, G2.problem_hash(), run, [WinnerRow(1, 8, tac(32), True)], search="thorough")
        by_role = {w["role"]: w["search"] for w in tdb.winners()}
        with pytest.raises(ValueError, match="unknown search"):
            tdb.replace_winners(env_hash, G2.problem_hash(), run, [], search="exhaustive")
    assert by_role == {"gemm1": "pruned", "gemm2": "thorough"}


def test_merge_refuses_a_winner_of_an_unknown_search(tmp_path: Path) -> None:
    src = tmp_path / "src.db"
    fill(src)
    with sqlite3.connect(src) as c:
        c.execute("UPDATE winner SET search = 'exhaustive' WHERE m_lo = 9")
    with pytest.raises(TacticsError, match="search 'exhaustive' is none of pruned, thorough"):
        store.merge_into(tmp_path / "dest.db", src)
    assert not (tmp_path / "dest.db").exists()


def test_curves_follow_the_lookup_rule_above_the_last_range(tmp_path: Path) -> None:
    """The plot's tuned curve uses the lookup's range rule: a range marked ``extends_up`` serves
    the token counts above it, as it does at run time."""
    path = tmp_path / "c.db"
    fill(path, winners=[WinnerRow(1, 8, tac(16), True)])
    with open_db(path) as tdb:
        run_id = tdb.conn.execute("SELECT run_id FROM tuning_run").fetchone()[0]
        env_hash = tdb.conn.execute("SELECT env_hash FROM env").fetchone()[0]
        ph = G1.problem_hash()
        rows = [
            {"m": m, "params_json": t, "status": "ok", "is_default": d, "median_us": us}
            for m in (8, 64)
            for t, d, us in ((tac(16), False, 1.0 * m), (tac(64), True, 2.0 * m))
        ]
        tdb.add_measurements(run_id, env_hash, ph, rows)
        curve = tdb.curves(env_hash, ph)
    assert [(c["m"], c["default_us"], c["tuned_us"]) for c in curve] == [(8, 16.0, 8.0), (64, 128.0, 64.0)]


def test_the_runtime_uses_rows_of_another_triton_and_says_so_once(tmp_path: Path, monkeypatch) -> None:
    from prepkit.kernels.device import H100 as KH100
    from prepkit.kernels.tactic import GemmTactic

    path = tmp_path / "u.db"
    g1 = GemmTactic(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4)
    g2 = GemmTactic(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3, split_k=2)
    older = replace(Environment.of(KH100), triton_version="2.9.0")  # a minor no installed Triton has
    fill(path, env=older, winners=[WinnerRow(1, 8192, g1.to_json(), True)])
    fill(path, env=older, winners=[WinnerRow(1, 8192, g2.to_json(), True)], problem=G2)
    prob = GPT_OSS_120B_TP1.problem(7)
    strict = lookup.make_tactic_lookup(resolver=TacticResolver(user_db=path, bundled_db=False), kernel_version=1)
    with pytest.warns(TacticsDBWarning, match="prepkit tune"):
        assert strict(prob, KH100) is None
    # The runtime's own resolver (what load_moe_layers uses when given none).
    monkeypatch.setattr(
        resolver, "_runtime_resolver", TacticResolver(user_db=path, bundled_db=False, smoke_check=resolver._all_decode)
    )
    runtime = lookup.make_tactic_lookup(kernel_version=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert runtime(prob, KH100) == (g1, g2)
        assert runtime(replace(prob, num_tokens=900), KH100) == (g1, g2)
    msgs = [str(w.message) for w in caught if "another Triton" in str(w.message)]
    assert len(msgs) == 2 and "gemm1" in msgs[0] and "gemm2" in msgs[1]


def test_rows_that_no_longer_decode_do_not_serve(tmp_path: Path) -> None:
    from prepkit.kernels.device import H100 as KH100

    path = tmp_path / "u.db"
    older = replace(Environment.of(KH100), triton_version="2.9.0")
    fill(path, env=older, winners=[WinnerRow(1, 8192, json.dumps({"block_q": 3}), True)])
    res = TacticResolver(user_db=path, bundled_db=False, smoke_check=resolver._all_decode)
    table = res.table(G1, KH100)
    assert table.ranges == () and any("smoke check" in n for n in table.notes)
    prob = GPT_OSS_120B_TP1.problem(7)
    with pytest.warns(TacticsDBWarning):
        assert lookup.make_tactic_lookup(resolver=res, kernel_version=1)(prob, KH100) is None


# ------------------------------------------------------------------------------ hash pinning

# Problem hashes of real layers as the tactics DBs store them (computed before problem keys took
# per-rank dims, with kernel version 7). A change here orphans every stored row: see the warning
# next to ProblemKey.
PINNED_PROBLEM_HASHES = {
    ("gpt-oss-120b", 1, "bf16"): ("7a98709c1cf0ceb6eae972d97293a046", "cba2121d9a392bff78e59baa9b10161e"),
    ("gpt-oss-120b", 1, "mxfp8"): ("d0ec943ccecce01d8b7ebea5cf2e4f48", "80fca1264c9f6b55c5dd28608b6859ab"),
    ("gpt-oss-120b", 1, "mxfp4"): ("e77ad723247af68a08a77633182d9f7a", "68ee5b62bcf1c4e7edfc0abda5fff31f"),
    ("gpt-oss-120b", 2, "bf16"): ("148e38e9318391aa54354b712961ab39", "d6fc18f34f10ef5793da3744ad14fa8c"),
    ("gpt-oss-120b", 2, "mxfp8"): ("e2efce213d80db24d61de0d0aa8fb31a", "00958bd5d17a1a837c50a136c650d34f"),
    ("gpt-oss-120b", 2, "mxfp4"): ("179c008342f6ece8e1589ed3a3b3da7c", "42b731f5b294d52ad7970c1ea0999356"),
    ("gpt-oss-120b", 4, "bf16"): ("5e4cdf3fbd4bae307f051363ed30f3b1", "f4394b1dd7b5fc7877c5ab7a6f2c14a5"),
    ("gpt-oss-120b", 4, "mxfp8"): ("35b5bed6b6c7bf0534b59b835e3d4c44", "d60e2804c79e1820afefc1e1375521e6"),
    ("gpt-oss-20b", 1, "bf16"): ("b24d01b7607e51d89279bde24a77a3af", "c85e8b9b3be5b6e830143a94ebb28c82"),
    ("gpt-oss-20b", 1, "mxfp8"): ("865c0ba357364efab79d8358632e03d2", "450a1e3445fc26bb1adb76e5a3048b1e"),
    ("gpt-oss-20b", 1, "mxfp4"): ("12142f69a4b59db26c4f2c29862d68b3", "cff211ded0fbb80c23c8faf600f77ad4"),
}
PINNED_KERNEL_HASHES = ("3c3124cf4ac932d6984cde6c23e78115", "adfa5c6f806e923023d8616816602b73")


@pytest.mark.parametrize(("model", "tp", "policy"), sorted(PINNED_PROBLEM_HASHES))
def test_problem_hashes_of_real_layers_are_pinned(model: str, tp: int, policy: str) -> None:
    from prepkit.tune.run import tune_problems

    keys_ = tune_problems(model=model, shards=None, tp=tp, kernel_version="7", activations=policy)
    assert tuple(k.problem_hash() for k in keys_) == PINNED_PROBLEM_HASHES[(model, tp, policy)]
    assert tuple(k.kernel_hash() for k in keys_) == PINNED_KERNEL_HASHES


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 5000])
def test_the_runtime_lookup_keys_a_layer_as_the_tuner_does(num_tokens: int) -> None:
    """The runtime keys a call by its layer record alone: every rank of a TP split asks the rows
    the tuner stored for TP rank 0 when the ranks hold as many rows (tp 2), whatever the tokens."""
    for tp_rank in (0, 1):
        layer = rank_layer(ModelDims(36, 128, 2880, 2880, 4), RankSpec(tp_size=2, tp_rank=tp_rank))
        got = layer_problems(
            layer.problem(num_tokens).layer, kernel="moe_mxfp4", kernel_version="7",
            weight_layout="triton_moe_v3", act_dtype="mxfp8",
        )  # fmt: skip
        assert (got["gemm1"].problem_hash(), got["gemm2"].problem_hash()) == PINNED_PROBLEM_HASHES[
            ("gpt-oss-120b", 2, "mxfp8")
        ]


def test_the_db_lookup_warns_once_per_layer_for_a_missed_tactic(tmp_path: Path) -> None:
    from prepkit.kernels.device import H100 as KH100
    from prepkit.warn_once import new_owner, owned_by

    fn = lookup.make_tactic_lookup(resolver=TacticResolver(user_db=tmp_path / "none.db", bundled_db=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for owner in (new_owner(), new_owner()):  # two layers of the same shape
            with owned_by(owner):
                for m in (1, 7, 300, 9000):
                    assert fn(GPT_OSS_120B_TP1.problem(m), KH100) is None
    msgs = [str(w.message) for w in caught if issubclass(w.category, TacticsDBWarning)]
    assert len(msgs) == 2 and all("no tuned tactics for gemm1" in m for m in msgs), msgs
