"""A write killed right after its commit leaves a DB that a read-only folder reads whole, and a log
SQLite has not applied is named, with how to apply it, instead of being read stale or "malformed"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from prepkit.errors import TacticsError
from prepkit.tactics import schema
from prepkit.tactics.lookup import TacticsDBWarning, TacticTable
from tests.tactics.test_db import G1, H100, fill
from tests.tactics.test_hostile import ROLLBACK, _make_read_only, invoke, journal_files

ROOT = Path(__file__).resolve().parents[2]

# A tune's writes: an environment, a run and its winner ranges, each committed; then SIGKILL.
TUNE = """
from prepkit.tactics.store import WinnerRow, env_record, open_db
from tests.tactics.test_db import G1, H100, tac
tdb = open_db(DB)
env = tdb.put_env(env_record(H100, package_version="0"))
run = tdb.start_run(env, timing_method={}, search_space={}, token_points=[1, 2])
tdb.put_problem(G1)
tdb.replace_winners(env, G1.problem_hash(), run, [WinnerRow(1, 2, tac(16), True), WinnerRow(3, 9, tac(32), True)])
tdb.finish_run(run, "complete")
die()
"""

# A merge whose transaction committed; killed before the DB is closed.
MERGE = """
from prepkit.tactics import store
real = store.TacticsDB.merge_checked
def merge_then_die(self, copy):
    real(self, copy)
    die()
store.TacticsDB.merge_checked = merge_then_die
store.merge_into(DB, SRC)
"""


def _run_and_kill(script: str, db: Path, src: Path | None = None) -> None:
    code = "import os, signal\n" + "def die():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    code += f"DB, SRC = {str(db)!r}, {str(src)!r}\n" + textwrap.dedent(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def _winner_count(db: Path) -> int:
    r = invoke("tactics", "show", "--json", "--db", str(db))
    assert r.exit_code == 0, r.output
    return int(json.loads(r.stdout)["counts"]["winner"])


@pytest.mark.parametrize("writer", ["tune", "merge"])
def test_a_writer_killed_after_its_commit_leaves_a_whole_rollback_journal_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    folder = tmp_path / "image"
    folder.mkdir()
    db = folder / "tactics.db"
    if writer == "tune":
        _run_and_kill(TUNE, db)
        expected = 2
    else:
        src = tmp_path / "src.db"
        fill(src)
        _run_and_kill(MERGE, db, src)
        expected = 3
    assert db.read_bytes()[18:20] == ROLLBACK and journal_files(db) == []
    _make_read_only(folder, monkeypatch)
    try:
        assert _winner_count(db) == expected
        with warnings.catch_warnings():
            warnings.simplefilter("error", TacticsDBWarning)
            assert TacticTable.load(G1, H100, user_db=db, bundled_db=False).source == "user"
    finally:
        folder.chmod(0o755)


def _hot_wal(db: Path) -> int:
    """A DB in WAL mode whose last commit sits only in its -wal (a WAL writer killed after its
    commit); returns the winner rows the main file alone holds."""
    fill(db)
    with sqlite3.connect(db) as c:
        stale = c.execute("SELECT COUNT(*) FROM winner").fetchone()[0]
    script = """
    import sqlite3
    c = sqlite3.connect(DB, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA wal_autocheckpoint=0")
    c.execute("DELETE FROM winner")
    die()
    """
    _run_and_kill(script, db)
    assert db.with_name(db.name + "-wal").stat().st_size > 0
    return int(stale)


def test_a_hot_wal_in_a_read_only_folder_is_named_with_how_to_apply_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "image"
    folder.mkdir()
    db = folder / "tactics.db"
    assert _hot_wal(db) == 3
    _make_read_only(folder, monkeypatch)
    try:
        for args in (("show",), ("show", "--json"), ("export",)):
            r = invoke("tactics", *args, "--db", str(db))
            assert r.exit_code == 3, r.output
            assert "tactics.db-wal" in r.output and "wal_checkpoint(TRUNCATE)" in r.output, r.output
            assert "malformed" not in r.output and '"winner"' not in r.stdout
        r = invoke("tactics", "merge", str(db), "--db", str(tmp_path / "team.db"))
        assert r.exit_code == 3 and "tactics.db-wal" in r.output and not (tmp_path / "team.db").exists()
        with pytest.warns(TacticsDBWarning, match="tactics.db-wal"):
            table = TacticTable.load(G1, H100, user_db=db, bundled_db=False)
        assert table.ranges == ()  # not the stale rows of the main file
    finally:
        folder.chmod(0o755)
    # What the hint says, in a writable copy: the log is applied and the rows are current.
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    with sqlite3.connect(copy / "tactics.db") as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        c.execute("PRAGMA journal_mode=DELETE")
    assert _winner_count(copy / "tactics.db") == 0


def test_a_hot_journal_in_a_read_only_folder_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "image"
    folder.mkdir()
    db = folder / "tactics.db"
    fill(db)
    db.with_name(db.name + "-journal").write_bytes(b"\xd9\xd5\x05\xf9\x20\xa1\x63\xd7" + b"\0" * 504)
    _make_read_only(folder, monkeypatch)
    try:
        with pytest.raises(TacticsError, match="tactics.db-journal .* interrupted write"):
            schema.open_readonly(db)
    finally:
        folder.chmod(0o755)


def test_an_empty_log_is_no_pending_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "image"
    folder.mkdir()
    db = folder / "tactics.db"
    fill(db)
    db.with_name(db.name + "-wal").write_bytes(b"")
    _make_read_only(folder, monkeypatch)
    try:
        assert _winner_count(db) == 3
    finally:
        folder.chmod(0o755)
