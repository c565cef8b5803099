"""The decode step's two collectives, over all ranks of the launch: ``all_reduce`` (sum) of the
partial outputs of the o-projection and the MoE, and ``gather`` of the vocabulary slices of the
logits. On CUDA the sum runs on symmetric memory when it can: by default the project's one-kernel
sum (:mod:`prepkit.distributed.lamport`), else torch's one-shot op, else NCCL; on the CPU, gloo.
Both are plain tensor-in, tensor-out calls that a CUDA graph can capture."""

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
# The sums a CUDA launch on one host can take, in the order tried when the variable is unset: each
# where the GPUs cannot map each other's memory gives way to the next.
ALL_REDUCE_KINDS: tuple[str, ...] = ("lamport", "symmetric", "nccl")


def all_reduce_kind() -> str | None:
    """The sum ``PREPKIT_ALL_REDUCE`` names, or None when it is unset (the first of
    :data:`ALL_REDUCE_KINDS` that the GPUs can run).

    Raises:
        LaunchError: a value that is none of :data:`ALL_REDUCE_KINDS`.
    """
    kind = os.environ.get(ALL_REDUCE_ENV, "")
    if not kind:
        return None
    if kind not in ALL_REDUCE_KINDS:
        raise LaunchError(f"{ALL_REDUCE_ENV}={kind!r}: expected one of {', '.join(ALL_REDUCE_KINDS)}")
    return kind


def _cannot_map(kind: str, err: Exception | None) -> LaunchError:
    why = f" ({err})" if err is not None else ""
    return LaunchError(
        f"{ALL_REDUCE_ENV}={kind}: the GPUs cannot map each other's memory{why}",
        hint=f"unset {ALL_REDUCE_ENV} to take the first sum these GPUs can run",
    )


class Collectives:
    """Sum and vocabulary gather over ``group`` (the default group when None). ``symmetric``:
    whether the ranks may map each other's memory (one host); ``kind``: the sum to use there
    (:func:`all_reduce_kind` when None; None tries :data:`ALL_REDUCE_KINDS` in order, a named one
    that the GPUs cannot run is a LaunchError)."""

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
        named = kind or all_reduce_kind()
        if device.type != "cuda" or not symmetric or self.world_size == 1:
            return
        # Every rank tries the same kinds in the same order: each try is a collective.
        for candidate in (named,) if named else ALL_REDUCE_KINDS:
            if candidate == "lamport":
                self._lamport = self._try_lamport(loud=named == "lamport")
            elif candidate == "symmetric":
                self._symmetric = try_symmetric(self.group, device, dtype)
                if self._symmetric is None and named:
                    raise _cannot_map(candidate, None)
            if candidate == "nccl" or self._lamport is not None or self._symmetric is not None:
                return

    def _try_lamport(self, *, loud: bool) -> LamportAllReduce | None:
        """The one-kernel sum's buffers mapped, or None (a LaunchError when ``loud``) where the
        GPUs cannot map each other's memory."""
        try:
            from prepkit.distributed.lamport import rendezvous_lamport  # a Triton kernel: imported when used

            return rendezvous_lamport(self.group, self.device)
        except (ImportError, RuntimeError, AttributeError, TypeError) as err:
            if loud:
                raise _cannot_map("lamport", err) from err
            return None

    @property
    def sums_fp32(self) -> bool:
        """Whether ``all_reduce`` takes fp32 shares at a bf16 share's cost (the one-kernel sum adds
        in fp32 whatever it is handed): the MoE then hands over its fp32 output uncast."""
        return self._lamport is not None

    @property
    def transport(self) -> Transport:
        """How ``all_reduce`` moves the data (for reports)."""
        if self._symmetric is not None:
            return "symmetric"
        if self._lamport is not None:
            return "lamport"
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, as a tensor of ``x``'s shape and dtype (the same bits
        on every rank)."""
        import torch.distributed as dist

        if self.world_size == 1:
            return x
        if self._symmetric is not None and self._symmetric.fits(x):
            return self._symmetric(x)
        # The one-kernel sum is the fastest in a graph and the slowest launched eagerly (Triton's
        # launch): uncaptured sums (a prompt, a warm-up step) go to NCCL.
        if self._lamport is not None and self._lamport.fits(x) and torch.cuda.is_current_stream_capturing():
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
