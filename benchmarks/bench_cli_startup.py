"""How long ``prepkit --help``, ``prepkit prepare --help`` and shell completion take (the target is
under 0.5 s each: none of them may import torch): median of 5 fresh processes each.

python benchmarks/bench_cli_startup.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time


def median_s(argv: list[str], env: dict[str, str] | None = None, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(argv, check=False, capture_output=True, env=env)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    base = [sys.executable, "-m", "prepkit"]
    complete = {**os.environ, "_PREPKIT_COMPLETE": "bash_complete", "COMP_WORDS": "prepkit t", "COMP_CWORD": "1"}
    layouts = {**complete, "COMP_WORDS": "prepkit prepare --layout ", "COMP_CWORD": "3"}
    rows = [
        ("prepkit --help", median_s([*base, "--help"])),
        ("prepkit prepare --help", median_s([*base, "prepare", "--help"])),
        ("completion of 'prepkit t'", median_s(base, env=complete)),
        ("completion of 'prepare --layout '", median_s(base, env=layouts)),
        ("python -c pass (interpreter alone)", median_s([sys.executable, "-c", "pass"])),
    ]
    for name, s in rows:
        print(f"{name:40s} {s * 1000:7.0f} ms")


if __name__ == "__main__":
    main()
