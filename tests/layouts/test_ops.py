from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepkit.layouts import ops


def _shuffle_from_src_to_dst_table(m: int, blk: int) -> list[int]:
    """Independent construction: the engines store where each source row of a block goes
    (source row s -> destination (s % (blk/8))*8 + s // (blk/8)) and gather by its inverse."""
    per = blk // 8
    out = [0] * m
    for base in range(0, m, blk):
        for s in range(blk):
            out[base + (s % per) * 8 + s // per] = base + s
    return out


@settings(deadline=None, max_examples=60)
@given(k=st.integers(1, 96), etm=st.sampled_from([64, 128, 256]))
def test_row_shuffle_is_a_bijection_and_matches_the_table_form(k: int, etm: int) -> None:
    blk = ops.shuffle_block_size(etm)
    m = blk * k
    perm = ops.shuffle_row_indices(m, etm)
    assert sorted(perm.tolist()) == list(range(m))
    assert perm.tolist() == _shuffle_from_src_to_dst_table(m, blk)


def test_row_shuffle_first_block_reads_columns_of_an_8x4_grid() -> None:
    assert ops.shuffle_row_indices(32)[:10].tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 1, 5]


def test_row_shuffle_needs_whole_blocks() -> None:
    with pytest.raises(ValueError):
        ops.shuffle_row_indices(48, 128)


@settings(deadline=None, max_examples=40)
@given(half=st.integers(1, 400))
def test_gated_reorder_interleaves_halves(half: int) -> None:
    m = 2 * half
    p = ops.gated_reorder_indices(m).tolist()
    assert p[0::2] == list(range(half)) and p[1::2] == list(range(half, m))
    assert torch.equal(ops.inverse_permutation(torch.tensor(p))[torch.tensor(p)], torch.arange(m))


def test_w13_indices_apply_gated_reorder_then_shuffle() -> None:
    m = 256
    rows = torch.arange(m)
    want = rows[ops.gated_reorder_indices(m)][ops.shuffle_row_indices(m)]
    assert torch.equal(ops.w13_row_indices(m), want)


def _swizzle_offset(r: int, c: int, cp: int) -> int:
    """computeSFIndex for the 128x4 layout, read literally."""
    return (r // 128) * 128 * cp + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (200, 7), (1, 3), (384, 12)])
def test_swizzle_matches_the_offset_formula(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows * 31 + cols)
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8, generator=g)
    flat = ops.swizzle_scales_128x4(s).flatten()
    cp = ops.round_up(cols, 4)
    want = torch.zeros_like(flat)
    for r in range(rows):
        for c in range(cols):
            want[_swizzle_offset(r, c, cp)] = s[r, c]
    assert torch.equal(flat, want)


@settings(deadline=None, max_examples=60)
@given(rows=st.integers(1, 300), cols=st.integers(1, 40), experts=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_swizzle_round_trips_and_pads_with_zero(rows: int, cols: int, experts: int, seed: int) -> None:
    s = torch.randint(1, 256, (experts, rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    out = ops.swizzle_scales_128x4(s)
    assert torch.equal(ops.unswizzle_scales_128x4(out, rows, cols), s)
    assert int(torch.count_nonzero(out)) == s.numel()
    # per expert the swizzle is independent: expert e's bytes are the 2-D swizzle of s[e]
    assert torch.equal(out[-1], ops.swizzle_scales_128x4(s[-1]))


def test_interleave_round_trip() -> None:
    t = torch.arange(2 * 10 * 3).reshape(2, 10, 3)
    gate, up = ops.deinterleave_rows(t, dim=1)
    assert torch.equal(gate, t[:, 0::2]) and torch.equal(up, t[:, 1::2])
    assert torch.equal(ops.interleave_rows(gate, up, dim=1), t)


@pytest.mark.parametrize(
    "tp,dim,want",
    [
        (1, 2880, 128),
        (2, 2880, 3072),
        (4, 2880, 3072),
        (8, 2880, 3072),  # fc1 / fc2 weights (docs/layouts.md §2.2)
        (1, 90, 128),
        (2, 90, 256),
        (4, 90, 512),
        (8, 90, 1024),
    ],  # fc2 scales: the column-count quirk
)
def test_trtllm_weight_alignment(tp: int, dim: int, want: int) -> None:
    assert ops.trtllm_weight_alignment(128, 32, tp, dim) == want


def test_pad_and_unpad() -> None:
    t = torch.arange(1, 7, dtype=torch.uint8).reshape(2, 3)
    p = ops.pad_to(t, (4, 5))
    core, zero = ops.unpad(p, (2, 3))
    assert torch.equal(core, t) and zero
    p[3, 4] = 1
    assert not ops.unpad(p, (2, 3))[1]
    with pytest.raises(ValueError):
        ops.pad_to(t, (1, 3))
