"""``prepkit synth``: a synthetic gpt-oss MXFP4 checkpoint in the hub's exact format."""

from __future__ import annotations

from pathlib import Path

import click

from prepkit import console
from prepkit.cli._app import cli
from prepkit.cli._options import json_option, out_option, quiet_option


@cli.command()
@out_option("Folder to write the checkpoint into (new, or empty).")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--experts", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--hidden", default=2880, show_default=True, type=click.IntRange(min=32))
@click.option("--intermediate", default=2880, show_default=True, type=click.IntRange(min=32))
@click.option("--top-k", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--vocab", default=1024, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--num-shards",
    "num_shards",
    type=click.IntRange(min=1),
    help="Number of shard files (default: split at 4.8 GB like the hub's).",
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--tokenizer",
    is_flag=True,
    help="Also write a small word-level tokenizer with a chat template (tokenizer.json, tokenizer_config.json) "
    "whose ids fill --vocab; needs the tokenizers library (the transformers extra brings it).",
)
@json_option
@quiet_option
def synth(
    out: Path,
    layers: int,
    experts: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    vocab: int,
    num_shards: int | None,
    seed: int,
    tokenizer: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Write a random gpt-oss MXFP4 checkpoint (config, index, shards) for tests and demos.

    Real per-expert dims by default (H = I = 2880), so padding and TP splits are the
    real ones; few layers and experts keep it small. Deterministic for a seed.

    \b
    Example:
        prepkit synth --out ./synthetic --layers 2 --experts 4 --num-shards 3
        prepkit synth --out ./tiny --hidden 256 --intermediate 512 --tokenizer
    """
    from prepkit.errors import RecipeError
    from prepkit.synth import write_synthetic_checkpoint

    if hidden % 32 or intermediate % 32:
        raise RecipeError(f"--hidden {hidden} and --intermediate {intermediate} must be multiples of 32 (MXFP4 blocks)")
    if top_k > experts:
        raise RecipeError(f"--top-k {top_k} exceeds --experts {experts}")
    if out.exists() and any(out.iterdir()):
        raise RecipeError(f"{out} is not empty", hint="choose a new folder")
    if tokenizer:
        from prepkit.synth_tokenizer import check_can_write

        check_can_write(vocab)  # before any byte is written
    with console.progress(enabled=not quiet, transient=True) as on_progress:
        path = write_synthetic_checkpoint(
            out,
            num_layers=layers,
            num_experts=experts,
            hidden=hidden,
            intermediate=intermediate,
            top_k=top_k,
            vocab_size=vocab,
            num_shards=num_shards,
            seed=seed,
            on_progress=on_progress,
            tokenizer=tokenizer,
        )
    if as_json:
        console.emit_json({"out": str(path), "files": sorted(p.name for p in path.iterdir())})
    else:
        click.echo(str(path))
