"""The decode step's two collectives, over all ranks of the launch: ``all_reduce`` (sum) of the
partial outputs of the o-projection and the MoE, and ``gather`` of the vocabulary slices of the
logits. On CUDA the sum runs on symmetric memory (one-shot) when it can, else NCCL; on the CPU,
gloo. Both are plain tensor-in, tensor-out calls that a CUDA graph can capture."""

from __future__ import annotations

from typing import Any, Literal

import torch

from prepkit.distributed.symmetric import SymmetricAllReduce, try_symmetric

Transport = Literal["symmetric", "nccl", "gloo"]


class Collectives:
    """Sum and vocabulary gather over ``group`` (the default group when None)."""

    def __init__(
        self,
        device: torch.device,
        group: Any = None,
        *,
        dtype: torch.dtype = torch.bfloat16,
        symmetric: bool = True,
    ) -> None:
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device
        self._symmetric: SymmetricAllReduce | None = None
        if device.type == "cuda" and symmetric and self.world_size > 1:
            self._symmetric = try_symmetric(self.group, device, dtype)

    @property
    def transport(self) -> Transport:
        """How ``all_reduce`` moves the data (for reports)."""
        if self._symmetric is not None:
            return "symmetric"
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, as a tensor of ``x``'s shape and dtype."""
        import torch.distributed as dist

        if self.world_size == 1:
            return x
        if self._symmetric is not None and self._symmetric.fits(x):
            return self._symmetric(x)
        out = x.contiguous()
        dist.all_reduce(out, group=self.group)
        return out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's slice of the last dim (the vocabulary), joined in rank order on every rank:
        ``[..., V/world]`` -> ``[..., V]``."""
        import torch.distributed as dist

        if self.world_size == 1:
            return x
        local = x.contiguous()
        if self.device.type == "cuda":
            stacked = torch.empty((self.world_size, *local.shape), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(stacked, local, group=self.group)
            parts = list(stacked.unbind(0))
        else:
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)
