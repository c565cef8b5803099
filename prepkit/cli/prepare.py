"""``prepkit prepare``: checkpoint experts -> engine-ready shards per TP/EP rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prepkit import console
from prepkit.cli._app import cli
from prepkit.cli._choices import DENSE_FORMATS, LAYOUT_NAMES, TRTLLM_VERSIONS
from prepkit.cli._options import json_option, model_option, quiet_option
from prepkit.constants import DEFAULT_DENSE_FORMAT
from prepkit.fsutil import format_bytes

if TYPE_CHECKING:
    from prepkit.prepare import PreparePlan

# Nothing here imports torch at module level (the layouts and recipes do): `prepare --help` and
# completion inside `prepare` stay fast.


def default_src(model: str) -> Path:
    """Where a fetched model lies: its snapshot in the Hugging Face cache."""
    from prepkit.fetch import default_model_dir
    from prepkit.recipes import load_recipe

    return Path(default_model_dir(load_recipe(model)))


@cli.command()
@model_option
@click.option(
    "--layout",
    "layout_name",
    default="trtllm-gen",
    show_default=True,
    type=click.Choice(LAYOUT_NAMES),
    help="Target engine layout.",
)
@click.option(
    "--tp", "tp_size", default=1, show_default=True, type=click.IntRange(min=1), help="MoE tensor-parallel size."
)
@click.option(
    "--ep",
    "ep_size",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Expert-parallel size (contiguous expert slices).",
)
@click.option(
    "--rank",
    "ranks",
    multiple=True,
    type=click.IntRange(min=0),
    help="Only these output ranks (rank = ep_rank*tp + tp_rank); repeatable. Default: all.",
)
@click.option(
    "--trtllm-version",
    default="main",
    show_default=True,
    type=click.Choice(TRTLLM_VERSIONS),
    help="TensorRT-LLM whose TP split to match: 'main' (logical TP slicing where it applies, "
    "PR #18870) or '1.2' (pad-before-shard everywhere). Only TP2 of gpt-oss differs.",
)
@click.option(
    "--dense",
    default=DEFAULT_DENSE_FORMAT,
    show_default=True,
    type=click.Choice(DENSE_FORMATS),
    help="How to store the dense weights (q/k/v/o projections, lm_head): 'bf16' as the checkpoint "
    "has them, or 'mxfp8' / 'mxfp4' (fewer bytes per token, a rounding error per weight). The MX "
    "formats need --layout triton-moe.",
)
@click.option(
    "--src",
    type=click.Path(path_type=Path, file_okay=False),
    help="Any gpt-oss checkpoint folder: a `prepkit fetch` or `hf download --local-dir` folder, or a "
    "Hugging Face cache snapshot. Default: --model's snapshot in the Hugging Face cache.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    help="Output folder. Default: ./prepared/<model>-<layout>-tp<N>[-ep<M>][-<dense>] (<model> is "
    "synthetic-<recipe>-<L>l-<E>e for a `prepkit synth` checkpoint).",
)
@click.option("--dry-run", is_flag=True, help="Print the plan (ranks, shapes, bytes, free disk) and stop.")
@json_option
@quiet_option
def prepare(
    model: str,
    layout_name: str,
    tp_size: int,
    ep_size: int,
    ranks: tuple[int, ...],
    trtllm_version: str,
    dense: str,
    src: Path | None,
    out: Path | None,
    dry_run: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Convert the MoE experts of a checkpoint into one shard set per TP/EP rank.

    Reads each layer once, writes every rank's file from it, and finishes with
    OUT/manifest.json (layout id, source hashes, per-rank sizes, sha256 of every
    file), and prints OUT. An interrupted run resumes, even after kill -9: rerun the
    same command.
    A second run on the same OUT is refused (exit 3) with the pid of the first.

    \b
    Example:
        prepkit prepare --model gpt-oss-120b --layout trtllm-gen --tp 4
        prepkit prepare --src ./synthetic --tp 8 --out ./shards --dry-run
        prepkit prepare --model gpt-oss-120b --layout triton-moe --dense mxfp4
    """
    from prepkit import prepare as preparing
    from prepkit.errors import OutputError
    from prepkit.layouts import LayoutOptions, get_layout
    from prepkit.recipes import load_recipe
    from prepkit.synth import checkpoint_label

    recipe = load_recipe(model)
    layout = get_layout(layout_name)
    src = src or default_src(model)
    suffix = f"-ep{ep_size}" if ep_size > 1 else ""
    suffix += f"-{dense}" if dense != DEFAULT_DENSE_FORMAT else ""
    label = checkpoint_label(src, recipe.name)  # a synthetic checkpoint is never named as the real model
    out = out or Path("prepared") / f"{label}-{layout.name}-tp{tp_size}{suffix}"
    plan = preparing.plan_prepare(
        recipe,
        src,
        layout,
        tp_size=tp_size,
        ep_size=ep_size,
        out_dir=out,
        options=LayoutOptions(trtllm_version=trtllm_version),
        ranks=list(ranks) if ranks else None,
        dense=dense,
    )
    # A dry run's plan is its result (stdout); before a run it is information (stderr).
    _show_plan(plan, label, console.result if dry_run and not as_json else console.info)
    if dry_run:
        if as_json:
            console.emit_json({"plan": plan.summary()})
        return
    # A resume needs room for the files it has left, not for the whole output again.
    if plan.bytes_left > plan.free_bytes:
        resumed = " more" if plan.finished else ""
        raise OutputError(
            f"{out} needs {format_bytes(plan.bytes_left)}{resumed} but only {format_bytes(plan.free_bytes)} is free",
            hint="free disk space or choose --out on another disk",
        )
    with console.progress(enabled=not quiet) as on_progress:
        result = preparing.prepare(plan, on_progress=on_progress)
    summary = result.summary()
    if as_json:
        console.emit_json(summary)
    else:
        console.info(
            f"{summary['files_written']} files written, {summary['files_skipped']} "
            f"already complete, {format_bytes(summary['bytes_written'])} in {summary['seconds']:.1f} s "
            f"({summary['source_gb_per_s']:.2f} GB/s of source)",
            label="done:",
            style="green",
        )
        # the folder, which `prepkit verify` takes: `prepkit verify "$(prepkit prepare ... -q)"`
        click.echo(str(result.out_dir))


