"""The decode projections as :class:`~prepkit.kernels.decode.variants.DecodeKernel`\\ s (registered
on import as ``"norm_linear"`` and ``"linear_residual"``), with their torch references.

A problem's ``rows``/``cols`` are the weight's ``N``/``K``, ``fmt`` its format; ``extra`` may set
``("add", 0|1)``, ``("bias", 0|1)`` (both default 1) and, for ``norm_linear``, ``("normed", 0|1)``
(default 0): which optional operands a call passes.
"""

from __future__ import annotations

from typing import Any

import torch

from prepkit.kernels.decode.gemv import (
    Weight,
    candidate_variants,
    default_variant,
    linear_residual,
    norm_linear,
    weight_format,
    weight_shape,
)
from prepkit.kernels.decode.variants import DecodeProblem, DecodeVariant, register
from prepkit.kernels.mx.dense import DenseMxWeights
from prepkit.layouts.dense_mx import dequantize_kernel_layout, mx_format, to_kernel_layout

EPS = 1e-5  # gpt-oss's RMS norm epsilon
# Largest relative error (max |a - b| over max |b|) of a correct variant: the outputs round to
# bf16 (2^-8 relative) and a different fp32 summation order may flip a rounding.
TOLERANCE = 1e-2


def dequantized(weight: Weight) -> torch.Tensor:
    """The weight's values as fp32 ``[N, K]`` (MX codes decoded with their scales)."""
    if isinstance(weight, torch.Tensor):
        return weight.float()
    return dequantize_kernel_layout(weight.blocks, weight.scales, mx_format(weight.fmt))


def project_reference(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``bf16(x @ W^T + bias)`` with one fp32 accumulation."""
    out = x.float() @ dequantized(weight).T
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


def norm_linear_reference(
    hidden: torch.Tensor,
    add: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Weight,
    bias: torch.Tensor | None,
    want_normed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`~prepkit.kernels.decode.gemv.norm_linear` in torch operations, the eager modules' rounding."""
    summed = hidden if add is None else hidden + add.to(torch.bfloat16)
    x = summed.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    normed = (norm_weight * x).to(torch.bfloat16)
    return summed, project_reference(normed, weight, bias), normed if want_normed else None


def linear_residual_reference(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """:func:`~prepkit.kernels.decode.gemv.linear_residual` in torch operations."""
    return residual + project_reference(x, weight, bias)


def relative_error(got: Any, want: Any) -> float:
    """Largest relative error over the outputs (tensors or tuples of them, ``None`` matching ``None``):
    max |got - want| over max |want| per tensor.

    Raises:
        ValueError: the outputs differ in structure or shape.
    """
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            raise ValueError(f"outputs: got {type(got).__name__}, expected a tuple of {len(want)}")
        return max((relative_error(g, w) for g, w in zip(got, want, strict=True)), default=0.0)
    if want is None or got is None:
        if want is not got:
            raise ValueError(f"outputs: got {type(got).__name__}, expected {type(want).__name__}")
        return 0.0
    if got.shape != want.shape:
        raise ValueError(f"outputs: shape {list(got.shape)}, expected {list(want.shape)}")
    scale = want.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return float((got.float() - want.float()).abs().max() / scale)


def random_weight(n: int, k: int, fmt: str, generator: torch.Generator, device: Any) -> Weight:
    """A random ``[n, k]`` weight in ``fmt`` (bf16, or quantized to the stored MX form)."""
    w = (torch.randn((n, k), generator=generator) / k**0.5).to(torch.bfloat16)
    if fmt == "bf16":
        return w.to(device)
    stored = to_kernel_layout(w.float(), mx_format(fmt))
    return DenseMxWeights(stored["blocks"].to(device), stored["scales"].to(device), fmt)


def _flag(problem: DecodeProblem, name: str, default: int) -> bool:
    return bool(dict(problem.extra).get(name, default))


def _randn(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype, device: Any) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype).to(device)


class NormLinearKernel:
    """``norm_linear``: residual add, RMS norm and a projection in one launch."""

    name = "norm_linear"

    def default(self, problem: DecodeProblem) -> DecodeVariant:
        return default_variant(problem.rows, problem.cols, problem.batch, problem.fmt)

    def candidates(self, problem: DecodeProblem) -> list[DecodeVariant]:
        return candidate_variants(problem.rows, problem.cols, problem.batch, problem.fmt)

    def inputs(self, problem: DecodeProblem, device: Any, seed: int = 0) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        b, n, k = problem.batch, problem.rows, problem.cols
        return {
            "hidden": _randn((b, k), g, torch.bfloat16, device),
            "add": _randn((b, k), g, torch.float32, device) if _flag(problem, "add", 1) else None,
            "norm_weight": (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).to(device),
            "eps": EPS,
            "weight": random_weight(n, k, problem.fmt, g, device),
            "bias": _randn((n,), g, torch.bfloat16, device) if _flag(problem, "bias", 1) else None,
            "want_normed": _flag(problem, "normed", 0),
        }

    def launch(self, inputs: dict[str, Any], variant: DecodeVariant) -> Any:
        return norm_linear(**inputs, variant=variant)

    def reference(self, inputs: dict[str, Any]) -> Any:
        return norm_linear_reference(**inputs)

    def tolerance(self, problem: DecodeProblem) -> float:
        return TOLERANCE


class LinearResidualKernel:
    """``linear_residual``: a projection and the residual add in one launch."""

    name = "linear_residual"

    def default(self, problem: DecodeProblem) -> DecodeVariant:
        return default_variant(problem.rows, problem.cols, problem.batch, problem.fmt)

    def candidates(self, problem: DecodeProblem) -> list[DecodeVariant]:
        return candidate_variants(problem.rows, problem.cols, problem.batch, problem.fmt)

    def inputs(self, problem: DecodeProblem, device: Any, seed: int = 0) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        b, n, k = problem.batch, problem.rows, problem.cols
        return {
            "x": _randn((b, k), g, torch.bfloat16, device),
            "weight": random_weight(n, k, problem.fmt, g, device),
            "bias": _randn((n,), g, torch.bfloat16, device) if _flag(problem, "bias", 1) else None,
            "residual": _randn((b, n), g, torch.bfloat16, device),
        }

    def launch(self, inputs: dict[str, Any], variant: DecodeVariant) -> Any:
        return linear_residual(**inputs, variant=variant)

    def reference(self, inputs: dict[str, Any]) -> Any:
        return linear_residual_reference(**inputs)

    def tolerance(self, problem: DecodeProblem) -> float:
        return TOLERANCE


def problem_of(kernel: str, weight: Weight, batch: int, **flags: int) -> DecodeProblem:
    """The problem of ``batch`` rows of ``kernel`` through ``weight``; ``flags``: the extras
    (``add``, ``bias``, ``normed``) in name order."""
    n, k = weight_shape(weight)
    return DecodeProblem(kernel, n, k, batch, weight_format(weight), tuple(sorted(flags.items())))


NORM_LINEAR = register(NormLinearKernel())
LINEAR_RESIDUAL = register(LinearResidualKernel())
