"""One tuning run, start to end: which problems, which GPUs, the sweep, and what the DB keeps.

:func:`run_tune` is what ``prepkit tune`` calls; it returns a :class:`TuneReport` and prints
nothing (progress goes through ``on_progress``).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prepkit import __version__
from prepkit.constants import TRITON_MOE_LAYOUT_ID
from prepkit.errors import DeviceError, RecipeError, TacticsError
from prepkit.layer import resolve_layer
from prepkit.tactics import store
from prepkit.tactics.keys import DENSE_ROLE, KERNEL_NAME, Environment, ProblemKey, layer_problems
from prepkit.tactics.lookup import TOKEN_POINTS, bundled_db_path, user_db_path
from prepkit.tune import thorough
from prepkit.tune.backend import SubprocessBackend, Worker, open_gpu_workers
from prepkit.tune.candidates import (
    gemm1_split_siblings,
    kernel_candidates,
    kernel_defaults,
    kernel_space,
    neighbourhood,
    rule_space,
)
from prepkit.tune.decode_problems import DecodeTarget, decode_targets
from prepkit.tune.decode_sweep import DecodeResult, decode_winner_row, tune_decode
from prepkit.tune.dense import DENSE_ANCHORS, DenseTarget, dense_targets
from prepkit.tune.gpu_bench import BUILD_LOCK_ENV, CHECK_M, NICE_ENV, SINGLE_CHECK_M, kernel_timing_scope
from prepkit.tune.layer_sweep import tune_layer
from prepkit.tune.records import LayerReport
from prepkit.tune.sweep_config import PreviousRecords, ProgressFn, SweepConfig

if TYPE_CHECKING:
    from prepkit.kernels.activations import ActivationPolicy
    from prepkit.kernels.device import DeviceInfo
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
    budget_minutes: float | None = None  # None: the search's default (prepkit.tune.thorough)
    gpus: tuple[int, ...] = ()
    max_candidates: int = 64  # the pruned search's; a thorough one takes every valid variant
    check_workers: int | None = None  # None: 4, or sized from the CPU and GPU for a thorough search
    keep: int = 6
    thorough: bool = False
    # The dense MX linears (prepkit.tune.dense.DENSE_CHOICES): "none", a format, "all", or None for
    # the source's own (a model: every format; a shard set: the format its manifest records).
    dense_formats: str | None = None
    moe: bool = True  # False: the dense problems only
    decode: bool = False  # also the decode kernels (prepkit.tune.decode_problems), after the rest
    cmdline: Sequence[str] = field(default_factory=lambda: ["prepkit", *sys.argv[1:]])

    @property
    def search(self) -> str:
        """``'thorough'`` or ``'pruned'`` (:data:`prepkit.tactics.schema.SEARCHES`)."""
        return "thorough" if self.thorough else "pruned"

    @property
    def check_m(self) -> tuple[int, ...]:
        """The token counts each numerics check runs at."""
        return SINGLE_CHECK_M if self.thorough else CHECK_M


@dataclass
class TuneReport:
    """What a run measured and where it stored it: ``layer`` holds the MoE GEMMs' sweeps (and the
    whole-layer comparison), then each dense problem's."""

    layer: LayerReport
    env: Environment
    db_path: Path
    status: str  # 'complete' | 'partial'
    search: str = "pruned"  # or 'thorough'
    decode: list[DecodeResult] = field(default_factory=list)
    decode_notes: list[str] = field(default_factory=list)  # decode kernels left out, and why


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
    lock_dir = tempfile.TemporaryDirectory(prefix="prepkit-tune-")
    # Workers build their layers one at a time (gpu_bench.build_lock): a build's peak is several layers.
    worker_env = {BUILD_LOCK_ENV: os.path.join(lock_dir.name, "build.lock")}
    workers = open_gpu_workers(opts.gpus, worker_env)
    checkers: list[Backend] = []
    try:
        check_workers(workers, opts.arch)
        from prepkit.kernels.mx import KERNEL_VERSION

        problems = (
            tune_problems(
                model=opts.model, shards=opts.shards, tp=opts.tp, kernel_version=str(KERNEL_VERSION),
                activations=opts.activations,
            )
            if opts.moe
            else []
        )  # fmt: skip
        dense = dense_targets(
            model=opts.model, shards=opts.shards, choice=opts.dense_formats, kernel_version=str(KERNEL_VERSION),
            activations=opts.activations,
        )  # fmt: skip
        decode = decode_targets(model=opts.model, shards=opts.shards) if opts.decode else []
        if not problems and not dense and not decode:
            raise RecipeError(
                "nothing to tune: --no-moe and no dense problem",
                hint="pass --dense-formats or --decode, or drop --no-moe",
            )
        path = opts.db_path or user_db_path()
        with store.open_db(path) as tdb:
            first = workers[0].backend
            # Check workers serve the GEMM problems; the decode problems are checked on `first`.
            if isinstance(first, SubprocessBackend) and (problems or dense):
                check_m = opts.check_m if opts.thorough else None
                for w in workers:  # with no check workers the timing workers check
                    if isinstance(w.backend, SubprocessBackend):
                        w.backend.check_m = check_m
                largest = max([*problems, *(t.problem for t in dense)], key=thorough.layer_weight_bytes)
                n = check_worker_count(opts, workers[0].env, largest, len(workers))
                # Compiling yields the CPU to the timing worker (whose launches are timed).
                check_env = {**first.extra_env, NICE_ENV: str(thorough.CHECK_WORKER_NICENESS)}
                # Spread over the GPUs of the run: each holds its share of the workers' layers.
                gpus = [w.backend.gpu if isinstance(w.backend, SubprocessBackend) else first.gpu for w in workers]
                checkers = [
                    SubprocessBackend(gpus[i % len(gpus)], argv=first.argv, env=check_env, check_m=check_m)
                    for i in range(n)
                ]
            layer, decoded, status = _sweep_into(tdb, workers, checkers, problems, dense, decode, opts, on_progress)
    finally:
        for b in [w.backend for w in workers] + checkers:
            b.close()
        lock_dir.cleanup()
    return TuneReport(layer, workers[0].env, path, status, opts.search, decoded[0], decoded[1])


