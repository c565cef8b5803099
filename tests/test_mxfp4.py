from __future__ import annotations

import math

import pytest
import torch

from prepkit import mxfp4
from prepkit.mx_codec import quantize_mxfp4_blocks


# E2M1 magnitudes derived from the format itself (sign, 2 exponent bits, 1 mantissa bit, bias 1),
# not copied from the module under test.
def _e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp = (code >> 1) & 3
    man = code & 1
    if exp == 0:
        return sign * man * 0.5  # subnormal: 0 or 0.5
    return sign * (1 + man / 2) * 2.0 ** (exp - 1)


def test_fp4_table_matches_the_e2m1_definition() -> None:
    assert [abs(v) for v in mxfp4.FP4_VALUES] == [abs(_e2m1(c)) for c in range(16)]
    assert [math.copysign(1, v) for v in mxfp4.FP4_VALUES] == [
        math.copysign(1, _e2m1(c)) if c != 8 else -1 for c in range(16)
    ]


def test_nibble_unpack_is_low_nibble_first_for_every_byte() -> None:
    every = torch.arange(256, dtype=torch.uint8)
    codes = mxfp4.unpack_nibbles(every)
    assert codes.shape == (512,)
    for b in range(256):
        assert int(codes[2 * b]) == b & 0x0F
        assert int(codes[2 * b + 1]) == b >> 4
    assert torch.equal(mxfp4.pack_nibbles(codes), every)


def test_pack_rejects_bad_codes() -> None:
    with pytest.raises(ValueError):
        mxfp4.pack_nibbles(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError):
        mxfp4.pack_nibbles(torch.tensor([1, 2, 3], dtype=torch.uint8))


def test_e8m0_round_trip_and_nan() -> None:
    scales = torch.arange(255, dtype=torch.uint8)
    values = mxfp4.e8m0_to_float(scales)
    assert float(values[127]) == 1.0 and float(values[128]) == 2.0 and float(values[0]) == 2.0**-127
    assert torch.equal(mxfp4.float_to_e8m0(values), scales)
    assert math.isnan(float(mxfp4.e8m0_to_float(torch.tensor([255], dtype=torch.uint8))[0]))


def test_dequantize_matches_a_scalar_reading_of_the_format() -> None:
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 135, (3, 2), dtype=torch.uint8, generator=g)
    out = mxfp4.dequantize(blocks, scales)
    assert out.shape == (3, 64)
    for r in range(3):
        for k in range(64):
            byte = int(blocks[r, k // 32, (k % 32) // 2])
            code = byte & 0xF if k % 2 == 0 else byte >> 4
            want = _e2m1(code) * 2.0 ** (int(scales[r, k // 32]) - 127)
            assert float(out[r, k]) == want
    # flat byte form gives the same values
    assert torch.equal(mxfp4.dequantize(blocks.flatten(-2), scales), out)


def test_quantize_round_trips_representable_values() -> None:
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (5, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (5, 4), dtype=torch.uint8, generator=g)
    values = mxfp4.dequantize(blocks, scales)
    b2, s2 = quantize_mxfp4_blocks(values)
    assert torch.equal(mxfp4.dequantize(b2, s2), values)


def test_dequantize_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="do not describe the same"):
        mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
