"""The Triton kernel of the decode step's attention: rotary on the token's query and key, the key
and value written into the cache, and attention over the cache slots in use, in one launch.

One program per (row, kv head, split): it handles the ``GROUP`` query heads that share the kv head
(padded to ``GROUP_PAD`` >= 16 rows, the matrix instructions' smallest tile), so each cache slot is
read once for the whole group. The token's own slot is never read back from memory: the program
that writes it (split 0) folds the rotated key and the value from its registers into the softmax,
and the loop covers the slots before it, ``[lo, position)``. With ``SPLIT`` > 1 the slots are cut
into ``SPLIT`` ranges (flash-decoding); each program stores its partial softmax state and the last
one of its (row, kv head) to arrive combines them, in this same launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._chain import _chain_enter

# exp(x) = exp2(x * log2(e)): the softmax runs in base 2, the scores and sinks scaled once.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _round_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as fp32. Spelled in integer bits
    because the CPU interpreter's cast truncates; a GPU's cast rounds the same."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rotate(x, partner, cos, sin, sign):
    """gpt-oss's rotary on halves for a row read twice (``partner``: the other half's element at
    each column; ``sign``: -1 on the first half), rounded to bf16 after each product and after the
    sum as the eager bf16 tensors are."""
    return _round_bf16(_round_bf16(x * cos) + sign * _round_bf16(partner * sin)).to(tl.bfloat16)


@triton.jit
def _rope_cache_attend_kernel(
    qkv_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, pos_ptr, pad_ptr, sinks_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr, count_ptr,
    stride_qkv, stride_cos, stride_sin,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_out,
    window, n_slots, scale_log2,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    _chain_enter(PDL)  # before anything is read: the step's previous kernel may still run
    GROUP: tl.constexpr = HQ // HKV
    HALF: tl.constexpr = D // 2
    pid = tl.program_id(0)  # row * HKV + kv head
    split = tl.program_id(1)
    b = pid // HKV
    kvh = pid % HKV

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < GROUP
    partner = (offs_d + HALF) % D
    sign = tl.where(offs_d < HALF, -1.0, 1.0)[None, :]
    cos = tl.load(cos_ptr + b * stride_cos + offs_d % HALF).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + b * stride_sin + offs_d % HALF).to(tl.float32)[None, :]

    # The token's query heads of this group, its key and its value, rotated in registers.
    row = qkv_ptr + b.to(tl.int64) * stride_qkv
    heads = kvh * GROUP + offs_g
    q_row = row + heads[:, None] * D
    q_x = tl.load(q_row + offs_d[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    q_p = tl.load(q_row + partner[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    q = _rotate(q_x, q_p, cos, sin, sign)  # [GROUP_PAD, D] bf16
    k_row = row + (HQ + kvh) * D
    k_x = tl.load(k_row + offs_d[None, :]).to(tl.float32)
    k_p = tl.load(k_row + partner[None, :]).to(tl.float32)
    k_cur = _rotate(k_x, k_p, cos, sin, sign)  # [1, D] bf16
    v_cur = tl.load(row + (HQ + HKV + kvh) * D + offs_d[None, :])  # [1, D] bf16

    pos = tl.load(pos_ptr).to(tl.int32)
    k_base = keys_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = values_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    # A position past the cache (a caller's bug the host cannot see) writes and reads nothing out of bounds.
    if (split == 0) & (pos < n_slots):
        tl.store(k_base + pos * stride_kl + offs_d[None, :], k_cur)
        tl.store(v_base + pos * stride_vl + offs_d[None, :], v_cur)

    lo = tl.load(pad_ptr + b).to(tl.int32)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    # The softmax state starts from the token's own slot (split 0, when the slot is not masked:
    # a row padded past ``position`` attends to the sink alone).
    own = (split == 0) & (pos >= lo)
    s_cur = tl.sum(q.to(tl.float32) * k_cur.to(tl.float32), axis=1) * scale_log2
    m = tl.where(own, s_cur, float("-inf"))
    l_sum = tl.where(own, 1.0, 0.0) + tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.where(own, 1.0, 0.0) * v_cur.to(tl.float32) + tl.zeros([GROUP_PAD, D], dtype=tl.float32)

    # This split's share of the slots before the token, whole blocks each.
    hi = tl.minimum(pos, n_slots)
    used = tl.maximum(hi - lo, 0)
    share = tl.cdiv(tl.cdiv(used, SPLIT), BLOCK_N) * BLOCK_N
    start = lo + split * share
    end = tl.minimum(start + share, hi)
    q_dot = q.to(tl.float32) if DOT_FP32 else q
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * stride_kl + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vl + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q_dot, tl.trans(k)) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        # The probabilities in the values' dtype, as the eager ones are cast.
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(_round_bf16(p), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m = m_new

    sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * LOG2E
    out_ptrs = out_ptr + b.to(tl.int64) * stride_out + heads[:, None] * D + offs_d[None, :]
    if SPLIT == 1:
        top = tl.maximum(m, sink)
        keep = tl.exp2(m - top)
        total = l_sum * keep + tl.exp2(sink - top)
        tl.store(out_ptrs, _round_bf16(acc * (keep / total)[:, None]).to(tl.bfloat16), mask=g_mask[:, None])
    else:
        state = pid * SPLIT + split
        tile = offs_g[:, None] * D + offs_d[None, :]
        tl.store(part_acc_ptr + state * (GROUP_PAD * D) + tile, acc)
        tl.store(part_ml_ptr + state * (2 * GROUP_PAD) + offs_g, m)
        tl.store(part_ml_ptr + state * (2 * GROUP_PAD) + GROUP_PAD + offs_g, l_sum)
        tl.debug_barrier()  # every thread's partials issued before the release below
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            # The last of the row's splits: combine every split's state with the sink, then
            # reset the counter for the next call (no zeroing launch).
            first = pid * SPLIT
            top = sink
            for s_i in tl.static_range(SPLIT):
                m_i = tl.load(part_ml_ptr + (first + s_i) * (2 * GROUP_PAD) + offs_g, cache_modifier=".cg")
                top = tl.maximum(top, m_i)
            total = tl.exp2(sink - top)
            out = tl.zeros([GROUP_PAD, D], dtype=tl.float32)
            for s_i in tl.static_range(SPLIT):
                ml = part_ml_ptr + (first + s_i) * (2 * GROUP_PAD)
                m_i = tl.load(ml + offs_g, cache_modifier=".cg")
                l_i = tl.load(ml + GROUP_PAD + offs_g, cache_modifier=".cg")
                a_i = tl.load(part_acc_ptr + (first + s_i) * (GROUP_PAD * D) + tile, cache_modifier=".cg")
                w = tl.exp2(m_i - top)
                total += l_i * w
                out += a_i * w[:, None]
            tl.store(out_ptrs, _round_bf16(out / total[:, None]).to(tl.bfloat16), mask=g_mask[:, None])
            tl.atomic_xchg(count_ptr + pid, 0)
