"""The K loops shared by both GEMMs: one for bf16 activations, one for MX activations.

In the weights' byte order (:mod:`prepkit.layouts.triton_moe` describes it) byte j of a 32-element
scale group holds its elements j and j + 16, the group's bytes in MMA fragment order
(``_natural_order`` undoes that on load). Upcasting a tile therefore yields two bf16 tiles, the "low" elements
(k = 32g + j) and the "high" ones (k = 32g + 16 + j), each a plain elementwise function of the
bytes: no interleave, no reshape across registers. Swapped tiles (the weights are the MMA's
register operand) feed each half to its own dot with the matching half of the activations, or,
with ``swapped_dot="joined"``, join the halves in registers first (faster on some tiles, slower
on others: a knob for the tuner). The other tiles always put the halves back side by side and
run one dot over the whole step on activations in natural order: their weight operand goes
through shared memory anyway, where the joined order costs nothing, and one dot of depth BLOCK_K
beats two of BLOCK_K/2 (docs/kernel-notes.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._ids import W_MXFP8
from prepkit.kernels.mx._mx import ACT_BF16, ACT_MXFP8, _widen_e2m1
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
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    # ``[BN, BM]`` when the weight tile is the MMA's M side.
    return tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], dtype=tl.float32)


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
def _mxfp4_mainloop(
    a_rows,
    a_mask,
    w_base,
    w_desc,
    w_row,
    s_base,
    offs_n,
    n_mask,
    panel_rows,
    stride_sk,
    k_lo,
    k_hi,
    K,
    acc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SWAP: tl.constexpr,
    JOIN: tl.constexpr,
    W_TMA: tl.constexpr,
    MASK_ALL: tl.constexpr,
    PANEL_K: tl.constexpr,
):
    """``acc += A[:, k_lo:k_hi] @ W[offs_n, k_lo:k_hi]^T`` (``acc`` is ``[BN, BM]`` when SWAP;
    JOIN: one dot per K step, see :func:`_mxfp4_step`).

    ``a_rows [BM]`` are pointers to the first element of each activation row; W is one expert's
    MXFP4 weights in K panels (``[K/PANEL_K, panel_rows, PANEL_BYTES]`` bytes at ``w_base``,
    triton_moe_v3 byte order) with scales ``[K/32, N]``. ``k_lo`` is a multiple of BLOCK_K, which
    divides PANEL_K, so a step never crosses a panel. With W_TMA the weight tile is the ``w_desc``
    box whose first row is ``w_row`` in panel 0; panel p sits ``p * panel_rows`` rows further.
    MASK_ALL (``k_loop="masked"``) masks every step, so a partial last step stays inside the
    pipelined loop instead of following it with loads nothing prefetched.
    """
    G: tl.constexpr = BLOCK_K // 32
    offs_g = tl.arange(0, G)
    if UPCAST == UPCAST_DOT_SCALED:
        n_groups = K // 32
        for k0 in range(k_lo, k_hi, BLOCK_K):
            gg = k0 // 32 + offs_g
            g_mask = gg < n_groups
            sc = tl.load(
                s_base + gg[None, :] * stride_sk + offs_n[:, None], mask=n_mask[:, None] & g_mask[None, :], other=0
            )  # [BN, G]
            # tl.dot_scaled wants byte j of a group to hold elements 2j, 2j+1: feed it the
            # activations permuted the same way (column 2j+t of a group reads element 16t + j).
            offs_kp = tl.arange(0, BLOCK_K)
            src = k0 + (offs_kp // 32) * 32 + (offs_kp % 2) * 16 + (offs_kp % 32) // 2
            a = tl.load(a_rows[:, None] + src[None, :], mask=a_mask[:, None] & (src < K)[None, :], other=0.0)
            offs_b = tl.arange(0, BLOCK_K // 2)
            # Column b of the group sits at byte 4q + 2jh + jl (b = 8jh + 2q + jl) in storage.
            stored_b = (offs_b // 16) * 16 + ((offs_b % 8) // 2) * 4 + ((offs_b % 16) // 8) * 2 + offs_b % 2
            w_off, _, _ = _panel_step(k0, panel_rows, PANEL_K)
            wq = tl.load(
                w_base + offs_n[None, :] * (PANEL_K // 2) + w_off + stored_b[:, None],
                mask=n_mask[None, :] & (k0 // 2 + offs_b < K // 2)[:, None],
                other=0,
            )
            acc = tl.dot_scaled(a, None, "bf16", wq, sc, "e2m1", acc)
    else:
        offs_c = tl.arange(0, BLOCK_K // 2)
        w_tile = w_base + offs_n[:, None] * (PANEL_K // 2) + offs_c[None, :]
        if JOIN:
            a_ptrs = a_rows[:, None] + (k_lo + tl.arange(0, BLOCK_K))[None, :]
        else:
            # Byte c of a step holds element 32 * (c // 16) + c % 16 in its low nibble.
            a_ptrs = a_rows[:, None] + (k_lo + (offs_c // 16) * 32 + offs_c % 16)[None, :]
        s_ptrs = s_base + (k_lo // 32 + offs_g)[None, :] * stride_sk + offs_n[:, None]
        k_hi = tl.maximum(k_hi, k_lo)
        k_full = k_hi if MASK_ALL else k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
        for k0 in range(k_lo, k_full, BLOCK_K):
            w_off, w_row_off, w_col = _panel_step(k0, panel_rows, PANEL_K)
            acc = _mxfp4_step(
                a_ptrs,
                a_mask,
                w_tile + w_off,
                w_desc,
                w_row + w_row_off,
                w_col,
                s_ptrs,
                n_mask,
                k_hi - k0,
                acc,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                DOT_FP32,
                SWAP,
                JOIN,
                MASK_ALL,
                W_TMA,
            )
            a_ptrs += BLOCK_K
            s_ptrs += G * stride_sk
        if k_full < k_hi:
            w_off, w_row_off, w_col = _panel_step(k_full, panel_rows, PANEL_K)
            acc = _mxfp4_step(
                a_ptrs,
                a_mask,
                w_tile + w_off,
                w_desc,
                w_row + w_row_off,
                w_col,
                s_ptrs,
                n_mask,
                k_hi - k_full,
                acc,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                DOT_FP32,
                SWAP,
                JOIN,
                True,
                W_TMA,
            )
    return acc


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


@triton.jit
def _mx_mainloop(
    a_rows,
    as_rows,
    a_mask,
    w_base,
    w_desc,
    w_row,
    s_base,
    offs_n,
    n_mask,
    panel_rows,
    stride_sk,
    k_lo,
    k_hi,
    acc,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ACT: tl.constexpr,
    SWAP: tl.constexpr,
    W_TMA: tl.constexpr,
    MASK_ALL: tl.constexpr,
    PANEL_K: tl.constexpr,
    WFMT: tl.constexpr,
):
    """:func:`_mxfp4_mainloop` with block-scaled operands: ``a_rows [BM]`` point at each row's
    first activation, ``as_rows [BM]`` at its scales (MX activations).

    WFMT mxfp4 (MX activations only): both operands in the layout's group order, one
    ``tl.dot_scaled`` per K step (:func:`_mx_step`). WFMT mxfp8: e4m3 weight bytes in K panels of
    PANEL_K elements (``[K/PANEL_K, panel_rows, PANEL_K]`` bytes at ``w_base``, natural order inside
    a row) with scales ``[K/32, N]``; activations bf16 (widened weights, or ``tl.dot_scaled`` bf16 x
    e4m3 when UPCAST is dot_scaled) or, with ACT mxfp8, e4m3 codes in natural order plus their
    scales: one e4m3 x e4m3 ``tl.dot_scaled`` per step, SM12x's block-scaled MMA
    (:func:`_e4m3_step`)."""
    G: tl.constexpr = BLOCK_K // 32
    E4M3: tl.constexpr = WFMT == W_MXFP8
    # Activation bytes (or bf16 elements) per K step, and weight elements per byte.
    AB: tl.constexpr = BLOCK_K if (E4M3 or ACT == ACT_MXFP8) else BLOCK_K // 2
    PER_BYTE: tl.constexpr = 1 if E4M3 else 2
    if E4M3:
        offs_k = tl.arange(0, BLOCK_K)
        w_tile = w_base + offs_n[:, None] * PANEL_K + offs_k[None, :]
        a_ptrs = a_rows[:, None] + (k_lo + offs_k)[None, :]
    else:
        offs_c = tl.arange(0, BLOCK_K // 2)
        w_tile = w_base + offs_n[:, None] * (PANEL_K // 2) + offs_c[None, :]
        a_ptrs = a_rows[:, None] + (k_lo // 32 * (AB // G) + tl.arange(0, AB))[None, :]
    as_ptrs = as_rows[:, None] + (k_lo // 32 + tl.arange(0, G))[None, :]
    s_ptrs = s_base + (k_lo // 32 + tl.arange(0, G))[None, :] * stride_sk + offs_n[:, None]
    k_hi = tl.maximum(k_hi, k_lo)
    k_full = k_hi if MASK_ALL else k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
    for k0 in range(k_lo, k_full, BLOCK_K):
        acc = _block_scaled_step(
            a_ptrs, as_ptrs, a_mask, w_tile, w_desc, w_row, s_ptrs, n_mask, panel_rows, k0, k_hi, acc,
            BLOCK_N, BLOCK_K, UPCAST, DOT_FP32, ACT, SWAP, MASK_ALL, W_TMA, PANEL_K, PER_BYTE, E4M3,
        )  # fmt: skip
        a_ptrs += AB
        as_ptrs += G
        s_ptrs += G * stride_sk
    if k_full < k_hi:
        acc = _block_scaled_step(
            a_ptrs, as_ptrs, a_mask, w_tile, w_desc, w_row, s_ptrs, n_mask, panel_rows, k_full, k_hi, acc,
            BLOCK_N, BLOCK_K, UPCAST, DOT_FP32, ACT, SWAP, True, W_TMA, PANEL_K, PER_BYTE, E4M3,
        )  # fmt: skip
    return acc


@triton.jit
def _block_scaled_step(
    a_ptrs,
    as_ptrs,
    a_mask,
    w_tile,
    w_desc,
    w_row,
    s_ptrs,
    n_mask,
    panel_rows,
    k0,
    k_hi,
    acc,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ACT: tl.constexpr,
    SWAP: tl.constexpr,
    MASK_K: tl.constexpr,
    W_TMA: tl.constexpr,
    PANEL_K: tl.constexpr,
    PER_BYTE: tl.constexpr,
    E4M3: tl.constexpr,
):
    """The K step of :func:`_mx_mainloop` starting at element ``k0``: where it lies in the panels,
    then the weight format's step."""
    w_off, w_row_off, w_col = _panel_step(k0, panel_rows, PANEL_K, PER_BYTE)
    if E4M3:
        acc = _e4m3_step(
            a_ptrs, as_ptrs, a_mask, w_tile + w_off, w_desc, w_row + w_row_off, w_col, s_ptrs, n_mask, k_hi - k0,
            acc, BLOCK_N, BLOCK_K, UPCAST, DOT_FP32, ACT, SWAP, MASK_K, W_TMA,
        )  # fmt: skip
    else:
        # The widening's inline PTX where dots run in bf16, i.e. off the interpreter.
        acc = _mx_step(
            a_ptrs, as_ptrs, a_mask, w_tile + w_off, w_desc, w_row + w_row_off, w_col, s_ptrs, n_mask, k_hi - k0,
            acc, BLOCK_N, BLOCK_K, ACT, SWAP, MASK_K, W_TMA, not DOT_FP32,
        )  # fmt: skip
    return acc


