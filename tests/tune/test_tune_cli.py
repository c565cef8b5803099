"""``prepkit tune``'s own options: the --tokens bound, the former --dense spelling, the help text."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.tactics.validate import MAX_TUNED_TOKENS
from prepkit.tune.candidates import parse_tokens


def invoke(*args: str):
    return CliRunner().invoke(cli, ["tune", *args])


@pytest.mark.parametrize("spec", [str(MAX_TUNED_TOKENS + 1), f"1-{10**15}", f"8,{MAX_TUNED_TOKENS * 4}"])
def test_a_token_count_beyond_the_db_is_a_usage_error_exit_3(spec: str) -> None:
    r = invoke("--arch", "sm121", "--compile-only", "--tokens", spec)
    assert r.exit_code == 3, r.output
    assert f"token counts up to {MAX_TUNED_TOKENS}" in r.output
    assert "compile check" not in r.output  # never reached the kernels


def test_the_largest_token_count_is_accepted() -> None:
    assert parse_tokens(f"1,{MAX_TUNED_TOKENS}") == (1, MAX_TUNED_TOKENS)


def test_the_former_dense_spelling_still_works_with_a_warning() -> None:
    # Refused for the same reason as with the new spelling: mxfp4 activations cannot take mxfp8 weights.
    old = invoke("--arch", "sm121", "--compile-only", "--activations", "mxfp4", "--dense", "mxfp8")
    new = invoke("--arch", "sm121", "--compile-only", "--activations", "mxfp4", "--dense-formats", "mxfp8")
    assert old.exit_code == new.exit_code == 3
    assert "--dense is deprecated" in old.output and "--dense-formats" in old.output
    assert "--dense is deprecated" not in new.output
    both = invoke("--arch", "sm121", "--compile-only", "--dense", "none", "--dense-formats", "none")
    assert both.exit_code == 2 and "pass one" in both.output


def test_help_points_only_at_what_ships() -> None:
    r = invoke("--help")
    assert r.exit_code == 0
    assert "benchmarks/" not in r.output
    assert "--dense-formats" in r.output
    assert "--dense " not in r.output.replace("--dense-formats", "")  # the old spelling is hidden


def test_tune_command_takes_at_most_14_parameters() -> None:
    import inspect

    from prepkit.cli.tune import tune_command

    assert len(inspect.signature(tune_command.callback.__wrapped__).parameters) <= 14  # type: ignore[union-attr]
