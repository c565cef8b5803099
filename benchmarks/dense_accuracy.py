"""Accuracy of MX dense weights (``prepare --dense mxfp8|mxfp4``) against bf16, on synthetic weights.

Two measurements per dense format, both on random weights with gpt-oss-like statistics (no real
weights are read, so this bounds the format's rounding, not a real model's quality):

1. Per tensor, at gpt-oss-120b's real shapes (q, k, v, o and the lm_head, the head in row
   chunks): ``||W_mx - W||_F / ||W||_F``, the worst element's error over the format's rounding
   bound (at most 1), the Frobenius bound that rule allows, and the share of nonzero elements
   that round to zero. Two weight distributions: Gaussian and Student-t (4 degrees of freedom,
   heavier tails), both with std 0.02 and 0.5 % of input columns 8x larger.
2. In transformers' ``GptOssForCausalLM`` built from a small config with gpt-oss-120b's attention
   and vocabulary (hidden 2880, 64 heads, 8 kv heads, head dim 64, vocab 201088; few layers and
   experts): the same model run with its q/k/v/o and lm_head weights replaced by what the kernel
   reads (``dequantize_kernel_layout(to_kernel_layout(W))``), everything else identical.
   Teacher-forced over one random token sequence per seed: the logits' relative error and
   greedy next-token agreement with the bf16 weights, over all positions and over those whose
   bf16 top-1 margin exceeds ``--margin`` (random weights give flat logits and many near-ties).

Weights are bf16 values; forwards run in float32 so that the difference measured is the
weight format's alone, not bf16 arithmetic's.

    python benchmarks/dense_accuracy.py [--seeds 0 1] [--positions 256] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from prepkit.layouts.dense_mx import (
    LAYER_DENSE_WEIGHTS,
    LM_HEAD_WEIGHT,
    MX_FORMATS,
    MxFormat,
    dequantize,
    dequantize_kernel_layout,
    is_dense_weight,
    quantize,
    rounding_bound,
    to_kernel_layout,
)
from prepkit.recipes import load_recipe, shape_of

MODEL = "gpt-oss-120b"
WEIGHT_STD = 0.02  # gpt-oss's projections sit near 1e-2 .. 3e-2; also transformers' init range
OUTLIER_COLUMN_SHARE = 0.005  # input channels whose weights run large (about 14 of 2880)
OUTLIER_GAIN = 8.0
STUDENT_T_DOF = 4.0  # heavy tails with a finite variance, so the std can be matched
DISTRIBUTIONS = ("gaussian", "student-t")
CHUNK_ROWS = 4096  # rows quantized at once: the e2m1 rounding holds 8 distances per element
DEFAULT_MARGIN = 0.2  # logits; top-1 gaps of random 201088-way logits are mostly ~0.1 .. 0.3


def dense_shapes(model: str = MODEL) -> dict[str, tuple[int, int]]:
    """Each dense weight kind (``q_proj``, ..., ``lm_head``) -> its ``[N, K]`` in ``model``."""
    recipe = load_recipe(model)
    shapes = {}
    for name in LAYER_DENSE_WEIGHTS:
        n, k = shape_of(recipe.layer_tensors[name], recipe.reference_dims)
        shapes[name.split(".")[1]] = (n, k)
    n, k = shape_of(recipe.global_tensors[LM_HEAD_WEIGHT], recipe.reference_dims)
    shapes[LM_HEAD_WEIGHT.split(".")[0]] = (n, k)
    return shapes


def dense_bytes_per_token(fmt: MxFormat | None, model: str = MODEL) -> int:
    """Bytes of every dense weight one decoded token reads: q/k/v/o of each layer and the
    lm_head (``fmt`` None: bf16). The embedding is read one row a token and is not counted."""
    layers = load_recipe(model).reference_dims["num_hidden_layers"]
    total = 0
    for kind, (n, k) in dense_shapes(model).items():
        stored = 2 * n * k if fmt is None else fmt.stored_bytes(n, k)
        total += stored * (1 if kind == "lm_head" else layers)
    return total


def outlier_columns(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    count = max(1, round(k * OUTLIER_COLUMN_SHARE))
    return torch.randperm(k, generator=g)[:count]


def synthetic_rows(rows: int, k: int, distribution: str, seed: int, outliers: torch.Tensor) -> torch.Tensor:
    """``[rows, k]`` bf16 weights: std :data:`WEIGHT_STD`, the ``outliers`` columns scaled up."""
    g = torch.Generator().manual_seed(seed)
    if distribution == "gaussian":
        w = torch.randn(rows, k, generator=g)
    elif distribution == "student-t":
        # t = z / sqrt(chi2 / dof); chi2 with dof degrees is Gamma(dof/2, scale 2). Unit variance.
        z = torch.randn(rows, k, generator=g)
        chi2 = torch._standard_gamma(torch.full((rows, k), STUDENT_T_DOF / 2), generator=g) * 2
        w = z / torch.sqrt(chi2 / STUDENT_T_DOF) * math.sqrt((STUDENT_T_DOF - 2) / STUDENT_T_DOF)
    else:
        raise ValueError(f"unknown distribution {distribution!r} (one of {', '.join(DISTRIBUTIONS)})")
    w *= WEIGHT_STD
    w[:, outliers] *= OUTLIER_GAIN
    return w.to(torch.bfloat16)


@dataclass(frozen=True)
class TensorError:
    tensor: str
    shape: tuple[int, int]
    format: str
    distribution: str
    relative_error: float  # ||W_mx - W||_F / ||W||_F
    relative_error_bound: float  # ||rounding bound||_F / ||W||_F: the most the rule allows
    max_error_over_bound: float  # worst element's |error| / its rounding bound; <= 1
    zeroed_share: float  # nonzero elements that round to zero


def tensor_error(
    tensor: str, shape: tuple[int, int], fmt: MxFormat, distribution: str, seed: int, chunk_rows: int = CHUNK_ROWS
) -> TensorError:
    """Quantize a synthetic ``shape`` weight ``chunk_rows`` rows at a time and measure it."""
    n, k = shape
    outliers = outlier_columns(k, seed)
    err2 = ref2 = bound2 = 0.0
    worst = 0.0
    zeroed = nonzero = 0
    for chunk, start in enumerate(range(0, n, chunk_rows)):
        rows = min(chunk_rows, n - start)
        w = synthetic_rows(rows, k, distribution, seed * 1_000_003 + chunk, outliers).float()
        codes, scales = quantize(w, fmt)
        err = (dequantize(codes, scales, fmt) - w).abs()
        bound = rounding_bound(w, scales, fmt)
        err2 += float(err.double().square().sum())
        ref2 += float(w.double().square().sum())
        bound2 += float(bound.double().square().sum())
        worst = max(worst, float((err / bound).max()))
        zeroed += int(((err == w.abs()) & (w != 0)).sum())
        nonzero += int((w != 0).sum())
    return TensorError(
        tensor,
        shape,
        fmt.name,
        distribution,
        math.sqrt(err2 / ref2),
        math.sqrt(bound2 / ref2),
        worst,
        zeroed / max(nonzero, 1),
    )


def mx_round_trip(weight: torch.Tensor, fmt: MxFormat, name: str, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """What the dense kernel reads for ``weight``: stored in its layout and decoded again.
    Row chunks are independent in the layout (one scale per 32 along K), so chunking is exact."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for start in range(0, weight.shape[0], chunk_rows):
        stored = to_kernel_layout(weight[start : start + chunk_rows], fmt, name)
        out[start : start + chunk_rows] = dequantize_kernel_layout(stored["blocks"], stored["scales"], fmt, name)
    return out


