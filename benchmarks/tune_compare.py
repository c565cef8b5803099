"""The pruned search against the thorough one, from the tuning runs stored in tactics DBs.

    python benchmarks/tune_compare.py pruned.db thorough.db [--tokens 1,8,64] [--gpu NAME] [--json]
    python benchmarks/tune_compare.py both.db

Per GEMM and token count: the default's median, the pruned and the thorough pick with their
medians, the miss in % (how much slower the pruned pick is), and how long each search took, as a
markdown table (or JSON). Each search is the latest one recorded in the DBs given (one DB may hold
both); ``prepkit.tune.compare`` says how the numbers are read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepkit.errors import PrepkitError  # noqa: E402
from prepkit.tune import compare, parse_tokens  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare a pruned and a thorough `prepkit tune` search.")
    parser.add_argument("dbs", nargs="+", type=Path, help="tactics DBs holding the two searches (one or two)")
    parser.add_argument("--tokens", help="token counts to show, e.g. 1,8,64 or 1-8 (default: every point swept)")
    parser.add_argument("--gpu", help="GPU name (default: the GPU of the latest thorough run)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    try:
        tokens = parse_tokens(args.tokens) if args.tokens else None
    except ValueError as err:
        parser.error(f"--tokens: {err}")
    try:
        found = compare.read_searches(args.dbs, args.gpu)
        missing = [s for s in ("pruned", "thorough") if s not in found]
        if missing:
            raise PrepkitError(
                f"no recorded {' or '.join(missing)} run on that GPU in {', '.join(map(str, args.dbs))}",
                hint="run `prepkit tune` (pruned) and `prepkit tune --thorough` on it first",
            )
        doc = compare.compare(found["pruned"], found["thorough"], tokens)
    except PrepkitError as err:
        print(f"error: {err}" + (f"\nhint: {err.hint}" if err.hint else ""), file=sys.stderr)
        return err.exit_code
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.json else compare.markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
