"""``ModelDims``: the model-wide MoE dimensions, kept free of torch so a manifest can carry them
without importing it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelDims:
    """Model-wide MoE dimensions (from config.json): the recipe's and the manifest's dims.

    A layout plans one rank of these (:class:`~prepkit.layouts.base.RankPlan`); what one rank of
    the bundled kernel holds of a layer is :class:`prepkit.layer.RankLayer`.
    """

    num_layers: int
    num_experts: int  # E
    hidden: int  # H
    intermediate: int  # I
    top_k: int

    def source_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Checkpoint shape and dtype of every expert tensor of one layer."""
        import torch

        from prepkit.mxfp4 import BLOCK_BYTES, BLOCK_ELEMS

        E, H, I = self.num_experts, self.hidden, self.intermediate
        return {
            "gate_up_proj_blocks": ((E, 2 * I, H // BLOCK_ELEMS, BLOCK_BYTES), torch.uint8),
            "gate_up_proj_scales": ((E, 2 * I, H // BLOCK_ELEMS), torch.uint8),
            "gate_up_proj_bias": ((E, 2 * I), torch.bfloat16),
            "down_proj_blocks": ((E, H, I // BLOCK_ELEMS, BLOCK_BYTES), torch.uint8),
            "down_proj_scales": ((E, H, I // BLOCK_ELEMS), torch.uint8),
            "down_proj_bias": ((E, H), torch.bfloat16),
        }
