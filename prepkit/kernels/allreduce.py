"""A one-kernel all-reduce for the decode step's few-KB sums over GPUs that map each other's memory.

Each rank writes its values straight into a slot of every rank's buffer (its own row of the slot)
and then reads its own buffer's rows until none holds the empty mark, summing them in rank order,
so that every rank gets the same bits. No flag and no barrier: a value is there once it is no
longer the mark (fp32 ``-0.0``; an input ``-0.0`` is sent as ``+0.0``, which sums the same). Each
32-bit value lands whole, so a row is ready value by value.

Two slots take turns, one per call (``epoch`` mod 2, a counter in device memory that the last
program of each call advances, so a CUDA graph's replays keep turning them). A rank empties each
value of its buffer as soon as it has read it. No rank writes that slot again before the call
after next, and no rank gets there before it has this rank's values of the next call, which this
rank sends only after this call has ended: the arrival that ends it is a release at system scope,
after the emptying.
"""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._chain import _chain_enter

SLOTS = 2
EMPTY_BITS = 0x80000000  # fp32 -0.0: the empty mark
MAX_RANKS = 8
# The same two numbers as kernel constants.
_SLOTS: tl.constexpr = tl.constexpr(SLOTS)
_EMPTY_BITS: tl.constexpr = tl.constexpr(EMPTY_BITS)


@triton.jit
def _peer(p: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7):
    """Buffer ``p`` of the eight (a compile-time choice: ``p`` is a constant)."""
    if p == 0:  # noqa: SIM116
        return b0
    elif p == 1:
        return b1
    elif p == 2:
        return b2
    elif p == 3:
        return b3
    elif p == 4:
        return b4
    elif p == 5:
        return b5
    elif p == 6:
        return b6
    else:
        return b7


@triton.jit
def _all_reduce_kernel(
    x_ptr, out_ptr, own_ptr, b0, b1, b2, b3, b4, b5, b6, b7, epoch_ptr, count_ptr,
    rank, numel, row_stride,
    WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` sums values ``[pid * BLOCK, (pid + 1) * BLOCK)`` of ``x`` over the ranks into
    ``out``. Buffers (``b0 .. b{WORLD-1}``, this rank's is ``own``): ``SLOTS x WORLD`` rows of
    ``row_stride`` fp32 values; row ``slot * WORLD + r`` holds rank ``r``'s values."""
    _chain_enter(PDL)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    epoch = tl.load(epoch_ptr)
    slot = epoch % _SLOTS
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 is the empty mark: send +0.0
    mine = (slot * WORLD + rank) * row_stride + offs
    for p in tl.static_range(WORLD):
        tl.store(_peer(p, b0, b1, b2, b3, b4, b5, b6, b7) + mine, v, mask=mask)
    empty = tl.full((BLOCK,), _EMPTY_BITS, tl.uint32).to(tl.float32, bitcast=True)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        row = own_ptr + (slot * WORLD + r) * row_stride + offs
        got = tl.load(row, mask=mask, other=0.0, volatile=True)
        while tl.sum(((got.to(tl.uint32, bitcast=True) == _EMPTY_BITS) & mask).to(tl.int32), axis=0) > 0:
            got = tl.load(row, mask=mask, other=0.0, volatile=True)
        acc += got
        tl.store(row, empty, mask=mask)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    # The last program to arrive moves the slots on for the next call.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="sys")
    if arrived == tl.num_programs(0) - 1:
        tl.store(epoch_ptr, epoch + 1)
        tl.atomic_xchg(count_ptr, 0)
