"""The bundled MXFP4 MoE layer in Triton: routing, grouping, GEMM1 + SwiGLU, GEMM2 + combine.

Four launches per layer (three when one routing program covers every token), all with static
grids so a CUDA graph can capture them:

1. ``_route_kernel`` (token blocks x column chunks): top-k of the router logits, softmax over the
   k picks in fp32, an atomic per-expert counter whose old value is the pick's rank inside its
   expert (chunk 0 only), and zeroing of the fp32 output rows that step 4 accumulates into (each
   program one chunk of its block's rows).
2. ``_scatter_kernel`` (picks): exclusive prefix sum of the counters, then each pick writes its
   index to ``sorted[start(expert) + rank]``; the rows of one expert become contiguous. When step
   1 runs as a single program (up to 32 tokens) it groups the picks in registers instead: no
   atomics, no second launch.
3. ``_gemm1_swiglu_kernel`` (row blocks x N tiles): gathers token rows, multiplies by the MXFP4
   gate/up rows of the expert, adds the bias and applies the gpt-oss SwiGLU in the epilogue;
   writes bf16 activations in sorted order.
4. ``_gemm2_combine_kernel`` (row blocks x N tiles x K splits): multiplies by the MXFP4 down rows,
   adds the bias (K split 0 only), scales by the routing weight and atomically adds into the
   token's fp32 output row, so the sum over a token's k experts needs no extra pass.

Every GEMM program finds its (expert, row block) from the per-expert counters alone, so grids are
sized by an upper bound and surplus programs return at once.

Weights are in the ``triton_moe_v3`` layout (docs/triton-moe-layout.md): per expert,
``w13_blocks [ceil(H/256), 2*Ip, 128]`` (K panels of 256 elements, each ``[N, 128]`` bytes; rows
gate/up interleaved, byte j of each 32-element group holding elements j and j+16, the group's 16
bytes in MMA fragment order, the last panel zero-padded), ``w13_scales [H/32, 2*Ip]`` (N
contiguous), ``w13_bias [2*Ip]`` fp32, ``w2_blocks [ceil(Ip/256), H, 128]``,
``w2_scales [Ip/32, H]``, ``w2_bias [H]`` fp32.

Variant knobs (``GemmTactic``): tile sizes, warps, stages, split-K (GEMM2 only), the upcast
(``asm``: inline PTX, CUDA only, the default; ``bits``: Triton integer ops, runs in the CPU
interpreter; ``dot_scaled``: ``tl.dot_scaled``) and how weight tiles are loaded (``ptr``: pointer
loads the compiler pipelines; ``tma``: the Hopper/Blackwell tensor memory accelerator, one copy per
tile through a host-built descriptor) and how the K loop ends (``tail``: unmasked steps, then one
masked step after the loop; ``masked``: every step masked, one pipelined loop). Tiles of at most
32 rows swap operands; they run each K step as two dots, one per half of the scale groups
(``swapped_dot="split"``), or as one dot on the halves joined in registers (``"joined"``, what
tiles of more rows always do).
Results are not bitwise deterministic: the combine adds in fp32 atomics in arrival order.

Activation precision (``activations``, the user's policy, never a tactic): ``bf16`` as above;
``mxfp8``/``mxfp4`` quantize each token row once in step 1 (its column-chunk programs already
visit every row) and the SwiGLU output in step 3's epilogue to e4m3/e2m1 with one E8M0 scale per
32 values (:mod:`prepkit.kernels.activations`), and both GEMMs run ``tl.dot_scaled`` with
same-format operands: e4m3 x e4m3 (the weights widened from e2m1 in registers, exact) or
e2m1 x e2m1 (the stored weight bytes as they are). SM12x lowers both to block-scaled MMA; other
GPUs run Triton's decomposition of the same dot.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prepkit.constants import TRITON_MOE_LAYOUT_ID
from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.kernels.device import DeviceInfo
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import K_LOOPS, SWAPPED_DOTS, invalid_reason, joins_halves, swaps_operands
from prepkit.layouts.triton_moe import PANEL_BYTES, PANEL_K

WEIGHT_LAYOUT = TRITON_MOE_LAYOUT_ID
KERNEL_VERSION = 7

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0

_UPCAST_IDS = {"bits": 0, "dot_scaled": 1, "asm": 2}
# The kernels' ACT constant per activation policy (0 keeps the bf16 path and its compiled code).
_ACT_IDS = {"bf16": 0, "mxfp8": 1, "mxfp4": 2}


def _interpreting() -> bool:
    # The CPU interpreter computes bf16 dots wrongly (torch CPU + numpy), so dots run in fp32 there.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _chain_enter(PDL: tl.constexpr):
    """With programmatic dependent launch (sm_90+), a kernel's programs may start while the kernel
    before it still runs: wait here until that kernel has finished and its writes are visible, then
    let the next kernel of the layer start its programs (they wait in turn). This hides the launch
    gap between the layer's kernels; every kernel waits before it reads anything."""
    if PDL:
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


# --------------------------------------------------------------------------------------------
# routing and grouping


