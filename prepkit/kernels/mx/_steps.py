"""One K step of each main loop (:mod:`._mainloop`): the bf16 path's on mxfp4 weights, and the
block-scaled paths' on mxfp4 and e4m3 weights, with the helpers they share (the fragment-order
renaming, the dot, where a step lies in the K panels)."""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._mx import ACT_MXFP8, _widen_e2m1
from prepkit.kernels.mx._upcast import UPCAST_DOT_SCALED, _upcast_pair


@triton.jit
def _natural_order(wq, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BN, BK/2]`` bytes in the layout's fragment order -> column order: stored byte
    ``4q + 2jh + jl`` of a 16-byte group is column ``8jh + 2q + jl``. Only a register renaming
    for the compiler: the four bytes a thread needs for its MMA fragment arrive as one word."""
    wq = tl.reshape(wq, (BLOCK_N, BLOCK_K // 32, 4, 2, 2))
    return tl.reshape(tl.permute(wq, (0, 1, 3, 2, 4)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:  # noqa: SIM108 (a constexpr branch; one of them is never compiled)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _mxfp4_step(
    a_ptrs,
    a_mask,
    w_ptrs,
    w_desc,
    w_row,
    w_col,
    s_ptrs,
    n_mask,
    k_rem,
    acc,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SWAP: tl.constexpr,
    JOIN: tl.constexpr,
    MASK_K: tl.constexpr,
    W_TMA: tl.constexpr,
):
    """One K step on 2-D tiles: ``w_ptrs [BN, BK/2]`` bytes (or the ``w_desc`` box at
    ``[w_row, w_col]`` when W_TMA), ``s_ptrs [BN, G]`` scales; ``a_ptrs`` the activations: when
    JOIN the whole ``[BM, BK]`` step in natural order for one dot on the weight halves joined
    into group order, else ``[BM, BK/2]`` those of the low nibbles (the high ones sit 16 further)
    for one dot per half (swapped tiles only). ``MASK_K``: mask K past ``k_rem`` elements
    left (the last partial step; with ``k_loop="masked"`` every step, whose masks are then all
    true but the last). The TMA unit zero-fills a box past the tensor's end by itself.
    K is a multiple of 32 (a scale group), so masks go by whole groups: 16 bytes, 16 activations
    on each side, which keeps the masked loads vectorized."""
    G: tl.constexpr = BLOCK_K // 32
    if MASK_K:
        c_ok = tl.arange(0, BLOCK_K // 2) // 16 < k_rem // 32
        g_ok = tl.arange(0, G) < k_rem // 32
        w_msk = n_mask[:, None] & c_ok[None, :]
        if JOIN:
            a_msk = a_mask[:, None] & (tl.arange(0, BLOCK_K) // 32 < k_rem // 32)[None, :]
        else:
            a_msk = a_mask[:, None] & c_ok[None, :]
        s_msk = n_mask[:, None] & g_ok[None, :]
    else:
        w_msk = n_mask[:, None]
        a_msk = a_mask[:, None]
        s_msk = n_mask[:, None]
    if W_TMA:  # noqa: SIM108 (a constexpr branch; the other one is never compiled)
        wq = w_desc.load([w_row, w_col])
    else:
        wq = tl.load(w_ptrs, mask=w_msk, other=0)
    wq = _natural_order(wq, BLOCK_N, BLOCK_K)
    if JOIN:
        a = tl.load(a_ptrs, mask=a_msk, other=0.0)
    else:
        a_lo = tl.load(a_ptrs, mask=a_msk, other=0.0)
        a_hi = tl.load(a_ptrs + 16, mask=a_msk, other=0.0)
    sc = tl.load(s_ptrs, mask=s_msk, other=0)
    # One scale per byte: byte c of the step belongs to group c // 16.
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, BLOCK_K // 2))
    w_lo, w_hi = _upcast_pair(wq, sc, UPCAST)
    if JOIN:
        # Group g's low half (elements 32g + j) and high half (32g + 16 + j) side by side.
        w = tl.join(tl.reshape(w_lo, (BLOCK_N, G, 16)), tl.reshape(w_hi, (BLOCK_N, G, 16)))
        w = tl.reshape(tl.permute(w, (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))
        if SWAP:  # noqa: SIM108 (a constexpr branch; the other one is never compiled)
            # Few rows: the weight tile is the MMA's M side, the tokens its N side.
            acc = _dot(w, tl.trans(a), acc, DOT_FP32)
        else:
            acc = _dot(a, tl.trans(w), acc, DOT_FP32)
    else:
        acc = _dot(w_lo, tl.trans(a_lo), acc, DOT_FP32)
        acc = _dot(w_hi, tl.trans(a_hi), acc, DOT_FP32)
    return acc


@triton.jit
def _panel_step(k, panel_rows, PANEL_K: tl.constexpr, PER_BYTE: tl.constexpr = 2):
    """Where the K step starting at element ``k`` lies in one expert's panels
    (``[K/PANEL_K, panel_rows, PANEL_K/PER_BYTE]`` bytes; ``PER_BYTE`` elements a byte: 2 for
    e2m1, 1 for e4m3): its byte offset, and the TMA box's row offset and column. The hint keeps
    pointer loads 16 bytes wide: the compiler cannot see that the offset stays group-aligned."""
    panel = k // PANEL_K
    col = (k % PANEL_K) // PER_BYTE
    return tl.multiple_of(panel * panel_rows * (PANEL_K // PER_BYTE) + col, 16), panel * panel_rows, col


@triton.jit
def _mx_step(
    a_ptrs,
    as_ptrs,
    a_mask,
    w_ptrs,
    w_desc,
    w_row,
    w_col,
    s_ptrs,
    n_mask,
    k_rem,
    acc,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    SWAP: tl.constexpr,
    MASK_K: tl.constexpr,
    W_TMA: tl.constexpr,
    WIDEN_ASM: tl.constexpr,
):
    """One K step with MX activations: ``a_ptrs [BM, AB]`` code bytes and ``as_ptrs [BM, G]``
    scales of the rows, the weight bytes ``w_ptrs [BN, BK/2]`` as stored (or the ``w_desc`` box)
    and ``s_ptrs [BN, G]`` their scales; both operands in the layout's group order. Masks as in
    :func:`_mxfp4_step` (by whole groups; a masked scale reads 0, i.e. 2^-127 times zero codes)."""
    G: tl.constexpr = BLOCK_K // 32
    AB: tl.constexpr = BLOCK_K if ACT == ACT_MXFP8 else BLOCK_K // 2
    if MASK_K:
        g_ok = tl.arange(0, G) < k_rem // 32
        w_msk = n_mask[:, None] & (tl.arange(0, BLOCK_K // 2) // 16 < k_rem // 32)[None, :]
        a_msk = a_mask[:, None] & (tl.arange(0, AB) // (AB // G) < k_rem // 32)[None, :]
        s_msk = n_mask[:, None] & g_ok[None, :]
        as_msk = a_mask[:, None] & g_ok[None, :]
    else:
        w_msk = n_mask[:, None]
        a_msk = a_mask[:, None]
        s_msk = n_mask[:, None]
        as_msk = a_mask[:, None]
    if W_TMA:  # noqa: SIM108 (a constexpr branch; the other one is never compiled)
        wq = w_desc.load([w_row, w_col])
    else:
        wq = tl.load(w_ptrs, mask=w_msk, other=0)
    a = tl.load(a_ptrs, mask=a_msk, other=0)
    a_sc = tl.load(as_ptrs, mask=as_msk, other=0)
    w_sc = tl.load(s_ptrs, mask=s_msk, other=0)
    if ACT == ACT_MXFP8:
        w = _widen_e2m1(wq, BLOCK_N, BLOCK_K, WIDEN_ASM)
        if SWAP:
            acc = tl.dot_scaled(w, w_sc, "e4m3", tl.trans(a), a_sc, "e4m3", acc)
        else:
            acc = tl.dot_scaled(a, a_sc, "e4m3", tl.trans(w), w_sc, "e4m3", acc)
    else:
        if SWAP:
            acc = tl.dot_scaled(wq, w_sc, "e2m1", tl.trans(a), a_sc, "e2m1", acc)
        else:
            acc = tl.dot_scaled(a, a_sc, "e2m1", tl.trans(wq), w_sc, "e2m1", acc)
    return acc


@triton.jit
def _e4m3_step(
    a_ptrs,
    as_ptrs,
    a_mask,
    w_ptrs,
    w_desc,
    w_row,
    w_col,
    s_ptrs,
    n_mask,
    k_rem,
    acc,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ACT: tl.constexpr,
    SWAP: tl.constexpr,
    MASK_K: tl.constexpr,
    W_TMA: tl.constexpr,
):
    """One K step on e4m3 weights (one byte per element, natural order): ``w_ptrs [BN, BK]``
    bytes (or the ``w_desc`` box), ``s_ptrs [BN, G]`` their scales, ``a_ptrs [BM, BK]`` the
    activations in natural order (bf16, or e4m3 codes with ``as_ptrs [BM, G]`` scales when ACT is
    mxfp8). Masks go by whole 32-element groups, as in :func:`_mxfp4_step`."""
    G: tl.constexpr = BLOCK_K // 32
    if MASK_K:
        k_ok = tl.arange(0, BLOCK_K) // 32 < k_rem // 32
        g_ok = tl.arange(0, G) < k_rem // 32
        w_msk = n_mask[:, None] & k_ok[None, :]
        a_msk = a_mask[:, None] & k_ok[None, :]
        s_msk = n_mask[:, None] & g_ok[None, :]
        as_msk = a_mask[:, None] & g_ok[None, :]
    else:
        w_msk = n_mask[:, None]
        a_msk = a_mask[:, None]
        s_msk = n_mask[:, None]
        as_msk = a_mask[:, None]
    if W_TMA:  # noqa: SIM108 (a constexpr branch; the other one is never compiled)
        wq = w_desc.load([w_row, w_col])
    else:
        wq = tl.load(w_ptrs, mask=w_msk, other=0)
    sc = tl.load(s_ptrs, mask=s_msk, other=0)
    if ACT == ACT_MXFP8:
        a = tl.load(a_ptrs, mask=a_msk, other=0)
        a_sc = tl.load(as_ptrs, mask=as_msk, other=0)
        if SWAP:
            acc = tl.dot_scaled(wq, sc, "e4m3", tl.trans(a), a_sc, "e4m3", acc)
        else:
            acc = tl.dot_scaled(a, a_sc, "e4m3", tl.trans(wq), sc, "e4m3", acc)
    elif UPCAST == UPCAST_DOT_SCALED:
        a = tl.load(a_ptrs, mask=a_msk, other=0.0)
        acc = tl.dot_scaled(a, None, "bf16", tl.trans(wq), sc, "e4m3", acc)
    else:
        a = tl.load(a_ptrs, mask=a_msk, other=0.0)
        # e4m3 -> fp32 is exact (a hardware conversion on sm_89+), and so is the product with the
        # power-of-two scale 2^(s-127), whose fp32 bits are the byte s in the exponent field; the
        # bf16 result is exact too (3 mantissa bits) unless it falls below bf16's normal range.
        scale = (sc.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        w = wq.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w = tl.reshape(tl.reshape(w, (BLOCK_N, G, 32)) * scale[:, :, None], (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
        if SWAP:  # noqa: SIM108 (a constexpr branch; the other one is never compiled)
            acc = _dot(w, tl.trans(a), acc, DOT_FP32)
        else:
            acc = _dot(a, tl.trans(w), acc, DOT_FP32)
    return acc