@dataclass(frozen=True)
class LogitsAgreement:
    relative_error: float  # ||logits_mx - logits_bf16||_F / ||logits_bf16||_F
    positions: int
    agreement: float  # share of positions whose argmax equals bf16's
    margin: float
    margin_positions: int  # positions whose bf16 top-1 leads top-2 by more than ``margin``
    margin_agreement: float


def logits_agreement(ref: torch.Tensor, out: torch.Tensor, margin: float = DEFAULT_MARGIN) -> LogitsAgreement:
    """Compare ``[positions, vocab]`` logits ``out`` with the reference ``ref``."""
    ref64, out64 = ref.double(), out.double()
    rel = float(torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64))
    same = ref.argmax(-1) == out.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > margin
    clear_count = int(clear.sum())
    return LogitsAgreement(
        rel,
        ref.shape[0],
        float(same.float().mean()),
        margin,
        clear_count,
        float(same[clear].float().mean()) if clear_count else float("nan"),
    )


def small_gpt_oss_config(layers: int, experts: int, vocab: int, **dims: int) -> Any:
    """gpt-oss-120b's attention and head dims (or ``dims``' overrides, by config key) with
    ``layers`` layers of ``experts`` experts, two routed per token."""
    from transformers import GptOssConfig

    real = load_recipe(MODEL).reference_dims
    keys = ("hidden_size", "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads")
    return GptOssConfig(
        num_hidden_layers=layers,
        num_local_experts=experts,
        num_experts_per_tok=min(2, experts),
        vocab_size=vocab,
        **{key: dims.get(key, real[key]) for key in keys},
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        initializer_range=WEIGHT_STD,
    )


