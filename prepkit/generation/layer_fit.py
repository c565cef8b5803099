"""Per-layer cost and fixed part of a decode step from two ``prepkit bench`` reports at different
layer counts, scaled to a model's full depth and set against the bandwidth floor.

A decode step is ``fixed + layers x per_layer`` (embedding, head and sampler are the fixed part), so
two layer counts of one folder give both terms; the figures then hold for the full model on a GPU
that cannot hold it, and for a synthetic folder of a few layers at real dimensions. The floor is
scaled the same way from the bytes per token and the copy bandwidth the run measured.
"""

from __future__ import annotations

from typing import Any

from prepkit.generation.kernel_count import per_layer
from prepkit.generation.step_timeline import kernels_per_layer
from prepkit.recipes import recipe_depth


def tg_ms(report: dict[str, Any], test: str = "tg128", batch: int = 1) -> float:
    """Milliseconds a decoded token in ``report``'s ``test`` row (median tok/s) at ``batch``.

    Raises:
        ValueError: the report has no such row.
    """
    for row in report["tests"]:
        if row["test"] == test and row["batch"] == batch:
            return 1e3 / row["tok_s"]["median"]
    raise ValueError(f"the report has no {test} row at batch {batch}")


def fit_layers(
    full: dict[str, Any], few: dict[str, Any], *, scale_to: int | None = None, test: str = "tg128"
) -> dict[str, Any]:
    """The per-layer and fixed cost of ``test`` (batch 1) from reports at two layer counts
    (``full`` the larger), the step scaled to ``scale_to`` layers (default: the depth of the
    reports' recipe, else the larger count), and its floor scaled the same way (``None`` floor
    figures where the run measured no copy bandwidth: the CPU). Kernels a layer where both reports
    counted the step's kernels.

    Raises:
        ValueError: the two reports ran the same number of layers, or lack the ``test`` row.
    """
    layers, fit = full["model"]["layers"], few["model"]["layers"]
    if layers == fit:
        raise ValueError(f"both reports ran {layers} layers: a fit needs two layer counts")
    scale_to = scale_to or recipe_depth(full["model"].get("recipe", "")) or layers
    per_layer = (tg_ms(full, test) - tg_ms(few, test)) / (layers - fit)
    fixed = tg_ms(full, test) - layers * per_layer
    scaled_ms = fixed + scale_to * per_layer
    fitted: dict[str, Any] = {
        "layers": [layers, fit],
        "test": test,
        "per_layer_us": per_layer * 1e3,
        "fixed_ms": fixed,
        "scaled_layers": scale_to,
        "scaled_ms": scaled_ms,
        "scaled_tok_s": 1e3 / scaled_ms,
        "kernels_per_layer": _kernels_per_layer(full, few),
    }
    floor: dict[str, Any] = dict.fromkeys(("floor_ms", "floor_tok_s", "pct_of_floor", "floor_per_layer_us"))
    if full.get("copy_bandwidth_gb_s"):
        parts, bw = full["bytes_per_token"], full["copy_bandwidth_gb_s"] * 1e9
        layer_bytes = (sum(parts.values()) - parts["head"]) / layers
        floor_ms = (parts["head"] + scale_to * layer_bytes) / bw * 1e3
        floor = {
            "floor_ms": floor_ms,
            "floor_tok_s": 1e3 / floor_ms,
            "pct_of_floor": 100 * floor_ms / scaled_ms,
            "floor_per_layer_us": layer_bytes / bw * 1e6,
        }
    return {**fitted, **floor}


def _kernels_per_layer(full: dict[str, Any], few: dict[str, Any]) -> float | None:
    """The kernels of a layer (:func:`~prepkit.generation.step_timeline.kernels_per_layer`: the
    layers' own block where the reports hold timelines), else the slope of the two counts."""
    a, b = full.get("step_launches"), few.get("step_launches")
    if not a or not b:
        return None
    try:
        return kernels_per_layer([full, few])
    except ValueError:
        return per_layer({full["model"]["layers"]: a["kernels"], few["model"]["layers"]: b["kernels"]})


def summary_line(fit: dict[str, Any]) -> str:
    """The fit in one line, as ``prepkit bench`` prints it."""
    layers, fewer = fit["layers"]
    text = (
        f"fit over {layers} and {fewer} layers ({fit['test']}, batch 1): {fit['per_layer_us']:.1f} us a layer"
        + (f" (floor {fit['floor_per_layer_us']:.1f})" if fit["floor_per_layer_us"] is not None else "")
        + f", fixed {fit['fixed_ms']:.3f} ms; at {fit['scaled_layers']} layers {fit['scaled_tok_s']:.1f} tok/s"
    )
    if fit["pct_of_floor"] is not None:
        text += f", {fit['pct_of_floor']:.1f} % of the floor ({fit['floor_tok_s']:.1f} tok/s)"
    if fit["kernels_per_layer"] is not None:
        text += f"; {fit['kernels_per_layer']:g} kernels a layer"
    return text
