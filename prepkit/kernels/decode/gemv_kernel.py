"""The decode projection kernel: ``out[B, N] = f(x)[B, K] @ W^T (+ bias) (+ residual)`` for a few rows.

At one token per row the weight is read once and each of its bytes feeds at most ``B`` (<= 8)
multiply-adds, so the kernel is a weight stream: programs over blocks of output rows (and optional
K splits), each loading ``[BLOCK_N, BLOCK_K]`` weight tiles with wide contiguous loads, decoding MX
codes to fp32 in registers and reducing with elementwise products and sums (no matrix unit: the
tiles are too thin for it, and the interpreter computes bf16 dots wrongly).

``NORM``: ``f`` is the RMS-norm prologue of :func:`~prepkit.kernels.decode.gemv.norm_linear`:
``summed = bf16(x + bf16(add))``, ``normed = bf16(rms_norm(summed) * norm_weight)``; every program
computes the rows' inverse RMS over the whole row (a few KB read from L2) and then the normed values
of its own K steps, and program (0, 0) alone writes ``summed`` and ``normed``.

Five K loops. bf16 weights (the launcher picks by registers, :func:`~prepkit.kernels.decode.gemv.defers`):
one keeps each row's products in a register tile and sums it after the loop (one multiply-add per
weight value and row), the other sums every step, which needs fewer registers at many rows or wide
tiles; one row of the first kind can have a loop of its own (``OWN_ROW_LOOP``, chosen by
:func:`~prepkit.kernels.decode.gemv.own_row_loop`) that also loads its inputs a step ahead, and its
first weight tile before the wait on the kernel before (programmatic dependent launch).
MX weights sum each row's products per 32-value scale group in registers (chains of multiply-adds,
no cross-thread sum in the loop) and scale each group sum once; one row of them can load each
step's codes, scales and inputs a step ahead (``MX_AHEAD``, chosen by
:func:`~prepkit.kernels.decode.gemv.mx_ahead`), or else its first step's tile before the wait on
the kernel before (``EARLY_TILE``, :func:`~prepkit.kernels.decode.gemv.early_tile`); the deferred
loop, which scales every weight value, serves them only where it is chosen for tiles of a few groups.

K splits reduce in the same launch: each split stores its fp32 partial sums and the last split of
an N tile to arrive (a counter per tile, reset by that split) adds them up and runs the epilogue.
Unlike fp32 atomics into a zeroed buffer this needs no memset before and no rounding pass after,
and the sum's order is fixed, so repeated calls give the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._chain import _chain_enter
from prepkit.kernels.mx._mx import _widen_e2m1

# The weight formats (the kernel's WFMT constant).
WFMT_BF16: tl.constexpr = tl.constexpr(0)
WFMT_MXFP8: tl.constexpr = tl.constexpr(1)
WFMT_MXFP4: tl.constexpr = tl.constexpr(2)
# Bytes of one stored K panel row (prepkit.layouts.dense_mx), as a kernel constant.
_PANEL_BYTES: tl.constexpr = tl.constexpr(128)


@triton.jit
def _bf16(x, SW_ROUND: tl.constexpr):
    """fp32 -> bf16, nearest-even. ``SW_ROUND`` (the interpreter, whose cast truncates) rounds
    with integer arithmetic first, so the cast that follows is exact."""
    if SW_ROUND:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _tile_elements(BLOCK_K: tl.constexpr, WFMT: tl.constexpr):
    """For each position of a decoded ``BLOCK_K`` weight tile, the K offset (within the tile) of
    the element it holds. mxfp4 positions ``2p + t`` hold nibble ``t`` of stored byte ``p``:
    byte ``s`` of a 16-byte group is nibble-ordered byte ``8*jh + 2*q + jl`` (``s = 4q + 2jh + jl``,
    the layout's fragment order), whose nibble ``t`` is element ``j + 16t`` of the 32-element group."""
    i = tl.arange(0, BLOCK_K)
    if WFMT == WFMT_MXFP4:
        p = i // 2
        s = p % 16
        j = 8 * ((s // 2) % 2) + 2 * (s // 4) + s % 2
        return (p // 16) * 32 + j + 16 * (i % 2)
    return i


@triton.jit
def _load_raw(w_ptr, s_ptr, offs_n, n_mask, k0, k_end, stride_wn, stride_wp, stride_sk, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, WFMT: tl.constexpr):  # fmt: skip
    """The weight tile at K offset ``k0`` as stored (bf16 values, or MX code bytes and their
    E8M0 scale bytes ``[BLOCK_N, BLOCK_K/32]``), nothing decoded: the K loops load the next step's
    tile before they use this one, and only the loads are in flight across the step. Rows past
    ``N`` and K past ``k_end`` read as zero (a scale byte as 127, the factor 1)."""
    if WFMT == WFMT_BF16:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = n_mask[:, None] & (offs_k < k_end)[None, :]
        raw = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
        scale = tl.full((BLOCK_N, 1), 127, tl.uint8)  # unused: bf16 weights have no scales
    else:
        G: tl.constexpr = BLOCK_K // 32
        ELEMS_PER_BYTE: tl.constexpr = 2 if WFMT == WFMT_MXFP4 else 1
        TILE_BYTES: tl.constexpr = BLOCK_K // ELEMS_PER_BYTE
        kb = k0 // ELEMS_PER_BYTE + tl.arange(0, TILE_BYTES)
        # Byte kb of row n sits in panel kb // 128 at n * 128 + kb % 128 (prepkit.layouts.dense_mx).
        offs = (kb // _PANEL_BYTES) * stride_wp + kb % _PANEL_BYTES
        mask = n_mask[:, None] & (kb < k_end // ELEMS_PER_BYTE)[None, :]
        raw = tl.load(w_ptr + offs_n[:, None] * _PANEL_BYTES + offs[None, :], mask=mask, other=0)
        offs_g = k0 // 32 + tl.arange(0, G)
        s_mask = n_mask[:, None] & (offs_g < k_end // 32)[None, :]
        scale = tl.load(s_ptr + offs_g[None, :] * stride_sk + offs_n[:, None], mask=s_mask, other=127)
    return raw, scale


@triton.jit
def _decode(raw, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr, ASM: tl.constexpr):
    """A :func:`_load_raw` tile -> the weight values ``[BLOCK_N, BLOCK_K]`` in fp32 and, for MX,
    the scales as fp32 factors ``[BLOCK_N, BLOCK_K/32]`` (applied to the group sums)."""
    if WFMT == WFMT_BF16:
        w = raw.to(tl.float32)
        mult = tl.full((BLOCK_N, 1), 1.0, tl.float32)
    else:
        codes = raw
        if WFMT == WFMT_MXFP4:
            codes = _widen_e2m1(codes, BLOCK_N, BLOCK_K, ASM)
        w = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        # E8M0 byte e is 2^(e - 127): the fp32 whose exponent field is e.
        mult = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return w, mult


@triton.jit
def _split8(v):
    """The 8 tensors ``v[..., i, j, k]`` of ``v [..., 2, 2, 2]``."""
    a, b = tl.split(v)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    a00, a01 = tl.split(a0)
    a10, a11 = tl.split(a1)
    b00, b01 = tl.split(b0)
    b10, b11 = tl.split(b1)
    return a00, a01, a10, a11, b00, b01, b10, b11


@triton.jit
def _add_products8(s, w, x):
    """``s`` plus the 8 products of :func:`_split8`'s parts of ``w [..., G, 2, 2, 2, 2]`` and
    ``x [G, 2, 2, 2, 2]``, one multiply-add after the other (one link of :func:`_group_sums`' chain)."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _split8(w)
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x)
    s += w0 * x0[None]
    s += w1 * x1[None]
    s += w2 * x2[None]
    s += w3 * x3[None]
    s += w4 * x4[None]
    s += w5 * x5[None]
    s += w6 * x6[None]
    s += w7 * x7[None]
    return s


@triton.jit
def _group_sums(w, xb, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_N, BLOCK_K/32]``: each 32-element group's ``sum w * x``, as chains of multiply-adds
    over 16 of the group's values and a 2-way sum (a longer chain leaves fewer adds than a tree)."""
    G: tl.constexpr = BLOCK_K // 32
    wa, wb = tl.split(tl.reshape(w, (BLOCK_N, G, 2, 2, 2, 2, 2)))
    xa, xb2 = tl.split(tl.reshape(xb, (G, 2, 2, 2, 2, 2)))
    s = _add_products8(tl.zeros((BLOCK_N, G, 2), dtype=tl.float32), wa, xa)
    s = _add_products8(s, wb, xb2)
    return tl.sum(s, axis=2)


@triton.jit
def _input_row(x_row, add_row, nw, offs_k, k_mask, rstd, NORM: tl.constexpr, HAS_ADD: tl.constexpr,
               SW_ROUND: tl.constexpr):  # fmt: skip
    """One row's activations at ``offs_k`` in fp32: ``x`` itself, or with ``NORM`` the normed
    values ``bf16(norm_weight * (bf16(x + bf16(add)) * rstd))`` (``nw``: the norm weight at
    ``offs_k`` in fp32)."""
    x = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
    if NORM:
        add = x
        if HAS_ADD:
            add = tl.load(add_row + offs_k, mask=k_mask, other=0.0)
        return _normed(x, add, nw, rstd, HAS_ADD, SW_ROUND)
    return x.to(tl.float32)


@triton.jit
def _summed(x, add_row, offs_k, k_mask, HAS_ADD: tl.constexpr, SW_ROUND: tl.constexpr):
    """``x + add`` in bf16 (the residual stream's add), ``add`` rounded to bf16 first."""
    if HAS_ADD:
        x = _add_values(x, tl.load(add_row + offs_k, mask=k_mask, other=0.0), SW_ROUND)
    return x


@triton.jit
def _add_values(x, add, SW_ROUND: tl.constexpr):
    """:func:`_summed`'s arithmetic on loaded values."""
    a = _bf16(add.to(tl.float32), SW_ROUND)
    return _bf16(x.to(tl.float32) + a.to(tl.float32), SW_ROUND)


@triton.jit
def _normed(x, add, nw, rstd, HAS_ADD: tl.constexpr, SW_ROUND: tl.constexpr):
    """:func:`_input_row`'s normed values from loaded ``x``, ``add`` (unused without
    ``HAS_ADD``) and norm weight ``nw``, in fp32."""
    if HAS_ADD:
        x = _add_values(x, add, SW_ROUND)
    return _bf16(nw.to(tl.float32) * (x.to(tl.float32) * rstd), SW_ROUND).to(tl.float32)


@triton.jit
def _row_rstd(x_row, add_row, K, eps, ROW_BLOCK: tl.constexpr, HAS_ADD: tl.constexpr, SW_ROUND: tl.constexpr):
    """``1 / sqrt(mean(summed^2) + eps)`` of one row, in fp32. ``ROW_BLOCK`` covers the whole row
    where it can: a loop's loads are not pipelined, so each step would wait out one L2 round trip."""
    sq = tl.zeros((ROW_BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, ROW_BLOCK):
        offs_k = k0 + tl.arange(0, ROW_BLOCK)
        k_mask = offs_k < K
        x = _summed(tl.load(x_row + offs_k, mask=k_mask, other=0.0), add_row, offs_k, k_mask, HAS_ADD, SW_ROUND)
        xf = x.to(tl.float32)
        sq += xf * xf
    return 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)


@triton.jit
def _gemv_kernel(
    x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, bias_ptr, res_ptr, out_ptr, summed_ptr, normed_ptr, part_ptr, count_ptr,
    N, K, eps,
    stride_xb, stride_ab, stride_rb, stride_ob, stride_sb, stride_nb, stride_wn, stride_wp, stride_sk,
    B: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    WFMT: tl.constexpr, NORM: tl.constexpr, HAS_ADD: tl.constexpr, WANT_NORMED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ASM: tl.constexpr, SW_ROUND: tl.constexpr,
    DEFER: tl.constexpr, OWN_ROW_LOOP: tl.constexpr, MX_AHEAD: tl.constexpr, EARLY_TILE: tl.constexpr,
    ROW_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (N tile, K split) of ``B`` rows. ``x``/``add``: ``[B, K]`` rows (``add`` fp32 or
    bf16); ``w``: bf16 ``[N, K]`` (row stride ``stride_wn``) or MX panels (``stride_wp`` bytes per
    panel) with scales ``[K/32, N]`` (``stride_sk`` per group); ``out``/``res``: ``[B, N]`` bf16;
    ``summed``/``normed``: ``[B, K]`` bf16; ``part``: ``[SPLIT_K, B, N]`` fp32 and ``count`` one
    counter per N tile, zero between calls, when ``SPLIT_K > 1``. ``ROW_BLOCK``: how many of a row's
    values the norm's prologue and its row writes load at once (:func:`_row_rstd`). ``PDL``:
    programmatic dependent launch (:func:`~prepkit.kernels.mx._chain._chain_enter`), before
    anything is read."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, B_PAD)
    # Split boundaries on BLOCK_K multiples keep every scale group inside one split.
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if OWN_ROW_LOOP:
        # The weight does not depend on the kernel before: its first tile is on its way while
        # this program waits for that kernel and computes the norm.
        first = _load_raw(w_ptr, w_ptr, offs_n, n_mask, k_lo, k_hi, stride_wn, 0, 0, BLOCK_N, BLOCK_K, WFMT_BF16)[0]
    if MX_AHEAD or EARLY_TILE:
        first_raw, first_sc = _load_raw(w_ptr, s_ptr, offs_n, n_mask, k_lo, k_hi, 0, stride_wp, stride_sk, BLOCK_N,
                                        BLOCK_K, WFMT)  # fmt: skip
    else:
        first_raw = tl.zeros((1,), dtype=tl.uint8)  # no early tile: the loop loads every step itself
        first_sc = first_raw
    _chain_enter(PDL)
    rstd = tl.zeros((B_PAD,), dtype=tl.float32)
    if NORM:
        for b in tl.static_range(B):
            r = _row_rstd(x_ptr + b * stride_xb, add_ptr + b * stride_ab, K, eps, ROW_BLOCK, HAS_ADD, SW_ROUND)
            rstd = tl.where(rows == b, r, rstd)
    elem = _tile_elements(BLOCK_K, WFMT)
    if OWN_ROW_LOOP:
        acc = _one_row_k_loop(first, x_ptr, add_ptr, nw_ptr, w_ptr, offs_n, n_mask, rows, rstd, elem, k_lo, k_hi, K,
                              stride_wn, B_PAD, BLOCK_N, BLOCK_K, NORM, HAS_ADD, SW_ROUND)  # fmt: skip
    elif MX_AHEAD:
        acc = _one_row_group_loop(first_raw, first_sc, x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, offs_n, n_mask, rows,
                                  rstd, elem, k_lo, k_hi, K, stride_wp, stride_sk, B_PAD, BLOCK_N, BLOCK_K, WFMT, NORM,
                                  HAS_ADD, ASM, SW_ROUND)  # fmt: skip
    elif (WFMT != WFMT_BF16) and (not DEFER):
        acc = _group_k_loop(first_raw, first_sc, x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, offs_n, n_mask, rows, rstd,
                            elem, k_lo, k_hi, K, stride_xb, stride_ab, stride_wp, stride_sk, B, B_PAD, BLOCK_N,
                            BLOCK_K, WFMT, NORM, HAS_ADD, ASM, SW_ROUND, EARLY_TILE)  # fmt: skip
    elif DEFER:
        acc = _deferred_k_loop(x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, offs_n, n_mask, rows, rstd, elem, k_lo, k_hi, K,
                               stride_xb, stride_ab, stride_wn, stride_wp, stride_sk, B, B_PAD, BLOCK_N, BLOCK_K,
                               WFMT, NORM, HAS_ADD, ASM, SW_ROUND)  # fmt: skip
    else:
        acc = _step_k_loop(x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, offs_n, n_mask, rows, rstd, elem, k_lo, k_hi, K,
                           stride_xb, stride_ab, stride_wn, stride_wp, stride_sk, B, B_PAD, BLOCK_N, BLOCK_K,
                           WFMT, NORM, HAS_ADD, ASM, SW_ROUND)  # fmt: skip
    mask = n_mask[:, None] & (rows < B)[None, :]
    if SPLIT_K > 1:
        part = part_ptr + rows[None, :] * N + offs_n[:, None]
        tl.store(part + pid_k * (B * N), acc, mask=mask)
        tl.debug_barrier()  # every thread's partials issued before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(part + s * (B * N), mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(acc, bias_ptr, res_ptr, out_ptr, offs_n, n_mask, rows, mask, stride_rb, stride_ob, HAS_BIAS,
                      HAS_RES, SW_ROUND)  # fmt: skip
            tl.atomic_xchg(count_ptr + pid_n, 0)
    else:
        _epilogue(acc, bias_ptr, res_ptr, out_ptr, offs_n, n_mask, rows, mask, stride_rb, stride_ob, HAS_BIAS, HAS_RES,
                  SW_ROUND)  # fmt: skip
    if NORM:  # noqa: SIM102 (a compile-time branch: kernels without the norm keep no trace of it)
        if (pid_n == 0) & (pid_k == 0):
            for b in tl.static_range(B):
                _write_rows(x_ptr + b * stride_xb, add_ptr + b * stride_ab, nw_ptr, summed_ptr + b * stride_sb,
                            normed_ptr + b * stride_nb, K, tl.sum(tl.where(rows == b, rstd, 0.0), axis=0), ROW_BLOCK,
                            HAS_ADD, WANT_NORMED, SW_ROUND)  # fmt: skip


@triton.jit
def _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, b: tl.constexpr, stride_xb, stride_ab, NORM: tl.constexpr,
           HAS_ADD: tl.constexpr, SW_ROUND: tl.constexpr):  # fmt: skip
    """Row ``b``'s activations at ``offs_k``, ``[BLOCK_K]`` fp32 (:func:`_input_row`)."""
    r = _row_of(rstd, rows, b)
    return _input_row(x_ptr + b * stride_xb, add_ptr + b * stride_ab, nw, offs_k, k_mask, r, NORM, HAS_ADD, SW_ROUND)


@triton.jit
def _row_of(v, rows, b: tl.constexpr):
    """Element ``b`` of the per-row vector ``v``."""
    return tl.sum(tl.where(rows == b, v, 0.0), axis=0)


@triton.jit
def _step_k_loop(x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, offs_n, n_mask, rows, rstd, elem, k_lo, k_hi, K,
                 stride_xb, stride_ab, stride_wn, stride_wp, stride_sk, B: tl.constexpr, B_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr, NORM: tl.constexpr,
                 HAS_ADD: tl.constexpr, ASM: tl.constexpr, SW_ROUND: tl.constexpr):  # fmt: skip
    """The K loop of bf16 weights that sums every row's products at every step: few registers
    whatever the rows, a cross-thread sum per row and step. Returns the sums ``[BLOCK_N, B_PAD]``."""
    acc = tl.zeros((BLOCK_N, B_PAD), dtype=tl.float32)
    raw, sc = _load_raw(w_ptr, s_ptr, offs_n, n_mask, k_lo, k_hi, stride_wn, stride_wp, stride_sk, BLOCK_N, BLOCK_K,
                        WFMT)  # fmt: skip
    for k_step in range(k_lo, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k_step, BLOCK_K)
        # The next step's tile is loaded before this one is used: two steps' loads in flight.
        raw_next, sc_next = _load_raw(w_ptr, s_ptr, offs_n, n_mask, k0 + BLOCK_K, k_hi, stride_wn, stride_wp,
                                      stride_sk, BLOCK_N, BLOCK_K, WFMT)  # fmt: skip
        w, _ = _decode(raw, sc, BLOCK_N, BLOCK_K, WFMT, ASM)
        offs_k = k0 + elem
        k_mask = offs_k < K
        nw = tl.zeros((BLOCK_K,), dtype=tl.float32)
        if NORM:
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        for b in tl.static_range(B):
            r = _row_of(rstd, rows, b)
            xb = _input_row(x_ptr + b * stride_xb, add_ptr + b * stride_ab, nw, offs_k, k_mask, r, NORM, HAS_ADD,
                            SW_ROUND)  # fmt: skip
            dot = tl.sum(w * xb[None, :], axis=1)
            acc += tl.where(rows[None, :] == b, dot[:, None], 0.0)
        raw, sc = raw_next, sc_next
    return acc


@triton.jit
def _step_columns(nw_ptr, k0, elem, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr,
                  NORM: tl.constexpr):  # fmt: skip
    """A K step's activation offsets, their mask and (``NORM``) the norm weight there. bf16
    weights without the norm read the activations as ``[BLOCK_N, BLOCK_K]``, each row's values
    repeated down the tile: the weight tile's own layout, so no step moves them through shared
    memory. Elsewhere they stay one ``[BLOCK_K]`` row: repeating the norm's arithmetic per weight
    value, or the mxfp4 order's scattered reads, cost more than that move (sm_90 SASS, 8 x 256
    q/k/v: 238 against 123 instructions a step; 16 x 512 mxfp4 o: 710 against 350)."""
    if NORM or (WFMT != WFMT_BF16):
        offs_k = k0 + elem
        k_mask = offs_k < K
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    else:
        offs_k = tl.broadcast_to(k0 + elem[None, :], (BLOCK_N, BLOCK_K))
        k_mask = offs_k < K
        nw = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    return offs_k, k_mask, nw


@triton.jit
def _group_k_loop(raw, sc, x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, offs_n, n_mask, rows, rstd, elem, k_lo, k_hi, K,
                  stride_xb, stride_ab, stride_wp, stride_sk, B: tl.constexpr, B_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr, NORM: tl.constexpr,
                  HAS_ADD: tl.constexpr, ASM: tl.constexpr, SW_ROUND: tl.constexpr,
                  EARLY_TILE: tl.constexpr):  # fmt: skip
    """The K loop of MX weights: each row's products summed per 32-value scale group in registers
    (chains of multiply-adds, :func:`_group_sums`), scaled once a group into a ``[BLOCK_N,
    BLOCK_K/32]`` accumulator per row, which is summed once after the loop: one multiply-add per
    weight value and row, no cross-thread sum in the loop, few registers. With ``EARLY_TILE``,
    ``raw`` and ``sc`` are the first step's tile as stored, loaded before the wait on the kernel
    before; every other step loads its tile in the step (carried across the loop, the codes would
    cross it a byte a register). Returns ``[BLOCK_N, B_PAD]``."""
    a0 = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    k_first = k_lo
    if EARLY_TILE:
        a0, a1, a2, a3, a4, a5, a6, a7 = _group_step(a0, a1, a2, a3, a4, a5, a6, a7, raw, sc, x_ptr, add_ptr, nw_ptr,
                                                     rows, rstd, elem, k_lo, K, stride_xb, stride_ab, B, BLOCK_N,
                                                     BLOCK_K, WFMT, NORM, HAS_ADD, ASM, SW_ROUND)  # fmt: skip
        k_first = k_lo + BLOCK_K
    for k_step in range(k_first, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k_step, BLOCK_K)
        raw_step, sc_step = _load_raw(w_ptr, s_ptr, offs_n, n_mask, k0, k_hi, 0, stride_wp, stride_sk, BLOCK_N, BLOCK_K,
                                      WFMT)  # fmt: skip
        a0, a1, a2, a3, a4, a5, a6, a7 = _group_step(a0, a1, a2, a3, a4, a5, a6, a7, raw_step, sc_step, x_ptr, add_ptr,
                                                     nw_ptr, rows, rstd, elem, k0, K, stride_xb, stride_ab, B, BLOCK_N,
                                                     BLOCK_K, WFMT, NORM, HAS_ADD, ASM, SW_ROUND)  # fmt: skip
    s0, s1, s2, s3 = tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1)
    s4, s5, s6, s7 = tl.sum(a4, axis=1), tl.sum(a5, axis=1), tl.sum(a6, axis=1), tl.sum(a7, axis=1)
    return _gather_rows(s0, s1, s2, s3, s4, s5, s6, s7, rows, B)


@triton.jit
def _group_step(a0, a1, a2, a3, a4, a5, a6, a7, raw, sc, x_ptr, add_ptr, nw_ptr, rows, rstd, elem, k0, K, stride_xb,
                stride_ab, B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr,
                NORM: tl.constexpr, HAS_ADD: tl.constexpr, ASM: tl.constexpr, SW_ROUND: tl.constexpr):  # fmt: skip
    """One K step of :func:`_group_k_loop` on its tile as stored: the accumulators ``a0 .. a7``
    (one a row) with the step's scaled group sums added."""
    w, mult = _decode(raw, sc, BLOCK_N, BLOCK_K, WFMT, ASM)
    offs_k, k_mask, nw = _step_columns(nw_ptr, k0, elem, K, BLOCK_N, BLOCK_K, WFMT, NORM)
    a0 += mult * _group_sums(w, _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 0, stride_xb, stride_ab, NORM,
                                       HAS_ADD, SW_ROUND), BLOCK_N, BLOCK_K)  # fmt: skip
    if B > 1:
        a1 += mult * _group_sums(w, _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 1, stride_xb, stride_ab,
                                           NORM, HAS_ADD, SW_ROUND), BLOCK_N, BLOCK_K)  # fmt: skip
    if B > 2:
        a2 += mult * _group_sums(w, _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 2, stride_xb, stride_ab,
                                           NORM, HAS_ADD, SW_ROUND), BLOCK_N, BLOCK_K)  # fmt: skip
    if B > 3:
        a3 += mult * _group_sums(w, _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 3, stride_xb, stride_ab,
                                           NORM, HAS_ADD, SW_ROUND), BLOCK_N, BLOCK_K)  # fmt: skip
    if B > 4:
        a4 += mult * _group_sums(w, _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 4, stride_xb, stride_ab,
                                           NORM, HAS_ADD, SW_ROUND), BLOCK_N, BLOCK_K)  # fmt: skip
    if B > 5:
        a5 += mult * _group_sums(w, _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 5, stride_xb, stride_ab,
                                           NORM, HAS_ADD, SW_ROUND), BLOCK_N, BLOCK_K)  # fmt: skip
    if B > 6:
        a6 += mult * _group_sums(w, _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 6, stride_xb, stride_ab,
                                           NORM, HAS_ADD, SW_ROUND), BLOCK_N, BLOCK_K)  # fmt: skip
    if B > 7:
        a7 += mult * _group_sums(w, _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 7, stride_xb, stride_ab,
                                           NORM, HAS_ADD, SW_ROUND), BLOCK_N, BLOCK_K)  # fmt: skip
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _gather_rows(s0, s1, s2, s3, s4, s5, s6, s7, rows, B: tl.constexpr):
    """The first ``B`` of the per-row sums ``s0 .. s7 [BLOCK_N]`` as columns of ``[BLOCK_N, B_PAD]``."""
    acc = tl.where(rows[None, :] == 0, s0[:, None], 0.0)
    if B > 1:
        acc += tl.where(rows[None, :] == 1, s1[:, None], 0.0)
    if B > 2:
        acc += tl.where(rows[None, :] == 2, s2[:, None], 0.0)
    if B > 3:
        acc += tl.where(rows[None, :] == 3, s3[:, None], 0.0)
    if B > 4:
        acc += tl.where(rows[None, :] == 4, s4[:, None], 0.0)
    if B > 5:
        acc += tl.where(rows[None, :] == 5, s5[:, None], 0.0)
    if B > 6:
        acc += tl.where(rows[None, :] == 6, s6[:, None], 0.0)
    if B > 7:
        acc += tl.where(rows[None, :] == 7, s7[:, None], 0.0)
    return acc


