"""The one-kernel all-reduce (:mod:`prepkit.kernels.allreduce`) over buffers every rank maps: on
CUDA, torch symmetric memory rendezvoused once at load; in tests, CPU tensors shared between
processes. A call copies nothing into a staging buffer and waits on no flag, so a captured step
holds one launch per sum."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton

from prepkit.kernels.allreduce import EMPTY_BITS, MAX_RANKS, SLOTS, _all_reduce_kernel
from prepkit.kernels.mx._chain import chain_launch

# Values a call may sum: a decode step's rows (up to 8 rows of 2,880) and room to spare; larger
# sums (prefill chunks) take the caller's other path.
DEFAULT_MAX_NUMEL = 1 << 15
BLOCK = 1024


def empty_buffer(world: int, max_numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A rank's buffer, every value the empty mark: ``SLOTS x world`` rows of ``max_numel`` fp32."""
    marks = torch.full((SLOTS * world * max_numel,), EMPTY_BITS - (1 << 32), dtype=torch.int32, device=device)
    return marks.view(torch.float32)


class LamportAllReduce:
    """Sums over ``world`` ranks through ``buffers`` (rank order; each from :func:`empty_buffer`,
    or mapped from a peer), this rank's being ``buffers[rank]``. ``epoch`` and ``count``: this
    rank's two int32 counters, zero before the first call."""

    def __init__(
        self,
        rank: int,
        buffers: Sequence[torch.Tensor],
        max_numel: int,
        epoch: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
    ) -> None:
        world = len(buffers)
        if not 1 <= world <= MAX_RANKS:
            raise ValueError(f"all-reduce: {world} ranks, expected 1..{MAX_RANKS}")
        if not 0 <= rank < world:
            raise ValueError(f"all-reduce: rank {rank} of {world}")
        for i, b in enumerate(buffers):
            if b.dtype != torch.float32 or b.numel() < SLOTS * world * max_numel:
                raise ValueError(
                    f"all-reduce: buffer of rank {i} holds {b.numel()} {b.dtype} values, "
                    f"expected {SLOTS * world * max_numel} float32"
                )
        own = buffers[rank]
        self.rank, self.world, self.max_numel = rank, world, max_numel
        self.buffers = list(buffers)
        # The kernel takes MAX_RANKS buffers; those past the world are this rank's, never read.
        self._peers = self.buffers + [own] * (MAX_RANKS - world)
        self.epoch = epoch if epoch is not None else torch.zeros(1, dtype=torch.int32, device=own.device)
        self.count = count if count is not None else torch.zeros(1, dtype=torch.int32, device=own.device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.max_numel and x.device == self.buffers[self.rank].device

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in rank order (the same bits on every rank), as
        ``out_dtype`` (``x``'s by default). Every rank must call with the same shape."""
        if not self.fits(x):
            raise ValueError(f"all-reduce: {x.numel()} values on {x.device}, room for {self.max_numel}")
        src = x.contiguous()
        out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
        grid = (triton.cdiv(src.numel(), BLOCK),)
        _all_reduce_kernel[grid](
            src, out, self.buffers[self.rank], *self._peers, self.epoch, self.count,
            self.rank, src.numel(), self.max_numel,
            WORLD=self.world, BLOCK=BLOCK, num_warps=4, **chain_launch(x.device),
        )  # fmt: skip
        return out


def rendezvous_lamport(group: Any, device: torch.device, max_numel: int = DEFAULT_MAX_NUMEL) -> LamportAllReduce:
    """Allocate this rank's buffer in symmetric memory, map every peer's (a collective: every rank,
    once), mark them empty, wait for all ranks to have done so, and sum once (the kernel loaded).

    Raises:
        RuntimeError, ImportError, AttributeError: this torch or these GPUs cannot map each other's memory.
    """
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed before 2.9, a no-op after
        enable(group.group_name)
    numel = SLOTS * world * max_numel
    own = symm_mem.empty(numel, dtype=torch.float32, device=device)
    handle = symm_mem.rendezvous(own, group)
    own.copy_(empty_buffer(world, max_numel, device))
    buffers = [own if r == rank else handle.get_buffer(r, (numel,), torch.float32) for r in range(world)]
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    summed = LamportAllReduce(rank, buffers, max_numel)
    # One sum now: the kernel compiles and loads here, never first inside a graph's capture.
    summed(torch.zeros(1, device=device))
    torch.cuda.synchronize(device)
    return summed
