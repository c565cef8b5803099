"""Checks that ``.ci/wheel-check`` runs inside the installed wheel, from an unrelated folder.

``python wheel_checks.py show < tactics-show.json``: ``prepkit tactics show --json`` read the DB
shipped inside the installed package and lists its winners.

``python wheel_checks.py lookup``: the runtime's tactic lookup for gpt-oss-120b TP 1 on an H100
is served by that DB, with tuned ranges for both GEMMs (needs the ``gpu`` extra: the kernel
version lives in the kernel module).

Each exits non-zero with the reason on stderr.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
SHIPPED_DB = SITE / "prepkit" / "data" / "tactics.db"


def show() -> str | None:
    shown = json.load(sys.stdin)
    db = shown["db"]
    if Path(db).resolve() != SHIPPED_DB:
        return f"tactics show read {db}, not {SHIPPED_DB}"
    gpus = sorted({w["gpu_name"] for w in shown["winners"]})
    if "NVIDIA H100 80GB HBM3" not in gpus:
        return f"tactics show lists no H100 winners (GPUs: {gpus})"
    print(f"{db}: {len(shown['winners'])} winner ranges on {gpus}")
    return None


def lookup() -> str | None:
    from prepkit.constants import TRITON_MOE_LAYOUT_ID
    from prepkit.kernels.moe_mxfp4 import KERNEL_VERSION
    from prepkit.kernels.tactic import GemmTactic
    from prepkit.runtime import Environment, TacticTable, gpt_oss_problems
    from prepkit.tactics.keys import KERNEL_NAME
    from prepkit.tactics.lookup import bundled_db_path

    h100 = Environment(cc_major=9, cc_minor=0, name="NVIDIA H100 80GB HBM3", triton_version="3.6.0")
    bundled = bundled_db_path()
    if bundled is None or bundled.resolve() != SHIPPED_DB:
        return f"bundled_db_path() is {bundled}, expected {SHIPPED_DB}"
    problems = gpt_oss_problems(
        kernel=KERNEL_NAME, kernel_version=str(KERNEL_VERSION), weight_layout=TRITON_MOE_LAYOUT_ID
    )
    for role, problem in problems.items():
        table = TacticTable.load(problem, h100, user_db="/nonexistent/tactics.db")
        if table.source != "bundled" or table.tier != "exact" or not table.ranges:
            return (
                f"{role} (kernel v{KERNEL_VERSION}) on {h100.name}: source {table.source!r}, tier {table.tier!r}, "
                f"{len(table.ranges)} ranges; notes: {list(table.notes)}"
            )
        points = (1, 64, table.max_tuned)
        decoded = {m: table.get(m, lambda m: None, GemmTactic.from_json) for m in points}
        if any(t is None for t in decoded.values()):
            return f"{role}: a tuned range does not decode into a GemmTactic: {decoded}"
        print(f"{role}: {len(table.ranges)} tuned ranges up to {table.max_tuned} tokens from {table.db_path}")
    return None


if __name__ == "__main__":
    checks = {"show": show, "lookup": lookup}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        sys.exit(f"usage: python {sys.argv[0]} {{{'|'.join(checks)}}}")
    error = checks[sys.argv[1]]()
    if error:
        sys.exit(f"FAIL: {error}")
