"""K splits of one GEMM tile: each split's share of K, and the reduction of the splits' partial
sums inside the same launch. Each split stores its fp32 partial sums; the last of the tile's
splits to arrive adds them up in split order (so the sum does not depend on which split came
last) and resets the tile's counter for the next call: no zeroed buffer, no launch after."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _split_range(K, pid_k, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """``[k_lo, k_hi)`` of split ``pid_k``: boundaries on BLOCK_K multiples keep every scale group
    inside one split (a split past the end of K gets an empty range)."""
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    return k_lo, tl.minimum(k_lo + k_per_split, K)


@triton.jit
def _split_sum(
    acc, part_ptr, rows, m_mask, offs_n, n_mask, pid_k, T, N, count_ptr, tile, SWAP: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Store split ``pid_k``'s partial sums ``acc`` (``[BN, BM]`` when SWAP) into ``part``
    (``[SPLIT_K, T, N]`` fp32) and arrive at ``count_ptr[tile]`` (zero between calls). Returns
    ``(last, sums)``: whether this program is the tile's last split, and then the tile's sums over
    every split (its own partials otherwise)."""
    if SWAP:
        part = part_ptr + rows[None, :] * N + offs_n[:, None]
        mask = m_mask[None, :] & n_mask[:, None]
    else:
        part = part_ptr + rows[:, None] * N + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    split_stride = (pid_k.to(tl.int64) * 0 + T) * N  # T may be a specialized constant
    tl.store(part + pid_k * split_stride, acc, mask=mask)
    tl.debug_barrier()  # every thread's partials issued before the release below
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    sums = acc
    if last:
        sums = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            sums += tl.load(part + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0)
    return last, sums
