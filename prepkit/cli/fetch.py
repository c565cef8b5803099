"""``prepkit fetch``: download a gpt-oss checkpoint from the hub, verified, into the Hugging Face cache or a folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.table import Table
from rich.text import Text

from prepkit import console
from prepkit import fetch as fetching
from prepkit.cli._app import cli
from prepkit.cli._options import json_option, model_option, quiet_option
from prepkit.fsutil import format_bytes

_STATUS: dict[str, str | Text] = {
    "verified": Text("verified", style="green"),
    "unverified": "present, to verify",
    "cached": "in the cache, to link and verify",
    "wrong-size": Text("wrong size, to replace", style="yellow"),
    "missing": "to download",
    "forced": "to download again (--force-download)",
}


@cli.command("fetch")
@click.argument("repo_id", required=False, metavar="[REPO_ID]")
@model_option
@click.option("--revision", help="Branch, tag or commit sha. Default: the recipe's pinned commit (main for ORG/NAME).")
@click.option(
    "--include",
    multiple=True,
    metavar="GLOB",
    help="Fetch only files matching GLOB (repeatable), instead of the recipe's file list; as for `hf download`.",
)
@click.option("--exclude", multiple=True, metavar="GLOB", help="Skip files matching GLOB (repeatable).")
@click.option(
    "--local-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Put plain files in this folder (files already there, e.g. from `hf download --local-dir`, are "
    "hashed and kept when they match). Default: the Hugging Face cache.",
)
@click.option(
    "--cache-dir",
    envvar="HF_HUB_CACHE",
    type=click.Path(file_okay=False, path_type=Path),
    help="Hugging Face cache to use. Default: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub.",
)
@click.option("--include-original", is_flag=True, help="Also fetch original/ (a second copy in OpenAI's format).")
@click.option("--dry-run", is_flag=True, help="Show the plan and the disk check; download nothing.")
@click.option(
    "--offline", is_flag=True, help="No network: hash again a model a fetch completed before, against its record."
)
@click.option(
    "--force-download",
    is_flag=True,
    help="Download every file again, even those already present and verified (as for `hf download`).",
)
@click.option("--endpoint", envvar="HF_ENDPOINT", help="Hub URL. Default: $HF_ENDPOINT or the Hugging Face hub.")
@click.option("--token", help="Hub token for gated or private repos. Default: $HF_TOKEN, or the `hf auth login` one.")
@click.option(
    "--max-workers",
    type=click.IntRange(1, 16),
    default=4,
    show_default=True,
    help="Files downloaded at the same time.",
)
@json_option
@quiet_option
def fetch_command(
    repo_id: str | None,
    model: str,
    revision: str | None,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    local_dir: Path | None,
    cache_dir: Path | None,
    include_original: bool,
    dry_run: bool,
    offline: bool,
    force_download: bool,
    endpoint: str | None,
    token: str | None,
    max_workers: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Download the files `prepare` needs, check each against the hub's sha256, and record them.

    Files go to the Hugging Face cache, shared with `hf download` and transformers: a model
    already there is hashed and reused, not downloaded again. Never fetches metal/; fetches
    original/ only with --include-original. huggingface_hub moves the bytes; a rerun skips files
    already verified, and a failed or interrupted download leaves no partial file (one a kill -9
    leaves is removed by `hf cache prune`). Prints the model folder on stdout.

    REPO_ID (or --model) is a recipe name or hub id: openai/gpt-oss-120b and openai/gpt-oss-20b
    fetch the commit their recipe pins; any other ORG/NAME works too (at main, with the gpt-oss file
    set). Under HF_HUB_OFFLINE=1, as with --offline, the hub is never asked.

    \b
    Example:
        prepkit fetch openai/gpt-oss-120b --dry-run
        prepkit fetch gpt-oss-20b --local-dir ~/models/gpt-oss-20b --json
        prepkit fetch openai/gpt-oss-20b --revision main --include '*.json'
    """
    ctx = click.get_current_context()
    if repo_id is not None and ctx.get_parameter_source("model") is ParameterSource.COMMANDLINE and model != repo_id:
        raise click.UsageError(f"REPO_ID {repo_id!r} and --model {model!r} disagree: give one of them")
    if force_download and offline:
        raise click.UsageError("--force-download needs the hub; it cannot be combined with --offline")
    source = fetching.resolve_source(model if repo_id is None else repo_id, revision=revision)
    source = source.narrowed(include, exclude)
    plan = fetching.plan_fetch(
        source,
        local_dir,
        cache_dir=cache_dir,
        include_original=include_original,
        offline=offline,
        force=force_download,
        endpoint=endpoint,
        token=token,
    )
    # A dry run's plan is its result (stdout); before a download it is information (stderr).
    _show_plan(plan, console.result if dry_run and not as_json else console.info)
    if dry_run:
        if as_json:
            console.emit_json({"dry_run": True, **_plan_json(plan)})
        return
    # In a log, lines for the total only: one per file would be noise.
    with console.progress(enabled=not quiet, log_labels=(fetching.TOTAL_LABEL,)) as on_progress:
        result = fetching.fetch(plan, token=token, max_workers=max_workers, on_progress=on_progress)
    _show_result(result)
    if as_json:
        console.emit_json({"dry_run": False, **_result_json(result)})
    else:
        click.echo(str(result.plan.dest))


