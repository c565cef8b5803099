"""The contract every layout implements, and the value types that cross it.

A layout turns one layer's experts, in checkpoint form, into the tensors one TP/EP rank of an
engine consumes, and back. Layouts are pure functions on CPU tensors: no file I/O, no globals,
no device probing. The pipeline does the reading and writing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from prepkit.dims import ModelDims
from prepkit.errors import LayoutError
from prepkit.mxfp4 import BLOCK_ELEMS

# Expert tensor roles in checkpoint order; the names are the checkpoint's suffixes.
SOURCE_ROLES = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "gate_up_proj_bias",
    "down_proj_blocks",
    "down_proj_scales",
    "down_proj_bias",
)


@dataclass
class ExpertWeights:
    """One layer's experts in checkpoint form: gate/up rows interleaved (row 2i gate, 2i+1 up).

    Shapes: blocks ``[E, 2I, H/32, 16]`` / ``[E, H, I/32, 16]`` uint8, scales the same less the
    last dim (E8M0 uint8), biases ``[E, 2I]`` / ``[E, H]`` bfloat16. A rank's share of the
    intermediate axis is again an ``ExpertWeights`` with a smaller I, so inverses compare against
    plain slices of the source.
    """

    gate_up_proj_blocks: torch.Tensor
    gate_up_proj_scales: torch.Tensor
    gate_up_proj_bias: torch.Tensor
    down_proj_blocks: torch.Tensor
    down_proj_scales: torch.Tensor
    down_proj_bias: torch.Tensor

    @classmethod
    def from_mapping(cls, tensors: Mapping[str, torch.Tensor]) -> ExpertWeights:
        return cls(**{role: tensors[role] for role in SOURCE_ROLES})

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {role: getattr(self, role) for role in SOURCE_ROLES}

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj_blocks.shape[0]

    @property
    def intermediate(self) -> int:
        return self.gate_up_proj_blocks.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.down_proj_blocks.shape[1]

    def experts(self, lo: int, hi: int) -> ExpertWeights:
        """Experts ``[lo, hi)`` (views, no copy)."""
        return ExpertWeights(**{role: t[lo:hi] for role, t in self.as_dict().items()})

    def intermediate_slice(self, lo: int, hi: int) -> ExpertWeights:
        """Rows ``[lo, hi)`` of the intermediate axis; ``lo`` and ``hi`` multiples of 32."""
        if lo % BLOCK_ELEMS or (hi % BLOCK_ELEMS and hi != self.intermediate):
            raise LayoutError(f"intermediate slice [{lo}, {hi}) splits a 32-element scale block")
        g_lo, g_hi = lo // BLOCK_ELEMS, -(-hi // BLOCK_ELEMS)
        return ExpertWeights(
            gate_up_proj_blocks=self.gate_up_proj_blocks[:, 2 * lo : 2 * hi],
            gate_up_proj_scales=self.gate_up_proj_scales[:, 2 * lo : 2 * hi],
            gate_up_proj_bias=self.gate_up_proj_bias[:, 2 * lo : 2 * hi],
            down_proj_blocks=self.down_proj_blocks[:, :, g_lo:g_hi],
            down_proj_scales=self.down_proj_scales[:, :, g_lo:g_hi],
            down_proj_bias=self.down_proj_bias,
        )

    @staticmethod
    def concat_intermediate(pieces: list[ExpertWeights]) -> ExpertWeights:
        """Inverse of :meth:`intermediate_slice` over consecutive pieces (down bias from the first)."""
        return ExpertWeights(
            gate_up_proj_blocks=torch.cat([p.gate_up_proj_blocks for p in pieces], dim=1),
            gate_up_proj_scales=torch.cat([p.gate_up_proj_scales for p in pieces], dim=1),
            gate_up_proj_bias=torch.cat([p.gate_up_proj_bias for p in pieces], dim=1),
            down_proj_blocks=torch.cat([p.down_proj_blocks for p in pieces], dim=2),
            down_proj_scales=torch.cat([p.down_proj_scales for p in pieces], dim=2),
            down_proj_bias=pieces[0].down_proj_bias,
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.as_dict().values())


@dataclass(frozen=True)
class RankSpec:
    """Where one output rank sits: ``rank = ep_rank * tp_size + tp_rank``."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def rank(self) -> int:
        return self.ep_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    @staticmethod
    def all_ranks(tp_size: int, ep_size: int = 1) -> list[RankSpec]:
        return [
            RankSpec(tp_size=tp_size, tp_rank=t, ep_size=ep_size, ep_rank=e)
            for e in range(ep_size)
            for t in range(tp_size)
        ]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one output tensor, with the names of its dims for the manifest."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dims: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RankPlan:
    """Everything a layout decided for one rank before any byte is read.

    ``intermediate_range`` is the half-open range of checkpoint intermediate rows this rank holds
    (``valid_intermediate`` of them); the rest up to ``padded_intermediate`` is zero padding.
    ``tensors`` maps output tensor suffixes (e.g. ``w3_w1_weight``) to their per-layer specs.
    ``facts`` carries layout-specific values worth recording in the manifest. Any layout's byte
    plan; the dims the bundled kernel reads of a triton-moe plan are its
    :class:`prepkit.layer.RankLayer` (``RankLayer.of_plan``).
    """

    spec: RankSpec
    dims: ModelDims
    expert_range: tuple[int, int]
    intermediate_range: tuple[int, int]
    padded_intermediate: int
    padded_hidden: int
    tensors: dict[str, TensorSpec]
    sharding_rule: str
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def valid_intermediate(self) -> int:
        return self.intermediate_range[1] - self.intermediate_range[0]

    @property
    def num_local_experts(self) -> int:
        return self.expert_range[1] - self.expert_range[0]

    def layer_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True)
