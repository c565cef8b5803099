"""The fp4 upcast of the bf16 path: E2M1 weight bytes and their E8M0 scales -> bf16 values, by
Triton integer ops (runs in the CPU interpreter) or by inline PTX (CUDA only)."""

from __future__ import annotations

import triton
import triton.language as tl

# The kernels' UPCAST constant, how fp4 weights become MMA operands (``GemmTactic.upcast``):
# integer ops, ``tl.dot_scaled``, the inline PTX, and the PTX with the scale folded into one FMA.
UPCAST_BITS: tl.constexpr = tl.constexpr(0)
UPCAST_DOT_SCALED: tl.constexpr = tl.constexpr(1)
UPCAST_ASM: tl.constexpr = tl.constexpr(2)
UPCAST_ASM_FOLDED: tl.constexpr = tl.constexpr(3)


@triton.jit
def _fp4_to_f32(code):
    """E2M1 codes (uint32, 0..15) -> fp32 by bit moves: magnitude ``e1 e0 m`` shifted to bits
    24..22 plus 126 in the exponent is the value for normal codes; 0 and 0.5 are chosen directly."""
    mag = code & 7
    bits = tl.where(mag > 1, (mag << 22) + 0x3F000000, mag * 0x3F000000) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


# Inline PTX that upcasts 4 bytes at once (sm_80+): bytes spread to 16-bit lanes with prmt, each
# nibble's bits moved to bf16 position (mag e1 e0 m -> bits 8..6, sign -> bit 15: the value *
# 2^-126), then bf16x2 FMAs with a -0.0 addend (keeps +0 and -0): * 2^126 and * the E8M0 scale
# ($5, $6), or, when every scale is at most 2^1, one FMA by scale * 2^126 = 2^(s-1) (a power of
# two, so the product is exact: the same bits as the two steps; tests/kernels/test_upcast_fold.py).
# One multiply places both copies a nibble needs: with the other nibble masked off, n * (2^a +
# 2^(a+6)) puts n at bits a.. and a+6.. with no overlap and no carry, and a mask keeps the
# magnitude of the first copy and the sign of the second. Three integer ops an output, not five.
# Output $i (bf16x2) from a 16-bit-lane word: the nibble kept by ``keep``, times ``mul``.
_ASM_LANE = """
    and.b32 a, {src}, {keep};
    mul.lo.u32 a, a, {mul};
    and.b32 ${out}, a, 0x81C081C0;
"""
# $0, $1: low nibbles of bytes 0-1 / 2-3 (t0 / t1); $2, $3: their high nibbles.
_ASM_SPREAD = """
    .reg .b32 t0, t1, a, k, z;
    mov.b32 z, 0x80008000;
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
""" + "".join(
    _ASM_LANE.format(out=out, src=src, keep=keep, mul=mul)
    for out, (src, keep, mul) in enumerate(
        (
            ("t0", "0x000F000F", "0x1040"),
            ("t1", "0x000F000F", "0x1040"),
            ("t0", "0x00F000F0", "0x104"),
            ("t1", "0x00F000F0", "0x104"),
        )
    )
)
_ASM_TIMES_2_126 = "    mov.b32 k, 0x7E807E80;\n" + "".join(f"    fma.rn.bf16x2 ${i}, ${i}, k, z;\n" for i in range(4))
# $5 scales bytes 0-1 ($0, $2), $6 bytes 2-3 ($1, $3).
_ASM_TIMES_SCALE = "".join(f"    fma.rn.bf16x2 ${i}, ${i}, ${5 + i % 2}, z;\n" for i in range(4))
_ASM_UPCAST: tl.constexpr = tl.constexpr("{" + _ASM_SPREAD + _ASM_TIMES_2_126 + _ASM_TIMES_SCALE + "}")
_ASM_UPCAST_FOLDED: tl.constexpr = tl.constexpr("{" + _ASM_SPREAD + _ASM_TIMES_SCALE + "}")


@triton.jit
def _asm_upcast(wq, scale, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, "=r,=r,=r,=r,r,r,r", [wq, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
    )


@triton.jit
def _upcast_pair(wq, sc, UPCAST: tl.constexpr):
    """``wq`` bytes and ``sc`` E8M0 of the same shape (one scale per byte) -> bf16 (low, high).
    UPCAST_ASM and UPCAST_ASM_FOLDED are the inline PTX, the folded one only for scale bytes of at
    most 128 (``small_scales``); anything else runs Triton's integer ops."""
    if UPCAST == UPCAST_ASM:
        scale = (sc.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
        lo, hi = _asm_upcast(wq, scale, _ASM_UPCAST)
    elif UPCAST == UPCAST_ASM_FOLDED:
        # 2^(s-127) * 2^126 = 2^(s-1): bf16 exponent field s + 126, at most 254 for s <= 128.
        scale = ((sc.to(tl.uint16) + 126) << 7).to(tl.bfloat16, bitcast=True)
        lo, hi = _asm_upcast(wq, scale, _ASM_UPCAST_FOLDED)
    else:
        # Scale byte s is 2^(s-127): the same bits as an fp32 exponent field (s = 0 reads as 0).
        scale = (sc.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        w32 = wq.to(tl.uint32)
        lo = (_fp4_to_f32(w32 & 0xF) * scale).to(tl.bfloat16)
        hi = (_fp4_to_f32(w32 >> 4) * scale).to(tl.bfloat16)
    return lo, hi
