"""A tune killed at any point resumes: the DB stays intact and the rerun measures only what is
missing. Two merges into one DB at once: the second is refused at once, naming the first's pid.

The tuner runs in a child process through the real ``prepkit tune`` command, with a stand-in GPU
(a FunctionBackend whose timer sleeps) so that SIGKILL can land mid-sweep on a CPU machine.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TOKENS = "1-4,64,8192"

CHILD = textwrap.dedent(
    """
    import json, sys, time
    from prepkit.kernels.device import H100
    from prepkit.tactics.keys import Environment
    from prepkit.tune import FunctionBackend, Worker
    from prepkit.tune import run as tune_run

    delay = float(sys.argv[1])

    def timer(t, m):
        time.sleep(delay)
        d = json.loads(t)
        us = (5.0 + m * 0.01) * (1 + 0.1 * abs(d["block_m"].bit_length() - (5 if m <= 64 else 8)))
        return [us * (1 + 0.001 * i) for i in range(9)]

    def checker(t):
        time.sleep(delay)
        return True

    env = Environment.of(H100)
    tune_run.open_gpu_workers = lambda gpus, extra_env=None: [Worker(FunctionBackend(timer, checker), env, H100)]
    from prepkit.cli import main

    sys.argv = ["prepkit", "tune", "--arch", "sm90", "--db", sys.argv[2], "--tokens", sys.argv[3],
                "--max-candidates", "12", "--dense-formats", "none", "--json", "-q"]
    main()
    """
)


def _rows(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
            return int(
                c.execute("SELECT (SELECT COUNT(*) FROM measurement) + (SELECT COUNT(*) FROM correctness)").fetchone()[
                    0
                ]
            )
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_tune_killed_anywhere_resumes_with_an_intact_db(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    db = tmp_path / "t.db"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # Kill early (during the numerics checks), in the middle and late in the sweep.
    for kill_after in (3, 25, 60):
        proc = subprocess.Popen([sys.executable, str(script), "0.01", str(db), TOKENS], env=env, stdout=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while _rows(db) < kill_after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with sqlite3.connect(db) as c:
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    done = subprocess.run(
        [sys.executable, str(script), "0", str(db), TOKENS], env=env, capture_output=True, text=True, check=True
    )
    summary = json.loads(done.stdout)
    assert all(p["complete"] for p in summary["problems"])
    assert sum(p["reused"] for p in summary["problems"]) > 0  # the killed runs' points are kept
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        statuses = [r[0] for r in c.execute("SELECT status FROM tuning_run ORDER BY started_at")]
        # every (tactic, point) pair was measured once over all the runs
        dup = c.execute(
            "SELECT COUNT(*) FROM (SELECT problem_hash, m, tactic_hash FROM measurement "
            "GROUP BY problem_hash, m, tactic_hash HAVING COUNT(*) > 1)"
        ).fetchone()[0]
        winners = c.execute("SELECT COUNT(*) FROM winner").fetchone()[0]
    assert statuses[-1] == "complete" and len(statuses) == 4
    assert dup == 0 and winners >= 2


def test_second_merge_into_one_db_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from prepkit.cli import cli
    from prepkit.tactics.store import open_db

    src = tmp_path / "src.db"
    open_db(src).close()
    dest = tmp_path / "dest.db"
    holder = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from prepkit.locks import exclusive
        from prepkit.errors import TacticsError
        with exclusive(Path({str(dest) + ".merge-lock"!r}), busy=lambda pid: TacticsError("busy")):
            print("holding", flush=True)
            time.sleep(30)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        t0 = time.monotonic()
        r = CliRunner().invoke(cli, ["tactics", "merge", str(dest), str(src)])
        assert time.monotonic() - t0 < 10  # refused at once, not after the busy timeout
        assert r.exit_code == 3
        assert f"pid {proc.pid}" in r.output and "another `prepkit tactics merge`" in r.output
    finally:
        proc.kill()
        proc.wait()
    r = CliRunner().invoke(cli, ["tactics", "merge", str(dest), str(src)])
    assert r.exit_code == 0, r.output
