"""``prepkit fetch``: download a gpt-oss checkpoint from the hub, verified, into a local folder."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from prepkit import console
from prepkit import fetch as fetching
from prepkit.cli._app import cli
from prepkit.cli._options import json_option, model_option, quiet_option
from prepkit.fsutil import format_bytes

_STATUS = {
    "verified": "[green]verified[/]",
    "unverified": "present, to verify",
    "wrong-size": "[yellow]wrong size, to replace[/]",
    "missing": "to download",
}


@cli.command("fetch")
@model_option
@click.option("--revision", help="Branch, tag or commit sha. Default: the recipe's pinned commit (main for ORG/NAME).")
@click.option(
    "--dir",
    "dest",
    type=click.Path(file_okay=False, path_type=Path),
    help="Target folder. Default: $PREPKIT_HOME/models/<org>--<name>/<revision>.",
)
@click.option("--include-original", is_flag=True, help="Also fetch original/ (a second copy in OpenAI's format).")
@click.option("--dry-run", is_flag=True, help="Show the plan and the disk check; download nothing.")
@click.option("--offline", is_flag=True, help="No network: verify a folder fetched before and record it.")
@click.option("--endpoint", envvar="HF_ENDPOINT", help="Hub URL. Default: $HF_ENDPOINT or the Hugging Face hub.")
@click.option(
    "--workers", type=click.IntRange(1, 16), default=4, show_default=True, help="Files downloaded at the same time."
)
@json_option
@quiet_option
def fetch_command(
    model: str,
    revision: str | None,
    dest: Path | None,
    include_original: bool,
    dry_run: bool,
    offline: bool,
    endpoint: str | None,
    workers: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Download the files `prepare` needs, check each against the hub's sha256, and record them.

    Never fetches metal/; fetches original/ only with --include-original. A rerun skips files
    already verified and removes partial files of an interrupted run. Set HF_TOKEN for gated
    or private repos.

    Any ORG/NAME on the hub works too (at main, with the gpt-oss file set).

    \b
    Example:
        prepkit fetch --model gpt-oss-120b --dry-run
        prepkit fetch --model gpt-oss-20b --dir ~/models/gpt-oss-20b --json
    """
    source = fetching.resolve_source(model, revision=revision)
    target = dest or fetching.model_dir_for(source.repo_id, source.revision)
    plan = fetching.plan_fetch(source, target, include_original=include_original, offline=offline, endpoint=endpoint)
    _show_plan(plan)
    if dry_run:
        if as_json:
            console.emit_json({"dry_run": True, **plan.to_json()})
        return
    # Bars only on a terminal: in a log, a final frame of one bar per file is noise.
    with console.progress(enabled=not quiet and console.err_console.is_terminal) as on_progress:
        result = fetching.fetch(plan, max_workers=workers, on_progress=on_progress)
    _show_result(result)
    if as_json:
        console.emit_json({"dry_run": False, **result.to_json()})
    else:
        click.echo(str(result.plan.dest))


def _show_plan(plan: fetching.FetchPlan) -> None:
    pinned = " (pinned by the recipe)" if plan.source.recipe and plan.commit == plan.source.revision else ""
    console.info(f"[bold]{plan.source.repo_id}[/] @ {plan.commit}{pinned}")
    console.info(f"into {plan.dest}" + (" (offline)" if plan.offline else f" from {plan.endpoint}"))
    table = Table(box=None, pad_edge=False)
    table.add_column("file")
    table.add_column("size", justify="right")
    table.add_column("status")
    for f in plan.files:
        table.add_row(f.path, format_bytes(f.remote.size), _STATUS.get(f.status, f.status))
    console.err_console.print(table)
    console.info(
        f"{len(plan.files)} files, {format_bytes(plan.total_bytes)}: {plan.count('verified')} verified, "
        f"{plan.count('unverified')} to verify, {format_bytes(plan.download_bytes)} to download"
    )
    orphans = f" + {format_bytes(plan.orphan_bytes)} of partial files to remove" if plan.orphan_bytes else ""
    console.info(f"free disk: {format_bytes(plan.free_bytes)}{orphans}")
    if not plan.fits:
        needed = f"{format_bytes(plan.need_bytes)} + {format_bytes(plan.margin_bytes)} margin"
        console.warn(f"not enough disk space: {needed} needed; the download would be refused")


def _show_result(result: fetching.FetchResult) -> None:
    parts = [f"{len(result.downloaded)} downloaded", f"{len(result.reused)} already verified"]
    if result.retried:
        names = ", ".join(result.retried)
        parts.append(f"{len(result.retried)} fetched twice after a sha256 mismatch: {names}")
    if result.orphans_removed:
        parts.append(f"{result.orphans_removed} partial file(s) of an interrupted run removed")
    console.info(f"[green]Done:[/] {'; '.join(parts)}.")
    console.info(f"record: {result.record.path}")
