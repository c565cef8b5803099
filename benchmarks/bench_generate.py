"""The generate/bench figures at gpt-oss-120b dims on one GPU, in one run:

    python -m benchmarks.bench_generate --workdir DIR --out DIR [--layers 5] [--fit-layers 2]
        [--dense bf16,mxfp4,mxfp8] [--parts bench,generate,accuracy] [--accuracy-steps 256]

- ``bench``: ``prepkit bench``'s report (pp512, pp2048, tg32, tg128 at batch 1; tg128 at batch 4
  and 16) on a ``--layers``-layer checkpoint per ``--dense`` format, then tg128 at batch 1 on
  its first ``--fit-layers`` layers: the per-layer cost and the fixed part from the two counts,
  and tok/s scaled to 36 layers against the floor scaled the same way.
- ``generate``: the fast step's ``PrepkitDecoder.generate`` against ``model.generate`` on the same
  model (greedy and sampled), and with a text streamer against without (tok/s, medians).
- ``accuracy``: the accuracy rule (:mod:`prepkit.generation.accuracy`) on a 2-layer checkpoint,
  teacher-forced over ``--accuracy-steps`` positions: transformers' bf16, the modules' step, the
  compiled step, the kernels step, and the MX dense sets against their dequantized weights.

The checkpoints are ``prepkit synth``'s random weights at real dims (128 experts, H = I = 2880,
top-4, 64/8 heads, the 201,088-token vocabulary) with a word-level tokenizer. Writes one JSON per
part to ``--out`` and prints a short table last. No network.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REAL = {"num_experts": 128, "hidden": 2880, "intermediate": 2880, "top_k": 4, "vocab_size": 201088}
ATTENTION = {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_checkpoint(root: Path, layers: int, seed: int, dims: dict[str, int] | None = None) -> Path:
    """A synthetic checkpoint with a tokenizer at ``dims`` (default: gpt-oss-120b's), or the one an
    earlier run left in ``root``."""
    if (root / "tokenizer.json").is_file():  # kept from an earlier run on this machine
        return root
    from prepkit.synth import write_synthetic_checkpoint
    from tests.tokenizer_files import write_tokenizer_files

    dims = dims or {**REAL, **ATTENTION}
    src = write_synthetic_checkpoint(root, num_layers=layers, seed=seed, **dims)
    write_tokenizer_files(src, dims["vocab_size"])
    return src


def prepare(src: Path, out: Path, dense: str) -> Path:
    if (out / "manifest.json").is_file():
        return out
    from click.testing import CliRunner

    from prepkit.cli import cli

    argv = ["prepare", "--src", str(src), "--out", str(out), "--layout", "triton-moe", "--tp", "1", "-q"]
    result = CliRunner().invoke(cli, [*argv, *(["--dense", dense] if dense != "bf16" else [])])
    if result.exit_code != 0:
        raise RuntimeError(result.output)
    return out


def bench_part(args: argparse.Namespace, folders: dict[str, Path]) -> dict[str, Any]:
    from prepkit.generation.bench import BenchRequest, markdown, run_bench
    from prepkit.generation.layer_fit import fit_layers

    out: dict[str, Any] = {}
    for fmt, folder in folders.items():
        log(f"bench {fmt}: {args.layers} layers")
        full = run_bench(BenchRequest(folder, (512, 2048), (32, 128), (1,), args.repetitions))
        batches = run_bench(BenchRequest(folder, (), (128,), (4, 16), args.repetitions, sampled=False))
        full["tests"] += batches["tests"]
        print(markdown(full), flush=True)
        log(f"bench {fmt}: {args.fit_layers} layers")
        few = run_bench(BenchRequest(folder, (), (128,), (1,), args.repetitions, layers=(args.fit_layers,)))
        fit = fit_layers(full, few)  # scaled to the recipe's depth
        out[fmt] = {"report": full, "fit_layers_report": few, "fit": fit}
        gc.collect()
        torch.cuda.empty_cache()
    return out


def median_tok_s(run: Any, tokens: int, repetitions: int) -> dict[str, float]:
    rates = []
    for _ in range(repetitions):
        torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        rates.append(tokens / (time.perf_counter() - began))
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def generate_part(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from prepkit.generation import loading
    from prepkit.generation.sampling import SamplingParams
    from prepkit.generation.text import TextStream
    from prepkit.integrations.static_decode import PrepkitDecoder

    manifest = loading.open_prepared(folder)
    model = loading.load_model(folder, manifest, torch.device("cuda"), "bf16").model
    tokenizer = loading.load_tokenizer(folder)
    model.generation_config.eos_token_id = None
    new = 128
    ids = torch.randint(0, 180000, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
    sampled = SamplingParams.create(do_sample=True, defaults=model.generation_config)
    decoder = PrepkitDecoder(model, 256, compile=True)
    out: dict[str, Any] = {"sampling": sampled.describe(), "new_tokens": new, "prompt_tokens": 16}
    for name, params in (("greedy", SamplingParams()), ("sampled", sampled)):
        kwargs = {"do_sample": name == "sampled"}
        runs = {
            "fast_step": lambda p=params: decoder.generate(ids, new, sampling=p),
            "model_generate": lambda k=kwargs: model.generate(ids, max_new_tokens=new, **k),
            "streamed": lambda p=params: decoder.generate(
                ids, new, sampling=p, streamer=TextStream(tokenizer, 1, write=lambda text: None)
            ),
        }
        for label, run in runs.items():
            run()  # warm-up: compile and capture
            out[f"{label}_{name}"] = median_tok_s(run, new, args.repetitions)
    for name in ("greedy", "sampled"):
        fast = out[f"fast_step_{name}"]["median"]
        out[f"model_generate_over_fast_{name}"] = out[f"model_generate_{name}"]["median"] / fast
        out[f"streamed_over_plain_{name}"] = out[f"streamed_{name}"]["median"] / fast
    out["sampled_over_greedy"] = out["fast_step_sampled"]["median"] / out["fast_step_greedy"]["median"]
    decoder.graphs.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return out


def accuracy_part(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from prepkit.generation import accuracy
    from prepkit.generation.accuracy import PathAccuracy
    from prepkit.generation.steps import build_decoder
    from prepkit.integrations.transformers import from_prepared

    src = write_checkpoint(root / "acc-model", 2, seed=23)
    folders = {fmt: prepare(src, root / f"acc-{fmt}", fmt) for fmt in ("bf16", *args.accuracy_dense)}
    prompt, length = 16, 16 + args.accuracy_steps
    tokens = torch.randint(0, 180000, (1, length), generator=torch.Generator().manual_seed(5))
    log("accuracy: transformers bf16 and the fp32 reference")
    model = accuracy.reference_model(src, "cuda", torch.bfloat16)
    bf16_logits = accuracy.forward_logits(model, tokens)[:, prompt - 1 : -1]
    model.float()  # the MXFP4 experts are exact in bf16: the same weights, in fp32
    references = {"bf16": accuracy.forward_logits(model, tokens)[:, prompt - 1 : -1]}
    for fmt in args.accuracy_dense:
        accuracy.load_dequantized_dense(model, folders[fmt])
        references[fmt] = accuracy.forward_logits(model, tokens)[:, prompt - 1 : -1]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    rows: list[PathAccuracy] = [
        accuracy.compare("transformers bf16 eager", accuracy.by_position(bf16_logits, 0), references["bf16"])
    ]
    del bf16_logits
    paths = [("modules step (graph)", "bf16", "modules"), ("compiled step (graph)", "bf16", "compiled")]
    paths += [("kernels step (graph)", "bf16", "kernels")]
    steps = ("compiled", "kernels")
    paths += [(f"{step} step, --dense {fmt}", fmt, step) for fmt in args.accuracy_dense for step in steps]
    for name, fmt, step in paths:
        log(f"accuracy: {name}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = from_prepared(folders[fmt], device="cuda")
        decoder = build_decoder(model, length, 1, step, keep_logits=True)
        rows.append(accuracy.compare(name, accuracy.decoder_logits(decoder, tokens, prompt), references[fmt]))
        del decoder, model
        gc.collect()
        torch.cuda.empty_cache()
    yardstick = rows[0]
    overhead = host_overhead(folders["bf16"]) if args.host_overhead else None
    return {
        "layers": 2,
        "positions": rows[0].positions,
        "rows": [{**r.as_dict(), "passes": accuracy.passes(r, yardstick)} for r in rows],
        "host_overhead": overhead,
    }


def host_overhead(folder: Path) -> dict[str, float]:
    """ms per decode step of the compiled step (2 layers): graph replays alone, replays with the
    one-step-behind readback, and ``generate`` (readback, row bookkeeping)."""
    from prepkit.integrations.decode_loop import Readback
    from prepkit.integrations.static_decode import PrepkitDecoder
    from prepkit.integrations.transformers import from_prepared

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_prepared(folder, device="cuda")
    model.generation_config.eos_token_id = None
    decoder = PrepkitDecoder(model, 160, compile=True)
    ids = torch.randint(0, 1000, (1, 1))
    decoder.generate(ids, 4)
    steps = 128

    def replays() -> None:
        for _ in range(steps):
            decoder.step()

    def with_readback() -> None:
        reader = Readback(decoder.next_ids, 1)
        for _ in range(steps):
            decoder.step()
            reader.launch()
            if reader.in_flight() == 2:
                reader.collect()
        while reader.in_flight():
            reader.collect()

    out = {}
    for name, run in (("replays", replays), ("replays_readback", with_readback)):
        decoder.prefill(ids)
        run()
        out[name] = 1e3 / median_tok_s(lambda r=run: (decoder.prefill(ids), r()), steps, 5)["median"]
    out["generate"] = 1e3 / median_tok_s(lambda: decoder.generate(ids, steps + 1), steps, 5)["median"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--fit-layers", type=int, default=2)
    parser.add_argument("--dense", default="bf16")
    parser.add_argument("--accuracy-dense", default="mxfp8,mxfp4")
    parser.add_argument("--parts", default="bench,generate,accuracy")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--accuracy-steps", type=int, default=256)
    parser.add_argument("--no-host-overhead", dest="host_overhead", action="store_false")
    args = parser.parse_args(argv)
    args.accuracy_dense = [f for f in args.accuracy_dense.split(",") if f]
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*no tuned tactic.*")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if parts & {"bench", "generate"}:
        log(f"synth + prepare: {args.layers} layers")
        src = write_checkpoint(args.workdir / "model", args.layers, seed=0)
        folders = {fmt: prepare(src, args.workdir / f"prepared-{fmt}", fmt) for fmt in args.dense.split(",")}
        if "bench" in parts:
            results["bench"] = bench_part(args, folders)
            (args.out / "bench.json").write_text(json.dumps(results["bench"], indent=1))
        if "generate" in parts:
            log("generate: fast step against model.generate and streaming")
            results["generate"] = generate_part(args, next(iter(folders.values())))
            (args.out / "generate.json").write_text(json.dumps(results["generate"], indent=1))
    if "accuracy" in parts:
        results["accuracy"] = accuracy_part(args, args.workdir)
        (args.out / "accuracy.json").write_text(json.dumps(results["accuracy"], indent=1))
    print_summary(results)
    return 0


def print_summary(results: dict[str, Any]) -> None:
    print(f"\n== {results['device']}, torch {results['torch']}")
    for fmt, part in results.get("bench", {}).items():
        fit = part["fit"]
        print(
            f"dense {fmt}: per layer {fit['per_layer_us']:.1f} us (floor {fit['floor_per_layer_us']:.1f}), fixed "
            f"{fit['fixed_ms']:.3f} ms, {fit['scaled_layers']} layers {fit['scaled_tok_s']:.1f} tok/s = "
            f"{fit['pct_of_floor']:.1f} % of floor ({fit['floor_tok_s']:.1f})"
        )
    gen = results.get("generate")
    if gen:
        print(json.dumps({k: v for k, v in gen.items() if not isinstance(v, dict)}, indent=1))
    acc = results.get("accuracy")
    if acc:
        for row in acc["rows"]:
            print(
                f"{row['path']:32s} mean err {row['mean_error']:.5f} max {row['max_error']:.4f} "
                f"agree {row['agreement']:.4f} pass {row['passes']}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
