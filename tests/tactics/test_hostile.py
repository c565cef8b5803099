"""Tactics DBs that users send back or other tools damaged, and DBs read from read-only places."""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import sqlite3
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prepkit.cli import cli
from prepkit.tactics import schema
from prepkit.tactics.lookup import TacticsDBWarning, TacticTable
from prepkit.tactics.store import WinnerRow, open_db
from tests.tactics.test_db import G1, H100, fill, tac

ROLLBACK = b"\x01\x01"  # bytes 18-19 of a SQLite header: file format versions, 1 = rollback journal


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def side_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name and p.name.startswith(path.name))


def journal_files(db: Path) -> list[str]:
    """The files SQLite keeps beside a DB while it is open or after a crash."""
    return [p.name for p in (db.with_name(db.name + s) for s in ("-wal", "-shm", "-journal")) if p.exists()]


def export_of(db: Path) -> dict[str, Any]:
    r = invoke("tactics", "export", "--db", str(db))
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    db = tmp_path / "src.db"
    fill(db)
    return db


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A DB that already holds rows of another GPU (a merge must leave it byte for byte)."""
    from dataclasses import replace

    db = tmp_path / "team.db"
    fill(db, env=replace(H100, name="NVIDIA H200"), winners=[WinnerRow(1, 64, tac(64), True, 5.0, 6.0, 1.2)])
    return db


# ------------------------------------------------------------------------------ merge refuses


def _mutate(export: dict[str, Any], how: str) -> Any:
    data = copy.deepcopy(export)
    tables = data["tables"]
    if how == "unknown-key-only":
        tables["winner"][0] = {"foo": 1}
    elif how == "unknown-column":
        tables["winner"][0]["speedup"] = 2.0
    elif how == "unknown-table":
        tables["winners_v2"] = []
    elif how == "dangling-reference":
        tables["winner"][1]["tactic_hash"] = "0" * 32
    elif how == "garbage-tactic":
        tables["tactic"][0]["params_json"] = "{block_m: 16"
    elif how == "not-a-tactic":
        tables["tactic"][0]["params_json"] = {"block_m": "big"}
    elif how == "wrong-type":
        tables["winner"][0]["m_lo"] = "one"
    elif how == "too-big":
        tables["winner"][0]["m_hi"] = 2**64
    elif how == "missing-required":
        del tables["winner"][0]["run_id"]
    elif how == "array":
        return [data]
    return data


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("unknown-key-only", "unknown columns ['foo']"),
        ("unknown-column", "unknown columns ['speedup']"),
        ("unknown-table", "unknown table 'winners_v2'"),
        ("dangling-reference", "names no tactic row"),
        ("garbage-tactic", "params_json is not JSON"),
        ("not-a-tactic", "params_json is not a valid tactic"),
        ("wrong-type", "m_lo is str"),
        ("too-big", "m_hi is int"),
        ("missing-required", "['run_id'] are missing"),
        ("array", "a JSON array but not a prepkit tactics export"),
    ],
)
def test_foreign_and_hand_edited_exports_are_refused_whole(
    source: Path, target: Path, tmp_path: Path, how: str, says: str
) -> None:
    bad = tmp_path / "sent-back.json"
    bad.write_text(json.dumps(_mutate(export_of(source), how)))
    before = target.read_bytes()
    r = invoke("tactics", "merge", str(bad), "--db", str(target))
    assert r.exit_code == 3, r.output
    assert says in r.output and "sent-back.json" in r.output, r.output
    assert "not a readable SQLite" not in r.output and "Traceback" not in r.output
    assert target.read_bytes() == before and side_files(target) == []
    fresh = tmp_path / "fresh" / "new.db"
    assert invoke("tactics", "merge", str(bad), "--db", str(fresh)).exit_code == 3
    assert not fresh.parent.exists()  # a refused import creates nothing


def test_a_hand_edited_db_is_refused_whole(source: Path, target: Path) -> None:
    with sqlite3.connect(source) as c:
        c.execute("UPDATE tactic SET params_json = 'garbage' WHERE rowid = 1")
    before = target.read_bytes()
    r = invoke("tactics", "merge", str(source), "--db", str(target))
    assert r.exit_code == 3 and "tactic row" in r.output and "params_json is not JSON" in r.output, r.output
    assert target.read_bytes() == before


# ------------------------------------------------------------------------ damaged DBs are read


def test_show_and_export_name_a_damaged_tactic_row(source: Path) -> None:
    with sqlite3.connect(source) as c:
        (th,) = c.execute("SELECT tactic_hash FROM tactic ORDER BY rowid LIMIT 1").fetchone()
        c.execute("UPDATE tactic SET params_json = '{oops' WHERE tactic_hash = ?", (th,))
    r = invoke("tactics", "show", "--db", str(source))
    assert r.exit_code == 0, r.output
    assert th in r.stderr and "not JSON" in r.stderr and "(damaged)" in r.stdout
    r = invoke("tactics", "show", "--db", str(source), "--json")
    assert r.exit_code == 0, r.output
    winners = json.loads(r.stdout)["winners"]
    assert sum(w["tactic"] is None for w in winners) == 1
    assert all(isinstance(w["tactic"], dict) for w in winners if w["tactic_hash"] != th)
    r = invoke("tactics", "export", "--db", str(source))
    assert r.exit_code == 0 and th in r.stderr, r.output
    rows = {t["tactic_hash"]: t["params_json"] for t in json.loads(r.stdout)["tables"]["tactic"]}
    assert rows[th] == "{oops" and all(isinstance(v, dict) for k, v in rows.items() if k != th)


def test_show_and_export_of_a_db_without_a_winner_table_say_what_is_missing(source: Path) -> None:
    with sqlite3.connect(source) as c:
        c.execute("DROP TABLE winner")
    for args in (("show",), ("show", "--json"), ("export",)):
        r = invoke("tactics", *args, "--db", str(source))
        assert r.exit_code == 3, r.output
        assert "['winner'] are missing" in r.output and "Traceback" not in r.output


# ------------------------------------------------------------------------- read-only places


def test_every_db_prepkit_writes_is_left_in_rollback_journal_mode(source: Path, target: Path, tmp_path: Path) -> None:
    from prepkit.tactics.bundle import write_bundle

    assert source.read_bytes()[18:20] == ROLLBACK  # written as a tune writes (open_db, RunRecorder rows)
    merged = tmp_path / "merged.db"
    assert invoke("tactics", "merge", str(source), "--db", str(merged)).exit_code == 0
    assert invoke("tactics", "merge", str(target), "--db", str(merged)).exit_code == 0
    write_bundle(merged, tmp_path / "bundle.db")
    for db in (merged, tmp_path / "bundle.db"):
        assert db.read_bytes()[18:20] == ROLLBACK, db
        assert journal_files(db) == []


def test_a_writer_open_beside_another_never_switches_to_wal(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    first = open_db(db)
    fill(db)  # opens, writes and closes while `first` still holds the file
    assert db.read_bytes()[18:20] == ROLLBACK and journal_files(db) == []
    first.close()
    assert db.read_bytes()[18:20] == ROLLBACK


def test_a_writer_alone_switches_a_wal_left_file_back_when_it_opens(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _wal_left(db)
    with open_db(db) as tdb:
        assert tdb.conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert db.read_bytes()[18:20] == ROLLBACK


def _wal_left(db: Path) -> None:
    """A DB as an older prepkit left it: WAL mode in the header, no -wal or -shm beside it."""
    fill(db)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    assert db.read_bytes()[18:20] == b"\x02\x02" and side_files(db) == []


@pytest.fixture
def read_only_folder(tmp_path: Path):
    """A folder no one may create files in. Root ignores the mode bits, so there the check that
    prepkit makes is answered as a read-only mount would answer it."""
    folder = tmp_path / "image"
    folder.mkdir()
    yield folder
    folder.chmod(0o755)


def _make_read_only(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real = schema.folder_writable
        monkeypatch.setattr(schema, "folder_writable", lambda p: False if Path(p) == folder.resolve() else real(p))


def test_a_wal_left_db_is_read_from_a_read_only_folder(read_only_folder: Path, monkeypatch) -> None:
    db = read_only_folder / "tactics.db"
    _wal_left(db)
    before = db.read_bytes()
    _make_read_only(read_only_folder, monkeypatch)
    opened: list[str] = []
    real_connect = sqlite3.connect
    monkeypatch.setattr(
        sqlite3, "connect", lambda database, *a, **k: opened.append(str(database)) or real_connect(database, *a, **k)
    )
    for args in (("show", "--json"), ("export",)):
        r = invoke("tactics", *args, "--db", str(db))
        assert r.exit_code == 0, r.output
    assert json.loads(invoke("tactics", "show", "--json", "--db", str(db)).stdout)["counts"]["winner"] == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", TacticsDBWarning)
        table = TacticTable.load(G1, H100, user_db=db, bundled_db=False)
    assert table.source == "user" and json.loads(table.tactic_for(3) or "{}") == json.loads(tac(16))
    assert opened and all("mode=ro" in u and "immutable=1" in u for u in opened), opened
    assert db.read_bytes() == before and side_files(db) == []


def test_merge_into_a_read_only_place_or_under_a_file_names_the_path(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = invoke("tactics", "merge", str(source), "--db", str(blocker / "t.db"))
    assert r.exit_code == 3 and str(blocker / "t.db") in r.output and "not a folder" in r.output, r.output
    assert "Traceback" not in r.output and "free disk space" not in r.output

    ro = tmp_path / "ro" / "t.db"
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self == ro.parent:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    r = invoke("tactics", "merge", str(source), "--db", str(ro))
    assert r.exit_code == 3 and str(ro) in r.output and "read-only" in r.output, r.output
    assert "Traceback" not in r.output and "free disk space" not in r.output and "not readable" not in r.output


def test_merge_into_a_full_disk_names_the_db(source: Path, target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prepkit.tactics import store

    def full(self: Any, copy: Path) -> dict[str, int]:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store.TacticsDB, "merge_checked", full)
    r = invoke("tactics", "merge", str(source), "--db", str(target))
    assert r.exit_code == 3 and f"{target}: no space left" in r.output, r.output


# ------------------------------------------------------------------------------- hypothesis


_EXPORT: dict[str, Any] = {}
_TARGET: list[bytes] = []


def _real_export_and_target() -> tuple[dict[str, Any], bytes]:
    """One real export (two problems, two runs) and the bytes of a non-empty target DB."""
    if not _EXPORT:
        from dataclasses import replace

        from tests.tactics.test_db import G2

        with tempfile.TemporaryDirectory() as tmp:
            src, dest = Path(tmp) / "s.db", Path(tmp) / "d.db"
            fill(src)
            fill(src, problem=G2, winners=[WinnerRow(1, 8192, tac(32, num_warps=8), True, 3.0, 4.0, 1.3)])
            fill(dest, env=replace(H100, name="NVIDIA H200"))
            _EXPORT.update(export_of(src))
            _TARGET.append(dest.read_bytes())
    return _EXPORT, _TARGET[0]


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**62), max_value=2**62),
    st.integers(min_value=2**63, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
)


@st.composite
def mutated_exports(draw: st.DrawFn) -> str:
    export, _ = _real_export_and_target()
    data = copy.deepcopy(export)
    tables = data["tables"]
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        op = draw(
            st.sampled_from(
                ["drop-key", "rename-key", "retype", "garbage-tactic", "dangle", "extra-table", "extra-column",
                 "drop-row", "drop-table", "top-level"]
            )
        )  # fmt: skip
        name = draw(st.sampled_from(sorted(t for t in tables if tables[t]) or ["winner"]))
        rows = tables.get(name) or [{}]
        row = rows[draw(st.integers(min_value=0, max_value=len(rows) - 1))]
        keys = sorted(row) or ["x"]
        key = draw(st.sampled_from(keys))
        if op == "drop-key":
            row.pop(key, None)
        elif op == "rename-key":
            row[draw(st.sampled_from(keys)) + draw(st.sampled_from(["_", "x", ""]))] = row.pop(key, None)
        elif op == "retype":
            row[key] = draw(_values)
        elif op == "garbage-tactic" and tables.get("tactic"):
            tables["tactic"][0]["params_json"] = draw(st.one_of(st.text(max_size=20), _values))
        elif op == "dangle":
            ref = draw(st.sampled_from(["tactic_hash", "env_hash", "problem_hash", "run_id", "kernel_hash"]))
            if ref in row:
                row[ref] = draw(st.sampled_from(["", "0" * 32, "nope"]))
        elif op == "extra-table":
            tables[draw(st.text(min_size=1, max_size=8))] = [{"a": 1}]
        elif op == "extra-column":
            row[draw(st.text(min_size=1, max_size=8))] = draw(_values)
        elif op == "drop-row" and rows is tables.get(name):
            rows.remove(row)
        elif op == "drop-table":
            tables.pop(name, None)
        elif op == "top-level":
            data[draw(st.sampled_from(["format", "schema_version", "tables", "extra"]))] = draw(_values)
    text = json.dumps(data)
    if draw(st.booleans()) and draw(st.integers(0, 9)) == 0:  # now and then a truncated file
        text = text[: draw(st.integers(min_value=0, max_value=len(text) - 1))]
    return text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_exports())
def test_a_mutated_export_merges_cleanly_or_is_refused_whole(text: str) -> None:
    _, target_bytes = _real_export_and_target()
    with tempfile.TemporaryDirectory() as tmp:
        sent, dest = Path(tmp) / "sent.json", Path(tmp) / "team.db"
        sent.write_text(text)
        dest.write_bytes(target_bytes)
        r = invoke("tactics", "merge", str(sent), "--db", str(dest))
        assert r.exit_code in (0, 3), (r.output, r.exception)
        event("merged" if r.exit_code == 0 else "refused")
        assert "Traceback" not in r.output
        if r.exit_code == 3:
            assert dest.read_bytes() == target_bytes and "sent.json" in r.output
            return
        assert dest.read_bytes()[18:20] == ROLLBACK
        for args in (("show",), ("show", "--json"), ("export",)):
            shown = invoke("tactics", *args, "--db", str(dest))
            assert shown.exit_code == 0 and not shown.stderr, shown.output
        with warnings.catch_warnings():
            warnings.simplefilter("error", TacticsDBWarning)
            for problem in (G1,):
                table = TacticTable.load(problem, H100, user_db=dest, bundled_db=False)
                for m in (1, 9, 600, 100_000):
                    table.get(m, default=lambda n: None)
        shutil.rmtree(tmp, ignore_errors=True)
