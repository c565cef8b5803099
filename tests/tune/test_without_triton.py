"""``tune --compile-only`` where triton cannot be imported: prepkit's DependencyError naming the
extra that installs it, never a ModuleNotFoundError traceback. Needs no triton itself."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.distribution import install_hint
from prepkit.errors import DependencyError


def test_compile_only_without_triton_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now fails as if not installed
    args = ["tune", "--compile-only", "--arch", "sm90", "--model", "gpt-oss-120b", "--tp", "1"]
    result = CliRunner().invoke(cli, [*args, "--tokens", "1", "--sample", "0"])
    assert result.exit_code == DependencyError.exit_code, result.output
    assert "needs triton" in result.stderr and install_hint("gpu") in result.stderr
    assert "Traceback" not in result.stderr and "ModuleNotFoundError" not in result.stderr
