"""``prepkit tune``: sweep the bundled kernel's variants on this GPU into a tactics DB."""

from __future__ import annotations

import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import click

from prepkit import __version__, console
from prepkit import tactics_db as tdb_mod
from prepkit import tune as tuning
from prepkit.cli._app import cli
from prepkit.cli._options import json_option, quiet_option
from prepkit.errors import DeviceError, RecipeError, TacticsError
from prepkit.runtime.tactics import (
    KERNEL_NAME,
    WEIGHT_LAYOUT,
    Environment,
    ProblemKey,
    bundled_db_path,
    gpt_oss_problems,
    user_db_path,
)

ARCHES = ("auto", "sm121", "sm120", "sm100", "sm90")


def _problems(model: str | None, shards: Path | None, tp: int | None, kernel_version: str) -> list[ProblemKey]:
    """GEMM1 and GEMM2 problem keys of TP rank 0 from a recipe or a prepared shard set."""
    from prepkit.layouts.triton_moe import intermediate_split

    if shards is not None:
        from prepkit.shards import read_manifest

        man = read_manifest(shards)
        if man["layout"]["id"] != WEIGHT_LAYOUT:
            raise RecipeError(
                f"{shards} is in layout {man['layout']['id']!r}; the bundled kernel (the one tuned) reads "
                f"{WEIGHT_LAYOUT!r}",
                hint="prepare with --layout triton-moe, or tune with --model",
            )
        d = man["model"]["dims"]
        m_tp, ep = int(man["parallel"]["tp_size"]), int(man["parallel"]["ep_size"])
        if tp is not None and tp != m_tp:
            raise RecipeError(f"--tp {tp} but {shards} was prepared for tp={m_tp}", hint="drop --tp")
        tp = m_tp
        E, H, I, k = d["num_experts"], d["hidden"], d["intermediate"], d["top_k"]
    else:
        from prepkit.recipes import load_recipe

        r = load_recipe(model or "gpt-oss-120b").reference_dims
        E, H, I, k = (
            r["num_local_experts"],
            r["hidden_size"],
            r["intermediate_size"],
            r["num_experts_per_tok"],
        )
        ep = 1
        tp = tp or 1
    lo, hi, _ = intermediate_split(I, tp, 0)
    probs = gpt_oss_problems(
        kernel=KERNEL_NAME,
        kernel_version=kernel_version,
        weight_layout=WEIGHT_LAYOUT,
        num_experts=E,
        hidden=H,
        intermediate=(hi - lo) * tp,
        top_k=k,
        tp_size=tp,
        ep_size=ep,
    )
    return [probs["gemm1"], probs["gemm2"]]


def open_backends(gpus: list[int] | None) -> list[tuple[Any, Environment, Any]]:
    """One worker per GPU: ``(backend, environment, kernels DeviceInfo)``. Tests replace this.

    Raises:
        DeviceError: no CUDA device, or a listed GPU does not exist.
    """
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(
            "no CUDA GPU is visible: `prepkit tune` measures kernels on the GPU it runs on",
            hint="run it on the machine whose GPU you want tuned (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
        )
    count = torch.cuda.device_count()
    ids = gpus if gpus else [0]
    missing = [g for g in ids if not 0 <= g < count]
    if missing:
        raise DeviceError(f"--gpus lists {missing}, but only GPUs 0..{count - 1} exist")
    from prepkit.kernels.device import DeviceInfo

    out = []
    for g in ids:
        b = tuning.SubprocessBackend(g)
        facts = b.describe()
        info = {**facts["device_info"], "capability": tuple(facts["device_info"]["capability"])}
        out.append((b, Environment(**facts["environment"]), DeviceInfo(**info)))
    return out


def _parse_gpus(spec: str | None) -> list[int] | None:
    if not spec:
        return None
    try:
        return sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise click.BadParameter(f"{spec!r}: expected GPU indexes like 0,1", param_hint="--gpus") from None


