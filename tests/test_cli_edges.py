"""The CLI's edges a new user hits: -q everywhere, usage errors as JSON, Ctrl-C, the --debug note,
a closed or broken stdout, names too long, the folder prepare prints, env's report, ETA lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from prepkit import console
from prepkit.cli import cli
from prepkit.cli._app import COMMANDS, INTERRUPTED_EXIT, RESUMABLE
from prepkit.errors import PathError

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, **env: str):
    return CliRunner(env=env or None).invoke(cli, list(args))


def _prepkit(*args: str, shell_tail: str = "", timeout: int = 120) -> subprocess.CompletedProcess[str]:
    """The real entry point in a fresh process, optionally piped or redirected through bash."""
    cmd = " ".join([f"'{sys.executable}'", "-m", "prepkit", *(f"'{a}'" for a in args)]) + shell_tail
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=timeout,
    )


def _leaf_commands() -> list[tuple[str, click.Command]]:
    ctx = click.Context(cli)
    out = []
    for name in sorted(COMMANDS):
        cmd = cli.get_command(ctx, name)
        assert cmd is not None, name
        if isinstance(cmd, click.Group):
            out += [(f"{name} {sub}", cmd.get_command(ctx, sub)) for sub in cmd.list_commands(ctx)]
        else:
            out.append((name, cmd))
    return out


# ------------------------------------------------------------------------------------- -q


def test_every_command_accepts_q() -> None:
    leaves = _leaf_commands()
    assert {"env", "prepare", "tactics show", "tactics merge"} <= {name for name, _ in leaves}
    missing = [name for name, cmd in leaves if not any("-q" in p.opts for p in cmd.params)]
    assert not missing, f"commands without -q: {missing}"


def test_q_on_a_command_that_does_not_declare_it_is_accepted() -> None:
    from prepkit.tactics.lookup import bundled_db_path

    r = run("tactics", "export", "--db", str(bundled_db_path()), "-q")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) and r.stderr == ""
    r = run("env", "-q", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["versions"]["prepkit"]


# ------------------------------------------------------------------------ usage errors as JSON


@pytest.mark.parametrize(
    ("args", "kind"),
    [
        (["prepare", "--json", "--tp", "0"], "BadParameter"),
        (["prepare", "--tp", "0", "--json"], "BadParameter"),
        (["tactics", "show", "--json", "--no-such-option"], "NoSuchOption"),
        (["prepare", "--json", "--layout", "nope"], "BadParameter"),
    ],
)
def test_usage_errors_print_one_json_error_under_json(args: list[str], kind: str) -> None:
    r = run(*args)
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["error"]["type"] == kind and doc["error"]["exit_code"] == 2 and doc["error"]["message"]
    assert "Usage:" in r.stderr  # the human form stays on stderr


def test_usage_errors_without_json_leave_stdout_empty() -> None:
    r = run("prepare", "--tp", "0")
    assert r.exit_code == 2 and r.stdout == ""


def test_a_usage_error_of_the_group_itself_is_json_too() -> None:
    done = _prepkit("--no-such-flag", "--json")
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"]["type"] == "NoSuchOption"


# ----------------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_a_resumable_command_says_how_to_resume(ep_ckpt: Path, tmp_path: Path, monkeypatch) -> None:
    from prepkit import prepare

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "prepare", interrupted)
    r = run("prepare", "--src", str(ep_ckpt), "--out", str(tmp_path / "o"), "-q")
    assert r.exit_code == INTERRUPTED_EXIT == 130
    assert "interrupted: rerun the same command to resume" in r.stderr
    assert "Aborted" not in r.stderr and "prepare" in RESUMABLE


def test_ctrl_c_elsewhere_says_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    from prepkit import env

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(env, "report", interrupted)
    r = run("env")
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines()[-1] == "interrupted"


# --------------------------------------------------------------------------------- --debug


def test_an_expected_error_offers_no_traceback(tmp_path: Path) -> None:
    r = run("verify", str(tmp_path / "nowhere"))
    assert r.exit_code == 3 and "Error:" in r.stderr
    assert "--debug" not in r.stderr and "PREPKIT_DEBUG" not in r.stderr
    r = run("--debug", "verify", str(tmp_path / "nowhere"))
    assert r.exit_code == 3 and "Traceback" in r.stderr


# --------------------------------------------------------------------- closed or broken stdout


def test_a_reader_that_leaves_early_ends_the_command_with_0() -> None:
    # tactics show --json of the bundled DB is far larger than a pipe's buffer
    done = _prepkit("tactics", "show", "--json", shell_tail=" | head -c 1")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "{" and "Traceback" not in done.stderr and done.stderr == ""
    done = _prepkit("tactics", "show", shell_tail=" | head -n 1")
    assert done.returncode == 0 and "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [("env", "--json"), ("tactics", "export"), ("tactics", "show")])
def test_a_closed_stdout_ends_the_command_quietly(args: tuple[str, ...]) -> None:
    done = _prepkit(*args, shell_tail=" >&-")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


def test_an_error_under_json_with_a_closed_stdout_keeps_its_code(tmp_path: Path) -> None:
    done = _prepkit("verify", str(tmp_path / "nowhere"), "--json", shell_tail=" >&-")
    assert done.returncode == 3 and "Traceback" not in done.stderr and "no such folder" in done.stderr


# --------------------------------------------------------------------------- names too long


def test_an_out_with_a_name_too_long_is_one_error_naming_it(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / ("x" * 300)
    r = run("prepare", "--src", str(ep_ckpt), "--out", str(out))
    assert r.exit_code == PathError.exit_code == 3, r.output
    assert str(out) in r.stderr and "too long" in r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_a_tactics_db_with_a_name_too_long_is_one_error_naming_it(tmp_path: Path) -> None:
    db = str(tmp_path / ("y" * 300 + ".db"))
    for args in (("tactics", "show"), ("env",)):
        r = run(*args, PREPKIT_TACTICS_DB=db)
        assert r.exception is None or isinstance(r.exception, SystemExit), args
        if r.exit_code != 0:
            assert r.exit_code == 3 and db in r.stderr and "too long" in r.stderr, (args, r.output)


# ------------------------------------------------------------------------------ prepare's stdout


def test_prepare_prints_the_folder_verify_takes(ep_ckpt: Path, tmp_path: Path) -> None:
    r = run("prepare", "--src", str(ep_ckpt), "--out", str(tmp_path / "o"), "-q")
    assert r.exit_code == 0, r.output
    folder = r.stdout.strip()
    assert folder == str(tmp_path / "o")
    assert run("verify", folder, "-q").exit_code == 0


# ----------------------------------------------------------------------------------------- env


def test_env_reports_python_os_driver_and_the_hub_library() -> None:
    r = run("env", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    versions = doc["versions"]
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert {"huggingface_hub", "driver", "cuda", "torch", "triton"} <= set(versions)
    assert versions["huggingface_hub"]  # a dependency: always installed
    assert doc["os"] and "triton_vs_bundled" in doc
    text = run("env").stdout
    assert "python: " in text and "os: " in text and "huggingface_hub: " in text and "driver: " in text


def test_env_reads_the_nvidia_driver_from_the_kernel_module(tmp_path: Path) -> None:
    from prepkit.env import driver_version

    version_file = tmp_path / "version"
    version_file.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U22)\n"
        "GCC version:  gcc version 12.3.0\n"
    )
    assert driver_version(version_file) == "580.95.05"
    assert driver_version(tmp_path / "absent") is None


def test_env_flags_a_triton_other_than_the_bundled_rows_were_measured_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prepkit import env
    from prepkit.tactics.lookup import bundled_db_path

    bundled = bundled_db_path()
    assert bundled is not None
    measured = env.measured_triton(bundled)
    assert measured and all(v.count(".") == 1 for v in measured)  # major.minor, as the rows were measured
    same = f"{measured[0]}.1"
    assert env.triton_check(same, measured)["differs"] is False
    assert env.triton_check("99.0.0", measured)["differs"] is True
    assert env.triton_check(None, measured)["differs"] is False  # no triton: nothing to compare

    monkeypatch.setattr(env, "_version", lambda package: "99.0.0" if package == "triton" else "1.0")
    r = run("env")
    assert r.exit_code == 0, r.output
    assert "triton 99.0.0" in r.stderr and "measured with" in r.stderr
    doc = json.loads(run("env", "--json").stdout)
    assert doc["triton_vs_bundled"] == {"installed": "99.0.0", "bundled_rows_measured_with": measured, "differs": True}


# ---------------------------------------------------------------------------------- ETA lines


def test_plain_byte_progress_lines_say_the_time_left(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = [0.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv(console.PROGRESS_INTERVAL_ENV, "10")
    with console.progress() as on_progress:
        on_progress("source", 0, 100 * 1024**2)
        clock[0] = 10.0
        on_progress("source", 20 * 1024**2, 100 * 1024**2)  # 2 MiB/s: 80 MiB left is 40 s
    assert capsys.readouterr().err.splitlines() == [
        "source: 20.0 MiB / 100.0 MiB (20%), 2.0 MiB/s, 10 s elapsed, about 40 s left"
    ]
