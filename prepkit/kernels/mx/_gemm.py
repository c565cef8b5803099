"""The two GEMM kernels: GEMM1 + SwiGLU and GEMM2 + bias + routing weight + combine (launches 3
and 4 of the layer), each over the row blocks of the grouped picks, or (``ONE_TOKEN``) over one
token's picks, which GEMM1 finds in the router logits itself."""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._chain import _chain_enter
from prepkit.kernels.mx._ids import W_MXFP4
from prepkit.kernels.mx._mainloop import _mainloop, _zero_acc
from prepkit.kernels.mx._mx import ACT_BF16, _store_mx
from prepkit.kernels.mx._routing import _one_token_block, _one_token_pick, _row_block
from prepkit.kernels.mx._split import _split_range, _split_sum


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    b_ptr,
    counts_ptr,
    sorted_ptr,
    h_ptr,
    xs_ptr,
    hs_ptr,
    N,
    K,
    E_LOCAL,
    stride_xt,
    stride_we,
    stride_se,
    stride_sk,
    stride_be,
    stride_ht,
    N_STORED,
    K_PANELS,
    alpha,
    limit,
    logits_ptr,
    topk_ids_ptr,
    topk_w_ptr,
    out_ptr,
    E_TOTAL,
    E_LO,
    H_OUT,
    part_ptr,
    count_ptr,
    TK,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
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
    PDL: tl.constexpr,
    ONE_TOKEN: tl.constexpr = False,
    E_PAD_ALL: tl.constexpr = 16,
    ZERO_BLOCK: tl.constexpr = 16,
    SPLIT_K: tl.constexpr = 1,
    PICK_COPIES: tl.constexpr = 1,
):
    """Program (row block, N tile, K split). With K splits, ``part`` holds their fp32 partial
    sums ``[SPLIT_K, TK, N]`` (TK: the picks) and ``count`` one arrival counter per (row block,
    N tile), zero between calls: the last split of a tile adds the bias and applies SwiGLU."""
    _chain_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if ONE_TOKEN:
        # No routing launch: every program finds its pick, and the programs of the first row
        # block zero the output row GEMM2 adds into, ZERO_BLOCK columns each.
        first_split = pid_k == 0
        valid, e64, rows, m_mask, f, tok = _one_token_pick(
            logits_ptr, topk_ids_ptr, topk_w_ptr, pid_m, (pid_n == 0) & first_split, E_TOTAL, E_LO, E_LOCAL, TOP_K,
            E_PAD_ALL, BLOCK_M, PICK_COPIES,
        )  # fmt: skip
        offs_z = pid_n * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        zero_end = tl.where((pid_m == 0) & first_split, H_OUT, 0)
        tl.store(out_ptr + offs_z, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=offs_z < zero_end)
    else:
        valid, e64, rows, m_mask, f, tok = _row_block(counts_ptr, sorted_ptr, pid_m, E_LOCAL, TOP_K, E_PAD, BLOCK_M)
    if valid:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        k_lo, k_hi = _split_range(K, pid_k, BLOCK_K, SPLIT_K)
        acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)
        acc = _mainloop(
            x_ptr + tok * stride_xt,
            xs_ptr + tok * (K // 32) if ACT != ACT_BF16 else xs_ptr,
            m_mask,
            w_ptr + e64 * stride_we,
            w_desc,
            (e64 * N_STORED * K_PANELS + pid_n * BLOCK_N).to(tl.int32),
            s_ptr + e64 * stride_se,
            offs_n,
            n_mask,
            N_STORED,
            stride_sk,
            k_lo,
            k_hi,
            K,
            acc,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            UPCAST,
            DOT_FP32,
            SWAP,
            JOIN,
            W_TMA,
            MASK_ALL,
            PANEL_K,
            ACT,
            W_MXFP4,
        )
        if SPLIT_K > 1:
            tile = pid_m * tl.num_programs(1) + pid_n
            last, acc = _split_sum(
                acc, part_ptr, rows, m_mask, offs_n, n_mask, pid_k, TK, N, count_ptr, tile, SWAP, SPLIT_K
            )
            if last:
                _swiglu_store(
                    acc, b_ptr + e64 * stride_be, offs_n, n_mask, rows, m_mask, h_ptr, hs_ptr, stride_ht, N, alpha,
                    limit, pid_n, BLOCK_M, BLOCK_N, SWAP, ACT,
                )  # fmt: skip
        else:
            _swiglu_store(
                acc, b_ptr + e64 * stride_be, offs_n, n_mask, rows, m_mask, h_ptr, hs_ptr, stride_ht, N, alpha, limit,
                pid_n, BLOCK_M, BLOCK_N, SWAP, ACT,
            )  # fmt: skip


@triton.jit
def _swiglu_store(
    acc,
    b_row,
    offs_n,
    n_mask,
    rows,
    m_mask,
    h_ptr,
    hs_ptr,
    stride_ht,
    N,
    alpha,
    limit,
    pid_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWAP: tl.constexpr,
    ACT: tl.constexpr,
):
    """GEMM1's epilogue on a tile's complete sums: bias, SwiGLU, the rows of ``h`` (bf16, or
    quantized to the MX policy)."""
    bias = tl.load(b_row + offs_n, mask=n_mask, other=0.0)
    offs_i = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    # Rows alternate gate/up, so each pair of tile rows/columns is one (gate, up) unit.
    if SWAP:
        acc += bias[:, None]
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1)))
    else:
        acc += bias[None, :]
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    act = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    if ACT != ACT_BF16:
        # GEMM2's input quantized straight from fp32; block_n >= 64 gives whole 32-groups.
        if SWAP:
            act = tl.trans(act)
        _store_mx(h_ptr, hs_ptr, rows, m_mask, pid_n * (BLOCK_N // 2), N // 2, act, BLOCK_M, BLOCK_N // 2, ACT)
    else:
        act = act.to(h_ptr.dtype.element_ty)
        i_mask = offs_i < N // 2
        if SWAP:
            tl.store(h_ptr + rows[None, :] * stride_ht + offs_i[:, None], act, mask=m_mask[None, :] & i_mask[:, None])
        else:
            tl.store(h_ptr + rows[:, None] * stride_ht + offs_i[None, :], act, mask=m_mask[:, None] & i_mask[None, :])


@triton.jit
def _gemm2_combine_kernel(
    h_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    b_ptr,
    counts_ptr,
    sorted_ptr,
    topk_w_ptr,
    out_ptr,
    hs_ptr,
    N,
    K,
    E_LOCAL,
    stride_ht,
    stride_we,
    stride_se,
    stride_sk,
    stride_be,
    stride_ot,
    N_STORED,
    K_PANELS,
    topk_ids_ptr,
    E_LO,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SWAP: tl.constexpr,
    JOIN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_TMA: tl.constexpr,
    MASK_ALL: tl.constexpr,
    PANEL_K: tl.constexpr,
    ACT: tl.constexpr,
    PDL: tl.constexpr,
    ONE_TOKEN: tl.constexpr = False,
):
    _chain_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if ONE_TOKEN:
        valid, e64, rows, m_mask, f, tok = _one_token_block(topk_ids_ptr, pid_m, E_LO, E_LOCAL, TOP_K, BLOCK_M)
    else:
        valid, e64, rows, m_mask, f, tok = _row_block(counts_ptr, sorted_ptr, pid_m, E_LOCAL, TOP_K, E_PAD, BLOCK_M)
    if valid:
        gw = tl.load(topk_w_ptr + f, mask=m_mask, other=0.0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        k_lo, k_hi = _split_range(K, pid_k, BLOCK_K, SPLIT_K)
        acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)
        acc = _mainloop(
            h_ptr + rows * stride_ht,
            hs_ptr + rows * (K // 32) if ACT != ACT_BF16 else hs_ptr,
            m_mask,
            w_ptr + e64 * stride_we,
            w_desc,
            (e64 * N_STORED * K_PANELS + pid_n * BLOCK_N).to(tl.int32),
            s_ptr + e64 * stride_se,
            offs_n,
            n_mask,
            N_STORED,
            stride_sk,
            k_lo,
            k_hi,
            K,
            acc,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            UPCAST,
            DOT_FP32,
            SWAP,
            JOIN,
            W_TMA,
            MASK_ALL,
            PANEL_K,
            ACT,
            W_MXFP4,
        )
        if HAS_BIAS:
            bias = tl.load(b_ptr + e64 * stride_be + offs_n, mask=n_mask, other=0.0)
            bias = tl.where(pid_k == 0, bias, 0.0)
        else:
            bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        if SWAP:
            acc = (acc + bias[:, None]) * gw[None, :]
            tl.atomic_add(
                out_ptr + tok[None, :] * stride_ot + offs_n[:, None],
                acc,
                mask=m_mask[None, :] & n_mask[:, None],
                sem="relaxed",
            )
        else:
            acc = (acc + bias[None, :]) * gw[:, None]
            # One atomic add per column half: the output addresses of a whole 64 x 256 tile do
            # not fit in registers next to the accumulator (the compiler spilled them).
            acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            offs_half = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            rows_out = out_ptr + tok[:, None] * stride_ot
            _add_columns(rows_out, offs_half, acc_lo, m_mask, N)
            _add_columns(rows_out, offs_half + BLOCK_N // 2, acc_hi, m_mask, N)


@triton.jit
def _add_columns(rows_out, offs_n, vals, m_mask, N):
    """``rows_out[m, offs_n] += vals[m, :]`` for the rows in ``m_mask`` and columns below ``N``."""
    tl.atomic_add(rows_out + offs_n[None, :], vals, mask=m_mask[:, None] & (offs_n < N)[None, :], sem="relaxed")
