"""``--layout triton-moe``: the layout of prepkit's own Triton MXFP4 MoE kernel.

Consumer: ``prepkit.kernels.mx`` (its ``WEIGHT_LAYOUT`` is this layout's id) through
``prepkit.runtime``. Byte-level spec: docs/triton-moe-layout.md.

Design, per expert and rank:
  * weights keep the checkpoint's output rows (gate/up rows interleaved, so a BLOCK_N tile of
    w13 holds whole (gate, up) pairs and the SwiGLU runs in the GEMM1 epilogue), cut along K into
    panels of :data:`PANEL_K` elements stored one after the other (:func:`to_panels`): panel p is
    ``[N, PANEL_BYTES]`` contiguous bytes. A kernel tile at one K step (BLOCK_K dividing PANEL_K)
    is then ``BLOCK_N`` rows of one contiguous ``BLOCK_N * PANEL_BYTES`` block instead of
    ``BLOCK_N`` short runs spread over ``BLOCK_N`` full rows: fewer DRAM pages per step, so the
    grid streams its weights faster (docs/kernel-history.md). The last panel is zero-padded, as
    TensorRT-LLM pads its MXFP4 K to 3072 for hidden 2880;
  * inside each 32-element group the nibbles are reordered (:func:`shuffle_nibbles`: byte j
    holds elements j and j+16), so the upcast is elementwise;
  * and the 16 bytes of each group are stored in MMA fragment order (:data:`FRAGMENT_ORDER`):
    the four bytes one thread feeds to a 16-bit tensor-core fragment (columns 2q, 2q+1, 2q+8,
    2q+9) are adjacent, so the kernel reads them with one 32-bit shared-memory load
    (``ldmatrix``) instead of byte pairs it must then repack;
  * E8M0 scales are transposed to ``[K/32, N]`` so a tile's scales are BLOCK_N contiguous bytes
    per K group instead of a few bytes from each of BLOCK_N rows;
  * biases are float32 (exact for bf16 sources), the epilogue adds them without a convert;
  * TP: contiguous, balanced slices of whole 32-row groups of the intermediate axis
    (:func:`intermediate_split`), zero-padded to the largest slice so every rank has the same
    shapes; the kernel reads only the valid rows (``valid_intermediate``). The down bias is
    stored whole on every rank (so ``invert`` recovers it anywhere); only TP rank 0 adds it.
  * EP: contiguous expert slices (:func:`prepkit.layouts.base.expert_range`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from prepkit.constants import TRITON_MOE_LAYOUT_ID
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
    expert_range,
)
from prepkit.mxfp4 import BLOCK_BYTES, BLOCK_ELEMS, pack_nibbles, unpack_nibbles

SHARDING_RULE = "balanced-32-groups"
TENSOR_NAMES = ("w13_blocks", "w13_scales", "w13_bias", "w2_blocks", "w2_scales", "w2_bias")
# K elements per weight panel; every K step the kernel takes (32 .. 256) divides it.
PANEL_K = 256
PANEL_BYTES = PANEL_K // 2


def num_panels(k: int) -> int:
    """Panels that hold ``k`` elements (the last one partly padding)."""
    return ops.ceil_div(k, PANEL_K)


def tensor_specs(num_local_experts: int, hidden: int, padded_intermediate: int) -> dict[str, TensorSpec]:
    """The six tensors of one layer and rank (docs/triton-moe-layout.md §2), for ``El`` local
    experts, hidden ``H`` and padded intermediate ``Ip``: what ``plan_rank`` writes and what the
    runtime checks before it launches the kernel."""
    El, H, Ip = num_local_experts, hidden, padded_intermediate
    u8, f32 = torch.uint8, torch.float32
    return {
        "w13_blocks": TensorSpec(
            (El, num_panels(H), 2 * Ip, PANEL_BYTES), u8, ("E", f"ceil(H/{PANEL_K})", "2*Ip", str(PANEL_BYTES))
        ),
        "w13_scales": TensorSpec((El, H // 32, 2 * Ip), u8, ("E", "H/32", "2*Ip")),
        "w13_bias": TensorSpec((El, 2 * Ip), f32, ("E", "2*Ip")),
        "w2_blocks": TensorSpec(
            (El, num_panels(Ip), H, PANEL_BYTES), u8, ("E", f"ceil(Ip/{PANEL_K})", "H", str(PANEL_BYTES))
        ),
        "w2_scales": TensorSpec((El, Ip // 32, H), u8, ("E", "Ip/32", "H")),
        "w2_bias": TensorSpec((El, H), f32, ("E", "H")),
    }


def to_panels(rows: torch.Tensor) -> torch.Tensor:
    """Byte rows ``[..., N, K/2]`` -> panels ``[..., ceil(K/PANEL_K), N, PANEL_BYTES]``: panel p holds
    bytes ``[p*PANEL_BYTES, (p+1)*PANEL_BYTES)`` of every row, zero past the row's end."""
    *lead, n, row_bytes = rows.shape
    p = ops.ceil_div(row_bytes, PANEL_BYTES)
    padded = ops.pad_to(rows, (*lead, n, p * PANEL_BYTES))
    return padded.unflatten(-1, (p, PANEL_BYTES)).transpose(-3, -2).contiguous()


