"""The pruned search against the thorough one, from the tuning runs stored in tactics DBs.

    python benchmarks/tune_compare.py pruned.db thorough.db [--tokens 1,8,64] [--gpu NAME] [--json]
    python benchmarks/tune_compare.py both.db
    python benchmarks/tune_compare.py pruned.db thorough.db --retime   # on that GPU: time the picks again
    python benchmarks/tune_compare.py pruned.db thorough.db --retime --rounds 9   # more rounds where timings drift

Per GEMM and token count: the default's median, the pruned and the thorough pick with their
medians, the miss in % (how much slower the pruned pick is), and how long each search took, as a
markdown table (or JSON). Each search is the latest one recorded in the DBs given (one DB may hold
both); ``benchmarks/search_compare.py`` says how the numbers are read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import search_compare as compare  # noqa: E402
from prepkit.errors import PrepkitError  # noqa: E402
from prepkit.tune import parse_tokens  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare a pruned and a thorough `prepkit tune` search.")
    parser.add_argument("dbs", nargs="+", type=Path, help="tactics DBs holding the two searches (one or two)")
    parser.add_argument("--tokens", help="token counts to show, e.g. 1,8,64 or 1-8 (default: every point swept)")
    parser.add_argument("--gpu", help="GPU name (default: the GPU of the latest thorough run)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument(
        "--retime",
        action="store_true",
        help="time each row's default and both picks again side by side on GPU 0 (needs the GPU the searches ran on)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="with --retime: time the picks this many times, each round starting one pick later, and take medians "
        "(default 5: from 2048 tokens up, one timing moves by several per cent)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: must be at least 1, got {args.rounds}")
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
        if args.retime:
            retime(doc, found["thorough"].db, args.rounds)
    except PrepkitError as err:
        print(f"error: {err}" + (f"\nhint: {err.hint}" if err.hint else ""), file=sys.stderr)
        return err.exit_code
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.json else compare.markdown(doc))
    return 0


def retime(doc: dict[str, Any], db: str, rounds: int) -> None:
    """Time the picks again on GPU 0 (:func:`prepkit.tune.compare.retime`); refuses another GPU."""
    from prepkit.errors import DeviceError
    from prepkit.tactics import store
    from prepkit.tune.backend import open_gpu_workers

    with store.open_db_readonly(db) as tdb:
        problems = {g["problem_hash"]: tdb.problem_key(g["problem_hash"]) for g in doc["gemms"]}
    worker = open_gpu_workers([0])[0]
    try:
        if worker.env.name != doc["gpu"]:
            raise DeviceError(f"the searches ran on {doc['gpu']}, this GPU is {worker.env.name}")
        n = compare.retime(doc, problems, worker.backend, rounds)
        print(f"retimed {n} rows on {worker.env.name}, {rounds} round{'s' if rounds > 1 else ''}", file=sys.stderr)
    finally:
        worker.backend.close()


if __name__ == "__main__":
    sys.exit(main())
