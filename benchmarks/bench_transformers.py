"""transformers' gpt-oss with its own MoE against the same model with prepkit's MoE swapped in.

    python -m benchmarks.bench_transformers [--layers 2] [--tokens 512] [--decode-tokens 32]
                                            [--experts 128] [--activations bf16] [--workdir DIR]

Writes a synthetic checkpoint at the real per-expert dims (H = I = 2880, ``--experts``, 1024-token
vocabulary) with ``prepkit synth``'s code, prepares it with ``--layout triton-moe``, then on one GPU:

- load: ``from_pretrained`` with MXFP4 dequantized on load, moved to the GPU (transformers' path),
  against ``use_prepkit_moe`` loading the prepared experts onto the GPU (the files were just
  written, so both read from the page cache);
- prefill: one forward of ``[1, --tokens]`` ids without a cache;
- decode: ``--decode-tokens`` single-token forwards on a KV cache after a 16-token prompt;

each timed with CUDA events after warmup, median of ``--iters``. The same model object runs both
rows: measured with transformers' experts, then swapped in place. Times are also given per decoder
layer (the small vocabulary keeps the head negligible), so that 36 layers scale from them. No
network: nothing is downloaded, no tokenizer is used.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_TOKENS = 16  # decode starts from a short prompt's cache


def cuda_ms(fn: Callable[[], None], warmup: int, iters: int, setup: Callable[[], None] | None = None) -> float:
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


def timed_s(fn: Callable[[], object]) -> tuple[float, object]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, result


def prefill_ms(model: torch.nn.Module, tokens: int, warmup: int, iters: int) -> float:
    ids = torch.randint(0, 1000, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def run() -> None:
        model(ids, use_cache=False)

    return cuda_ms(run, warmup, iters)


def decode_ms(model: torch.nn.Module, steps: int, warmup: int, iters: int) -> float:
    """Milliseconds for ``steps`` single-token forwards on a fresh cache each run."""
    g = torch.Generator("cuda").manual_seed(1)
    prompt = torch.randint(0, 1000, (1, PROMPT_TOKENS), device="cuda", generator=g)
    nxt = torch.randint(0, 1000, (steps, 1, 1), device="cuda", generator=g)
    state: dict[str, object] = {}

    def setup() -> None:
        state["cache"] = model(prompt, use_cache=True).past_key_values

    def run() -> None:
        cache = state["cache"]
        for step in range(steps):
            cache = model(nxt[step], past_key_values=cache, use_cache=True).past_key_values

    return cuda_ms(run, warmup, iters, setup)


def block_ms(model: torch.nn.Module, tokens: int, warmup: int, iters: int) -> float:
    """Median milliseconds of one MoE block (layer 0's ``mlp``) on ``[1, tokens, H]`` inputs."""
    block = model.model.layers[0].mlp
    g = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(1, tokens, model.config.hidden_size, device="cuda", generator=g).to(torch.bfloat16)

    def run() -> None:
        block(x)

    return cuda_ms(run, warmup, iters)


def measure(model: torch.nn.Module, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(prefill ms, decode ms, block ms at --tokens, block ms at 1 token)."""
    w, n = args.warmup, args.iters
    return (
        prefill_ms(model, args.tokens, w, n),
        decode_ms(model, args.decode_tokens, w, n),
        block_ms(model, args.tokens, w, n),
        block_ms(model, 1, w, n),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="prefill length")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--activations", default="bf16", choices=("bf16", "mxfp8", "mxfp4"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--workdir", type=Path, help="where the checkpoint and shards go (default: a temp dir)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_transformers needs a CUDA device", file=sys.stderr)
        return 2
    try:
        import transformers
    except ImportError:
        print("bench_transformers needs transformers: pip install 'prepkit[transformers]'", file=sys.stderr)
        return 2
    from click.testing import CliRunner

    from prepkit.cli import cli
    from prepkit.integrations.transformers import use_prepkit_moe
    from prepkit.synth import write_synthetic_checkpoint

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        print(
            f"writing a {args.layers}-layer, {args.experts}-expert checkpoint and its triton-moe shards ...", flush=True
        )
        src = write_synthetic_checkpoint(
            root / "model", num_layers=args.layers, num_experts=args.experts, vocab_size=1024, seed=0
        )
        result = CliRunner().invoke(
            cli, ["prepare", "--src", str(src), "--out", str(root / "triton"), "--layout", "triton-moe", "-q"]
        )
        if result.exit_code != 0:
            print(result.output, file=sys.stderr)
            return 1
        # Kept and listed after the table: an untuned tactic or a decomposed MX path explains a number.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")

            def load() -> torch.nn.Module:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(src), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16
                )
                return model.to("cuda").eval()

            tf_load_s, model = timed_s(load)
            rows: list[tuple[str, float, tuple[float, float, float, float]]] = []
            with torch.no_grad():
                rows.append(("transformers", tf_load_s, measure(model, args)))
                pk_load_s, _ = timed_s(lambda: use_prepkit_moe(model, root / "triton", activations=args.activations))
                rows.append((f"prepkit ({args.activations})", pk_load_s, measure(model, args)))
    L = args.layers
    print()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{L} layers, {args.experts} experts, H = I = 2880, top-4; prefill {args.tokens} tokens, "
        f"decode {args.decode_tokens} tokens after {PROMPT_TOKENS}; median of {args.iters}"
    )
    print()
    print(
        "| MoE | load s | load s/layer | prefill tok/s | prefill ms/layer | decode tok/s | decode ms/token/layer "
        "| MoE block ms, prefill | MoE block ms, 1 token | 36-layer prefill tok/s | 36-layer decode tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, load_s, (pre_ms, dec_ms, blk_ms, blk1_ms) in rows:
        pre_layer, dec_layer = pre_ms / L, dec_ms / args.decode_tokens / L
        print(
            f"| {name} | {load_s:.2f} | {load_s / L:.2f} | {args.tokens / pre_ms * 1e3:,.0f} | {pre_layer:.3f} "
            f"| {args.decode_tokens / dec_ms * 1e3:,.1f} | {dec_layer:.3f} | {blk_ms:.3f} | {blk1_ms:.3f} "
            f"| {args.tokens / (pre_layer * 36) * 1e3:,.0f} | {1e3 / (dec_layer * 36):,.1f} |"
        )
    print()
    print(
        "load: transformers = from_pretrained with MXFP4 dequantized on load + .to('cuda'), whole model; "
        "prepkit = use_prepkit_moe, the prepared experts onto the GPU (the rest of the model is transformers'). "
        "MoE block: layer 0's mlp alone (router + experts), eager, no CUDA graph."
    )
    seen = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught})
    if seen:
        print()
        print("warnings during the run:")
        for line in seen:
            print(f"- {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
