"""The dense MX linear, ``y[T, N] = x[T, K] @ W^T (+ bias)``: the MoE GEMM with one group and no
routing. Each program runs the MoE layer's K loop (:mod:`~prepkit.kernels.mx._mainloop`)
over one row block of ``x`` and one N tile of ``W``, the weights as a single expert whose panels
hold ``N`` rows. With a K split (decode shapes with few N tiles) each split stores its fp32
partial sums and the last split of a tile to finish reduces them (a counter per tile, reset by
that last split), all in one launch.

Weights are :mod:`prepkit.layouts.dense_mx`'s stored form: ``[P, N, 128]`` uint8 K panels
(mxfp4: the MoE weights' byte order, 256 elements a panel; mxfp8: e4m3 bytes in natural order,
128 elements a panel) and E8M0 scales ``[K/32, N]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._chain import _chain_enter
from prepkit.kernels.mx._mainloop import _mainloop, _zero_acc
from prepkit.kernels.mx._mx import _store_mx
from prepkit.kernels.mx._split import _split_range


@triton.jit
def _dense_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    T,
    N,
    K,
    stride_xt,
    stride_yt,
    N_STORED,
    stride_sk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SWAP: tl.constexpr,
    JOIN: tl.constexpr,
    W_TMA: tl.constexpr,
    MASK_ALL: tl.constexpr,
    PANEL_K: tl.constexpr,
    ACT: tl.constexpr,
    WFMT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (N tile, row block, K split). ``x`` is bf16 ``[T, K]`` (row stride ``stride_xt``)
    or, with an MX ACT, its codes (contiguous rows) and ``xs`` their scales ``[T, K/32]``. ``y``
    is ``[T, N]`` in the output dtype; with K splits, ``part`` holds their fp32 partial sums
    ``[SPLIT_K, T, N]`` and ``count`` one arrival counter per (row block, N tile), zero between
    calls. The
    weight may be rows of a wider one (q of a fused qkv): its panels hold ``N_STORED`` rows, its
    scales are ``stride_sk`` apart per group."""
    _chain_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = rows < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_lo, k_hi = _split_range(K, pid_k, BLOCK_K, SPLIT_K)
    acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)
    a_rows = x_ptr + rows * stride_xt
    as_rows = xs_ptr + rows * (K // 32)
    w_row = (pid_n * BLOCK_N).to(tl.int32)
    acc = _mainloop(
        a_rows, as_rows, m_mask, w_ptr, w_desc, w_row, s_ptr, offs_n, n_mask, N_STORED, stride_sk, k_lo, k_hi, K, acc,
        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_FP32, SWAP, JOIN, W_TMA, MASK_ALL, PANEL_K, ACT, WFMT,
    )  # fmt: skip
    if SWAP:
        ptrs = y_ptr + rows[None, :] * stride_yt + offs_n[:, None]
        mask = m_mask[None, :] & n_mask[:, None]
    else:
        ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        # Serial reduction in this launch, inline rather than through _split.py's helper: with the
        # helper the 64 x 128 split tiles took 255 registers on sm_90 instead of 174.
        if SWAP:
            part = part_ptr + rows[None, :] * N + offs_n[:, None]
        else:
            part = part_ptr + rows[:, None] * N + offs_n[None, :]
        split_stride = (pid_k.to(tl.int64) * 0 + T) * N  # T may be a specialized constant
        tl.store(part + pid_k * split_stride, acc, mask=mask)
        tl.debug_barrier()  # every thread's partials issued before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(part + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            acc = _add_bias(acc, b_ptr, offs_n, n_mask, SWAP, HAS_BIAS)
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)
    else:
        acc = _add_bias(acc, b_ptr, offs_n, n_mask, SWAP, HAS_BIAS)
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_bias(acc, b_ptr, offs_n, n_mask, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SWAP:
            acc += bias[:, None]
        else:
            acc += bias[None, :]
    return acc


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    T,
    K,
    stride_xt,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    NATURAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """bf16 rows ``x [T, K]`` -> MX codes and scales (contiguous, :class:`MxRows`' form), by the
    rule the MoE layer quantizes its token rows with (:func:`_store_mx`). ``NATURAL``: codes in
    natural order inside each 32-group (for e4m3 weights, stored that way) instead of the MoE
    weights' group order: the loads gather each group so that the quantizer's reordering lands
    every value back at its own position (value ``16t + 8h + 2q + l`` of the group it reorders to
    position ``2(4q + 2h + l) + t``, so it is fed the value of that position)."""
    _chain_enter(PDL)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = rows < T
    c0 = tl.program_id(1) * BLOCK_K
    v = tl.arange(0, BLOCK_K)
    if NATURAL:
        j = v % 32
        src = c0 + (v // 32) * 32 + 2 * (4 * ((j % 8) // 2) + 2 * ((j % 16) // 8) + j % 2) + j // 16
    else:
        src = c0 + v
    x = tl.load(x_ptr + rows[:, None] * stride_xt + src[None, :], mask=t_mask[:, None] & (src < K)[None, :], other=0.0)
    _store_mx(codes_ptr, scales_ptr, rows, t_mask, c0, K, x.to(tl.float32), BLOCK_T, BLOCK_K, ACT)
