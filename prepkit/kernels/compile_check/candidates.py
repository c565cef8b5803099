"""What the compile check compiles: the MoE layer's default variants over the token points, and a
bounded, deterministic sample of each variant family."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prepkit.errors import DeviceError
from prepkit.kernels.activations import ActivationPolicy
from prepkit.kernels.device import ARCH_DEVICES, DeviceInfo
from prepkit.kernels.tactic import FAMILY_KNOBS, GemmTactic
from prepkit.kernels.variants import GEMMS, Gemm, default_tactics, enumerate_tactics
from prepkit.layer import RankLayer


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
