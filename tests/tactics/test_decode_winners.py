"""The decode_winner table: its schema step migrates older DBs, merges keep the later timing, and
the decode lookup reads DBs of every schema read-only."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from prepkit.kernels.decode.variants import DecodeProblem, DecodeVariant
from prepkit.tactics import schema, store
from prepkit.tactics.decode_lookup import decode_variant
from prepkit.tactics.schema import SCHEMA_VERSION
from prepkit.tactics.store import DecodeWinnerRow, env_record, open_db
from tests.tactics.test_db import H100, STEP_NAMES, fill

PROBLEM = DecodeProblem("stub_decode", rows=8, cols=16, batch=1)
DEFAULT = DecodeVariant(block_n=32, block_k=32, num_warps=4)


class Stub:
    """Just enough of a decode kernel for the lookup: a name, a version and a default."""

    name = "stub_decode"
    version = "7"

    def default(self, problem: DecodeProblem) -> DecodeVariant:
        return DEFAULT


def put(path: Path, variant: DecodeVariant) -> None:
    with open_db(path) as tdb:
        env_hash = tdb.put_env(env_record(H100, package_version="0.1.0"))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=())
        row = DecodeWinnerRow("stub_decode", PROBLEM.key(), variant.name(), "7", 3.5, DEFAULT.name(), 4.0, 3)
        tdb.put_decode_winner(env_hash, run, row)


def to_schema_3(path: Path) -> None:
    """Back to the file a prepkit before the decode table wrote."""
    with sqlite3.connect(path) as c:
        c.execute("DROP TABLE decode_winner")
        c.execute("DELETE FROM _sqlite_migrations WHERE name = 'create_decode_winner'")
        c.execute("PRAGMA user_version = 3")
    c.close()


def test_an_older_db_migrates_forward_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    fill(path)
    to_schema_3(path)
    with store.open_db_readonly(path) as tdb:  # read through a migrated copy: the file stays as it was
        assert tdb.decode_winners() == [] and len(tdb.winners()) == 3
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 3
    c.close()
    assert decode_variant(Stub(), PROBLEM, path, device=H100) == DEFAULT  # no table: the default

    with open_db(path) as tdb:
        assert tdb.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        names = [r[0] for r in tdb.conn.execute("SELECT name FROM _sqlite_migrations ORDER BY id")]
        assert names == STEP_NAMES and names[-1] == "create_decode_winner"
        assert {c.name for c in tdb.db["decode_winner"].columns} == set(schema.columns("decode_winner"))
        assert len(tdb.winners()) == 3
    tuned = DecodeVariant(block_n=64, block_k=128, num_warps=8, split_k=2)
    put(path, tuned)
    assert decode_variant(Stub(), PROBLEM, path, device=H100) == tuned


def test_a_merge_keeps_the_later_decode_timing(tmp_path: Path) -> None:
    old, new = DecodeVariant(16, 64, 2), DecodeVariant(128, 64, 8)
    dest, src = tmp_path / "dest.db", tmp_path / "src.db"
    put(dest, old)
    put(src, new)  # timed later
    summary = store.merge_into(dest, src)
    assert summary.added["decode_winner"] == 0  # the same (GPU, kernel, problem): replaced, not added
    assert decode_variant(Stub(), PROBLEM, dest, device=H100) == new
    store.merge_into(src, dest)  # the other way the later one stays
    assert decode_variant(Stub(), PROBLEM, src, device=H100) == new
    with open_db(dest) as tdb:
        export = tdb.export()
    assert [r["variant"] for r in export["tables"]["decode_winner"]] == [new.name()]


def test_an_export_with_decode_winners_merges_like_a_db(tmp_path: Path) -> None:
    import json

    src = tmp_path / "src.db"
    put(src, DecodeVariant(64, 64, 4))
    with open_db(src) as tdb:
        (tmp_path / "export.json").write_text(json.dumps(tdb.export()))
    store.merge_into(tmp_path / "dest.db", tmp_path / "export.json")
    assert decode_variant(Stub(), PROBLEM, tmp_path / "dest.db", device=H100) == DecodeVariant(64, 64, 4)
