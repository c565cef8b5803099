"""``benchmarks/bench_splits.py``: one checkpoint benched on one rank and split, each split with
each sum asked for; on the CPU (tiny dims, gloo, the interpreter) as a smoke test of the script."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import bench_splits
from tests.distributed.conftest import cpu_twin


def test_splits_are_tp_or_ep_with_a_count() -> None:
    assert bench_splits.parse_split("tp4") == (4, 1)
    assert bench_splits.parse_split("ep2") == (1, 2)
    for bad in ("tp", "dp2", "ep0", "tp2ep2"):
        with pytest.raises(argparse.ArgumentTypeError, match="a split is tpN or epN"):
            bench_splits.parse_split(bad)
    assert [bench_splits.split_label(*s) for s in ((1, 1), (2, 1), (1, 4))] == ["TP 1", "TP 2", "EP 4"]


@cpu_twin
def test_one_rank_and_a_split_end_in_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on a CI machine of two cores
    out = tmp_path / "splits.json"
    argv = ["--workdir", str(tmp_path / "w"), "--tiny", "--device", "cpu", "--splits", "ep2", "--tg", "2", "-r", "1"]
    assert bench_splits.main([*argv, "--layers", "2,1", "--out", str(out)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| split | sum (used) |") and len(table) == 3
    assert table[1].startswith("| TP 1 | - |") and table[2].startswith("| EP 2 | default (gloo) |")
    reports = json.loads(out.read_text())
    assert set(reports) == {"tp1", "ep2-default"}
    assert reports["ep2-default"]["ranks"] == {"tp": 1, "ep": 2, "all_reduce": "gloo"}
    assert reports["tp1"]["fit"]["layers"] == [2, 1]
