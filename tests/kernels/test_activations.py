"""The MX reference quantizer (prepkit.kernels.activations): every element code, rounding, the
scale rule, saturation, zero and NaN blocks, and random data against a brute-force oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepkit.errors import PrepkitError
from prepkit.kernels.activations import (
    ACTIVATION_POLICIES,
    E2M1_VALUES,
    check_policy,
    decode_elements,
    dequantize_mx,
    fake_quantize,
    mx_format,
    quantize_mx,
    shared_exponents,
)

FORMATS = ("e4m3", "e2m1")
EMAX = {"e4m3": 8, "e2m1": 2}
MAX = {"e4m3": 448.0, "e2m1": 6.0}


def _finite_codes(fmt: str) -> torch.Tensor:
    """Every code of the format that is a number (e4m3: all but the two NaN codes)."""
    if fmt == "e2m1":
        return torch.arange(16, dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes[(codes & 0x7F) != 0x7F]


def _values(fmt: str) -> torch.Tensor:
    return decode_elements(_finite_codes(fmt), fmt).double()


def _unit_scale_block(fmt: str, vals: torch.Tensor) -> torch.Tensor:
    """Blocks of 32 whose first value pins the scale to 2^0 (amax 2^emax), then ``vals``."""
    n = len(vals)
    rows = -(-n // 31)
    x = torch.zeros(rows * 31, dtype=torch.float32)
    x[:n] = vals.float()
    x = x.view(rows, 31)
    pin = torch.full((rows, 1), 2.0 ** EMAX[fmt])
    return torch.cat((pin, x), dim=1).flatten()


def _oracle(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force: the OCP scale from math.frexp per block, then the nearest representable
    magnitude (ties to the even code), saturating; the sign bit of negative inputs."""
    blocks = x.double().view(-1, 32)
    codes_all = _finite_codes(fmt)
    vals_all = decode_elements(codes_all, fmt).double()
    keep = vals_all >= 0
    if fmt == "e4m3":
        keep &= codes_all < 0x80
    else:
        keep &= codes_all < 8
    pos_codes, pos_vals = codes_all[keep], vals_all[keep]
    sign_bit = 0x80 if fmt == "e4m3" else 0x8
    scales, codes = [], []
    for block in blocks:
        amax = float(block.abs().max())
        s = 0 if amax < 2.0**-126 else min(max(math.frexp(amax)[1] - 1 - EMAX[fmt] + 127, 0), 254)
        scales.append(s)
        y = block * 2.0 ** (127 - s)
        dist = (y.abs().clamp(max=MAX[fmt])[:, None] - pos_vals[None, :]).abs()
        # Among the nearest values the even code (2 rules out the others).
        key = torch.where(dist == dist.min(1, keepdim=True).values, (pos_codes[None, :] % 2).double(), 2.0)
        best = pos_codes[key.argmin(dim=1)]
        codes.append(torch.where(torch.signbit(y), best | sign_bit, best))
    return torch.stack(codes).flatten(), torch.tensor(scales, dtype=torch.uint8)