def check_worker_count(opts: TuneOptions, env: Environment, problem: ProblemKey, gpus: int = 1) -> int:
    """``--check-workers`` as given; else 4, or for a thorough search one per CPU core as far as
    the memory of the run's ``gpus`` GPUs holds them (:func:`prepkit.tune.thorough.check_workers`)."""
    if opts.check_workers is not None:
        return opts.check_workers
    if not opts.thorough:
        return thorough.DEFAULT_CHECK_WORKERS
    return thorough.check_workers(os.cpu_count(), env.mem_bytes, thorough.layer_weight_bytes(problem), gpus)


def _sweep_into(
    tdb: store.TacticsDB,
    workers: Sequence[Worker],
    checkers: list[Backend],
    problems: list[ProblemKey],
    dense: list[DenseTarget],
    decode: list[DecodeTarget],
    opts: TuneOptions,
    on_progress: ProgressFn | None,
) -> tuple[LayerReport, tuple[list[DecodeResult], list[str]], str]:
    env, info = workers[0].env, workers[0].device
    backends = [w.backend for w in workers]
    bw = backends[0].bandwidth_gbps() if hasattr(backends[0], "bandwidth_gbps") else None
    env_hash = tdb.put_env(store.env_record(env, package_version=__version__, mem_bw_gbps=bw))
    budget_s = thorough.budget_minutes(opts.budget_minutes, thorough=opts.thorough) * 60
    config = SweepConfig(points=opts.points, keep_per_anchor=opts.keep, budget_s=budget_s, search=opts.search)
    dense_config = SweepConfig(**{**config.__dict__, "anchors": DENSE_ANCHORS})
    if opts.thorough:
        config = SweepConfig(**{**config.__dict__, "anchors": thorough.thorough_anchors(opts.points, config.anchors)})
        dense_config = SweepConfig(
            **{**dense_config.__dict__, "anchors": thorough.thorough_anchors(opts.points, DENSE_ANCHORS)}
        )
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
            "search": opts.search,
            "max_candidates": None if opts.thorough else opts.max_candidates,
            "keep_per_anchor": opts.keep,
            "refine": None if opts.thorough else [config.refine_seeds, config.refine_rounds],
            "anchors": list(config.anchors),
            "min_gain": config.min_gain,
            "retime": {"margin": config.retime.margin, "rounds": config.retime.rounds},
            "check_m": list(opts.check_m),
            "check_workers": len(checkers),
            "dense": [t.label for t in dense],
            "dense_anchors": list(dense_config.anchors),
            "decode": [t.label for t in decode],
        },
        token_points=opts.points,
        cmdline=shlex.join(opts.cmdline),
    )
    rec = store.RunRecorder(tdb, run_id, env_hash, env, search=opts.search)
    past = past_winners(tdb, env.name, [*problems, *(t.problem for t in dense)])

    def previous(p: ProblemKey) -> PreviousRecords:
        measured, checked, blocked = rec.previous(p)
        return measured, reusable_checks(checked, opts.check_m), blocked

    status = "aborted"
    report: LayerReport | None = None
    decoded: tuple[list[DecodeResult], list[str]] = ([], [])
    sweep_args: dict[str, Any] = dict(
        candidates_for=lambda p: search_candidates(opts, p, info, past[p]),
        default_for=lambda p: kernel_defaults(p, info),
        previous=previous,
        on_batch=rec.batch,
        on_result=rec.result,
        on_progress=on_progress,
        check_backends=checkers or None,
        valid_for=lambda p: len(kernel_space(p, info)),
        neighbours_for=lambda p: None if opts.thorough or p.role == DENSE_ROLE else neighbourhood(rule_space(p, info)),
        point_extras_for=lambda p: gemm1_split_siblings(p, info),
    )
    try:
        # The MoE layer first, as a run without dense problems sweeps it (its budget, its
        # whole-layer comparison); then the dense problems, with a budget of their own.
        report = tune_layer(problems, backends, config=config, **sweep_args)
        if dense:
            labels = {t.problem: t.label for t in dense}
            linears = tune_layer(
                [t.problem for t in dense], backends, config=dense_config, compare_layer=False,
                label_for=labels.get, **sweep_args,
            )  # fmt: skip
            report = LayerReport(
                report.results + linears.results, report.layer_points, report.elapsed_s + linears.elapsed_s
            )
        if decode:  # last, with a budget of its own, on the first GPU
            decoded = _decode_into(tdb, env_hash, run_id, backends[0], decode, budget_s, on_progress)
        done = all(r.complete for r in report.results) and all(r.complete for r in decoded[0])
        status = "complete" if done else "partial"
    finally:
        notes = run_notes(report, opts.search, decoded[0]) if report is not None else None
        tdb.finish_run(run_id, status, notes=notes)
    return report, decoded, status


