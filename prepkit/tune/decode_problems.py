"""The decode problems ``prepkit tune --decode`` sweeps: each decode kernel's calls in one step of
a model, at a few batch sizes (and, for attention, context lengths).

A decode step has five sites (the op boundaries of :mod:`prepkit.kernels.decode`), each served by
one registered kernel (:data:`SITE_KERNELS`):

* ``qkv``: the fused q/k/v projection after the norm, ``(Hq + 2 * Hkv) * D`` rows of ``H``;
* ``router``: the router after the norm, ``E`` rows of ``H`` (bf16: the checkpoint's router);
* ``lm_head``: the output head after the final norm, ``vocab`` rows of ``H``;
* ``o``: the output projection with the residual add, ``H`` rows of ``Hq * D``;
* ``attention``: ``Hq`` query heads over the cache slots in use (``D`` and ``Hkv`` in ``extra``);
  128 slots are also what a sliding-window layer reads at any context.

The projections run in each dense weight format the source holds (a model: bf16 and every MX
format; a shard set: the one its manifest records), but for an mxfp4 lm_head, which the step runs
on the dense MX kernel (a dense problem). Shapes are a whole model's (TP 1).
Standard library only: the kernels are looked up by name, never imported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prepkit.errors import RecipeError
from prepkit.kernels.decode.problems import DECODE_CONTEXTS, attention_problem, on_tensor_cores, projection_problem
from prepkit.kernels.decode.variants import DecodeProblem

# The registered kernel (prepkit.kernels.decode.variants.KERNELS) that serves each site.
SITE_KERNELS: dict[str, str] = {
    "qkv": "norm_linear",
    "router": "norm_linear",
    "lm_head": "norm_linear",
    "o": "linear_residual",
    "attention": "rope_cache_attend",
}
# Rows per decode step: one sequence, and a few served together.
DECODE_BATCHES: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True)
class DecodeTarget:
    """One decode problem to sweep and what people call it."""

    site: str
    problem: DecodeProblem
    label: str  # e.g. "decode qkv norm_linear mxfp4 5120x2880 b1"


def _dim(config: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = config.get(name)
        if value is not None:
            if not isinstance(value, int) or value <= 0:
                raise RecipeError(f"the model config's {name} is {value!r}: decode shapes need a positive integer")
            return value
    raise RecipeError(f"the model config has no {names[0]}: the decode shapes need it")


def decode_formats(held: Sequence[str], *, from_shards: bool) -> list[str]:
    """The weight formats the projections are swept in: a model can be prepared in bf16 or any
    MX format ``held``; a shard set holds its MX format, or bf16 dense weights."""
    if from_shards:
        return list(held) or ["bf16"]
    return ["bf16", *held]


def decode_problems(
    config: Mapping[str, Any],
    formats: Sequence[str],
    *,
    batches: Sequence[int] = DECODE_BATCHES,
    contexts: Sequence[int] = DECODE_CONTEXTS,
) -> list[DecodeTarget]:
    """Every site's problems for a gpt-oss ``config`` (config.json keys), site by site.

    Raises:
        RecipeError: a dimension is missing or not a positive integer.
    """
    hidden = _dim(config, "hidden_size")
    heads, kv = _dim(config, "num_attention_heads"), _dim(config, "num_key_value_heads")
    head_dim, vocab = _dim(config, "head_dim"), _dim(config, "vocab_size")
    experts = _dim(config, "num_local_experts", "num_experts")
    shapes = {
        "qkv": ((heads + 2 * kv) * head_dim, hidden, list(formats)),
        "router": (experts, hidden, ["bf16"]),
        "lm_head": (vocab, hidden, list(formats)),
        "o": (hidden, heads * head_dim, list(formats)),
    }
    out: list[DecodeTarget] = []
    for site, (rows, cols, fmts) in shapes.items():
        kernel = SITE_KERNELS[site]
        for fmt in fmts:
            if on_tensor_cores(rows, fmt):
                continue  # the dense MX kernel runs it: a dense problem (tune --dense-formats)
            for b in batches:
                p = projection_problem(kernel, rows, cols, b, fmt)
                out.append(DecodeTarget(site, p, f"decode {site} {kernel} {fmt} {rows}x{cols} b{b}"))
    kernel = SITE_KERNELS["attention"]
    for ctx in contexts:
        for b in batches:
            p = attention_problem(b, heads, kv, head_dim, ctx, None, ctx)
            out.append(DecodeTarget("attention", p, f"decode attention {kernel} {heads}x{ctx} slots b{b}"))
    return out


def decode_targets(*, model: str | None, shards: Path | None) -> list[DecodeTarget]:
    """:func:`decode_problems` of a recipe (default gpt-oss-120b) or a prepared shard set.

    Raises:
        RecipeError: unknown recipe, or a config without the dims.
    """
    from prepkit.tune.dense import dense_source

    held, config, _ = dense_source(model=model, shards=shards)
    return decode_problems(config, decode_formats(held, from_shards=shards is not None))
