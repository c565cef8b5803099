"""``prepkit tune`` and ``prepkit tactics ...`` through click's CliRunner, on the CPU."""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import asdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.kernels.device import H100 as KH100
from prepkit.tactics.keys import Environment
from prepkit.tactics.table import TacticTable
from prepkit.tune import FunctionBackend, Worker
from prepkit.tune import run as tune_run

H100_ENV = Environment.of(KH100)
TOKENS = "1-4,64,8192"


def synthetic_timer(t: str, m: int) -> list[float]:
    """Latency model of the stand-in GPU: small row blocks win small M, big tiles win big M."""
    d = json.loads(t)
    fit = abs(d["block_m"].bit_length() - (5 if m <= 64 else 8))
    us = (5.0 + m * 0.01) * (1 + 0.15 * fit + (0.05 if d["block_n"] < 128 else 0) + 0.01 * d["num_stages"])
    return [us * (1 + 0.001 * i) for i in range(9)]


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """Replace the GPU workers with stand-in backends describing an H100."""
    made: list[FunctionBackend] = []

    def open_backends(gpus, env=None):
        made.clear()
        for _ in gpus or [0]:
            made.append(FunctionBackend(synthetic_timer, lambda t: json.loads(t)["block_n"] != 32))
        return [Worker(b, H100_ENV, KH100) for b in made]

    monkeypatch.setattr(tune_run, "open_gpu_workers", open_backends)
    return made


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_tune_without_gpu_is_a_clear_error(tmp_path: Path) -> None:
    r = invoke("tune", "--arch", "sm90", "--db", str(tmp_path / "t.db"))
    assert r.exit_code == 5
    assert "no CUDA GPU" in r.output and "Hint:" in r.output
    assert not (tmp_path / "t.db").exists()


def test_tune_refuses_another_arch(fake_gpu, tmp_path: Path) -> None:
    r = invoke("tune", "--arch", "sm121", "--db", str(tmp_path / "t.db"))
    assert r.exit_code == 5
    assert "--arch sm121" in r.output and "sm90" in r.output and "H100" in r.output


def test_tune_bad_tokens_is_a_usage_error(fake_gpu, tmp_path: Path) -> None:
    r = invoke("tune", "--tokens", "0,x", "--db", str(tmp_path / "t.db"))
    assert r.exit_code == 2 and "--tokens" in r.output


