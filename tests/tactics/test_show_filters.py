"""``tactics show --gpu/--arch/--problem``, ``-q`` on every ``tactics`` command, and tactics output
into a reader that stopped early or a closed stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prepkit.tactics.lookup import bundled_db_path
from tests.tactics.test_db import fill
from tests.tactics.test_hostile import invoke

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = bundled_db_path()
pytestmark = pytest.mark.skipif(BUNDLED is None, reason="no bundled tactics.db in this checkout")


def shown(*args: str) -> tuple[list[dict[str, Any]], Any]:
    r = invoke("tactics", "show", "--json", "--db", str(BUNDLED), *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["winners"], r


def test_filters_narrow_the_winners_and_keep_the_counts() -> None:
    every, _ = shown()
    gpus = {w["gpu_name"] for w in every}
    assert len(gpus) > 1 and len({w["role"] for w in every}) > 1
    gpu = sorted(gpus)[0]
    word = gpu.split()[1].lower()  # "h100": any case, part of the name
    by_gpu, r = shown("--gpu", word)
    assert by_gpu and len(by_gpu) < len(every) and all(word in w["gpu_name"].lower() for w in by_gpu)
    assert json.loads(r.stdout)["counts"]["winner"] == len(every)
    by_arch, _ = shown("--arch", every[0]["arch"])
    assert by_arch == [w for w in every if w["arch"] == every[0]["arch"]]
    gemm1, _ = shown("--problem", "gemm1")
    assert gemm1 and all(w["role"] == "gemm1" for w in gemm1)
    one = every[-1]["problem_hash"]
    by_hash, _ = shown("--problem", one[:8], "--gpu", word)
    assert by_hash == [w for w in every if w["problem_hash"] == one and word in w["gpu_name"].lower()]
    r = invoke("tactics", "show", "--db", str(BUNDLED), "--gpu", word, "--problem", "gemm2")
    assert r.exit_code == 0 and gpu in r.stdout and "gemm2 N=" in r.stdout and "gemm1 N=" not in r.stdout


def test_a_filter_that_matches_nothing_says_what_the_db_holds() -> None:
    none, r = shown("--gpu", "B200")
    assert none == [] and "no winner range matches" in r.stderr and "sm90" in r.stderr
    _, quiet = shown("--gpu", "B200", "-q")
    assert quiet.stderr == ""


@pytest.mark.parametrize(("option", "value"), [("--arch", "90"), ("--problem", "gemm3"), ("--problem", "ab")])
def test_a_filter_that_can_match_no_db_is_a_usage_error(option: str, value: str) -> None:
    r = invoke("tactics", "show", "--db", str(BUNDLED), option, value)
    assert r.exit_code == 2 and option in r.output, r.output


def test_every_tactics_command_takes_q(tmp_path: Path) -> None:
    src = tmp_path / "src.db"
    fill(src)
    dest = tmp_path / "dest.db"
    r = invoke("tactics", "merge", str(src), "--db", str(dest), "-q")
    assert r.exit_code == 0 and r.stdout.strip() == str(dest) and r.stderr == "", r.output
    for args in (("show", "-q"), ("export", "-q")):
        r = invoke("tactics", *args, "--db", str(dest))
        assert r.exit_code == 0 and r.stderr == "", r.output
    r = invoke("tactics", "plot", "--help")
    assert "--quiet" in r.output and "-q" in r.output


def _prepkit(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "prepkit", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


@pytest.mark.parametrize("args", [("show",), ("show", "--json"), ("export",)], ids=["show", "show-json", "export"])
def test_a_reader_that_stops_early_ends_the_command_quietly(args: tuple[str, ...]) -> None:
    """``prepkit tactics show | head -1``: the reader has what it wanted; exit 0, nothing on stderr."""
    proc = _prepkit("tactics", *args, "--db", str(BUNDLED))
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


@pytest.mark.parametrize("args", [("show",), ("show", "--json"), ("export",)], ids=["show", "show-json", "export"])
def test_a_closed_stdout_ends_the_command_quietly(args: tuple[str, ...]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = " ".join([sys.executable, "-m", "prepkit", "tactics", *args, "--db", str(BUNDLED), ">&-"])
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
