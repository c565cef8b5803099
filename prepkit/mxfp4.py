"""MXFP4 codec: E2M1 nibbles and E8M0 block scales (OCP MX v1.0), pure torch, no I/O.

Storage conventions of the gpt-oss checkpoint:
  * element ``k`` of a row lives in byte ``k // 2``; even ``k`` in the low nibble, odd ``k`` in
    the high nibble;
  * nibble ``s e1 e0 m``: magnitude code 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign;
  * one E8M0 scale byte per 32 consecutive elements of a row, value ``2 ** (byte - 127)``;
    byte 255 is NaN in the MX format and never appears in a valid checkpoint.

This module is the oracle for every layout test: it must stay small and obviously right. Quantizing
(rounding to these codes) is :mod:`prepkit.mx_codec`'s: ``quantize_mxfp4_blocks`` gives this form.
"""

from __future__ import annotations

import torch

BLOCK_ELEMS = 32  # FP4 elements that share one E8M0 scale
BLOCK_BYTES = BLOCK_ELEMS // 2
E8M0_BIAS = 127
E8M0_NAN = 0xFF

FP4_VALUES: tuple[float, ...] = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def fp4_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 E2M1 code values as float32 (index = nibble code)."""
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., B] uint8`` -> ``[..., 2*B] uint8`` codes, low nibble first."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2*B] uint8`` codes (0..15) -> ``[..., B] uint8``; inverse of :func:`unpack_nibbles`."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"FP4 codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack FP4 pairs, got {codes.shape[-1]}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("FP4 codes must be in 0..15")
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 powers of two; 255 -> NaN as the MX format defines."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scales.dtype}")
    exponent = scales.to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return torch.where(scales == E8M0_NAN, torch.full_like(value, float("nan")), value)


def float_to_e8m0(value: torch.Tensor) -> torch.Tensor:
    """Positive powers of two (float) -> E8M0 bytes; inverse of :func:`e8m0_to_float` on 0..254."""
    mantissa, exponent = torch.frexp(value.to(torch.float32))
    if bool(((mantissa != 0.5) & ~torch.isnan(value)).any()):
        raise ValueError("E8M0 can only hold powers of two")
    out = (exponent.to(torch.int32) - 1 + E8M0_BIAS).clamp(0, 254).to(torch.uint8)
    return torch.where(torch.isnan(value), torch.full_like(out, E8M0_NAN), out)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Reference MXFP4 dequantization.

    ``blocks``: ``[..., G, 16] uint8`` (the checkpoint's 4-D form) or ``[..., G*16]`` bytes;
    ``scales``: ``[..., G] uint8``. Returns ``[..., G*32] float32``.
    """
    if blocks.dim() == scales.dim():  # flat bytes: [..., G*16]
        blocks = blocks.unflatten(-1, (-1, BLOCK_BYTES))
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(
            f"blocks {list(blocks.shape)} and scales {list(scales.shape)} do not describe the same "
            f"MXFP4 blocks (expected blocks [..., G, {BLOCK_BYTES}] and scales [..., G])"
        )
    values = fp4_table(blocks.device)[unpack_nibbles(blocks).long()]  # [..., G, 32]
    values = values * e8m0_to_float(scales).unsqueeze(-1)
    return values.flatten(-2)