def test_tune_fills_db_then_resumes(fake_gpu, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    args = (
        "tune",
        "--arch",
        "sm90",
        "--db",
        str(db),
        "--tokens",
        TOKENS,
        "--max-candidates",
        "24",
        "--dense-formats",
        "none",
        "--json",
        "-q",
    )
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["arch"] == "sm90" and len(out["problems"]) == 2
    assert all(p["complete"] and p["timed"] > 0 and p["reused"] == 0 for p in out["problems"])
    assert all(p["blocklisted"] > 0 for p in out["problems"])  # the block_n=32 variants failed their check
    for role, prob in zip(("gemm1", "gemm2"), out["problems"], strict=True):
        assert prob["problem"].startswith(role)
        assert prob["geomean_speedup"] >= 1.0
    with sqlite3.connect(db) as c:
        runs = c.execute("SELECT status FROM tuning_run").fetchall()
        winners = c.execute("SELECT COUNT(*) FROM winner").fetchone()[0]
        bad = c.execute("SELECT COUNT(*) FROM winner w JOIN blocklist b USING (tactic_hash)").fetchone()[0]
    assert runs == [("complete",)] and winners >= 2 and bad == 0

    # The runtime reads what the CLI wrote.
    from prepkit.kernels.mx import KERNEL_VERSION
    from prepkit.tactics.keys import gpt_oss_problems

    probs = gpt_oss_problems(kernel="moe_mxfp4", kernel_version=str(KERNEL_VERSION), weight_layout="triton_moe_v3")
    table = TacticTable.load(probs["gemm1"], H100_ENV, user_db=db, bundled_db=False)
    assert table.tier == "exact" and table.tactic_for(3) and table.tactic_for(100_000)

    # A rerun never times a pair the DB holds. It goes on only with a refinement that stopped at its
    # round limit (this stand-in's landscape slopes on and on), so a few reruns reach a fixed point.
    first = sum(p["timed"] for p in out["problems"])
    twice = "SELECT COUNT(*) FROM (SELECT 1 FROM measurement GROUP BY problem_hash, m, tactic_hash HAVING COUNT(*) > 1)"
    for _ in range(8):
        again = json.loads(invoke(*args).output)
        more = sum(p["timed"] for p in again["problems"])
        with sqlite3.connect(db) as c:
            assert c.execute(twice).fetchone()[0] == 0  # no pair stored twice: none timed again
        assert more < first
        if not more:
            break
    assert all(p["timed"] == 0 and p["reused"] > 0 for p in again["problems"])
    assert all(not b.calls or all(op != "time" for op, _, _ in b.calls) for b in fake_gpu)


def test_tune_measures_past_winners_of_an_older_kernel(fake_gpu, tmp_path: Path, monkeypatch) -> None:
    from prepkit.kernels.mx import KERNEL_VERSION
    from prepkit.tactics.keys import gpt_oss_problems
    from prepkit.tactics.store import WinnerRow, env_record, open_db
    from prepkit.tune import kernel_candidates

    monkeypatch.setattr(tune_run, "bundled_db_path", lambda: None)  # only the DB written here
    old = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="0", weight_layout="triton_moe_v3")["gemm1"]
    now = gpt_oss_problems(kernel="moe_mxfp4", kernel_version=str(KERNEL_VERSION), weight_layout="triton_moe_v3")
    budget = kernel_candidates(now["gemm1"], KH100, max_count=8)
    past = next(t for t in kernel_candidates(now["gemm1"], KH100) if t not in budget and '"block_n":32' not in t)
    db = tmp_path / "t.db"
    with open_db(db) as tdb:
        env_hash = tdb.put_env(env_record(H100_ENV, package_version="0"))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=[1, 8])
        tdb.put_problem(old)
        tdb.replace_winners(env_hash, old.problem_hash(), run, [WinnerRow(1, 8192, past, True)])
        tdb.finish_run(run, "complete")
    r = invoke("tune", "--db", str(db), "--tokens", "1,8", "--max-candidates", "8", "--dense-formats", "none", "-q")
    assert r.exit_code == 0, r.output
    timed = {t for b in fake_gpu for op, t, _ in b.calls if op == "time"}
    assert past in timed


