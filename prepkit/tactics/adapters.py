"""The runtime's lookups backed by the tactic DBs: :func:`make_tactic_lookup` for MoE layers and
:func:`make_dense_tactic_lookup` for MX dense linears (the Protocols of
:mod:`prepkit.tactics.choose`).

Standard library only; the kernel version is read from the kernels on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prepkit.tactics.keys import KERNEL_NAME, Environment, ProblemKey, dense_problem, layer_problems
from prepkit.tactics.resolver import TacticResolver, runtime_resolver
from prepkit.tactics.table import TacticsDBWarning, decode_or_none
from prepkit.warn_once import new_owner, warn_once

if TYPE_CHECKING:
    from prepkit.kernels.activations import ActivationPolicy
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.tactic import GemmTactic
    from prepkit.layer import MoeProblem, RankLayer
    from prepkit.tactics.choose import DenseTacticLookup, TacticLookup


def make_tactic_lookup(
    *,
    resolver: TacticResolver | None = None,
    kernel: str = KERNEL_NAME,
    kernel_version: str | int | None = None,
    weight_layout: str | None = None,
    activations: ActivationPolicy = "bf16",
) -> TacticLookup:
    """A :class:`~prepkit.tactics.choose.TacticLookup` backed by the tactic DBs.

    Called with a ``prepkit.layer.MoeProblem`` (a rank's layer record and a token count) and the
    kernels' ``DeviceInfo``, it returns ``(gemm1, gemm2)`` tactics, ``None`` in the slot of a GEMM
    without a tuned row (the chooser's default fills it); when neither GEMM has one it returns
    ``None``. Either way one warning names the tune command, once per missed
    problem (and per layer, when a layer calls it). ``kernel_version=None`` reads
    ``prepkit.kernels.mx.KERNEL_VERSION`` on first use; ``weight_layout=None`` is the
    bundled kernel's layout. ``activations`` is the activation precision policy the layer runs
    with: rows tuned for another policy never serve it. ``resolver=None`` is
    :func:`runtime_resolver`: a table tuned with another Triton minor version serves, with one
    warning naming both versions.
    """
    res = resolver or runtime_resolver()
    owner = new_owner()

    def note_other_triton(key: ProblemKey, device: DeviceInfo) -> None:
        table = res.table(key, device)
        if table.tier != "triton_minor":
            return
        env = Environment.of(device)
        warn_once(
            (owner, "other triton", key.role),
            f"tactics for {key.describe()} were tuned with another Triton than this one "
            f"({env.triton_version}); they run as they are (same kernel version). `prepkit tune` "
            "re-measures them for this Triton",
            TacticsDBWarning,
            stacklevel=4,
        )

    version: list[str] = [] if kernel_version is None else [str(kernel_version)]
    layout = weight_layout or _kernel_layout()
    problems: dict[RankLayer, dict[str, ProblemKey]] = {}

    def lookup(problem: MoeProblem, device: DeviceInfo) -> tuple[GemmTactic | None, GemmTactic | None] | None:
        if not version:
            from prepkit.kernels.mx import KERNEL_VERSION

            version.append(str(KERNEL_VERSION))
        keys = problems.get(problem.layer)
        if keys is None:
            keys = layer_problems(
                problem.layer, kernel=kernel, kernel_version=version[0], weight_layout=layout, act_dtype=activations
            )
            problems[problem.layer] = keys
        found = {role: res.lookup(keys[role], problem.num_tokens, device, warn=False) for role in ("gemm1", "gemm2")}
        missed = [role for role, tj in found.items() if tj is None]
        if missed:
            # One warning for the call, about the first GEMM that missed: one tune run fills both.
            res.warn_miss(keys[missed[0]], problem.num_tokens, device)
        decoded = {role: decode_or_none(tj) for role, tj in found.items()}
        g1, g2 = decoded["gemm1"], decoded["gemm2"]
        if g1 is None and g2 is None:
            return None
        for role, tactic in decoded.items():
            if tactic is not None:
                note_other_triton(keys[role], device)
        return g1, g2

    return lookup


def make_dense_tactic_lookup(
    *,
    resolver: TacticResolver | None = None,
    kernel: str = KERNEL_NAME,
    kernel_version: str | int | None = None,
    weight_layout: str | None = None,
) -> DenseTacticLookup:
    """A :class:`~prepkit.tactics.choose.DenseTacticLookup` backed by the tactic DBs: called with
    the token count, the weight's ``n``/``k``/format, the activation policy and the kernels'
    ``DeviceInfo``, it returns the tuned tactic of that dense problem (its own problem key,
    :func:`~prepkit.tactics.keys.dense_problem`), else ``None`` (the chooser's default serves)
    after one warning naming the tune command.
    ``kernel_version=None`` reads ``prepkit.kernels.mx.KERNEL_VERSION`` on first use;
    ``weight_layout=None`` is the dense MX layout."""
    res = resolver or runtime_resolver()
    version: list[str] = [] if kernel_version is None else [str(kernel_version)]
    layout = weight_layout or _dense_layout()
    keys: dict[tuple[int, int, str, str], ProblemKey] = {}

    def lookup(
        num_tokens: int, n: int, k: int, fmt: str, activations: ActivationPolicy, device: DeviceInfo
    ) -> GemmTactic | None:
        if not version:
            from prepkit.kernels.mx import KERNEL_VERSION

            version.append(str(KERNEL_VERSION))
        key = keys.get((n, k, fmt, activations))
        if key is None:
            key = dense_problem(
                kernel=kernel, kernel_version=version[0], weight_layout=layout, n=n, k=k, fmt=fmt,
                act_dtype=activations,
            )  # fmt: skip
            keys[(n, k, fmt, activations)] = key
        return decode_or_none(res.lookup(key, num_tokens, device))

    return lookup


def _dense_layout() -> str:
    from prepkit.constants import DENSE_MX_LAYOUT_ID

    return DENSE_MX_LAYOUT_ID


def _kernel_layout() -> str:
    from prepkit.constants import TRITON_MOE_LAYOUT_ID

    return TRITON_MOE_LAYOUT_ID