@triton.jit
def _one_row_k_loop(raw, x_ptr, add_ptr, nw_ptr, w_ptr, offs_n, n_mask, rows, rstd, elem, k_lo, k_hi, K, stride_wn,
                    B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                    HAS_ADD: tl.constexpr, SW_ROUND: tl.constexpr):  # fmt: skip
    """:func:`_deferred_k_loop` for one row of bf16 weights (``raw``: the first tile), which loads
    each step's inputs (activations, and with ``NORM`` the residual add and the norm weight) a
    step ahead with the weight tile: they come from L2, and a load inside the step would wait out
    that round trip before its multiply-adds. Returns ``[BLOCK_N, B_PAD]``."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    r = _row_of(rstd, rows, 0)
    x, add, nw = _step_inputs(x_ptr, add_ptr, nw_ptr, k_lo, elem, K, BLOCK_N, BLOCK_K, NORM, HAS_ADD, not NORM)
    for k_step in range(k_lo, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k_step, BLOCK_K)
        raw_next, _ = _load_raw(w_ptr, w_ptr, offs_n, n_mask, k0 + BLOCK_K, k_hi, stride_wn, 0, 0, BLOCK_N, BLOCK_K,
                                WFMT_BF16)  # fmt: skip
        x_next, add_next, nw_next = _step_inputs(x_ptr, add_ptr, nw_ptr, k0 + BLOCK_K, elem, K, BLOCK_N, BLOCK_K,
                                                 NORM, HAS_ADD, not NORM)  # fmt: skip
        if NORM:
            acc += raw.to(tl.float32) * _normed(x, add, nw, r, HAS_ADD, SW_ROUND)[None, :]
        else:
            acc += raw.to(tl.float32) * x.to(tl.float32)
        raw, x, add, nw = raw_next, x_next, add_next, nw_next
    return tl.where(rows[None, :] == 0, tl.sum(acc, axis=1)[:, None], 0.0)


@triton.jit
def _one_row_group_loop(raw, sc, x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, offs_n, n_mask, rows, rstd, elem, k_lo, k_hi, K,
                        stride_wp, stride_sk, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        WFMT: tl.constexpr, NORM: tl.constexpr, HAS_ADD: tl.constexpr, ASM: tl.constexpr,
                        SW_ROUND: tl.constexpr):  # fmt: skip
    """:func:`_group_k_loop` for one row of MX weights (``raw``, ``sc``: the first tile as
    stored), which loads each step's codes, scales and inputs a step ahead: a load inside the step
    would wait out its round trip before the decode, and the compiler does not pipeline loads
    that feed no matrix unit. Returns ``[BLOCK_N, B_PAD]``."""
    acc = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    r = _row_of(rstd, rows, 0)
    x, add, nw = _step_inputs(x_ptr, add_ptr, nw_ptr, k_lo, elem, K, BLOCK_N, BLOCK_K, NORM, HAS_ADD, False)
    for k_step in range(k_lo, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k_step, BLOCK_K)
        raw_next, sc_next = _load_raw(w_ptr, s_ptr, offs_n, n_mask, k0 + BLOCK_K, k_hi, 0, stride_wp, stride_sk,
                                      BLOCK_N, BLOCK_K, WFMT)  # fmt: skip
        x_next, add_next, nw_next = _step_inputs(x_ptr, add_ptr, nw_ptr, k0 + BLOCK_K, elem, K, BLOCK_N, BLOCK_K,
                                                 NORM, HAS_ADD, False)  # fmt: skip
        w, mult = _decode(raw, sc, BLOCK_N, BLOCK_K, WFMT, ASM)
        if NORM:  # noqa: SIM108 (a compile-time branch: without the norm no trace of it)
            xr = _normed(x, add, nw, r, HAS_ADD, SW_ROUND)
        else:
            xr = x.to(tl.float32)
        acc += mult * _group_sums(w, xr, BLOCK_N, BLOCK_K)
        raw, sc, x, add, nw = raw_next, sc_next, x_next, add_next, nw_next
    return tl.where(rows[None, :] == 0, tl.sum(acc, axis=1)[:, None], 0.0)


@triton.jit
def _step_inputs(x_ptr, add_ptr, nw_ptr, k0, elem, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM: tl.constexpr, HAS_ADD: tl.constexpr, AS_TILE: tl.constexpr):  # fmt: skip
    """One row's inputs of the K step at ``k0`` as loaded, nothing computed: ``x``, and with
    ``NORM`` ``add`` and the norm weight (else both are ``x`` again, as ``add`` is without
    ``HAS_ADD``). ``[BLOCK_K]`` values, or with ``AS_TILE`` (bf16 weights without the norm) in the
    weight tile's layout ``[BLOCK_N, BLOCK_K]`` (:func:`_step_columns`)."""
    offs_k = tl.broadcast_to(k0 + elem[None, :], (BLOCK_N, BLOCK_K)) if AS_TILE else k0 + elem
    k_mask = offs_k < K
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    add = x
    nw = x
    if NORM:
        if HAS_ADD:
            add = tl.load(add_ptr + offs_k, mask=k_mask, other=0.0)
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0)
    return x, add, nw


