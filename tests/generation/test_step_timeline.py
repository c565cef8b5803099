"""``benchmarks.step_timeline``: a decode step's kernels split into the block each layer repeats
(median share per kernel over the layers) and the kernels outside the layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import step_timeline as st


def _report(layers: int, shares: list[list[float]]) -> dict:
    block = ["qkv", "attend", "qkv", "moe"]  # a name may repeat inside the block
    timeline = [{"kernel": "embed", "us": 3.0}]
    for layer in range(layers):
        timeline += [{"kernel": n, "us": shares[layer][j]} for j, n in enumerate(block)]
    timeline += [{"kernel": "head", "us": 400.0}, {"kernel": "argmax", "us": 5.0}]
    return {"model": {"layers": layers}, "step_launches": {"kernels": len(timeline), "timeline": timeline}}


def test_the_layer_block_and_the_fixed_kernels_are_found() -> None:
    shares = [[10.0, 4.0, 9.0, 30.0], [12.0, 5.0, 9.5, 31.0], [11.0, 4.5, 8.0, 50.0]]
    found = st.breakdown(_report(3, shares))
    assert found["per_layer"] == [("qkv", 11.0), ("attend", 4.5), ("qkv", 9.0), ("moe", 31.0)]
    assert found["fixed"] == [("embed", 3.0), ("head", 400.0), ("argmax", 5.0)]
    text = st.table(found, "r.json")
    assert "| 4 | moe | 31.0 |" in text and "| | a layer | 55.5 |" in text and "| outside the layers | 408.0 |" in text


def test_names_that_repeat_no_block_per_layer_are_refused() -> None:
    report = _report(2, [[1.0] * 4, [1.0] * 4])
    report["step_launches"]["timeline"][5]["kernel"] = "other"  # layer 2's first kernel differs
    with pytest.raises(ValueError, match="no block of kernels repeats"):
        st.breakdown(report)
    with pytest.raises(ValueError, match="no step timeline"):
        st.breakdown({"model": {"layers": 2}, "step_launches": {"kernels": 3}})


def test_the_command_prints_tables_and_fails_on_a_bad_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_report(2, [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 6.0]])))
    bad.write_text(json.dumps({"model": {"layers": 2}, "step_launches": None}))
    assert st.main([str(good)]) == 0
    assert "| 4 | moe | 5.0 |" in capsys.readouterr().out
    assert st.main([str(good), str(bad)]) == 1
    assert "bad.json: the report has no step timeline" in capsys.readouterr().err
