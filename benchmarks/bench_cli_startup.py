"""How long ``prepkit --help`` and shell completion take: median of 5 fresh processes each.

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
    rows = [
        ("prepkit --help", median_s([*base, "--help"])),
        ("completion of 'prepkit t'", median_s(base, env=complete)),
        ("python -c pass (interpreter alone)", median_s([sys.executable, "-c", "pass"])),
    ]
    for name, s in rows:
        print(f"{name:40s} {s * 1000:7.0f} ms")


if __name__ == "__main__":
    main()
