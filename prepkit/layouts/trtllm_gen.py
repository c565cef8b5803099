"""``--layout trtllm-gen``: the bytes TensorRT-LLM's trtllm-gen MXFP4 MoE builds at load time.

Consumer: TensorRT-LLM PyTorch backend, ``MXFP4WeightTRTLLMGenFusedMoEMethod`` and its W4A16 /
W4A8 subclasses (same weight, scale and bias bytes), and FlashInfer's
``trtllm_fp4_block_scale_moe`` with the same padding. Source read:
``tensorrt_llm/_torch/moe/fused_moe/quantization.py`` (``_get_weight_alignment``,
``maybe_pad_for_mxfp4``, ``load_expert_w3_w1_weight``, ``load_expert_w2_weight``, the
``_uses_logical_tp_sharding`` branch of PR #18870), ``modeling_gpt_oss.py`` (``load_hf_weights``),
``fp4_utils.py`` (row permutations) and ``thop/fp4Op.cpp`` (``computeSFIndex``).

Per expert and rank:
  1. de-interleave the checkpoint's gate/up rows (row 2i gate, 2i+1 up);
  2. take the rank's intermediate rows (pad-before-shard, or logical slicing; see
     :func:`intermediate_split`) and zero-pad each half to ``Ip = roundup(I/tp, 128)`` rows and
     fc1 K to ``roundup(H, 512)``; fc2 rows to ``roundup(H, 128)``;
  3. stack ``[up ; gate]`` (TRT-LLM's ``w3_w1``), gather rows with gated-reorder-then-shuffle
     (fc1) or shuffle (fc2) for ``epilogue_tile_m = 128``; weights, scales and biases alike;
  4. 128x4-interleave the E8M0 scales; biases become float32, the fc2 bias divided by tp and
     kept whole on every rank (the kernel adds it on every rank before the all-reduce).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from prepkit.constants import TRTLLM_GEN_LAYOUT_ID
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
from prepkit.mxfp4 import BLOCK_BYTES, BLOCK_ELEMS

WEIGHT_ALIGNMENT = 128  # rows of a kernel tile
INPUT_HIDDEN_ALIGNMENT = 512  # fc1 K padding
SCALING_VECTOR_SIZE = BLOCK_ELEMS
EPILOGUE_TILE_M = 128  # hard-coded in TRT-LLM ("depends on kernel internals")

TRTLLM_VERSIONS = ("main", "1.2")

PAD_BEFORE_SHARD = "pad-before-shard"
LOGICAL = "logical-tp-shard"


def uses_logical_tp_sharding(intermediate: int, tp_size: int) -> bool:
    """TRT-LLM main's ``_requires_rank_local_tp_padding`` predicate (PR #18870): every rank owns
    whole 32-groups but not a 128-aligned row count, so it slices unpadded and pads locally."""
    per_rank = intermediate // tp_size
    return (
        tp_size > 1
        and intermediate % tp_size == 0
        and per_rank % SCALING_VECTOR_SIZE == 0
        and per_rank % WEIGHT_ALIGNMENT != 0
    )


@dataclass(frozen=True)
class IntermediateSplit:
    rule: str
    row_range: tuple[int, int]  # checkpoint intermediate rows held by this rank
    padded_intermediate: int  # Ip: rows of each half in the engine buffer


def intermediate_split(intermediate: int, tp_size: int, tp_rank: int, trtllm_version: str) -> IntermediateSplit:
    """Which checkpoint rows of the intermediate axis one TP rank holds, as TRT-LLM decides it."""
    if trtllm_version not in TRTLLM_VERSIONS:
        raise LayoutError(
            f"unknown TensorRT-LLM version {trtllm_version!r}", hint=f"use one of {', '.join(TRTLLM_VERSIONS)}"
        )
    padded = ops.round_up(intermediate // tp_size, WEIGHT_ALIGNMENT)  # create_weights' buffer
    if trtllm_version == "main" and uses_logical_tp_sharding(intermediate, tp_size):
        per_rank = intermediate // tp_size
        lo = tp_rank * per_rank
        return IntermediateSplit(LOGICAL, (lo, lo + per_rank), padded)

    # Pad the whole axis to a multiple of A, then cut it in tp equal slices.
    align = ops.trtllm_weight_alignment(WEIGHT_ALIGNMENT, SCALING_VECTOR_SIZE, tp_size, intermediate)
    slice_rows = ops.round_up(intermediate, align) // tp_size
    # fc2 scales are padded with an alignment computed from their column count (I/32), a quirk
    # of the engine; the split only works where both agree on the boundaries.
    scale_cols = intermediate // SCALING_VECTOR_SIZE
    scale_align = ops.trtllm_weight_alignment(WEIGHT_ALIGNMENT, SCALING_VECTOR_SIZE, tp_size, scale_cols)
    scale_slice = ops.ceil_div(ops.round_up(scale_cols, scale_align // SCALING_VECTOR_SIZE), tp_size)
    if slice_rows != padded or scale_slice * SCALING_VECTOR_SIZE != slice_rows:
        raise LayoutError(
            f"TensorRT-LLM cannot split intermediate size {intermediate} over tp={tp_size}: "
            f"weight slices of {slice_rows} rows, fc2 scale slices of {scale_slice * SCALING_VECTOR_SIZE}, "
            f"buffers of {padded}",
            hint="choose a tp size that divides the intermediate size into 32-row groups",
        )
    lo = min(tp_rank * slice_rows, intermediate)
    return IntermediateSplit(PAD_BEFORE_SHARD, (lo, min(lo + slice_rows, intermediate)), padded)


class TrtllmGenLayout:
    name = "trtllm-gen"
    layout_id = TRTLLM_GEN_LAYOUT_ID
    w13_row_order = "up_gate"
    summary = "TensorRT-LLM trtllm-gen MXFP4 MoE (SM100 family): shuffled rows, 128x4 scales"
    uses_options: tuple[str, ...] = ("trtllm_version",)

    # --- planning -------------------------------------------------------------------------

    def plan_rank(self, dims: ModelDims, spec: RankSpec, options: LayoutOptions) -> RankPlan:
        E_lo, E_hi = expert_range(dims.num_experts, spec)
        H, I = dims.hidden, dims.intermediate
        if H % BLOCK_ELEMS or I % BLOCK_ELEMS:
            raise LayoutError(f"hidden {H} and intermediate {I} must be multiples of {BLOCK_ELEMS} for MXFP4")
        split = intermediate_split(I, spec.tp_size, spec.tp_rank, options.trtllm_version)
        lo, hi = split.row_range
        if hi <= lo:
            raise LayoutError(
                f"tp={spec.tp_size} leaves TP rank {spec.tp_rank} without intermediate rows "
                f"(TensorRT-LLM pads {I} rows to slices of {split.padded_intermediate})",
                hint="use a smaller --tp",
            )
        Ip = split.padded_intermediate
        H1 = ops.round_up(H, INPUT_HIDDEN_ALIGNMENT)
        H2 = ops.round_up(H, WEIGHT_ALIGNMENT)
        El = E_hi - E_lo
        u8, f32 = torch.uint8, torch.float32
        tensors = {
            "w3_w1_weight": TensorSpec((El, 2 * Ip, H1 // 2), u8, ("E", "2*Ip", "H1/2")),
            "w3_w1_weight_scale": TensorSpec((El, 2 * Ip, H1 // 32), u8, ("E", "2*Ip", "H1/32")),
            "w3_w1_bias": TensorSpec((El, 2 * Ip), f32, ("E", "2*Ip")),
            "w2_weight": TensorSpec((El, H2, Ip // 2), u8, ("E", "H2", "Ip/2")),
            "w2_weight_scale": TensorSpec((El, H2, Ip // 32), u8, ("E", "H2", "Ip/32")),
            "w2_bias": TensorSpec((El, H2), f32, ("E", "H2")),
        }
        facts = {
            "engine": "TensorRT-LLM trtllm-gen MXFP4 MoE (MXFP4WeightTRTLLMGenFusedMoEMethod)",
            "trtllm_version": options.trtllm_version,
            "valid_hidden_size": H,
            "padded_hidden_fc1": H1,
            "padded_hidden_fc2": H2,
            "valid_intermediate_size": hi - lo,
            "intermediate_size": Ip,
            "epilogue_tile_m": EPILOGUE_TILE_M,
            "w2_bias": "divided by tp_size, whole on every rank",
            "scales": "uint8 E8M0, 128x4-interleaved per expert, logical 2-D shape",
            "swiglu_alpha": 1.702,
            "swiglu_beta": 1.0,
            "swiglu_limit": 7.0,
        }
        return RankPlan(
            spec=spec,
            dims=dims,
            expert_range=(E_lo, E_hi),
            intermediate_range=(lo, hi),
            padded_intermediate=Ip,
            padded_hidden=H2,
            tensors=tensors,
            sharding_rule=split.rule,
            facts=facts,
        )

    # --- forward --------------------------------------------------------------------------

    def plan_warnings(self, dims: ModelDims, plans: Sequence[RankPlan], options: LayoutOptions) -> list[str]:
        """Where the TensorRT-LLM versions split the intermediate axis differently (only some TP
        sizes), the bytes fit one version only: say so, naming the ranks that differ."""
        warnings = []
        for version in TRTLLM_VERSIONS:
            if version == options.trtllm_version or not plans:
                continue
            other = replace(options, trtllm_version=version)
            differ = [
                p.spec.rank
                for p in plans
                if self.plan_rank(dims, p.spec, other).intermediate_range != p.intermediate_range
            ]
            if differ:
                warnings.append(
                    f"at tp={plans[0].spec.tp_size} the per-rank bytes depend on the TensorRT-LLM version: using "
                    f"--trtllm-version {options.trtllm_version} ({plans[0].sharding_rule}); "
                    f"--trtllm-version {version} would place different rows on ranks {differ}"
                )
        return warnings

    def build(self, weights: ExpertWeights, plan: RankPlan) -> dict[str, torch.Tensor]:
        check_experts(weights, plan)
        piece = weights.intermediate_slice(*plan.intermediate_range)
        Ip, H2 = plan.padded_intermediate, plan.padded_hidden
        H1 = plan.facts["padded_hidden_fc1"]
        tp = plan.spec.tp_size
        # Each output is one gather from the checkpoint rows: de-interleave, [up ; gate] stacking,
        # per-half padding and the permutation composed into one index (see w13_source_rows).
        rows13 = w13_source_rows(plan.valid_intermediate, Ip)
        rows2 = w2_source_rows(plan.dims.hidden, H2)
        gate_up = piece.gate_up_proj_blocks.flatten(-2)
        return {
            "w3_w1_weight": ops.gather_rows(gate_up, rows13, H1 // 2),
            "w3_w1_weight_scale": ops.swizzle_scales_128x4(
                ops.gather_rows(piece.gate_up_proj_scales, rows13, H1 // 32)
            ),
            "w3_w1_bias": ops.gather_rows(piece.gate_up_proj_bias.float().unsqueeze(-1), rows13, 1).squeeze(-1),
            "w2_weight": ops.gather_rows(piece.down_proj_blocks.flatten(-2), rows2, Ip // 2),
            "w2_weight_scale": ops.swizzle_scales_128x4(ops.gather_rows(piece.down_proj_scales, rows2, Ip // 32)),
            "w2_bias": ops.gather_rows(piece.down_proj_bias.float().unsqueeze(-1), rows2, 1).squeeze(-1) / tp,
        }

    # --- inverse --------------------------------------------------------------------------

    def invert(self, tensors: Mapping[str, torch.Tensor], plan: RankPlan) -> ExpertWeights:
        check_prepared(tensors, plan)
        H, V = plan.dims.hidden, plan.valid_intermediate
        Ip, H2 = plan.padded_intermediate, plan.padded_hidden
        tp = plan.spec.tp_size
        inv13 = ops.inverse_permutation(ops.w13_row_indices(2 * Ip, EPILOGUE_TILE_M))
        inv2 = ops.inverse_permutation(ops.shuffle_row_indices(H2, EPILOGUE_TILE_M))

        w13 = tensors["w3_w1_weight"].index_select(1, inv13)
        w13_sf = ops.unswizzle_scales_128x4(
            tensors["w3_w1_weight_scale"], 2 * Ip, tensors["w3_w1_weight_scale"].shape[-1]
        )
        w13_sf = w13_sf.index_select(1, inv13)
        w13_bias = tensors["w3_w1_bias"].index_select(1, inv13)
        gate_up = _split_up_gate(w13, V, H // 2, "w3_w1_weight")
        gate_up_sf = _split_up_gate(w13_sf, V, H // 32, "w3_w1_weight_scale")
        gate_up_bias = _split_up_gate(w13_bias.unsqueeze(-1), V, 1, "w3_w1_bias").squeeze(-1)

        w2 = tensors["w2_weight"].index_select(1, inv2)
        w2_sf = ops.unswizzle_scales_128x4(tensors["w2_weight_scale"], H2, Ip // 32).index_select(1, inv2)
        w2_bias = tensors["w2_bias"].index_select(1, inv2)
        El = w2.shape[0]
        down = _unpad_checked(w2, (El, H, V // 2), "w2_weight")
        down_sf = _unpad_checked(w2_sf, (El, H, V // 32), "w2_weight_scale")
        down_bias = _unpad_checked(w2_bias, (El, H), "w2_bias") * tp

        return ExpertWeights(
            gate_up_proj_blocks=gate_up.unflatten(-1, (-1, BLOCK_BYTES)),
            gate_up_proj_scales=gate_up_sf,
            gate_up_proj_bias=gate_up_bias.to(torch.bfloat16),
            down_proj_blocks=down.unflatten(-1, (-1, BLOCK_BYTES)),
            down_proj_scales=down_sf,
            down_proj_bias=down_bias.to(torch.bfloat16),
        )


@lru_cache(maxsize=32)
def w13_source_rows(valid: int, padded: int) -> torch.Tensor:
    """For each ``w3_w1`` output row, the checkpoint gate_up row it comes from (-1: zero padding).

    Stacked row ``s`` of ``[up ; gate]`` (each half ``padded`` long) is up ``s`` or gate
    ``s - padded``; up ``i`` is checkpoint row ``2i + 1`` and gate ``i`` is row ``2i``; rows at or
    past ``valid`` in a half are padding. The engine's gather (gated reorder, then shuffle) picks
    the stacked rows.
    """
    stacked = ops.w13_row_indices(2 * padded, EPILOGUE_TILE_M)
    is_up = stacked < padded
    i = torch.where(is_up, stacked, stacked - padded)
    rows = torch.where(is_up, 2 * i + 1, 2 * i)
    return torch.where(i < valid, rows, torch.full_like(rows, -1))


@lru_cache(maxsize=32)
def w2_source_rows(hidden: int, padded_hidden: int) -> torch.Tensor:
    """For each ``w2`` output row, the checkpoint down row (-1: zero padding)."""
    rows = ops.shuffle_row_indices(padded_hidden, EPILOGUE_TILE_M)
    return torch.where(rows < hidden, rows, torch.full_like(rows, -1))


def _split_up_gate(stacked: torch.Tensor, valid_rows: int, cols: int, name: str) -> torch.Tensor:
    """``[E, 2*half, C]`` = ``[up ; gate]`` with per-half padding -> checkpoint rows (gate/up
    interleaved), checking that every padding byte is zero."""
    half = stacked.shape[1] // 2
    E = stacked.shape[0]
    up = _unpad_checked(stacked[:, :half], (E, valid_rows, cols), name)
    gate = _unpad_checked(stacked[:, half:], (E, valid_rows, cols), name)
    return ops.interleave_rows(gate, up, dim=1)


def _unpad_checked(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    core, padding_is_zero = ops.unpad(t, shape)
    if not padding_is_zero:
        raise LayoutError(f"{name}: padding beyond {list(shape)} holds nonzero bytes")
    return core


LAYOUT = TrtllmGenLayout()
