"""The triton-moe layout: exact inverse, zero padding, TP/EP splits, K panels, nibble order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepkit.errors import LayoutError
from prepkit.layouts.base import LayoutOptions, ModelDims, RankSpec
from prepkit.layouts.triton_moe import (
    FRAGMENT_ORDER,
    LAYOUT,
    PANEL_BYTES,
    from_fragment_order,
    from_panels,
    intermediate_split,
    shuffle_nibbles,
    to_fragment_order,
    to_panels,
    unshuffle_nibbles,
)
from prepkit.mxfp4 import dequantize
from tests.kernels.moe_data import random_experts

E, H, I = 4, 64, 320  # I = 10 groups of 32: uneven for tp 3, 4 and 8


@pytest.fixture(scope="module")
def experts():
    return random_experts(E, H, I, seed=3)


def _plan(tp, ep, tp_rank=0, ep_rank=0, dims=None):
    dims = dims or ModelDims(1, E, H, I, 4)
    return LAYOUT.plan_rank(dims, RankSpec(tp, tp_rank, ep, ep_rank), LayoutOptions())


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_invert_build_is_the_rank_slice_and_padding_is_zero(experts, tp_size, ep_size):
    pieces = []
    for spec in RankSpec.all_ranks(tp_size, ep_size):
        plan = LAYOUT.plan_rank(ModelDims(1, E, H, I, 4), spec, LayoutOptions())
        local = experts.experts(*plan.expert_range)
        out = LAYOUT.build(local, plan)
        for name, tspec in plan.tensors.items():
            assert tuple(out[name].shape) == tspec.shape and out[name].dtype == tspec.dtype, name
        back = LAYOUT.invert(out, plan)
        want = local.intermediate_slice(*plan.intermediate_range)
        for role, t in want.as_dict().items():
            assert torch.equal(getattr(back, role), t), (spec, role)
        # Nonzero bytes are exactly the source's nonzero nibbles/scales: padding stays zero.
        v = plan.valid_intermediate
        assert torch.count_nonzero(out["w13_blocks"][:, :, 2 * v :]) == 0
        assert torch.count_nonzero(out["w13_blocks"][..., H // 2 :]) == 0  # the last panel's tail
        assert torch.count_nonzero(out["w2_scales"][:, v // 32 :]) == 0
        if spec.ep_rank == 0:
            pieces.append(back)
    # TP slices re-concatenate to the checkpoint.
    whole = type(experts).concat_intermediate(pieces)
    ref = experts.experts(0, E // ep_size)
    pairs = zip(whole.as_dict().values(), ref.as_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_layout_values_dequantize_like_the_checkpoint(experts):
    """Undoing only the byte and nibble orders gives the checkpoint's values (gpt-oss decoder
    semantics)."""
    plan = _plan(1, 1)
    out = LAYOUT.build(experts, plan)
    rows = from_panels(out["w2_blocks"], I // 2)
    blocks = unshuffle_nibbles(from_fragment_order(rows.unflatten(-1, (-1, 16))))
    scales = out["w2_scales"].transpose(1, 2)
    got = dequantize(blocks, scales)
    assert torch.equal(got, dequantize(experts.down_proj_blocks, experts.down_proj_scales))


def test_nibble_shuffle_round_trips_every_byte():
    b = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(unshuffle_nibbles(shuffle_nibbles(b)), b)
    # byte j of a group holds element j (low nibble) and j + 16 (high nibble)
    codes = torch.arange(32, dtype=torch.uint8) % 16
    from prepkit.mxfp4 import pack_nibbles

    shuffled = shuffle_nibbles(pack_nibbles(codes))
    assert shuffled.tolist() == [(j % 16) | ((j + 16) % 16) << 4 for j in range(16)]


def test_fragment_order_puts_each_threads_mma_columns_together():
    # A 16-bit MMA fragment gives thread q of a quad the columns 2q, 2q+1, 2q+8, 2q+9 of a
    # 16-column step: in storage they are the thread's own 4-byte word, in that order.
    for q in range(4):
        assert FRAGMENT_ORDER[4 * q : 4 * q + 4] == (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9)
    groups = torch.randint(0, 256, (3, 5, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    stored = to_fragment_order(groups)
    assert not torch.equal(stored, groups)
    assert torch.equal(from_fragment_order(stored), groups)
    assert torch.equal(stored[..., 2], groups[..., 8])


def test_stored_rows_hold_fragment_ordered_groups(experts):
    """Byte 16g + p of a stored row is byte FRAGMENT_ORDER[p] of the row's nibble-ordered group g."""
    out = LAYOUT.build(experts, _plan(1, 1))
    nibble_ordered = shuffle_nibbles(experts.gate_up_proj_blocks)  # [E, 2I, G, 16]
    stored = from_panels(out["w13_blocks"], H // 2).unflatten(-1, (-1, 16))
    for p, j in enumerate(FRAGMENT_ORDER):
        assert torch.equal(stored[..., p], nibble_ordered[..., j]), p


@settings(deadline=None, max_examples=60)
@given(groups=st.integers(1, 200), tp=st.integers(1, 16))
def test_tp_split_is_balanced_contiguous_and_32_aligned(groups, tp):
    intermediate = 32 * groups
    if groups < tp:
        with pytest.raises(LayoutError, match="without intermediate rows"):
            intermediate_split(intermediate, tp, 0)
        return
    bounds = [intermediate_split(intermediate, tp, r) for r in range(tp)]
    assert bounds[0][0] == 0 and bounds[-1][1] == intermediate
    for (lo, hi, per), nxt in zip(bounds, bounds[1:] + [None], strict=True):
        assert lo % 32 == 0 and 0 < hi - lo <= per and per - (hi - lo) <= 32
        if nxt is not None:
            assert nxt[0] == hi


def test_gpt_oss_full_size_plans_on_meta():
    dims = ModelDims(36, 128, 2880, 2880, 4)
    sizes = {tp: [_plan(tp, 1, r, dims=dims).valid_intermediate for r in range(tp)] for tp in (1, 2, 4, 8)}
    assert sizes[1] == [2880] and sizes[2] == [1440, 1440]
    assert sizes[4] == [704, 736, 704, 736]
    assert sorted(set(sizes[8])) == [352, 384] and sum(sizes[8]) == 2880
    plan = _plan(8, 2, 7, 1, dims=dims)
    assert plan.expert_range == (64, 128)
    assert plan.tensors["w13_blocks"].shape == (64, 12, 768, 128)  # 2880 = 11.25 panels of 256
    assert plan.tensors["w2_blocks"].shape == (64, 2, 2880, 128)  # 384 = 1.5 panels
    assert plan.tensors["w2_scales"].shape == (64, 12, 2880)
    # build runs on meta tensors at full size (no memory): shapes match the plan
    from prepkit.layouts.base import ExpertWeights

    local = ExpertWeights.from_mapping(
        {
            role: torch.empty((64, *shape[1:]), dtype=dtype, device="meta")
            for role, (shape, dtype) in dims.source_shapes().items()
        }
    )
    out = LAYOUT.build(local, plan)
    for name, tspec in plan.tensors.items():
        assert tuple(out[name].shape) == tspec.shape and out[name].dtype == tspec.dtype, name


def test_invert_rejects_nonzero_padding_and_foreign_bias(experts):
    plan = _plan(4, 1, 0)  # 64 valid rows padded to 96
    out = LAYOUT.build(experts, plan)
    bad = dict(out)
    bad["w13_blocks"] = out["w13_blocks"].clone()
    bad["w13_blocks"][0, 0, -1, 0] = 7  # a padded row
    with pytest.raises(LayoutError, match="w13_blocks: padding"):
        LAYOUT.invert(bad, plan)
    bad["w13_blocks"] = out["w13_blocks"].clone()
    bad["w13_blocks"][0, 0, 0, H // 2] = 7  # past K in the last panel
    with pytest.raises(LayoutError, match="w13_blocks: padding"):
        LAYOUT.invert(bad, plan)
    bad = dict(out)
    bad["w2_bias"] = out["w2_bias"] + 1e-6
    with pytest.raises(LayoutError, match="w2_bias: values are not bf16-exact"):
        LAYOUT.invert(bad, plan)
    bad = dict(out)
    del bad["w2_scales"]
    with pytest.raises(LayoutError, match="'w2_scales' is missing"):
        LAYOUT.invert(bad, plan)


def test_build_rejects_foreign_dims(experts):
    with pytest.raises(LayoutError, match="the plan expects"):
        LAYOUT.build(random_experts(E, H, 64, seed=0), _plan(1, 1))


def test_protocol_fields():
    assert LAYOUT.name == "triton-moe"
    assert (LAYOUT.layout_id, LAYOUT.w13_row_order) == ("triton_moe_v3", "interleaved")


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 40), groups=st.integers(1, 40), lead=st.integers(1, 3))
def test_panels_round_trip_and_keep_each_k_step_contiguous(n, groups, lead):
    row_bytes = 16 * groups
    rows = torch.randint(1, 256, (lead, n, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    panels = to_panels(rows)
    p = -(-row_bytes // PANEL_BYTES)
    assert panels.shape == (lead, p, n, PANEL_BYTES) and panels.is_contiguous()
    assert torch.equal(from_panels(panels, row_bytes), rows)
    assert torch.count_nonzero(panels) == torch.count_nonzero(rows)  # padding is zero
    # Byte c of row r lives at offset ((e * P + c // 128) * N + r) * 128 + c % 128 of the flat
    # tensor: a [rows, K step] tile is one contiguous run when the step divides the panel.
    flat = panels.flatten()
    e, r, c = lead - 1, n - 1, row_bytes - 1
    assert flat[((e * p + c // PANEL_BYTES) * n + r) * PANEL_BYTES + c % PANEL_BYTES] == rows[e, r, c]
    step = rows[0, :, :32] if row_bytes >= 32 else rows[0, :, :row_bytes]
    assert torch.equal(flat[: n * PANEL_BYTES].view(n, PANEL_BYTES)[:, : step.shape[1]], step)


def test_from_panels_names_the_tensor_when_the_panel_count_is_wrong():
    panels = to_panels(torch.ones((2, 8, 300), dtype=torch.uint8))  # 3 panels
    with pytest.raises(LayoutError, match=r"w2_blocks: panels \[2, 3, 8, 128\] do not hold rows of 100 bytes"):
        from_panels(panels, 100, "w2_blocks")