@triton.jit
def _route_kernel(
    logits_ptr,
    topk_ids_ptr,
    topk_w_ptr,
    rank_ptr,
    counts_ptr,
    sorted_ptr,
    out_ptr,
    T,
    E,
    H,
    stride_lt,
    stride_ot,
    E_LO,
    E_LOCAL,
    x_ptr,
    xq_ptr,
    xs_ptr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    E_LOCAL_PAD: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    PLACE: tl.constexpr,
    ACT: tl.constexpr,
    PDL: tl.constexpr,
):
    _chain_enter(PDL)
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    # The combine in GEMM2 accumulates into these rows. One program per BLOCK_H columns: zeroing
    # them all in one program would take longer than the routing itself.
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tl.store(
        out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_h[None, :],
        tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32),
        mask=t_mask[:, None] & (offs_h < H)[None, :],
    )
    if ACT != 0:
        # The same programs quantize the token rows for GEMM1: each token once, whatever it picks.
        rows = offs_t.to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * H + offs_h[None, :], mask=t_mask[:, None] & (offs_h < H)[None, :])
        _store_mx(xq_ptr, xs_ptr, rows, t_mask, tl.program_id(1) * BLOCK_H, H, x.to(tl.float32), BLOCK_T, BLOCK_H, ACT)
    if tl.program_id(1) != 0:
        return  # the other column chunks only zero
    offs_e = tl.arange(0, E_PAD)
    e_mask = offs_e < E
    logits = tl.load(
        logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :],
        mask=t_mask[:, None] & e_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    logits = tl.where(e_mask[None, :], logits, float("-inf"))
    row_max = tl.max(logits, axis=1)

    # Pass 1: the softmax denominator over the k picks.
    work = logits
    denom = tl.zeros([BLOCK_T], dtype=tl.float32)
    for _ in tl.static_range(TOP_K):
        m = tl.max(work, axis=1)
        idx = tl.min(tl.where(work == m[:, None], offs_e[None, :], E_PAD), axis=1)
        denom += tl.exp(m - row_max)
        work = tl.where(offs_e[None, :] == idx[:, None], float("-inf"), work)

    # Pass 2: the same picks in the same order (largest first, lowest index on ties), stored.
    work = logits
    picks = tl.full([BLOCK_T, TOPK_PAD], -1, tl.int32)  # PLACE: expert of pick (t, j), -1 for none
    for j in tl.static_range(TOP_K):
        m = tl.max(work, axis=1)
        idx = tl.min(tl.where(work == m[:, None], offs_e[None, :], E_PAD), axis=1)
        flat = offs_t * TOP_K + j
        tl.store(topk_ids_ptr + flat, idx, mask=t_mask)
        tl.store(topk_w_ptr + flat, tl.exp(m - row_max) / denom, mask=t_mask)
        if PLACE:
            picks = tl.where(tl.arange(0, TOPK_PAD)[None, :] == j, tl.where(t_mask, idx, -1)[:, None], picks)
        else:
            local = idx - E_LO
            is_local = t_mask & (local >= 0) & (local < E_LOCAL)
            rank = tl.atomic_add(counts_ptr + local, tl.full([BLOCK_T], 1, tl.int32), mask=is_local)
            tl.store(rank_ptr + flat, rank, mask=is_local)
        work = tl.where(offs_e[None, :] == idx[:, None], float("-inf"), work)

    if PLACE:
        # The only program holds every pick, so it groups them in registers: no counter atomics,
        # no zeroed counters beforehand, no second pass over memory. A pick's rank inside its
        # expert is the number of earlier picks of the same expert (pick order).
        n_picks: tl.constexpr = BLOCK_T * TOPK_PAD
        local = tl.reshape(picks, (n_picks,)) - E_LO
        is_local = (local >= 0) & (local < E_LOCAL)
        offs_p = tl.arange(0, n_picks)
        pick = (pid * BLOCK_T + offs_p // TOPK_PAD) * TOP_K + offs_p % TOPK_PAD
        earlier = (local[:, None] == local[None, :]) & (offs_p[None, :] < offs_p[:, None]) & is_local[None, :]
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        offs_le = tl.arange(0, E_LOCAL_PAD)
        owns = (offs_le[:, None] == local[None, :]) & is_local[None, :]  # [experts, picks]
        counts = tl.sum(owns.to(tl.int32), axis=1)
        start = tl.cumsum(counts, axis=0) - counts
        pick_start = tl.sum(tl.where(owns, start[:, None], 0), axis=0)
        tl.store(sorted_ptr + pick_start + rank, pick, mask=is_local)
        tl.store(counts_ptr + offs_le, counts, mask=offs_le < E_LOCAL)


@triton.jit
def _scatter_kernel(
    topk_ids_ptr,
    rank_ptr,
    counts_ptr,
    sorted_ptr,
    TK,
    E_LO,
    E_LOCAL,
    E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """``sorted[start(expert) + rank] = pick`` for the picks of this block, ``start`` being the
    exclusive prefix sum of the final per-expert counters."""
    _chain_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    f_mask = offs < TK
    offs_e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E_LOCAL, other=0)
    local = tl.load(topk_ids_ptr + offs, mask=f_mask, other=-1) - E_LO
    is_local = f_mask & (local >= 0) & (local < E_LOCAL)
    start = tl.sum(tl.where(offs_e[None, :] < local[:, None], counts[None, :], 0), axis=1)
    rank = tl.load(rank_ptr + offs, mask=is_local, other=0)
    tl.store(sorted_ptr + start + rank, offs, mask=is_local)


@triton.jit
def _locate_block(counts_ptr, pid_m, E_LOCAL, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map a row-block program id to (valid, expert, first sorted row of expert, rows, block)."""
    offs_e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E_LOCAL, other=0)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(nblk, axis=0)
    total = tl.sum(nblk, axis=0)
    e = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    first_blk = tl.sum(tl.where(offs_e < e, nblk, 0), axis=0)
    row_start = tl.sum(tl.where(offs_e < e, counts, 0), axis=0)
    count_e = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
    return pid_m < total, e, row_start, count_e, pid_m - first_blk


@triton.jit
def _row_block(counts_ptr, sorted_ptr, pid_m, E_LOCAL, TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block ``pid_m`` of the grouped picks: (valid, expert as int64, grouped row indices,
    row mask, pick indices, token indices). A surplus program sees a row count of 0, so its mask is
    empty and it reads nothing."""
    valid, e, row_start, count_e, mb = _locate_block(counts_ptr, pid_m, E_LOCAL, E_PAD, BLOCK_M)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count_e
    rows = (row_start + offs_m).to(tl.int64)
    f = tl.load(sorted_ptr + rows, mask=m_mask, other=0)
    return valid, e.to(tl.int64), rows, m_mask, f, (f // TOP_K).to(tl.int64)


# --------------------------------------------------------------------------------------------
# MX activations (policies mxfp8 and mxfp4, prepkit.kernels.activations)
#
# Quantized rows are stored as ``codes`` (one e4m3 byte per value, or two e2m1 codes per byte)
# plus ``scales`` ([rows, n/32] E8M0), both contiguous. Inside each 32-value group the values sit
# in the weights' order (docs/triton-moe-layout.md): position 2p + t holds value
# FRAGMENT_ORDER[p] + 16t, the two values of the weights' stored byte p. A dot over K does not care
# how K is ordered inside a scale group as long as both operands agree, so the weight bytes reach
# ``tl.dot_scaled`` as stored (mxfp4) or with each nibble widened in place (mxfp8): no shuffle.


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
    e4m3 when ACT is 1, ``[R, C/2]`` packed e2m1 when 2; E8M0 scales uint8 ``[R, C/32]``), by the
    rule of :func:`prepkit.kernels.activations.quantize_mx` (the CPU tests compare bits)."""
    G: tl.constexpr = C // 32
    EMAX: tl.constexpr = 8 if ACT == 1 else 2
    xg = tl.reshape(x, (R, G, 32))
    amax = tl.reduce(tl.abs(xg), 2, _nan_max)
    # floor(log2(amax)) + 127 is amax's exponent field; 255 (NaN, inf) gives the NaN scale.
    field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    scale = tl.where(field == 255, 255, tl.maximum(field - EMAX, 0))
    inv = ((254 - tl.minimum(scale, 254)) << 23).to(tl.float32, bitcast=True)  # 2^(127 - scale)
    y = xg * inv[:, :, None]
    if ACT == 1:
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
    if ACT == 2:
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
    GROUP_BYTES: tl.constexpr = 32 if ACT == 1 else 16
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
    AB: tl.constexpr = BLOCK_K if ACT == 1 else BLOCK_K // 2
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
    if ACT == 1:
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
    ACT: tl.constexpr,
    SWAP: tl.constexpr,
    W_TMA: tl.constexpr,
    MASK_ALL: tl.constexpr,
    PANEL_K: tl.constexpr,
    WIDEN_ASM: tl.constexpr,
):
    """:func:`_mxfp4_mainloop` with MX activations: ``a_rows [BM]`` point at each row's codes,
    ``as_rows [BM]`` at its scales; one ``tl.dot_scaled`` per K step."""
    G: tl.constexpr = BLOCK_K // 32
    AB: tl.constexpr = BLOCK_K if ACT == 1 else BLOCK_K // 2
    offs_c = tl.arange(0, BLOCK_K // 2)
    w_tile = w_base + offs_n[:, None] * (PANEL_K // 2) + offs_c[None, :]
    a_ptrs = a_rows[:, None] + (k_lo // 32 * (AB // G) + tl.arange(0, AB))[None, :]
    as_ptrs = as_rows[:, None] + (k_lo // 32 + tl.arange(0, G))[None, :]
    s_ptrs = s_base + (k_lo // 32 + tl.arange(0, G))[None, :] * stride_sk + offs_n[:, None]
    k_hi = tl.maximum(k_hi, k_lo)
    k_full = k_hi if MASK_ALL else k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
    for k0 in range(k_lo, k_full, BLOCK_K):
        w_off, w_row_off, w_col = _panel_step(k0, panel_rows, PANEL_K)
        acc = _mx_step(
            a_ptrs, as_ptrs, a_mask, w_tile + w_off, w_desc, w_row + w_row_off, w_col, s_ptrs, n_mask, k_hi - k0, acc,
            BLOCK_N, BLOCK_K, ACT, SWAP, MASK_ALL, W_TMA, WIDEN_ASM,
        )  # fmt: skip
        a_ptrs += AB
        as_ptrs += G
        s_ptrs += G * stride_sk
    if k_full < k_hi:
        w_off, w_row_off, w_col = _panel_step(k_full, panel_rows, PANEL_K)
        acc = _mx_step(
            a_ptrs, as_ptrs, a_mask, w_tile + w_off, w_desc, w_row + w_row_off, w_col, s_ptrs, n_mask, k_hi - k_full,
            acc, BLOCK_N, BLOCK_K, ACT, SWAP, True, W_TMA, WIDEN_ASM,
        )  # fmt: skip
    return acc


# --------------------------------------------------------------------------------------------
# the MXFP4 main loop shared by both GEMMs
#
# triton_moe_v3 stores each 32-element scale group as 16 bytes where byte j holds element j (low
# nibble) and element j + 16 (high nibble), the bytes in MMA fragment order (``_natural_order``
# undoes it on load). Upcasting a tile therefore yields two bf16 tiles, the "low" elements
# (k = 32g + j) and the "high" ones (k = 32g + 16 + j), each a plain elementwise function of the
# bytes: no interleave, no reshape across registers. Swapped tiles (the weights are the MMA's
# register operand) feed each half to its own dot with the matching half of the activations, or,
# with ``swapped_dot="joined"``, join the halves in registers first (faster on some tiles, slower
# on others: a knob for the tuner). The other tiles always put the halves back side by side and
# run one dot over the whole step on activations in natural order: their weight operand goes
# through shared memory anyway, where the joined order costs nothing, and one dot of depth BLOCK_K
# beats two of BLOCK_K/2 (docs/kernel-notes.md).


@triton.jit
def _fp4_to_f32(code):
    """E2M1 codes (uint32, 0..15) -> fp32 by bit moves: magnitude ``e1 e0 m`` shifted to bits
    24..22 plus 126 in the exponent is the value for normal codes; 0 and 0.5 are chosen directly."""
    mag = code & 7
    bits = tl.where(mag > 1, (mag << 22) + 0x3F000000, mag * 0x3F000000) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


# Inline PTX that upcasts 4 bytes at once (sm_80+): bytes spread to 16-bit lanes with prmt, nibble
# bits moved to bf16 position (mag e1 e0 m -> bits 8..6, sign -> bit 15: the value * 2^-126), then
# bf16x2 FMAs with a -0.0 addend (keeps +0 and -0): * 2^126 and * the E8M0 scale ($5, $6), or,
# when every scale is at most 2^1, one FMA by scale * 2^126 = 2^(s-1) (a power of two, so the
# product is exact: the same bits as the two steps; tests/kernels/test_upcast_fold.py).
# Output $i (bf16x2) from a 16-bit-lane word: magnitude bits (after ``shift``) to 8..6, sign to 15.
_ASM_LANE = """
    shl.b32 a, {src}, {shift};
    and.b32 a, a, 0x01C001C0;
    shl.b32 b, {src}, {sign_shift};
    and.b32 b, b, 0x80008000;
    or.b32 ${out}, a, b;
"""
# $0, $1: low nibbles of bytes 0-1 / 2-3 (t0 / t1); $2, $3: their high nibbles (4 bits further up).
_ASM_SPREAD = """
    .reg .b32 t0, t1, a, b, k, z;
    mov.b32 z, 0x80008000;
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
""" + "".join(
    _ASM_LANE.format(out=out, src=src, shift=shift, sign_shift=shift + 6)
    for out, (src, shift) in enumerate((("t0", 6), ("t1", 6), ("t0", 2), ("t1", 2)))
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
    UPCAST 2 and 3 are the inline PTX; 3 only for scale bytes of at most 128 (``small_scales``)."""
    if UPCAST == 2:
        scale = (sc.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
        lo, hi = _asm_upcast(wq, scale, _ASM_UPCAST)
    elif UPCAST == 3:
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
def _panel_step(k, panel_rows, PANEL_K: tl.constexpr):
    """Where the K step starting at element ``k`` lies in one expert's panels
    (``[K/PANEL_K, panel_rows, PANEL_K/2]`` bytes): its byte offset, and the TMA box's row offset
    and column. The hint keeps pointer loads 16 bytes wide: the compiler cannot see that the
    offset stays group-aligned."""
    panel = k // PANEL_K
    col = (k % PANEL_K) // 2
    return tl.multiple_of(panel * panel_rows * (PANEL_K // 2) + col, 16), panel * panel_rows, col


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
    if UPCAST == 1:
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


# --------------------------------------------------------------------------------------------
# GEMM1 + SwiGLU, GEMM2 + combine


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
):
    _chain_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    valid, e64, rows, m_mask, f, tok = _row_block(counts_ptr, sorted_ptr, pid_m, E_LOCAL, TOP_K, E_PAD, BLOCK_M)
    if valid:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)
        if ACT != 0:
            acc = _mx_mainloop(
                x_ptr + tok * stride_xt,
                xs_ptr + tok * (K // 32),
                m_mask,
                w_ptr + e64 * stride_we,
                w_desc,
                (e64 * N_STORED * K_PANELS + pid_n * BLOCK_N).to(tl.int32),
                s_ptr + e64 * stride_se,
                offs_n,
                n_mask,
                N_STORED,
                stride_sk,
                0,
                K,
                acc,
                BLOCK_N,
                BLOCK_K,
                ACT,
                SWAP,
                W_TMA,
                MASK_ALL,
                PANEL_K,
                not DOT_FP32,
            )
        else:
            acc = _mxfp4_mainloop(
                x_ptr + tok * stride_xt,
                m_mask,
                w_ptr + e64 * stride_we,
                w_desc,
                (e64 * N_STORED * K_PANELS + pid_n * BLOCK_N).to(tl.int32),
                s_ptr + e64 * stride_se,
                offs_n,
                n_mask,
                N_STORED,
                stride_sk,
                0,
                K,
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
            )
        bias = tl.load(b_ptr + e64 * stride_be + offs_n, mask=n_mask, other=0.0)
        offs_i = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        # Rows alternate gate/up, so each pair of tile rows/columns is one (gate, up) unit.
        if SWAP:
            acc += bias[:, None]
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1)))
        else:
            acc += bias[None, :]
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(
            tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL
        )
        act = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
        if ACT != 0:
            # GEMM2's input quantized straight from fp32; block_n >= 64 gives whole 32-groups.
            if SWAP:
                act = tl.trans(act)
            _store_mx(h_ptr, hs_ptr, rows, m_mask, pid_n * (BLOCK_N // 2), N // 2, act, BLOCK_M, BLOCK_N // 2, ACT)
        else:
            act = act.to(h_ptr.dtype.element_ty)
            i_mask = offs_i < N // 2
            if SWAP:
                tl.store(
                    h_ptr + rows[None, :] * stride_ht + offs_i[:, None], act, mask=m_mask[None, :] & i_mask[:, None]
                )
            else:
                tl.store(
                    h_ptr + rows[:, None] * stride_ht + offs_i[None, :], act, mask=m_mask[:, None] & i_mask[None, :]
                )


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
):
    _chain_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    valid, e64, rows, m_mask, f, tok = _row_block(counts_ptr, sorted_ptr, pid_m, E_LOCAL, TOP_K, E_PAD, BLOCK_M)
    if valid:
        gw = tl.load(topk_w_ptr + f, mask=m_mask, other=0.0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        # Split boundaries on BLOCK_K multiples keep every scale group inside one split.
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)
        if ACT != 0:
            acc = _mx_mainloop(
                h_ptr + rows * stride_ht,
                hs_ptr + rows * (K // 32),
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
                acc,
                BLOCK_N,
                BLOCK_K,
                ACT,
                SWAP,
                W_TMA,
                MASK_ALL,
                PANEL_K,
                not DOT_FP32,
            )
        else:
            acc = _mxfp4_mainloop(
                h_ptr + rows * stride_ht,
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


# --------------------------------------------------------------------------------------------
# launcher


def _chain_launch(device: torch.device) -> dict[str, bool]:
    """Launch arguments for programmatic dependent launch (``_chain_enter``): on CUDA devices of
    sm_90 and newer, off in the interpreter and elsewhere."""
    cap = launch_capability(device)
    on = not _interpreting() and cap is not None and cap >= (9, 0)
    return {"PDL": on, "launch_pdl": on}


def upcast_id(tactic: GemmTactic, small_scales: bool) -> int:
    """The kernel's UPCAST constant: ``asm`` with ``small_scales`` (every E8M0 byte of the GEMM's
    scales is at most 128, i.e. scales <= 2; ``MoeLayer`` checks once at load) runs one bf16 FMA
    fewer per value pair. The values are the same bits for scale
    bytes 1..128; byte 0 (2^-127) becomes exact where the two-step path flushes it to zero. A
    wrong ``True`` gives wrong values for scales above 2."""
    if tactic.upcast == "asm" and small_scales:
        return 3
    return _UPCAST_IDS[tactic.upcast]


def max_row_blocks(num_picks: int, num_local_experts: int, block_m: int) -> int:
    """Upper bound of sum over experts of ceil(rows_e / block_m) when the rows sum to at most
    ``num_picks``: each non-empty expert wastes at most ``block_m - 1`` rows of its last block."""
    busy = min(num_local_experts, num_picks)
    return (num_picks + busy * (block_m - 1)) // block_m


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _check_tactic(t: GemmTactic, name: str, activations: ActivationPolicy = "bf16") -> None:
    if activations != "bf16":
        reason = invalid_reason(t, name, _ANY_DEVICE, activations)  # type: ignore[arg-type]
        if reason is not None:
            raise ValueError(f"{name}: tactic {t.key()} cannot run with activations {activations!r}: {reason}")
    if t.upcast not in _UPCAST_IDS:
        raise ValueError(f"{name}: unknown upcast {t.upcast!r}")
    if t.k_loop not in K_LOOPS:
        raise ValueError(f"{name}: unknown k_loop {t.k_loop!r} (expected one of {K_LOOPS})")
    if t.swapped_dot not in SWAPPED_DOTS:
        raise ValueError(f"{name}: unknown swapped_dot {t.swapped_dot!r} (expected one of {SWAPPED_DOTS})")
    if t.upcast == "asm" and _interpreting():
        raise ValueError(f"{name}: upcast 'asm' is inline PTX and cannot run under TRITON_INTERPRET")
    if PANEL_K % t.block_k or t.block_k < 32 or t.block_m < 16 or t.block_n < 16:
        raise ValueError(
            f"{name}: tile {t.key()} needs block_k in (32, 64, 128, 256) (a divisor of the "
            f"{PANEL_K}-element K panel) and block_m, block_n >= 16"
        )


def _check_panels(w_blocks: torch.Tensor, k: int, name: str) -> None:
    """``w_blocks`` must be ``[E, K_panels, N, PANEL_BYTES]`` with enough panels for ``k``."""
    if w_blocks.dim() != 4 or w_blocks.shape[3] != PANEL_BYTES or w_blocks.shape[1] * PANEL_K < k:
        raise ValueError(
            f"{name}: weights {list(w_blocks.shape)} are not [E, K/{PANEL_K}, N, {PANEL_BYTES}] panels "
            f"covering K = {k} (triton_moe_v3)"
        )


# The device-independent rules of invalid_reason: any sm_90+ part with room for every tile.
_ANY_DEVICE = DeviceInfo("any", (9, 0), 1, 1 << 30)


def launch_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of the CUDA device a launch on ``device`` runs on, ``None`` off CUDA. The one
    place launch decisions read the device (programmatic dependent launch and the tensor memory
    accelerator both start with sm_90), so an ahead-of-time compile can stand in a target."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index or 0)


@functools.cache
def _cuda_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def weight_descriptor(
    w_blocks: torch.Tensor, tactic: GemmTactic, activations: ActivationPolicy = "bf16"
) -> object | None:
    """A TMA descriptor of the panels ``w_blocks [E, K_panels, N, PANEL_BYTES]`` as
    ``[E*K_panels*N, PANEL_BYTES]`` with ``[block_n, block_k/2]`` boxes when ``tactic`` asks for
    TMA loads and the tensor allows them (contiguous, 16-byte aligned base, a device with the unit
    or the interpreter); ``None`` means pointer loads."""
    if tactic.weight_load != "tma" or (tactic.upcast == "dot_scaled" and activations == "bf16"):
        return None
    if not w_blocks.is_contiguous() or w_blocks.shape[-1] % 16 or w_blocks.data_ptr() % 16:
        return None
    cap = launch_capability(w_blocks.device)
    if not _interpreting() and not (cap is not None and cap >= (9, 0)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = w_blocks.view(-1, w_blocks.shape[-1])
    return TensorDescriptor.from_tensor(flat, [tactic.block_n, tactic.block_k // 2])


@dataclass
class MxRows:
    """Rows quantized to MX: ``codes`` uint8 ``[rows, n]`` (e4m3) or ``[rows, n/2]`` (two e2m1 per
    byte), each 32-value group in the kernel's group order (see the MX section above); ``scales``
    uint8 ``[rows, n/32]`` E8M0. Both contiguous."""

    codes: torch.Tensor
    scales: torch.Tensor
    activations: ActivationPolicy

    @property
    def num_cols(self) -> int:
        return self.scales.shape[1] * 32

    @classmethod
    def empty(cls, rows: int, cols: int, activations: ActivationPolicy, device: torch.device) -> MxRows:
        code_cols = cols if activations == "mxfp8" else cols // 2
        return cls(
            torch.empty((rows, code_cols), dtype=torch.uint8, device=device),
            torch.empty((rows, cols // 32), dtype=torch.uint8, device=device),
            activations,
        )


def group_order() -> list[int]:
    """Value index (inside a 32-value group) at each position of the kernel's group order."""
    from prepkit.layouts.triton_moe import FRAGMENT_ORDER

    return [FRAGMENT_ORDER[p] + 16 * t for p in range(16) for t in range(2)]


def to_mx_rows(codes: torch.Tensor, scales: torch.Tensor, activations: ActivationPolicy) -> MxRows:
    """One code per value in natural order (:func:`prepkit.kernels.activations.quantize_mx`) ->
    the kernel's :class:`MxRows` (group order; e2m1 packed two per byte, low nibble first)."""
    order = torch.tensor(group_order(), device=codes.device)
    stored = codes.unflatten(-1, (-1, 32))[..., order].flatten(-2)
    if activations == "mxfp4":
        stored = stored[..., 0::2] | (stored[..., 1::2] << 4)
    return MxRows(stored.contiguous(), scales.contiguous(), activations)


def from_mx_rows(rows: MxRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_mx_rows`: (codes one per value in natural order, scales)."""
    stored = rows.codes
    if rows.activations == "mxfp4":
        stored = torch.stack((stored & 0xF, stored >> 4), dim=-1).flatten(-2)
    inverse = torch.argsort(torch.tensor(group_order(), device=stored.device))
    return stored.unflatten(-1, (-1, 32))[..., inverse].flatten(-2), rows.scales


@dataclass
class Routing:
    """Routing and grouping of one call: what both GEMMs read. ``out`` is zeroed fp32 ``[T, H]``;
    ``x_mx`` holds the token rows quantized for GEMM1 when ``activations`` is not bf16."""

    num_tokens: int
    top_k: int
    num_local_experts: int
    counts: torch.Tensor  # [E_local] int32 rows per local expert
    sorted_picks: torch.Tensor  # [T*k] int32 pick index (token*k + slot), grouped by expert
    topk_ids: torch.Tensor  # [T, k] int32 global expert ids, largest logit first
    topk_weights: torch.Tensor  # [T, k] fp32 softmax over the k picks
    out: torch.Tensor  # [T, H] fp32
    activations: ActivationPolicy = "bf16"
    x_mx: MxRows | None = None

    @property
    def num_picks(self) -> int:
        return self.num_tokens * self.top_k


def route(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    expert_lo: int,
    num_local_experts: int,
    hidden: int,
    out: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    activations: ActivationPolicy = "bf16",
) -> Routing:
    """Launch routing (top-k, softmax, counters, output zeroing) and grouping; with an MX
    ``activations`` policy the same launch quantizes ``hidden_states`` (contiguous bf16
    ``[T, hidden]``) into ``Routing.x_mx``."""
    T, E_total = router_logits.shape
    device = router_logits.device
    if router_logits.stride(1) != 1:
        raise ValueError("router_logits must be contiguous in its last dim")
    act = _ACT_IDS[check_policy(activations)]
    x_mx = None
    if act:
        if hidden_states is None or tuple(hidden_states.shape) != (T, hidden) or not hidden_states.is_contiguous():
            got = None if hidden_states is None else list(hidden_states.shape)
            raise ValueError(f"activations {activations!r} need contiguous hidden_states [{T}, {hidden}], got {got}")
        if hidden % 32:
            raise ValueError(f"activations {activations!r} need hidden a multiple of 32, got {hidden}")
        x_mx = MxRows.empty(max(T, 1), hidden, activations, device)
    TK = T * top_k
    if out is None:
        out = torch.empty((T, hidden), dtype=torch.float32, device=device)
    e_pad_all = max(16, _next_pow2(E_total))
    e_pad_local = max(16, _next_pow2(num_local_experts))
    # Up to 32 tokens (128 experts) one program routes them all and groups the picks itself.
    block_t = max(1, min(32, 4096 // e_pad_all, _next_pow2(T)))
    programs = triton.cdiv(T, block_t)
    # Counters start at zero for the atomics of several programs; one program writes them whole.
    counts = (torch.empty if programs == 1 else torch.zeros)(num_local_experts, dtype=torch.int32, device=device)
    topk_ids = torch.empty((T, top_k), dtype=torch.int32, device=device)
    topk_w = torch.empty((T, top_k), dtype=torch.float32, device=device)
    rank = torch.empty((T, top_k), dtype=torch.int32, device=device)
    sorted_picks = torch.empty(max(TK, 1), dtype=torch.int32, device=device)
    routing = Routing(T, top_k, num_local_experts, counts, sorted_picks, topk_ids, topk_w, out, activations, x_mx)
    if T == 0:
        return routing
    block_h = 128
    picks_per_program = block_t * _next_pow2(top_k)
    _route_kernel[(programs, max(1, triton.cdiv(hidden, block_h)))](
        router_logits,
        topk_ids,
        topk_w,
        rank,
        counts,
        sorted_picks,
        out,
        T,
        E_total,
        hidden,
        router_logits.stride(0),
        out.stride(0),
        expert_lo,
        num_local_experts,
        hidden_states if act else None,
        x_mx.codes if act else None,
        x_mx.scales if act else None,
        TOP_K=top_k,
        BLOCK_T=block_t,
        E_PAD=e_pad_all,
        BLOCK_H=block_h,
        E_LOCAL_PAD=e_pad_local,
        TOPK_PAD=_next_pow2(top_k),
        PLACE=programs == 1,  # one launch fewer for few tokens
        ACT=act,
        **_chain_launch(device),
        # Grouping 128 picks in one program compares every pair: more warps for more picks.
        num_warps=4 if picks_per_program <= 32 else 8 if picks_per_program <= 64 else 16,
    )
    if programs > 1:
        scatter_block = 128
        _scatter_kernel[(triton.cdiv(TK, scatter_block),)](
            topk_ids,
            rank,
            counts,
            sorted_picks,
            TK,
            expert_lo,
            num_local_experts,
            E_PAD=e_pad_local,
            BLOCK=scatter_block,
            **_chain_launch(device),
        )
    return routing


def gemm1_swiglu(
    routing: Routing,
    hidden_states: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_bias: torch.Tensor,
    *,
    valid_intermediate: int,
    tactic: GemmTactic,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    small_scales: bool = False,
    activations: ActivationPolicy = "bf16",
) -> torch.Tensor | MxRows:
    """GEMM1 + SwiGLU: bf16 ``[T*k, valid_intermediate]`` activations in grouped order, or with
    an MX policy the same rows quantized (:class:`MxRows`; GEMM1 then reads ``routing.x_mx``, so
    the routing must have been made with the same policy). ``small_scales``: see :func:`upcast_id`."""
    act = _ACT_IDS[check_policy(activations)]
    _check_tactic(tactic, "gemm1", activations)
    if routing.activations != activations:
        raise ValueError(f"gemm1 runs activations {activations!r}, the routing quantized for {routing.activations!r}")
    if tactic.split_k != 1:
        raise ValueError("gemm1 cannot split K: the fused SwiGLU needs complete sums")
    T, H = hidden_states.shape
    _check_panels(w13_blocks, H, "w13_blocks")
    if w13_scales.shape[1] * 32 != H:
        raise ValueError(f"w13 is for hidden {w13_scales.shape[1] * 32}, activations have {H}")
    if hidden_states.stride(1) != 1:
        raise ValueError("hidden_states must be contiguous in its last dim")
    TK = routing.num_picks
    device = hidden_states.device
    if act:
        if valid_intermediate % 32:
            raise ValueError(f"activations {activations!r} need valid_intermediate a multiple of 32")
        h1: torch.Tensor | MxRows = MxRows.empty(max(TK, 1), valid_intermediate, activations, device)
    else:
        h1 = torch.empty((max(TK, 1), valid_intermediate), dtype=torch.bfloat16, device=device)
    if TK == 0:
        return h1
    E_local = routing.num_local_experts
    n1 = 2 * valid_intermediate
    grid = (max_row_blocks(TK, E_local, tactic.block_m), triton.cdiv(n1, tactic.block_n))
    w_desc = weight_descriptor(w13_blocks, tactic, activations)
    x_in = routing.x_mx.codes if act else hidden_states
    _gemm1_swiglu_kernel[grid](
        x_in,
        w13_blocks,
        w13_blocks if w_desc is None else w_desc,
        w13_scales,
        w13_bias,
        routing.counts,
        routing.sorted_picks,
        h1.codes if act else h1,
        routing.x_mx.scales if act else None,
        h1.scales if act else None,
        n1,
        H,
        E_local,
        x_in.stride(0),
        w13_blocks.stride(0),
        w13_scales.stride(0),
        w13_scales.stride(1),
        w13_bias.stride(0),
        h1.codes.stride(0) if act else h1.stride(0),
        w13_blocks.shape[2],
        w13_blocks.shape[1],
        swiglu_alpha,
        swiglu_limit,
        TOP_K=routing.top_k,
        E_PAD=max(16, _next_pow2(E_local)),
        BLOCK_M=tactic.block_m,
        BLOCK_N=tactic.block_n,
        BLOCK_K=tactic.block_k,
        UPCAST=upcast_id(tactic, small_scales),
        DOT_FP32=_interpreting(),
        SWAP=swaps_operands(tactic, activations),
        JOIN=joins_halves(tactic),
        W_TMA=w_desc is not None,
        MASK_ALL=tactic.k_loop == "masked",
        PANEL_K=PANEL_K,
        ACT=act,
        **_chain_launch(device),
        num_warps=tactic.num_warps,
        num_stages=tactic.num_stages,
    )
    return h1


def gemm2_combine(
    routing: Routing,
    h1: torch.Tensor | MxRows,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor | None,
    *,
    tactic: GemmTactic,
    small_scales: bool = False,
    activations: ActivationPolicy = "bf16",
) -> torch.Tensor:
    """GEMM2 + bias + routing weight + sum over picks, accumulated into ``routing.out``. ``h1``
    is what :func:`gemm1_swiglu` returned for the same ``activations``. ``small_scales``: see
    :func:`upcast_id`."""
    act = _ACT_IDS[check_policy(activations)]
    _check_tactic(tactic, "gemm2", activations)
    if isinstance(h1, MxRows) != bool(act) or (act and h1.activations != activations):
        got = h1.activations if isinstance(h1, MxRows) else "bf16"
        raise ValueError(f"gemm2 runs activations {activations!r}, h1 holds {got!r} rows")
    out = routing.out
    TK = routing.num_picks
    if TK == 0:
        return out
    H = out.shape[1]
    K = h1.num_cols if isinstance(h1, MxRows) else h1.shape[1]
    _check_panels(w2_blocks, K, "w2_blocks")
    if w2_blocks.shape[2] != H:
        raise ValueError(f"w2 is for hidden {w2_blocks.shape[2]}, the output has {H}")
    E_local = routing.num_local_experts
    has_bias = w2_bias is not None
    grid = (max_row_blocks(TK, E_local, tactic.block_m), triton.cdiv(H, tactic.block_n), tactic.split_k)
    w_desc = weight_descriptor(w2_blocks, tactic, activations)
    h_in = h1.codes if isinstance(h1, MxRows) else h1
    _gemm2_combine_kernel[grid](
        h_in,
        w2_blocks,
        w2_blocks if w_desc is None else w_desc,
        w2_scales,
        w2_bias if has_bias else out,
        routing.counts,
        routing.sorted_picks,
        routing.topk_weights,
        out,
        h1.scales if isinstance(h1, MxRows) else None,
        H,
        K,
        E_local,
        h_in.stride(0),
        w2_blocks.stride(0),
        w2_scales.stride(0),
        w2_scales.stride(1),
        w2_bias.stride(0) if has_bias else 0,
        out.stride(0),
        w2_blocks.shape[2],
        w2_blocks.shape[1],
        TOP_K=routing.top_k,
        E_PAD=max(16, _next_pow2(E_local)),
        BLOCK_M=tactic.block_m,
        BLOCK_N=tactic.block_n,
        BLOCK_K=tactic.block_k,
        SPLIT_K=tactic.split_k,
        UPCAST=upcast_id(tactic, small_scales),
        DOT_FP32=_interpreting(),
        SWAP=swaps_operands(tactic, activations),
        JOIN=joins_halves(tactic),
        HAS_BIAS=has_bias,
        W_TMA=w_desc is not None,
        MASK_ALL=tactic.k_loop == "masked",
        PANEL_K=PANEL_K,
        ACT=act,
        **_chain_launch(out.device),
        num_warps=tactic.num_warps,
        num_stages=tactic.num_stages,
    )
    return out


def fused_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_bias: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor | None,
    *,
    top_k: int,
    expert_lo: int,
    valid_intermediate: int,
    gemm1: GemmTactic,
    gemm2: GemmTactic,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    out: torch.Tensor | None = None,
    small_scales: tuple[bool, bool] = (False, False),
    activations: ActivationPolicy = "bf16",
) -> torch.Tensor:
    """One MoE layer for this rank's experts. Returns the fp32 ``[T, H]`` sum over the token's picks
    that live on this rank (``out`` if given). ``w2_bias=None`` skips the down bias (TP ranks but
    one). Shapes as in the module docstring; ``router_logits`` is ``[T, E_total]`` over all experts.
    ``small_scales``: (w13, w2), see :func:`upcast_id`. ``activations``: the precision policy
    (module docstring); the tactics must be valid for it
    (:func:`prepkit.kernels.variants.invalid_reason`, :func:`~prepkit.kernels.variants.policy_variant`).
    """
    T, H = hidden_states.shape
    if router_logits.shape[0] != T:
        raise ValueError(f"router_logits has {router_logits.shape[0]} rows, hidden_states {T}")
    routing = route(
        router_logits,
        top_k=top_k,
        expert_lo=expert_lo,
        num_local_experts=w13_blocks.shape[0],
        hidden=H,
        out=out,
        hidden_states=hidden_states,
        activations=activations,
    )
    h1 = gemm1_swiglu(
        routing,
        hidden_states,
        w13_blocks,
        w13_scales,
        w13_bias,
        valid_intermediate=valid_intermediate,
        tactic=gemm1,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
        small_scales=small_scales[0],
        activations=activations,
    )
    return gemm2_combine(
        routing, h1, w2_blocks, w2_scales, w2_bias, tactic=gemm2, small_scales=small_scales[1], activations=activations
    )
