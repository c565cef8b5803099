"""The click group, the one place where errors become messages and exit codes."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

import click

from prepkit import __version__, exit_codes
from prepkit.errors import PrepkitError

EPILOG = exit_codes.epilog()


def _debug_enabled(ctx: click.Context | None) -> bool:
    if os.environ.get("PREPKIT_DEBUG") == "1":
        return True
    root = ctx.find_root() if ctx else None
    return bool(root and root.params.get("debug"))


# Each command lives in its own module, imported only when the command runs (or its own --help
# is asked for): ``prepkit --help`` and shell completion then load neither torch nor triton.
# The one-line help is written here too; a test checks it against the command's docstring.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "prepkit.cli.bench",
        "Measure prefill and decode tok/s of a prepared folder on this GPU, llama-bench style, against its floor.",
    ),
    "env": (
        "prepkit.cli.env",
        "Print versions, the GPU, the tactics DBs found and native MX support, for bug reports.",
    ),
    "fetch": (
        "prepkit.cli.fetch",
        "Download the files `prepare` needs, check each against the hub's sha256, and record them.",
    ),
    "generate": ("prepkit.cli.generate", "Generate text from a prepared folder, streaming it to stdout."),
    "prepare": ("prepkit.cli.prepare", "Convert the MoE experts of a checkpoint into one shard set per TP/EP rank."),
    "synth": (
        "prepkit.cli.synth",
        "Write a random gpt-oss MXFP4 checkpoint (config, index, shards) for tests and demos.",
    ),
    "tactics": ("prepkit.cli.tactics", "Inspect, export, merge and plot tactic databases (tactics.db)."),
    "tune": (
        "prepkit.cli.tune",
        "Measure every pruned kernel variant on this GPU and store the fastest per token range.",
    ),
    "verify": ("prepkit.cli.verify", "Check a prepared shard set."),
}


class PrepkitGroup(click.Group):
    """Loads commands on first use, and turns :class:`PrepkitError` into one red line, its hint,
    and the error's exit code."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            importlib.import_module(COMMANDS[cmd_name][0])  # registers the command on this group
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem

        names = [n for n in sorted(COMMANDS) if n.startswith(incomplete)]
        return [CompletionItem(n, help=COMMANDS[n][1]) for n in names]

    def invoke(self, ctx: click.Context) -> Any:
        from prepkit import console

        console.set_quiet(False)  # until the command's -q / --json say otherwise
        console.set_json(False)
        try:
            return super().invoke(ctx)
        except PrepkitError as err:
            if _debug_enabled(ctx):
                traceback.print_exc()
            if console.json_requested():
                # --json: the error is a result too, so a script reading stdout sees what failed
                console.emit_json(
                    {"error": {"type": type(err).__name__, "message": str(err), "hint": err.hint,
                               "exit_code": err.exit_code}}
                )  # fmt: skip
            console.error(str(err), err.hint, debug_note=not _debug_enabled(ctx))
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
