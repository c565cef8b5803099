"""Activation precision of the MoE layer: the user's policy, and the MX quantizer that defines it.

``bf16`` multiplies bf16 activations by the MXFP4 weights (today's numerics). ``mxfp8`` and
``mxfp4`` quantize the activations of both GEMMs (the token rows at GEMM1's input, the SwiGLU
output at GEMM2's input) to OCP MX: one E8M0 scale per 32 consecutive values along the last
dim, elements e4m3 or e2m1. SM12x and SM10x tensor cores multiply such operands natively when
both sides share the element format, which is why mxfp8 also upcasts the e2m1 weights to e4m3.

Scale rule (OCP Microscaling Formats v1.0, section 6.3): shared exponent
``floor(log2(amax)) - emax(element)`` (emax 8 for e4m3, 2 for e2m1), clamped to E8M0's finite
range [-127, 127]; elements ``x / 2^exp`` rounded to nearest-even and saturated to the element's
largest magnitude (448, 6). A block whose amax is zero (or below 2^-126) gets the smallest
scale, byte 0 (2^-127), and zero elements; a block holding NaN or inf gets byte 255 (NaN), so it
never passes as a number.

TensorRT-LLM and FlashInfer round the scale up instead: ``cvt_warp_fp16_to_mxfp8`` (and
``cvt_warp_fp16_to_fp4`` with E8M0 scales) in ``cpp/tensorrt_llm/kernels/quantization.cuh``
(TensorRT-LLM 2a0ce833) and ``csrc/nv_internal/tensorrt_llm/kernels/quantization.cuh``
(FlashInfer 7d706578) take ``amax * rcp_approx(448)`` (``/ 6`` for e2m1) and convert it to E8M0
rounding toward +inf, so no element saturates; their exponent is one larger than OCP's when
amax's mantissa exceeds 448/256 = 1.75 (e4m3) or 6/4 = 1.5 (e2m1), and they write byte 0 for an
all-zero block too. Quantized with their rule, the same values may differ from ours by one code
in such blocks.

Torch only: the tuner's numerics gate, the reference and the tests import this without triton.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from prepkit.errors import PrepkitError

ActivationPolicy = Literal["bf16", "mxfp8", "mxfp4"]
ACTIVATION_POLICIES: tuple[ActivationPolicy, ...] = get_args(ActivationPolicy)
MxFormat = Literal["e4m3", "e2m1"]

MX_BLOCK = 32  # values per E8M0 scale
E8M0_NAN = 255
# Element format of each quantized policy.
POLICY_FORMAT: dict[str, MxFormat] = {"mxfp8": "e4m3", "mxfp4": "e2m1"}
# Exponent of the largest normal value, and the largest magnitude, of each element format.
_EMAX = {"e4m3": 8, "e2m1": 2}
_MAX = {"e4m3": 448.0, "e2m1": 6.0}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Round-to-nearest-even into e2m1 by magnitude: the code is the number of these bounds passed;
# at a bound exactly, ">" keeps the lower neighbour and ">=" takes the upper one, whichever has
# the even (zero) mantissa bit.
E2M1_BOUNDS = ((0.25, ">"), (0.75, ">="), (1.25, ">"), (1.75, ">="), (2.5, ">"), (3.5, ">="), (5.0, ">"))


def check_policy(activations: str) -> ActivationPolicy:
    """``activations`` if it names a policy, else a ``PrepkitError`` listing the valid ones."""
    if activations not in ACTIVATION_POLICIES:
        raise PrepkitError(
            f"unknown activation precision {activations!r}; expected one of {', '.join(ACTIVATION_POLICIES)}",
            hint="bf16 keeps today's numerics; mxfp8 and mxfp4 quantize the activations (native on SM12x/SM10x)",
        )
    return activations  # type: ignore[return-value]


def mx_format(activations: str) -> MxFormat | None:
    """The element format a policy quantizes to, ``None`` for bf16."""
    return POLICY_FORMAT.get(check_policy(activations))


def _check_format(fmt: str) -> None:
    if fmt not in _EMAX:
        raise ValueError(f"unknown MX element format {fmt!r} (expected one of {tuple(_EMAX)})")


def shared_exponents(x: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """E8M0 scale bytes (uint8, ``[..., n/32]``) of ``x`` (``[..., n]``, n a multiple of 32)."""
    _check_format(fmt)
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {MX_BLOCK}")
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(dim=-1)
    # floor(log2(amax)) + 127 is amax's fp32 exponent field (0 for zero and subnormals, whose true
    # exponent is below -127 - emax anyway, so the clamp gives byte 0 for them too).
    field = (amax.view(torch.int32) >> 23) & 0xFF
    scale = (field - _EMAX[fmt]).clamp(min=0)
    return torch.where(field == 0xFF, E8M0_NAN, scale).to(torch.uint8)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 ``2^(s - 127)`` (byte 0 is the subnormal 2^-127, 255 is NaN)."""
    out = torch.exp2(scales.double() - 127.0)
    return torch.where(scales == E8M0_NAN, float("nan"), out).float()


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8 0..15): nearest-even, saturating at 6; the input's sign bit
    kept (tiny negatives and -0 become -0, as the e4m3 cast does). NaN gives a zero code (its
    block's scale is NaN)."""
    mag = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for bound, op in E2M1_BOUNDS:
        code += (mag > bound if op == ">" else mag >= bound).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def quantize_mx(x: torch.Tensor, fmt: MxFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization along the last dim: (codes uint8 ``[..., n]``, one per value: e4m3 bits
    or e2m1 codes 0..15; scales uint8 ``[..., n/32]`` E8M0). Pure function; any device."""
    scales = shared_exponents(x, fmt)
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    # x * 2^(127 - s): a power of two, built from its exponent field (s <= 246 for finite blocks).
    inv = ((254 - scales.to(torch.int32).clamp(max=254)) << 23).view(torch.float32)
    y = (blocks * inv[..., None]).flatten(-2)
    if fmt == "e2m1":
        return round_e2m1(y), scales
    # Clamped first: the cast rounds to nearest-even, and 448 is e4m3's largest value.
    return y.clamp(-_MAX[fmt], _MAX[fmt]).to(torch.float8_e4m3fn).view(torch.uint8), scales


def decode_elements(codes: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """Element codes -> their fp32 values (no scale)."""
    _check_format(fmt)
    if fmt == "e4m3":
        return codes.view(torch.float8_e4m3fn).float()
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def dequantize_mx(
    codes: torch.Tensor, scales: torch.Tensor, fmt: MxFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_mx` up to its rounding: ``value(code) * 2^(scale - 127)``."""
    vals = decode_elements(codes, fmt).to(torch.float64).unflatten(-1, (-1, MX_BLOCK))
    mult = torch.exp2(scales.double() - 127.0)
    mult = torch.where(scales == E8M0_NAN, float("nan"), mult)
    return (vals * mult[..., None]).flatten(-2).to(dtype)


def fake_quantize(x: torch.Tensor, activations: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as the policy's GEMM sees it: quantized and dequantized for mxfp8/mxfp4, unchanged
    for bf16. In ``dtype`` (default ``x.dtype``)."""
    fmt = mx_format(activations)
    dtype = x.dtype if dtype is None else dtype
    if fmt is None:
        return x.to(dtype)
    codes, scales = quantize_mx(x, fmt)
    return dequantize_mx(codes, scales, fmt, dtype)