@triton.jit
def _deferred_k_loop(x_ptr, add_ptr, nw_ptr, w_ptr, s_ptr, offs_n, n_mask, rows, rstd, elem, k_lo, k_hi, K,
                     stride_xb, stride_ab, stride_wn, stride_wp, stride_sk, B: tl.constexpr, B_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr, NORM: tl.constexpr,
                     HAS_ADD: tl.constexpr, ASM: tl.constexpr, SW_ROUND: tl.constexpr):  # fmt: skip
    """The K loop that keeps each row's products in a ``[BLOCK_N, BLOCK_K]`` accumulator and sums
    it once after the loop: one multiply-add per weight value and row, no cross-thread sum in the
    loop, ``B`` tiles of registers. One named accumulator per row: a ``[B, BLOCK_N, BLOCK_K]``
    tensor updated row by row would move through shared memory. Returns ``[BLOCK_N, B_PAD]``."""
    a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    # bf16 tiles load the next step's tile before they use this one: two steps' loads in flight.
    # MX tiles load in their step: their decode's instructions, not latency, bound them, and a
    # second tile's registers add to them (sm_90 SASS: mxfp8 o 151 -> 222 instructions a step).
    AHEAD: tl.constexpr = WFMT == WFMT_BF16
    if AHEAD:
        raw, sc = _load_raw(w_ptr, s_ptr, offs_n, n_mask, k_lo, k_hi, stride_wn, stride_wp, stride_sk, BLOCK_N,
                            BLOCK_K, WFMT)  # fmt: skip
    for k_step in range(k_lo, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k_step, BLOCK_K)
        if AHEAD:
            raw_next, sc_next = _load_raw(w_ptr, s_ptr, offs_n, n_mask, k0 + BLOCK_K, k_hi, stride_wn, stride_wp,
                                          stride_sk, BLOCK_N, BLOCK_K, WFMT)  # fmt: skip
            w, mult = _decode(raw, sc, BLOCK_N, BLOCK_K, WFMT, ASM)
        else:
            raw_step, sc_step = _load_raw(w_ptr, s_ptr, offs_n, n_mask, k0, k_hi, stride_wn, stride_wp, stride_sk,
                                          BLOCK_N, BLOCK_K, WFMT)  # fmt: skip
            w, mult = _decode(raw_step, sc_step, BLOCK_N, BLOCK_K, WFMT, ASM)
        if WFMT != WFMT_BF16:
            w = tl.reshape(tl.reshape(w, (BLOCK_N, BLOCK_K // 32, 32)) * mult[:, :, None], (BLOCK_N, BLOCK_K))
        offs_k, k_mask, nw = _step_columns(nw_ptr, k0, elem, K, BLOCK_N, BLOCK_K, WFMT, NORM)
        a0 += w * _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 0, stride_xb, stride_ab, NORM, HAS_ADD,
                         SW_ROUND)  # fmt: skip
        if B > 1:
            a1 += w * _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 1, stride_xb, stride_ab, NORM, HAS_ADD,
                             SW_ROUND)  # fmt: skip
        if B > 2:
            a2 += w * _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 2, stride_xb, stride_ab, NORM, HAS_ADD,
                             SW_ROUND)  # fmt: skip
        if B > 3:
            a3 += w * _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 3, stride_xb, stride_ab, NORM, HAS_ADD,
                             SW_ROUND)  # fmt: skip
        if B > 4:
            a4 += w * _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 4, stride_xb, stride_ab, NORM, HAS_ADD,
                             SW_ROUND)  # fmt: skip
        if B > 5:
            a5 += w * _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 5, stride_xb, stride_ab, NORM, HAS_ADD,
                             SW_ROUND)  # fmt: skip
        if B > 6:
            a6 += w * _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 6, stride_xb, stride_ab, NORM, HAS_ADD,
                             SW_ROUND)  # fmt: skip
        if B > 7:
            a7 += w * _x_row(x_ptr, add_ptr, nw, offs_k, k_mask, rstd, rows, 7, stride_xb, stride_ab, NORM, HAS_ADD,
                             SW_ROUND)  # fmt: skip
        if AHEAD:
            raw, sc = raw_next, sc_next
    acc = tl.where(rows[None, :] == 0, tl.sum(a0, axis=1)[:, None], 0.0)
    if B > 1:
        acc += tl.where(rows[None, :] == 1, tl.sum(a1, axis=1)[:, None], 0.0)
    if B > 2:
        acc += tl.where(rows[None, :] == 2, tl.sum(a2, axis=1)[:, None], 0.0)
    if B > 3:
        acc += tl.where(rows[None, :] == 3, tl.sum(a3, axis=1)[:, None], 0.0)
    if B > 4:
        acc += tl.where(rows[None, :] == 4, tl.sum(a4, axis=1)[:, None], 0.0)
    if B > 5:
        acc += tl.where(rows[None, :] == 5, tl.sum(a5, axis=1)[:, None], 0.0)
    if B > 6:
        acc += tl.where(rows[None, :] == 6, tl.sum(a6, axis=1)[:, None], 0.0)
    if B > 7:
        acc += tl.where(rows[None, :] == 7, tl.sum(a7, axis=1)[:, None], 0.0)
    return acc


