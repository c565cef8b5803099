"""MX activations in the kernels (policies mxfp8 and mxfp4, :mod:`prepkit.kernels.activations`):
quantizing rows to e4m3 / e2m1 with E8M0 scales, and widening e2m1 weights to e4m3.

Quantized rows are stored as ``codes`` (one e4m3 byte per value, or two e2m1 codes per byte)
plus ``scales`` ([rows, n/32] E8M0), both contiguous. Inside each 32-value group the values sit
in the weights' order (:mod:`prepkit.layouts.triton_moe`): position 2p + t holds value
FRAGMENT_ORDER[p] + 16t, the two values of the weights' stored byte p. A dot over K does not care
how K is ordered inside a scale group as long as both operands agree, so the weight bytes reach
``tl.dot_scaled`` as stored (mxfp4) or with each nibble widened in place (mxfp8): no shuffle.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The kernels' ACT constant: the activation precision a launch runs (prepkit.kernels.activations).
# ACT_BF16 keeps the bf16 path and its compiled code; the MX ids quantize to e4m3 or e2m1.
ACT_BF16: tl.constexpr = tl.constexpr(0)
ACT_MXFP8: tl.constexpr = tl.constexpr(1)
ACT_MXFP4: tl.constexpr = tl.constexpr(2)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _round_e4m3(y):
    """fp32 -> the nearest e4m3 value (ties to even, saturating at 448), still fp32, so that the
    conversion to e4m3 after it is exact: the interpreter's own rounding is not nearest-even.
    Adding 2^(e + 20), e the value's exponent (at least -6, e4m3's subnormal step 2^-9 below),
    leaves a sum whose fp32 ulp is the e4m3 step 2^(e - 3), so the add rounds for us."""
    mag = tl.minimum(tl.abs(y), 448.0)
    e = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)
    r = (mag + magic) - magic
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _mx_quantize(x, R: tl.constexpr, C: tl.constexpr, ACT: tl.constexpr):
    """fp32 ``[R, C]`` (C a multiple of 32) -> (codes in the kernel's group order: uint8 ``[R, C]``
    e4m3 for ACT_MXFP8, ``[R, C/2]`` packed e2m1 for ACT_MXFP4; E8M0 scales uint8 ``[R, C/32]``), by the
    rule of :func:`prepkit.kernels.activations.quantize_mx` (the CPU tests compare bits)."""
    G: tl.constexpr = C // 32
    EMAX: tl.constexpr = 8 if ACT == ACT_MXFP8 else 2
    xg = tl.reshape(x, (R, G, 32))
    amax = tl.reduce(tl.abs(xg), 2, _nan_max)
    # floor(log2(amax)) + 127 is amax's exponent field; 255 (NaN, inf) gives the NaN scale.
    field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    scale = tl.where(field == 255, 255, tl.maximum(field - EMAX, 0))
    inv = ((254 - tl.minimum(scale, 254)) << 23).to(tl.float32, bitcast=True)  # 2^(127 - scale)
    y = xg * inv[:, :, None]
    if ACT == ACT_MXFP8:
        codes = _round_e4m3(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        mag = tl.abs(y)
        # Nearest-even into e2m1: the code counts the bounds passed (ties to the even mantissa).
        codes = (
            (mag > 0.25).to(tl.uint8)
            + (mag >= 0.75).to(tl.uint8)
            + (mag > 1.25).to(tl.uint8)
            + (mag >= 1.75).to(tl.uint8)
            + (mag > 2.5).to(tl.uint8)
            + (mag >= 3.5).to(tl.uint8)
            + (mag > 5.0).to(tl.uint8)
        ) | ((y.to(tl.uint32, bitcast=True) >> 31).to(tl.uint8) << 3)
    # Value 16t + 8h + 2q + l of a group goes to position 2(4q + 2h + l) + t.
    codes = tl.reshape(tl.permute(tl.reshape(codes, (R, G, 2, 2, 4, 2)), (0, 1, 4, 3, 5, 2)), (R, C))
    if ACT == ACT_MXFP4:
        lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
        codes = lo | (hi << 4)
    return codes, scale.to(tl.uint8)


@triton.jit
def _store_mx(
    codes_ptr, scales_ptr, rows, row_mask, c0, n_cols, x, R: tl.constexpr, C: tl.constexpr, ACT: tl.constexpr
):
    """Quantize ``x [R, C]``, columns ``c0 ..`` (a multiple of 32) of ``rows`` of an ``n_cols``-wide
    matrix (a multiple of 32), into contiguous ``codes``/``scales`` rows; columns past ``n_cols``
    are not stored."""
    codes, scales = _mx_quantize(x, R, C, ACT)
    G: tl.constexpr = C // 32
    GROUP_BYTES: tl.constexpr = 32 if ACT == ACT_MXFP8 else 16
    offs_g = c0 // 32 + tl.arange(0, G)
    tl.store(
        scales_ptr + rows[:, None] * (n_cols // 32) + offs_g[None, :],
        scales,
        mask=row_mask[:, None] & (offs_g < n_cols // 32)[None, :],
    )
    offs_b = c0 // 32 * GROUP_BYTES + tl.arange(0, G * GROUP_BYTES)
    tl.store(
        codes_ptr + rows[:, None] * (n_cols // 32 * GROUP_BYTES) + offs_b[None, :],
        codes,
        mask=row_mask[:, None] & (offs_b // GROUP_BYTES < n_cols // 32)[None, :],
    )


@triton.jit
def _e2m1_to_e4m3(code):
    """e2m1 codes (uint8 0..15) -> the e4m3 bits of the same value (exact): magnitude ``e1 e0 m``
    with e > 0 is 2^(e-1) * (1 + m/2), e4m3 exponent field e + 6 and mantissa m00; 0.5 is 0x30."""
    mag = code & 7
    return tl.where(mag > 1, mag * 4 + 48, mag * 48) | ((code & 8) << 4)


# e2m1 -> e4m3 of both codes of four bytes at once. One PRMT looks the e4m3 bytes of four codes'
# magnitudes up in two words holding the eight magnitudes' e4m3 bytes; a PRMT in sign mode turns
# the four codes' sign bits into byte masks; a LOP3 merges them. Output element i (16 bits) is
# byte i's low code widened, then its high code: the two words come out in the order the MMA reads.
_ASM_E2M1_TO_E4M3: tl.constexpr = tl.constexpr("""{
    .reg .b32 m, h, y, t0, t1, g0, g1, s0, s1, sb;
    mov.b32 t0, 0x3C383000;
    mov.b32 t1, 0x4C484440;
    mov.b32 sb, 0x80808080;
    and.b32 m, $2, 0x77777777;
    shr.b32 h, m, 16;
    prmt.b32 g0, t0, t1, m;
    prmt.b32 g1, t0, t1, h;
    shl.b32 y, $2, 4;
    prmt.b32 s0, y, $2, 0xD9C8;
    prmt.b32 s1, y, $2, 0xFBEA;
    lop3.b32 $0, g0, s0, sb, 0xF8;
    lop3.b32 $1, g1, s1, sb, 0xF8;
}""")


@triton.jit
def _widen_e2m1(wq, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """``[BN, BK/2]`` e2m1 code bytes -> ``[BN, BK]`` e4m3 bytes (exact), byte p's two values side
    by side at positions 2p + t, the activations' order. ``ASM``: inline PTX (off the interpreter)."""
    if ASM:
        w16 = tl.inline_asm_elementwise(_ASM_E2M1_TO_E4M3, "=r,=r,r", [wq], dtype=tl.uint16, is_pure=True, pack=4)
        lo = w16.to(tl.uint8)
        hi = (w16 >> 8).to(tl.uint8)
    else:
        lo = _e2m1_to_e4m3(wq & 0xF)
        hi = _e2m1_to_e4m3(wq >> 4)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
