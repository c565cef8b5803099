"""``prepare``'s choices are spelled statically so that its ``--help`` and shell completion never
import torch; they must stay equal to the registries they mirror."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prepkit.cli import _choices

ROOT = Path(__file__).resolve().parents[1]


def test_static_choices_equal_the_registries() -> None:
    from prepkit.layouts import LAYOUTS
    from prepkit.layouts.dense_mx import DENSE_FORMATS
    from prepkit.layouts.trtllm_gen import TRTLLM_VERSIONS

    assert sorted(_choices.LAYOUT_NAMES) == sorted(LAYOUTS)
    assert sorted(_choices.DENSE_FORMATS) == sorted(DENSE_FORMATS)
    assert sorted(_choices.TRTLLM_VERSIONS) == sorted(TRTLLM_VERSIONS)


# Runs the CLI in a fresh interpreter and says which heavy modules it loaded.
PROBE = """
import sys
from prepkit.cli import cli
try:
    cli.main(sys.argv[1:], prog_name="prepkit", standalone_mode=False)
except SystemExit:
    pass
print("LOADED", sorted(m for m in ("torch", "triton", "numpy", "safetensors") if m in sys.modules))
"""


def _loaded(args: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=120,
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("LOADED")]
    assert line, done.stdout + done.stderr
    return line[-1]


def test_prepare_help_imports_no_torch() -> None:
    assert _loaded(["prepare", "--help"]) == "LOADED []"


def test_completion_inside_prepare_imports_no_torch() -> None:
    env = {"_PREPKIT_COMPLETE": "bash_complete", "COMP_WORDS": "prepkit prepare --layout ", "COMP_CWORD": "3"}
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from prepkit.cli import main; main()"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert [line.split(",")[1] for line in done.stdout.splitlines()] == sorted(_choices.LAYOUT_NAMES)
    assert _loaded([], env) == "LOADED []"
