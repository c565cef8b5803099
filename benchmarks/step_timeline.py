"""Where one decode step's time goes, per kernel of a layer, from ``prepkit bench --json`` reports:

    python -m benchmarks.step_timeline REPORT.json [REPORT.json ...]

Each report's ``step_launches.timeline`` lists the step's kernels in launch order with their share
of the step's chain (prepkit.generation.kernel_count). The layers repeat one block of kernels; this
finds that block, and prints for each of its kernels the median share over the layers, then the
kernels outside the layers (embedding, head, sampler). The profiler's tracing slows each kernel a
little, so the shares add up to a bit more than the step's untraced time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def layer_block(names: list[str], layers: int) -> tuple[int, int] | None:
    """``(offset, period)``: the shortest block of kernel names that ``names`` repeats ``layers``
    times in a row from ``offset`` (the first such offset), or ``None``."""
    for period in range(1, len(names) // layers + 1):
        for offset in range(len(names) - layers * period + 1):
            block = names[offset : offset + period]
            if all(names[offset + i * period : offset + (i + 1) * period] == block for i in range(1, layers)):
                return offset, period
    return None


def breakdown(report: dict[str, Any]) -> dict[str, Any]:
    """Per-layer kernels (name, median share in us over the layers) and the fixed kernels of one
    report.

    Raises:
        ValueError: the report has no timeline, or its kernels repeat no block once per layer.
    """
    timeline = (report.get("step_launches") or {}).get("timeline")
    layers = report["model"]["layers"]
    if not timeline:
        raise ValueError("the report has no step timeline (a CUDA run of prepkit bench writes one)")
    names = [k["kernel"] for k in timeline]
    shares = [float(k["us"]) for k in timeline]
    found = layer_block(names, layers) if layers > 1 else None
    if found is None:
        raise ValueError(f"no block of kernels repeats once per layer over {layers} layers")
    offset, period = found
    per_layer = [
        (names[offset + j], statistics.median(shares[offset + i * period + j] for i in range(layers)))
        for j in range(period)
    ]
    end = offset + layers * period
    fixed = list(zip(names[:offset] + names[end:], shares[:offset] + shares[end:], strict=True))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="prepkit bench --json reports")
    args = parser.parse_args(argv)
    failed = False
    for path in args.reports:
        try:
            print(table(breakdown(json.loads(path.read_text())), str(path)) + "\n")
        except (OSError, ValueError, KeyError) as err:
            print(f"step_timeline: {path}: {err}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
