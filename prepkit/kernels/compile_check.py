"""Compile the MoE kernel for a GPU this machine does not have, and read what the compiler made.

The real launchers of :mod:`prepkit.kernels.mx` run on CPU tensors of the layer's real
shapes (``torch.empty``: nothing is touched) while Triton's active driver is a stand-in whose
current target is the chosen architecture. Triton's JIT specializes every launch exactly as it
would on that GPU (divisibility by 16, integers equal to 1, constexprs, options); a cache hook
records that specialization and tells the JIT to launch nothing; the recorded specializations are
then compiled through ``JITFunction.preload`` (Triton's own path from specialization to binary).
No GPU, no CUDA driver, no tactic DB. Works with triton 3.6 and 3.9.

Per compiled kernel a :class:`CompileReport` holds: registers and local-memory (spill) bytes per
thread (``cuobjdump --dump-resource-usage``), the shared memory a launch would request (Triton's
metadata), the PTX ``.target`` and matrix instruction (native block-scaled MMA, bf16 ``mma.sync``,
``wgmma``), and the SASS instructions of one K step: the loop that holds the matrix instructions,
found by its back-edge branch in the ``nvdisasm`` listing (docs/sm12x.md explains the method).
Variants that :func:`~prepkit.kernels.variants.invalid_reason` rejects are reported as pruned with
its reason and never reach the compiler.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import Any, Literal

from prepkit.errors import DeviceError
from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.kernels.device import ARCH_DEVICES, DeviceInfo, lowers_natively
from prepkit.kernels.tactic import FAMILY_KNOBS, GemmTactic
from prepkit.kernels.variants import GEMMS, Gemm, default_tactics, enumerate_tactics, invalid_reason
from prepkit.layer import RankLayer

Status = Literal["compiled", "pruned", "failed"]
Stage = Literal["route", "gemm1", "gemm2", "dense"]
# Called after each candidate: (candidates done, candidates in all, the candidate, its reports,
# routing kernels compiled just before it included).
ProgressFn = Callable[[int, int, "Candidate", "list[CompileReport]"], None]

# The matrix instruction a kernel's PTX uses, most specific first: (label, regex on the PTX).
_MMA_KINDS: tuple[tuple[str, str], ...] = (
    ("block_scale mxf8f6f4", r"mma\.sync\.aligned\.\S*kind::mxf8f6f4\.block_scale\S*"),
    ("block_scale mxf4nvf4", r"mma\.sync\.aligned\.\S*kind::mxf4nvf4\.block_scale\S*"),
    ("block_scale mxf4", r"mma\.sync\.aligned\.\S*kind::mxf4\.block_scale\S*"),
    ("wgmma", r"wgmma\.mma_async\S*"),
    ("tcgen05", r"tcgen05\.mma\S*"),
    ("mma.sync bf16", r"mma\.sync\.aligned\.\S*\.bf16\.bf16\S*"),
    ("mma.sync fp16", r"mma\.sync\.aligned\.\S*\.f16\.f16\S*"),
    ("mma.sync", r"mma\.sync\.aligned\.\S*"),
)
# What each policy's GEMMs must use where Triton lowers MX natively (on sm_120a / sm_121a, the
# targets with a reference device: block-scaled mma.sync).
NATIVE_MMA: dict[str, str] = {"mxfp8": "block_scale mxf8f6f4", "mxfp4": "block_scale mxf4nvf4"}
_FRESH_PROCESS_HINT = (
    "compile in a process that imports triton without TRITON_INTERPRET (prepkit tune --compile-only does)"
)


@dataclass(frozen=True)
class CompileReport:
    """One kernel of one variant, compiled (or not) for one architecture."""

    arch: str  # "sm90", "sm120", "sm121"
    activations: str
    stage: str  # "route", "gemm1", "gemm2"
    tactic: str  # canonical JSON of the GemmTactic; "" for routing
    origin: str  # "default" (and for which token counts) or the variant family it samples
    status: Status
    message: str = ""  # the pruning reason or the compiler's message
    kernel: str = ""
    ptx_target: str = ""  # e.g. "sm_120a"
    registers: int | None = None
    spill_bytes: int | None = None  # local memory per thread (Triton kernels keep no local arrays)
    shared_bytes: int | None = None  # dynamic shared memory a launch requests
    mma: str = ""  # label from _MMA_KINDS, "" when the kernel has no matrix instruction
    mma_instruction: str = ""  # the PTX instruction as written
    k_step_instructions: int | None = None  # SASS instructions in the K loop body
    k_step_mma: int | None = None  # of which matrix instructions
    instructions_per_4_weight_bytes: float | None = None
    compile_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "compiled"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reports_to_json(reports: Iterable[CompileReport]) -> str:
    """A JSON array of the reports (one object each, fields as in :class:`CompileReport`)."""
    return json.dumps([r.to_dict() for r in reports], indent=1)


def format_reports(reports: Sequence[CompileReport]) -> str:
    """A plain-text table, one line per report."""
    head = (
        "arch",
        "act",
        "stage",
        "kernel",
        "tactic",
        "origin",
        "status",
        "regs",
        "spill",
        "smem",
        "mma",
        "k-step",
        "/4B",
    )
    rows = [head]
    for r in reports:
        tactic = GemmTactic.from_json(r.tactic).key() if r.tactic else "-"
        rows.append(
            (
                r.arch,
                r.activations,
                r.stage,
                r.kernel.strip("_").removesuffix("_kernel"),
                tactic,
                r.origin,
                r.status if r.ok else f"{r.status}: {r.message.splitlines()[0][:90] if r.message else ''}",
                _cell(r.registers),
                _cell(r.spill_bytes),
                _cell(r.shared_bytes),
                r.mma or "-",
                "-" if r.k_step_instructions is None else f"{r.k_step_instructions} ({r.k_step_mma} mma)",
                "-" if r.instructions_per_4_weight_bytes is None else f"{r.instructions_per_4_weight_bytes:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows)


def _cell(v: int | None) -> str:
    return "-" if v is None else str(v)


# --------------------------------------------------------------------------------------------
# what to compile


@dataclass(frozen=True)
class Candidate:
    """One GEMM variant to compile, and why it was picked."""

    gemm: Gemm
    tactic: GemmTactic
    origin: str
    num_tokens: int = 1  # the launch's token count (only routing specializes on it)


def default_candidates(
    arch: str, shape: RankLayer, activations: ActivationPolicy, token_points: Iterable[int] | None = None
) -> list[Candidate]:
    """The distinct default variants of both GEMMs over ``token_points`` (the tactic table's points
    by default), each with the token counts it is the default for, in GEMM then first-point order."""
    from prepkit.kernels.variants import policy_variant

    if token_points is None:
        from prepkit.tactics.lookup import TOKEN_POINTS

        token_points = TOKEN_POINTS
    device = arch_device(arch)
    seen: dict[tuple[Gemm, GemmTactic], list[int]] = {}
    for m in token_points:
        pair = default_tactics(shape.problem(m), device, activations)
        for gemm, t in zip(GEMMS, pair, strict=True):
            seen.setdefault((gemm, policy_variant(t, gemm, device, activations)), []).append(m)
    return [
        Candidate(gemm, t, f"default T={_ranges(points)}", points[0])
        for gemm in GEMMS
        for (g, t), points in seen.items()
        if g == gemm
    ]


def family(t: GemmTactic, activations: ActivationPolicy = "bf16") -> str:
    """The variant family: the values of the path knobs (:data:`~prepkit.kernels.tactic.FAMILY_KNOBS`:
    how the weights are decoded, loaded and fed to the MMA, how the K loop ends) and whether the
    tile swaps operands, then the knobs of swapped bf16-upcast tiles where the tile is one; tile
    sizes, warps, stages and split-K vary inside a family."""
    from prepkit.kernels.variants import swaps_operands

    swap = swaps_operands(t, activations)
    parts = [str(getattr(t, k.name)) for k in FAMILY_KNOBS if not k.swapped_only]
    parts.append("swap" if swap else "plain")
    if swap and activations == "bf16" and t.upcast != "dot_scaled":
        parts += [str(getattr(t, k.name)) for k in FAMILY_KNOBS if k.swapped_only]
    return "/".join(parts)


def sample_candidates(
    arch: str, shape: RankLayer, activations: ActivationPolicy, per_family: int = 2, num_tokens: int = 1
) -> list[Candidate]:
    """A bounded, deterministic sample of the valid variant space: per GEMM and family (see
    :func:`family`), ``per_family`` variants spread evenly over the family's stable order (its
    first, its last, and evenly between), for the space of ``num_tokens``-token problems."""
    device = arch_device(arch)
    out: list[Candidate] = []
    for gemm in GEMMS:
        groups: dict[str, list[GemmTactic]] = {}
        for t in enumerate_tactics(gemm, device, shape.problem(num_tokens), activations):
            groups.setdefault(family(t, activations), []).append(t)
        for name, members in groups.items():
            for t in _spread(members, per_family):
                out.append(Candidate(gemm, t, f"sample {name}", num_tokens))
    return out


def _spread(items: Sequence[GemmTactic], count: int) -> list[GemmTactic]:
    if count <= 0 or not items:
        return []
    if count >= len(items):
        return list(items)
    if count == 1:
        return [items[0]]
    picks = sorted({round(i * (len(items) - 1) / (count - 1)) for i in range(count)})
    return [items[i] for i in picks]


def _ranges(points: Sequence[int]) -> str:
    """``[1, 2, 3, 8, 12]`` -> ``"1-3,8,12"``: consecutive runs of the token points, by value."""
    out: list[str] = []
    start = prev = points[0]
    for p in [*points[1:], None]:
        if p is not None and p == prev + 1:
            prev = p
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if p is not None:
            start = prev = p
    return ",".join(out)


def arch_device(arch: str) -> DeviceInfo:
    """The reference device of ``arch`` (:data:`~prepkit.kernels.device.ARCH_DEVICES`)."""
    try:
        return ARCH_DEVICES[arch]
    except KeyError:
        raise DeviceError(
            f"unknown --arch {arch!r}", hint=f"use one of {', '.join(ARCH_DEVICES)} (sm_90, sm_120, sm_121)"
        ) from None


# --------------------------------------------------------------------------------------------
# compiling


def compile_variants(
    arch: str,
    shape: RankLayer,
    activations: ActivationPolicy,
    candidates: Iterable[Candidate],
    *,
    routing: bool = True,
    small_scales: bool = True,
    on_progress: ProgressFn | None = None,
) -> list[CompileReport]:
    """Compile every candidate (and, with ``routing``, the routing kernels once per token count)
    for ``arch``'s reference device. Pruned candidates are reported with their reason, compiler
    errors as messages; nothing raises for a variant. ``small_scales``: the runtime's fold of
    scales <= 2 into the inline-PTX upcast (``mx.upcast_id``), true of real checkpoints'
    scales when every E8M0 byte is at most 128. ``on_progress`` hears of each candidate as it is
    done (a compile takes seconds)."""
    check_policy(activations)
    device = arch_device(arch)
    todo = list(candidates)
    out: list[CompileReport] = []
    with _TargetCompiler(device) as tc:
        kernels = tc.kernels
        route_done: set[int] = set()
        for i, cand in enumerate(todo):
            mine: list[CompileReport] = []
            if routing and cand.num_tokens not in route_done:
                route_done.add(cand.num_tokens)
                mine.extend(tc.run(arch, activations, "route", None, f"T={cand.num_tokens}", _route_launch(
                    kernels, shape, activations, cand.num_tokens)))  # fmt: skip
            reason = invalid_reason(cand.tactic, cand.gemm, device, activations)
            if reason is not None:
                mine.append(
                    CompileReport(arch, activations, cand.gemm, cand.tactic.to_json(), cand.origin, "pruned", reason)
                )
            else:
                launch = _gemm_launch(kernels, shape, activations, cand, small_scales)
                mine.extend(tc.run(arch, activations, cand.gemm, cand.tactic, cand.origin, launch))
            out.extend(mine)
            if on_progress is not None:
                on_progress(i + 1, len(todo), cand, mine)
    return out


def check_arch(
    arch: str,
    shape: RankLayer,
    activations: ActivationPolicy,
    *,
    per_family: int = 2,
    token_points: Iterable[int] | None = None,
    sample_tokens: Sequence[int] = (1,),
    on_progress: ProgressFn | None = None,
) -> list[CompileReport]:
    """The compile-only check of one arch and policy: the defaults over ``token_points``, then
    ``per_family`` sampled variants of each family (:func:`sample_candidates`) of the variant
    spaces of ``sample_tokens``-token problems (one token admits only 16-row tiles; a large count
    admits every tile), each variant once."""
    return compile_variants(
        arch, shape, activations, check_candidates(arch, shape, activations, per_family, token_points, sample_tokens),
        on_progress=on_progress,
    )  # fmt: skip


def check_candidates(
    arch: str,
    shape: RankLayer,
    activations: ActivationPolicy,
    per_family: int = 2,
    token_points: Iterable[int] | None = None,
    sample_tokens: Sequence[int] = (1,),
) -> list[Candidate]:
    """What :func:`check_arch` compiles: the defaults, then the samples not already among them."""
    out = default_candidates(arch, shape, activations, token_points)
    seen = {(c.gemm, c.tactic) for c in out}
    for m in sample_tokens:
        for c in sample_candidates(arch, shape, activations, per_family, m):
            if (c.gemm, c.tactic) not in seen:
                seen.add((c.gemm, c.tactic))
                out.append(c)
    return out


def failed_defaults(reports: Iterable[CompileReport]) -> list[CompileReport]:
    """Reports of default variants (and routing) that did not compile: a non-zero exit."""
    return [r for r in reports if not r.ok and (r.origin.startswith("default") or r.stage == "route")]


def check_failures(reports: Sequence[CompileReport]) -> list[str]:
    """Why the check fails, one line per kernel naming its stage, kernel and tactic (empty when
    it passes): a default or routing kernel that did not compile, or, for an MX policy where
    Triton lowers MX natively (:func:`~prepkit.kernels.device.lowers_natively`), a compiled
    default GEMM whose PTX lacks the native block-scaled MMA (:data:`NATIVE_MMA`): without it
    the policy runs decomposed, which is what the policy exists to avoid."""
    lines = [
        f"{_name(r)}: {r.status}: {r.message.splitlines()[0] if r.message else ''}" for r in failed_defaults(reports)
    ]
    for r in reports:
        want = NATIVE_MMA.get(r.activations)
        if (
            want is not None
            and r.ok
            and r.stage in ("gemm1", "gemm2", "dense")
            and r.kernel != "_quantize_rows_kernel"  # the dense kernel's row quantizer: no matrix unit
            and r.origin.startswith("default")
            and lowers_natively(arch_device(r.arch).capability)
            and r.mma != want
        ):
            lines.append(f"{_name(r)}: PTX holds {r.mma or 'no matrix instruction'}, not the native {want}")
    return lines


def _name(r: CompileReport) -> str:
    tactic = f" {GemmTactic.from_json(r.tactic).key()}" if r.tactic else ""
    kernel = f" {r.kernel}" if r.kernel else ""  # a pruned variant never got as far as a kernel
    return f"{r.arch} {r.activations} {r.stage}{kernel}{tactic} ({r.origin})"


# --------------------------------------------------------------------------------------------
# the dense MX linear

# gpt-oss's dense shapes (N, K): fused q/k/v, o_proj, lm_head.
DENSE_SHAPES: dict[str, tuple[int, int]] = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}
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
    arch: str, fmt: str, activations: ActivationPolicy, token_points: Iterable[int] = DENSE_TOKENS
) -> list[DenseCandidate]:
    """The distinct default variants of the dense linear on ``fmt`` weights over gpt-oss's dense
    shapes and ``token_points``."""
    from prepkit.kernels.variants import dense_default

    device = arch_device(arch)
    seen: dict[GemmTactic, DenseCandidate] = {}
    for name, (n, k) in DENSE_SHAPES.items():
        for m in token_points:
            t = dense_default(m, n, k, fmt, device, activations)
            if t not in seen:
                seen[t] = DenseCandidate(fmt, t, f"default {name} T={m}", n, k, m)
    return list(seen.values())


def compile_dense(
    arch: str, fmt: str, activations: ActivationPolicy, candidates: Iterable[DenseCandidate]
) -> list[CompileReport]:
    """Compile each dense candidate (and its row quantizer, for an MX policy) for ``arch``'s
    reference device, as :func:`compile_variants` does the MoE GEMMs; stage ``dense``."""
    from prepkit.kernels.variants import dense_invalid_reason

    check_policy(activations)
    device = arch_device(arch)
    out: list[CompileReport] = []
    with _TargetCompiler(device) as tc:
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

    from prepkit.kernels.mx.dense import DenseMxWeights, mx_linear
    from prepkit.layouts.dense_mx import mx_format

    def launch() -> None:
        panels = -(-cand.k // mx_format(cand.fmt).panel_k)
        w = DenseMxWeights(
            torch.empty((panels, cand.n, 128), dtype=torch.uint8),
            torch.empty((cand.k // 32, cand.n), dtype=torch.uint8),
            cand.fmt,
        )
        x = torch.empty((cand.num_tokens, cand.k), dtype=torch.bfloat16)
        bias = torch.empty(cand.n, dtype=torch.bfloat16)
        mx_linear(x, w, bias, activations=check_policy(activations), tactic=cand.tactic)

    return launch


def dense_main(argv: Sequence[str] | None = None) -> int:
    """``python -m prepkit.kernels.compile_check --arch sm121 --weights mxfp4 --activations mxfp8``:
    compile the dense linear's defaults for the arch, print the table; exit 1 when a default fails
    to compile or, for an MX policy on SM12x, lacks the native block-scaled MMA."""
    import argparse

    parser = argparse.ArgumentParser(description="compile-only check of the dense MX linear's defaults")
    parser.add_argument("--arch", required=True, choices=list(ARCH_DEVICES))
    parser.add_argument("--weights", required=True, choices=["mxfp4", "mxfp8"])
    parser.add_argument("--activations", default="bf16", choices=["bf16", "mxfp8", "mxfp4"])
    args = parser.parse_args(argv)
    if args.activations == "mxfp4" and args.weights != "mxfp4":
        parser.error("activations mxfp4 need mxfp4 weights")
    leave_interpreter()
    reports = compile_dense(args.arch, args.weights, args.activations, dense_candidates(
        args.arch, args.weights, args.activations))  # fmt: skip
    print(format_reports(reports))
    failures = check_failures(reports)
    for line in failures:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failures else 0


def _route_launch(k: ModuleType, shape: RankLayer, activations: str, num_tokens: int) -> Any:
    import torch

    def launch() -> None:
        x = torch.empty((num_tokens, shape.hidden), dtype=torch.bfloat16)
        logits = torch.empty((num_tokens, shape.num_experts), dtype=torch.bfloat16)
        k.route(
            logits, top_k=shape.top_k, expert_lo=shape.expert_lo, num_local_experts=shape.num_local_experts,
            hidden=shape.hidden, hidden_states=x, activations=activations,
        )  # fmt: skip

    return launch


def _gemm_launch(k: ModuleType, shape: RankLayer, activations: str, cand: Candidate, small_scales: bool) -> Any:
    """A launch of ``cand``'s GEMM on CPU tensors of the rank's real shapes (lazy allocations)."""
    import torch

    from prepkit.layouts.triton_moe import tensor_specs

    def launch() -> None:
        T, H, E = cand.num_tokens, shape.hidden, shape.num_local_experts
        specs = tensor_specs(E, H, shape.padded_intermediate)
        w = {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in specs.items()}
        counts = torch.empty(E, dtype=torch.int32)
        picks = torch.empty(max(T * shape.top_k, 1), dtype=torch.int32)
        ids = torch.empty((T, shape.top_k), dtype=torch.int32)
        weights = torch.empty((T, shape.top_k), dtype=torch.float32)
        out = torch.empty((T, H), dtype=torch.float32)
        mx = activations != "bf16"
        x = torch.empty((T, H), dtype=torch.bfloat16)
        x_mx = k.MxRows.empty(T, H, activations, x.device) if mx else None
        routing = k.Routing(T, shape.top_k, E, counts, picks, ids, weights, out, activations, x_mx)
        if cand.gemm == "gemm1":
            k.gemm1_swiglu(
                routing, x, w["w13_blocks"], w["w13_scales"], w["w13_bias"],
                valid_intermediate=shape.valid_intermediate, tactic=cand.tactic, small_scales=small_scales,
                activations=activations,
            )  # fmt: skip
        else:
            rows, cols = T * shape.top_k, shape.valid_intermediate
            h1 = (
                k.MxRows.empty(rows, cols, activations, x.device)
                if mx
                else torch.empty((rows, cols), dtype=torch.bfloat16)
            )
            k.gemm2_combine(
                routing, h1, w["w2_blocks"], w["w2_scales"], w["w2_bias"], tactic=cand.tactic,
                small_scales=small_scales, activations=activations,
            )  # fmt: skip

    return launch


class _StandInDriver:
    """Triton's active driver while compiling: reports ``target`` as the current GPU and a device
    key of its own (so the JIT's per-device caches never mix with a real GPU's)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.key = f"prepkit-compile-check:{target.backend}:{target.arch}"

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> str:
        return self.key

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the compile check never builds a launcher")

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("the compile check never times")


