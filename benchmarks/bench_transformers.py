"""gpt-oss in transformers end to end: transformers' own MoE against prepkit's, eager and with the
decode step in one CUDA graph, each against the bandwidth floor.

    python -m benchmarks.bench_transformers [--layers 4] [--vocab 201088] [--decode-tokens 64]
                                            [--prefill 512,2048] [--json OUT.json] [--workdir DIR]

Writes a synthetic checkpoint at gpt-oss-120b's dims (128 experts, H = I = 2880, top-4, 64 query
and 8 KV heads, the real 201,088-token vocabulary; ``--layers`` decoder layers) with ``prepkit
synth``'s code, prepares it with ``--layout triton-moe --tp 1``, then on one GPU reports:

- load seconds and peak device memory (the model comes from :func:`load_model`);
- prefill tok/s (one forward without a cache) per ``--prefill`` length;
- batch-1 decode tok/s: transformers' loop on its DynamicCache (eager), prepkit's
  :class:`~prepkit.integrations.static_decode.PrepkitDecoder` eager and with its step in one CUDA
  graph, and transformers' ``generate`` on a static cache with ``torch.compile`` if it runs;
- per-layer figures and figures scaled to 36 layers (labelled *scaled*: fixed part (embedding,
  final norm, lm_head, argmax, timed alone in a CUDA graph) + 36 x per layer);
- the bandwidth floor: bytes read per decoded token (4 active experts, attention projections,
  router, norms, lm_head) over the copy bandwidth measured in the same run;
- the MoE kernel alone at 1 token in a CUDA graph, eager ``moe()`` host cost at 1/4/16/64 tokens
  with a cProfile breakdown, and a profile of one graph-captured decode step by component.

Times are CUDA-event medians after warm-up. No network: nothing is downloaded, no tokenizer used.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_TOKENS = 16  # decode starts from a short prompt's cache
SCALED_LAYERS = 36
REAL_DIMS = {"num_experts": 128, "hidden": 2880, "intermediate": 2880, "top_k": 4}
REAL_ATTENTION = {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64}


def cuda_ms(fn: Callable[[], object], warmup: int, iters: int, setup: Callable[[], None] | None = None) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (``setup`` before each, untimed)."""
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], replays: int = 50) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, 3, replays)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (1 GiB each way)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), 3, 10)
    return 2 * (1 << 30) / (ms / 1e3)


def write_model(root: Path, layers: int, vocab: int, dense: list[str]) -> tuple[Path, dict[str, Path], float]:
    """(source checkpoint, prepared triton-moe shards per ``--dense`` format, seconds to prepare
    the first)."""
    from click.testing import CliRunner

    from prepkit.cli import cli
    from prepkit.synth import write_synthetic_checkpoint

    src = write_synthetic_checkpoint(
        root / "model", num_layers=layers, vocab_size=vocab, seed=0, **REAL_DIMS, **REAL_ATTENTION
    )
    prepared, seconds = {}, []
    for fmt in dense:
        t = time.perf_counter()
        out = root / f"triton-{fmt}"
        argv = ["prepare", "--src", str(src), "--out", str(out), "--layout", "triton-moe", "--tp", "1", "-q"]
        result = CliRunner().invoke(cli, [*argv, *(["--dense", fmt] if fmt != "bf16" else [])])
        if result.exit_code != 0:
            raise RuntimeError(result.output)
        prepared[fmt] = out
        seconds.append(time.perf_counter() - t)
    return src, prepared, seconds[0]


def load_transformers(src: Path) -> torch.nn.Module:
    """transformers' own model: MXFP4 experts dequantized to bf16 on load, moved to the GPU."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    )
    return model.to("cuda").eval()


def load_model(prepared: Path) -> torch.nn.Module:
    """The model with prepkit's MoE, from the prepared set alone (experts stay MXFP4)."""
    from prepkit.integrations.transformers import from_prepared

    return from_prepared(prepared, device="cuda")


