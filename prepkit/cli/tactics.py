"""``prepkit tactics show | export | merge | plot``: read, share and combine tactic DBs."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from prepkit import console
from prepkit.cli._app import cli
from prepkit.cli._options import db_option, json_option, out_option, quiet_option
from prepkit.distribution import install_hint
from prepkit.errors import DependencyError, TacticsError
from prepkit.tactics.keys import DENSE_ROLE

_db_option = db_option("Tactics DB (default: the user DB, else the bundled one).")


@contextlib.contextmanager
def _stdout_result() -> Iterator[None]:
    """Where a tactics command writes its result. A reader that stopped early (``show | head -1``)
    or a closed stdout has all it asked for: the command ends quietly, exit 0."""
    if sys.stdout is None or sys.stdout.closed:
        raise click.exceptions.Exit(0)
    try:
        yield
        sys.stdout.flush()
    except SystemExit as exc:
        # rich answers a broken pipe by pointing stdout at /dev/null and exiting 1; here only the
        # result is printed, so that exit is the reader having gone.
        if exc.code != 1:
            raise
        raise click.exceptions.Exit(0) from None
    except (BrokenPipeError, ValueError) as err:
        if isinstance(err, ValueError) and not sys.stdout.closed:
            raise  # not a closed stdout: a bug to see
        _silence_stdout()
        raise click.exceptions.Exit(0) from None
    except OSError as err:
        if err.errno not in (errno.EPIPE, errno.EBADF):
            raise
        _silence_stdout()
        raise click.exceptions.Exit(0) from None


def _silence_stdout() -> None:
    # Python flushes stdout once more at exit; pointed at /dev/null that flush cannot fail.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


@cli.group("tactics")
def tactics_group() -> None:
    """Inspect, export, merge and plot tactic databases (tactics.db)."""


@tactics_group.command("show")
@_db_option
@click.option("--gpu", help="Only GPUs whose name holds this text, any case (e.g. H100).")
@click.option("--arch", help="Only this architecture (e.g. sm90, sm120).")
@click.option(
    "--problem",
    help="Only this GEMM: a role (gemm1, gemm2, dense), or the start of a problem hash (4+ hex digits).",
)
@json_option
@quiet_option
def show_command(
    db_path: Path | None, gpu: str | None, arch: str | None, problem: str | None, as_json: bool, quiet: bool
) -> None:
    """List the winner ranges per GPU and problem, with row counts and the search that found them
    (pruned: the default sweep; thorough: `prepkit tune --thorough`). --gpu, --arch and
    --problem narrow the list (counts stay the whole DB's); each says on stderr when it matches
    nothing, with what the DB holds.

    \b
    Examples:
        prepkit tactics show --db tactics.db
        prepkit tactics show --gpu H100 --problem gemm1
    """
    from prepkit.tactics import store
    from prepkit.tactics.paths import db_to_read

    matches = _winner_filter(gpu, arch, problem)
    path = db_to_read(db_path)
    with store.open_db_readonly(path) as tdb:
        counts, every = tdb.counts(), tdb.winners()
    winners = [w for w in every if matches(w)]
    if every and not winners:
        _say_what_the_db_holds(every)
    tactics = _decoded_tactics(winners)
    from prepkit.env import installed_kernel_version

    served = installed_kernel_version()
    if as_json:
        rows = [
            {**{k: v for k, v in w.items() if k != "params_json"}, "tactic": tactics[w["params_json"]]} for w in winners
        ]
        with _stdout_result():
            console.emit_json({"db": str(path), "counts": counts, "kernel_version_served": served, "winners": rows})
        return
    with _stdout_result():
        _print_winners(path, counts, winners, tactics, served)


def _print_winners(
    path: Path, counts: dict[str, int], winners: list[dict[str, Any]], tactics: dict[str, Any], served: str | None
) -> None:
    from rich.table import Table

    from prepkit.tune.report import short_tactic, winner_groups

    console.result(f"{path}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    versions = sorted({str(w["kernel_version"]) for w in winners})
    if len(versions) > 1:
        console.result(
            f"kernel versions {', '.join('v' + v for v in versions)}: this install serves "
            + (
                f"v{served}; the other rows only seed `prepkit tune`"
                if served
                else "none (the kernel cannot be imported)"
            )
        )
    for rows in winner_groups(winners):
        w0 = rows[0]
        acts = "" if w0["act_dtype"] in (None, "bf16") else f" act={w0['act_dtype']}"
        t = Table(
            title=f"{w0['gpu_name']} ({w0['arch']}, Triton {w0['triton_version']}): {_problem_title(w0, acts)}, "
            f"{w0['kernel']} v{w0['kernel_version']} {w0['weight_layout']}"
            + (" (served here)" if str(w0["kernel_version"]) == served else "")
            + f", {'/'.join(dict.fromkeys(w['search'] for w in rows))} search",
            title_justify="left",
        )
        # Numbers never wrap or shorten; on a narrow screen the tactic column wraps instead.
        t.add_column("tokens", justify="right", no_wrap=True, min_width=9)
        t.add_column("tactic", overflow="fold", ratio=1)
        t.add_column("us", justify="right", no_wrap=True, min_width=7)
        t.add_column("vs default", justify="right", no_wrap=True, min_width=10)
        for w in rows:
            hi = "up" if w["extends_up"] else str(w["m_hi"])
            sp = w["speedup_vs_default"]
            t.add_row(
                f"{w['m_lo']}-{hi}", short_tactic(w["params_json"]) if tactics[w["params_json"]] else "(damaged)",
                _number(w["median_us"], "{:.1f}"), _number(sp, "{:.2f}x"),
            )  # fmt: skip
        console.result(t)


_HASH_PREFIX = re.compile(r"[0-9a-f]{4,32}")
_ROLES = ("gemm1", "gemm2", DENSE_ROLE)


def _winner_filter(gpu: str | None, arch: str | None, problem: str | None) -> Any:
    """The test a winner row must pass to be shown.

    Raises:
        click.BadParameter: an --arch or --problem that can match no row of any DB.
    """
    if arch is not None and not re.fullmatch(r"sm\d+", arch):
        raise click.BadParameter(f"{arch!r} is no architecture name; expected sm90, sm120, ...", param_hint="--arch")
    if problem is not None and problem not in _ROLES and not _HASH_PREFIX.fullmatch(problem):
        raise click.BadParameter(
            f"{problem!r}: expected one of {', '.join(_ROLES)}, or 4+ hex digits of a problem hash",
            param_hint="--problem",
        )

    def matches(w: dict[str, Any]) -> bool:
        if gpu is not None and gpu.lower() not in str(w["gpu_name"]).lower():
            return False
        if arch is not None and w["arch"] != arch:
            return False
        if problem in _ROLES:
            return bool(w["role"] == problem)
        return problem is None or str(w["problem_hash"]).startswith(problem)

    return matches


def _say_what_the_db_holds(winners: list[dict[str, Any]]) -> None:
    gpus = sorted({f"{w['gpu_name']} ({w['arch']})" for w in winners})
    roles = sorted({str(w["role"]) for w in winners})
    console.info(f"no winner range matches; the DB holds {', '.join(gpus)}, problems of {', '.join(roles)}")


def _problem_title(w: dict[str, Any], acts: str) -> str:
    """``gemm1 N=5760 K=2880 E=128 top_k=4 tp=1``, or for a dense linear ``dense mxfp4 N=5120 K=2880``
    (``acts``: the activation policy's note, empty for bf16)."""
    from prepkit.tactics.keys import DENSE_ROLE, DENSE_W_DTYPES

    if w["role"] == DENSE_ROLE:
        fmt = {v: f for f, v in DENSE_W_DTYPES.items()}.get(w.get("w_dtype") or "", w.get("w_dtype"))
        return f"dense {fmt} N={w['n']} K={w['k']}{acts}"
    return f"{w['role']} N={w['n']} K={w['k']} E={w['num_experts']} top_k={w['top_k']}{acts} tp={w['tp_size']}"


def _decoded_tactics(winners: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """Each winner's tactic as an object; one that is no valid tactic (a DB damaged by another
    tool) is ``None``, with a warning naming its row."""
    from prepkit.tactics.validate import tactic_problem

    out: dict[str, dict[str, Any] | None] = {}
    for w in winners:
        pj = w["params_json"]
        if pj in out:
            continue
        why = tactic_problem(pj)
        out[pj] = None if why else json.loads(pj)
        if why:
            console.warn(f"tactic row {w['tactic_hash']!r} (M {w['m_lo']}-{w['m_hi']}): params_json {why}")
    return out


def _number(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, int | float) and not isinstance(value, bool) and value else "-"


@tactics_group.command("export")
@_db_option
@quiet_option
def export_command(db_path: Path | None, quiet: bool) -> None:
    """Write the whole DB as JSON on stdout (for review, or to share measurements). A reader that
    stops early (`| head`) or a closed stdout ends it quietly, exit 0.

    \b
    Example:
        prepkit tactics export --db ~/.cache/prepkit/tactics.db > my-gpu.json
    """
    from prepkit.tactics import store
    from prepkit.tactics.paths import db_to_read

    with store.open_db_readonly(db_to_read(db_path)) as tdb:
        doc = tdb.export(on_damaged=lambda row: console.warn(f"{row}; exported as text"))
    with _stdout_result():
        console.emit_json(doc)


@tactics_group.command("merge")
@click.argument("paths", nargs=-1, required=True, metavar="SRC", type=click.Path(path_type=Path, dir_okay=False))
@db_option(
    "DB to merge into, created if missing (default: the user DB, $PREPKIT_TACTICS_DB or ~/.cache/prepkit/tactics.db)."
)
@json_option
@quiet_option
def merge_command(paths: tuple[Path, ...], db_path: Path | None, as_json: bool, quiet: bool) -> None:
    """Merge the rows of SRC into the DB named by --db; SRC is only read.

    SRC is a tactics DB or the JSON `prepkit tactics export` wrote (what users send back).
    Measurements, checks and blocklist entries are unions; for each GPU and problem the winner
    ranges of the newer run win as a whole (a run the DB already holds keeps the DB's dates).
    SRC is checked whole first and refused, naming the row, if a date is no ISO timestamp or lies
    ahead, a tactic's hash does not match its params, or a timing is negative or infinite. It then
    says what it added per table and how many winner ranges of the DB it replaced.

    \b
    Example:
        prepkit tactics merge gpu1.db
        prepkit tactics merge gpu1.db --db team.db
        prepkit tactics merge my-gpu.json --db team.db
    """
    from prepkit.tactics import store
    from prepkit.tactics.paths import user_db_path

    # `merge DEST SRC`, the spelling before --db, still works for one release.
    if len(paths) == 2 and db_path is None:
        dest, src = paths
    elif len(paths) == 1:
        dest, src = db_path or user_db_path(), paths[0]
    else:
        raise click.UsageError("give one SRC DB to merge (and the DB to merge into with --db)")
    if not src.is_file():
        raise click.BadParameter(f"{src} does not exist", param_hint="SRC")
    summary = store.merge_into(dest, src)
    with _stdout_result():
        if as_json:
            console.emit_json({"db": str(dest), "added": summary.added, "replaced": {"winner": summary.replaced}})
            return
        console.info(f"merged {src} into {dest}: {summary.describe()}")
        click.echo(str(dest))


@tactics_group.command("plot")
@out_option("Image to write (its suffix picks the format: .png, .svg, .pdf).", file=True)
@_db_option
@click.option("--gpu", help="Only this GPU name (default: every GPU in the DB).")
@quiet_option
def plot_command(out: Path, db_path: Path | None, gpu: str | None, quiet: bool) -> None:
    """Plot latency per token count, tuned vs default, against the memory-bandwidth floor.

    \b
    Example:
        prepkit tactics plot --out tactics.png --db tactics.db
    """
    from prepkit.tactics import store
    from prepkit.tactics.paths import db_to_read
    from prepkit.tune import report

    if importlib.util.find_spec("matplotlib") is None:
        raise DependencyError("plotting needs matplotlib, which is not installed", hint=install_hint("plot"))
    with store.open_db_readonly(db_to_read(db_path)) as tdb:
        panels = report.plot_panels(tdb, gpu)
    if not panels:
        raise TacticsError(
            "nothing to plot: no winners with measurements" + (f" for GPU {gpu!r}" if gpu else ""),
            hint="run `prepkit tune` first, or check `prepkit tactics show`",
        )
    report.plot(panels, out)
    with _stdout_result():
        click.echo(str(out))