def from_panels(panels: torch.Tensor, row_bytes: int, name: str = "weights") -> torch.Tensor:
    """Inverse of :func:`to_panels`: ``[..., P, N, PANEL_BYTES]`` -> ``[..., N, row_bytes]``.

    Raises:
        LayoutError: ``P`` panels do not fit ``row_bytes`` exactly, or the padding is not zero.
    """
    *lead, p, n, width = panels.shape
    if width != PANEL_BYTES or p != ops.ceil_div(row_bytes, PANEL_BYTES):
        raise LayoutError(
            f"{name}: panels {list(panels.shape)} do not hold rows of {row_bytes} bytes "
            f"(expected [..., {ops.ceil_div(row_bytes, PANEL_BYTES)}, N, {PANEL_BYTES}])"
        )
    rows = panels.transpose(-3, -2).flatten(-2)
    return _unpad_checked(rows, (*lead, n, row_bytes), name)


def intermediate_split(intermediate: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """``(lo, hi, per)``: checkpoint intermediate rows ``[lo, hi)`` of TP rank ``tp_rank`` and the
    padded row count ``per`` every rank stores.

    The axis is cut in whole 32-row groups (so each E8M0 scale group of the down projection stays
    on one rank), balanced: with ``G = I/32`` groups, rank ``r`` holds groups
    ``[floor(r*G/tp), floor((r+1)*G/tp))``, i.e. ``floor(G/tp)`` or ``ceil(G/tp)`` of them, and
    ``per = ceil(G/tp) * 32``. gpt-oss (I = 2880, G = 90): tp 2 -> 1440 each; tp 4 -> 704, 736,
    704, 736; tp 8 -> 352 or 384.

    Raises:
        LayoutError: ``tp_size``/``tp_rank`` out of range, or fewer 32-row groups than ranks.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"TP rank {tp_rank} of tp={tp_size} does not exist")
    groups = intermediate // BLOCK_ELEMS
    if groups < tp_size:
        raise LayoutError(
            f"tp={tp_size} leaves TP ranks without intermediate rows ({intermediate} rows are "
            f"{groups} groups of {BLOCK_ELEMS})",
            hint=f"use --tp {groups} or less",
        )
    lo = tp_rank * groups // tp_size * BLOCK_ELEMS
    hi = (tp_rank + 1) * groups // tp_size * BLOCK_ELEMS
    return lo, hi, ops.ceil_div(groups, tp_size) * BLOCK_ELEMS


def shuffle_nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """Checkpoint nibble order -> the layout's nibble order, per 32-element group (``[..., G, 16]``).

    Checkpoint byte j holds elements 2j (low nibble) and 2j+1 (high); here byte j holds element
    j (low) and element j+16 (high). The kernel then upcasts low and high nibbles into two
    separate tiles with elementwise bit operations only, each paired with a contiguous half of
    the group's activations, instead of interleaving values across registers.
    """
    codes = unpack_nibbles(blocks)  # [..., G, 32] in element order
    return codes[..., :16] | (codes[..., 16:] << 4)


def unshuffle_nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`shuffle_nibbles`."""
    codes = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1)
    return pack_nibbles(codes)


