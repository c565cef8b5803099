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

The codec itself (rounding, scale rules) is :mod:`prepkit.mx_codec`'s; this module names the
policies and quantizes by the OCP rule. Torch only: the tuner's numerics gate, the reference and
the tests import this without triton.
"""

from __future__ import annotations

import torch

from prepkit import mx_codec
from prepkit.errors import PrepkitError
from prepkit.mx_codec import E2M1_BOUNDS, element_format, round_e2m1
from prepkit.mx_formats import ACTIVATION_POLICIES, BLOCK_ELEMS, MX_FORMATS, ActivationPolicy, MxElement
from prepkit.mxfp4 import E8M0_NAN
from prepkit.mxfp4 import FP4_VALUES as E2M1_VALUES

MX_BLOCK = BLOCK_ELEMS  # values per E8M0 scale
# Element format of each quantized policy: a policy is named after its MX format.
POLICY_FORMAT: dict[str, MxElement] = {p: MX_FORMATS[p].element for p in ACTIVATION_POLICIES if p in MX_FORMATS}

__all__ = [
    "ACTIVATION_POLICIES",
    "E2M1_BOUNDS",
    "E2M1_VALUES",
    "E8M0_NAN",
    "MX_BLOCK",
    "POLICY_FORMAT",
    "ActivationPolicy",
    "MxElement",
    "check_policy",
    "decode_elements",
    "dequantize_mx",
    "e8m0_to_float",
    "fake_quantize",
    "mx_format",
    "quantize_mx",
    "round_e2m1",
    "shared_exponents",
]


def check_policy(activations: str) -> ActivationPolicy:
    """``activations`` if it names a policy, else a ``PrepkitError`` listing the valid ones."""
    if activations not in ACTIVATION_POLICIES:
        raise PrepkitError(
            f"unknown activation precision {activations!r}; expected one of {', '.join(ACTIVATION_POLICIES)}",
            hint="bf16 keeps today's numerics; mxfp8 and mxfp4 quantize the activations (native on SM12x/SM10x)",
        )
    return activations


def mx_format(activations: str) -> MxElement | None:
    """The element format a policy quantizes to, ``None`` for bf16."""
    return POLICY_FORMAT.get(check_policy(activations))


def shared_exponents(x: torch.Tensor, fmt: MxElement) -> torch.Tensor:
    """E8M0 scale bytes (uint8, ``[..., n/32]``) of ``x`` (``[..., n]``, n a multiple of 32)."""
    return mx_codec.ocp_scales(x, element_format(fmt))


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 ``2^(s - 127)`` (byte 0 is the subnormal 2^-127, 255 is NaN)."""
    out = torch.exp2(scales.double() - 127.0)
    return torch.where(scales == E8M0_NAN, float("nan"), out).float()


def quantize_mx(x: torch.Tensor, fmt: MxElement) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization along the last dim: (codes uint8 ``[..., n]``, one per value: e4m3 bits
    or e2m1 codes 0..15; scales uint8 ``[..., n/32]`` E8M0). Pure function; any device."""
    return mx_codec.quantize_ocp(x, element_format(fmt))


def decode_elements(codes: torch.Tensor, fmt: MxElement) -> torch.Tensor:
    """Element codes -> their fp32 values (no scale)."""
    return mx_codec.decode_elements(codes, element_format(fmt))


def dequantize_mx(
    codes: torch.Tensor, scales: torch.Tensor, fmt: MxElement, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_mx` up to its rounding: ``value(code) * 2^(scale - 127)``."""
    return mx_codec.dequantize(codes, scales, element_format(fmt), dtype)


def fake_quantize(x: torch.Tensor, activations: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as the policy's GEMM sees it: quantized and dequantized for mxfp8/mxfp4, unchanged
    for bf16. In ``dtype`` (default ``x.dtype``)."""
    fmt = mx_format(activations)
    dtype = x.dtype if dtype is None else dtype
    if fmt is None:
        return x.to(dtype)
    codes, scales = quantize_mx(x, fmt)
    return dequantize_mx(codes, scales, fmt, dtype)