def _decode_into(
    tdb: store.TacticsDB,
    env_hash: str,
    run_id: str,
    backend: Any,
    targets: list[DecodeTarget],
    budget_s: float,
    on_progress: ProgressFn | None,
) -> tuple[list[DecodeResult], list[str]]:
    """Sweep the decode problems whose kernel is registered, storing each winner as it comes."""
    from prepkit.tune.decode_bench import load_kernels

    kernels = load_kernels()

    def store_winner(res: DecodeResult) -> None:
        row = decode_winner_row(res, kernels[res.problem.kernel])
        if row is not None:
            tdb.put_decode_winner(env_hash, run_id, row)

    if not (hasattr(backend, "check_decode") and hasattr(backend, "time_decode")):
        raise DeviceError(f"the tuning backend {type(backend).__name__} cannot measure decode kernels")
    return tune_decode(targets, kernels, backend, budget_s=budget_s, on_result=store_winner, on_progress=on_progress)


def search_candidates(opts: TuneOptions, problem: ProblemKey, device: DeviceInfo, past: Sequence[str]) -> list[str]:
    """What the run's search takes up for ``problem``: every valid variant (thorough), or the
    pruned set with the ``past`` winners (:func:`~prepkit.tune.candidates.kernel_candidates`)."""
    if opts.thorough:
        return list(kernel_space(problem, device))
    return kernel_candidates(problem, device, max_count=opts.max_candidates, past_winners=past, points=opts.points)


def reusable_checks(checks: Mapping[str, Mapping[str, Any]], check_m: Sequence[int]) -> dict[str, Mapping[str, Any]]:
    """The stored checks a run takes over: every failure, and every pass at (at least) the token
    counts this run checks at. A thorough search's one-shape pass is checked again by a pruned run,
    whose checks stay as they were; a check that names no token counts (a stand-in's) is taken."""
    out: dict[str, Mapping[str, Any]] = {}
    for tactic, row in checks.items():
        try:
            shapes = set(json.loads(row.get("m_values") or "[]"))
        except (TypeError, ValueError):
            shapes = set()
        if not row.get("passed") or not shapes or set(check_m) <= shapes:
            out[tactic] = row
    return out


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


def run_notes(report: LayerReport, search: str, decode: Sequence[DecodeResult] = ()) -> str:
    """What the run keeps in ``tuning_run.notes``: the whole-layer comparison (default pair vs
    tuned pair), the search, and each GEMM's sweep record (:meth:`SweepResult.record`: duration,
    coverage, the choice per token point), which a later comparison of searches reads; and each
    decode problem's (:meth:`DecodeResult.record`), where the run tuned them."""
    return json.dumps(
        {
            "layer_us": [[p.m, p.default_us, p.tuned_us] for p in report.layer_points],
            "layer_geomean_speedup": report.layer_geomean(),
            "search": search,
            "sweeps": [r.record() for r in report.results],
            **({"decode": [r.record() for r in decode]} if decode else {}),
        }
    )
