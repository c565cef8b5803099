"""What a decode kernel offers the tuner and the step: its problem, its variants, a launcher.

A decode kernel's problem is small and fixed per model (rows and columns of a projection, or the
heads and head size of attention, plus the batch); its variants are launch parameters. The tuner
sweeps :meth:`DecodeKernel.candidates`, checks each against :meth:`DecodeKernel.reference`, and
records the fastest; the step asks for the recorded variant and falls back to
:attr:`DecodeKernel.default`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class DecodeProblem:
    """One decode kernel call's shape. ``rows``/``cols``: a projection's output rows and reduction
    width (attention: query heads and cache slots in use); ``fmt``: the weight format
    ("bf16", "mxfp8", "mxfp4"; attention: the cache dtype); ``extra``: kernel-specific facts
    (name, value) pairs, e.g. ``(("head_dim", 64), ("kv_heads", 8))``."""

    kernel: str
    rows: int
    cols: int
    batch: int
    fmt: str = "bf16"
    extra: tuple[tuple[str, int], ...] = field(default=())

    def key(self) -> str:
        """A stable text key (the tactics DB's problem column)."""
        parts = [self.kernel, f"r{self.rows}", f"c{self.cols}", f"b{self.batch}", self.fmt]
        parts += [f"{k}{v}" for k, v in self.extra]
        return "-".join(parts)


@dataclass(frozen=True)
class DecodeVariant:
    """Launch parameters of one decode kernel variant. ``block_n``: output rows (attention: cache
    slots) per program and step; ``block_k``: reduction width per step; ``split_k``: programs
    sharing one row block's reduction (1: none)."""

    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1
    num_stages: int = 1

    def name(self) -> str:
        """A stable text name (the tactics DB's tactic column), parsed back by :meth:`parse`."""
        return f"n{self.block_n}-k{self.block_k}-w{self.num_warps}-s{self.split_k}-p{self.num_stages}"

    @classmethod
    def parse(cls, name: str) -> DecodeVariant:
        """The variant :meth:`name` wrote. Raises ValueError for any other text."""
        try:
            n, k, w, s, p = name.split("-")
            fields = [int(part[1:]) for part, tag in zip((n, k, w, s, p), "nkwsp", strict=True) if part[0] == tag]
        except ValueError as err:
            raise ValueError(f"not a decode variant name: {name!r}") from err
        if len(fields) != 5:
            raise ValueError(f"not a decode variant name: {name!r}")
        return cls(*fields)


class DecodeKernel(Protocol):
    """What each decode kernel module registers."""

    name: str

    def default(self, problem: DecodeProblem) -> DecodeVariant:
        """A variant that is always valid for ``problem`` (used when nothing was tuned)."""
        ...

    def candidates(self, problem: DecodeProblem) -> list[DecodeVariant]:
        """The variants the tuner sweeps for ``problem`` (each valid for it)."""
        ...

    def inputs(self, problem: DecodeProblem, device: Any, seed: int = 0) -> dict[str, Any]:
        """Random inputs of ``problem``'s shape on ``device`` (never zeros), for checks and timing."""
        ...

    def launch(self, inputs: dict[str, Any], variant: DecodeVariant) -> Any:
        """Run the kernel on ``inputs`` with ``variant``; returns its outputs."""
        ...

    def reference(self, inputs: dict[str, Any]) -> Any:
        """The same outputs computed with torch operations, for correctness checks."""
        ...

    def tolerance(self, problem: DecodeProblem) -> float:
        """The largest relative error a correct variant may show against :meth:`reference`."""
        ...


KERNELS: dict[str, DecodeKernel] = {}


def register(kernel: DecodeKernel) -> DecodeKernel:
    """Add ``kernel`` to :data:`KERNELS` under its name (each kernel module calls this once)."""
    if kernel.name in KERNELS:
        raise ValueError(f"decode kernel {kernel.name!r} is registered twice")
    KERNELS[kernel.name] = kernel
    return kernel
