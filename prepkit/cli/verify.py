"""``prepkit verify``: hashes against the manifest; with --src, inverse layout against the source."""

from __future__ import annotations

from pathlib import Path

import click

from prepkit import console
from prepkit.cli._app import cli
from prepkit.cli._options import json_option, quiet_option


@cli.command()
@click.argument("out", type=click.Path(path_type=Path, file_okay=False))
@click.option(
    "--src",
    type=click.Path(path_type=Path, file_okay=False),
    help="Source checkpoint folder: invert the layout and compare every expert with it.",
)
@click.option(
    "--src-from-cache",
    is_flag=True,
    help="As --src, with the source the manifest names (repo and commit) from the Hugging Face cache: no path to type.",
)
@click.option("--sample", type=click.IntRange(min=1), help="With --src: check K random experts per rank and layer.")
@click.option("--seed", default=0, show_default=True, help="Seed for --sample.")
@json_option
@quiet_option
def verify(
    out: Path, src: Path | None, src_from_cache: bool, sample: int | None, seed: int, as_json: bool, quiet: bool
) -> None:
    """Check a prepared shard set.

    Always: every file exists with the size and sha256 the manifest records.
    With --src DIR (or --src-from-cache, for the snapshot of the repo and
    commit the manifest records, in the Hugging Face cache): every (or
    --sample K) expert is inverted through the layout (un-swizzle, un-shuffle,
    un-pad, re-interleave) and compared byte for byte with the source;
    non-expert tensors are compared too. Exit code 6 names rank, layer, expert
    and tensor of each mismatch.

    \b
    Example:
        prepkit verify prepared/gpt-oss-120b-trtllm-gen-tp4 --src-from-cache --sample 4
        prepkit verify prepared/gpt-oss-120b-trtllm-gen-tp4 --src ~/models/gpt-oss-120b
    """
    from prepkit.verify import verify as run_verify

    if src is not None and src_from_cache:
        raise click.UsageError("--src DIR and --src-from-cache both name the source: give one of them")
    with console.progress(enabled=not quiet, transient=True) as on_progress:
        report = run_verify(
            out, src=src, src_from_cache=src_from_cache, sample=sample, seed=seed, on_progress=on_progress
        )
    if as_json:
        console.emit_json(report.summary())
    else:
        console.result(
            f"{report.files_checked} files match the manifest"
            + (
                f", {report.experts_checked} experts and {report.shared_tensors_checked} shared tensors "
                "match the source"
                if src or src_from_cache
                else ""
            ),
            label="ok:",
            style="green",
        )
