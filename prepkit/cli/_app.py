"""The click group, the one place where errors become messages and exit codes."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import click

from prepkit import __version__
from prepkit.errors import PrepkitError

EPILOG = """\b
Exit codes:
  0  success
  1  internal error (a bug: the traceback is shown)
  2  usage error
  3  bad input (recipe, checkpoint, layout, output folder, tactics DB)
  4  fetch failed (hub, network, download disk)
  5  device problem (no GPU, wrong compute capability)
  6  verification failed
  130 interrupted
"""


def _debug_enabled(ctx: click.Context | None) -> bool:
    if os.environ.get("PREPKIT_DEBUG") == "1":
        return True
    root = ctx.find_root() if ctx else None
    return bool(root and root.params.get("debug"))


class PrepkitGroup(click.Group):
    """Turns :class:`PrepkitError` into one red line, its hint, and the error's exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PrepkitError as err:
            if _debug_enabled(ctx):
                traceback.print_exc()
            from prepkit.console import err_console

            err_console.print(f"[bold red]Error:[/] {err}", soft_wrap=True)
            if err.hint:
                err_console.print(f"[dim]Hint:[/] {err.hint}", soft_wrap=True)
            if not _debug_enabled(ctx):
                err_console.print("[dim](run with --debug or PREPKIT_DEBUG=1 for the traceback)[/]")
            ctx.exit(err.exit_code)


@click.group(cls=PrepkitGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="prepkit")
@click.option("--debug", is_flag=True, help="Show tracebacks for expected errors too.")
def cli(debug: bool) -> None:
    """Prepare gpt-oss MXFP4 MoE weights for NVIDIA inference engines, offline.

    \b
    Typical flow:
      prepkit fetch --model gpt-oss-120b
      prepkit prepare --model gpt-oss-120b --layout trtllm-gen --tp 4
      prepkit verify OUT --src SRC
    """


def main() -> None:
    try:
        # standalone_mode=False returns the exit code of ctx.exit() instead of raising it
        rv = cli.main(standalone_mode=False, prog_name="prepkit")
        if isinstance(rv, int):
            sys.exit(rv)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
