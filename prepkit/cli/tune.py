"""``prepkit tune``: sweep the bundled kernel's variants on this GPU into a tactics DB."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from prepkit import console
from prepkit.cli._app import cli
from prepkit.cli._options import db_option, json_option, quiet_option
from prepkit.mx_formats import ACTIVATION_POLICIES, ActivationPolicy
from prepkit.tune.dense import DENSE_CHOICES

ARCHES = ("auto", "sm121", "sm120", "sm100", "sm90")
_DENSE_OLD = "prepkit.tune.dense_old"  # where the former --dense spelling leaves its value (ctx.meta)


@dataclass(frozen=True)
class MeasureFlags:
    """The options of a measuring run, as the command line gave them (``None``: not given)."""

    db_path: Path | None
    budget_minutes: float | None
    gpus: str | None
    max_candidates: int
    check_workers: int | None
    keep: int
    thorough: bool


@dataclass(frozen=True)
class ProblemFlags:
    """Which problems a run takes up, as the command line gave them."""

    dense_formats: str | None
    moe: bool
    decode: bool


def _grouped(cls: type, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Pass the options named by ``cls``' fields to the command as one ``cls`` called ``name``."""
    names = [f.name for f in dataclasses.fields(cls)]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            kwargs[name] = cls(**{n: kwargs.pop(n) for n in names})
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def _deprecated_dense(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        console.warn("--dense is deprecated for tune (prepare --dense names a format): use --dense-formats")
        ctx.meta[_DENSE_OLD] = value


def _parse_gpus(spec: str | None) -> tuple[int, ...]:
    if not spec:
        return ()
    try:
        return tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        raise click.BadParameter(f"{spec!r}: expected GPU indexes like 0,1", param_hint="--gpus") from None


@cli.command("tune")
@click.option(
    "--arch",
    type=click.Choice(ARCHES),
    default="auto",
    show_default=True,
    help="Architecture to tune; refused when the GPU is another one. With --compile-only: the target "
    "to compile for (sm90, sm120 or sm121).",
)
@click.option("--model", help="Recipe whose MoE dims to tune (default gpt-oss-120b).")
@click.option(
    "--shards",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    help="A prepared triton-moe shard set: tune its dims and TP split.",
)
@click.option("--tp", type=click.IntRange(1, 64), help="Tensor-parallel size (rank 0's share is tuned).")
@click.option(
    "--activations",
    type=click.Choice(ACTIVATION_POLICIES),
    default="bf16",
    show_default=True,
    help="Activation precision the layer runs with (a policy, never a tactic: each is tuned on its own).",
)
@click.option(
    "--dense-formats",
    type=click.Choice(DENSE_CHOICES),
    default=None,
    help="Dense MX linears to tune besides the MoE layer (fused qkv, o, lm_head) in these weight formats.  "
    "[default: all with --model; with --shards the format its manifest records, none for bf16; "
    "none with --compile-only]",
)
@click.option(
    "--dense",
    type=click.Choice(DENSE_CHOICES),
    default=None,
    hidden=True,
    expose_value=False,
    callback=_deprecated_dense,
    help="Former spelling of --dense-formats.",
)
@click.option(
    "--moe/--no-moe",
    default=True,
    show_default=True,
    help="Tune the MoE layer's two GEMMs (--no-moe: only the --dense-formats problems).",
)
@click.option(
    "--decode",
    is_flag=True,
    help="Also tune the decode kernels (q/k/v, o, router and lm_head projections, decode attention) at the "
    "model's decode shapes, batch 1 to 8, after the rest, with a budget of their own; with --compile-only, "
    "compile their defaults for --arch. An mxfp4 lm_head is a --dense-formats problem: the step runs it on "
    "the dense MX kernel.",
)
@click.option("--tokens", help="Token counts, e.g. 1-8,16,64 (default: 1-8, 12, 16, 24 ... 8192).")
@db_option("Tactics DB to fill (default: $PREPKIT_TACTICS_DB or ~/.cache/prepkit/tactics.db).")
@click.option(
    "--budget-minutes",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Stop measuring after this long (the MoE layer; the dense problems then get as long again); the "
    "run is recorded as partial and resumes next time.  [default: 15; 720 with --thorough]",
)
@click.option("--gpus", help="GPU indexes to use in parallel, e.g. 0,1 (default 0).")
@click.option(
    "--max-candidates",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Variants per GEMM after pruning (the defaults and their neighbours come first; earlier winners on "
    "this GPU model, from --db and the bundled DB, are added), before the local search around the best.",
)
@click.option(
    "--check-workers",
    type=click.IntRange(0, 32),
    default=None,
    help="Extra worker processes that check (and so compile) candidates in parallel on the first GPU.  "
    "[default: 4; with --thorough one per CPU core, at most 32 and as many as the GPU memory holds, "
    "one core left to the timing worker]",
)
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    default=6,
    show_default=True,
    help="Variants kept per anchor token count for the full sweep.",
)
@click.option(
    "--thorough",
    is_flag=True,
    help="Measure every valid variant (no pruning, no --max-candidates): each is checked once, at 33 "
    "tokens, then screened at the anchor token counts, and the best of each anchor are timed in full at "
    "every point. An hour or more, not minutes: resumable, and the winners record that this search found them.",
)
@click.option(
    "--compile-only",
    is_flag=True,
    help="No GPU: compile the defaults and a sample of the variants for --arch's reference device, "
    "print what the compiler made, write no DB (see below).",
)
@click.option(
    "--sample",
    type=click.IntRange(min=0),
    default=None,
    help="With --compile-only: variants compiled per variant family besides the defaults "
    "(0: defaults only)  [default: 1]",
)
@json_option
@quiet_option
@click.pass_context
@_grouped(MeasureFlags, "measure")
@_grouped(ProblemFlags, "which")
def tune_command(
    ctx: click.Context,
    arch: str,
    model: str | None,
    shards: Path | None,
    tp: int | None,
    activations: ActivationPolicy,
    which: ProblemFlags,
    tokens: str | None,
    measure: MeasureFlags,
    compile_only: bool,
    sample: int | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Measure every pruned kernel variant on this GPU and store the fastest per token range.

    Each candidate is first checked against the fp32 reference of its activation policy
    (failures are blocklisted), then timed with CUDA graphs next to the default variant; the
    default is kept unless beaten beyond noise. A rerun skips what the DB already holds for this
    GPU and software.

    --thorough measures every valid variant instead of the pruned set, to find what the pruned
    search misses (docs/tuning.md gives its cost): progress counts the variants checked and
    measured with the time left, and the summary states the coverage per GEMM.

    --dense-formats also tunes the dense MX linears (fused qkv, o and lm_head of the model, per weight
    format), each under a problem key of its own: the runtime's dense lookup finds them and a MoE
    lookup never does. They run after the MoE layer, with a budget of their own.

    --decode also tunes the decode kernels registered in prepkit.kernels.decode, one winner per
    kernel and problem (shape, weight format, batch; attention: heads and cache slots in use),
    which the decode step looks up; a kernel not registered is named and left out.

    --compile-only needs no GPU and writes no DB: it compiles, through Triton's own compiler, the
    kernels a launch on the reference device of --arch (sm90: H100, sm120: RTX PRO 6000, sm121:
    GB10) would use: the default variant of each GEMM at every --tokens point, the routing
    kernels, and --sample variants of each variant family (of the variant spaces at the fewest
    and the most tokens). Progress, one line per kernel, goes to stderr; the table goes to stdout
    (--json: a JSON array, one object per kernel): compiled or the compiler's message,
    registers, spilled bytes, shared memory, the MMA in the PTX (native block-scaled, bf16
    mma.sync, wgmma) and SASS instructions per K step. On 2 CPU cores one arch and policy takes
    about a minute with the default --sample 1 (bf16, with more variant families: two).
    --dense-formats adds the dense MX linear's defaults in those weight formats (each that pairs
    with --activations) at the model's dense shapes, table after table; --no-moe leaves out the
    MoE layer.

    \b
    Exit codes of --compile-only:
      0  every default and routing kernel compiled; with mxfp8 / mxfp4 on sm120 / sm121,
         every default GEMM's PTX holds the native block-scaled MMA
      6  one did not: each such kernel is named on stderr, with its tactic
      5  --arch auto or sm100: name a target with a reference device
      3  unknown model, or shards not in the triton-moe layout
      2  an option of a measuring run (--db, --gpus, ...) given with it

    \b
    Example:
        prepkit tune --arch sm90 --model gpt-oss-120b --tp 1
        prepkit tune --arch sm121 --shards shards/ --tokens 1-8,16,32 --gpus 0,1
        prepkit tune --arch sm121 --model gpt-oss-120b --tp 1 --thorough --db thorough.db
        prepkit tune --arch sm90 --model gpt-oss-120b --tp 1 --dense-formats mxfp4 --no-moe --db dense.db
        prepkit tune --arch sm90 --model gpt-oss-120b --decode --no-moe --dense-formats none
        prepkit tune --arch sm121 --model gpt-oss-120b --tp 1 --compile-only --activations mxfp8
        prepkit tune --arch sm120 --compile-only --activations mxfp8 --dense-formats all --no-moe
    """
    from prepkit import tune
    from prepkit.tune import report as tune_report

    if model and shards:
        raise click.UsageError("--model and --shards are exclusive")
    dense_formats, moe = which.dense_formats, which.moe
    dense_old = ctx.meta.get(_DENSE_OLD)
    if dense_old is not None:
        if dense_formats is not None:
            raise click.UsageError("--dense is the former spelling of --dense-formats: pass one")
        dense_formats = dense_old
    try:
        points = tune.parse_tokens(tokens)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--tokens") from None
    if compile_only:
        _refuse_gpu_options(ctx)
        job = CompileJob(arch, model, shards, tp, activations, points, 1 if sample is None else sample)
        _compile_only(job, dense_formats, moe, as_json, quiet, decode=which.decode)
        return
    if sample is not None:
        raise click.UsageError("--sample applies to --compile-only only")
    m = measure
    if m.thorough and ctx.get_parameter_source("max_candidates") is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--max-candidates cannot be used with --thorough (it measures every valid variant)")
    opts = tune.TuneOptions(
        arch=arch, model=model, shards=shards, tp=tp, activations=activations, points=points, db_path=m.db_path,
        budget_minutes=m.budget_minutes, gpus=_parse_gpus(m.gpus), max_candidates=m.max_candidates,
        check_workers=m.check_workers, keep=m.keep, thorough=m.thorough, dense_formats=dense_formats, moe=moe,
        decode=which.decode,
    )  # fmt: skip
    with console.progress(enabled=not quiet, unit="count", eta=m.thorough) as on_progress:
        result = tune.run_tune(opts, on_progress=on_progress)
    summary = tune_report.summary(result)
    if as_json:
        console.emit_json(summary)
        return
    _print(summary)
    click.echo(summary["db"])


def _print(summary: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    from prepkit.tune import report as tune_report

    for p in summary["problems"]:
        gm = p["geomean_speedup"]
        console.result(
            Text.assemble(
                (p.get("name") or p["problem"], "bold"),
                f": {p['timed']} timed, {p['retimed']} retimings, {p['reused']} reused, "
                f"{p['blocklisted']} blocklisted, {p['ranges']} ranges, {p['elapsed_s']} s"
                + (f", geomean {gm:.3f}x vs default" if gm else ""),
                ("" if p["complete"] else " (partial: budget reached; rerun to resume)", "yellow"),
            )
        )
        if "coverage" in p:
            console.result(tune_report.coverage_line(p["coverage"]))
    for d in summary.get("decode", []):
        console.result(tune_report.decode_line(d))
    for note in summary.get("decode_notes", []):
        console.warn(note)
    if summary["layer"]:
        t = Table(title=f"whole layer on {summary['device']}: default vs tuned (median us)")
        for col in ("tokens", "default", "tuned", "speedup"):
            t.add_column(col, justify="right")
        for lp in summary["layer"]:
            sp = lp["speedup"]
            t.add_row(str(lp["m"]), _us(lp["default_us"]), _us(lp["tuned_us"]), f"{sp:.3f}x" if sp else "-")
        console.result(t)
        if summary["layer_geomean_speedup"]:
            console.result(f"layer geomean speedup: {summary['layer_geomean_speedup']:.3f}x")


def _us(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else "-"


# Options of a measuring run that a compile-only run has no use for: given, they are refused
# rather than ignored (a --db the run never writes would mislead).
_GPU_OPTIONS = tuple(f.name for f in dataclasses.fields(MeasureFlags))


def _refuse_gpu_options(ctx: click.Context) -> None:
    given = [
        f"--{name.removesuffix('_path').replace('_', '-')}"
        for name in _GPU_OPTIONS
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        raise click.UsageError(f"{', '.join(given)} cannot be used with --compile-only (it measures nothing)")


@dataclass(frozen=True)
class CompileJob:
    """What a compile-only run compiles: the target, the layer's source and the variants."""

    arch: str
    model: str | None
    shards: Path | None
    tp: int | None
    activations: str
    points: tuple[int, ...]
    sample: int


def _compile_only(
    job: CompileJob, dense_formats: str | None, moe: bool, as_json: bool, quiet: bool, decode: bool = False
) -> None:
    from rich.text import Text

    from prepkit.errors import CompileCheckError
    from prepkit.kernels.compile_check import format_reports, leave_interpreter
    from prepkit.tune import compile_only as co

    leave_interpreter()
    co.check_arch_name(job.arch)
    dense = co.plan_compile_dense(job.activations, model=job.model, shards=job.shards, choice=dense_formats)
    on_line = None if quiet else console.info
    results: list[co.CompileOnlyResult | co.DenseCompileResult | co.DecodeCompileResult] = []
    if moe:
        from prepkit.layer import resolve_layer

        target = resolve_layer(model=job.model, shards=job.shards, tp=job.tp)
        results.append(
            co.run_compile_only(
                job.arch, job.activations, target, per_family=job.sample, points=job.points, on_line=on_line
            )
        )
    results += co.run_compile_dense(job.arch, job.activations, dense, on_line=on_line)
    if decode:
        results.append(co.run_compile_decode(job.arch, model=job.model, shards=job.shards, on_line=on_line))
    if as_json:
        console.emit_json([r.to_dict() for res in results for r in res.reports])
    else:
        for res in results:
            # soft_wrap: the table's lines stay whole off a terminal
            console.out_console.print(Text(format_reports(res.reports)), soft_wrap=True)
            console.out_console.print(Text(res.summary()), soft_wrap=True)
    failures = [line for res in results for line in res.failures]
    if failures:
        raise CompileCheckError(
            f"{len(failures)} default kernel(s) failed the {job.arch} compile check:\n  " + "\n  ".join(failures),
            hint="the table above (or --json) holds each kernel's compiler message",
        )