class _TargetCompiler:
    """Context in which kernel launches compile for ``device`` and launch nothing."""

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self.capability = device.capability[0] * 10 + device.capability[1]
        self._stack = contextlib.ExitStack()
        self._tools = _NvidiaTools()
        self._done: dict[tuple[str, str], tuple[Any, float] | BaseException] = {}

    def __enter__(self) -> _TargetCompiler:
        import triton
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver

        self.triton = triton
        if interpreter_imported():
            raise DeviceError(
                "triton was imported with TRITON_INTERPRET=1: its own @jit functions are interpreter "
                "functions, so nothing compiles ahead of time in this process",
                hint=_FRESH_PROCESS_HINT,
            )
        self._stack.enter_context(_env("TRITON_INTERPRET", None))
        if "TRITON_DEFAULT_FP_FUSION" not in os.environ:
            # Triton's default (fused), said explicitly: a launch compiles the same, minus the
            # warning triton 3.9 prints once per process when the variable is unset.
            self._stack.enter_context(_env("TRITON_DEFAULT_FP_FUSION", "1"))
        self.kernels = _compilable_kernels()
        # DriverConfig keeps the active driver in ``_active``; restore exactly that (its public
        # reset would build the default driver, which fails on a machine without a GPU).
        prev_driver = getattr(driver, "_active", None)
        self._driver = _StandInDriver(GPUTarget("cuda", self.capability, 32))
        driver.set_active(self._driver)  # type: ignore[arg-type]
        self._stack.callback(setattr, driver, "_active", prev_driver)
        prev_hook = knobs.runtime.jit_cache_hook
        self._stack.callback(setattr, knobs.runtime, "jit_cache_hook", prev_hook)
        self._knobs = knobs
        from prepkit.kernels.mx._target import pinned_capability

        # The launchers then decide (PDL, TMA descriptors) as on the target, though tensors are on the CPU.
        self._stack.enter_context(pinned_capability(self.device.capability))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def run(
        self, arch: str, activations: str, stage: Stage, tactic: GemmTactic | None, origin: str, launch: Any
    ) -> list[CompileReport]:
        """Run ``launch`` with the JIT recording instead of compiling, then compile what it recorded."""
        recorded: list[tuple[Any, str, str]] = []

        def record(*, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
            recorded.append((fn.jit_function, compile["specialization_data"], str(key)))
            return True  # the JIT then compiles and launches nothing

        base = CompileReport(arch, activations, stage, "" if tactic is None else tactic.to_json(), origin, "failed")
        self._knobs.runtime.jit_cache_hook = record
        try:
            launch()
        except Exception as exc:  # a launcher's own check: the variant never reached the compiler
            return [replace(base, message=f"launcher refused: {_compiler_message(exc)}")]
        finally:
            self._knobs.runtime.jit_cache_hook = None
        if not recorded:
            return [replace(base, message="the launcher launched no kernel")]
        return [self._compile(base, fn, spec, key, tactic) for fn, spec, key in recorded]

    def _compile(self, base: CompileReport, fn: Any, spec: str, key: str, tactic: GemmTactic | None) -> CompileReport:
        name = getattr(fn, "__name__", str(fn))
        base = replace(base, kernel=name)
        done = self._done.get((name, key))
        if done is None:
            start = time.perf_counter()
            try:
                done = (fn.preload(spec), time.perf_counter() - start)
            except Exception as exc:
                done = exc
            finally:
                # preload caches the kernel for the stand-in device; a later launch of the same
                # specialization would find it there and try to run it.
                fn.device_caches.pop(self._driver.key, None)
            self._done[(name, key)] = done
        if isinstance(done, BaseException):
            return replace(base, message=_compiler_message(done))
        compiled, seconds = done
        return self._read(replace(base, compile_s=round(seconds, 2)), compiled, tactic)

    def _read(self, base: CompileReport, compiled: Any, tactic: GemmTactic | None) -> CompileReport:
        ptx = compiled.asm.get("ptx", "")
        target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
        mma, instruction = mma_kind(ptx)
        shared = int(getattr(compiled.metadata, "shared", 0))
        report = replace(
            base, status="compiled", ptx_target=target.group(1) if target else "", shared_bytes=shared, mma=mma,
            mma_instruction=instruction,
        )  # fmt: skip
        cubin = compiled.asm.get("cubin")
        if cubin:
            usage, sass = self._tools.inspect(cubin)
            loop = k_loop(sass)
            report = replace(report, registers=usage.get("REG"), spill_bytes=usage.get("LOCAL"))
            if loop is not None:
                report = replace(report, k_step_instructions=loop[0], k_step_mma=loop[1])
                if tactic is not None:
                    per_thread = tactic.block_n * tactic.block_k / 2 / (32 * tactic.num_warps)
                    report = replace(report, instructions_per_4_weight_bytes=round(loop[0] / (per_thread / 4), 2))
        if shared > self.device.max_shared_mem:
            report = replace(
                report,
                status="failed",
                message=f"out of resources: needs {shared} B of shared memory, {self.device.name} allows "
                f"{self.device.max_shared_mem}",
            )
        return report


def interpreter_imported() -> bool:
    """Whether triton's own library was imported under ``TRITON_INTERPRET=1`` (its ``@jit``
    functions are then interpreter functions for the life of the process)."""
    std = sys.modules.get("triton.language.standard")
    return std is not None and type(getattr(std, "cdiv", None)).__name__ == "InterpretedFunction"


def leave_interpreter() -> None:
    """Turn ``TRITON_INTERPRET`` off for this process while triton is not imported yet, so a
    compile-only process compiles even where the variable is set (it runs no kernel)."""
    if "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)


def _compiler_message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:4000]


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _compilable_kernels() -> ModuleType:
    """``prepkit.kernels.mx``, whose kernels must be compiler functions: Triton makes each
    ``@triton.jit`` function an interpreter function for good when its module is imported under
    ``TRITON_INTERPRET=1``."""
    from triton.runtime.jit import JITFunction

    from prepkit.kernels import mx
    from prepkit.kernels.mx._gemm import _gemm1_swiglu_kernel

    if not isinstance(_gemm1_swiglu_kernel, JITFunction):
        raise DeviceError(
            "prepkit.kernels.mx was imported with TRITON_INTERPRET=1: its kernels are interpreter "
            "functions, so nothing compiles ahead of time in this process",
            hint=_FRESH_PROCESS_HINT,
        )
    return mx