def _show_plan(plan: PreparePlan, label: str, show: Callable[..., None]) -> None:
    from rich.table import Table
    from rich.text import Text

    s = plan.summary()
    d = s["dims"]
    show(
        f"{label} from {s['source']}: {d['num_layers']} layers, {d['num_experts']} experts, "
        f"H={d['hidden']}, I={d['intermediate']}  ->  {s['layout']} ({s['layout_id']}), "
        f"tp={s['tp_size']} ep={s['ep_size']} into {s['out']}"
    )
    table = Table(title=None, show_edge=False, header_style="bold")
    for col in ("rank", "experts", "I rows", "valid", "padded", "rule", "bytes"):
        table.add_column(col)
    for r in s["ranks"]:
        lo, hi = r["intermediate_rows"]
        table.add_row(
            str(r["rank"]),
            f"{r['experts'][0]}..{r['experts'][1] - 1}",
            Text(f"[{lo}, {hi})"),
            str(r["valid_intermediate"]),
            str(r["padded_intermediate"]),
            r["sharding_rule"],
            format_bytes(r["bytes"]),
        )
    show(table)
    shapes = ", ".join(f"{n} {v}" for n, v in s["ranks"][0]["tensors_per_layer"].items())
    show(f"per layer, rank {s['ranks'][0]['rank']}: {shapes}")
    show(
        f"to write: {format_bytes(s['bytes_to_write'])} (shared non-expert tensors {format_bytes(s['shared_bytes'])}, "
        f"written once), {format_bytes(s['bytes_left'])} of it still to write; free: {format_bytes(s['free_bytes'])}"
    )
    dense = s["dense"]
    what = "dense weights (q/k/v/o, lm_head)"
    if dense["layout_id"] is None:
        show(f"{what}: {dense['format']}, as in the checkpoint ({format_bytes(dense['bytes'])})")
    else:
        show(
            f"{what}: {dense['format']} ({dense['layout_id']}), "
            f"{format_bytes(dense['bytes'])} instead of {format_bytes(dense['bf16_bytes'])} in bf16: "
            f"{format_bytes(dense['bytes_saved'])} saved"
        )
    for w in s["warnings"]:
        console.warn(w)