def test_policies_and_their_formats():
    assert ACTIVATION_POLICIES == ("bf16", "mxfp8", "mxfp4")
    assert mx_format("bf16") is None and mx_format("mxfp8") == "e4m3" and mx_format("mxfp4") == "e2m1"
    with pytest.raises(PrepkitError, match="bf16, mxfp8, mxfp4"):
        check_policy("fp8")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_quantizes_to_itself(fmt):
    codes = _finite_codes(fmt)
    x = _unit_scale_block(fmt, decode_elements(codes, fmt))
    got, scales = quantize_mx(x, fmt)
    assert bool((scales == 127).all())
    got = got.view(-1, 32)[:, 1:].flatten()[: len(codes)]
    assert torch.equal(got, codes)
    back = dequantize_mx(*quantize_mx(x, fmt), fmt)
    assert torch.equal(back, x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_midpoints_round_to_the_even_code(fmt):
    codes = _finite_codes(fmt)
    vals = decode_elements(codes, fmt).double()
    pos = (vals > 0) | (codes == 0)
    order = torch.argsort(vals[pos])
    pcodes, pvals = codes[pos][order], vals[pos][order]
    mids = (pvals[:-1] + pvals[1:]) / 2
    expect = torch.where(pcodes[:-1] % 2 == 0, pcodes[:-1], pcodes[1:])
    for sign, sign_bit in ((1.0, 0), (-1.0, 0x80 if fmt == "e4m3" else 0x8)):
        got, _ = quantize_mx(_unit_scale_block(fmt, sign * mids), fmt)
        got = got.view(-1, 32)[:, 1:].flatten()[: len(mids)]
        assert torch.equal(got, expect | sign_bit), fmt
        # Just off the midpoint the nearer neighbour wins.
        eps = (pvals[1:] - pvals[:-1]) / 8
        lo, _ = quantize_mx(_unit_scale_block(fmt, sign * (mids - eps)), fmt)
        hi, _ = quantize_mx(_unit_scale_block(fmt, sign * (mids + eps)), fmt)
        assert torch.equal(lo.view(-1, 32)[:, 1:].flatten()[: len(mids)], pcodes[:-1] | sign_bit)
        assert torch.equal(hi.view(-1, 32)[:, 1:].flatten()[: len(mids)], pcodes[1:] | sign_bit)


@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_is_floor_log2_amax_minus_emax(fmt):
    for exp in (-100, -20, -1, 0, 3, 17, 100):
        for mant in (1.0, 1.3, 1.75, 1.99):
            x = torch.full((32,), 0.01) * 2.0**exp
            x[7] = -mant * 2.0**exp
            _, s = quantize_mx(x, fmt)
            assert int(s) == exp - EMAX[fmt] + 127, (exp, mant)


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_above_the_largest_code_saturate(fmt):
    # amax = 1.9 * 2^emax: the OCP scale is 2^0, so the largest values clip to the format's max.
    x = torch.linspace(-1.9, 1.9, 32) * 2.0 ** EMAX[fmt]
    codes, scales = quantize_mx(x, fmt)
    assert int(scales) == 127
    back = dequantize_mx(codes, scales, fmt)
    assert float(back.max()) == MAX[fmt] and float(back.min()) == -MAX[fmt]
    assert bool((back.abs() <= MAX[fmt]).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_tiny_blocks_get_the_smallest_scale(fmt):
    x = torch.zeros(96)
    x[32:64] = 1e-40  # fp32 subnormals
    x[64:] = torch.randn(32)
    codes, scales = quantize_mx(x, fmt)
    assert scales[0] == 0 and scales[1] == 0 and scales[2] > 0
    assert bool((codes[:32] == 0).all())
    back = dequantize_mx(codes, scales, fmt, torch.float64)
    assert bool((back[:32] == 0).all())
    # 1e-40 is 0.017 * 2^-127: e4m3 still holds it (subnormal steps of 2^-9), e2m1 rounds it to 0.
    assert (
        torch.allclose(back[32:64], x[32:64].double(), rtol=0.07) if fmt == "e4m3" else bool((back[32:64] == 0).all())
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_and_inf_blocks_stay_nan(fmt):
    x = torch.randn(96)
    x[5] = float("nan")
    x[40] = float("inf")
    codes, scales = quantize_mx(x, fmt)
    assert scales[0] == 255 and scales[1] == 255 and scales[2] != 255
    back = dequantize_mx(codes, scales, fmt)
    assert bool(back[:64].isnan().all()) and bool(back[64:].isfinite().all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_blocks_match_the_brute_force_oracle(fmt):
    g = torch.Generator().manual_seed(3)
    mags = torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())
    x = (torch.randn(64, 32, generator=g) * mags).flatten()
    x[::97] = 0.0
    codes, scales = quantize_mx(x, fmt)
    want_codes, want_scales = _oracle(x, fmt)
    assert torch.equal(scales, want_scales)
    assert torch.equal(dequantize_mx(codes, scales, fmt), dequantize_mx(want_codes, want_scales, fmt))


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    exp=st.integers(-60, 60),
    values=st.lists(st.floats(-8.0, 8.0, allow_nan=False, width=32), min_size=64, max_size=64),
)
def test_quantization_is_idempotent_and_within_half_a_step(fmt, exp, values):
    x = torch.tensor(values, dtype=torch.float32) * 2.0**exp
    codes, scales = quantize_mx(x, fmt)
    back = dequantize_mx(codes, scales, fmt)
    again = quantize_mx(back, fmt)
    assert torch.equal(again[0].view(-1, 32)[back.view(-1, 32) != 0], codes.view(-1, 32)[back.view(-1, 32) != 0])
    assert torch.equal(dequantize_mx(*again, fmt), back)
    # Unsaturated values land within half a step of the format's grid, scaled by the block scale.
    X = torch.exp2(scales.double() - 127).repeat_interleave(32)
    y = x.double() / X
    vals = _values(fmt)
    grid = torch.sort(vals[vals >= 0]).values
    idx = torch.searchsorted(grid, y.abs().clamp(max=MAX[fmt])).clamp(1, len(grid) - 1)
    half_step = (grid[idx] - grid[idx - 1]) / 2
    err = (back.double() / X - y.clamp(-MAX[fmt], MAX[fmt])).abs()
    assert bool((err <= half_step + 1e-12).all())


def test_fake_quantize_keeps_bf16_and_changes_mx():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fake_quantize(x, "bf16"), x)
    for policy in ("mxfp8", "mxfp4"):
        q = fake_quantize(x, policy)
        assert q.shape == x.shape and not torch.equal(q, x)
        assert torch.equal(fake_quantize(q, policy), q)  # already on the grid


def test_shared_exponents_need_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        shared_exponents(torch.ones(40), "e4m3")
    with pytest.raises(ValueError, match="format"):
        quantize_mx(torch.ones(32), "e5m2")  # type: ignore[arg-type]


def test_e2m1_table_is_the_checkpoint_table():
    from prepkit.mxfp4 import FP4_VALUES

    assert tuple(float(v) for v in FP4_VALUES) == E2M1_VALUES
