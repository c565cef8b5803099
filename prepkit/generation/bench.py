"""``prepkit bench``: prefill and decode speed of a prepared folder on this device, in
llama-bench's terms, next to the bandwidth floor measured in the same run.

- ``ppN``: a prompt of N tokens (batch 1) through one prefill forward, in tok/s.
- ``tgN``: N new tokens decoded one step at a time (greedy; ``sampled`` rows use the folder's
  sampling defaults), in tok/s over all rows of the batch, after a one-token prompt.

Each figure is the median of ``repetitions`` runs with their spread; loading, compiling and
graph capture happen before and are timed apart. Two layer counts are both measured on one load
and fitted per layer (:mod:`prepkit.generation.layer_fit`), with each kernel's share of a layer
(:mod:`prepkit.generation.step_timeline`). Prompts are random token ids (no tokenizer
needed) and EOS is ignored, so every run decodes its full length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prepkit.distributed.decoder import build_rank_decoder
from prepkit.distributed.model_hooks import split_label, split_of
from prepkit.distributed.session import start_ranks
from prepkit.errors import RecipeError
from prepkit.generation import floor, loading
from prepkit.generation.kernel_count import count_kernels
from prepkit.generation.layer_fit import fit_layers, summary_line
from prepkit.generation.sampling import SamplingParams
from prepkit.generation.step_timeline import breakdown
from prepkit.generation.step_timeline import table as timeline_table
from prepkit.generation.steps import DecodeStep, default_step
from prepkit.scale_stats import folded_upcast

ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class BenchRequest:
    folder: Path
    prompt_lengths: tuple[int, ...] = (512, 2048)
    gen_lengths: tuple[int, ...] = (32, 128)
    batches: tuple[int, ...] = (1,)
    repetitions: int = 5
    sampled: bool = True
    activations: str = "bf16"
    device: str = "cuda"
    step: DecodeStep | None = None
    seed: int = 0
    # Run only the first N decoder layers; two counts are both measured (the larger first) and
    # fitted per layer (prepkit.generation.layer_fit), scaled to ``scale_to`` layers (default: the
    # recipe's depth).
    layers: tuple[int, ...] = ()
    scale_to: int | None = None

    @property
    def cache_lengths(self) -> tuple[int, int]:
        """Slots of the decode cache and of the prefill cache. Decoding runs on caches sized for
        its own lengths (attention reads the whole cache), as llama-bench's tg runs at an empty
        context; prefill gets a cache of its own."""
        return 2 + max(self.gen_lengths, default=1), 1 + max(self.prompt_lengths, default=1)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, standard deviation (0 for one value), minimum and maximum."""
    return {
        "median": statistics.median(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(request: BenchRequest, on_progress: ProgressFn | None = None) -> dict[str, Any]:
    """Measure ``request``; returns the JSON-ready report (see the module).

    Raises:
        PrepkitError: bad input of any kind, before the weights load; a batch and context whose
            cache does not fit the device's free memory (named).
    """
    progress = on_progress or (lambda label, done, total: None)
    loading.check_dependencies()
    group = start_ranks(request.device, request.folder)
    manifest = loading.open_prepared(request.folder, group.world_size if group else 1)
    device = group.device if group is not None else loading.resolve_device(request.device)
    rank = group.rank if group is not None else 0
    longest = max(request.cache_lengths)
    loading.check_fits(manifest, device, max(request.batches, default=1), longest, rank=rank)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    depth = int(manifest.model.config["num_hidden_layers"])
    counts = layer_counts(request.layers, depth)
    if len(counts) == 2 and not (request.gen_lengths and 1 in request.batches):
        raise RecipeError("layers: a fit over two counts needs a --tg test at batch 1")
    loaded = loading.load_model(request.folder, manifest, device, request.activations)
    model = loaded.model
    if len(counts) < 2:
        if counts:
            keep_layers(model, counts[0])
        return _measure(request, model, manifest, device, loaded.load_s, progress)
    reports: list[dict[str, Any]] = []
    for count in counts:
        keep_layers(model, count)
        if reports and device.type == "cuda":  # the fewer layers' own peak, not the first run's
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        reports.append(_measure(request, model, manifest, device, loaded.load_s, progress))
    report, fewer = reports
    report["fit"] = fit_layers(report, fewer, scale_to=request.scale_to, test=f"tg{max(request.gen_lengths)}")
    report["layer_kernels"] = _layer_kernels(report, report["fit"]["kernels_per_layer"])
    report["fewer_layers"] = fewer
    return report


def layer_counts(layers: Sequence[int], depth: int) -> list[int]:
    """``layers`` as the counts to run, the larger first.

    Raises:
        RecipeError: more than two counts, two equal ones, or a count outside 1..``depth``.
    """
    counts = sorted(set(layers), reverse=True)
    if len(counts) != len(layers) or len(counts) > 2:
        raise RecipeError(
            f"layers: {', '.join(map(str, layers))}: give one count, or two different ones to fit per layer"
        )
    bad = [n for n in counts if not 1 <= n <= depth]
    if bad:
        raise RecipeError(f"layers: {bad[0]} is not in 1..{depth}, the folder's layer count")
    return counts


def _layer_kernels(report: dict[str, Any], period: float | None) -> dict[str, Any] | None:
    """The larger run's kernels, per kernel of a layer (``period`` of them: the fit's count) and
    outside the layers (:mod:`prepkit.generation.step_timeline`); ``None`` without timelines or a
    repeating block."""
    if period is None or period != int(period):
        return None
    try:
        found = breakdown(report, int(period))
    except (ValueError, KeyError, TypeError):
        return None
    return {"layers": found["layers"], **{key: [list(k) for k in found[key]] for key in ("per_layer", "fixed")}}


def _measure(
    request: BenchRequest, model: Any, manifest: Any, device: torch.device, load_s: float, progress: ProgressFn
) -> dict[str, Any]:
    """The figures of ``request`` on ``model`` as loaded (or cut to fewer layers): one report."""
    tg_len, pp_len = request.cache_lengths
    sampling = SamplingParams.create(do_sample=True, defaults=model.generation_config)
    model.generation_config.eos_token_id = None  # every run decodes its full length
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(request.seed)

    def prompt(batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, max(1, vocab * 9 // 10), (batch, length), generator=generator)

    bandwidth = floor.copy_bandwidth(device)
    tests: list[dict[str, Any]] = []
    total = len(request.prompt_lengths) + len(request.batches) * len(request.gen_lengths) * (
        2 if request.sampled else 1
    )
    started = time.perf_counter()
    steps = {batch: request.step or default_step(device, batch) for batch in request.batches}
    decoders = {batch: build_rank_decoder(model, tg_len, batch, steps[batch]) for batch in request.batches}
    first = build_rank_decoder(model, pp_len, 1, "modules") if request.prompt_lengths else None
    warm_s = _warm_up(decoders, first, prompt, sampling if request.sampled else None, request.prompt_lengths)
    launches = _step_launches(decoders, device)

    for length in request.prompt_lengths:
        assert first is not None
        ids = prompt(1, length)
        times = []
        for _ in range(request.repetitions):
            began = time.perf_counter()
            first.prefill(ids)
            _sync(device)
            times.append(time.perf_counter() - began)
        tests.append(_row(f"pp{length}", 1, [length / t for t in times], None))
        progress("bench", len(tests), total)

    kinds = [("", SamplingParams())] + ([(" sampled", sampling)] if request.sampled and not sampling.greedy else [])
    for batch, decoder in decoders.items():
        step_bytes = floor.step_bytes(model, batch)
        floor_tps = bandwidth / sum(step_bytes.values()) * batch if bandwidth else None
        for length in request.gen_lengths:
            for suffix, params in kinds:
                rates = []
                for rep in range(request.repetitions):
                    decoder.generate(prompt(batch, 1), length + 1, sampling=params, seed=request.seed + rep)
                    stats = decoder.stats
                    rates.append(batch * length / (stats.first_step_s + stats.decode_s))
                tests.append({**_row(f"tg{length}{suffix}", batch, rates, floor_tps), "step": steps[batch]})
                progress("bench", len(tests), total)
    measured_s = time.perf_counter() - started - warm_s

    from prepkit.env import report as env_report

    env = env_report()
    layer_bytes = floor.step_bytes(model, 1)
    return {
        "folder": str(request.folder),
        "model": {
            "recipe": manifest.model.recipe,
            "layers": int(model.config.num_hidden_layers),
            "experts": int(model.config.num_local_experts),
            "top_k": int(model.config.num_experts_per_tok),
            "hidden": int(model.config.hidden_size),
            "vocab": vocab,
            "dense": manifest.dense_format,
        },
        "device": loading.device_name(device),
        "ranks": split_of(manifest, model),
        "activations": request.activations,
        # The decode step of the smallest batch; each tg row names its own.
        "step": steps[min(steps)] if steps else request.step or default_step(device),
        "sampling": sampling.describe(),
        "repetitions": request.repetitions,
        "tests": tests,
        "bytes_per_token": layer_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None,
        "floor_tok_s": bandwidth / sum(layer_bytes.values()) if bandwidth else None,
        "load_s": load_s,
        "warmup_s": warm_s,
        "measure_s": measured_s,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "tactics": _tactics_used(model, request.prompt_lengths),
        "step_launches": launches,
        "folded_upcast": folded_upcast(model),
        "versions": env["versions"],
        "tactics_dbs": env["tactics_dbs"],
        "mx_native": env["mx_native"] if request.activations != "bf16" else None,
    }


def keep_layers(model: Any, count: int) -> None:
    """Cut ``model`` to its first ``count`` decoder layers (the rest freed): timing two layer
    counts of one folder separates the per-layer cost from the fixed part.

    Raises:
        RecipeError: ``count`` outside 1..the model's layers.
    """
    from torch import nn

    layers = list(model.model.layers)
    layer_counts([count], len(layers))
    model.model.layers = nn.ModuleList(layers[:count])
    model.config.num_hidden_layers = count
    model.config.layer_types = list(model.config.layer_types)[:count]
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def _warm_up(
    decoders: dict[int, Any],
    prefill: Any,
    prompt: Callable[[int, int], torch.Tensor],
    sampling: SamplingParams | None,
    prompt_lengths: Sequence[int],
) -> float:
    """Compile, autotune and capture every path the figures take; returns the seconds spent."""
    began = time.perf_counter()
    for batch, decoder in decoders.items():
        decoder.generate(prompt(batch, 1), 3)
        if sampling is not None and not sampling.greedy:
            decoder.generate(prompt(batch, 1), 3, sampling=sampling)
    for length in prompt_lengths:
        prefill.prefill(prompt(1, length))
        _sync(prefill.device)
    return time.perf_counter() - began


def _step_launches(decoders: dict[int, Any], device: torch.device) -> dict[str, Any] | None:
    """Kernels and memory operations one captured step launches at the smallest batch (after the
    warm-up captured it), counted by the profiler, and the kernels' shares of the step's chain
    (``timeline``: name and us in launch order, the median of three profiled replays; the
    profiler's tracing slows each kernel a little); None off CUDA."""
    decoder = decoders[min(decoders)] if decoders else None
    graph = getattr(decoder, "graph", None)
    if graph is None:
        return None
    replays = [count_kernels(graph.replay, device) for _ in range(3)]
    counted = replays[0]
    if counted is None:
        return None
    launches: dict[str, Any] = {"kernels": counted.kernels, "memory_ops": counted.memory_ops}
    if all(r is not None and r.names == counted.names and r.shares_us for r in replays):
        shares = zip(*(r.shares_us for r in replays if r is not None), strict=True)
        launches["timeline"] = [
            {"kernel": name, "us": statistics.median(s)} for name, s in zip(counted.names, shares, strict=True)
        ]
    return launches


def _row(test: str, batch: int, rates: list[float], floor_tps: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"test": test, "batch": batch, "tok_s": spread(rates)}
    if floor_tps:
        row["floor_tok_s"] = floor_tps
        row["pct_of_floor"] = 100.0 * row["tok_s"]["median"] / floor_tps
    return row


def _tactics_used(model: Any, prompt_lengths: Sequence[int]) -> dict[str, str]:
    """The MoE variants layer 0 runs at one token and at each prompt length (tuned or default)."""
    from prepkit.runtime.moe import default_tactics_for

    layer = model.model.layers[0].mlp.moe_layer
    used = {}
    for tokens in (1, *prompt_lengths):
        try:
            pair = layer.tactics(tokens)
            default = default_tactics_for(layer.problem(tokens), layer._device_info(), layer.activations)
        except Exception as err:  # report, never fail the bench over a description
            used[str(tokens)] = f"unknown ({err})"
            continue
        origin = "default" if tuple(pair) == tuple(default) else "tuned"
        used[str(tokens)] = f"{origin}: " + " / ".join(str(t) for t in pair)
    return used


def markdown(report: dict[str, Any]) -> str:
    """The report as llama-bench prints it: one table row a test, then the floor."""
    m = report["model"]
    name = f"{m['recipe']} {m['layers']}L dense {m['dense']}"
    if split := split_label(report.get("ranks")):  # the figures are one rank's of a split set
        name += f" {split}"
    lines = [
        "| model | device | act | step | test | batch | t/s | % floor |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    for t in report["tests"]:
        s = t["tok_s"]
        pct = f"{t['pct_of_floor']:.1f}" if "pct_of_floor" in t else "-"
        lines.append(
            f"| {name} | {report['device']} | {report['activations']} | {t.get('step', '-')} | {t['test']} | "
            f"{t['batch']} | {s['median']:.2f} ± {s['stdev']:.2f} | {pct} |"
        )
    if report["copy_bandwidth_gb_s"]:
        lines.append("")
        lines.append(
            f"floor: {sum(report['bytes_per_token'].values()) / 1e9:.3f} GB per token at "
            f"{report['copy_bandwidth_gb_s']:.0f} GB/s copy bandwidth = {report['floor_tok_s']:.1f} tok/s (batch 1)"
        )
    fit = report.get("fit")
    if fit:
        lines += ["", summary_line(fit)]
    if report.get("layer_kernels"):
        lines += ["", timeline_table(report["layer_kernels"], "each kernel's share of the step (profiled)")]
    launches = report.get("step_launches")
    if launches and not fit:
        lines.append(
            f"one decode step: {launches['kernels']} kernels and {launches['memory_ops']} memory operations "
            f"over {m['layers']} layers (fit two layer counts for the per-layer share)"
        )
    return "\n".join(lines)