# Stored byte p of a 16-byte group is byte FRAGMENT_ORDER[p] of the nibble-ordered group. A
# 16-bit MMA fragment gives thread q of a quad the columns 2q, 2q+1, 2q+8 and 2q+9 of each 16-column
# step; here those four bytes are stored at 4q .. 4q+3.
FRAGMENT_ORDER = tuple(8 * jh + 2 * q + jl for q in range(4) for jh in range(2) for jl in range(2))
_NATURAL_ORDER = tuple(FRAGMENT_ORDER.index(j) for j in range(BLOCK_BYTES))


def to_fragment_order(groups: torch.Tensor) -> torch.Tensor:
    """Reorder the bytes of each 16-byte group (``[..., G, 16]``) into :data:`FRAGMENT_ORDER`."""
    return groups[..., list(FRAGMENT_ORDER)]


def from_fragment_order(groups: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_fragment_order`."""
    return groups[..., list(_NATURAL_ORDER)]


class TritonMoeLayout:
    name = "triton-moe"
    layout_id = TRITON_MOE_LAYOUT_ID
    w13_row_order = "interleaved"
    summary = "prepkit's Triton MXFP4 MoE kernel (any CUDA arch): 256-wide K panels, [K/32, N] scales"
    uses_options: tuple[str, ...] = ()

    def plan_rank(self, dims: ModelDims, spec: RankSpec, options: LayoutOptions) -> RankPlan:
        E_lo, E_hi = expert_range(dims.num_experts, spec)
        H, I = dims.hidden, dims.intermediate
        if H % BLOCK_ELEMS or I % BLOCK_ELEMS:
            raise LayoutError(f"hidden {H} and intermediate {I} must be multiples of {BLOCK_ELEMS} for MXFP4")
        lo, hi, Ip = intermediate_split(I, spec.tp_size, spec.tp_rank)
        tensors = tensor_specs(E_hi - E_lo, H, Ip)
        facts = {
            # Recorded in manifests: the kernel's former module name, so prepared output stays byte-identical.
            "engine": "prepkit Triton MXFP4 MoE kernel (prepkit.kernels.moe_mxfp4)",
            "valid_hidden_size": H,
            "valid_intermediate_size": hi - lo,
            "intermediate_size": Ip,
            "w13_rows": "interleaved: row 2i gate_i, row 2i+1 up_i",
            "weights": f"K panels of {PANEL_K} elements: [E, K_panels, N, {PANEL_BYTES}] bytes, last panel zero-padded",
            "scales": "uint8 E8M0, transposed to [K/32, N] per expert",
            "w2_bias": "whole on every rank; added by TP rank 0 only",
            "w2_bias_tp_rank": 0,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
        }
        return RankPlan(
            spec=spec,
            dims=dims,
            expert_range=(E_lo, E_hi),
            intermediate_range=(lo, hi),
            padded_intermediate=Ip,
            padded_hidden=H,
            tensors=tensors,
            sharding_rule=SHARDING_RULE,
            facts=facts,
        )

    def plan_warnings(self, dims: ModelDims, plans: Sequence[RankPlan], options: LayoutOptions) -> list[str]:
        return []

    def build(self, weights: ExpertWeights, plan: RankPlan) -> dict[str, torch.Tensor]:
        check_experts(weights, plan)
        piece = weights.intermediate_slice(*plan.intermediate_range)
        H, Ip, El = plan.dims.hidden, plan.padded_intermediate, weights.num_experts
        w13_scales = ops.pad_to(piece.gate_up_proj_scales, (El, 2 * Ip, H // 32))
        w2_scales = ops.pad_to(piece.down_proj_scales, (El, H, Ip // 32))
        w13_blocks = to_fragment_order(shuffle_nibbles(piece.gate_up_proj_blocks)).flatten(-2)
        w2_blocks = to_fragment_order(shuffle_nibbles(piece.down_proj_blocks)).flatten(-2)
        return {
            "w13_blocks": to_panels(ops.pad_to(w13_blocks, (El, 2 * Ip, H // 2))),
            "w13_scales": w13_scales.transpose(1, 2).contiguous(),
            "w13_bias": ops.pad_to(piece.gate_up_proj_bias.float(), (El, 2 * Ip)),
            "w2_blocks": to_panels(ops.pad_to(w2_blocks, (El, H, Ip // 2))),
            "w2_scales": w2_scales.transpose(1, 2).contiguous(),
            "w2_bias": piece.down_proj_bias.float().contiguous(),
        }

    def invert(self, tensors: Mapping[str, torch.Tensor], plan: RankPlan) -> ExpertWeights:
        El = None
        for name, spec in plan.tensors.items():
            t = tensors.get(name)
            if t is None:
                raise LayoutError(f"tensor {name!r} is missing")
            # Like build, accept any run of the rank's experts (same count in every tensor).
            El = t.shape[0] if El is None else El
            if tuple(t.shape) != (El, *spec.shape[1:]) or t.dtype != spec.dtype or El > spec.shape[0]:
                raise LayoutError(f"{name}: shape {list(t.shape)} {t.dtype}, expected {list(spec.shape)} {spec.dtype}")
        assert El is not None
        H, V = plan.dims.hidden, plan.valid_intermediate
        Ip = plan.padded_intermediate
        w13_rows = from_panels(tensors["w13_blocks"], H // 2, "w13_blocks")
        gate_up = _unpad_checked(w13_rows, (El, 2 * V, H // 2), "w13_blocks")
        gate_up_sf = _unpad_checked(tensors["w13_scales"].transpose(1, 2), (El, 2 * V, H // 32), "w13_scales")
        gate_up_bias = _bf16_exact(_unpad_checked(tensors["w13_bias"], (El, 2 * V), "w13_bias"), "w13_bias")
        down = _unpad_checked(from_panels(tensors["w2_blocks"], Ip // 2, "w2_blocks"), (El, H, V // 2), "w2_blocks")
        down_sf = _unpad_checked(tensors["w2_scales"].transpose(1, 2), (El, H, V // 32), "w2_scales")
        return ExpertWeights(
            gate_up_proj_blocks=_checkpoint_groups(gate_up),
            gate_up_proj_scales=gate_up_sf,
            gate_up_proj_bias=gate_up_bias,
            down_proj_blocks=_checkpoint_groups(down),
            down_proj_scales=down_sf,
            down_proj_bias=_bf16_exact(tensors["w2_bias"], "w2_bias"),
        )


def _checkpoint_groups(rows: torch.Tensor) -> torch.Tensor:
    """Stored rows ``[..., K/2]`` -> checkpoint blocks ``[..., K/32, 16]``."""
    return unshuffle_nibbles(from_fragment_order(rows.unflatten(-1, (-1, BLOCK_BYTES))))


def _unpad_checked(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    core, padding_is_zero = ops.unpad(t, shape)
    if not padding_is_zero:
        raise LayoutError(f"{name}: padding beyond {list(shape)} holds nonzero bytes")
    return core


def _bf16_exact(t: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 bias -> the checkpoint's bf16, refusing values bf16 cannot hold (a corrupted shard)."""
    out = t.to(torch.bfloat16)
    if t.device.type != "meta" and not torch.equal(out.float(), t):
        raise LayoutError(f"{name}: values are not bf16-exact, so they did not come from the checkpoint")
    return out


LAYOUT = TritonMoeLayout()
