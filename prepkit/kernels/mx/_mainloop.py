"""The K loops shared by every GEMM kernel, and their one dispatcher (:func:`_mainloop`): one loop
for bf16 activations on mxfp4 weights, one for block-scaled operands; their steps are in :mod:`._steps`.

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
from prepkit.kernels.mx._mx import ACT_BF16, ACT_MXFP8
from prepkit.kernels.mx._steps import _e4m3_step, _mx_step, _mxfp4_step, _panel_step
from prepkit.kernels.mx._upcast import UPCAST_DOT_SCALED


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    # ``[BN, BM]`` when the weight tile is the MMA's M side.
    return tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], dtype=tl.float32)


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
