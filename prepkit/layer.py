"""One MoE layer as one TP/EP rank holds it (:class:`RankLayer`), and that layer called with a
token count (:class:`MoeProblem`).

This is the per-rank shape every consumer reads: the tuner and its workers, the compile-only
check, the runtime's layers, the tactic keys and the transformers integration. :func:`rank_layer`
builds it from the model's dims and a rank through the bundled kernel's layout (so the padding is
the layout's own), and :func:`resolve_layer` from a recipe or a prepared shard set.

Standard library only at import time: the layout (torch) loads when a record is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prepkit.dims import ModelDims
    from prepkit.layouts.base import RankPlan, RankSpec


@dataclass(frozen=True)
class RankLayer:
    """One rank's share of one MoE layer in the bundled kernel's layout (``triton_moe_v3``).

    The whole-model dims are :class:`~prepkit.dims.ModelDims`; the layout's full byte plan of the
    rank (tensor specs, facts) is :class:`~prepkit.layouts.base.RankPlan`. This record is what a
    kernel launch, a variant pick and a tactic key need of them, and nothing else.
    """

    num_experts: int  # router width: the experts of all ranks
    expert_range: tuple[int, int]  # [lo, hi) of the experts this rank holds
    hidden: int
    valid_intermediate: int  # checkpoint intermediate rows this rank holds
    padded_intermediate: int  # rows it stores (the widest rank's share, zero-padded)
    top_k: int
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1

    @property
    def num_local_experts(self) -> int:
        return self.expert_range[1] - self.expert_range[0]

    @property
    def expert_lo(self) -> int:
        return self.expert_range[0]

    def problem(self, num_tokens: int) -> MoeProblem:
        """This layer called with ``num_tokens`` tokens."""
        return MoeProblem(self, num_tokens)

    @classmethod
    def of_plan(cls, plan: RankPlan) -> RankLayer:
        """The record of a layout's plan for one rank."""
        return cls(
            num_experts=plan.dims.num_experts,
            expert_range=plan.expert_range,
            hidden=plan.dims.hidden,
            valid_intermediate=plan.valid_intermediate,
            padded_intermediate=plan.padded_intermediate,
            top_k=plan.dims.top_k,
            tp_size=plan.spec.tp_size,
            tp_rank=plan.spec.tp_rank,
            ep_size=plan.spec.ep_size,
        )


@dataclass(frozen=True)
class MoeProblem:
    """One call of a rank's layer: the record plus a token count (what defaults and variant
    pruning read; local experts and valid intermediate rows, as the tactic table keys them)."""

    layer: RankLayer
    num_tokens: int

    @property
    def num_experts(self) -> int:
        """Local experts on this rank."""
        return self.layer.num_local_experts

    @property
    def hidden(self) -> int:
        return self.layer.hidden

    @property
    def intermediate(self) -> int:
        """Valid intermediate rows on this rank."""
        return self.layer.valid_intermediate

    @property
    def top_k(self) -> int:
        return self.layer.top_k

    def key(self) -> str:
        return f"E{self.num_experts}H{self.hidden}I{self.intermediate}k{self.top_k}"

    @property
    def max_rows_per_expert(self) -> int:
        """A token picks an expert at most once, so no expert sees more rows than tokens."""
        return self.num_tokens


def rank_layer(dims: ModelDims, rank: RankSpec | None = None) -> RankLayer:
    """The layer ``rank`` (TP rank 0 of EP group 0 by default) holds of a model with ``dims``,
    as the bundled kernel's layout plans it.

    Raises:
        LayoutError: the split does not fit the dims.
    """
    from prepkit.layouts.base import LayoutOptions, RankSpec
    from prepkit.layouts.triton_moe import LAYOUT

    return RankLayer.of_plan(LAYOUT.plan_rank(dims, rank or RankSpec(), LayoutOptions()))


@dataclass(frozen=True)
class LayerSource:
    """A rank's layer and how to name where it came from."""

    label: str  # e.g. "gpt-oss-120b TP1 rank 0"
    layer: RankLayer


def resolve_layer(*, model: str | None, shards: Path | None, tp: int | None) -> LayerSource:
    """TP rank 0's layer of a recipe (default gpt-oss-120b, TP ``tp`` or 1) or of a prepared
    triton-moe shard set (its own TP and EP split).

    Raises:
        RecipeError: unknown recipe; shards in another layout, or ``tp`` disagreeing with them.
    """
    from prepkit.constants import TRITON_MOE_LAYOUT_ID
    from prepkit.errors import RecipeError
    from prepkit.layouts.base import RankSpec

    if shards is not None:
        from prepkit.manifest import Manifest

        man = Manifest.read(shards)
        if man.layout.id != TRITON_MOE_LAYOUT_ID:
            raise RecipeError(
                f"{shards} is in layout {man.layout.id!r}; the bundled kernel reads {TRITON_MOE_LAYOUT_ID!r}",
                hint="prepare with --layout triton-moe, or use --model",
            )
        m_tp, ep = man.parallel.tp_size, man.parallel.ep_size
        if tp is not None and tp != m_tp:
            raise RecipeError(f"--tp {tp} but {shards} was prepared for tp={m_tp}", hint="drop --tp")
        split = f"TP{m_tp}" + (f" EP{ep}" if ep > 1 else "")
        layer = rank_layer(man.model.dims, RankSpec(tp_size=m_tp, ep_size=ep))
        return LayerSource(f"{shards} {split} rank 0", layer)
    from prepkit.recipes import load_recipe, model_dims

    recipe = load_recipe(model or "gpt-oss-120b")
    tp = tp or 1
    layer = rank_layer(model_dims(recipe.reference_dims), RankSpec(tp_size=tp))
    return LayerSource(f"{recipe.name} TP{tp} rank 0", layer)
