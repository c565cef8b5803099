"""Merges that cannot be lied to: a source's dates, tactic hashes and timings are checked, and a
run the target already holds is dated by the target, so a sent-back file cannot take over a DB's
winners by claiming to be newer."""

from __future__ import annotations

import copy
import datetime as dt
import json
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prepkit.tactics import validate
from prepkit.tactics.lookup import bundled_db_path
from tests.tactics.test_hostile import export_of, invoke, side_files

BUNDLED = bundled_db_path()
pytestmark = pytest.mark.skipif(BUNDLED is None, reason="no bundled tactics.db in this checkout")


def _winners(db: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return c.execute(
            "SELECT env_hash, problem_hash, m_lo, m_hi, tactic_hash FROM winner ORDER BY 1, 2, 3"
        ).fetchall()


@pytest.fixture(scope="module")
def real_export() -> dict[str, Any]:
    """The export of the DB prepkit ships: 13 runs, 82 tactics, 214 winner ranges."""
    assert BUNDLED is not None
    return export_of(BUNDLED)


@pytest.fixture
def team(tmp_path: Path) -> Path:
    """A DB holding every row of the bundled one (so every run of its export)."""
    assert BUNDLED is not None
    db = tmp_path / "team.db"
    shutil.copyfile(BUNDLED, db)
    return db


def _send(tmp_path: Path, data: dict[str, Any]) -> Path:
    sent = tmp_path / "sent-back.json"
    sent.write_text(json.dumps(data))
    return sent


def _one_tactic_everywhere(data: dict[str, Any]) -> None:
    first = data["tables"]["tactic"][0]["tactic_hash"]
    for w in data["tables"]["winner"]:
        w["tactic_hash"] = first


def test_dates_that_are_no_timestamps_are_refused_naming_the_row(
    real_export: dict[str, Any], team: Path, tmp_path: Path
) -> None:
    """The attack of the report: every run date "zzzz", every winner one tactic."""
    data = copy.deepcopy(real_export)
    for run in data["tables"]["tuning_run"]:
        run["started_at"] = run["finished_at"] = "zzzz"
    _one_tactic_everywhere(data)
    before = team.read_bytes()
    r = invoke("tactics", "merge", str(_send(tmp_path, data)), "--db", str(team))
    assert r.exit_code == 3, r.output
    assert "tuning_run row" in r.output and "is not an ISO 8601 timestamp" in r.output, r.output
    assert team.read_bytes() == before and side_files(team) == []


def test_a_date_in_the_future_is_refused(real_export: dict[str, Any], team: Path, tmp_path: Path) -> None:
    data = copy.deepcopy(real_export)
    data["tables"]["tuning_run"][3]["finished_at"] = "9999-12-31T23:59:59+00:00"
    before = team.read_bytes()
    r = invoke("tactics", "merge", str(_send(tmp_path, data)), "--db", str(team))
    assert r.exit_code == 3 and "lies in the future" in r.output, r.output
    assert team.read_bytes() == before


def test_runs_the_target_holds_are_dated_by_the_target(real_export: dict[str, Any], team: Path, tmp_path: Path) -> None:
    """Re-dated copies of the target's own runs (valid, recent dates) win nothing: the summary
    says no winner was replaced, and the 214 ranges keep their 59 tactics."""
    data = copy.deepcopy(real_export)
    recent = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)).isoformat()
    for run in data["tables"]["tuning_run"]:
        run["started_at"] = run["finished_at"] = recent
    _one_tactic_everywhere(data)
    before = _winners(team)
    r = invoke("tactics", "merge", str(_send(tmp_path, data)), "--db", str(team), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["replaced"] == {"winner": 0} and out["added"]["winner"] == 0
    assert _winners(team) == before
    assert len({w[4] for w in before}) > 1


def test_a_tactic_whose_hash_names_other_params_is_refused(
    real_export: dict[str, Any], team: Path, tmp_path: Path
) -> None:
    data = copy.deepcopy(real_export)
    tactic = data["tables"]["tactic"][0]
    other = data["tables"]["tactic"][1]["params_json"]  # a valid tactic, another hash
    tactic["params_json"] = other
    before = team.read_bytes()
    r = invoke("tactics", "merge", str(_send(tmp_path, data)), "--db", str(team))
    assert r.exit_code == 3, r.output
    assert f"tactic row {tactic['tactic_hash']!r}" in r.output and "does not match its params_json" in r.output
    assert team.read_bytes() == before


@pytest.mark.parametrize(
    ("table", "column", "value"), [("measurement", "median_us", -3.5), ("winner", "median_us", -1.0)]
)
def test_a_negative_timing_is_refused(
    real_export: dict[str, Any], team: Path, tmp_path: Path, table: str, column: str, value: float
) -> None:
    data = copy.deepcopy(real_export)
    data["tables"][table][2][column] = value
    before = team.read_bytes()
    r = invoke("tactics", "merge", str(_send(tmp_path, data)), "--db", str(team))
    assert r.exit_code == 3 and f"{table} row" in r.output and f"{column} {value}" in r.output, r.output
    assert team.read_bytes() == before


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_an_infinite_timing_in_a_db_is_refused(team: Path, tmp_path: Path, value: float) -> None:
    """JSON has no infinity; a DB file does."""
    assert BUNDLED is not None
    src = tmp_path / "src.db"
    shutil.copyfile(BUNDLED, src)
    with sqlite3.connect(src) as c:
        done = c.execute(
            "UPDATE measurement SET median_us = ? WHERE rowid = (SELECT MIN(rowid) FROM measurement)", (value,)
        )
        assert done.rowcount == 1
    dest = tmp_path / "dest.db"
    r = invoke("tactics", "merge", str(src), "--db", str(dest))
    assert r.exit_code == 3 and "is no possible timing" in r.output, r.output
    assert not dest.exists()


def test_the_summary_counts_replaced_winners(real_export: dict[str, Any], tmp_path: Path) -> None:
    """A genuinely newer run's ranges replace the DB's, and the summary says how many."""
    data = copy.deepcopy(real_export)
    target = tmp_path / "old.db"
    # The target: the same rows, its runs dated a year earlier.
    old = copy.deepcopy(data)
    for run in old["tables"]["tuning_run"]:
        for key in ("started_at", "finished_at"):
            when = dt.datetime.fromisoformat(run[key])
            run[key] = when.replace(year=when.year - 1).isoformat()
    old_sent = tmp_path / "old.json"
    old_sent.write_text(json.dumps(old))
    assert invoke("tactics", "merge", str(old_sent), "--db", str(target)).exit_code == 0
    # The source: the real rows under new run ids (new runs, dated as they were).
    for run in data["tables"]["tuning_run"]:
        run["run_id"] = "n" + run["run_id"][1:]
    for table in ("winner", "measurement", "correctness"):
        for row in data["tables"][table]:
            row["run_id"] = "n" + row["run_id"][1:]
    r = invoke("tactics", "merge", str(_send(tmp_path, data)), "--db", str(target), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["replaced"] == {"winner": len(data["tables"]["winner"])} and out["added"]["winner"] == 0
    r = invoke("tactics", "merge", str(_send(tmp_path, data)), "--db", str(target))
    assert "0 winner ranges replaced" in r.stderr, r.output


def test_timestamps() -> None:
    now = dt.datetime(2026, 11, 27, tzinfo=dt.timezone.utc)
    for good in ("2026-11-22T11:33:17.500222+00:00", "2026-11-22 11:33:17", "2026-11-22T11:33Z"):
        assert validate.timestamp_problem(good, now) is None, good
    for bad in ("zzzz", "", "2026-13-01T00:00:00", "2026-11-22", "20261122T113317", "2026-11-22T11:33:17+00:00x"):
        assert "not an ISO 8601 timestamp" in (validate.timestamp_problem(bad, now) or ""), bad
    assert "future" in (validate.timestamp_problem("2026-11-29T00:00:00+00:00", now) or "")


# ------------------------------------------------------------------------------- hypothesis

_dates = st.one_of(
    st.sampled_from(["zzzz", "", "9999-12-31T00:00:00+00:00", "2026-02-30T00:00:00", "yesterday"]),
    st.datetimes(min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2026, 11, 1)).map(lambda d: d.isoformat()),
    st.text(max_size=30),
)
_timings = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False), st.floats(max_value=-1e-9), st.integers(-5, 10_000)
)


