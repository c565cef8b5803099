"""``prepkit bench`` end to end on a tiny prepared folder (the Triton interpreter on the CPU):
llama-bench's rows, the JSON report a user sends in, and errors before loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.generation.bench import spread
from prepkit.generation.floor import expected_experts
from prepkit.recipes import recipe_depth

from .conftest import DEVICE


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["bench", *args, "--device", DEVICE])
    return result.exit_code, result.stdout, result.stderr


def test_the_json_report_holds_every_figure(tiny_prepared: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code, stdout, err = run(
        str(tiny_prepared), "--pp", "8", "--tg", "3", "--batch", "1,2", "-r", "2", "--json", "--out", str(out)
    )
    assert code == 0, err
    report = json.loads(stdout)
    assert json.loads(out.read_text()) == report
    tests = [(t["test"], t["batch"]) for t in report["tests"]]
    assert tests == [("pp8", 1), ("tg3", 1), ("tg3 sampled", 1), ("tg3", 2), ("tg3 sampled", 2)]
    for t in report["tests"]:
        s = t["tok_s"]
        assert 0 < s["min"] <= s["median"] <= s["max"]
    assert report["model"]["layers"] == 2 and report["repetitions"] == 2
    assert set(report["bytes_per_token"]) == {"experts", "attention", "router", "norms", "head"}
    assert all(v > 0 for v in report["bytes_per_token"].values())
    assert {"versions", "tactics", "tactics_dbs", "load_s", "warmup_s", "peak_memory_gib"} <= set(report)
    assert report["versions"]["torch"]


def test_the_table_reads_as_llama_bench(tiny_prepared: Path) -> None:
    code, stdout, err = run(str(tiny_prepared), "--pp", "4", "--tg", "2", "-r", "1", "--no-sampled")
    assert code == 0, err
    rows = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| model |") and len(rows) == 3
    assert "| pp4 |" in rows[1] and "| tg2 |" in rows[2]
    assert "warm-up" in err


def test_bad_lists_and_folders_are_refused(tiny_source: Path) -> None:
    code, _, err = run(str(tiny_source), "--tg", "x")
    assert code == 2 and "comma-separated" in err
    code, _, err = run(str(tiny_source))
    assert code == 3 and "not a prepared folder" in err


def test_spread_and_expected_experts() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "stdev": 1.0, "min": 1.0, "max": 3.0}
    assert expected_experts(128, 4, 1) == 4
    assert 4 < expected_experts(128, 4, 16) < 64 and expected_experts(128, 4, 10**4) > 127.9


def test_two_layer_counts_are_measured_and_fitted(tiny_prepared: Path) -> None:
    code, stdout, err = run(
        str(tiny_prepared), "--pp", "", "--tg", "3", "--no-sampled", "-r", "1", "--layers", "1,2", "--scale-to", "10",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(stdout)
    assert report["model"]["layers"] == 2 and report["fewer_layers"]["model"]["layers"] == 1
    fit = report["fit"]
    assert fit["layers"] == [2, 1] and fit["scaled_layers"] == 10 and fit["test"] == "tg3"
    two, one = (1e3 / r["tests"][0]["tok_s"]["median"] for r in (report, report["fewer_layers"]))
    assert fit["per_layer_us"] == pytest.approx((two - one) * 1e3)
    assert fit["scaled_ms"] == pytest.approx(fit["fixed_ms"] + 10 * (two - one))
    code, stdout, err = run(str(tiny_prepared), "--pp", "", "--tg", "2", "--no-sampled", "-r", "1", "--layers", "2,1")
    assert code == 0, err
    assert "fit over 2 and 1 layers (tg2, batch 1)" in stdout
    depth = recipe_depth(report["model"]["recipe"]) or 2
    assert f"at {depth} layers" in stdout  # the recipe's depth without --scale-to


def test_layer_counts_that_cannot_be_fitted_are_refused_before_loading(tiny_prepared: Path) -> None:
    for layers, message in [
        ("2,2", "two different ones"),
        ("3,2,1", "two different ones"),
        ("9", "9 is not in 1..2"),
    ]:
        code, _, err = run(str(tiny_prepared), "--pp", "", "--tg", "2", "--layers", layers)
        assert code != 0 and message in err, (layers, err)
    code, _, err = run(str(tiny_prepared), "--pp", "4", "--tg", "", "--layers", "2,1")
    assert code != 0 and "needs a --tg test at batch 1" in err


@pytest.mark.parametrize("rank0", [True, False])
def test_only_rank_0_writes_the_report_file(
    tiny_prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank0: bool
) -> None:
    # Every rank of a split run holds the report: two writers of one file would interleave it.
    import sys

    import prepkit.generation.bench as bench_module

    report = {"tests": [], "rank_wrote": "yes"}
    monkeypatch.setattr(bench_module, "run_bench", lambda request, on_progress: report)
    monkeypatch.setattr(sys.modules["prepkit.cli.bench"], "other_rank", lambda: not rank0)
    out = tmp_path / "bench.json"
    code, stdout, err = run(str(tiny_prepared), "--json", "--out", str(out))
    assert code == 0, err
    if rank0:
        assert out.read_text() == stdout and json.loads(stdout) == report
    else:
        assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == (["bench.json"] if rank0 else [])  # no temp file left
