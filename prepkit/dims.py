"""``ModelDims``: the model-wide MoE dimensions, and :func:`dense_shapes`: the dense linears' weight
shapes, kept free of torch so a manifest (and the tactics lookup) can read them without importing it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prepkit.errors import RecipeError

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


@dataclass(frozen=True)
class DenseShape:
    """One dense linear of the model: its name and its weight ``[n, k]``."""

    name: str  # "qkv" | "o" | "lm_head"
    n: int
    k: int


def dense_shapes(config: Mapping[str, Any]) -> list[DenseShape]:
    """The fused qkv, o and lm_head shapes of a gpt-oss config (config.json keys).

    Raises:
        RecipeError: a dimension is missing or not a positive integer.
    """
    dims = {}
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"):
        value = config.get(key)
        if not isinstance(value, int) or value <= 0:
            raise RecipeError(f"the model config's {key} is {value!r}: the dense shapes need a positive integer")
        dims[key] = value
    hidden, heads, head_dim = dims["hidden_size"], dims["num_attention_heads"], dims["head_dim"]
    kv = dims["num_key_value_heads"]
    return [
        DenseShape("qkv", (heads + 2 * kv) * head_dim, hidden),
        DenseShape("o", hidden, heads * head_dim),
        DenseShape("lm_head", dims["vocab_size"], hidden),
    ]
