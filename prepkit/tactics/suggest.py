"""The ``prepkit tune`` command that would fill the DB for a missed problem.

A problem of a model prepkit ships a recipe for is named by that model (``--model``), found by
:func:`shipped_model_for` from the recipes' reference dims; any other needs the user's shards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prepkit.errors import PrepkitError
from prepkit.tactics.keys import DENSE_ROLE, DENSE_W_DTYPES, ProblemKey

if TYPE_CHECKING:
    from prepkit.dims import ModelDims


@dataclass(frozen=True)
class ShippedModel:
    """A model of a shipped recipe and the GEMM shapes it runs."""

    name: str
    dims: ModelDims
    dense: frozenset[tuple[int, int]]  # (n, k) of its dense linears

    def moe_layer(self, tp_size: int, ep_size: int) -> tuple[int, int, int] | None:
        """``(experts over all ranks, hidden, valid intermediate rows)`` of rank 0's layer under
        the split, as the kernel's layout plans it (:func:`prepkit.layer.rank_layer`); ``None``
        where the split does not fit."""
        return _rank_dims(self.dims, tp_size, ep_size)


@functools.cache
def shipped_models() -> tuple[ShippedModel, ...]:
    """Every shipped recipe's model, in name order: its MoE dims (:func:`prepkit.recipes.model_dims`)
    and dense shapes (:func:`prepkit.dims.dense_shapes`) at its reference dims. A recipe that does
    not load is left out: this only names a command."""
    from prepkit.dims import dense_shapes
    from prepkit.recipes import available, load_recipe, model_dims

    out = []
    for name in available():
        try:
            config = load_recipe(name).reference_dims
            dims = model_dims(config)
            dense = frozenset((s.n, s.k) for s in dense_shapes(config))
        except (PrepkitError, KeyError, TypeError, ValueError):
            continue
        out.append(ShippedModel(name, dims, dense))
    return tuple(out)


@functools.cache
def _rank_dims(dims: ModelDims, tp_size: int, ep_size: int) -> tuple[int, int, int] | None:
    from prepkit.layer import rank_layer
    from prepkit.layouts.base import RankSpec

    try:
        layer = rank_layer(dims, RankSpec(tp_size=tp_size, ep_size=ep_size))
    except (PrepkitError, ValueError):
        return None
    return layer.num_experts, layer.hidden, layer.valid_intermediate


def shipped_model_for(problem: ProblemKey) -> str | None:
    """The first shipped model (by name) that runs ``problem``'s GEMM, or ``None``."""
    for model in shipped_models():
        if problem.role == DENSE_ROLE:
            if (problem.n, problem.k) in model.dense:
                return model.name
            continue
        hidden, intermediate = problem.layer_dims
        ours = (problem.num_experts * problem.ep_size, hidden, intermediate)
        if model.moe_layer(problem.tp_size, problem.ep_size) == ours:
            return model.name
    return None


def suggest_tune_command(problem: ProblemKey, arch: str) -> str:
    """The command line that would fill the DB for ``problem`` on this device."""
    acts = "" if problem.act_dtype == "bf16" else f" --activations {problem.act_dtype}"
    model = shipped_model_for(problem)
    src = f"--model {model}" if model else "--shards DIR"
    if problem.role == DENSE_ROLE:
        fmt = {w: f for f, w in DENSE_W_DTYPES.items()}.get(problem.w_dtype, "all")
        return f"prepkit tune --arch {arch} {src} --dense-formats {fmt} --no-moe{acts}"
    return f"prepkit tune --arch {arch} {src} --tp {problem.tp_size}{acts}"
