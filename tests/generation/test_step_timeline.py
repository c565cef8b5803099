"""``benchmarks.step_timeline``: a decode step's kernels split into the block each layer repeats
(median share per kernel over the layers) and the kernels outside the layers, with the head's
kernel sharing a layer kernel's name and one layer adding a kernel of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import step_timeline as cli
from prepkit.generation import step_timeline as st

BLOCK = ["proj", "attend", "proj", "moe"]  # a name may repeat inside the block


def _report(layers: int, shares: list[list[float]], extra_in: int | None = None, head: str = "proj") -> dict:
    timeline = [{"kernel": "embed", "us": 3.0}]
    for layer in range(layers):
        for j, name in enumerate(BLOCK):
            timeline.append({"kernel": name, "us": shares[layer][j]})
            if layer == extra_in and j == 0:
                timeline.append({"kernel": "fill", "us": 0.5})
    # By default the head runs the projection kernel too: read from "attend" on, it would pass for
    # a layer's.
    timeline += [{"kernel": head, "us": 400.0}, {"kernel": "argmax", "us": 5.0}]
    return {"model": {"layers": layers}, "step_launches": {"kernels": len(timeline), "timeline": timeline}}


SHARES = [[10.0, 4.0, 9.0, 30.0], [12.0, 5.0, 9.5, 31.0], [11.0, 4.5, 8.0, 50.0], [11.0, 4.5, 8.5, 31.0]]


def test_the_layer_block_and_the_kernels_outside_it_are_found() -> None:
    found = st.breakdown(_report(3, SHARES, extra_in=1), 4)
    assert found["per_layer"] == [("proj", 11.0), ("attend", 4.5), ("proj", 9.0), ("moe", 31.0)]
    assert found["fixed"] == [("embed", 3.0), ("fill", 0.5), ("proj", 400.0), ("argmax", 5.0)]
    text = st.table(found, "r.json")
    assert "| 4 | moe | 31.0 |" in text and "| | a layer | 55.5 |" in text and "| outside the layers | 408.5 |" in text


def test_two_layers_are_told_from_the_head() -> None:
    # With two layers a median is a mean: the head's kernel must not be read as a layer's.
    found = st.breakdown(_report(2, SHARES), 4)
    assert found["per_layer"][0] == ("proj", 11.0) and ("proj", 400.0) in found["fixed"]


def test_two_layers_one_with_a_fill_and_a_head_of_its_own_are_found() -> None:
    # No window of the layers' length then runs twice exactly (the fill sits inside the second
    # layer, the head shares no layer kernel's name): the block is the window most layers match.
    two = _report(2, SHARES, extra_in=1, head="dense")
    found = st.breakdown(two, 4)
    assert found["per_layer"] == [("proj", 11.0), ("attend", 4.5), ("proj", 9.25), ("moe", 30.5)]
    assert found["fixed"] == [("embed", 3.0), ("fill", 0.5), ("dense", 400.0), ("argmax", 5.0)]
    assert st.kernels_per_layer([_report(4, SHARES, extra_in=1, head="dense"), two]) == 4


def test_kernels_per_layer_is_the_slope_of_two_reports() -> None:
    assert st.kernels_per_layer([_report(4, SHARES), _report(2, SHARES)]) == 4
    with pytest.raises(ValueError, match="two layer counts"):
        st.kernels_per_layer([_report(2, SHARES)])
    broken = _report(3, SHARES)
    for i, k in enumerate(broken["step_launches"]["timeline"]):
        k["kernel"] = f"k{i}"  # no two layers run the same kernels
    with pytest.raises(ValueError, match="no block near it repeats"):
        st.kernels_per_layer([broken, _report(1, SHARES)])
    untimed = [
        {"model": {"layers": 3}, "step_launches": {"kernels": 16}},
        {"model": {"layers": 1}, "step_launches": {"kernels": 7}},
    ]
    with pytest.raises(ValueError, match="4.5 kernels a layer"):
        st.kernels_per_layer(untimed)


def test_a_kernel_one_report_alone_caught_does_not_count_for_the_layers() -> None:
    # The profiler caught a fill inside layer 2 and a copy after the head of the 4-layer step and
    # nothing extra at 2 layers: 23 against 13 kernels give 5 a layer by the slope; the layers run 4.
    four = _report(4, SHARES, extra_in=1)
    four["step_launches"]["timeline"].append({"kernel": "copy", "us": 1.0})
    four["step_launches"]["kernels"] += 1
    two = _report(2, SHARES)
    assert (four["step_launches"]["kernels"] - two["step_launches"]["kernels"]) / 2 == 5
    assert st.kernels_per_layer([four, two]) == 4
    odd = _report(3, SHARES, extra_in=0)  # 16 kernels at 3 layers against 7 at 1: 4.5 a layer
    assert st.kernels_per_layer([odd, _report(1, SHARES)]) == 4


def test_names_that_repeat_no_block_per_layer_are_refused() -> None:
    report = _report(2, SHARES)
    report["step_launches"]["timeline"][5]["kernel"] = "other"  # layer 2's first kernel differs
    with pytest.raises(ValueError, match="do not each run one block"):
        st.breakdown(report, 4)
    with pytest.raises(ValueError, match="no step timeline"):
        st.breakdown({"model": {"layers": 2}, "step_launches": {"kernels": 3}}, 4)


def test_the_command_prints_tables_and_fails_on_a_bad_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    four, two, bad = tmp_path / "four.json", tmp_path / "two.json", tmp_path / "bad.json"
    four.write_text(json.dumps(_report(4, SHARES)))
    two.write_text(json.dumps(_report(2, SHARES)))
    bad.write_text(json.dumps({"model": {"layers": 2}, "step_launches": {"kernels": 1}}))
    assert cli.main([str(four), str(two)]) == 0
    assert "| 4 | moe | 31.0 |" in capsys.readouterr().out
    assert cli.main([str(four), str(bad), "--per-layer", "4"]) == 1
    assert "bad.json: the report has no step timeline" in capsys.readouterr().err
    assert cli.main([str(four)]) == 1
    assert "two layer counts" in capsys.readouterr().err
