"""Layout registry: an explicit dict, so ``--help`` can list it and imports have no side effects."""

from __future__ import annotations

from prepkit.errors import LayoutError
from prepkit.layouts import cutlass_sm12x, cutlass_sm90, triton_moe, trtllm_gen
from prepkit.layouts.base import (
    ExpertWeights,
    Layout,
    LayoutOptions,
    ModelDims,
    RankPlan,
    RankSpec,
    TensorSpec,
)

LAYOUTS: dict[str, Layout] = {
    layout.name: layout for layout in (trtllm_gen.LAYOUT, triton_moe.LAYOUT, cutlass_sm12x.LAYOUT, cutlass_sm90.LAYOUT)
}


def get_layout(name: str) -> Layout:
    """The layout called ``name`` (CLI spelling) or with that versioned id."""
    for layout in LAYOUTS.values():
        if name in (layout.name, layout.layout_id):
            return layout
    raise LayoutError(f"unknown layout {name!r}", hint=f"choose one of: {', '.join(sorted(LAYOUTS))}")


__all__ = [
    "LAYOUTS",
    "ExpertWeights",
    "Layout",
    "LayoutOptions",
    "ModelDims",
    "RankPlan",
    "RankSpec",
    "TensorSpec",
    "get_layout",
]
