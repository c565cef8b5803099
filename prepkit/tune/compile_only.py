"""``prepkit tune --compile-only``: compile the layer's kernels for a GPU this machine lacks.

The layer comes from a recipe or a prepared shard set (TP rank 0, as the tuner tunes it); the
defaults over the asked token counts and a bounded sample of each variant family are compiled
for the reference device of ``--arch`` by :mod:`prepkit.kernels.compile_check`; with
``--dense-formats``, so are the dense MX linear's defaults at the source's dense shapes
(:func:`plan_compile_dense`, :func:`run_compile_dense`). Nothing here
touches a GPU or a tactics DB, and nothing is printed: the caller gets lines to show.
Importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prepkit.errors import DeviceError
from prepkit.kernels.device import ARCH_DEVICES
from prepkit.layer import LayerSource

if TYPE_CHECKING:
    from prepkit.kernels.compile_check import Candidate, CompileReport

# Architectures a compile-only run can target: those with a reference device.
COMPILE_ARCHES: tuple[str, ...] = tuple(ARCH_DEVICES)

LineFn = Callable[[str], None]


@dataclass(frozen=True)
class CompileOnlyResult:
    """Every kernel compiled (or not), and why the check fails (empty ``failures``: it passes)."""

    arch: str
    activations: str
    target: LayerSource
    per_family: int
    reports: list[CompileReport]
    failures: list[str]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """One line: what compiled, by origin, and the MMA the default GEMMs use."""
        defaults = [r for r in self.reports if r.origin.startswith("default")]
        sampled = [r for r in self.reports if r.origin.startswith("sample")]
        route = [r for r in self.reports if r.stage == "route"]
        mmas = sorted({r.mma or "none" for r in defaults if r.ok})
        return (
            f"{self.arch} ({ARCH_DEVICES[self.arch].name}) {self.activations}, {self.target.label}: "
            f"defaults {_count(defaults)}, MMA {', '.join(mmas) or '-'}; routing {_count(route)}; "
            f"sample ({self.per_family} per family) {_count(sampled)}; {self.elapsed_s:.0f} s"
        )


def _count(reports: Sequence[CompileReport]) -> str:
    ok = sum(r.ok for r in reports)
    pruned = sum(r.status == "pruned" for r in reports)
    failed = len(reports) - ok - pruned
    return (
        f"{ok}/{len(reports)} compiled"
        + (f", {pruned} pruned" if pruned else "")
        + (f", {failed} failed" if failed else "")
    )


def check_arch_name(arch: str) -> str:
    """``arch`` when a compile-only run can target it.

    Raises:
        DeviceError: ``auto`` (there is no GPU to detect) or an architecture without a reference
            device.
    """
    if arch not in ARCH_DEVICES:
        choices = ", ".join(f"{a} ({d.name})" for a, d in ARCH_DEVICES.items())
        why = "needs a named target: there is no GPU to detect" if arch == "auto" else "has no reference device"
        raise DeviceError(f"--compile-only with --arch {arch} {why}", hint=f"use --arch with one of {choices}")
    return arch


def run_compile_only(
    arch: str,
    activations: str,
    target: LayerSource,
    *,
    per_family: int = 1,
    points: Sequence[int] | None = None,
    on_line: LineFn | None = None,
) -> CompileOnlyResult:
    """Compile the defaults over ``points`` (the tactic table's token points by default) and
    ``per_family`` variants of each family of the variant spaces at the fewest and most tokens,
    for ``arch``'s reference device; ``on_line`` hears one line per kernel as it is done."""
    from prepkit.kernels import compile_check as cc
    from prepkit.kernels import require_triton
    from prepkit.kernels.activations import check_policy
    from prepkit.tactics.lookup import TOKEN_POINTS

    check_arch_name(arch)
    policy = check_policy(activations)
    require_triton("tune --compile-only")  # before any work: triton is the compiler it runs
    pts = tuple(points or TOKEN_POINTS)
    candidates = cc.check_candidates(
        arch, target.layer, policy, per_family, pts, sample_tokens=sorted({min(pts), max(pts)})
    )
    if on_line is not None:
        on_line(
            f"compiling {len(candidates)} GEMM variants and their routing for {arch} "
            f"({ARCH_DEVICES[arch].name}), {activations} activations, {target.label}"
        )

    def progress(done: int, total: int, cand: Candidate, reports: list[CompileReport]) -> None:
        if on_line is not None:
            for r in reports:
                on_line(progress_line(done, total, r))

    start = time.perf_counter()
    reports = cc.compile_variants(arch, target.layer, policy, candidates, on_progress=progress)
    return CompileOnlyResult(
        arch, activations, target, per_family, reports, cc.check_failures(reports), time.perf_counter() - start
    )


@dataclass(frozen=True)
class DenseCompileResult:
    """The dense linear's defaults in one weight format, compiled (or not)."""

    arch: str
    activations: str
    fmt: str
    source: str
    reports: list[CompileReport]
    failures: list[str]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """One line: what compiled, and the MMA the dense GEMMs use."""
        gemms = [r for r in self.reports if r.kernel != "_quantize_rows_kernel"]
        mmas = sorted({r.mma or "none" for r in gemms if r.ok})
        return (
            f"{self.arch} ({ARCH_DEVICES[self.arch].name}) {self.activations}, dense {self.fmt} of {self.source}: "
            f"defaults {_count(self.reports)}, MMA {', '.join(mmas) or '-'}; {self.elapsed_s:.0f} s"
        )


@dataclass(frozen=True)
class DensePlan:
    """The dense section of a compile-only run: the weight formats and the model's dense shapes."""

    formats: list[str]
    shapes: dict[str, tuple[int, int]]  # name -> (n, k)
    source: str


def plan_compile_dense(activations: str, *, model: str | None, shards: Path | None, choice: str | None) -> DensePlan:
    """The formats of ``choice`` (``--dense-formats``: ``none``/``None``, a format, ``all``) that the
    source holds and that pair with the policy (:func:`prepkit.tune.dense.dense_formats`), at the
    source's dense shapes. Checked before anything compiles.

    Raises:
        RecipeError: a ``choice`` the source or policy cannot take, or an unknown recipe.
    """
    from prepkit.kernels.activations import check_policy
    from prepkit.tune.dense import dense_formats, dense_shapes, dense_source

    if choice in (None, "none"):
        return DensePlan([], {}, "")
    held, config, source = dense_source(model=model, shards=shards)
    formats = dense_formats(choice, held, check_policy(activations), source)
    return DensePlan(formats, {s.name: (s.n, s.k) for s in dense_shapes(config)} if formats else {}, source)


def run_compile_dense(
    arch: str, activations: str, plan: DensePlan, *, on_line: LineFn | None = None
) -> list[DenseCompileResult]:
    """Compile the dense MX linear's defaults of each format of ``plan`` at its shapes for
    ``arch``'s reference device, one result per format."""
    if not plan.formats:
        return []
    from prepkit.kernels import compile_check as cc
    from prepkit.kernels import require_triton

    check_arch_name(arch)
    require_triton("tune --compile-only")
    out = []
    for fmt in plan.formats:
        candidates = cc.dense_candidates(arch, fmt, activations, plan.shapes)  # type: ignore[arg-type]
        if on_line is not None:
            on_line(
                f"compiling {len(candidates)} dense {fmt} variants for {arch} ({ARCH_DEVICES[arch].name}), "
                f"{activations} activations, {plan.source}"
            )
        start = time.perf_counter()
        reports = cc.compile_dense(arch, fmt, activations, candidates)  # type: ignore[arg-type]
        if on_line is not None:
            for i, r in enumerate(reports):
                on_line(progress_line(i + 1, len(reports), r))
        out.append(
            DenseCompileResult(
                arch, activations, fmt, plan.source, reports, cc.check_failures(reports), time.perf_counter() - start
            )
        )
    return out


def progress_line(done: int, total: int, r: CompileReport) -> str:
    """``[3/23] gemm1 m16n128k128... (default T=1-8): compiled 4.1 s, 153 regs, ...``"""
    from prepkit.kernels.tactic import GemmTactic

    kernel = r.kernel.strip("_").removesuffix("_kernel")
    what = f"{r.stage} {GemmTactic.from_json(r.tactic).key()}" if r.tactic else f"{r.stage} {kernel}"
    head = f"[{done}/{total}] {what} ({r.origin}): "
    if not r.ok:
        return head + f"{r.status}: {r.message.splitlines()[0] if r.message else ''}"
    facts = [
        "compiled" + (f" in {r.compile_s:.1f} s" if r.compile_s is not None else ""),
        f"{r.registers} regs" if r.registers is not None else "",
        f"{r.spill_bytes} B spilled" if r.spill_bytes else "",
        f"{r.shared_bytes} B shared" if r.shared_bytes is not None else "",
        r.mma,
    ]
    return head + ", ".join(f for f in facts if f)


@dataclass(frozen=True)
class DecodeCompileResult:
    """The decode kernels' defaults (projections and attention) at a model's shapes, compiled (or not)."""

    arch: str
    source: str
    reports: list[CompileReport]
    failures: list[str]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return (
            f"{self.arch} ({ARCH_DEVICES[self.arch].name}) decode kernels of {self.source}: "
            f"defaults {_count(self.reports)}; {self.elapsed_s:.0f} s"
        )


def run_compile_decode(
    arch: str, *, model: str | None, shards: Path | None, on_line: LineFn | None = None
) -> DecodeCompileResult:
    """Compile the decode step's kernels (the projections in every weight format at the source's
    dense shapes and the router's, and attention at its heads) for ``arch``'s reference device.

    Raises:
        RecipeError: an unknown recipe, or a config without the dims.
    """
    from prepkit.dims import dense_shapes
    from prepkit.kernels import compile_check as cc
    from prepkit.kernels import require_triton
    from prepkit.tune.dense import dense_source

    check_arch_name(arch)
    require_triton("tune --compile-only")
    _, config, source = dense_source(model=model, shards=shards)
    shapes = {s.name: (s.n, s.k) for s in dense_shapes(config)}
    experts = config.get("num_local_experts") or config.get("num_experts")
    if isinstance(experts, int):
        shapes["router"] = (experts, int(config["hidden_size"]))
    dims = (int(config["num_attention_heads"]), int(config["num_key_value_heads"]), int(config["head_dim"]))
    projections = cc.decode_candidates(shapes)
    attention = cc.attention_candidates(dims)
    if on_line is not None:
        on_line(
            f"compiling {len(projections)} decode projection and {len(attention)} decode attention variants for "
            f"{arch} ({ARCH_DEVICES[arch].name}), {source}"
        )
    start = time.perf_counter()
    reports = cc.compile_decode(arch, projections) + cc.compile_attention(arch, attention)
    if on_line is not None:
        for i, r in enumerate(reports):
            on_line(progress_line(i + 1, len(reports), r))
    return DecodeCompileResult(arch, source, reports, cc.check_failures(reports), time.perf_counter() - start)
