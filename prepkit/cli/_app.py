"""The click group, the one place where errors become messages and exit codes."""

from __future__ import annotations

import errno
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import click

from prepkit import __version__, exit_codes
from prepkit.cli._options import quiet_parameter
from prepkit.errors import PathError, PrepkitError

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
        "Measure prefill and decode tok/s of a prepared folder, llama-bench style.",
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

# Commands that pick up where a stopped run left off when rerun: what Ctrl-C tells the user.
RESUMABLE = frozenset({"fetch", "prepare", "tune"})
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as shells report a Ctrl-C


def interrupted_message(command: str | None) -> str:
    return "interrupted: rerun the same command to resume" if command in RESUMABLE else "interrupted"


class QuietGroup(click.Group):
    """A group whose every command accepts ``-q`` (its one meaning: :data:`_options.QUIET_HELP`),
    whether or not the command declares it; nested groups are of this class too."""

    # a subgroup is of the same class (the root's subgroups: see PrepkitGroup)
    group_class: type[click.Group] | type[type] | None = type

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        declared = any(p.name == "quiet" or "-q" in getattr(p, "opts", ()) for p in cmd.params)
        if not isinstance(cmd, click.Group) and not declared:
            cmd.params.append(quiet_parameter())
        super().add_command(cmd, name)


def _silence_stdout() -> None:
    from prepkit.console import silence_stdout

    silence_stdout()


def _wants_json(argv: Sequence[str]) -> bool:
    return "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv


def _usage_error_json(err: click.UsageError) -> None:
    from prepkit import console

    if not console.json_emitted():
        console.emit_json(
            {"error": {"type": type(err).__name__, "message": err.format_message(), "hint": None,
                       "exit_code": err.exit_code}}
        )  # fmt: skip


class PrepkitGroup(QuietGroup):
    """Loads commands on first use, and turns :class:`PrepkitError` into one red line, its hint,
    and the error's exit code; usage errors under ``--json`` into a JSON error too; Ctrl-C into
    :data:`INTERRUPTED_EXIT`; a closed stdout into a quiet exit 0."""

    group_class = QuietGroup  # `tactics`: a plain group of commands, each with -q

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

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["prepkit.argv"] = list(args)  # --json is known before the command parses its options
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        from prepkit import console

        console.set_quiet(False)  # until the command's -q / --json say otherwise
        console.set_json(False)
        try:
            return super().invoke(ctx)
        except PrepkitError as err:
            self._fail(ctx, err)
        except OSError as err:
            if err.errno == errno.EPIPE:  # stdout closed by its reader (`| head -1`): nothing left to say
                _silence_stdout()
                ctx.exit(0)
            if err.errno != errno.ENAMETOOLONG:
                raise
            self._fail(ctx, PathError.name_too_long(err.filename))
        except click.UsageError as err:
            if _wants_json(ctx.meta.get("prepkit.argv", [])):
                try:
                    _usage_error_json(err)
                except BrokenPipeError:
                    _silence_stdout()
            raise
        except KeyboardInterrupt:
            click.echo("", err=True)  # past the terminal's ^C
            click.echo(interrupted_message(ctx.invoked_subcommand), err=True)
            ctx.exit(INTERRUPTED_EXIT)

    def _fail(self, ctx: click.Context, err: PrepkitError) -> None:
        from prepkit import console

        if _debug_enabled(ctx):
            traceback.print_exc()
        if console.json_requested():
            # --json: the error is a result too, so a script reading stdout sees what failed
            try:
                console.emit_json(
                    {"error": {"type": type(err).__name__, "message": str(err), "hint": err.hint,
                               "exit_code": err.exit_code}}
                )  # fmt: skip
            except BrokenPipeError:
                _silence_stdout()
        # an expected error is explained by its message: no traceback to offer
        console.error(str(err), err.hint, debug_note=False)
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
    if sys.stdout is None:  # started with stdout closed (`prepkit ... >&-`): results go nowhere, quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (open for the life of the process)
    try:
        # standalone_mode=False returns the exit code of ctx.exit() instead of raising it
        rv = cli.main(standalone_mode=False, prog_name="prepkit")
        if isinstance(rv, int):
            sys.exit(rv)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        if isinstance(exc, click.UsageError) and _wants_json(sys.argv[1:]):
            _usage_error_json(exc)  # an error in the group's own options (the command's are answered above)
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo(interrupted_message(None), err=True)
        sys.exit(INTERRUPTED_EXIT)
    except BrokenPipeError:
        _silence_stdout()
        sys.exit(0)