def dense_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The model's Linear modules whose weights ``--dense`` quantizes, by checkpoint name."""
    return {
        name + ".weight": module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and is_dense_weight(name + ".weight")
    }


def build_model(config: Any, seed: int) -> torch.nn.Module:
    """A float32 ``GptOssForCausalLM`` holding bf16 values: transformers' init for everything,
    the dense weights drawn like the per-tensor measurement's Gaussian case."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "eager"  # the attention sinks need eager attention
    model = GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
        for index, (_, linear) in enumerate(sorted(dense_linears(model).items())):
            n, k = linear.weight.shape
            outliers = outlier_columns(k, seed * 1_000_003 + index)
            for start in range(0, n, CHUNK_ROWS):
                rows = min(CHUNK_ROWS, n - start)
                chunk_seed = (seed * 1_000_003 + index) * 1_000_003 + start
                linear.weight[start : start + rows] = synthetic_rows(rows, k, "gaussian", chunk_seed, outliers)
    return model


def teacher_forced_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=tokens.unsqueeze(0), use_cache=False).logits[0].float()


def model_agreement(
    config: Any, seed: int, formats: list[MxFormat], *, positions: int, margin: float = DEFAULT_MARGIN
) -> dict[str, LogitsAgreement]:
    """Per format, the logits of the model with MX dense weights against its bf16 self, and
    those of a control with Gaussian noise of the format's relative size in the same weights."""
    model = build_model(config, seed)
    tokens = torch.randint(config.vocab_size, (positions,), generator=torch.Generator().manual_seed(seed))
    ref = teacher_forced_logits(model, tokens)
    linears = dense_linears(model)
    originals = {name: linear.weight.detach().clone() for name, linear in linears.items()}
    noise = torch.Generator().manual_seed(seed + 1)
    results = {}
    for fmt in formats:
        err2 = ref2 = 0.0
        with torch.no_grad():
            for name, linear in linears.items():
                linear.weight.copy_(mx_round_trip(originals[name], fmt, name))
                err2 += float((linear.weight.double() - originals[name].double()).square().sum())
                ref2 += float(originals[name].double().square().sum())
        results[fmt.name] = logits_agreement(ref, teacher_forced_logits(model, tokens), margin)
        # The control: the same dense weights times (1 + eps * N(0, 1)), eps the format's own
        # relative error, separates what the format does from how much this random model
        # amplifies any perturbation of that size.
        eps = math.sqrt(err2 / ref2)
        with torch.no_grad():
            for name, linear in linears.items():
                w = originals[name]
                linear.weight.copy_(w * (1 + eps * torch.randn(w.shape, generator=noise)))
        results[f"noise {100 * eps:.1f} %"] = logits_agreement(ref, teacher_forced_logits(model, tokens), margin)
        with torch.no_grad():
            for name, linear in linears.items():
                linear.weight.copy_(originals[name])
    return results


