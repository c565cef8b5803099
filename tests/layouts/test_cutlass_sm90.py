"""``cutlass-sm90``: the SM90 weight interleave against a literal model of the CUDA kernel, the
scale fold against its index formula, round trips on real dims, shapes, bad input."""

from __future__ import annotations

import pytest
import torch

from prepkit.errors import LayoutError
from prepkit.layouts.base import ExpertWeights, LayoutOptions, ModelDims, RankSpec
from prepkit.layouts.cutlass_sm12x import LAYOUT as SM12X
from prepkit.layouts.cutlass_sm12x import stack_up_gate
from prepkit.layouts.cutlass_sm90 import (
    LAYOUT,
    deinterleave_weights_sm90,
    fold_scales_sm90,
    interleave_weights_sm90,
    unfold_scales_sm90,
)

H = I = 2880
E = 2
DIMS = ModelDims(num_layers=1, num_experts=E, hidden=H, intermediate=I, top_k=1)
OPTS = LayoutOptions()
PADDED = {1: 2944, 2: 1536, 4: 768, 8: 384}

# (mask, shift) pairs of interleave_fp4_weights_for_sm90_mixed_gemm_kernel (moe_gemm_mixed_utils.cu,
# FlashInfer 0.7.2.post1); a positive shift moves left, a negative one right.
KERNEL_MASKS = [
    (0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
    (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
    (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
    (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13),
    (0x01000000, -11), (0x06000000, -15),
]  # fmt: skip


def kernel_model(w: torch.Tensor) -> torch.Tensor:
    """The kernel's loops run one thread at a time on a ``[rows, cols/2]`` byte matrix."""
    rows, kb = w.shape
    cols = 2 * kb
    src = w.flatten().tolist()
    out: list[int | None] = [None] * len(src)
    for block_id in range(rows // 2):
        for partition_id in range(cols // 64):
            for lane_id in range(16):
                row_id = block_id // 8 * 16 + block_id % 8
                mma_id = lane_id // 4
                dst_row_id = row_id + (mma_id % 2) * 8
                col_id = partition_id * 32 + mma_id * 8 + lane_id % 4
                dst_col_id = partition_id * 32 + lane_id // 8 * 16 + (lane_id % 4) * 4
                first, second = row_id * kb + col_id, (row_id + 8) * kb + col_id
                raw = src[first] | src[second] << 8 | src[first + 4] << 16 | src[second + 4] << 24
                word = 0
                for mask, shift in KERNEL_MASKS:
                    word |= ((raw & mask) << shift if shift > 0 else (raw & mask) >> -shift) & 0xFFFFFFFF
                dst = dst_row_id * kb + dst_col_id
                for b in range(4):
                    assert out[dst + b] is None, "kernel writes a byte twice"
                    out[dst + b] = (word >> (8 * b)) & 0xFF
    assert None not in out, "kernel leaves a byte unwritten"
    return torch.tensor(out, dtype=torch.uint8).view(rows, kb)


def random_weights(dims: ModelDims, num_experts: int, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for role, (shape, dtype) in dims.source_shapes().items():
        shape = (num_experts, *shape[1:])
        if dtype == torch.uint8:
            out[role] = torch.randint(1, 255 if role.endswith("scales") else 256, shape, dtype=dtype, generator=g)
        else:
            sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
            out[role] = ((torch.rand(shape, generator=g) + 0.5) * sign).to(dtype)
    return ExpertWeights.from_mapping(out)


def assert_same_bytes(got: ExpertWeights, want: ExpertWeights) -> None:
    for role, t in want.as_dict().items():
        g = getattr(got, role)
        assert g.dtype == t.dtype and tuple(g.shape) == tuple(t.shape), role
        assert torch.equal(g.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), role


@pytest.fixture(scope="module")
def weights() -> ExpertWeights:
    return random_weights(DIMS, E)


@pytest.mark.parametrize(("rows", "kb"), [(16, 32), (32, 64), (48, 96)])
def test_weight_interleave_matches_the_kernel(rows: int, kb: int) -> None:
    w = torch.randint(0, 256, (rows, kb), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows + kb))
    got = interleave_weights_sm90(w)
    assert torch.equal(got, kernel_model(w))
    assert torch.equal(deinterleave_weights_sm90(got), w)


def test_weight_interleave_is_per_expert_and_inverts() -> None:
    w = torch.randint(0, 256, (3, 64, 160), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got = interleave_weights_sm90(w)
    for e in range(3):
        assert torch.equal(got[e], interleave_weights_sm90(w[e]))
    assert torch.equal(deinterleave_weights_sm90(got), w)
    # the kernel permutes bits inside 16-row x 32-byte tiles: each tile keeps its popcount
    popcount = torch.tensor([bin(b).count("1") for b in range(256)])
    tiles = (3, 4, 16, 5, 32)
    assert torch.equal(popcount[got.long()].view(tiles).sum((2, 4)), popcount[w.long()].view(tiles).sum((2, 4)))


def test_weight_interleave_rejects_shapes_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="n % 16"):
        interleave_weights_sm90(torch.zeros((8, 32), dtype=torch.uint8))
    with pytest.raises(ValueError, match="k % 64"):
        interleave_weights_sm90(torch.zeros((16, 48), dtype=torch.uint8))


def test_scale_fold_formula_and_inverse() -> None:
    g = torch.Generator().manual_seed(2)
    s = torch.randint(0, 255, (2, 192, 12), dtype=torch.uint8, generator=g)
    folded = fold_scales_sm90(s).view(2, 3, 3, 16, 16)  # FlashInfer's [E, R/64, K/128, 16, 16]
    for e, rb, kb, f, m, j in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 15, 3, 2), (0, 1, 2, 7, 1, 3)]:
        assert folded[e, rb, kb, f, 4 * m + j] == s[e, 64 * rb + 16 * m + f, 4 * kb + j]
    assert torch.equal(unfold_scales_sm90(fold_scales_sm90(s)), s)
    with pytest.raises(ValueError, match="rows % 64"):
        fold_scales_sm90(torch.zeros((2, 96, 4), dtype=torch.uint8))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_round_trip_every_rank_real_dims(weights: ExpertWeights, tp: int) -> None:
    pieces = []
    for spec in RankSpec.all_ranks(tp):
        plan = LAYOUT.plan_rank(DIMS, spec, OPTS)
        assert plan.padded_intermediate == PADDED[tp]
        out = LAYOUT.build(weights, plan)
        for name, ts in plan.tensors.items():
            assert tuple(out[name].shape) == ts.shape and out[name].dtype == ts.dtype, name
        back = LAYOUT.invert(out, plan)
        assert_same_bytes(back, weights.intermediate_slice(*plan.intermediate_range))
        pieces.append(back)
    assert_same_bytes(ExpertWeights.concat_intermediate(pieces), weights)


def test_same_rows_and_padding_as_sm12x_before_the_sm90_steps(weights: ExpertWeights) -> None:
    spec = RankSpec(tp_size=4, tp_rank=3)
    plan = LAYOUT.plan_rank(DIMS, spec, OPTS)
    plain = SM12X.build(weights, SM12X.plan_rank(DIMS, spec, OPTS))
    out = LAYOUT.build(weights, plan)
    assert torch.equal(deinterleave_weights_sm90(out["w3_w1_weight"]), plain["w3_w1_weight"])
    assert torch.equal(deinterleave_weights_sm90(out["w2_weight"]), plain["w2_weight"])
    for name in ("w3_w1_bias", "w2_bias"):
        assert torch.equal(out[name], plain[name])
    lo, hi = plan.intermediate_range
    piece = weights.intermediate_slice(lo, hi)
    linear = stack_up_gate(piece.gate_up_proj_scales, plan.padded_intermediate, plan.padded_hidden // 32)
    assert torch.equal(unfold_scales_sm90(out["w3_w1_weight_scale"]), linear)
    # padding stays zero through the interleave: nonzero count is the valid bytes' count at most
    valid_bytes = E * 2 * (hi - lo) * (H // 2)
    assert int(torch.count_nonzero(out["w3_w1_weight"])) <= valid_bytes


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_full_size_shapes_on_meta(tp: int) -> None:
    dims = ModelDims(num_layers=36, num_experts=128, hidden=H, intermediate=I, top_k=4)
    meta = ExpertWeights.from_mapping(
        {role: torch.empty(shape, dtype=dtype, device="meta") for role, (shape, dtype) in dims.source_shapes().items()}
    )
    plan = LAYOUT.plan_rank(dims, RankSpec(tp_size=tp, tp_rank=tp - 1), OPTS)
    out = LAYOUT.build(meta, plan)
    Ip = PADDED[tp]
    assert tuple(out["w3_w1_weight"].shape) == (128, 2 * Ip, 1472)
    assert tuple(out["w2_weight"].shape) == (128, 2944, Ip // 2)
    # FlashInfer's folded view of the scales, as int32
    sf = out["w3_w1_weight_scale"].view(128, 2 * Ip // 64, 2944 // 128, 16, 16).view(torch.int32)
    assert tuple(sf.shape) == (128, 2 * Ip // 64, 23, 16, 4)
    sf2 = out["w2_weight_scale"].view(128, 2944 // 64, Ip // 128, 16, 16)
    assert sf2.numel() == 128 * 2944 * Ip // 32
    assert plan.facts["flashinfer_version"] == "0.7.2.post1"


def test_bad_input_is_refused(weights: ExpertWeights) -> None:
    with pytest.raises(LayoutError, match="without intermediate rows"):
        LAYOUT.plan_rank(DIMS, RankSpec(tp_size=16, tp_rank=15), OPTS)
    plan = LAYOUT.plan_rank(DIMS, RankSpec(tp_size=8, tp_rank=7), OPTS)  # 192 valid of 384
    out = LAYOUT.build(weights, plan)
    for name, index in [
        ("w3_w1_weight", (0, 200, 3)),
        ("w2_weight_scale", (1, 2943, 11)),
        ("w2_bias", (0, 2900)),
    ]:
        bad = dict(out)
        bad[name] = out[name].clone()
        bad[name][index] = 0x11
        with pytest.raises(LayoutError, match=name):
            LAYOUT.invert(bad, plan)
    with pytest.raises(LayoutError, match="w3_w1_weight_scale"):
        LAYOUT.invert({**out, "w3_w1_weight_scale": out["w3_w1_weight_scale"][:, :64]}, plan)


def test_identity() -> None:
    assert (LAYOUT.name, LAYOUT.layout_id, LAYOUT.w13_row_order) == (
        "cutlass-sm90",
        "cutlass_sm90_v1",
        "up_gate",
    )
