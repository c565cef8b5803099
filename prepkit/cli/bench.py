"""``prepkit bench``: llama-bench's pp/tg figures for a prepared folder, against the floor."""

from __future__ import annotations

from pathlib import Path

import click

from prepkit import console
from prepkit.cli._app import cli
from prepkit.cli._options import json_option, quiet_option
from prepkit.cli._run_options import as_ranks, other_rank, prepared_argument, run_options
from prepkit.fsutil import write_atomic


def _lengths(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of whole numbers") from None
    if any(n < 1 or n > 1 << 20 for n in lengths):
        raise click.BadParameter(f"{value!r}: each value must be in 1..{1 << 20}")
    return lengths


@cli.command()
@prepared_argument
@click.option(
    "--pp",
    "prompt_lengths",
    default="512,2048",
    show_default=True,
    callback=_lengths,
    help="Prompt lengths to prefill (ppN), comma-separated; empty for none.",
)
@click.option(
    "--tg",
    "gen_lengths",
    default="32,128",
    show_default=True,
    callback=_lengths,
    help="Token counts to decode (tgN), comma-separated.",
)
@click.option(
    "--batch",
    "batches",
    default="1",
    show_default=True,
    callback=_lengths,
    help="Decode batch sizes, comma-separated (e.g. 1,4,16).",
)
@click.option(
    "--repetitions",
    "-r",
    type=click.IntRange(1, 100),
    default=5,
    show_default=True,
    help="Runs per figure; the median and spread are reported.",
)
@click.option(
    "--sampled/--no-sampled",
    default=True,
    show_default=True,
    help="Also decode with the folder's sampling defaults (tgN sampled rows).",
)
@click.option(
    "--layers",
    default="",
    callback=_lengths,
    help="Run only the first N decoder layers. Two counts (e.g. 4,2) run both and fit the per-layer "
    "cost, the fixed part and each kernel's share of a layer, scaled to the full model: figures for a "
    "model this GPU cannot hold.",
)
@click.option(
    "--scale-to",
    type=click.IntRange(min=1),
    help="Layers the two-count fit scales to.  [default: the recipe's depth, e.g. 36 for gpt-oss-120b]",
)
@click.option(
    "--out",
    "out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Also write the JSON report to this file (to send in).",
)
@run_options
@json_option
@quiet_option
def bench(
    prepared: Path,
    prompt_lengths: tuple[int, ...],
    gen_lengths: tuple[int, ...],
    batches: tuple[int, ...],
    repetitions: int,
    sampled: bool,
    layers: tuple[int, ...],
    scale_to: int | None,
    out: Path | None,
    activations: str,
    device: str,
    step: str | None,
    nproc: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Measure prefill and decode tok/s of a prepared folder, llama-bench style.

    ppN: a prompt of N tokens in one prefill (tok/s). tgN: N tokens decoded
    one graph-replayed step at a time after a one-token prompt (tok/s over the
    batch). Each figure is the median of -r runs with its spread. The copy
    bandwidth is measured in the same run, so each tg figure also reads as a
    percentage of this device's floor (weights read per token / bandwidth).
    Load, compile and capture are timed apart. The report names the device,
    versions, tactics used and whether MX ran natively on the tensor cores:
    send the --json (or --out FILE) output in with your numbers.

    \b
    Example:
        prepkit bench prepared/gpt-oss-120b-triton-moe-tp1
        prepkit bench FOLDER --pp 512,2048 --tg 32,128 --batch 1,4,16 --out bench.json
        prepkit bench FOLDER --pp '' --tg 128 --no-sampled --layers 4,2
    """
    code = as_ranks(nproc)
    if code is not None:
        click.get_current_context().exit(code)
    from prepkit.generation.bench import BenchRequest, markdown, run_bench

    request = BenchRequest(
        folder=prepared, prompt_lengths=prompt_lengths, gen_lengths=gen_lengths, batches=batches or (1,),
        repetitions=repetitions, sampled=sampled, activations=activations, device=device, layers=layers,
        scale_to=scale_to, step=step,  # type: ignore[arg-type]
    )  # fmt: skip
    with console.progress(enabled=not (quiet or other_rank()), transient=True, unit="count") as on_progress:
        report = run_bench(request, on_progress)
    if out is not None and not other_rank():  # every rank holds the report; one writes it, whole
        write_atomic(out, [console.json_text(report).encode()])
    if as_json:
        console.emit_json(report)
    else:
        console.result(markdown(report))
        console.info(
            f"load {report['load_s']:.1f} s, warm-up (compile, capture) {report['warmup_s']:.1f} s, "
            f"peak memory {report['peak_memory_gib'] or 0:.1f} GiB",
            label="bench:",
        )
