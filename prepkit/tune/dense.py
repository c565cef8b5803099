"""The dense problems ``prepkit tune`` sweeps: the MX linears of a model's attention and output head.

gpt-oss runs three dense shapes per weight format (the runtime fuses q, k and v into one launch):

* ``qkv``: ``N = (heads + 2 * kv_heads) * head_dim``, ``K = hidden``;
* ``o``: ``N = hidden``, ``K = heads * head_dim``;
* ``lm_head``: ``N = vocab``, ``K = hidden``.

Each (shape, weight format, activation policy) is a problem of its own
(:func:`prepkit.tactics.keys.dense_problem`, role ``dense``), so its rows never serve a MoE GEMM
and the reverse. Standard library only: nothing here touches a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prepkit.dims import dense_shapes
from prepkit.errors import RecipeError
from prepkit.mx_formats import MX_FORMATS, pairing_reason
from prepkit.tactics.keys import DENSE_ROLE, KERNEL_NAME, ProblemKey, dense_problem

if TYPE_CHECKING:
    from prepkit.kernels.activations import ActivationPolicy

# ``--dense-formats``: no dense problem, one MX format, or every one.
MX_DENSE_FORMATS = tuple(MX_FORMATS)
DENSE_CHOICES = ("none", *MX_DENSE_FORMATS, "all")
# Where the dense kernel's tiles change: 16-row tiles up to 16 tokens, 32-row ones up to 32, then
# 64 (prepkit.kernels.variants.dense_sweep_space); the MoE anchors miss the 32-row regime.
DENSE_ANCHORS = (1, 4, 16, 32, 128, 1024, 4096)


@dataclass(frozen=True)
class DenseTarget:
    """One dense problem to sweep and what people call it."""

    problem: ProblemKey
    label: str  # e.g. "dense mxfp4 qkv 5120x2880"


def dense_formats(choice: str | None, held: Sequence[str], activations: ActivationPolicy, source: str) -> list[str]:
    """The weight formats to sweep: ``choice`` (``None``: every format ``held``) among those the
    source ``held`` (a model: both; a shard set: the one its manifest records, or none), under the
    activation policy (mxfp4 activations multiply e2m1 by e2m1: mxfp4 weights only).

    Raises:
        RecipeError: ``choice`` names a format the source does not hold or the policy cannot run.
    """
    if choice is not None and choice not in DENSE_CHOICES:
        raise RecipeError(f"--dense-formats {choice}: expected one of {', '.join(DENSE_CHOICES)}")
    if choice == "none":
        return []
    wanted = list(MX_DENSE_FORMATS) if choice in (None, "all") else [choice]
    if choice not in (None, "all") and choice not in held:
        holds = f"dense weights in {held[0]}" if held else "bf16 dense weights"
        raise RecipeError(
            f"--dense-formats {choice}, but {source} holds {holds}",
            hint="drop --dense-formats, or pass --dense-formats none",
        )
    out = [f for f in wanted if f in held and pairing_reason(activations, f) is None]
    if choice not in (None, "all") and not out:
        raise RecipeError(
            f"--dense-formats {choice} with --activations {activations}: {pairing_reason(activations, choice)}",
            hint=f"pass --dense-formats {activations}, or other activations",
        )
    return out


def dense_source(*, model: str | None, shards: Path | None) -> tuple[Sequence[str], Mapping[str, Any], str]:
    """(the MX formats the source holds, its model config, its name): a recipe (default
    gpt-oss-120b) holds every format; a prepared shard set the one its manifest records, or none.

    Raises:
        RecipeError: unknown recipe.
    """
    if shards is not None:
        from prepkit.manifest import Manifest

        man = Manifest.read(shards)
        held: Sequence[str] = [man.dense_format] if man.dense_format in MX_DENSE_FORMATS else []
        return held, man.model.config, str(shards)
    from prepkit.recipes import load_recipe

    recipe = load_recipe(model or "gpt-oss-120b")
    return MX_DENSE_FORMATS, recipe.reference_dims, recipe.name


def dense_targets(
    *,
    model: str | None,
    shards: Path | None,
    choice: str | None,
    kernel_version: str,
    activations: ActivationPolicy = "bf16",
) -> list[DenseTarget]:
    """The dense problems of a recipe (default gpt-oss-120b; both MX formats) or of a prepared
    shard set (the format its manifest records; none for bf16 dense weights), per
    :func:`dense_formats`, format by format in the order qkv, o, lm_head.

    Raises:
        RecipeError: unknown recipe, or a ``choice`` the source or policy cannot take.
    """
    from prepkit.constants import DENSE_MX_LAYOUT_ID

    held, config, source = dense_source(model=model, shards=shards)
    formats = dense_formats(choice, held, activations, source)
    shapes = dense_shapes(config) if formats else []
    acts = "" if activations == "bf16" else f" act={activations}"
    return [
        DenseTarget(
            dense_problem(
                kernel=KERNEL_NAME,
                kernel_version=kernel_version,
                weight_layout=DENSE_MX_LAYOUT_ID,
                n=s.n,
                k=s.k,
                fmt=fmt,
                act_dtype=activations,
            ),
            f"dense {fmt} {s.name} {s.n}x{s.k}{acts}",
        )  # fmt: skip
        for fmt in formats
        for s in shapes
    ]


def dense_format(problem: ProblemKey) -> str:
    """``mxfp4`` or ``mxfp8``: the weight format of a dense problem.

    Raises:
        ValueError: ``problem`` is no dense problem.
    """
    fmt = next((f.name for f in MX_FORMATS.values() if f.w_dtype == problem.w_dtype), None)
    if problem.role != DENSE_ROLE or fmt is None:
        raise ValueError(f"not a dense MX problem: {problem.describe()}")
    return fmt
