"""Options shared by several commands, defined once so they are spelled the same everywhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

F = Callable[..., Any]


def model_option(f: F) -> F:
    return click.option(
        "--model",
        "model",
        default="gpt-oss-120b",
        show_default=True,
        help="Recipe name (gpt-oss-120b, gpt-oss-20b), hub id, or path to a recipe JSON.",
    )(f)


def _tell_console(setter: str) -> Callable[[click.Context, click.Parameter, bool], bool]:
    def callback(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        from prepkit import console

        getattr(console, setter)(value)
        return value

    return callback


def json_option(f: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        callback=_tell_console("set_json"),
        help="Print a JSON summary on stdout (on failure, a JSON error object).",
    )(f)


# The one meaning of -q in every command.
QUIET_HELP = "No progress and no info lines on stderr; results on stdout, warnings and errors still print."


def quiet_option(f: F) -> F:
    return click.option("--quiet", "-q", is_flag=True, callback=_tell_console("set_quiet"), help=QUIET_HELP)(f)


def quiet_parameter() -> click.Option:
    """``-q`` for a command that does not declare it (it then reaches the console only): the group
    adds it to every command, so each accepts -q."""
    return click.Option(
        ["--quiet", "-q"], is_flag=True, expose_value=False, callback=_tell_console("set_quiet"), help=QUIET_HELP
    )


def out_option(help: str, *, file: bool = False) -> Callable[[F], F]:
    """``--out``: the one spelling of where a command writes its result."""
    kind = click.Path(path_type=Path, dir_okay=not file, file_okay=file)
    return click.option("--out", "out", type=kind, required=True, help=help)


def db_option(help: str) -> Callable[[F], F]:
    """``--db``: the one spelling of the tactics DB a command reads or writes."""
    return click.option("--db", "db_path", type=click.Path(path_type=Path, dir_okay=False), help=help)
