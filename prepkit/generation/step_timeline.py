"""Where a decode step's time goes, kernel by kernel of a layer, from ``prepkit bench`` reports.

Each report's ``step_launches.timeline`` lists the step's kernels in launch order with their share
of the step's chain (:mod:`prepkit.generation.kernel_count`). The layers repeat one block of
kernels (about as many as the slope of two reports' kernel counts over their layer counts); this finds
that block, the median share of each of its kernels over the layers, and the kernels outside it
(embedding, head, sampler, and a kernel one layer alone adds). The profiler's tracing slows each
kernel a little, and may catch a kernel of one report alone, which :func:`kernels_per_layer` sees
through.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from prepkit.generation.kernel_count import per_layer

# How far the kernels of a layer may lie from the slope of the reports' kernel counts: a kernel the
# profiler catches in one report alone (a fill, a copy node) moves the slope, not the layers' block.
SLOPE_SLACK = 2


def kernels_per_layer(reports: list[dict[str, Any]]) -> int:
    """The kernels each layer runs. Without timelines, the slope of the reports' kernel counts
    over their layer counts (two different ones needed); with them, the largest count within
    :data:`SLOPE_SLACK` of that slope whose block every report's layers repeat (:func:`breakdown`).

    Raises:
        ValueError: fewer than two layer counts; without timelines a slope that is not a whole
            number; with them no count near the slope that every report's layers repeat.
    """
    counts = {r["model"]["layers"]: r["step_launches"]["kernels"] for r in reports if r.get("step_launches")}
    slope = per_layer(counts)
    if slope is None:
        raise ValueError("the kernels of a layer need reports at two layer counts (or --per-layer)")
    timed = [r for r in reports if (r.get("step_launches") or {}).get("timeline")]
    if not timed:
        if slope != int(slope) or slope < 1:
            raise ValueError(f"the kernel counts {counts} give {slope:g} kernels a layer")
        return int(slope)
    for period in range(math.ceil(slope) + SLOPE_SLACK, max(0, math.floor(slope) - SLOPE_SLACK), -1):
        if all(_repeats(r, period) for r in timed):
            return period
    raise ValueError(f"the kernel counts {counts} give {slope:g} kernels a layer, and no block near it repeats")


def _repeats(report: dict[str, Any], period: int) -> bool:
    try:
        breakdown(report, period)
    except ValueError:
        return False
    return True


def layer_block(names: list[str], period: int) -> list[str]:
    """The block of ``period`` kernel names the layers repeat: the window of that length that
    :func:`match_layers` finds most often, a kernel one layer alone adds allowed inside (the
    earliest-starting window among equals). Counting exact windows instead, a fill inside one of
    two layers leaves every window once, and the earliest (the embedding's) wins. Which of its
    rotations starts a layer is :func:`breakdown`'s choice."""
    first: dict[tuple[str, ...], int] = {}
    for i in range(len(names) - period + 1):
        first.setdefault(tuple(names[i : i + period]), i)
    if not first:
        return []
    best, _ = max(first.items(), key=lambda kv: (len(match_layers(names, list(kv[0]))), -kv[1]))
    return list(best)


def match_layers(names: list[str], block: list[str], slack: int = 2) -> list[list[int]]:
    """The index lists at which ``names`` runs ``block`` in order, each allowing up to ``slack``
    other kernels inside (a kernel one layer alone adds), scanned from the left."""
    layers, i = [], 0
    while i < len(names):
        found = _match_at(names, i, block, slack)
        if found is None:
            i += 1
        else:
            layers.append(found)
            i = found[-1] + 1
    return layers


def _match_at(names: list[str], i: int, block: list[str], slack: int) -> list[int] | None:
    if not block or names[i] != block[0]:
        return None
    found, j, skipped = [i], i + 1, 0
    for name in block[1:]:
        while j < len(names) and names[j] != name and skipped < slack:
            j, skipped = j + 1, skipped + 1
        if j >= len(names) or names[j] != name:
            return None
        found.append(j)
        j += 1
    return found


def breakdown(report: dict[str, Any], period: int) -> dict[str, Any]:
    """Per-layer kernels (name, median share in us over the layers found) and the kernels outside
    them, of one report whose layers each run ``period`` kernels.

    Raises:
        ValueError: the report has no timeline, or fewer layers than it ran repeat one block.
    """
    timeline = (report.get("step_launches") or {}).get("timeline")
    layers = report["model"]["layers"]
    if not timeline:
        raise ValueError("the report has no step timeline (a CUDA run of prepkit bench writes one)")
    names = [k["kernel"] for k in timeline]
    shares = [float(k["us"]) for k in timeline]
    block = layer_block(names, period)
    # The layers' block may be read from any of its kernels on (the head's kernel can share a
    # layer kernel's name): the rotation whose layers agree best, kernel by kernel, starts a layer.
    candidates = []
    for r in range(len(block)):
        rotated = block[r:] + block[:r]
        found = match_layers(names, rotated)
        if len(found) == layers:
            spread = sum(max(shares[f[j]] for f in found) - min(shares[f[j]] for f in found) for j in range(period))
            candidates.append((spread, r, rotated, found))
    if not candidates:
        raise ValueError(f"the {layers} layers do not each run one block of {period} kernels")
    _, _, block, found = min(candidates, key=lambda c: (c[0], c[1]))
    per_layer = [(name, statistics.median(shares[f[j]] for f in found)) for j, name in enumerate(block)]
    inside = {i for f in found for i in f}
    fixed = [(names[i], shares[i]) for i in range(len(names)) if i not in inside]
    return {"layers": layers, "per_layer": per_layer, "fixed": fixed}


def table(found: dict[str, Any], source: str) -> str:
    lines = [f"{source}: {found['layers']} layers", "", "| # | kernel, per layer | us |", "|---:|---|---:|"]
    lines += [f"| {i + 1} | {_short(n)} | {us:.1f} |" for i, (n, us) in enumerate(found["per_layer"])]
    lines.append(f"| | a layer | {sum(us for _, us in found['per_layer']):.1f} |")
    lines += ["", "| kernel, outside the layers | us |", "|---|---:|"]
    lines += [f"| {_short(n)} | {us:.1f} |" for n, us in found["fixed"]]
    lines.append(f"| outside the layers | {sum(us for _, us in found['fixed']):.1f} |")
    return "\n".join(lines)


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."
