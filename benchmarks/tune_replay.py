"""Replay the pruned search on the timings a thorough search stored, on the CPU.

    python benchmarks/tune_replay.py thorough.db [--gpu NAME] [--tokens 1,8,64] [--refine-rounds 1]

Per GEMM and token count: the thorough search's choice, and the pick of the pruned search
without and with its local refinement, replayed on the thorough run's timings
(``prepkit.tune.replay`` says how, and how far to trust it), with the miss in %; then how many
variants each replay checked and timed. A change to the pruning is tried here before the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import search_compare as compare  # noqa: E402
from benchmarks.search_replay import env_device, replay, timing_map  # noqa: E402
from prepkit.errors import PrepkitError  # noqa: E402
from prepkit.tactics import store  # noqa: E402
from prepkit.tune import parse_tokens  # noqa: E402
from prepkit.tune.report import short_tactic  # noqa: E402
from prepkit.tune.sweep import SweepConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Replay the pruned search on a thorough run's timings.")
    parser.add_argument("db", type=Path, help="tactics DB holding a thorough search")
    parser.add_argument("--gpu", help="GPU name (default: the GPU of the latest thorough run)")
    parser.add_argument("--tokens", help="token counts to replay (default: the thorough run's points)")
    parser.add_argument(
        "--refine-seeds", type=int, default=SweepConfig.refine_seeds, help="best variants per anchor to search around"
    )
    parser.add_argument(
        "--refine-rounds", type=int, default=SweepConfig.refine_rounds, help="rounds of the local search at most"
    )
    args = parser.parse_args(argv)
    try:
        thorough = compare.read_searches([args.db], args.gpu).get("thorough")
        if thorough is None:
            raise PrepkitError(f"no recorded thorough run in {args.db}", hint="run `prepkit tune --thorough` first")
        with store.open_db_readonly(thorough.db) as tdb:
            device = env_device(tdb, thorough.env_hash)
            points = parse_tokens(args.tokens) if args.tokens else tuple(json.loads(thorough.runs[-1]["token_points"]))
            print(f"## Pruned search replayed on the thorough timings of {device.name}\n")
            for ph in thorough.records:
                problem = tdb.problem_key(ph)
                us = timing_map(tdb.measured(thorough.env_hash, ph))
                plain = replay(problem, device, us, points, refine=False)
                refined = replay(
                    problem, device, us, points, refine_seeds=args.refine_seeds, refine_rounds=args.refine_rounds
                )
                print(f"### {problem.role} N={problem.n} K={problem.k} ({plain.unmapped} variants without a timing)\n")
                print("| tokens | thorough µs | thorough variant | pruned µs | miss % | refined µs | miss % |")
                print("|---:|---:|---|---:|---:|---:|---:|")
                for m in plain.points:
                    best, nan = plain.best[m], float("nan")
                    pruned_us, refined_us = us.get((m, plain.picks[m]), nan), us.get((m, refined.picks[m]), nan)
                    print(
                        f"| {m} | {us[(m, best)]:.1f} | {short_tactic(best)} | {pruned_us:.1f} "
                        f"| {plain.miss(m) * 100:.1f} | {refined_us:.1f} | {refined.miss(m) * 100:.1f} |"
                    )
                print(
                    f"\nchecked / timed: pruned {plain.checks} / {plain.timings}, "
                    f"refined {refined.checks} / {refined.timings}\n"
                )
    except PrepkitError as err:
        print(f"error: {err}" + (f"\nhint: {err.hint}" if err.hint else ""), file=sys.stderr)
        return err.exit_code
    except ValueError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
