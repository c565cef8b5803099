"""Output a script can trust: text never read as markup, results on stdout and diagnostics on
stderr, one meaning of -q, JSON errors, and exit codes generated from the error classes."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit import console, exit_codes
from prepkit.cli import cli
from prepkit.distribution import install_hint
from prepkit.errors import DependencyError, PrepkitError, TacticsError

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


# --------------------------------------------------------------------------- 10: no markup


def test_messages_with_brackets_print_whole(capsys: pytest.CaptureFixture[str]) -> None:
    console.set_quiet(False)
    console.info("pip install 'prepkit-gpt-oss[plot]' for shards/[0-9]*.safetensors")
    console.warn("tensor model.layers[3].mlp [bold] stays")
    console.error("needs prepkit[plot]", hint="pip install 'prepkit-gpt-oss[plot]'")
    console.result("[green]not a style[/]")
    out, err = capsys.readouterr()
    assert "pip install 'prepkit-gpt-oss[plot]' for shards/[0-9]*.safetensors" in err
    assert "model.layers[3].mlp [bold] stays" in err
    assert "Error: needs prepkit[plot]" in err and "Hint: pip install 'prepkit-gpt-oss[plot]'" in err
    assert out == "[green]not a style[/]\n"


def test_an_error_hint_with_brackets_reaches_the_terminal_whole(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from prepkit.cli._app import cli, main\n"
        "from prepkit.errors import TacticsError\n"
        "@cli.command('boom')\n"
        "def boom():\n"
        "    raise TacticsError('bad [x] row', hint=\"pip install 'prepkit-gpt-oss[plot]'\")\n"
        "sys.argv = ['prepkit', 'boom']\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 3
    assert "bad [x] row" in out.stderr and "pip install 'prepkit-gpt-oss[plot]'" in out.stderr


# -------------------------------------------------------------- 11: stdout, stderr, -q, JSON


def test_a_dry_run_plan_is_read_from_stdout(ep_ckpt: Path, tmp_path: Path) -> None:
    r = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(tmp_path / "o"), "--dry-run")
    assert r.exit_code == 0, r.output
    assert "to write:" in r.stdout and "rank" in r.stdout and "[0, 256)" in r.stdout
    assert "to write:" not in r.stderr
    # the same plan before a real run is information: stderr, and -q drops it
    r = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(tmp_path / "o"), "-q")
    assert r.exit_code == 0, r.output
    assert "to write:" not in r.stdout and r.stderr == ""
    assert r.stdout.strip() == str(tmp_path / "o")  # the folder: `verify "$(prepkit prepare ... -q)"`
    r = run("verify", r.stdout.strip(), "-q")
    assert r.exit_code == 0 and r.stdout.startswith("ok: ") and r.stderr == ""


def test_quiet_means_the_same_in_every_command() -> None:
    from prepkit.cli._options import QUIET_HELP

    for name in ("fetch", "prepare", "synth", "tune", "verify"):
        r = run(name, "--help")
        assert r.exit_code == 0
        text = " ".join(r.stdout.split())
        assert " ".join(QUIET_HELP.split()) in text, name


def test_verify_json_prints_an_error_object_on_failure(tmp_path: Path) -> None:
    r = run("verify", str(tmp_path / "nowhere"), "--json")
    assert r.exit_code == 3
    doc = json.loads(r.stdout)
    assert doc["error"]["exit_code"] == 3 and "nowhere" in doc["error"]["message"]
    assert doc["error"]["type"] == "OutputError"


def test_json_outputs_hold_objects_not_json_strings(tmp_path: Path) -> None:
    from tests.tactics.test_db import fill

    db = tmp_path / "t.db"
    fill(db)
    shown = json.loads(run("tactics", "show", "--json", "--db", str(db)).stdout)
    assert all(isinstance(w["tactic"], dict) and "params_json" not in w for w in shown["winners"])
    exported = json.loads(run("tactics", "export", "--db", str(db)).stdout)
    assert isinstance(exported["tables"]["tactic"][0]["params_json"], dict)
    assert isinstance(exported["tables"]["tuning_run"][0]["token_points"], list)

    def strings_that_are_json(node: object) -> list[str]:
        if isinstance(node, dict):
            return [s for v in node.values() for s in strings_that_are_json(v)]
        if isinstance(node, list):
            return [s for v in node for s in strings_that_are_json(v)]
        if isinstance(node, str) and node[:1] in ("[", "{"):
            return [node]
        return []

    assert strings_that_are_json(shown) == [] and strings_that_are_json(exported) == []


def test_every_json_output_uses_the_one_style() -> None:
    """One writer of JSON for every command: no other json.dumps with an indent under prepkit/cli."""
    for path in (ROOT / "prepkit" / "cli").glob("*.py"):
        assert not re.search(r"json\.dumps\(.*indent", path.read_text()), path


# ------------------------------------------------------------------------- 13: exit codes


def test_readme_and_help_hold_the_exit_codes_of_the_error_classes() -> None:
    readme = (ROOT / "README.md").read_text()
    assert exit_codes.markdown_table() in readme
    help_text = run("--help").stdout
    for code, meaning in exit_codes.table():
        assert re.search(rf"^\s+{code}\s+{re.escape(meaning)}$", help_text, re.M), (code, help_text)
    for cls in (TacticsError, *PrepkitError.__subclasses__()):
        assert (cls.exit_code, cls.exit_meaning.partition(": ")[0]) in [
            (c, m.partition(": ")[0]) for c, m in exit_codes.table()
        ]


def test_a_new_error_class_joins_the_table_by_itself() -> None:
    class DiskQuotaError(PrepkitError):
        exit_code = 7
        exit_meaning = "quota exceeded: the user's disk quota"

    class DeeperTacticsError(TacticsError):
        pass

    try:
        rows = dict(exit_codes.table())
        assert rows[7] == "quota exceeded: the user's disk quota"
        assert rows[3].count("tactics DB") == 1  # a subclass with its parent's meaning adds nothing
    finally:
        del DiskQuotaError, DeeperTacticsError
        import gc

        gc.collect()


def test_plot_without_matplotlib_is_a_dependency_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    r = run("tactics", "plot", "--out", str(tmp_path / "x.png"))
    assert r.exit_code == DependencyError.exit_code and install_hint("plot") in r.output, r.output


def test_verify_of_a_missing_folder_is_bad_input(tmp_path: Path) -> None:
    r = run("verify", str(tmp_path / "nowhere"))
    assert r.exit_code == 3 and "no such folder" in r.stderr


def test_prepare_under_a_file_does_not_ask_to_free_disk_space(ep_ckpt: Path, tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(blocker / "out"), "-q")
    assert r.exit_code == 3 and "free disk space" not in r.stderr and "Not a directory" in r.stderr, r.stderr

    from prepkit.prepare import run as prepare_run

    def full(path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare_run, "make_dirs", full)
    out = tmp_path / "full"
    r = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    assert r.exit_code == 3 and f"writing {out} failed" in r.stderr and "free disk space" in r.stderr, r.stderr


# --------------------------------------------------------------------------- 12: progress in logs

_PROGRESS_LINE = re.compile(r"^(source|rank \d+|hashes|experts): .*\(\d+%\).*elapsed$", re.M)


def test_progress_goes_to_a_log_as_plain_lines(ep_ckpt: Path, tmp_path: Path) -> None:
    # CliRunner's stderr is not a terminal, as under nohup, CI or ssh | tee: rich draws no bars
    out = tmp_path / "out"
    prepare = ["prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out)]
    every_update = {console.PROGRESS_INTERVAL_ENV: "0"}
    r = CliRunner().invoke(cli, prepare, env=every_update)
    assert r.exit_code == 0, r.stderr
    lines = _PROGRESS_LINE.findall(r.stderr)
    assert {"source", "rank 0", "rank 1"} <= set(lines)
    assert re.search(r"^source: (\S+ \S+) / \1 \(100%\)", r.stderr, re.M)  # the last update, whole
    assert not _PROGRESS_LINE.search(r.stdout)  # still diagnostics: never on stdout
    r = CliRunner().invoke(cli, ["verify", str(out), "--src", str(ep_ckpt)], env=every_update)
    assert r.exit_code == 0, r.stderr
    assert {"hashes", "experts"} <= set(_PROGRESS_LINE.findall(r.stderr))
    # -q silences them; a steady pace means none before the first interval has passed
    r = CliRunner().invoke(cli, ["verify", str(out), "-q"], env=every_update)
    assert r.exit_code == 0 and not _PROGRESS_LINE.search(r.stderr)
    r = CliRunner().invoke(cli, ["verify", str(out)], env={console.PROGRESS_INTERVAL_ENV: "3600"})
    assert r.exit_code == 0 and not _PROGRESS_LINE.search(r.stderr)


def test_progress_lines_keep_a_steady_pace(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clock = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv(console.PROGRESS_INTERVAL_ENV, "10")
    with console.progress() as on_progress:
        for second in range(1, 36):  # an update every second for 35 s
            clock[0] = 100.0 + second
            on_progress("source", second * 1024**2, 35 * 1024**2)
    err = capsys.readouterr().err
    # each line estimates the time left at the rate seen so far (1 MiB/s)
    assert err.splitlines() == [
        f"source: {mib}.0 MiB / 35.0 MiB ({100 * mib // 35}%), 1.0 MiB/s, {mib} s elapsed, about {35 - mib} s left"
        for mib in (10, 20, 30)
    ]


def test_a_long_result_line_reaches_a_pipe_whole(capsys) -> None:
    from prepkit import console

    line = "ok: " + " ".join(f"file-{i}.safetensors" for i in range(12))  # far past 80 columns
    console.result(line)
    assert capsys.readouterr().out == line + "\n"
