"""``--layout cutlass-sm12x``: MXFP4 weights for the CUTLASS MoE with MXFP8 activations.

Consumer: TensorRT-LLM's CUTLASS MoE backend, ``W4A8MXFP4MXFP8CutlassFusedMoEMethod`` (what a
gpt-oss ``mxfp4`` checkpoint becomes on SM100/SM103/SM110/SM120/SM121 with the CUTLASS backend,
the default on DGX Spark and RTX PRO 6000), and FlashInfer's
``cutlass_fused_moe(..., use_mxfp8_act_scaling=True)`` given the same tensors. Sources read:
TensorRT-LLM ``tensorrt_llm/_torch/moe/fused_moe/quantization.py`` at 02320c35
(``MXFP4WeightFusedMoEMethod.create_weights``, ``MXFP4WeightCutlassFusedMoEMethod``,
``_get_weight_alignment``, ``maybe_pad_for_mxfp4``); FlashInfer 0.7.2.post1
``csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu`` (scale shape checks)
and ``cutlass_fused_moe_kernels.cuh`` (fc2 bias on ``tp_rank == 0`` only). docs/layouts-cutlass.md
has the details.

Per expert and rank:
  1. de-interleave the checkpoint's gate/up rows (row 2i gate, 2i+1 up);
  2. take the rank's intermediate rows with TensorRT-LLM's pad-before-shard rule (the same
     ``_get_weight_alignment`` split as trtllm-gen before PR #18870, which did not touch this
     method) and zero-pad each half to ``Ip = roundup(I/tp, 128)`` rows; K of fc1 and the rows of
     fc2 are zero-padded to ``H2 = roundup(H, 128)``;
  3. stack ``[up ; gate]`` (TensorRT-LLM's ``w3_w1``) with no gated reorder and no row shuffle;
  4. 128x4-interleave each expert's E8M0 scale matrix as it stands (unpermuted);
  5. biases stay bfloat16 (the engine's activation dtype); the fc2 bias is stored whole and
     unscaled, because the CUTLASS finalize step adds it on TP rank 0 only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from prepkit.constants import CUTLASS_SM12X_LAYOUT_ID
from prepkit.errors import LayoutError
from prepkit.layouts import ops
from prepkit.layouts.base import (
    ExpertWeights,
    LayoutOptions,
    ModelDims,
    RankPlan,
    RankSpec,
    TensorSpec,
    check_experts,
    check_prepared,
    expert_range,
)
from prepkit.layouts.trtllm_gen import PAD_BEFORE_SHARD, intermediate_split
from prepkit.mxfp4 import BLOCK_BYTES, BLOCK_ELEMS

WEIGHT_ALIGNMENT = 128  # the CUTLASS MoE's alignment of I/tp and of H (fc1 K and fc2 rows alike)

SWIGLU = {"swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0}


# --- shared by the two CUTLASS layouts -----------------------------------------------------------


def plan_cutlass_rank(
    dims: ModelDims,
    spec: RankSpec,
    facts: dict[str, Any],
) -> RankPlan:
    """Ranges, padded sizes and tensor specs of one rank under TensorRT-LLM's CUTLASS MXFP4 split
    (both CUTLASS layouts store the same shapes; only the bytes inside differ).

    Raises:
        LayoutError: dims that are not whole MXFP4 blocks, an EP size that does not divide the
            experts, or a TP size that leaves a rank without intermediate rows.
    """
    E_lo, E_hi = expert_range(dims.num_experts, spec)
    H, I = dims.hidden, dims.intermediate
    if H % BLOCK_ELEMS or I % BLOCK_ELEMS:
        raise LayoutError(f"hidden {H} and intermediate {I} must be multiples of {BLOCK_ELEMS} for MXFP4")
    # "1.2" selects pad-before-shard at every TP size: the CUTLASS method never slices logically.
    split = intermediate_split(I, spec.tp_size, spec.tp_rank, "1.2")
    lo, hi = split.row_range
    if hi <= lo:
        raise LayoutError(
            f"tp={spec.tp_size} leaves TP rank {spec.tp_rank} without intermediate rows "
            f"(TensorRT-LLM pads {I} rows to slices of {split.padded_intermediate})",
            hint="use a smaller --tp",
        )
    Ip = split.padded_intermediate
    H2 = ops.round_up(H, WEIGHT_ALIGNMENT)
    facts = {
        **facts,
        "valid_hidden_size": H,
        "padded_hidden": H2,
        "valid_intermediate_size": hi - lo,
        "intermediate_size": Ip,
        **SWIGLU,
    }
    return RankPlan(
        spec=spec,
        dims=dims,
        expert_range=(E_lo, E_hi),
        intermediate_range=(lo, hi),
        padded_intermediate=Ip,
        padded_hidden=H2,
        tensors=cutlass_tensor_specs(E_hi - E_lo, Ip, H2),
        sharding_rule=PAD_BEFORE_SHARD,
        facts=facts,
    )


def stack_up_gate(interleaved: torch.Tensor, half_rows: int, cols: int) -> torch.Tensor:
    """``[E, 2V, C]`` checkpoint rows (gate, up alternating) -> ``[E, 2*half_rows, cols]`` =
    ``[up ; gate]``, each half zero-padded at its own end so the gate/up boundary stays at
    ``half_rows``, where the kernel looks for it."""
    gate, up = ops.deinterleave_rows(interleaved, dim=1)
    E, V, C = gate.shape
    out = torch.zeros((E, 2 * half_rows, cols), dtype=interleaved.dtype, device=interleaved.device)
    out[:, :V, :C] = up
    out[:, half_rows : half_rows + V, :C] = gate
    return out


def unstack_up_gate(stacked: torch.Tensor, valid_rows: int, cols: int, name: str) -> torch.Tensor:
    """Inverse of :func:`stack_up_gate`; raises ``LayoutError`` naming ``name`` on nonzero padding."""
    E, rows = stacked.shape[0], stacked.shape[1]
    up = unpad_checked(stacked[:, : rows // 2], (E, valid_rows, cols), name)
    gate = unpad_checked(stacked[:, rows // 2 :], (E, valid_rows, cols), name)
    return ops.interleave_rows(gate, up, dim=1)


def unpad_checked(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    core, padding_is_zero = ops.unpad(t, shape)
    if not padding_is_zero:
        raise LayoutError(f"{name}: padding beyond {list(shape)} holds nonzero bytes")
    return core


def padded_pieces(weights: ExpertWeights, plan: RankPlan) -> dict[str, torch.Tensor]:
    """The rank's unpermuted, zero-padded matrices: ``[up ; gate]`` fc1 and plain fc2, each with
    its E8M0 scales in linear (row-major) order and bfloat16 biases."""
    check_experts(weights, plan)
    piece = weights.intermediate_slice(*plan.intermediate_range)
    Ip, H2, El = plan.padded_intermediate, plan.padded_hidden, weights.num_experts
    return {
        "w13": stack_up_gate(piece.gate_up_proj_blocks.flatten(-2), Ip, H2 // 2),
        "w13_scales": stack_up_gate(piece.gate_up_proj_scales, Ip, H2 // BLOCK_ELEMS),
        "w13_bias": stack_up_gate(piece.gate_up_proj_bias.unsqueeze(-1), Ip, 1).squeeze(-1),
        "w2": ops.pad_to(piece.down_proj_blocks.flatten(-2), (El, H2, Ip // 2)),
        "w2_scales": ops.pad_to(piece.down_proj_scales, (El, H2, Ip // BLOCK_ELEMS)),
        "w2_bias": ops.pad_to(piece.down_proj_bias, (El, H2)),
    }


def unpadded_pieces(pieces: Mapping[str, torch.Tensor], plan: RankPlan, names: Mapping[str, str]) -> ExpertWeights:
    """Inverse of :func:`padded_pieces`; ``names`` maps each piece to the output tensor it came
    from, for error messages."""
    H, V = plan.dims.hidden, plan.valid_intermediate
    El = pieces["w2"].shape[0]
    gate_up = unstack_up_gate(pieces["w13"], V, H // 2, names["w13"])
    gate_up_sf = unstack_up_gate(pieces["w13_scales"], V, H // BLOCK_ELEMS, names["w13_scales"])
    gate_up_bias = unstack_up_gate(pieces["w13_bias"].unsqueeze(-1), V, 1, names["w13_bias"]).squeeze(-1)
    down = unpad_checked(pieces["w2"], (El, H, V // 2), names["w2"])
    down_sf = unpad_checked(pieces["w2_scales"], (El, H, V // BLOCK_ELEMS), names["w2_scales"])
    down_bias = unpad_checked(pieces["w2_bias"], (El, H), names["w2_bias"])
    return ExpertWeights(
        gate_up_proj_blocks=gate_up.unflatten(-1, (-1, BLOCK_BYTES)),
        gate_up_proj_scales=gate_up_sf,
        gate_up_proj_bias=gate_up_bias,
        down_proj_blocks=down.unflatten(-1, (-1, BLOCK_BYTES)),
        down_proj_scales=down_sf,
        down_proj_bias=down_bias,
    )


# --- the layout ------------------------------------------------------------------------------


class CutlassSm12xLayout:
    name = "cutlass-sm12x"
    layout_id = CUTLASS_SM12X_LAYOUT_ID
    w13_row_order = "up_gate"
    summary = "CUTLASS MoE, MXFP4 weights x MXFP8 activations (SM100/SM120/SM121): plain rows, 128x4 scales"
    uses_options: tuple[str, ...] = ()

    def plan_rank(self, dims: ModelDims, spec: RankSpec, options: LayoutOptions) -> RankPlan:
        facts = {
            "engine": (
                "TensorRT-LLM CUTLASS MoE (W4A8MXFP4MXFP8CutlassFusedMoEMethod, "
                "SM100/SM103/SM110/SM120/SM121); FlashInfer cutlass_fused_moe(use_mxfp8_act_scaling=True)"
            ),
            "matches": "TensorRT-LLM quantization.py @02320c35; FlashInfer 0.7.2.post1",
            "activation_quantization": (
                "MXFP8: mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=128) -> "
                "e4m3 [T, padded_hidden] + 128x4-swizzled UE8M0 scales (input_sf); "
                "pass unpadded_hidden_size=valid_hidden_size"
            ),
            "engine_views": {
                "w3_w1_weight": "int64 [E, 2*Ip, padded_hidden/16]",
                "w2_weight": "int64 [E, padded_hidden, Ip/16]",
                "w3_w1_weight_scale": "int32 [E, 2*Ip, padded_hidden/128]",
                "w2_weight_scale": "int32 [E, padded_hidden, Ip/128]",
            },
            "quant_scales": "[w3_w1_weight_scale(int32), ones(E) fp32, w2_weight_scale(int32), ones(E) fp32]",
            "scales": "uint8 E8M0, 128x4-interleaved per expert on the unpermuted matrix, logical 2-D shape",
            "engine_fc2_bias": "full, added on tp_rank 0 only (pass tp_size/tp_rank to the MoE call)",
            "bias_dtype": "bfloat16 (the activation dtype)",
        }
        return plan_cutlass_rank(dims, spec, facts)

    def plan_warnings(self, dims: ModelDims, plans: Sequence[RankPlan], options: LayoutOptions) -> list[str]:
        return []

    def build(self, weights: ExpertWeights, plan: RankPlan) -> dict[str, torch.Tensor]:
        p = padded_pieces(weights, plan)
        return {
            "w3_w1_weight": p["w13"],
            "w3_w1_weight_scale": ops.swizzle_scales_128x4(p["w13_scales"]),
            "w3_w1_bias": p["w13_bias"],
            "w2_weight": p["w2"],
            "w2_weight_scale": ops.swizzle_scales_128x4(p["w2_scales"]),
            "w2_bias": p["w2_bias"],
        }

    def invert(self, tensors: Mapping[str, torch.Tensor], plan: RankPlan) -> ExpertWeights:
        check_prepared(tensors, plan)
        w13_sf = tensors["w3_w1_weight_scale"]
        w2_sf = tensors["w2_weight_scale"]
        pieces = {
            "w13": tensors["w3_w1_weight"],
            "w13_scales": ops.unswizzle_scales_128x4(w13_sf, w13_sf.shape[-2], w13_sf.shape[-1]),
            "w13_bias": tensors["w3_w1_bias"],
            "w2": tensors["w2_weight"],
            "w2_scales": ops.unswizzle_scales_128x4(w2_sf, w2_sf.shape[-2], w2_sf.shape[-1]),
            "w2_bias": tensors["w2_bias"],
        }
        return unpadded_pieces(pieces, plan, NAMES)


NAMES = {
    "w13": "w3_w1_weight",
    "w13_scales": "w3_w1_weight_scale",
    "w13_bias": "w3_w1_bias",
    "w2": "w2_weight",
    "w2_scales": "w2_weight_scale",
    "w2_bias": "w2_bias",
}


def cutlass_tensor_specs(El: int, Ip: int, H2: int) -> dict[str, TensorSpec]:
    u8, bf16 = torch.uint8, torch.bfloat16
    return {
        "w3_w1_weight": TensorSpec((El, 2 * Ip, H2 // 2), u8, ("E", "2*Ip", "H2/2")),
        "w3_w1_weight_scale": TensorSpec((El, 2 * Ip, H2 // 32), u8, ("E", "2*Ip", "H2/32")),
        "w3_w1_bias": TensorSpec((El, 2 * Ip), bf16, ("E", "2*Ip")),
        "w2_weight": TensorSpec((El, H2, Ip // 2), u8, ("E", "H2", "Ip/2")),
        "w2_weight_scale": TensorSpec((El, H2, Ip // 32), u8, ("E", "H2", "Ip/32")),
        "w2_bias": TensorSpec((El, H2), bf16, ("E", "H2")),
    }


LAYOUT = CutlassSm12xLayout()
