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


class RenamedOption(click.Option):
    """An option whose old spellings still work but are not shown in ``--help``: pass them as
    ``old_names`` (kept for one release after a rename, so scripts do not break at once)."""

    def __init__(self, *args: Any, old_names: tuple[str, ...] = (), **kwargs: Any) -> None:
        decls = list(args[0]) if args else list(kwargs.pop("param_decls"))
        super().__init__([*decls, *old_names], *args[1:], **kwargs)
        self.old_names = old_names

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        shown = [o for o in self.opts if o not in self.old_names]
        opts, self.opts = self.opts, shown
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = opts


class OldPositional(click.Argument):
    """A positional argument kept for one release after it became an option: accepted, but left
    out of the usage line so that ``--help`` teaches only the new spelling."""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return []


def out_option(help: str, *, file: bool = False) -> Callable[[F], F]:
    """``--out``: the one spelling of where a command writes its result."""
    kind = click.Path(path_type=Path, dir_okay=not file, file_okay=file)
    return click.option("--out", "out", type=kind, help=help)


def pick_out(out: Path | None, old: Path | None) -> Path:
    """``--out``, or the positional spelling it replaced; refuses neither or two different ones."""
    if out is not None and old is not None and out != old:
        raise click.UsageError(f"two output locations given: --out {out} and {old}")
    chosen = out or old
    if chosen is None:
        raise click.UsageError("Missing option '--out'.")
    return chosen