@triton.jit
def _mainloop(
    a_rows,
    as_rows,
    a_mask,
    w_base,
    w_desc,
    w_row,
    s_base,
    offs_n,
    n_mask,
    panel_rows,
    stride_sk,
    k_lo,
    k_hi,
    K,
    acc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SWAP: tl.constexpr,
    JOIN: tl.constexpr,
    W_TMA: tl.constexpr,
    MASK_ALL: tl.constexpr,
    PANEL_K: tl.constexpr,
    ACT: tl.constexpr,
    WFMT: tl.constexpr,
):
    """The one main-loop dispatcher of every GEMM kernel: ``acc += A[:, k_lo:k_hi] @ W^T`` by the
    loop the weight format and activation policy call for: block-scaled operands (mxfp8 weights,
    or MX activations) in :func:`_mx_mainloop`, bf16 activations on mxfp4 weights in
    :func:`_mxfp4_mainloop`. ``as_rows`` is read only by MX activations."""
    if WFMT == W_MXFP8 or ACT != ACT_BF16:
        acc = _mx_mainloop(
            a_rows, as_rows, a_mask, w_base, w_desc, w_row, s_base, offs_n, n_mask, panel_rows, stride_sk, k_lo, k_hi,
            acc, BLOCK_N, BLOCK_K, UPCAST, DOT_FP32, ACT, SWAP, W_TMA, MASK_ALL, PANEL_K, WFMT,
        )  # fmt: skip
    else:
        acc = _mxfp4_mainloop(
            a_rows, a_mask, w_base, w_desc, w_row, s_base, offs_n, n_mask, panel_rows, stride_sk, k_lo, k_hi, K, acc,
            BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_FP32, SWAP, JOIN, W_TMA, MASK_ALL, PANEL_K,
        )  # fmt: skip
    return acc
