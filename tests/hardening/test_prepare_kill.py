"""A ``prepare`` killed at any instant resumes with the same command and ends byte-identical to an
uninterrupted run, with no temp file left; two runs on one folder are never interleaved.

The kill-anywhere test SIGKILLs the real ``prepkit prepare`` command at every step of a run (each
write, rename and link of an output file, the journal's included: ``PREPKIT_TEST_CRASH_AT``), then
reruns it. A driver process imports prepkit once and forks one child per run, so a whole sweep
costs about what the runs themselves cost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.constants import JOURNAL_NAME, MANIFEST_NAME, PREPARE_LOCK
from prepkit.fsutil import CRASH_AT_ENV, STEP_DELAY_ENV
from prepkit.synth import write_synthetic_checkpoint

REPO = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent(
    """
    import hashlib, json, os, shutil, sys
    from pathlib import Path

    import prepkit.cli.prepare, prepkit.prepare  # imported once, before the forks
    from prepkit.cli import main
    from prepkit.constants import JOURNAL_NAME, MANIFEST_NAME, PREPARE_LOCK
    from prepkit.fsutil import CRASH_AT_ENV

    src, work, args = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]

    def run(out, crash_at):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if crash_at:
                    os.environ[CRASH_AT_ENV] = str(crash_at)
                fd = os.open(os.devnull, os.O_WRONLY)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.argv = ["prepkit", "prepare", "--src", str(src), "--out", str(out), "-q", *args]
                main()
                code = 0
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def snapshot(out):
        # every file's bytes and link count (shared files are hard links); the lock holds a pid
        files = {}
        for path in sorted(out.rglob("*")):
            if path.is_file() and path.name != PREPARE_LOCK:
                st = path.lstat()
                files[str(path.relative_to(out))] = [hashlib.sha256(path.read_bytes()).hexdigest(), st.st_nlink]
        return files

    def state(out):
        names = {str(p.relative_to(out)) for p in out.rglob("*")} if out.exists() else set()
        return {
            "journal": JOURNAL_NAME in names,
            "manifest": MANIFEST_NAME in names,
            "finished": sum(n.endswith(".safetensors") for n in names),
            "temp": sum(".tmp-" in n for n in names),
        }

    clean = work / "clean"
    assert run(clean, 0) == 0
    print(json.dumps({"clean": snapshot(clean)}), flush=True)
    n = 0
    while True:
        n += 1
        out = work / f"killed-{n}"
        killed = run(out, n)
        if killed == 0:
            break  # step n is past the run's last one
        record = {"step": n, "killed": killed, "left": state(out)}
        record["rerun"] = run(out, 0)
        record["files"] = snapshot(out)
        record["temp_after"] = sorted(str(p) for p in out.rglob("*.tmp-*"))
        print(json.dumps(record), flush=True)
        shutil.rmtree(out)
    """
)


def _sweep(tmp_path: Path, src: Path, *args: str) -> tuple[dict[str, list], list[dict]]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(CRASH_AT_ENV, None)
    done = subprocess.run(
        [sys.executable, str(script), str(src), str(work), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return lines[0]["clean"], lines[1:]


@pytest.mark.slow
def test_prepare_killed_at_every_step_resumes_byte_identical(tmp_path: Path) -> None:
    src = write_synthetic_checkpoint(
        tmp_path / "src", num_layers=3, num_experts=4, hidden=256, intermediate=512, num_shards=2, seed=5
    )
    clean, kills = _sweep(tmp_path, src, "--tp", "2")
    assert MANIFEST_NAME in clean and len(clean) > 10
    # the sweep covers the whole run: before the journal, shared files, every layer, the manifest
    assert len(kills) >= 30
    assert all(k["killed"] == -signal.SIGKILL for k in kills)
    left = [k["left"] for k in kills]
    assert not left[0]["journal"] and left[-1]["manifest"]
    layer_files = {k["left"]["finished"] for k in kills if not k["left"]["manifest"]}
    assert {0, 1, 3, 5}.issubset(layer_files)  # nothing, the shared file, then each layer's 2 files
    assert any(k["left"]["temp"] for k in kills)
    for k in kills:
        step = k["step"]
        assert k["rerun"] == 0, f"step {step}: the rerun failed"
        assert k["files"] == clean, f"step {step}: output differs from an uninterrupted run"
        assert not k["temp_after"], f"step {step}: temp files left"
        assert JOURNAL_NAME not in k["files"]


def _start(src: Path, out: Path, delay: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), STEP_DELAY_ENV: delay}
    env.pop(CRASH_AT_ENV, None)
    cmd = [sys.executable, "-m", "prepkit", "prepare", "--src", str(src), "--tp", "2", "--out", str(out), "-q"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != PREPARE_LOCK
    }


def test_killed_1_5_s_after_start_resumes(ep_ckpt: Path, tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    assert (
        CliRunner().invoke(cli, ["prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(clean), "-q"]).exit_code
        == 0
    )
    out = tmp_path / "out"
    proc = _start(ep_ckpt, out, "0.05")
    time.sleep(1.5)
    assert proc.poll() is None, "the run ended before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / MANIFEST_NAME).exists()
    r = CliRunner().invoke(cli, ["prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert _files(out) == _files(clean)
    assert not list(out.rglob("*.tmp-*"))


def test_second_run_on_one_folder_is_refused_with_the_holders_pid(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    runs = [_start(ep_ckpt, out, "0.05")]
    try:
        time.sleep(0.3)
        runs.append(_start(ep_ckpt, out, "0.05"))
        deadline = time.monotonic() + 120
        while all(r.poll() is None for r in runs) and time.monotonic() < deadline:
            time.sleep(0.01)
        # usually the second is refused; on a loaded machine it may get the lock first
        refused = next(r for r in runs if r.poll() is not None)
        holder = runs[1 - runs.index(refused)]
        assert holder.poll() is None, "refused at once, while the other still runs"
        _, err = refused.communicate()
        assert refused.returncode == 3, err
        assert f"another prepkit prepare (pid {holder.pid}) is writing {out}" in err
        assert "Traceback" not in err
        _, err = holder.communicate(timeout=120)
        assert holder.returncode == 0, err
    finally:
        for r in runs:
            if r.poll() is None:
                r.kill()
                r.wait()
    r = CliRunner().invoke(cli, ["verify", str(out), "--src", str(ep_ckpt)])
    assert r.exit_code == 0, r.output