@st.composite
def lies(draw: st.DrawFn, export: dict[str, Any]) -> dict[str, Any]:
    """``export`` with 1-4 of its dates, tactic hashes, tactic params, winner tactics or timings changed."""
    data = copy.deepcopy(export)
    tables = data["tables"]
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["date", "hash", "params", "winner-tactic", "timing", "all-dates"]))
        if what in ("date", "all-dates"):
            runs = tables["tuning_run"] if what == "all-dates" else [draw(st.sampled_from(tables["tuning_run"]))]
            value = draw(_dates)
            for run in runs:
                run[draw(st.sampled_from(["started_at", "finished_at"]))] = value
        elif what == "hash":
            draw(st.sampled_from(tables["tactic"]))["tactic_hash"] = draw(st.sampled_from(["0" * 32, "abc"]))
        elif what == "params":
            row, other = draw(st.sampled_from(tables["tactic"])), draw(st.sampled_from(tables["tactic"]))
            row["params_json"] = other["params_json"]
        elif what == "winner-tactic":
            hashes = [t["tactic_hash"] for t in tables["tactic"]]
            for w in draw(st.lists(st.sampled_from(tables["winner"]), min_size=1, max_size=50)):
                w["tactic_hash"] = draw(st.sampled_from(hashes))
        else:
            table = draw(st.sampled_from(["measurement", "winner"]))
            col = draw(
                st.sampled_from(["median_us", "default_median_us"] if table == "winner" else ["median_us", "p10_us"])
            )
            draw(st.sampled_from(tables[table]))[col] = draw(_timings)
    return data


_CASE: dict[str, Any] = {}


def _case() -> dict[str, Any]:
    if not _CASE:
        assert BUNDLED is not None
        _CASE["export"] = export_of(BUNDLED)
    return _CASE["export"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_lying_export_merges_cleanly_or_is_refused_whole(data: st.DataObject) -> None:
    """Each mutation of a real export's dates, hashes and timings is refused with the target
    unchanged, or merges without changing a winner range of a run the target holds and leaves
    a DB that passes every check."""
    assert BUNDLED is not None
    sent_data = data.draw(lies(_case()))
    with tempfile.TemporaryDirectory() as tmp:
        sent, dest = Path(tmp) / "sent.json", Path(tmp) / "team.db"
        sent.write_text(json.dumps(sent_data))
        shutil.copyfile(BUNDLED, dest)
        before_bytes, before = dest.read_bytes(), _winners(dest)
        r = invoke("tactics", "merge", str(sent), "--db", str(dest), "--json")
        assert r.exit_code in (0, 3), (r.output, r.exception)
        event("merged" if r.exit_code == 0 else "refused")
        if r.exit_code == 3:
            assert dest.read_bytes() == before_bytes and "sent.json" in r.output
            return
        assert json.loads(r.stdout)["replaced"] == {"winner": 0}
        assert _winners(dest) == before  # every run of the export is the target's: none is newer
        with sqlite3.connect(dest) as c:
            assert list(validate.db_problems(c)) == []