def test_tune_human_output_and_two_gpus(fake_gpu, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    r = invoke(
        "tune",
        "--db",
        str(db),
        "--tokens",
        "1,2,8",
        "--gpus",
        "0,1",
        "--max-candidates",
        "8",
        "--dense-formats",
        "none",
        "-q",
    )
    assert r.exit_code == 0, r.output
    assert str(db) in r.output and "gemm1" in r.output
    assert len(fake_gpu) == 2 and all(b.calls for b in fake_gpu)


def test_tune_shards_must_be_triton_moe(fake_gpu, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    r = invoke("tune", "--shards", str(shards), "--db", str(tmp_path / "t.db"))
    assert r.exit_code != 0 and r.exit_code != 1


@pytest.fixture
def filled(fake_gpu, tmp_path: Path) -> Path:
    db = tmp_path / "filled.db"
    r = invoke("tune", "--db", str(db), "--tokens", TOKENS, "--max-candidates", "12", "--dense-formats", "none", "-q")
    assert r.exit_code == 0, r.output
    return db


def test_show_export_plot(filled: Path, tmp_path: Path) -> None:
    r = invoke("tactics", "show", "--db", str(filled), "--json")
    assert r.exit_code == 0
    shown = json.loads(r.output)
    assert shown["counts"]["winner"] >= 2 and {w["role"] for w in shown["winners"]} == {"gemm1", "gemm2"}
    r = invoke("tactics", "show", "--db", str(filled))
    assert r.exit_code == 0 and "gemm2 N=2880" in r.output and "tokens" in r.output
    assert re.search(r"m\d+ n\d+ k\d+ w\d+ s\d+ sk\d+ upcast=\w+", r.output), r.output
    r = invoke("tactics", "export", "--db", str(filled))
    assert r.exit_code == 0
    exported = json.loads(r.output)
    assert exported["format"] == "prepkit-tactics" and exported["tables"]["measurement"]
    r = invoke("tactics", "export", "--json", "--db", str(filled))  # JSON is its only format: no flag for it
    assert r.exit_code == 2 and "No such option '--json'" in r.output
    png = tmp_path / "p.png"
    r = invoke("tactics", "plot", "--out", str(png), "--db", str(filled))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_empty_db_fails(tmp_path: Path) -> None:
    db = tmp_path / "e.db"
    from prepkit.tactics.store import open_db

    open_db(db).close()
    r = invoke("tactics", "plot", "--out", str(tmp_path / "x.png"), "--db", str(db))
    assert r.exit_code == 3 and "nothing to plot" in r.output


def test_merge(filled: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest.db"
    r = invoke("tactics", "merge", str(dest), str(filled), "--json")
    assert r.exit_code == 0, r.output
    added = json.loads(r.output)["added"]
    assert added["winner"] >= 2 and added["measurement"] > 0
    r = invoke("tactics", "merge", str(dest), str(filled), "--json")
    assert set(json.loads(r.output)["added"].values()) == {0}
    # The spelling of the other tactics commands: SRC, and the DB written with --db.
    r = invoke("tactics", "merge", str(filled), "--db", str(tmp_path / "new.db"), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["db"] == str(tmp_path / "new.db") and json.loads(r.output)["added"] == added


@pytest.mark.parametrize("kind", ["corrupt", "foreign", "newer", "missing"])
def test_bad_db_files_exit_3_with_a_message(tmp_path: Path, kind: str) -> None:
    db = tmp_path / "bad.db"
    if kind == "corrupt":
        db.write_bytes(b"\x00garbage" * 300)
    elif kind == "foreign":
        with sqlite3.connect(db) as c:
            c.execute("CREATE TABLE t (x)")
    elif kind == "newer":
        from prepkit.tactics.schema import SCHEMA_VERSION
        from prepkit.tactics.store import open_db

        open_db(db).close()
        with sqlite3.connect(db) as c:
            c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    expected = {
        "corrupt": "not a readable SQLite",
        "foreign": "not a prepkit tactics DB",
        "newer": "newer",
        "missing": "no such tactics DB",
    }[kind]
    for args in (("tactics", "show", "--db", str(db)), ("tactics", "export", "--db", str(db))):
        r = invoke(*args)
        assert r.exit_code == 3, r.output
        assert expected in r.output
    if kind != "missing":
        r = invoke("tactics", "merge", str(tmp_path / "d.db"), str(db))
        assert r.exit_code == 3 and expected in r.output


def test_tune_refuses_bad_db_before_measuring(fake_gpu, tmp_path: Path) -> None:
    db = tmp_path / "bad.db"
    db.write_bytes(b"garbage" * 500)
    r = invoke("tune", "--db", str(db), "--tokens", "1")
    assert r.exit_code == 3 and "not a readable SQLite" in r.output
    assert all(b.calls == [] for b in fake_gpu)


def test_environment_round_trips_through_the_worker_payload() -> None:
    assert Environment(**asdict(H100_ENV)) == H100_ENV


def test_reading_a_shipped_db_never_changes_it(filled: Path, tmp_path: Path) -> None:
    from prepkit.tactics.store import open_db

    shipped = tmp_path / "shipped.db"
    with open_db(filled) as tdb:
        tdb.vacuum_into(shipped)
    before = shipped.read_bytes()
    for args in (("show",), ("show", "--json"), ("export",), ("plot", "--out", str(tmp_path / "x.png"))):
        r = invoke("tactics", *args, "--db", str(shipped))
        assert r.exit_code == 0, r.output
    assert shipped.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("shipped")) == ["shipped.db"]


# ------------------------------------------------------------------------------ CLI start-up


def test_top_level_help_lists_every_command_with_its_own_summary() -> None:
    """The summaries ``prepkit --help`` prints without importing the commands are the commands' own."""
    import click

    from prepkit.cli._app import COMMANDS

    ctx = click.Context(cli)
    for name, (_module, summary) in COMMANDS.items():
        cmd = cli.get_command(ctx, name)
        assert cmd is not None, name
        assert cmd.get_short_help_str(limit=300) == summary, name
    out = invoke("--help").output
    assert all(name in out for name in COMMANDS)


def test_top_level_help_and_completion_import_no_torch() -> None:
    """``prepkit --help`` and tab completion load no command module, so neither torch nor triton."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from prepkit.cli import main\n"
        "sys.argv = ['prepkit', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = {'torch', 'triton', 'huggingface_hub', 'sqlite_utils'} & set(sys.modules)\n"
        "print('HEAVY', sorted(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
    env = {**os.environ, "_PREPKIT_COMPLETE": "bash_complete", "COMP_WORDS": "prepkit t", "COMP_CWORD": "1"}
    code = (
        "import sys\n"
        "from prepkit.cli import cli\n"
        "try:\n"
        "    cli.main(prog_name='prepkit')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('HEAVY', sorted({'torch', 'triton'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert "plain,tactics" in out.stdout and "plain,tune" in out.stdout, out.stdout
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_show_prints_whole_ranges_on_stdout_in_80_columns() -> None:
    """Off a terminal, 80 columns wide: the table is on stdout within 80 columns, and every token
    range, time and speedup is printed whole (only the tactic column wraps)."""
    import os
    import subprocess
    import sys

    from prepkit.tactics import store
    from prepkit.tactics.lookup import bundled_db_path

    path = bundled_db_path()
    assert path is not None
    with store.open_db_readonly(path) as tdb:
        winners = tdb.winners()
    env = {**os.environ, "COLUMNS": "80", "PREPKIT_TACTICS_DB": "/nonexistent/tactics.db"}
    out = subprocess.run(
        [sys.executable, "-m", "prepkit", "tactics", "show", "--db", str(path)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    lines = out.stdout.splitlines()
    # The table fits the 80 columns; a line of text stays one line off a terminal, as scripts read it.
    table = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 80
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    ranges = [c for c in cells if c and c[0]]
    assert len(ranges) == len(winners)
    for row, w in zip(ranges, winners, strict=True):
        assert row[0] == f"{w['m_lo']}-{'up' if w['extends_up'] else w['m_hi']}"
        assert row[2] == (f"{w['median_us']:.1f}" if w["median_us"] else "-")
        sp = w["speedup_vs_default"]
        assert row[3] == (f"{sp:.2f}x" if sp else "-")


def test_an_export_merges_like_the_db_it_came_from(filled: Path, tmp_path: Path) -> None:
    """What a user sends back (`tactics export > my-gpu.json`) merges into another DB."""
    r = invoke("tactics", "export", "--db", str(filled))
    assert r.exit_code == 0
    export = tmp_path / "my-gpu.json"
    export.write_text(r.stdout)
    from_db = invoke("tactics", "merge", str(filled), "--db", str(tmp_path / "a.db"), "--json")
    from_json = invoke("tactics", "merge", str(export), "--db", str(tmp_path / "b.db"), "--json")
    assert from_json.exit_code == 0, from_json.output
    assert json.loads(from_json.output)["added"] == json.loads(from_db.output)["added"]
    a = invoke("tactics", "export", "--db", str(tmp_path / "a.db")).stdout
    b = invoke("tactics", "export", "--db", str(tmp_path / "b.db")).stdout
    assert json.loads(a)["tables"] == json.loads(b)["tables"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"format": "something-else", "tables": {}}', "not a prepkit tactics export"),
        ('{"format": "prepkit-tactics", "schema_version": 999, "tables": {}}', "upgrade prepkit"),
        ('{"format": "prepkit-tactics", "schema_version": 1, "tables": {"winner": [3]}}', "tables.winner[0]"),
        ("{ not json", "not a readable tactics export"),
    ],
)
def test_a_bad_export_is_refused_naming_the_file(tmp_path: Path, text: str, says: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    r = invoke("tactics", "merge", str(bad), "--db", str(tmp_path / "dest.db"))
    assert r.exit_code == 3
    assert says in r.output and "bad.json" in r.output
    assert "Traceback" not in r.output