def _show_plan(plan: fetching.FetchPlan, show: Callable[..., None]) -> None:
    pinned = " (pinned by the recipe)" if plan.source.recipe and plan.commit == plan.source.revision else ""
    show(f"{plan.source.repo_id} @ {plan.commit}{pinned}")
    show(f"into {plan.dest}" + (" (offline)" if plan.offline else f" from {plan.endpoint}"))
    table = Table(box=None, pad_edge=False)
    table.add_column("file")
    table.add_column("size", justify="right")
    table.add_column("status")
    for f in plan.files:
        table.add_row(Text(f.path), format_bytes(f.remote.size), _STATUS.get(f.status, f.status))
    show(table)
    show(
        f"{len(plan.files)} files, {format_bytes(plan.total_bytes)}: {_count(plan, 'verified')} verified, "
        f"{_count(plan, 'unverified', 'cached')} to verify, {format_bytes(plan.download_bytes)} to download"
    )
    show(f"free disk: {format_bytes(plan.free_bytes)}")
    if not plan.fits:
        needed = f"{format_bytes(plan.need_bytes)} + {format_bytes(plan.margin_bytes)} margin"
        console.warn(f"not enough disk space: {needed} needed; the download would be refused")


def _show_result(result: fetching.FetchResult) -> None:
    parts = [f"{len(result.downloaded)} downloaded", f"{len(result.reused)} already verified"]
    if result.retried:
        names = ", ".join(result.retried)
        parts.append(f"{len(result.retried)} fetched twice after a hash mismatch: {names}")
    console.info(f"{'; '.join(parts)}.", label="Done:", style="green")
    console.info(f"record: {result.record.path}")


def _count(plan: fetching.FetchPlan, *statuses: str) -> int:
    return sum(1 for f in plan.files if f.status in statuses)


def _plan_json(plan: fetching.FetchPlan) -> dict[str, Any]:
    source = plan.source
    return {
        "repo_id": source.repo_id,
        "revision": source.revision,
        "commit": plan.commit,
        "recipe": source.recipe,
        "dir": str(plan.dest),
        "cache": str(plan.cache) if plan.cache else None,
        "endpoint": plan.endpoint,
        "offline": plan.offline,
        "include_original": plan.include_original,
        "force_download": plan.force,
        **{k: getattr(plan, k) for k in ("total_bytes", "download_bytes", "need_bytes", "free_bytes")},
        "fits": plan.fits,
        "files": [{"path": f.path, "size": f.remote.size, "status": f.status} for f in plan.files],
    }


def _result_json(result: fetching.FetchResult) -> dict[str, Any]:
    plan = result.plan
    sizes = {f.path: f.remote.size for f in plan.files}
    return {
        "repo_id": plan.source.repo_id,
        "revision": plan.source.revision,
        "commit": plan.commit,
        "dir": str(plan.dest),
        "record": str(result.record.path),
        "total_bytes": plan.total_bytes,
        "downloaded": list(result.downloaded),
        "downloaded_bytes": sum(sizes[p] for p in result.downloaded),
        "reused": list(result.reused),
        "retried": list(result.retried),
        "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in result.record.entries],
    }
