"""``python -m prepkit.tune.worker_cli``: start a tuning worker process (``prepkit tune`` does).

A module of its own: running :mod:`prepkit.tune.worker` with ``-m`` would load it a second time
(the package imports it), and Python warns about that on every worker's stderr.
"""

from __future__ import annotations

import argparse
import sys

from prepkit.tune.worker import worker_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="prepkit tuning worker (started by `prepkit tune`)")
    ap.add_argument("--seed", type=int, default=0)
    return worker_main(ap.parse_args(argv).seed)


if __name__ == "__main__":
    sys.exit(main())
