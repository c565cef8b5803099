"""Compiling the dense MX linear's defaults: one launch of ``mx_linear`` per distinct default
variant of the model's dense shapes, inside the stand-in target (stage ``dense``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.kernels.compile_check._compiler import TargetCompiler
from prepkit.kernels.compile_check.candidates import arch_device
from prepkit.kernels.compile_check.report import CompileReport
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import dense_default, dense_invalid_reason
from prepkit.mx_formats import MX_FORMATS, PANEL_BYTES

# The token counts whose defaults are compiled: where the dense tiles change (16, 32, 64 rows).
DENSE_TOKENS: tuple[int, ...] = (1, 8, 64, 512)


@dataclass(frozen=True)
class DenseCandidate:
    """One dense variant to compile: weight format, shape and token count of the launch."""

    fmt: str
    tactic: GemmTactic
    origin: str
    n: int
    k: int
    num_tokens: int


def dense_candidates(
    arch: str,
    fmt: str,
    activations: ActivationPolicy,
    shapes: Mapping[str, tuple[int, int]],
    token_points: Iterable[int] = DENSE_TOKENS,
) -> list[DenseCandidate]:
    """The distinct default variants of the dense linear on ``fmt`` weights over the model's dense
    ``shapes`` (name -> ``(n, k)``: :func:`prepkit.tune.dense.dense_shapes`) and ``token_points``."""
    device = arch_device(arch)
    seen: dict[GemmTactic, DenseCandidate] = {}
    for name, (n, k) in shapes.items():
        for m in token_points:
            t = dense_default(m, n, k, fmt, device, activations)
            if t not in seen:
                seen[t] = DenseCandidate(fmt, t, f"default {name} T={m}", n, k, m)
    return list(seen.values())


def compile_dense(
    arch: str, fmt: str, activations: ActivationPolicy, candidates: Iterable[DenseCandidate]
) -> list[CompileReport]:
    """Compile each dense candidate (and its row quantizer, for an MX policy) for ``arch``'s
    reference device, as :func:`~prepkit.kernels.compile_check.moe.compile_variants` does the MoE
    GEMMs; stage ``dense``."""
    check_policy(activations)
    device = arch_device(arch)
    out: list[CompileReport] = []
    with TargetCompiler(device) as tc:
        for cand in candidates:
            reason = dense_invalid_reason(cand.tactic, fmt, device, activations)
            if reason is not None:
                out.append(
                    CompileReport(arch, activations, "dense", cand.tactic.to_json(), cand.origin, "pruned", reason)
                )
                continue
            out.extend(tc.run(arch, activations, "dense", cand.tactic, cand.origin, _dense_launch(cand, activations)))
    return out


def _dense_launch(cand: DenseCandidate, activations: str) -> Any:
    import torch

    # Imported inside the stand-in target: the kernels must be compiler functions.
    from prepkit.kernels.mx.dense import DenseMxWeights, mx_linear

    def launch() -> None:
        panels = -(-cand.k // MX_FORMATS[cand.fmt].panel_k)
        w = DenseMxWeights(
            torch.empty((panels, cand.n, PANEL_BYTES), dtype=torch.uint8),
            torch.empty((cand.k // 32, cand.n), dtype=torch.uint8),
            cand.fmt,
        )
        x = torch.empty((cand.num_tokens, cand.k), dtype=torch.bfloat16)
        bias = torch.empty(cand.n, dtype=torch.bfloat16)
        mx_linear(x, w, bias, activations=check_policy(activations), tactic=cand.tactic)

    return launch