@cli.command("tune")
@click.option(
    "--arch",
    type=click.Choice(ARCHES),
    default="auto",
    show_default=True,
    help="Architecture to tune; refused when the GPU is another one.",
)
@click.option("--model", help="Recipe whose MoE dims to tune (default gpt-oss-120b).")
@click.option(
    "--shards",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    help="A prepared triton-moe shard set: tune its dims and TP split.",
)
@click.option("--tp", type=click.IntRange(1, 64), help="Tensor-parallel size (rank 0's share is tuned).")
@click.option("--tokens", help="Token counts, e.g. 1-8,16,64 (default: 1-8, 12, 16, 24 ... 8192).")
@click.option(
    "--db",
    "db_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Tactics DB to fill (default: $PREPKIT_TACTICS_DB or ~/.cache/prepkit/tactics.db).",
)
@click.option(
    "--budget-minutes",
    type=click.FloatRange(min=0.1),
    default=15.0,
    show_default=True,
    help="Stop measuring after this long; the run is recorded as partial and resumes next time.",
)
@click.option("--gpus", help="GPU indexes to use in parallel, e.g. 0,1 (default 0).")
@click.option(
    "--max-candidates",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Variants per GEMM after pruning (the defaults and earlier winners on this GPU model, from --db "
    "and the bundled DB, come first).",
)
@click.option(
    "--check-workers",
    type=click.IntRange(0, 32),
    default=4,
    show_default=True,
    help="Extra worker processes that check (and so compile) candidates in parallel on the first GPU.",
)
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    default=6,
    show_default=True,
    help="Variants kept per anchor token count for the full sweep.",
)
@json_option
@quiet_option
def tune_command(
    arch: str,
    model: str | None,
    shards: Path | None,
    tp: int | None,
    tokens: str | None,
    db_path: Path | None,
    budget_minutes: float,
    gpus: str | None,
    max_candidates: int,
    check_workers: int,
    keep: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Measure every pruned kernel variant on this GPU and store the fastest per token range.

    Each candidate is first checked against the fp32 reference (failures are blocklisted),
    then timed with CUDA graphs next to the default variant; the default is kept unless beaten
    beyond noise. A rerun skips what the DB already holds for this GPU and software.

    \b
    Example:
        prepkit tune --arch sm90 --model gpt-oss-120b --tp 1
        prepkit tune --arch sm121 --shards shards/ --tokens 1-8,16,32 --gpus 0,1
    """
    if model and shards:
        raise click.UsageError("--model and --shards are exclusive")
    try:
        points = tuning.parse_tokens(tokens)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--tokens") from None
    gpu_ids = _parse_gpus(gpus)
    workers = open_backends(gpu_ids)
    checkers: list[Any] = []
    try:
        env = workers[0][1]
        arches = {w[1].arch for w in workers}
        if arch != "auto" and arches != {arch}:
            raise DeviceError(
                f"--arch {arch} but the GPU is {env.name} ({', '.join(sorted(arches))})",
                hint=f"run with --arch {env.arch} (or auto), or on a {arch} GPU",
            )
        if len(arches) > 1 or len({w[1].name for w in workers}) > 1:
            raise DeviceError(
                f"--gpus mixes GPU models: {sorted({w[1].name for w in workers})}",
                hint="tune each model on its own",
            )
        info = workers[0][2]
        from prepkit.kernels.moe_mxfp4 import KERNEL_VERSION

        problems = _problems(model, shards, tp, str(KERNEL_VERSION))
        path = db_path or user_db_path()
        opts = _Opts(points, budget_minutes, max_candidates, keep, quiet)
        with tdb_mod.open_db(path) as tdb:
            if isinstance(workers[0][0], tuning.SubprocessBackend):
                checkers = [tuning.SubprocessBackend(workers[0][0].gpu) for _ in range(check_workers)]
            report = _run(tdb, workers, checkers, env, info, problems, opts)
    finally:
        for b in [w[0] for w in workers] + checkers:
            b.close()
    _print(report, env, path, as_json)


class _Opts(NamedTuple):
    points: tuple[int, ...]
    budget_minutes: float
    max_candidates: int
    keep: int
    quiet: bool


def _run(
    tdb: tdb_mod.TacticsDB,
    workers: list[tuple[Any, Environment, Any]],
    checkers: list[Any],
    env: Environment,
    info: Any,
    problems: list[ProblemKey],
    opts: _Opts,
) -> tuning.LayerReport:
    points, budget_minutes, max_candidates, keep, quiet = opts
    backends = [w[0] for w in workers]
    bw = None
    if hasattr(backends[0], "bandwidth_gbps"):
        bw = backends[0].bandwidth_gbps()
    env_hash = tdb.put_env(tdb_mod.env_record(env, package_version=__version__, mem_bw_gbps=bw))
    config = tuning.SweepConfig(points=points, keep_per_anchor=keep, budget_s=budget_minutes * 60)
    run_id = tdb.start_run(
        env_hash,
        timing_method={
            "cuda_graph": True,
            "routing": "fresh uniform logits per launch",
            "stat": "median",
            "scope": tuning.kernel_timing_scope(),  # 'gemm': routing and the other GEMM untimed
            "other_gemm": "default",
        },
        search_space={
            "max_candidates": max_candidates,
            "keep_per_anchor": keep,
            "anchors": list(config.anchors),
            "min_gain": config.min_gain,
        },
        token_points=points,
        cmdline=shlex.join(["prepkit", *sys.argv[1:]]),
    )
    rec = tdb_mod.RunRecorder(tdb, run_id, env_hash, env)
    past = _past_winners(tdb, env.name, problems)
    status = "aborted"
    try:
        with console.progress(enabled=not quiet, unit="count") as on_progress:
            report = tuning.tune_layer(
                problems,
                backends,
                candidates_for=lambda p: tuning.kernel_candidates(
                    p, info, max_count=max_candidates, past_winners=past[p]
                ),
                default_for=lambda p: tuning.kernel_defaults(p, info),
                config=config,
                previous=rec.previous,
                on_batch=rec.batch,
                on_result=rec.result,
                on_progress=on_progress,
                check_backends=checkers or None,
            )
        status = "complete" if all(r.complete for r in report.results) else "partial"
    finally:
        tdb.finish_run(run_id, status, notes=_layer_notes(report) if status != "aborted" else None)
    return report


def _past_winners(tdb: tdb_mod.TacticsDB, gpu_name: str, problems: list[ProblemKey]) -> dict[ProblemKey, list[str]]:
    """Earlier winners of each problem on this GPU model, from the DB being written and the bundled
    one (any kernel version): the sweep measures them first, so a shorter search keeps them."""
    found = {p: tdb.past_winners(gpu_name, p) for p in problems}
    bundled = bundled_db_path()
    if bundled is not None and bundled.resolve() != Path(tdb.path).resolve():
        try:
            with tdb_mod.open_db_readonly(bundled) as shipped:
                for p, tactics in found.items():
                    tactics += [t for t in shipped.past_winners(gpu_name, p) if t not in tactics]
        except TacticsError:
            pass  # an unreadable shipped DB only costs the seeds; the runtime reports it on lookup
    return found


def _layer_notes(report: tuning.LayerReport) -> str:
    """The whole-layer comparison (default pair vs tuned pair), kept with the run."""
    import json

    return json.dumps(
        {
            "layer_us": [[p.m, p.default_us, p.tuned_us] for p in report.layer_points],
            "layer_geomean_speedup": report.layer_geomean(),
        }  # fmt: skip
    )


def _print(report: tuning.LayerReport, env: Environment, path: Path, as_json: bool) -> None:
    summary: dict[str, Any] = {
        "db": str(path),
        "device": env.name,
        "arch": env.arch,
        "elapsed_s": round(report.elapsed_s, 1),
        "layer_geomean_speedup": report.layer_geomean(),
        "problems": [],
        "layer": [asdict(p) | {"speedup": p.speedup} for p in report.layer_points],
    }
    for r in report.results:
        summary["problems"].append(
            {
                "problem": r.problem.describe(),
                "complete": r.complete,
                "elapsed_s": round(r.elapsed_s, 1),
                "timed": r.n_timed,
                "reused": r.n_reused,
                "blocklisted": len(r.blocked),
                "geomean_speedup": r.geomean_speedup(),
                "ranges": len(r.winners),
                "notes": r.notes,
                "points": [
                    {
                        "m": c.m,
                        "default_us": c.default_us,
                        "tuned_us": c.winner_us,
                        "speedup": c.speedup,
                        "why": c.why,
                    }
                    for c in r.choices
                ],
            }
        )
    if as_json:
        console.emit_json(summary)
        return
    from rich.table import Table

    for p in summary["problems"]:
        gm = p["geomean_speedup"]
        console.info(
            f"[bold]{p['problem']}[/]: {p['timed']} timed, {p['reused']} reused, "
            f"{p['blocklisted']} blocklisted, "
            f"{p['ranges']} ranges, {p['elapsed_s']} s"
            + (f", geomean {gm:.3f}x vs default" if gm else "")
            + ("" if p["complete"] else " [yellow](partial: budget reached; rerun to resume)[/]")
        )
    if report.layer_points:
        t = Table(title=f"whole layer on {env.name}: default vs tuned (median us)")
        for col in ("tokens", "default", "tuned", "speedup"):
            t.add_column(col, justify="right")
        for lp in report.layer_points:
            t.add_row(str(lp.m), _us(lp.default_us), _us(lp.tuned_us), f"{lp.speedup:.3f}x" if lp.speedup else "-")
        console.err_console.print(t)
        gm = report.layer_geomean()
        if gm:
            console.info(f"layer geomean speedup: {gm:.3f}x")
    click.echo(str(path))


def _us(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else "-"