class LayoutOptions:
    """Knobs a layout may read; layouts ignore the ones that do not concern them."""

    trtllm_version: str = "main"  # "main" (after TRT-LLM PR #18870) or "1.2"


class Layout(Protocol):
    """A weight layout: a name for the CLI, a versioned id for manifests, and pure transforms."""

    name: str  # CLI spelling, e.g. "trtllm-gen"
    layout_id: str  # stored in manifests and tactics.db, e.g. "trtllm_gen_v1"; bump on any byte change
    w13_row_order: str  # "interleaved" | "gate_up" | "up_gate"
    summary: str
    # LayoutOptions fields this layout reads (recorded in manifests); others are ignored.
    uses_options: tuple[str, ...]

    def plan_rank(self, dims: ModelDims, spec: RankSpec, options: LayoutOptions) -> RankPlan:
        """Shapes, ranges and facts of one rank; raises ``LayoutError`` for splits that do not fit."""
        ...

    def plan_warnings(self, dims: ModelDims, plans: Sequence[RankPlan], options: LayoutOptions) -> list[str]:
        """What a user should hear about these rank plans before any byte is written, e.g. that
        another engine version would place other rows on some ranks; empty when nothing."""
        ...

    def build(self, weights: ExpertWeights, plan: RankPlan) -> dict[str, torch.Tensor]:
        """The rank's tensors for one layer from local experts in checkpoint form.

        ``weights`` holds a consecutive run of the rank's experts (the pipeline streams chunks of
        ``plan.expert_range``) and the full intermediate axis; every output tensor has the
        expert as dim 0, so chunks concatenate along it.
        """
        ...

    def invert(self, tensors: Mapping[str, torch.Tensor], plan: RankPlan) -> ExpertWeights:
        """Undo :meth:`build`: the rank's share of the checkpoint, i.e. equal to
        ``weights.intermediate_slice(*plan.intermediate_range)``. Raises ``LayoutError`` naming the
        tensor when a padding byte is not zero or a shape is off."""
        ...


def check_split(dims: ModelDims, tp_size: int, ep_size: int) -> None:
    """Refuse a TP/EP size no layout can split ``dims`` into, from the sizes alone (before any rank
    is planned, so a huge size costs nothing). Every layout gives each EP rank whole experts and
    each TP rank whole 32-row groups of the intermediate axis (one E8M0 scale block stays on one
    rank); a layout may refuse more (its ``plan_rank`` says why).

    Raises:
        LayoutError: ``ep_size`` exceeds the experts or does not divide them, or ``tp_size``
            exceeds the intermediate axis's 32-row groups; the message names the bound.
    """
    experts = dims.num_experts
    if ep_size > experts or experts % ep_size:
        raise LayoutError(
            f"{experts} experts cannot be split evenly over ep={ep_size} "
            "(every EP rank holds the same number of whole experts)",
            hint=f"choose --ep dividing {experts}: {', '.join(map(str, _divisors(experts)))}",
        )
    groups = dims.intermediate // BLOCK_ELEMS
    if tp_size > groups:
        raise LayoutError(
            f"tp={tp_size}: the intermediate size {dims.intermediate} holds {groups} groups of {BLOCK_ELEMS} "
            f"rows, and every TP rank needs at least one (an MXFP4 scale block is never split)",
            hint=f"use --tp {groups} or less",
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_range(num_experts: int, spec: RankSpec) -> tuple[int, int]:
    """Contiguous expert slice of an EP rank (every engine here uses contiguous slices)."""
    if num_experts % spec.ep_size:
        raise LayoutError(
            f"{num_experts} experts cannot be split evenly over ep={spec.ep_size}",
            hint="choose --ep dividing the expert count",
        )
    per = num_experts // spec.ep_size
    return spec.ep_rank * per, (spec.ep_rank + 1) * per


def check_experts(weights: ExpertWeights, plan: RankPlan) -> None:
    """Refuse experts that do not belong to ``plan``'s rank. A run of fewer experts than the rank
    holds is fine: the pipeline streams a rank's experts in chunks."""
    if weights.num_experts > plan.num_local_experts:
        raise LayoutError(
            f"got {weights.num_experts} experts for rank {plan.spec.rank}, which holds {plan.num_local_experts}"
        )
    if weights.intermediate != plan.dims.intermediate or weights.hidden != plan.dims.hidden:
        raise LayoutError(
            f"expert weights have H={weights.hidden}, I={weights.intermediate}; "
            f"the plan expects H={plan.dims.hidden}, I={plan.dims.intermediate}"
        )


def check_prepared(tensors: Mapping[str, torch.Tensor], plan: RankPlan) -> None:
    """Refuse prepared tensors whose names, dtypes or per-expert shapes differ from ``plan``; any
    run of the rank's experts may be inverted on its own (verify samples single experts)."""
    for name, spec in plan.tensors.items():
        t = tensors.get(name)
        if t is None:
            raise LayoutError(f"tensor {name!r} is missing")
        if tuple(t.shape[1:]) != spec.shape[1:] or t.shape[0] > spec.shape[0] or t.dtype != spec.dtype:
            raise LayoutError(f"{name}: shape {list(t.shape)} {t.dtype}, expected {list(spec.shape)} {spec.dtype}")