def tensor_table(errors: list[TensorError]) -> str:
    lines = [
        "| tensor | shape | format | distribution | rel. error | bound (rule) | max err / bound | zeroed |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for e in errors:
        lines.append(
            f"| {e.tensor} | {e.shape[0]}x{e.shape[1]} | {e.format} | {e.distribution} | "
            f"{e.relative_error:.4f} | {e.relative_error_bound:.4f} | {e.max_error_over_bound:.3f} | "
            f"{100 * e.zeroed_share:.2f} % |"
        )
    return "\n".join(lines)


def model_table(results: dict[int, dict[str, LogitsAgreement]]) -> str:
    lines = [
        "| seed | dense weights | logits rel. error | greedy agreement | margin > τ: positions | agreement |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for seed, per_format in results.items():
        for name, a in per_format.items():
            lines.append(
                f"| {seed} | {name} | {a.relative_error:.4f} | {100 * a.agreement:.1f} % ({a.positions}) | "
                f"{a.margin_positions} | {100 * a.margin_agreement:.1f} % |"
            )
    return "\n".join(lines)


def bytes_table() -> str:
    lines = [
        "| format | dense bytes per token (gpt-oss-120b) |",
        "|---|---:|",
        f"| bf16 | {dense_bytes_per_token(None) / 1e9:.3f} GB |",
    ]
    for fmt in MX_FORMATS.values():
        lines.append(f"| {fmt.name} | {dense_bytes_per_token(fmt) / 1e9:.3f} GB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", choices=list(MX_FORMATS), default=list(MX_FORMATS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--parts", nargs="+", choices=["tensors", "model"], default=["tensors", "model"])
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=load_recipe(MODEL).reference_dims["vocab_size"])
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="top-1 margin (logits), τ")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    formats = [MX_FORMATS[name] for name in args.formats]
    started = time.perf_counter()

    print(bytes_table() + "\n", flush=True)
    errors: list[TensorError] = []
    if "tensors" in args.parts:
        for kind, shape in dense_shapes().items():
            for distribution in DISTRIBUTIONS:
                for fmt in formats:
                    errors.append(tensor_error(kind, shape, fmt, distribution, args.seeds[0]))
        print(tensor_table(errors) + "\n", flush=True)
    agreements: dict[int, dict[str, LogitsAgreement]] = {}
    if "model" in args.parts:
        for seed in args.seeds:
            config = small_gpt_oss_config(args.layers, args.experts, args.vocab)
            agreements[seed] = model_agreement(config, seed, formats, positions=args.positions, margin=args.margin)
        print(model_table(agreements), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s, torch {torch.__version__}, {torch.get_num_threads()} threads")

    if args.json:
        report = {
            "command": " ".join(sys.argv),
            "statistics": {
                "std": WEIGHT_STD,
                "outlier_column_share": OUTLIER_COLUMN_SHARE,
                "outlier_gain": OUTLIER_GAIN,
                "student_t_dof": STUDENT_T_DOF,
            },
            "dense_bytes_per_token": {
                "bf16": dense_bytes_per_token(None),
                **{f.name: dense_bytes_per_token(f) for f in MX_FORMATS.values()},
            },
            "tensors": [asdict(e) for e in errors],
            "model": {
                "config": {"layers": args.layers, "experts": args.experts, "vocab": args.vocab},
                "positions": args.positions,
                "results": {str(s): {f: asdict(a) for f, a in r.items()} for s, r in agreements.items()},
            },
        }
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
