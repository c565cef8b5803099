"""The folded upcast (``upcast_id`` 3): one bf16 multiply by 2^(s-1) in place of * 2^126 then
* 2^(s-127) is exact for every E2M1 code and every scale byte s <= 128, and ``MoeLayer`` only
enables it when its scales allow. The PTX itself runs in the GPU tests; here the same bf16
arithmetic runs in torch (each bf16 product rounds once, like ``fma.rn.bf16x2`` with a -0 addend)."""

from __future__ import annotations

import re

import torch

from prepkit import mxfp4
from prepkit.runtime.moe import scales_are_small
from tests.kernels.moe_data import make_layer, random_experts


def _bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.bfloat16)


def _raw_bits(codes: torch.Tensor) -> torch.Tensor:
    # What the PTX builds from each code: sign at bit 15, magnitude bits e1 e0 m at bits 8..6,
    # i.e. the bf16 bits of the fp4 value times 2^-126.
    return ((codes & 8) << 12) | ((codes & 7) << 6)


def _raw_values() -> torch.Tensor:
    return _bf16_from_bits(_raw_bits(torch.arange(16, dtype=torch.int32)))


def test_folded_scale_is_bit_exact_for_scales_up_to_two():
    raw = _raw_values()[:, None]  # [16, 1]
    s = torch.arange(0, 129, dtype=torch.int32)[None, :]  # [1, 129]
    two_step = (raw * _bf16_from_bits(torch.tensor(0x7E80))) * _bf16_from_bits(s << 7)
    folded = raw * _bf16_from_bits((s + 126) << 7)
    exact = (mxfp4.fp4_table()[:, None] * torch.exp2(s.double() - 127)).to(torch.bfloat16)
    # The folded product is the codec's value for every code and scale byte 0..128.
    assert torch.equal(folded.view(torch.int16), exact.view(torch.int16))
    # The two-step path agrees from s = 1 on; at s = 0 (2^-127, not a normal bf16) its scale
    # bits read as zero, so it flushes those values (below 1e-38) to zero instead.
    assert torch.equal(two_step[:, 1:].view(torch.int16), folded[:, 1:].view(torch.int16))
    assert not bool(two_step[:, 0].abs().max()) and bool(folded[:, 0].abs().max())


def test_folded_multiplier_does_not_exist_above_two():
    # s = 129 would need bf16 exponent field 255 (inf/NaN): such layers keep the two-step upcast.
    assert int((129 + 126) << 7) & 0x7F80 == 0x7F80


def test_layer_checks_its_scales_once():
    layer, _ = make_layer(random_experts(4, 64, 64, seed=0), 2)
    want = (int(layer.w13_scales.max()) <= 128, int(layer.w2_scales.max()) <= 128)
    assert layer.small_scales == want == (True, True)
    big = layer.w2_scales.clone()
    big[1, 0, 3] = 129
    assert not scales_are_small(big)
    assert scales_are_small(torch.full((2, 3), 128, dtype=torch.uint8))
    assert not scales_are_small(torch.empty((0, 3), dtype=torch.uint8))
    assert not scales_are_small(torch.empty((2, 3), dtype=torch.uint8, device="meta"))


# Each output of the PTX upcast, in order: (source lane word, nibble mask, multiplier).
_MODEL_LANES = (("t0", 0x000F000F, 0x1040), ("t1", 0x000F000F, 0x1040), ("t0", 0x00F000F0, 0x104),
                ("t1", 0x00F000F0, 0x104))  # fmt: skip


def _spread_model(w: torch.Tensor) -> list[torch.Tensor]:
    """The integer steps of the PTX upcast (``_ASM_SPREAD``) on 32-bit words ``w`` (int64 holding
    uint32): prmt 0x4140 / 0x4342 (bytes to the low byte of 16-bit lanes), then per output the
    nibble masked, multiplied (32-bit, wrapping) and masked again."""
    full = 0xFFFFFFFF
    byte = [(w >> (8 * i)) & 0xFF for i in range(4)]
    words = {"t0": byte[0] | (byte[1] << 16), "t1": byte[2] | (byte[3] << 16)}
    return [(((words[src] & keep) * mul) & full) & 0x81C081C0 for src, keep, mul in _MODEL_LANES]


def _asm_lanes() -> list[tuple[str, int, int]]:
    """(source, nibble mask, multiplier) of each output, read from the PTX the kernels compile."""
    from prepkit.kernels.mx import _upcast

    found = re.findall(r"and\.b32 a, (t[01]), (0x[0-9A-F]+);\s*mul\.lo\.u32 a, a, (0x[0-9A-F]+);", _upcast._ASM_SPREAD)
    return [(src, int(keep, 16), int(mul, 16)) for src, keep, mul in found]


def test_model_uses_the_ptx_constants():
    # The model above and the PTX must not drift apart: same sources, masks, multipliers, order.
    assert _asm_lanes() == list(_MODEL_LANES)


def test_ptx_bit_placement_isolates_every_nibble():
    """Every pair of bytes, in both lanes: each 16-bit lane holds exactly the sign (bit 15) and
    magnitude (bits 8..6) of its own nibble, with no bits from the other nibble or the other lane."""
    pairs = torch.arange(1 << 16, dtype=torch.int64)
    w = pairs | (pairs.flip(0) << 16)  # bytes 2-3 run the pairs backwards
    out = _spread_model(w)
    byte = [(w >> (8 * i)) & 0xFF for i in range(4)]
    for reg, (b_lo_lane, b_hi_lane), nibble_shift in (
        (out[0], (byte[0], byte[1]), 0),
        (out[1], (byte[2], byte[3]), 0),
        (out[2], (byte[0], byte[1]), 4),
        (out[3], (byte[2], byte[3]), 4),
    ):
        assert torch.equal(reg & 0xFFFF, _raw_bits((b_lo_lane >> nibble_shift) & 0xF))
        assert torch.equal(reg >> 16, _raw_bits((b_hi_lane >> nibble_shift) & 0xF))
