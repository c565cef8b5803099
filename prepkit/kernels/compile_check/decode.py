"""Compiling the decode projections (:mod:`prepkit.kernels.decode.gemv`): one launch of each op
(``norm_linear``, ``linear_residual``, ``linear``) per weight format, batch and distinct default
variant of the model's projection shapes, and the norm alone (``add_norm``, before a weight the
tensor cores run) per batch, inside the stand-in target (stage ``decode``).

The ops take no tactic of the GEMM kind, so a report's ``tactic`` is empty and its ``origin`` names
the op, weight format, shape, rows and the decode variant (``n..-k..-w..-s..-p..``; none for the
norm alone)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prepkit.kernels.compile_check._compiler import TargetCompiler
from prepkit.kernels.compile_check.candidates import arch_device
from prepkit.kernels.compile_check.report import CompileReport
from prepkit.kernels.decode.variants import DecodeVariant
from prepkit.mx_formats import MX_FORMATS, PANEL_BYTES

DECODE_OPS = ("norm_linear", "linear_residual", "linear")
NORM_OP = "add_norm"  # the norm alone, before a weight the dense MX kernel runs
DECODE_FORMATS = ("bf16", *MX_FORMATS)
DECODE_BATCHES: tuple[int, ...] = (1, 8)


@dataclass(frozen=True)
class DecodeCandidate:
    """One decode projection launch to compile."""

    op: str
    fmt: str
    n: int
    k: int
    batch: int
    variant: DecodeVariant | None  # None: the norm alone
    origin: str


def decode_candidates(
    shapes: Mapping[str, tuple[int, int]],
    formats: Iterable[str] = DECODE_FORMATS,
    batches: Iterable[int] = DECODE_BATCHES,
    ops: Iterable[str] = DECODE_OPS,
) -> list[DecodeCandidate]:
    """Each op's distinct default launches over ``shapes`` (name -> ``(n, k)``), ``formats`` and
    ``batches``: one per (op, format, rows, variant), the first shape that picks it; and the norm
    alone at each batch where a shape runs on the tensor cores in one of ``formats``."""
    from prepkit.kernels.decode.gemv import default_variant
    from prepkit.kernels.decode.problems import on_tensor_cores

    seen: dict[tuple[str, str, int, DecodeVariant | None], DecodeCandidate] = {}
    for op in ops:
        for fmt in formats:
            for batch in batches:
                for name, (n, k) in shapes.items():
                    v = default_variant(n, k, batch, fmt)
                    key = (op, fmt, batch, v)
                    if key not in seen:
                        origin = f"default {op} {fmt} {name} B={batch} {v.name()}"
                        seen[key] = DecodeCandidate(op, fmt, n, k, batch, v, origin)
    normed = [(name, n, k, fmt) for name, (n, k) in shapes.items() for fmt in formats if on_tensor_cores(n, fmt)]
    if normed:
        name, n, k, fmt = normed[0]
        for batch in batches:
            seen[(NORM_OP, fmt, batch, None)] = DecodeCandidate(
                NORM_OP, fmt, n, k, batch, None, f"default {NORM_OP} {fmt} {name} B={batch}"
            )
    return list(seen.values())


def compile_decode(arch: str, candidates: Iterable[DecodeCandidate]) -> list[CompileReport]:
    """Compile each candidate for ``arch``'s reference device; stage ``decode``."""
    device = arch_device(arch)
    out: list[CompileReport] = []
    with TargetCompiler(device) as tc:
        for cand in candidates:
            out.extend(tc.run(arch, "bf16", "decode", None, cand.origin, _decode_launch(cand)))
    return out


def _decode_launch(cand: DecodeCandidate) -> Any:
    import torch

    # Imported inside the stand-in target: the kernels must be compiler functions.
    from prepkit.kernels.decode import gemv
    from prepkit.kernels.mx.dense import DenseMxWeights

    def launch() -> None:
        bf16 = torch.bfloat16
        x = torch.empty((cand.batch, cand.k), dtype=bf16)
        add = torch.empty((cand.batch, cand.k), dtype=torch.float32)
        norm_weight = torch.empty(cand.k, dtype=bf16)
        if cand.op == NORM_OP:
            gemv.add_norm(x, add, norm_weight, 1e-5)
            return
        weight: gemv.Weight
        if cand.fmt == "bf16":
            weight = torch.empty((cand.n, cand.k), dtype=bf16)
        else:
            panels = -(-cand.k // MX_FORMATS[cand.fmt].panel_k)
            weight = DenseMxWeights(
                torch.empty((panels, cand.n, PANEL_BYTES), dtype=torch.uint8),
                torch.empty((cand.k // 32, cand.n), dtype=torch.uint8),
                cand.fmt,
            )
        bias = torch.empty(cand.n, dtype=bf16)
        if cand.op == "norm_linear":
            gemv.norm_linear(x, add, norm_weight, 1e-5, weight, bias, True, variant=cand.variant)
        elif cand.op == "linear_residual":
            residual = torch.empty((cand.batch, cand.n), dtype=bf16)
            gemv.linear_residual(x, weight, bias, residual, variant=cand.variant)
        else:
            gemv.linear(x, weight, bias, variant=cand.variant)

    return launch
