"""What the compile check reports: one :class:`CompileReport` per kernel, the table and JSON forms,
and the rule that makes a check fail (:func:`check_failures`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from prepkit.kernels.device import ARCH_DEVICES, lowers_natively
from prepkit.kernels.tactic import GemmTactic

Status = Literal["compiled", "pruned", "failed"]
Stage = Literal["route", "gemm1", "gemm2", "dense", "decode", "attention"]
# What each policy's GEMMs must use where Triton lowers MX natively (on sm_120a / sm_121a, the
# targets with a reference device: block-scaled mma.sync).
NATIVE_MMA: dict[str, str] = {"mxfp8": "block_scale mxf8f6f4", "mxfp4": "block_scale mxf4nvf4"}


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
            and lowers_natively(ARCH_DEVICES[r.arch].capability)
            and r.mma != want
        ):
            lines.append(f"{_name(r)}: PTX holds {r.mma or 'no matrix instruction'}, not the native {want}")
    return lines


def _name(r: CompileReport) -> str:
    tactic = f" {GemmTactic.from_json(r.tactic).key()}" if r.tactic else ""
    kernel = f" {r.kernel}" if r.kernel else ""  # a pruned variant never got as far as a kernel
    return f"{r.arch} {r.activations} {r.stage}{kernel}{tactic} ({r.origin})"
