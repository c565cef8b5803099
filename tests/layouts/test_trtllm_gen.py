from __future__ import annotations

import pytest
import torch

from prepkit import mxfp4
from prepkit.errors import LayoutError
from prepkit.layouts import LayoutOptions, ModelDims, RankSpec, get_layout, ops
from prepkit.layouts.base import ExpertWeights
from tests.conftest import random_experts

LAYOUT = get_layout("trtllm-gen")
REAL = ModelDims(num_layers=1, num_experts=2, hidden=2880, intermediate=2880, top_k=4)


@pytest.fixture(scope="module")
def weights() -> ExpertWeights:
    return random_experts(REAL, seed=11)


def _all_rank_outputs(w: ExpertWeights, dims: ModelDims, tp: int, version: str, ep: int = 1):
    for spec in RankSpec.all_ranks(tp, ep):
        plan = LAYOUT.plan_rank(dims, spec, LayoutOptions(trtllm_version=version))
        lo, hi = plan.expert_range
        yield plan, LAYOUT.build(w.experts(lo, hi), plan)


@pytest.mark.parametrize("version", ["main", "1.2"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_round_trip_recovers_the_checkpoint_bytes(weights: ExpertWeights, tp: int, version: str) -> None:
    pieces = []
    for plan, out in _all_rank_outputs(weights, REAL, tp, version):
        for name, spec in plan.tensors.items():
            assert tuple(out[name].shape) == spec.shape and out[name].dtype == spec.dtype, name
        back = LAYOUT.invert(out, plan)
        want = weights.intermediate_slice(*plan.intermediate_range)
        for role, t in want.as_dict().items():
            assert torch.equal(back.as_dict()[role], t), (tp, plan.spec.tp_rank, role)
        pieces.append(back)
    whole = ExpertWeights.concat_intermediate(pieces)
    for role, t in weights.as_dict().items():
        assert torch.equal(whole.as_dict()[role], t), role
    # dequantized: prepared -> inverted -> dequantized equals the source dequantized
    assert torch.equal(
        mxfp4.dequantize(whole.gate_up_proj_blocks, whole.gate_up_proj_scales),
        mxfp4.dequantize(weights.gate_up_proj_blocks, weights.gate_up_proj_scales),
    )
    assert torch.equal(
        mxfp4.dequantize(whole.down_proj_blocks, whole.down_proj_scales),
        mxfp4.dequantize(weights.down_proj_blocks, weights.down_proj_scales),
    )


@pytest.mark.parametrize(
    "tp,version,lean",
    [
        (1, "main", [2880]),
        (2, "1.2", [1536, 1344]),
        (2, "main", [1440, 1440]),
        (4, "main", [768, 768, 768, 576]),
        (8, "main", [384] * 7 + [192]),
        (4, "1.2", [768, 768, 768, 576]),
        (8, "1.2", [384] * 7 + [192]),
    ],
)
def test_valid_intermediate_sizes(tp: int, version: str, lean: list[int]) -> None:
    plans = [LAYOUT.plan_rank(REAL, s, LayoutOptions(version)) for s in RankSpec.all_ranks(tp)]
    assert [p.valid_intermediate for p in plans] == lean
    assert [p.facts["valid_intermediate_size"] for p in plans] == lean


def test_tp16_leaves_ranks_empty_and_is_refused() -> None:
    with pytest.raises(LayoutError, match="without intermediate rows"):
        for s in RankSpec.all_ranks(16):
            LAYOUT.plan_rank(REAL, s, LayoutOptions())


@pytest.mark.parametrize(
    "tp,w13,w13s,w2,w2s",
    [
        (1, [128, 5888, 1536], [128, 5888, 96], [128, 2944, 1472], [128, 2944, 92]),
        (2, [128, 3072, 1536], [128, 3072, 96], [128, 2944, 768], [128, 2944, 48]),
        (4, [128, 1536, 1536], [128, 1536, 96], [128, 2944, 384], [128, 2944, 24]),
        (8, [128, 768, 1536], [128, 768, 96], [128, 2944, 192], [128, 2944, 12]),
    ],
)
def test_full_120b_shapes_on_meta(tp: int, w13: list[int], w13s: list[int], w2: list[int], w2s: list[int]) -> None:
    dims = ModelDims(num_layers=36, num_experts=128, hidden=2880, intermediate=2880, top_k=4)
    plan = LAYOUT.plan_rank(dims, RankSpec(tp_size=tp), LayoutOptions())
    meta = ExpertWeights.from_mapping(
        {r: torch.empty(s, dtype=d, device="meta") for r, (s, d) in dims.source_shapes().items()}
    )
    out = LAYOUT.build(meta, plan)
    got = {n: list(t.shape) for n, t in out.items()}
    assert got == {
        "w3_w1_weight": w13,
        "w3_w1_weight_scale": w13s,
        "w3_w1_bias": w13[:2],
        "w2_weight": w2,
        "w2_weight_scale": w2s,
        "w2_bias": [128, 2944],
    }
    assert out["w3_w1_bias"].dtype == torch.float32 and out["w2_bias"].dtype == torch.float32


@pytest.mark.parametrize("tp,rank", [(1, 0), (8, 3), (8, 7)])
def test_w13_equals_the_swap_pairs_then_shuffle_derivation(weights: ExpertWeights, tp: int, rank: int) -> None:
    """Second derivation (vLLM/SGLang style): keep the checkpoint's interleaved rows, swap each
    (gate, up) pair, pad at the end, apply only the row shuffle; equal bytes where padding agrees."""
    plan = LAYOUT.plan_rank(REAL, RankSpec(tp_size=tp, tp_rank=rank), LayoutOptions())
    out = LAYOUT.build(weights, plan)
    lo, hi = plan.intermediate_range
    Ip = plan.padded_intermediate
    rows = weights.gate_up_proj_blocks.flatten(-2)[:, 2 * lo : 2 * hi]  # [E, 2V, H/2] interleaved
    E, two_v, k = rows.shape
    swapped = rows.reshape(E, two_v // 2, 2, k).flip(2).reshape(E, two_v, k)
    padded = ops.pad_to(swapped, (E, 2 * Ip, 1536))
    want = padded[:, ops.shuffle_row_indices(2 * Ip)]
    assert torch.equal(out["w3_w1_weight"], want)
    bias = weights.gate_up_proj_bias[:, 2 * lo : 2 * hi].float().reshape(E, -1, 2).flip(2).reshape(E, -1)
    assert torch.equal(out["w3_w1_bias"], ops.pad_to(bias, (E, 2 * Ip))[:, ops.shuffle_row_indices(2 * Ip)])


def test_biases_are_float32_and_fc2_bias_is_divided_by_tp(weights: ExpertWeights) -> None:
    for tp in (1, 4):
        plan = LAYOUT.plan_rank(REAL, RankSpec(tp_size=tp, tp_rank=tp - 1), LayoutOptions())
        out = LAYOUT.build(weights, plan)
        unshuffled = out["w2_bias"][:, ops.inverse_permutation(ops.shuffle_row_indices(2944))]
        assert torch.equal(unshuffled[:, :2880], weights.down_proj_bias.float() / tp)
        assert int(torch.count_nonzero(unshuffled[:, 2880:])) == 0


def test_row_ranges_by_trtllm_version_at_tp2() -> None:
    main = [LAYOUT.plan_rank(REAL, s, LayoutOptions("main")).intermediate_range for s in RankSpec.all_ranks(2)]
    old = [LAYOUT.plan_rank(REAL, s, LayoutOptions("1.2")).intermediate_range for s in RankSpec.all_ranks(2)]
    assert main == [(0, 1440), (1440, 2880)]
    assert old == [(0, 1536), (1536, 2880)]


def test_nonzero_padding_is_reported_by_name(weights: ExpertWeights) -> None:
    plan = LAYOUT.plan_rank(REAL, RankSpec(tp_size=8, tp_rank=7), LayoutOptions())
    out = LAYOUT.build(weights, plan)
    # rank 7 holds 192 of 384 rows: the unshuffled row 300 of the up half is padding
    inv = ops.inverse_permutation(ops.w13_row_indices(2 * 384))
    out["w3_w1_weight"][0, inv[300], 0] = 1
    with pytest.raises(LayoutError, match="w3_w1_weight"):
        LAYOUT.invert(out, plan)


def test_ep_gives_contiguous_expert_slices() -> None:
    dims = ModelDims(num_layers=1, num_experts=4, hidden=256, intermediate=512, top_k=2)
    w = random_experts(dims, seed=5)
    seen = []
    for plan, out in _all_rank_outputs(w, dims, 2, "main", ep=2):
        seen.append(plan.expert_range)
        back = LAYOUT.invert(out, plan)
        lo, hi = plan.expert_range
        assert torch.equal(
            back.down_proj_blocks, w.experts(lo, hi).intermediate_slice(*plan.intermediate_range).down_proj_blocks
        )
    assert seen == [(0, 2), (0, 2), (2, 4), (2, 4)]
    with pytest.raises(LayoutError, match="split evenly"):
        LAYOUT.plan_rank(dims, RankSpec(ep_size=3), LayoutOptions())


def _literal_pipeline(w: ExpertWeights, tp: int, rank: int, version: str) -> dict[str, torch.Tensor]:
    """docs/layouts.md §2.6 step by step, per expert, with plain torch: pad, slice, stack, permute,
    swizzle. Written independently of the layout's composed gathers."""
    plan = LAYOUT.plan_rank(REAL, RankSpec(tp_size=tp, tp_rank=rank), LayoutOptions(version))
    lo, hi = plan.intermediate_range
    Ip, H2 = plan.padded_intermediate, plan.padded_hidden
    p13 = ops.gated_reorder_indices(2 * Ip)[ops.shuffle_row_indices(2 * Ip)]
    p2 = ops.shuffle_row_indices(H2)
    out: dict[str, list[torch.Tensor]] = {n: [] for n in plan.tensors}
    for e in range(w.num_experts):
        gu = w.gate_up_proj_blocks[e].reshape(2 * REAL.intermediate, -1)
        gate, up = gu[0::2][lo:hi], gu[1::2][lo:hi]
        gs, us = w.gate_up_proj_scales[e][0::2][lo:hi], w.gate_up_proj_scales[e][1::2][lo:hi]
        gb, ub = w.gate_up_proj_bias[e][0::2][lo:hi].float(), w.gate_up_proj_bias[e][1::2][lo:hi].float()
        W = torch.cat([ops.pad_to(up, (Ip, 1536)), ops.pad_to(gate, (Ip, 1536))])
        S = torch.cat([ops.pad_to(us, (Ip, 96)), ops.pad_to(gs, (Ip, 96))])
        B = torch.cat([ops.pad_to(ub, (Ip,)), ops.pad_to(gb, (Ip,))])
        out["w3_w1_weight"].append(W[p13])
        out["w3_w1_weight_scale"].append(ops.swizzle_scales_128x4(S[p13]))
        out["w3_w1_bias"].append(B[p13])
        dn = w.down_proj_blocks[e].reshape(REAL.hidden, -1)[:, lo // 2 : hi // 2]
        ds = w.down_proj_scales[e][:, lo // 32 : hi // 32]
        out["w2_weight"].append(ops.pad_to(dn, (H2, Ip // 2))[p2])
        out["w2_weight_scale"].append(ops.swizzle_scales_128x4(ops.pad_to(ds, (H2, Ip // 32))[p2]))
        out["w2_bias"].append((ops.pad_to(w.down_proj_bias[e].float(), (H2,)) / tp)[p2])
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.parametrize("tp,rank,version", [(1, 0, "main"), (2, 1, "main"), (2, 1, "1.2"), (4, 3, "main")])
def test_build_equals_the_step_by_step_spec(weights: ExpertWeights, tp: int, rank: int, version: str) -> None:
    plan = LAYOUT.plan_rank(REAL, RankSpec(tp_size=tp, tp_rank=rank), LayoutOptions(version))
    got = LAYOUT.build(weights, plan)
    want = _literal_pipeline(weights, tp, rank, version)
    for name in plan.tensors:
        assert torch.equal(got[name], want[name]), name
