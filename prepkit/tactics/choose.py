"""The one tactic chooser: which kernel variants serve a call, and what replaces them when they fail.

Every caller that runs the bundled kernels (MoE layers, MX dense linears, the tuner's worker and
its dense bench) asks :func:`choose`, which goes through the same steps in the same order:

1. the sources of :data:`SOURCES`, first that answers: the caller's lookup (the tactics DBs,
   :mod:`prepkit.tactics.adapters`), then the built-in default. A lookup may answer some GEMMs
   of a call and not others; the default fills the rest;
2. the activation-policy variant (:func:`prepkit.kernels.variants.policy_variant`: a bf16 pair
   runs as the policy's variant; a dense tactic is already per policy);
3. the interpreter fix-up: off CUDA (the Triton interpreter runs no inline PTX) the PTX upcast
   becomes its integer-op twin;
4. one warning per owner when the default serves a call nothing was asked about (a lookup warns
   about its own misses, in the owner's name: :mod:`prepkit.warn_once`).

After a tuned choice failed to compile (another Triton), :func:`fall_back` gives the default
through the same steps, with a warning. A new source of tactics (a DB tier, a heuristic) is one
entry in :data:`SOURCES`; callers do not change.

The lookup Protocols live here, below the runtime that holds them, so tactics/ imports nothing
from prepkit.runtime. Kernel modules are imported on first use: importing this stays cheap.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from prepkit.warn_once import owned_by, warn_once

if TYPE_CHECKING:
    from prepkit.kernels.activations import ActivationPolicy
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.tactic import GemmTactic
    from prepkit.layer import MoeProblem

# What a lookup may answer per GEMM of a call: the variant, or ``None`` (the default serves it).
Slots = tuple["GemmTactic | None", ...]


class TacticLookup(Protocol):
    """Where a MoE layer gets the (GEMM1, GEMM2) variants of a call: the pair, a pair with ``None``
    for a GEMM it has nothing for, or ``None`` after saying why, if it wants to (the tactics DB's
    does, once per layer: the layer runs it as the warning owner). The default fills what it
    leaves out."""

    def __call__(
        self, problem: MoeProblem, device: DeviceInfo, /
    ) -> tuple[GemmTactic | None, GemmTactic | None] | None: ...


class DenseTacticLookup(Protocol):
    """Where an MX dense linear gets the variant of a call (the tactic DB's:
    :func:`prepkit.tactics.adapters.make_dense_tactic_lookup`); ``None`` means the default."""

    def __call__(
        self, num_tokens: int, n: int, k: int, fmt: str, activations: ActivationPolicy, device: DeviceInfo, /
    ) -> GemmTactic | None: ...


@dataclass(frozen=True)
class MoeCall:
    """One call of a MoE layer: its problem (a rank's layer and a token count) and its lookup."""

    problem: MoeProblem
    lookup: TacticLookup | None = None

    @property
    def num_tokens(self) -> int:
        return self.problem.num_tokens

    def describe(self) -> str:
        return self.problem.key()

    def looked_up(self, device: DeviceInfo, activations: ActivationPolicy) -> Slots | None:
        if self.lookup is None:
            return None
        pair = self.lookup(self.problem, device)  # the layer's lookup was built for its policy
        return None if pair is None else (pair[0], pair[1])

    def default(self, device: DeviceInfo, activations: ActivationPolicy) -> tuple[GemmTactic, ...]:
        from prepkit.kernels.variants import default_tactics

        return default_tactics(self.problem, device, activations)

    def policy(
        self, tactics: tuple[GemmTactic, ...], device: DeviceInfo, activations: ActivationPolicy
    ) -> tuple[GemmTactic, ...]:
        from prepkit.kernels.variants import policy_variant

        return (policy_variant(tactics[0], "gemm1", device, activations),
                policy_variant(tactics[1], "gemm2", device, activations))  # fmt: skip


@dataclass(frozen=True)
class DenseCall:
    """One call of an MX dense linear: ``num_tokens`` rows through an ``[n, k]`` ``fmt`` weight."""

    num_tokens: int
    n: int
    k: int
    fmt: str
    lookup: DenseTacticLookup | None = None

    def describe(self) -> str:
        return f"dense {self.fmt} N={self.n} K={self.k}"

    def looked_up(self, device: DeviceInfo, activations: ActivationPolicy) -> Slots | None:
        if self.lookup is None:
            return None
        t = self.lookup(self.num_tokens, self.n, self.k, self.fmt, activations, device)
        return None if t is None else (t,)

    def default(self, device: DeviceInfo, activations: ActivationPolicy) -> tuple[GemmTactic, ...]:
        from prepkit.kernels.mx.dense import default_dense_tactic

        return (default_dense_tactic(
            self.num_tokens, self.n, self.k, self.fmt, device.capability, activations=activations,
            sm_count=device.sm_count,
        ),)  # fmt: skip

    def policy(
        self, tactics: tuple[GemmTactic, ...], device: DeviceInfo, activations: ActivationPolicy
    ) -> tuple[GemmTactic, ...]:
        return tactics  # dense rows and defaults are keyed by the policy already


Call = MoeCall | DenseCall


@dataclass(frozen=True)
class Choice:
    """The variants that serve a call (one per GEMM: two for a MoE layer, one for a dense linear)
    and the source that gave them (a name of :data:`SOURCES`)."""

    tactics: tuple[GemmTactic, ...]
    source: str

    @property
    def tuned(self) -> bool:
        """Whether a lookup gave any of them (a compile failure may then fall back)."""
        return self.source != DEFAULT


DEFAULT = "default"


def _from_lookup(call: Call, device: DeviceInfo, activations: ActivationPolicy) -> Slots | None:
    return call.looked_up(device, activations)


def _from_default(call: Call, device: DeviceInfo, activations: ActivationPolicy) -> Slots | None:
    return call.default(device, activations)


# Where tactics come from, first that answers; the last one always does.
SOURCES: tuple[tuple[str, Callable[[Call, DeviceInfo, ActivationPolicy], Slots | None]], ...] = (
    ("lookup", _from_lookup),
    (DEFAULT, _from_default),
)


def choose(
    call: Call,
    device: DeviceInfo,
    activations: ActivationPolicy,
    *,
    on_cuda: bool,
    owner: Hashable | None = None,
    warn: bool = True,
) -> Choice:
    """The variants for ``call`` on ``device`` with the ``activations`` policy, by the steps of the
    module docstring. ``on_cuda``: whether the call runs on a GPU (else the interpreter);
    ``owner``: whose warnings these are (a layer, a module; ``None``: the process); ``warn=False``
    for callers that ask for the default on purpose (the tuner)."""
    with _owned(owner):
        slots: Slots | None = None
        source = DEFAULT
        for name, source_fn in SOURCES:
            slots = source_fn(call, device, activations)
            if slots is not None and any(t is not None for t in slots):
                source = name
                break
        assert slots is not None, "the default source always answers"
        if any(t is None for t in slots):
            default = call.default(device, activations)
            slots = tuple(t if t is not None else d for t, d in zip(slots, default, strict=True))
        tactics = _finish(call, tuple(t for t in slots if t is not None), device, activations, on_cuda)
        if warn and source == DEFAULT and call.lookup is None:
            warn_once(
                "no tuned tactic",
                f"no tuned tactic for {call.describe()} on {device.label}; using the built-in default "
                "(run `prepkit tune` for faster variants)",
                stacklevel=4,
            )
    return Choice(tactics, source)


def fall_back(
    call: Call, failed: Choice, error: BaseException, device: DeviceInfo, activations: ActivationPolicy, *,
    on_cuda: bool,
) -> Choice:  # fmt: skip
    """The default for ``call`` after the tuned ``failed`` did not compile (rows tuned with another
    Triton may not), with a warning naming the variants and the first line of ``error``."""
    tactics = _finish(call, call.default(device, activations), device, activations, on_cuda)
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    warnings.warn(
        f"tuned variants {' / '.join(t.key() for t in failed.tactics)} for {call.num_tokens} tokens do not "
        f"compile with this Triton ({first}); using the built-in default (`prepkit tune` re-measures)",
        stacklevel=4,
    )
    return Choice(tactics, DEFAULT)


def compile_errors() -> tuple[type[BaseException], ...]:
    """What Triton raises when a variant does not compile, or needs more than the GPU has."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return (CompilationError, OutOfResources)


def runnable(t: GemmTactic, *, on_cuda: bool) -> GemmTactic:
    """``t`` as it can run: off CUDA the interpreter runs no inline PTX, so the PTX upcast becomes
    its integer-op twin."""
    return t if on_cuda or t.upcast != "asm" else replace(t, upcast="bits")


def _finish(
    call: Call, tactics: tuple[GemmTactic, ...], device: DeviceInfo, activations: ActivationPolicy, on_cuda: bool
) -> tuple[GemmTactic, ...]:
    return tuple(runnable(t, on_cuda=on_cuda) for t in call.policy(tactics, device, activations))


@contextlib.contextmanager
def _owned(owner: Hashable | None) -> Iterator[None]:
    if owner is None:
        yield
        return
    with owned_by(owner):
        yield
