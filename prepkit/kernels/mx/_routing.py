"""Routing and grouping: top-k of the router logits with the softmax over the picks, the per-expert
counters, and the grouping of the picks by expert (launches 1 and 2 of the layer); how a GEMM
program finds its expert and rows from the counters alone; and, for one token, how a GEMM program
finds its pick from the logits themselves (no routing launch)."""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._chain import _chain_enter
from prepkit.kernels.mx._mx import ACT_BF16, _store_mx


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
    if ACT != ACT_BF16:
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


@triton.jit
def _one_token_pick(
    logits_ptr,
    topk_ids_ptr,
    topk_w_ptr,
    pid_m,
    store,
    E,
    E_LO,
    E_LOCAL,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PICK_COPIES: tl.constexpr,
):
    """Row block ``pid_m`` of one token's picks, one pick a block, in pick order: (valid, local
    expert as int64, rows, row mask, pick index, token index), as :func:`_row_block` gives them.
    The picks and weights are those of ``_route_kernel`` (the same operations in the same order,
    so the same bits); with ``store`` the program writes its pick's expert and weight.
    ``PICK_COPIES``: the launch's warps (another count gives the same picks, through shared memory)."""
    # Every warp holds the whole row (one copy a row of the tile): the top-4's reductions stay
    # inside a warp, in shuffles; only taking copy 0 at the end crosses warps.
    copies = tl.arange(0, PICK_COPIES)
    offs_e = tl.arange(0, E_PAD)[None, :] + copies[:, None] * 0
    work = tl.load(logits_ptr + offs_e, mask=offs_e < E, other=float("-inf")).to(tl.float32)
    row_max = tl.max(work, axis=1)
    denom = tl.zeros([PICK_COPIES], dtype=tl.float32)
    expert = tl.zeros([PICK_COPIES], dtype=tl.int32)
    mine = tl.zeros([PICK_COPIES], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        m = tl.max(work, axis=1)
        idx = tl.min(tl.where(work == m[:, None], offs_e, E_PAD), axis=1)
        denom += tl.exp(m - row_max)
        expert = tl.where(pid_m == j, idx, expert)
        mine = tl.where(pid_m == j, m, mine)
        work = tl.where(offs_e == idx[:, None], float("-inf"), work)
    # The copies agree; copy 0's values as scalars.
    expert = tl.sum(tl.where(copies == 0, expert, 0), axis=0)
    weight = tl.sum(tl.where(copies == 0, tl.exp(mine - row_max) / denom, 0.0), axis=0)
    is_pick = pid_m < TOP_K
    tl.store(topk_ids_ptr + pid_m, expert, mask=store & is_pick)
    tl.store(topk_w_ptr + pid_m, weight, mask=store & is_pick)
    return _pick_block(pid_m, is_pick, expert - E_LO, E_LOCAL, BLOCK_M)


@triton.jit
def _one_token_block(topk_ids_ptr, pid_m, E_LO, E_LOCAL, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """:func:`_one_token_pick` for GEMM2, from the picks GEMM1's programs stored."""
    is_pick = pid_m < TOP_K
    local = tl.load(topk_ids_ptr + pid_m, mask=is_pick, other=-1) - E_LO
    return _pick_block(pid_m, is_pick, local, E_LOCAL, BLOCK_M)


@triton.jit
def _pick_block(pid_m, is_pick, local, E_LOCAL, BLOCK_M: tl.constexpr):
    """Pick ``pid_m`` of one token (of local expert ``local``) as a row block of one row, in
    :func:`_row_block`'s terms; not valid past the picks or for another rank's expert."""
    valid = is_pick & (local >= 0) & (local < E_LOCAL)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < tl.where(valid, 1, 0)  # the pick's one row
    rows = (pid_m + offs_m).to(tl.int64)
    return valid, local.to(tl.int64), rows, m_mask, pid_m + offs_m * 0, (offs_m * 0).to(tl.int64)