@triton.jit
def _epilogue(acc, bias_ptr, res_ptr, out_ptr, offs_n, n_mask, rows, mask, stride_rb, stride_ob,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SW_ROUND: tl.constexpr):  # fmt: skip
    """``bf16(acc + bias)``, then ``+ residual`` in bf16, stored to ``out``."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y = _bf16(acc, SW_ROUND)
    if HAS_RES:
        res = tl.load(res_ptr + rows[None, :] * stride_rb + offs_n[:, None], mask=mask, other=0.0)
        y = _bf16(res.to(tl.float32) + y.to(tl.float32), SW_ROUND)
    tl.store(out_ptr + rows[None, :] * stride_ob + offs_n[:, None], y, mask=mask)


@triton.jit
def _add_norm_kernel(
    x_ptr, add_ptr, nw_ptr, summed_ptr, normed_ptr, K, eps, stride_xb, stride_ab, stride_sb, stride_nb,
    HAS_ADD: tl.constexpr, ROW_BLOCK: tl.constexpr, SW_ROUND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program ``b``: row ``b``'s ``summed`` and ``normed`` values, the same as the norm prologue
    of :func:`_gemv_kernel` writes them, with no projection (a weight the tensor cores run)."""
    b = tl.program_id(0)
    _chain_enter(PDL)
    x_row = x_ptr + b * stride_xb
    add_row = add_ptr + b * stride_ab
    rstd = _row_rstd(x_row, add_row, K, eps, ROW_BLOCK, HAS_ADD, SW_ROUND)
    _write_rows(x_row, add_row, nw_ptr, summed_ptr + b * stride_sb, normed_ptr + b * stride_nb, K, rstd, ROW_BLOCK,
                HAS_ADD, True, SW_ROUND)  # fmt: skip


@triton.jit
def _write_rows(x_row, add_row, nw_ptr, summed_row, normed_row, K, rstd, ROW_BLOCK: tl.constexpr,
                HAS_ADD: tl.constexpr, WANT_NORMED: tl.constexpr, SW_ROUND: tl.constexpr):  # fmt: skip
    """Store one row's ``summed`` and (``WANT_NORMED``) ``normed`` values, ``ROW_BLOCK`` at a time."""
    for k0 in range(0, K, ROW_BLOCK):
        offs_k = k0 + tl.arange(0, ROW_BLOCK)
        k_mask = offs_k < K
        x = _summed(tl.load(x_row + offs_k, mask=k_mask, other=0.0), add_row, offs_k, k_mask, HAS_ADD, SW_ROUND)
        tl.store(summed_row + offs_k, x, mask=k_mask)
        if WANT_NORMED:
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            tl.store(normed_row + offs_k, _bf16(nw * (x.to(tl.float32) * rstd), SW_ROUND), mask=k_mask)
