"""torch's symmetric-memory one-shot all-reduce: each rank reads every peer's buffer over NVLink
and sums, in one kernel; at the decode step's sizes (a few KB) it beats NCCL's ring. The buffer
is allocated and rendezvoused once; the op only copies into it, so it can be captured in a CUDA
graph. NVLink multicast is left off: the one-shot op does not use it. The kernel adds the
ranks' buffers in rank order on every rank, so all ranks get the same bits (each rank picks its
next token from its own copy of the logits)."""

from __future__ import annotations

from typing import Any

import torch

# Room for the largest reduce of a step: a prefill chunk of hidden-size rows is far above the
# decode step's rows, so anything larger takes the NCCL path.
DEFAULT_MAX_NUMEL = 1 << 20


class SymmetricAllReduce:
    """A rendezvoused bf16 buffer of ``max_numel`` values and the one-shot sum over it."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, max_numel: int = DEFAULT_MAX_NUMEL):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name: str = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before 2.9, a no-op after
            enable(self.group_name)
        self.dtype = dtype
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)  # collective: every rank, once

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buffer.numel() and x.is_cuda

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        slot = self.buffer.narrow(0, 0, x.numel()).view(x.shape)
        out: torch.Tensor = torch.ops.symm_mem.one_shot_all_reduce_copy(slot, x.contiguous(), "sum", self.group_name)
        return out


def try_symmetric(group: Any, device: torch.device, dtype: torch.dtype) -> SymmetricAllReduce | None:
    """The symmetric-memory all-reduce, or None where this torch or these GPUs cannot (no P2P
    access between them, an older torch): the caller then uses NCCL."""
    try:
        return SymmetricAllReduce(group, device, dtype)
    except (ImportError, RuntimeError, AttributeError, TypeError):
        return None