def prefill_ms(model: torch.nn.Module, tokens: int, warmup: int, iters: int) -> float:
    ids = torch.randint(0, 1000, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    return cuda_ms(lambda: model(ids, use_cache=False, logits_to_keep=1), warmup, iters)


def transformers_decode_ms(model: torch.nn.Module, steps: int, warmup: int, iters: int) -> float:
    """Milliseconds per token of transformers' own single-token forwards on a DynamicCache."""
    g = torch.Generator("cuda").manual_seed(1)
    prompt = torch.randint(0, 1000, (1, PROMPT_TOKENS), device="cuda", generator=g)
    nxt = torch.randint(0, 1000, (steps, 1, 1), device="cuda", generator=g)
    state: dict[str, object] = {}

    def setup() -> None:
        state["cache"] = model(prompt, use_cache=True, logits_to_keep=1).past_key_values

    def run() -> None:
        cache = state["cache"]
        for step in range(steps):
            cache = model(nxt[step], past_key_values=cache, use_cache=True, logits_to_keep=1).past_key_values

    return cuda_ms(run, warmup, iters, setup) / steps


def decoder_step_ms(
    model: torch.nn.Module,
    steps: int,
    cuda_graph: bool,
    iters: int,
    compile: bool = False,
    projections: str = "reduction",
) -> tuple[float, Any]:
    """Milliseconds per decode step of PrepkitDecoder (eager or graph-replayed, its decode step
    compiled or not), and the decoder."""
    from prepkit.integrations.static_decode import PrepkitDecoder

    length = PROMPT_TOKENS + steps * (iters + 4) + 8
    decoder = PrepkitDecoder(model, length, cuda_graph=cuda_graph, compile=compile, projections=projections)
    prompt = torch.randint(0, 1000, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    decoder.generate(prompt, 2)  # prefill, one step (warm-up; captures the graph)

    def run() -> None:
        for _ in range(steps):
            decoder.step()

    return cuda_ms(run, 2, iters) / steps, decoder


def fixed_ms(model: torch.nn.Module) -> float:
    """The per-token work outside the decoder layers (embedding, final norm, lm_head, argmax), in a graph."""
    ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    base = model.model
    return graph_ms(lambda: model.lm_head(base.norm(base.embed_tokens(ids))).argmax(-1))


def bytes_per_token(model: torch.nn.Module) -> dict[str, int]:
    """Bytes one batch-1 decode step must read: 4 active experts, attention projections and sinks,
    router, norms per layer, the final norm and lm_head (the embedding reads one row). MX dense
    weights count as stored (codes and scales)."""
    base, layers = model.model, list(model.model.layers)

    def nbytes(module: torch.nn.Module) -> int:
        tensors = [*module.parameters(), *module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    experts = 0
    for layer in layers:
        moe_layer = layer.mlp.moe_layer
        total = sum(
            getattr(moe_layer, n).numel() * getattr(moe_layer, n).element_size()
            for n in ("w13_blocks", "w13_scales", "w13_bias", "w2_blocks", "w2_scales", "w2_bias")
        )
        experts += total * moe_layer.top_k // moe_layer.num_local_experts
    attention = sum(nbytes(layer.self_attn) for layer in layers)
    router = sum(nbytes(layer.mlp.router) for layer in layers)
    norms = sum(nbytes(layer.input_layernorm) + nbytes(layer.post_attention_layernorm) for layer in layers)
    head = nbytes(model.lm_head) + nbytes(base.norm) + base.embed_tokens.weight[0].numel() * 2
    return {"experts": experts, "attention": attention, "router": router, "norms": norms, "head": head}


def same_tokens(model: torch.nn.Module, steps: int) -> dict[str, Any]:
    """The graph-captured decoder's tokens against its eager step's and transformers' eager greedy
    generate's (index of the first differing token, None when all agree)."""
    from prepkit.integrations.static_decode import generate_greedy

    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, 1000, (1, PROMPT_TOKENS), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    want = model.generate(prompt, max_new_tokens=steps, do_sample=False).cpu()
    got = generate_greedy(model, prompt, steps)
    eager = generate_greedy(model, prompt, steps, cuda_graph=False)
    differs = (got != want)[0].nonzero()
    return {
        "graph_equals_eager_step": bool(torch.equal(got, eager)),
        "equals_transformers_generate": bool(torch.equal(got, want)),
        "first_difference": int(differs[0]) if len(differs) else None,
        "new_tokens": steps,
    }


def moe_host_costs(layer: Any, hidden: int, num_experts: int) -> dict[str, Any]:
    """Eager ``moe()`` microseconds per call (200 back-to-back calls, one sync), the same in a
    CUDA graph (:func:`benchmarks.bench_eager.measure`), and a cProfile of the 1-token eager call."""
    from benchmarks.bench_eager import measure
    from prepkit.runtime import moe

    result: dict[str, Any] = {str(tokens): measure(layer, tokens) for tokens in (1, 4, 16, 64)}
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(1, hidden, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(1, num_experts, device="cuda", generator=g)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(500):
        moe(layer, x, logits)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    result["cprofile_1_token_500_calls"] = text.getvalue()
    return result


def step_profile(decoder: Any) -> dict[str, float]:
    """Kernel time by component over one replay of the captured decode step, and the gaps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decoder.step()
        end.record()
        torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3
    parts = {"moe_us": 0.0, "gemm_us": 0.0, "other_us": 0.0}
    kernels = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kernels += 1
        us = event.time_range.elapsed_us()
        if any(k in name for k in ("_route", "_scatter", "gemm1_swiglu", "gemm2_combine")):
            parts["moe_us"] += us
        elif any(k in name for k in ("gemm", "gemv", "xmma", "cutlass", "cublas", "splitk", "sm90")):
            parts["gemm_us"] += us
        else:
            parts["other_us"] += us
    parts["kernels"] = kernels
    parts["step_wall_us"] = wall_us
    parts["gaps_us"] = wall_us - parts["moe_us"] - parts["gemm_us"] - parts["other_us"]
    return parts


def try_transformers_static_compile(model: torch.nn.Module, steps: int) -> dict[str, Any]:
    """transformers' generate on a StaticCache with its automatic torch.compile: works or not, its
    tokens against eager greedy generate, and ms per token."""
    prompt = torch.randint(0, 1000, (1, PROMPT_TOKENS), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    model.generation_config.eos_token_id = None
    out: dict[str, Any] = {}
    try:
        want = model.generate(prompt, max_new_tokens=steps, do_sample=False)
        kwargs = {"max_new_tokens": steps, "do_sample": False, "cache_implementation": "static"}
        model.generate(prompt, **kwargs)  # compiles
        got = model.generate(prompt, **kwargs)
        out["same_tokens_as_eager"] = bool(torch.equal(got, want))
        t_full = cuda_ms(lambda: model.generate(prompt, **kwargs), 1, 3)
        t_one = cuda_ms(lambda: model.generate(prompt, **{**kwargs, "max_new_tokens": 1}), 1, 3)
        out["ms_per_token"] = (t_full - t_one) / (steps - 1)
        out["works"] = True
    except Exception as err:  # report, do not stop the benchmark
        out["works"] = False
        out["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    torch._dynamo.reset()
    return out


def measure_decode(model: torch.nn.Module, args: argparse.Namespace, fixed: float, label: str) -> dict[str, Any]:
    L = args.layers
    row: dict[str, Any] = {"moe": label}
    w, n = args.warmup, args.iters
    for tokens in args.prefill:
        row[f"prefill_{tokens}_ms"] = prefill_ms(model, tokens, w, n)
    row["transformers_loop_ms_per_token"] = transformers_decode_ms(model, args.decode_tokens, w, n)
    for key in ("transformers_loop",):
        ms = row[f"{key}_ms_per_token"]
        row[f"{key}_ms_per_layer"] = (ms - fixed) / L
    return row


def floors_ms(floor_bytes: dict[str, int], layers: int, bw: float) -> tuple[float, float]:
    """The bandwidth floor per token of this many layers, and scaled to 36 layers."""
    total = sum(floor_bytes.values())
    per_layer = (total - floor_bytes["head"]) / layers
    return total / bw * 1e3, (floor_bytes["head"] + SCALED_LAYERS * per_layer) / bw * 1e3


def dense_row(model: torch.nn.Module, args: argparse.Namespace, fmt: str, bw: float) -> dict[str, Any]:
    """The graph decode rows of a model whose dense weights are ``fmt``, with its own floor."""
    fixed = fixed_ms(model)
    floor_bytes = bytes_per_token(model)
    row: dict[str, Any] = {"moe": f"prepkit, dense {fmt}", "dense": fmt, "fixed_ms": fixed}
    row["bytes_per_token"] = floor_bytes
    row["floor_ms"], row["floor_36_ms"] = floors_ms(floor_bytes, args.layers, bw)
    row["graph_decode_tokens"] = same_tokens(model, args.decode_tokens)
    for tokens in args.prefill:
        row[f"prefill_{tokens}_ms"] = prefill_ms(model, tokens, args.warmup, args.iters)
    for key, compile in (("prepkit_graph", False), ("prepkit_graph_compiled_linear", True)):
        ms, decoder = decoder_step_ms(model, args.decode_tokens, True, args.iters, compile, "linear")
        row[f"{key}_ms_per_token"] = ms
        row[f"{key}_ms_per_layer"] = (ms - fixed) / args.layers
        del decoder
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--prefill", default="512,2048", help="comma-separated prefill lengths")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--skip-transformers-moe", action="store_true", help="only prepkit's MoE")
    parser.add_argument("--skip-static-compile", action="store_true")
    parser.add_argument(
        "--dense",
        default="bf16",
        help="comma-separated dense formats (prepare --dense); the first gets every row, the others the graph rows",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--workdir", type=Path, help="where the checkpoint and shards go (default: a temp dir)")
    args = parser.parse_args(argv)
    args.prefill = [int(t) for t in args.prefill.split(",") if t]
    args.dense = [f for f in args.dense.split(",") if f]
    if not torch.cuda.is_available():
        print("bench_transformers needs a CUDA device", file=sys.stderr)
        return 2
    try:
        import transformers
    except ImportError:
        print("bench_transformers needs transformers: pip install 'prepkit-gpt-oss[transformers]'", file=sys.stderr)
        return 2
    L = args.layers
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "layers": L,
        "vocab": args.vocab,
        "decode_tokens": args.decode_tokens,
        "prefill_tokens": args.prefill,
    }
    report["copy_bandwidth_bytes_per_s"] = bw = copy_bandwidth()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        root = Path(tmp)
        print(f"writing a {L}-layer real-dims checkpoint and its triton-moe shards ...", flush=True)
        t = time.perf_counter()
        src, prepared_sets, report["prepare_s"] = write_model(root, L, args.vocab, args.dense)
        prepared = prepared_sets[args.dense[0]]
        report["write_and_prepare_s"] = time.perf_counter() - t
        print(f"  {report['write_and_prepare_s']:.1f} s", flush=True)
        with torch.no_grad():
            if not args.skip_transformers_moe:
                torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                model = load_transformers(src)
                torch.cuda.synchronize()
                report["transformers_load_s"] = time.perf_counter() - t
                report["transformers_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                print("transformers' MoE ...", flush=True)
                rows.append(measure_decode(model, args, fixed_ms(model), "transformers"))
                del model
            shutil.rmtree(src)  # disk: the source is read once; prepkit's model needs only the prepared set
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            t = time.perf_counter()
            model = load_model(prepared)
            torch.cuda.synchronize()
            report["prepkit_load_s"] = time.perf_counter() - t
            report["prepkit_loaded_gib"] = (torch.cuda.memory_allocated() - before) / 2**30
            report["prepkit_load_peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
            report["fixed_ms"] = fixed = fixed_ms(model)
            report["bytes_per_token"] = floor_bytes = bytes_per_token(model)
            report["graph_decode_tokens"] = same_tokens(model, args.decode_tokens)
            print("prepkit's MoE ...", flush=True)
            row = measure_decode(model, args, fixed, "prepkit")
            row["dense"] = args.dense[0]
            for key, cuda_graph, compile, projections in (
                ("prepkit_eager", False, False, "linear"),
                ("prepkit_graph", True, False, "linear"),
                ("prepkit_graph_compiled_linear", True, True, "linear"),
                ("prepkit_graph_compiled", True, True, "reduction"),
            ):
                torch.cuda.reset_peak_memory_stats()
                ms, decoder = decoder_step_ms(model, args.decode_tokens, cuda_graph, args.iters, compile, projections)
                row[f"{key}_ms_per_token"] = ms
                row[f"{key}_ms_per_layer"] = (ms - fixed) / L
                row[f"{key}_peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
                if cuda_graph:
                    row[f"{key}_step_profile"] = step_profile(decoder)
                del decoder
            rows.append(row)
            layer0 = model.model.layers[0].mlp.moe_layer
            report["moe_host"] = moe_host_costs(layer0, model.config.hidden_size, model.config.num_local_experts)
            if not args.skip_static_compile:
                print("transformers' static cache + torch.compile with prepkit's MoE ...", flush=True)
                report["transformers_static_compile"] = try_transformers_static_compile(model, 32)
            for fmt in args.dense[1:]:
                del model
                gc.collect()
                torch.cuda.empty_cache()
                print(f"prepkit's MoE, dense weights in {fmt} ...", flush=True)
                model = load_model(prepared_sets[fmt])
                rows.append(dense_row(model, args, fmt, bw))
        report["warnings"] = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught})
    report["rows"] = rows
    report["floor_ms"], report["floor_36_ms"] = floors_ms(floor_bytes, L, bw)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print_table(report, rows)
    return 0


def print_table(report: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    L, fixed = report["layers"], report["fixed_ms"]
    print()
    print(report["moe_host"].pop("cprofile_1_token_500_calls", ""))
    print(json.dumps({k: v for k, v in report.items() if k not in ("rows", "moe_host")}, indent=1, default=str))
    print(json.dumps(report["moe_host"], indent=1))
    for row in rows:
        print(json.dumps(row, indent=1))
    print()
    print(
        f"{report['device']}, torch {report['torch']}, transformers {report['transformers']}; {L} layers at "
        f"gpt-oss-120b dims, vocab {report['vocab']:,}; copy bandwidth "
        f"{report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; "
        f"fixed part (embed, norm, lm_head, argmax) {fixed:.3f} ms"
    )
    print()
    print(
        f"| decode (batch 1) | ms/token, {L} layers | tok/s, {L} layers | ms/layer "
        "| scaled 36-layer tok/s | % of floor |"
    )
    print("|---|---|---|---|---|---|")
    floor, floor36 = report["floor_ms"], report["floor_36_ms"]
    print(f"| bandwidth floor | {floor:.3f} | {1e3 / floor:,.0f} | - | {1e3 / floor36:,.0f} | 100 |")
    for row in rows:
        if "floor_36_ms" in row:
            floor, floor36 = row["floor_ms"], row["floor_36_ms"]
            print(
                f"| bandwidth floor, dense {row['dense']} | {floor:.3f} | {1e3 / floor:,.0f} | - "
                f"| {1e3 / floor36:,.0f} | 100 |"
            )
    for row in rows:
        for key in (
            "transformers_loop", "prepkit_eager", "prepkit_graph", "prepkit_graph_compiled_linear",
            "prepkit_graph_compiled",
        ):  # fmt: skip
            if f"{key}_ms_per_token" not in row:
                continue
            ms, per_layer = row[f"{key}_ms_per_token"], row[f"{key}_ms_per_layer"]
            scaled = row.get("fixed_ms", fixed) + SCALED_LAYERS * per_layer
            floor = row.get("floor_36_ms", report["floor_36_ms"])  # each dense format has its own
            print(
                f"| {row['moe']} MoE, {key.replace('_', ' ')} | {ms:.3f} | {1e3 / ms:,.1f} | {per_layer:.3f} "
                f"| {1e3 / scaled:,.1f} | {100 * floor / scaled:.1f} |"
            )
    static = report.get("transformers_static_compile")
    if static:
        print(f"| prepkit MoE, transformers StaticCache + compile | {static} |")
    print()
    print("| prefill | " + " | ".join(f"{t} tok/s" for t in report["prefill_tokens"]) + " |")
    print("|---|" + "---|" * len(report["prefill_tokens"]))
    for row in rows:
        cells = " | ".join(f"{t / row[f'prefill_{t}_ms'] * 1e3:,.0f}" for t in report["prefill_tokens"])
        print(f"| {row['moe']} MoE | {cells} |")
    print()
    host = report["moe_host"]
    print("| moe() tokens | eager µs/call | host µs/call | CUDA graph µs/call |")
    print("|---|---|---|---|")
    for tokens, v in host.items():
        print(f"| {tokens} | {v['eager_us']:.1f} | {v['host_us']:.1f} | {v['graph_us']:.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
