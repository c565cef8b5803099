"""``cutlass-sm12x``: round trips on real dims, byte positions, padding, shapes, bad input."""

from __future__ import annotations

import pytest
import torch

from prepkit.errors import LayoutError
from prepkit.layouts.base import ExpertWeights, LayoutOptions, ModelDims, RankSpec
from prepkit.layouts.cutlass_sm12x import LAYOUT

H = I = 2880
E = 2
DIMS = ModelDims(num_layers=1, num_experts=E, hidden=H, intermediate=I, top_k=1)
OPTS = LayoutOptions()

# TensorRT-LLM's pad-before-shard split of I = 2880 (docs/layouts.md §2.3, §4b)
EXPECTED_RANGES = {
    1: [(0, 2880)],
    2: [(0, 1536), (1536, 2880)],
    4: [(0, 768), (768, 1536), (1536, 2304), (2304, 2880)],
    8: [(384 * r, 384 * r + 384) for r in range(7)] + [(2688, 2880)],
}
PADDED = {1: 2944, 2: 1536, 4: 768, 8: 384}


def random_weights(dims: ModelDims, num_experts: int, seed: int = 0) -> ExpertWeights:
    """Checkpoint-form experts: no zero byte anywhere, scale bytes never 0xFF, finite biases."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for role, (shape, dtype) in dims.source_shapes().items():
        shape = (num_experts, *shape[1:])
        if dtype == torch.uint8:
            high = 255 if role.endswith("scales") else 256
            out[role] = torch.randint(1, high, shape, dtype=torch.uint8, generator=g)
        else:
            t = torch.rand(shape, generator=g) + 0.5  # never zero
            sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
            out[role] = (t * sign).to(dtype)
    return ExpertWeights.from_mapping(out)


def assert_same_bytes(got: ExpertWeights, want: ExpertWeights) -> None:
    for role, t in want.as_dict().items():
        g = getattr(got, role)
        assert g.dtype == t.dtype and tuple(g.shape) == tuple(t.shape), role
        assert torch.equal(g.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), role


def swizzle_offset(r: int, c: int, cols_padded: int) -> int:
    """computeSFIndex for the 128x4 layout, written out (docs/layouts.md §3.4)."""
    return (r // 128) * 128 * cols_padded + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.fixture(scope="module")
def weights() -> ExpertWeights:
    return random_weights(DIMS, E)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_round_trip_every_rank_real_dims(weights: ExpertWeights, tp: int) -> None:
    pieces = []
    for spec in RankSpec.all_ranks(tp):
        plan = LAYOUT.plan_rank(DIMS, spec, OPTS)
        assert plan.intermediate_range == EXPECTED_RANGES[tp][spec.tp_rank]
        assert plan.padded_intermediate == PADDED[tp]
        out = LAYOUT.build(weights, plan)
        assert set(out) == set(plan.tensors)
        for name, ts in plan.tensors.items():
            assert tuple(out[name].shape) == ts.shape and out[name].dtype == ts.dtype, name
        back = LAYOUT.invert(out, plan)
        assert_same_bytes(back, weights.intermediate_slice(*plan.intermediate_range))
        pieces.append(back)
    assert_same_bytes(ExpertWeights.concat_intermediate(pieces), weights)


@pytest.mark.parametrize("tp", [2, 8])
def test_bytes_sit_where_the_engine_reads_them(weights: ExpertWeights, tp: int) -> None:
    spec = RankSpec(tp_size=tp, tp_rank=tp - 1)  # the last rank holds padding
    plan = LAYOUT.plan_rank(DIMS, spec, OPTS)
    out = LAYOUT.build(weights, plan)
    lo, hi = plan.intermediate_range
    V, Ip, H2 = hi - lo, plan.padded_intermediate, plan.padded_hidden
    gu = weights.gate_up_proj_blocks.flatten(-2)  # [E, 2I, H/2], row 2i gate_i, 2i+1 up_i
    w13 = out["w3_w1_weight"]
    # [up ; gate], no shuffle: row j of the first half is up_(lo+j), row Ip+j is gate_(lo+j)
    for j in (0, 1, 33, V - 1):
        assert torch.equal(w13[:, j, : H // 2], gu[:, 2 * (lo + j) + 1])
        assert torch.equal(w13[:, Ip + j, : H // 2], gu[:, 2 * (lo + j)])
    # padding: rows V..Ip of each half, K bytes H/2..H2/2, all zero
    assert not w13[:, V:Ip].any() and not w13[:, Ip + V :].any() and not w13[:, :, H // 2 :].any()
    bias = out["w3_w1_bias"]
    assert torch.equal(bias[:, :V], weights.gate_up_proj_bias[:, 2 * lo + 1 : 2 * hi : 2])
    assert not bias[:, V:Ip].any() and not bias[:, Ip + V :].any()
    # fc2: plain rows, the rank's K columns, zero beyond
    w2 = out["w2_weight"]
    dn = weights.down_proj_blocks.flatten(-2)
    assert torch.equal(w2[:, :H, : V // 2], dn[:, :, lo // 2 : hi // 2])
    assert not w2[:, H:].any() and not w2[:, :, V // 2 :].any()
    # the fc2 bias is the checkpoint's, whole, unscaled, on every rank
    assert torch.equal(out["w2_bias"][:, :H], weights.down_proj_bias)
    assert not out["w2_bias"][:, H:].any()
    # scales: 128x4 interleave of the unpermuted matrix
    sf = out["w3_w1_weight_scale"].reshape(E, -1)
    cols = H2 // 32
    for r, c in [(0, 0), (5, 3), (Ip + 7, 17), (V - 1, 89)]:
        half, j = divmod(r, Ip)
        src_row = 2 * (lo + j) + (1 - half)  # first half up (odd rows), second gate (even rows)
        assert torch.equal(sf[:, swizzle_offset(r, c, cols)], weights.gate_up_proj_scales[:, src_row, c])
    sf2 = out["w2_weight_scale"].reshape(E, -1)
    for r, c in [(0, 0), (130, 5), (H - 1, V // 32 - 1)]:
        assert torch.equal(sf2[:, swizzle_offset(r, c, Ip // 32)], weights.down_proj_scales[:, r, lo // 32 + c])
    # every nonzero input byte lands once; padding stays zero (inputs hold no zero byte)
    assert int(torch.count_nonzero(out["w3_w1_weight_scale"])) == E * 2 * V * (H // 32)
    assert int(torch.count_nonzero(out["w2_weight_scale"])) == E * H * (V // 32)


def test_fc2_bias_is_not_divided_by_tp(weights: ExpertWeights) -> None:
    for tp in (1, 4):
        for spec in RankSpec.all_ranks(tp):
            out = LAYOUT.build(weights, LAYOUT.plan_rank(DIMS, spec, OPTS))
            assert torch.equal(out["w2_bias"][:, :H], weights.down_proj_bias)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_full_size_shapes_on_meta(tp: int) -> None:
    dims = ModelDims(num_layers=36, num_experts=128, hidden=H, intermediate=I, top_k=4)
    meta = ExpertWeights.from_mapping(
        {role: torch.empty(shape, dtype=dtype, device="meta") for role, (shape, dtype) in dims.source_shapes().items()}
    )
    plan = LAYOUT.plan_rank(dims, RankSpec(tp_size=tp, tp_rank=0), OPTS)
    out = LAYOUT.build(meta, plan)
    Ip = PADDED[tp]
    # docs/layouts.md §4b: the engine's int64 / int32 parameter views
    assert tuple(out["w3_w1_weight"].view(torch.int64).shape) == (128, 2 * Ip, 2944 // 16)
    assert tuple(out["w3_w1_weight_scale"].view(torch.int32).shape) == (128, 2 * Ip, 23)
    assert tuple(out["w2_weight"].view(torch.int64).shape) == (128, 2944, Ip // 16)
    assert tuple(out["w2_weight_scale"].view(torch.int32).shape) == (128, 2944, Ip // 128)
    assert tuple(out["w3_w1_bias"].shape) == (128, 2 * Ip) and out["w3_w1_bias"].dtype == torch.bfloat16
    assert tuple(out["w2_bias"].shape) == (128, 2944)
    for name, ts in plan.tensors.items():
        assert tuple(out[name].shape) == ts.shape, name
    assert plan.facts["engine_fc2_bias"].startswith("full")
    assert plan.facts["padded_hidden"] == 2944


def test_ep_takes_contiguous_experts() -> None:
    dims = ModelDims(num_layers=1, num_experts=4, hidden=256, intermediate=256, top_k=1)
    w = random_weights(dims, 4, seed=3)
    plan = LAYOUT.plan_rank(dims, RankSpec(tp_size=2, tp_rank=1, ep_size=2, ep_rank=1), OPTS)
    assert plan.expert_range == (2, 4)
    back = LAYOUT.invert(LAYOUT.build(w.experts(2, 4), plan), plan)
    assert_same_bytes(back, w.experts(2, 4).intermediate_slice(*plan.intermediate_range))


def test_tp_that_leaves_a_rank_empty_is_refused() -> None:
    # I = 2880 at tp = 16 pads to 4096 rows in slices of 256: ranks 12..15 would hold nothing
    assert LAYOUT.plan_rank(DIMS, RankSpec(tp_size=16, tp_rank=11), OPTS).valid_intermediate == 64
    with pytest.raises(LayoutError, match="without intermediate rows"):
        LAYOUT.plan_rank(DIMS, RankSpec(tp_size=16, tp_rank=12), OPTS)


def test_bad_ep_and_bad_dims_are_refused() -> None:
    with pytest.raises(LayoutError, match="ep=3"):
        LAYOUT.plan_rank(DIMS, RankSpec(ep_size=3), OPTS)
    with pytest.raises(LayoutError, match="multiples of 32"):
        LAYOUT.plan_rank(ModelDims(1, 2, 2880, 2890, 1), RankSpec(), OPTS)


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("w3_w1_weight", (0, 1535, 0)),  # last padding row of the up half (tp=2 rank 1 holds 1344)
        ("w3_w1_weight", (1, 3071, 1471)),
        ("w3_w1_weight_scale", (0, 3071, 91)),
        ("w3_w1_bias", (1, 1400)),
        ("w2_weight", (0, 2900, 0)),
        ("w2_weight_scale", (1, 2943, 47)),
        ("w2_bias", (0, 2943)),
    ],
)
def test_nonzero_padding_is_reported_by_tensor(weights: ExpertWeights, name: str, index: tuple[int, ...]) -> None:
    plan = LAYOUT.plan_rank(DIMS, RankSpec(tp_size=2, tp_rank=1), OPTS)
    out = LAYOUT.build(weights, plan)
    t = out[name].clone()
    t[index] = 1
    out[name] = t
    with pytest.raises(LayoutError, match=name):
        LAYOUT.invert(out, plan)


def test_wrong_shape_or_count_is_refused(weights: ExpertWeights) -> None:
    plan = LAYOUT.plan_rank(DIMS, RankSpec(tp_size=2, tp_rank=0), OPTS)
    out = LAYOUT.build(weights, plan)
    with pytest.raises(LayoutError, match=r"w2_weight: shape \[2, 2944, 767\]"):
        LAYOUT.invert({**out, "w2_weight": out["w2_weight"][:, :, :-1]}, plan)
    with pytest.raises(LayoutError, match="w3_w1_bias"):
        LAYOUT.invert({**out, "w3_w1_bias": out["w3_w1_bias"].float()}, plan)
    with pytest.raises(LayoutError, match="'w2_bias' is missing"):
        LAYOUT.invert({k: v for k, v in out.items() if k != "w2_bias"}, plan)
    # a chunk of the rank's experts is fine (the pipeline streams them); more than it holds is not
    assert LAYOUT.build(weights.experts(0, 1), plan)["w2_weight"].shape[0] == 1
    ep_plan = LAYOUT.plan_rank(DIMS, RankSpec(tp_size=2, tp_rank=0, ep_size=2, ep_rank=1), OPTS)
    with pytest.raises(LayoutError, match="experts"):
        LAYOUT.build(weights, ep_plan)


def test_identity() -> None:
    assert (LAYOUT.name, LAYOUT.layout_id, LAYOUT.w13_row_order) == (
        "cutlass-sm12x",
        "cutlass_sm12x_v1",
        "up_gate",
    )
