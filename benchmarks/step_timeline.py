"""Where one decode step's time goes, per kernel of a layer, from ``prepkit bench --json`` reports:

    python -m benchmarks.step_timeline REPORT.json REPORT.json [--per-layer N]

Two reports at different layer counts give the kernels of a layer (or ``--per-layer``); each
report's table follows (prepkit.generation.step_timeline). ``prepkit bench --layers N,M`` prints
the same table for its own run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepkit.generation.step_timeline import breakdown, kernels_per_layer, table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="prepkit bench --json reports")
    parser.add_argument("--per-layer", type=int, help="kernels a layer (default: from the reports' counts)")
    args = parser.parse_args(argv)
    try:
        reports = [json.loads(path.read_text()) for path in args.reports]
        period = args.per_layer or kernels_per_layer(reports)
    except (OSError, ValueError, KeyError) as err:
        print(f"step_timeline: {err}", file=sys.stderr)
        return 1
    failed = False
    for path, report in zip(args.reports, reports, strict=True):
        try:
            print(table(breakdown(report, period), str(path)) + "\n")
        except (ValueError, KeyError) as err:
            print(f"step_timeline: {path}: {err}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