class _NvidiaTools:
    """``cuobjdump`` and ``nvdisasm`` as shipped in the triton wheel (or named by Triton's knobs)."""

    def __init__(self) -> None:
        from triton import knobs

        # Found up front (each answers --version): a missing tool is one clear error, not a
        # failure of every variant.
        found = {}
        for name in ("ptxas", "ptxas-blackwell", "cuobjdump", "nvdisasm"):
            knob = name.replace("-", "_")
            if not hasattr(knobs.nvidia, knob):
                continue  # ptxas-blackwell is a newer triton's second ptxas (sm_90 and up)
            try:
                found[name] = getattr(knobs.nvidia, knob).path
            except RuntimeError as exc:
                env = f"TRITON_{name.upper().replace('-', '_')}_PATH"
                raise DeviceError(
                    f"the compile check needs {name}: {exc}",
                    hint=f"the triton wheel ships it under triton/backends/nvidia/bin; or set {env}",
                ) from None
        self.cuobjdump = found["cuobjdump"]
        self.nvdisasm = found["nvdisasm"]

    def inspect(self, cubin: bytes) -> tuple[dict[str, int], str]:
        """(resource usage fields, SASS listing) of one cubin."""
        with tempfile.TemporaryDirectory(prefix="prepkit-compile-") as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            usage = subprocess.run(
                [self.cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True, check=True
            ).stdout
            sass = subprocess.run([self.nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
        return fields, sass


def mma_kind(ptx: str) -> tuple[str, str]:
    """(label, first instruction) of the matrix instruction in ``ptx``; ``("", "")`` if none."""
    for label, pattern in _MMA_KINDS:
        m = re.search(pattern, ptx)
        if m:
            return label, m.group(0).rstrip(";,")
    return "", ""


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA(?:\.[A-Z]+)*\s+(?:[!A-Z0-9]+,\s*)?`\((\.L_x_\d+)\)")
_SASS_MMA = re.compile(r"^(?:@!?U?P\w+\s+)?[A-Z]*MMA\b")


def k_loop(sass: str) -> tuple[int, int] | None:
    """(instructions, matrix instructions) in the body of the K loop of an ``nvdisasm -c``
    listing: of the loops closed by a backward branch, the innermost one holding matrix
    instructions. ``None`` when no loop holds one."""
    addr_of: dict[str, int] = {}
    pending: list[str] = []
    instructions: list[tuple[int, str]] = []
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _SASS_LINE.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                addr_of[name] = addr
            pending.clear()
            instructions.append((addr, m.group(2)))
    loops = []
    for addr, text in instructions:
        b = _SASS_BRANCH.search(text)
        if b and b.group(1) in addr_of and addr_of[b.group(1)] < addr:
            body = [t for a, t in instructions if addr_of[b.group(1)] <= a <= addr]
            mma = sum(1 for t in body if _SASS_MMA.match(t))
            if mma:
                loops.append((len(body), mma))
    return min(loops) if loops else None


if __name__ == "__main__":
    sys.exit(dense_main())
