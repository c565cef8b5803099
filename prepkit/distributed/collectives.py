"""The decode step's two collectives, over all ranks of the launch: ``all_reduce`` (sum) of the
partial outputs of the o-projection and the MoE, and ``gather`` of the vocabulary slices of the
logits. On CUDA the sum runs on symmetric memory when it can (torch's one-shot op, or with
``PREPKIT_ALL_REDUCE=lamport`` the project's one-kernel sum, :mod:`prepkit.distributed.lamport`),
else NCCL; on the CPU, gloo. Both are plain tensor-in, tensor-out calls that a CUDA graph can
capture."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

import torch

from prepkit.distributed.symmetric import SymmetricAllReduce, try_symmetric
from prepkit.errors import LaunchError

if TYPE_CHECKING:
    from prepkit.distributed.lamport import LamportAllReduce

Transport = Literal["symmetric", "lamport", "nccl", "gloo"]
ALL_REDUCE_ENV = "PREPKIT_ALL_REDUCE"
# The sums a CUDA launch on one host can take, the first being the default.
ALL_REDUCE_KINDS: tuple[str, ...] = ("symmetric", "lamport", "nccl")


def all_reduce_kind() -> str:
    """The sum ``PREPKIT_ALL_REDUCE`` asks for (``symmetric`` when unset).

    Raises:
        LaunchError: a value that is none of :data:`ALL_REDUCE_KINDS`.
    """
    kind = os.environ.get(ALL_REDUCE_ENV, "") or ALL_REDUCE_KINDS[0]
    if kind not in ALL_REDUCE_KINDS:
        raise LaunchError(f"{ALL_REDUCE_ENV}={kind!r}: expected one of {', '.join(ALL_REDUCE_KINDS)}")
    return kind


class Collectives:
    """Sum and vocabulary gather over ``group`` (the default group when None). ``symmetric``:
    whether the ranks may map each other's memory (one host); ``kind``: which sum to use there
    (:func:`all_reduce_kind` when None)."""

    def __init__(
        self,
        device: torch.device,
        group: Any = None,
        *,
        dtype: torch.dtype = torch.bfloat16,
        symmetric: bool = True,
        kind: str | None = None,
    ) -> None:
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device
        self._symmetric: SymmetricAllReduce | None = None
        self._lamport: LamportAllReduce | None = None
        kind = kind or all_reduce_kind()
        if device.type == "cuda" and symmetric and self.world_size > 1:
            if kind == "symmetric":
                self._symmetric = try_symmetric(self.group, device, dtype)
            elif kind == "lamport":
                from prepkit.distributed.lamport import rendezvous_lamport  # a Triton kernel: imported when asked for

                try:
                    self._lamport = rendezvous_lamport(self.group, device)
                except (ImportError, RuntimeError, AttributeError, TypeError) as err:
                    raise LaunchError(
                        f"{ALL_REDUCE_ENV}=lamport: the GPUs cannot map each other's memory ({err})",
                        hint=f"unset {ALL_REDUCE_ENV} to sum with torch's one-shot op or NCCL",
                    ) from err

    @property
    def transport(self) -> Transport:
        """How ``all_reduce`` moves the data (for reports)."""
        if self._symmetric is not None:
            return "symmetric"
        if self._lamport is not None:
            return "lamport"
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, as a tensor of ``x``'s shape and dtype."""
        import torch.distributed as dist

        if self.world_size == 1:
            return x
        if self._symmetric is not None and self._symmetric.fits(x):
            return self._symmetric(x)
        if self._lamport is not None and self._lamport.fits(x):
            return self._lamport(x)
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
