"""``--layout cutlass-sm90``: MXFP4 weights for FlashInfer's SM90 (Hopper) W4A16 CUTLASS MoE.

Consumer: FlashInfer 0.7.x ``cutlass_fused_moe(x_bf16, ..., use_w4_group_scaling=True)``, the
mixed-input grouped GEMM (BF16 activations x MXFP4 weights) whose byte layout FlashInfer has had
since 0.6.15 (PR #3738). Sources read: FlashInfer 0.7.2.post1 ``flashinfer/fused_moe/prepare.py``
(``interleave_moe_weights_for_sm90_mixed_gemm``, ``interleave_moe_scales_for_sm90_mixed_gemm``),
``csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_mixed_utils.cu``
(``interleave_fp4_weights_for_sm90_mixed_gemm_kernel``), ``tests/moe/test_trtllm_cutlass_fused_moe.py``
(``test_moe_bf16_mxfp4``: the call), and ``cutlass_fused_moe_kernels.cuh`` (fc2 bias on TP rank 0).
TensorRT-LLM's own Hopper method (``WFP4A16FusedMoEMethod``) wants other bytes (no weight
interleave, ``[E, K/128, rows*4]`` scales); this layout does not target it.

Per expert and rank:
  1-3. as ``cutlass-sm12x``: ``[up ; gate]`` rows, TensorRT-LLM's pad-before-shard TP split,
     each half zero-padded to ``Ip = roundup(I/tp, 128)``, K and fc2 rows to ``roundup(H, 128)``
     (the scale fold needs K % 128 == 0 and rows % 64 == 0);
  4. weights: the SM90 mixed-GEMM nibble interleave (:func:`interleave_weights_sm90`);
  5. scales: the 64-row x 128-K fold (:func:`fold_scales_sm90`), stored in the logical 2-D shape;
  6. biases bfloat16, the fc2 bias whole and unscaled (added on TP rank 0 only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

import torch

from prepkit.constants import CUTLASS_SM90_LAYOUT_ID
from prepkit.layouts.base import (
    ExpertWeights,
    LayoutOptions,
    ModelDims,
    RankPlan,
    RankSpec,
    check_prepared,
)
from prepkit.layouts.cutlass_sm12x import (
    NAMES,
    padded_pieces,
    plan_cutlass_rank,
    unpadded_pieces,
)

FLASHINFER_VERSION = "0.7.2.post1"  # the layout of FlashInfer >= 0.6.15 (PR #3738), read in this release

# --- weight interleave (moe_gemm_mixed_utils.cu, interleave_fp4_weights_for_sm90_mixed_gemm_kernel) --
#
# The kernel works on tiles of 16 rows x 32 bytes. Rows 16g + r8 and 16g + r8 + 8 form a pair; in a
# 32-byte group the byte offset is 8*mma + 4*h + j (mma 0..3, h 0..1, j 0..3). The four bytes
# (row ra, c), (row rb, c), (row ra, c+4), (row rb, c+4) with c = 8*mma + j give eight nibbles
# n0..n7 (low nibble first), which are repacked into one little-endian 32-bit word so that the
# LUT-based FP4 -> BF16 converter finds magnitudes and signs where it reads them. The word lands
# in row 16g + r8 + 8*(mma % 2), bytes 16*(mma // 2) + 4*j .. +3 of the group.


def _pack_half(a: int, b: int, c: int, d: int) -> int:
    """16 bits from four nibbles: three 3-bit magnitudes side by side, the fourth split around
    the sign bits (bit order fixed by the kernel's masks)."""
    return (
        (a & 7)
        | (b & 7) << 3
        | (c & 7) << 6
        | (a >> 3) << 9
        | ((d & 7) >> 1) << 10
        | (b >> 3) << 12
        | (d & 1) << 13
        | (d >> 3) << 14
        | (c >> 3) << 15
    )


def _repack_word(raw: int) -> int:
    """The kernel's 32-bit word from its four source bytes ``raw`` (byte 0 = (ra, c), 1 = (rb, c),
    2 = (ra, c+4), 3 = (rb, c+4), little-endian)."""
    n = [(raw >> (4 * i)) & 0xF for i in range(8)]
    return _pack_half(n[4], n[2], n[0], n[6]) | _pack_half(n[5], n[3], n[1], n[7]) << 16


def _shift_groups(dest: list[int]) -> list[tuple[int, int]]:
    """``(mask, shift)`` pairs moving input bit ``p`` to ``dest[p]``, one pair per distance."""
    groups: dict[int, int] = {}
    for p, q in enumerate(dest):
        groups[q - p] = groups.get(q - p, 0) | 1 << p
    return [(mask, shift) for shift, mask in sorted(groups.items())]


_DEST = [_repack_word(1 << p).bit_length() - 1 for p in range(32)]  # input bit p -> word bit
assert sorted(_DEST) == list(range(32)), "the repack must be a bit permutation"
_FORWARD = _shift_groups(_DEST)
_BACKWARD = _shift_groups([_DEST.index(q) for q in range(32)])


def _move_bits_by_shifts(x: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
    """Apply a bit permutation to int32 words with one mask-and-shift per shift distance. A right
    shift masks after shifting, so sign extension never leaks in."""
    out = torch.zeros_like(x)
    for mask, shift in groups:
        out |= (x & mask) << shift if shift >= 0 else (x >> -shift) & (mask >> -shift)
    return out


@lru_cache(maxsize=2)
def _byte_tables(groups: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``[4, 256]`` int32: where the bits of byte ``b`` of a word land. A bit permutation is
    linear under OR, so a word maps to the OR of its four bytes' entries."""
    values = torch.arange(256, dtype=torch.int32)
    return torch.stack([_move_bits_by_shifts(values << (8 * b), list(groups)) for b in range(4)])


def _move_bits(words: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
    """Apply a bit permutation to ``[..., 4]`` uint8 little-endian words, all at once: four
    table lookups per word instead of a pass per shift distance."""
    tables = _byte_tables(tuple(groups)).to(words.device)
    b = words.contiguous().long()
    out = tables[0][b[..., 0]] | tables[1][b[..., 1]] | tables[2][b[..., 2]] | tables[3][b[..., 3]]
    return out.unsqueeze(-1).view(torch.uint8)


def _check_interleave_shape(w: torch.Tensor) -> tuple[int, int]:
    if w.dtype != torch.uint8 or w.dim() < 2:
        raise ValueError(f"SM90 weight interleave takes [..., n, k/2] uint8, got {list(w.shape)} {w.dtype}")
    n, kb = w.shape[-2], w.shape[-1]
    if n % 16 or kb % 32:
        raise ValueError(f"SM90 weight interleave needs n % 16 == 0 and k % 64 == 0, got n={n}, k={2 * kb}")
    return n, kb


def interleave_weights_sm90(w: torch.Tensor) -> torch.Tensor:
    """``[..., n, k/2]`` packed FP4 -> the same shape in the SM90 mixed-input GEMM order
    (FlashInfer ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")``, per leading index)."""
    n, kb = _check_interleave_shape(w)
    lead = w.shape[:-2]
    d = len(lead)
    # [..., g, s, r8, p, mma, h, j]: row 16g + 8s + r8, byte 32p + 8mma + 4h + j
    src = w.reshape(*lead, n // 16, 2, 8, kb // 32, 4, 2, 4)
    # word bytes (ra, c), (rb, c), (ra, c+4), (rb, c+4): order (h, s) last -> [..., g, r8, p, mma, j, 4]
    words = src.permute(*range(d), d, d + 2, d + 3, d + 4, d + 6, d + 5, d + 1).flatten(-2)
    out = _move_bits(words, _FORWARD).view(torch.int32).squeeze(-1)  # whole words from here on
    # mma = 2q + s': the word goes to row 16g + 8s' + r8, bytes 32p + 16q + 4j + b
    out = out.reshape(*lead, n // 16, 8, kb // 32, 2, 2, 4)  # g, r8, p, q, s', j
    out = out.permute(*range(d), d, d + 4, d + 1, d + 2, d + 3, d + 5).contiguous()
    return out.view(torch.uint8).reshape(*lead, n, kb)


def deinterleave_weights_sm90(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_weights_sm90`."""
    n, kb = _check_interleave_shape(w)
    lead = w.shape[:-2]
    d = len(lead)
    t = w.contiguous().view(torch.int32).reshape(*lead, n // 16, 2, 8, kb // 32, 2, 4)  # g, s', r8, p, q, j
    t = t.permute(*range(d), d, d + 2, d + 3, d + 4, d + 1, d + 5).contiguous()  # g, r8, p, q, s', j
    t = t.view(torch.uint8).reshape(*lead, n // 16, 8, kb // 32, 4, 4, 4)  # g, r8, p, mma, j, b
    raw = _move_bits(t, _BACKWARD).unflatten(-1, (2, 2))  # g, r8, p, mma, j, h, s
    raw = raw.permute(*range(d), d, d + 6, d + 1, d + 2, d + 3, d + 5, d + 4)  # g, s, r8, p, mma, h, j
    return raw.reshape(*lead, n, kb)


# --- scale fold (prepare.py, interleave_moe_scales_for_sm90_mixed_gemm, uint8 / group 32) ---------


def _check_fold_shape(s: torch.Tensor) -> tuple[int, int]:
    if s.dtype != torch.uint8 or s.dim() < 2:
        raise ValueError(f"SM90 scale fold takes [..., rows, K/32] uint8, got {list(s.shape)} {s.dtype}")
    rows, groups = s.shape[-2], s.shape[-1]
    if rows % 64 or groups % 4:
        raise ValueError(f"SM90 scale fold needs rows % 64 == 0 and K % 128 == 0, got rows={rows}, K/32={groups}")
    return rows, groups


def fold_scales_sm90(s: torch.Tensor) -> torch.Tensor:
    """``[..., rows, K/32]`` E8M0 -> same shape, each 64-row x 128-K block as one 256-byte chunk of
    sixteen 16-byte lines: line ``f`` holds rows ``f, f+16, f+32, f+48`` of the block, 4 scales
    each. ``out.view(..., rows/64, K/128, 16, 16)`` is FlashInfer's helper output."""
    rows, groups = _check_fold_shape(s)
    lead = s.shape[:-2]
    d = len(lead)
    t = s.reshape(*lead, rows // 64, 4, 16, groups // 4, 4)  # rb, m, f, kb, j
    t = t.permute(*range(d), d, d + 3, d + 2, d + 1, d + 4)  # rb, kb, f, m, j
    return t.reshape(*lead, rows, groups)


def unfold_scales_sm90(s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fold_scales_sm90`."""
    rows, groups = _check_fold_shape(s)
    lead = s.shape[:-2]
    d = len(lead)
    t = s.reshape(*lead, rows // 64, groups // 4, 16, 4, 4)  # rb, kb, f, m, j
    t = t.permute(*range(d), d, d + 3, d + 2, d + 1, d + 4)  # rb, m, f, kb, j
    return t.reshape(*lead, rows, groups)


# --- the layout ------------------------------------------------------------------------------


class CutlassSm90Layout:
    name = "cutlass-sm90"
    layout_id = CUTLASS_SM90_LAYOUT_ID
    w13_row_order = "up_gate"
    summary = f"FlashInfer {FLASHINFER_VERSION} SM90 W4A16 CUTLASS MoE: interleaved nibbles, folded scales"
    uses_options: tuple[str, ...] = ()

    def plan_rank(self, dims: ModelDims, spec: RankSpec, options: LayoutOptions) -> RankPlan:
        facts = {
            "engine": "FlashInfer cutlass_fused_moe(use_w4_group_scaling=True) on SM90 (BF16 x MXFP4)",
            "flashinfer_version": FLASHINFER_VERSION,
            "flashinfer_layout": "SM90 mixed-input layout of FlashInfer >= 0.6.15 (PR #3738); not <= 0.6.14",
            "activation_quantization": (
                "none: bfloat16 activations zero-padded from valid_hidden_size to padded_hidden columns; "
                "output sliced back to valid_hidden_size"
            ),
            "engine_views": {
                "w3_w1_weight": "uint8 as stored (fc1_expert_weights)",
                "w2_weight": "uint8 as stored (fc2_expert_weights)",
                "w3_w1_weight_scale": (
                    "int32 view of the bytes: .view(E, 2*Ip/64, padded_hidden/128, 16, 16).view(torch.int32)"
                ),
                "w2_weight_scale": (
                    "int32 view of the bytes: .view(E, padded_hidden/64, Ip/128, 16, 16).view(torch.int32)"
                ),
            },
            "quant_scales": "[w3_w1_weight_scale(int32), w2_weight_scale(int32)]",
            "weights": (
                "SM90 mixed-GEMM nibble interleave per expert "
                "(interleave_moe_weights_for_sm90_mixed_gemm, quant_type fp4)"
            ),
            "scales": "uint8 E8M0 folded per 64x128 block (interleave_moe_scales_for_sm90_mixed_gemm), "
            "logical 2-D shape",
            "engine_fc2_bias": "full, added on tp_rank 0 only (pass tp_size/tp_rank to the MoE call)",
            "bias_dtype": "bfloat16 (the activation dtype)",
        }
        # Ip and H2 are multiples of 128, which the interleave (n % 16, K % 64) and the fold
        # (rows % 64, K % 128) need.
        return plan_cutlass_rank(dims, spec, facts)

    def plan_warnings(self, dims: ModelDims, plans: Sequence[RankPlan], options: LayoutOptions) -> list[str]:
        return []

    def build(self, weights: ExpertWeights, plan: RankPlan) -> dict[str, torch.Tensor]:
        p = padded_pieces(weights, plan)
        return {
            "w3_w1_weight": interleave_weights_sm90(p["w13"]),
            "w3_w1_weight_scale": fold_scales_sm90(p["w13_scales"]),
            "w3_w1_bias": p["w13_bias"],
            "w2_weight": interleave_weights_sm90(p["w2"]),
            "w2_weight_scale": fold_scales_sm90(p["w2_scales"]),
            "w2_bias": p["w2_bias"],
        }

    def invert(self, tensors: Mapping[str, torch.Tensor], plan: RankPlan) -> ExpertWeights:
        check_prepared(tensors, plan)
        pieces = {
            "w13": deinterleave_weights_sm90(tensors["w3_w1_weight"]),
            "w13_scales": unfold_scales_sm90(tensors["w3_w1_weight_scale"]),
            "w13_bias": tensors["w3_w1_bias"],
            "w2": deinterleave_weights_sm90(tensors["w2_weight"]),
            "w2_scales": unfold_scales_sm90(tensors["w2_weight_scale"]),
            "w2_bias": tensors["w2_bias"],
        }
        return unpadded_pieces(pieces, plan, NAMES)


LAYOUT = CutlassSm90Layout()
