"""``prepkit.generation.layer_fit``: the per-layer cost and fixed part of a decode step from two
layer counts, scaled to a model's depth, against the floor measured in the same run."""

from __future__ import annotations

import pytest

from prepkit.generation.layer_fit import fit_layers, summary_line, tg_ms


def _report(layers: int, ms: float, *, bandwidth: float | None = 1000.0, kernels: int | None = None) -> dict:
    report = {
        "model": {"layers": layers},
        "tests": [{"test": "tg16", "batch": 1, "tok_s": {"median": 1e3 / ms}}],
        "bytes_per_token": {"experts": 4e6 * layers, "attention": 1e6 * layers, "head": 2e6},
        "copy_bandwidth_gb_s": bandwidth,
    }
    if kernels is not None:
        report["step_launches"] = {"kernels": kernels, "memory_ops": 0}
    return report


def test_two_layer_counts_give_the_slope_the_fixed_part_and_the_scaled_floor() -> None:
    # 0.5 ms fixed + 0.25 ms a layer; 5 MB a layer and 2 MB of head at 1000 GB/s.
    fit = fit_layers(_report(4, 1.5, kernels=31), _report(2, 1.0, kernels=17), scale_to=36, test="tg16")
    assert fit["layers"] == [4, 2] and fit["scaled_layers"] == 36
    assert fit["per_layer_us"] == pytest.approx(250.0) and fit["fixed_ms"] == pytest.approx(0.5)
    assert fit["scaled_ms"] == pytest.approx(0.5 + 36 * 0.25) and fit["scaled_tok_s"] == pytest.approx(1e3 / 9.5)
    assert fit["floor_per_layer_us"] == pytest.approx(5.0)  # 5 MB at 1000 GB/s
    assert fit["floor_ms"] == pytest.approx((2.0 + 36 * 5.0) * 1e-3)
    assert fit["pct_of_floor"] == pytest.approx(100 * 0.182 / 9.5)
    assert fit["kernels_per_layer"] == pytest.approx(7.0)
    line = summary_line(fit)
    assert "fit over 4 and 2 layers" in line and "250.0 us a layer (floor 5.0)" in line
    assert "at 36 layers 105.3 tok/s" in line and "7 kernels a layer" in line


def test_with_timelines_the_fit_counts_the_layers_own_block_not_a_stray_kernel() -> None:
    # The profiler caught a fill in one layer and a copy after the head of the 4-layer step only:
    # the counts' slope says 5 kernels a layer, the layers each run a block of 4.
    from tests.generation.test_step_timeline import SHARES
    from tests.generation.test_step_timeline import _report as timed

    four, two = timed(4, SHARES, extra_in=1), timed(2, SHARES)
    four["step_launches"]["timeline"].append({"kernel": "copy", "us": 1.0})
    four["step_launches"]["kernels"] += 1
    for report, ms in ((four, 1.5), (two, 1.0)):
        report.update(_report(report["model"]["layers"], ms), step_launches=report["step_launches"])
    fit = fit_layers(four, two, scale_to=36, test="tg16")
    assert fit["kernels_per_layer"] == 4 and "; 4 kernels a layer" in summary_line(fit)


def test_without_a_copy_bandwidth_the_floor_figures_are_none() -> None:
    fit = fit_layers(_report(3, 2.0, bandwidth=None), _report(1, 1.0, bandwidth=None), scale_to=3, test="tg16")
    assert fit["per_layer_us"] == pytest.approx(500.0) and fit["kernels_per_layer"] is None
    assert fit["floor_ms"] is None and fit["pct_of_floor"] is None
    assert "% of the floor" not in summary_line(fit) and "floor" not in summary_line(fit)


def test_a_fit_needs_two_counts_and_the_test_row() -> None:
    with pytest.raises(ValueError, match="both reports ran 2 layers"):
        fit_layers(_report(2, 1.0), _report(2, 1.1), scale_to=36, test="tg16")
    with pytest.raises(ValueError, match="no tg128 row at batch 1"):
        tg_ms(_report(2, 1.0), "tg128")


def test_the_fit_scales_to_the_recipes_depth_unless_told() -> None:
    full, few = _report(4, 1.5), _report(2, 1.0)
    full["model"]["recipe"] = "gpt-oss-20b"
    assert fit_layers(full, few, test="tg16")["scaled_layers"] == 24  # the recipe's num_hidden_layers
    assert fit_layers(full, few, test="tg16", scale_to=7)["scaled_layers"] == 7
    full["model"]["recipe"] = "no-such-model"
    assert fit_layers(full, few, test="tg16")["scaled_layers"] == 4  # else the larger count
