"""One tuning run, start to end: which problems, which GPUs, the sweep, and what the DB keeps.

:func:`run_tune` is what ``prepkit tune`` calls; it returns a :class:`TuneReport` and prints
nothing (progress goes through ``on_progress``).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prepkit import __version__
from prepkit.constants import TRITON_MOE_LAYOUT_ID
from prepkit.errors import DeviceError, TacticsError
from prepkit.layer import resolve_layer
from prepkit.tactics import store
from prepkit.tactics.keys import KERNEL_NAME, Environment, ProblemKey, layer_problems
from prepkit.tactics.lookup import TOKEN_POINTS, bundled_db_path, user_db_path
from prepkit.tune.backend import SubprocessBackend, Worker, open_gpu_workers
from prepkit.tune.candidates import kernel_candidates, kernel_defaults
from prepkit.tune.records import LayerReport
from prepkit.tune.sweep import ProgressFn, SweepConfig, tune_layer
from prepkit.tune.worker import kernel_timing_scope

if TYPE_CHECKING:
    from prepkit.kernels.activations import ActivationPolicy
    from prepkit.tune.backend import Backend


@dataclass(frozen=True)
class TuneOptions:
    """What ``prepkit tune`` was asked for."""

    arch: str = "auto"
    model: str | None = None
    shards: Path | None = None
    tp: int | None = None
    activations: ActivationPolicy = "bf16"
    points: tuple[int, ...] = TOKEN_POINTS
    db_path: Path | None = None
    budget_minutes: float = 15.0
    gpus: tuple[int, ...] = ()
    max_candidates: int = 64
    check_workers: int = 4
    keep: int = 6
    cmdline: Sequence[str] = field(default_factory=lambda: ["prepkit", *sys.argv[1:]])


@dataclass
class TuneReport:
    """What a run measured and where it stored it."""

    layer: LayerReport
    env: Environment
    db_path: Path
    status: str  # 'complete' | 'partial'


def tune_problems(
    *,
    model: str | None,
    shards: Path | None,
    tp: int | None,
    kernel_version: str,
    activations: ActivationPolicy = "bf16",
) -> list[ProblemKey]:
    """GEMM1 and GEMM2 problem keys of TP rank 0's layer (:func:`prepkit.layer.resolve_layer`)
    of a recipe or a prepared shard set.

    Raises:
        RecipeError: the shard set is not in the kernel's layout, or ``tp`` disagrees with it.
    """
    layer = resolve_layer(model=model, shards=shards, tp=tp).layer
    probs = layer_problems(
        layer, kernel=KERNEL_NAME, kernel_version=kernel_version, weight_layout=TRITON_MOE_LAYOUT_ID,
        act_dtype=activations,
    )  # fmt: skip
    return [probs["gemm1"], probs["gemm2"]]


def check_workers(workers: Sequence[Worker], arch: str) -> None:
    """All GPUs of one model, and the one ``--arch`` names.

    Raises:
        DeviceError: ``arch`` is another architecture, or the GPUs differ.
    """
    env = workers[0].env
    arches = {w.env.arch for w in workers}
    if arch != "auto" and arches != {arch}:
        raise DeviceError(
            f"--arch {arch} but the GPU is {env.name} ({', '.join(sorted(arches))})",
            hint=f"run with --arch {env.arch} (or auto), or on a {arch} GPU",
        )
    if len(arches) > 1 or len({w.env.name for w in workers}) > 1:
        raise DeviceError(
            f"--gpus mixes GPU models: {sorted({w.env.name for w in workers})}", hint="tune each model on its own"
        )


def run_tune(opts: TuneOptions, *, on_progress: ProgressFn | None = None) -> TuneReport:
    """Sweep both GEMMs of the layer on the GPUs of ``opts`` into the tactics DB.

    Raises:
        DeviceError: no usable GPU, or not the one asked for.
        RecipeError: the problem cannot be built from the model or shards.
        TacticsError: the DB cannot be opened or written.
    """
    workers = open_gpu_workers(opts.gpus)
    checkers: list[Backend] = []
    try:
        check_workers(workers, opts.arch)
        from prepkit.kernels.moe_mxfp4 import KERNEL_VERSION

        problems = tune_problems(
            model=opts.model, shards=opts.shards, tp=opts.tp, kernel_version=str(KERNEL_VERSION),
            activations=opts.activations,
        )  # fmt: skip
        path = opts.db_path or user_db_path()
        with store.open_db(path) as tdb:
            first = workers[0].backend
            if isinstance(first, SubprocessBackend):
                checkers = [SubprocessBackend(first.gpu) for _ in range(opts.check_workers)]
            layer, status = _sweep_into(tdb, workers, checkers, problems, opts, on_progress)
    finally:
        for b in [w.backend for w in workers] + checkers:
            b.close()
    return TuneReport(layer, workers[0].env, path, status)


def _sweep_into(
    tdb: store.TacticsDB,
    workers: Sequence[Worker],
    checkers: list[Backend],
    problems: list[ProblemKey],
    opts: TuneOptions,
    on_progress: ProgressFn | None,
) -> tuple[LayerReport, str]:
    env, info = workers[0].env, workers[0].device
    backends = [w.backend for w in workers]
    bw = backends[0].bandwidth_gbps() if hasattr(backends[0], "bandwidth_gbps") else None
    env_hash = tdb.put_env(store.env_record(env, package_version=__version__, mem_bw_gbps=bw))
    config = SweepConfig(points=opts.points, keep_per_anchor=opts.keep, budget_s=opts.budget_minutes * 60)
    run_id = tdb.start_run(
        env_hash,
        timing_method={
            "cuda_graph": True,
            "routing": "fresh uniform logits per launch",
            "stat": "median",
            "scope": kernel_timing_scope(),  # 'gemm': routing and the other GEMM untimed
            "other_gemm": "default",
        },
        search_space={
            "max_candidates": opts.max_candidates,
            "keep_per_anchor": opts.keep,
            "anchors": list(config.anchors),
            "min_gain": config.min_gain,
        },
        token_points=opts.points,
        cmdline=shlex.join(opts.cmdline),
    )
    rec = store.RunRecorder(tdb, run_id, env_hash, env)
    past = past_winners(tdb, env.name, problems)
    status = "aborted"
    report: LayerReport | None = None
    try:
        report = tune_layer(
            problems,
            backends,
            candidates_for=lambda p: kernel_candidates(p, info, max_count=opts.max_candidates, past_winners=past[p]),
            default_for=lambda p: kernel_defaults(p, info),
            config=config,
            previous=rec.previous,
            on_batch=rec.batch,
            on_result=rec.result,
            on_progress=on_progress,
            check_backends=checkers or None,
        )
        status = "complete" if all(r.complete for r in report.results) else "partial"
    finally:
        tdb.finish_run(run_id, status, notes=layer_notes(report) if report is not None else None)
    return report, status


def past_winners(tdb: store.TacticsDB, gpu_name: str, problems: list[ProblemKey]) -> dict[ProblemKey, list[str]]:
    """Earlier winners of each problem on this GPU model, from the DB being written and the bundled
    one (any kernel version): the sweep measures them first, so a shorter search keeps them."""
    found = {p: tdb.past_winners(gpu_name, p) for p in problems}
    bundled = bundled_db_path()
    if bundled is not None and bundled.resolve() != Path(tdb.path).resolve():
        try:
            with store.open_db_readonly(bundled) as shipped:
                for p, tactics in found.items():
                    tactics += [t for t in shipped.past_winners(gpu_name, p) if t not in tactics]
        except TacticsError:
            pass  # an unreadable shipped DB only costs the seeds; the runtime reports it on lookup
    return found


def layer_notes(report: LayerReport) -> str:
    """The whole-layer comparison (default pair vs tuned pair), kept with the run."""
    return json.dumps(
        {
            "layer_us": [[p.m, p.default_us, p.tuned_us] for p in report.layer_points],
            "layer_geomean_speedup": report.layer_geomean(),
        }
    )
