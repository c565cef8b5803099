"""The torch-side MX codec: one E2M1 rounding rule, one E4M3 cast, two scale rules, one decoder.

Elements (:func:`encode_elements`): e2m1 rounds to the nearest of its eight magnitudes, ties to
the even code, saturating at 6, the sign bit kept (so tiny negatives and -0 give the code -0,
as the e4m3 cast does); e4m3 clamps to +-448 and casts (nearest-even). The kernels' quantizer
(:func:`prepkit.kernels.mx._mx._store_mx`) rounds the same way; tests/kernels/test_mx_codec.py
compares their bits.

Scales, one E8M0 byte per 32 consecutive values of the last dim:

* :func:`ocp_scales` (activations, :mod:`prepkit.kernels.activations`): OCP MX v1.0's
  ``floor(log2(amax)) - emax``, elements then saturate; NaN/inf blocks get byte 255.
* :func:`round_up_exponents` (stored weights, :mod:`prepkit.layouts.dense_mx`, and test data):
  ``ceil(log2(amax / max_element))``, the rule OpenAI's Triton MX kernels use for weights, so no
  element saturates.

Pure functions on tensors, any device, no I/O.
"""

from __future__ import annotations

import torch

from prepkit.mx_formats import BLOCK_ELEMS, BY_ELEMENT, MxFormat
from prepkit.mxfp4 import E8M0_BIAS, E8M0_NAN, FP4_VALUES, pack_nibbles

# Round-to-nearest-even into e2m1 by magnitude: the code is the number of these bounds passed;
# at a bound exactly, ">" keeps the lower neighbour and ">=" takes the upper one, whichever has
# the even (zero) mantissa bit.
E2M1_BOUNDS = ((0.25, ">"), (0.75, ">="), (1.25, ">"), (1.75, ">="), (2.5, ">"), (3.5, ">="), (5.0, ">"))


def element_format(element: str) -> MxFormat:
    """The format of element type ``element`` (``e2m1``, ``e4m3``).

    Raises:
        ValueError: no MX format has that element type.
    """
    try:
        return BY_ELEMENT[element]
    except KeyError:
        raise ValueError(f"unknown MX element format {element!r} (expected one of {tuple(BY_ELEMENT)})") from None


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8 0..15) by the module's rule. NaN gives a zero code."""
    mag = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for bound, op in E2M1_BOUNDS:
        code += (mag > bound if op == ">" else mag >= bound).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def encode_elements(scaled: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """Values already divided by their block's scale -> element codes (uint8, one per value)."""
    if fmt.element == "e2m1":
        return round_e2m1(scaled)
    # Clamped first: the cast rounds to nearest-even, and 448 is e4m3's largest value.
    return scaled.clamp(-fmt.max_value, fmt.max_value).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_elements(codes: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """Element codes -> their fp32 values (no scale)."""
    if fmt.element == "e4m3":
        return codes.view(torch.float8_e4m3fn).float()
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK_ELEMS:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {BLOCK_ELEMS}")
    return x.float().unflatten(-1, (-1, BLOCK_ELEMS))


def ocp_scales(x: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """E8M0 scale bytes (uint8, ``[..., n/32]``) of ``x`` (``[..., n]``) by OCP's rule, clamped to
    E8M0's finite range: a block whose amax is zero (or below 2^-126) gets byte 0 (2^-127)."""
    amax = _blocks(x).abs().amax(dim=-1)
    # floor(log2(amax)) + 127 is amax's fp32 exponent field (0 for zero and subnormals, whose true
    # exponent is below -127 - emax anyway, so the clamp gives byte 0 for them too).
    field = (amax.view(torch.int32) >> 23) & 0xFF
    scale = (field - fmt.emax).clamp(min=0)
    return torch.where(field == 0xFF, E8M0_NAN, scale).to(torch.uint8)


def round_up_exponents(x: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """``[..., K]`` -> ``[..., K/32]`` int32 scale exponents ``ceil(log2(amax / max_element))``,
    clamped to E8M0's finite range (an all-zero block gets the smallest)."""
    amax = _blocks(x).abs().amax(dim=-1)
    # frexp is exact where log2 may round: amax / max = m * 2**e with m in [0.5, 1).
    mantissa, exponent = torch.frexp(amax / fmt.max_value)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = torch.where(amax == 0, torch.full_like(exponent, -E8M0_BIAS), exponent)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def quantize_ocp(x: torch.Tensor, fmt: MxFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization along the last dim: (codes uint8 ``[..., n]``, scales uint8 ``[..., n/32]``)."""
    scales = ocp_scales(x, fmt)
    # x * 2^(127 - s): a power of two, built from its exponent field (s <= 246 for finite blocks).
    inv = ((254 - scales.to(torch.int32).clamp(max=254)) << 23).view(torch.float32)
    return encode_elements((_blocks(x) * inv[..., None]).flatten(-2), fmt), scales


def quantize_round_up(x: torch.Tensor, fmt: MxFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantization by the round-up scale rule: (codes uint8 ``[..., K]``, scales uint8 ``[..., K/32]``).
    A zero element is stored as +0 (the code 0), whatever its sign."""
    exponent = round_up_exponents(x, fmt)
    scaled = torch.ldexp(_blocks(x), -exponent.unsqueeze(-1)).flatten(-2)
    # + 0.0 turns -0 into +0 (IEEE), and nothing else: stored weights write zeros unsigned.
    return encode_elements(scaled + 0.0, fmt), (exponent + E8M0_BIAS).to(torch.uint8)


def quantize_mxfp4_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` floats -> the checkpoint's MXFP4 form by the round-up rule: (blocks
    ``[..., K/32, 16]`` uint8, two codes a byte, low nibble first; scales ``[..., K/32]`` uint8)."""
    codes, scales = quantize_round_up(x, BY_ELEMENT["e2m1"])
    return pack_nibbles(codes).unflatten(-1, (-1, BLOCK_ELEMS // 2)), scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: MxFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``value(code) * 2^(scale - 127)`` per element (byte 255 is NaN), in ``dtype``."""
    vals = decode_elements(codes, fmt).to(torch.float64).unflatten(-1, (-1, BLOCK_ELEMS))
    mult = torch.exp2(scales.double() - E8M0_BIAS)
    mult = torch.where(scales == E8M0_NAN, float("nan"), mult)
    return (vals * mult[..., None]).flatten(-2).to(dtype)
