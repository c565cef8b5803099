"""What one call of the MoE layer keeps between its launches: the routing both GEMMs read
(:class:`Routing`) and the buffers a launch plan reuses call after call (:class:`Workspace`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prepkit.kernels.activations import ActivationPolicy
from prepkit.kernels.mx._mx_rows import MxRows


@dataclass
class Routing:
    """Routing and grouping of one call: what both GEMMs read. ``out`` is zeroed fp32 ``[T, H]``;
    ``x_mx`` holds the token rows quantized for GEMM1 when ``activations`` is not bf16.

    With ``logits`` (one token, :func:`~prepkit.kernels.mx.launch.routes_in_gemms`) nothing ran
    yet: GEMM1 picks the experts from these logits, writes ``topk_ids`` and ``topk_weights`` and
    zeroes ``out``, and GEMM2 reads the picks GEMM1 wrote; ``counts`` and ``sorted_picks`` are
    not used."""

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
    logits: torch.Tensor | None = None  # [1, E_total]: the GEMMs route this one token themselves
    expert_lo: int = 0  # the first local expert's global id (read with ``logits``)

    @property
    def num_picks(self) -> int:
        return self.num_tokens * self.top_k


def empty_h1(
    num_picks: int, valid_intermediate: int, activations: ActivationPolicy, device: torch.device
) -> torch.Tensor | MxRows:
    """GEMM1's output rows: bf16, or quantized to the MX policy."""
    if activations != "bf16":
        return MxRows.empty(max(num_picks, 1), valid_intermediate, activations, device)
    return torch.empty((max(num_picks, 1), valid_intermediate), dtype=torch.bfloat16, device=device)


@dataclass
class Workspace:
    """What one call of the layer keeps between its launches: everything but the output. A launch
    plan keeps one per stream and shape and reuses it call after call; calls on one stream run in
    order, so no call reads what a later one writes."""

    counts: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    rank: torch.Tensor
    sorted_picks: torch.Tensor
    x_mx: MxRows | None = None
    h1: torch.Tensor | MxRows | None = None

    @classmethod
    def empty(
        cls,
        *,
        tokens: int,
        top_k: int,
        num_local_experts: int,
        hidden: int,
        activations: ActivationPolicy,
        device: torch.device,
        valid_intermediate: int | None = None,
    ) -> Workspace:
        """Routing buffers for ``tokens``; with ``valid_intermediate`` GEMM1's output rows too."""
        picks = tokens * top_k
        return cls(
            torch.empty(num_local_experts, dtype=torch.int32, device=device),
            torch.empty((tokens, top_k), dtype=torch.int32, device=device),
            torch.empty((tokens, top_k), dtype=torch.float32, device=device),
            torch.empty((tokens, top_k), dtype=torch.int32, device=device),
            torch.empty(max(picks, 1), dtype=torch.int32, device=device),
            MxRows.empty(max(tokens, 1), hidden, activations, device) if activations != "bf16" else None,
            None if valid_intermediate is None else empty_h1(picks, valid_intermediate, activations, device),
        )
