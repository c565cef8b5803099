"""``moe(layer, hidden_states, router_logits)``: one gpt-oss MoE layer with the bundled kernel.

A :class:`MoeLayer` holds one layer's experts in the ``triton_moe_v3`` layout on the GPU, plus
the facts the kernel needs (valid intermediate rows, expert range, whether this TP rank adds the
down bias). Per call the variant pair comes from :func:`prepkit.tactics.choose.choose`: the
layer's tactic lookup (the tuner's database) or, when it has none for the problem, the built-in
default, with one warning per layer. Triton compiles each variant once, on its first use.

Activation precision is the layer's policy (``activations``: bf16, mxfp8 or mxfp4,
:mod:`prepkit.kernels.activations`), fixed at load; variants without one of their own for the
policy are mapped onto it (:func:`prepkit.kernels.variants.policy_variant`). Where Triton cannot
lower MX operands to block-scaled MMA (it can on SM10x and SM12x) the layer still runs, through
Triton's decomposition, and says so once per process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from prepkit.constants import TRITON_MOE_LAYOUT_ID
from prepkit.errors import DeviceError, LayoutError
from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.kernels.device import NATIVE_MX_TRITON_SM12X, DeviceInfo, lowers_natively
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import default_tactics
from prepkit.layer import MoeProblem, RankLayer, rank_layer
from prepkit.layouts.base import ExpertWeights, LayoutOptions, ModelDims, RankPlan, RankSpec
from prepkit.layouts.triton_moe import LAYOUT, tensor_specs
from prepkit.runtime.op import register as register_layer
from prepkit.tactics.choose import Choice, MoeCall, TacticLookup, choose, compile_errors, fall_back
from prepkit.warn_once import new_owner, warn_once

if TYPE_CHECKING:
    from prepkit.kernels.mx.plan import LaunchPlan

# The layout the bundled kernel reads (also prepkit.kernels.mx.WEIGHT_LAYOUT); named here
# through the constants so that checking a manifest does not import triton.
WEIGHT_LAYOUT = TRITON_MOE_LAYOUT_ID
TENSOR_NAMES = ("w13_blocks", "w13_scales", "w13_bias", "w2_blocks", "w2_scales", "w2_bias")


def default_tactics_for(
    problem: MoeProblem, device: DeviceInfo, activations: ActivationPolicy = "bf16"
) -> tuple[GemmTactic, GemmTactic]:
    """The built-in variant pair for the policy: always valid, not tuned."""
    return default_tactics(problem, device, activations)


@dataclass
class MoeLayer:
    """One layer's experts for one rank, ready for :func:`moe`."""

    w13_blocks: torch.Tensor  # [El, ceil(H/256), 2*Ip, 128] uint8 (K panels)
    w13_scales: torch.Tensor  # [El, H/32, 2*Ip] uint8
    w13_bias: torch.Tensor  # [El, 2*Ip] fp32
    w2_blocks: torch.Tensor  # [El, ceil(Ip/256), H, 128] uint8 (K panels)
    w2_scales: torch.Tensor  # [El, Ip/32, H] uint8
    w2_bias: torch.Tensor  # [El, H] fp32
    num_experts: int  # E over all ranks (router width)
    expert_range: tuple[int, int]
    valid_intermediate: int
    top_k: int = 4
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    apply_down_bias: bool = True  # True on TP rank 0 only, so the all-reduce adds it once
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tactic_lookup: TacticLookup | None = None
    device_info: DeviceInfo | None = None
    activations: ActivationPolicy = "bf16"  # the precision policy both GEMMs' inputs run in
    # (w13, w2): every E8M0 byte <= 128, so the kernel may fold its upcast fix-up into the scale
    # multiply (prepkit.kernels.mx.upcast_id). Derived from the scales once, at construction.
    small_scales: tuple[bool, bool] = field(init=False, default=(False, False))
    # The layer's per-rank record (prepkit.layer), from the fields and the tensors' shapes.
    shape: RankLayer = field(init=False, repr=False)
    _chosen: dict[int, tuple[GemmTactic, GemmTactic]] = field(default_factory=dict, repr=False)
    _warn_owner: int = field(default_factory=new_owner, repr=False)  # whose warnings these are
    _tuned: set[int] = field(default_factory=set, repr=False)  # token counts served by the lookup
    # The id torch.ops.prepkit.moe finds this layer by (prepkit.runtime.op), assigned at construction.
    op_id: int = field(init=False, default=-1, repr=False, compare=False)
    # Recorded launches per (tokens, policy, logits dtype, stream) for cheap eager calls
    # (mx.plan); never copied by dataclasses.replace, whose copy may change the policy.
    _plans: dict[tuple[int, str, torch.dtype, int], LaunchPlan] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_policy(self.activations)
        self.small_scales = (scales_are_small(self.w13_scales), scales_are_small(self.w2_scales))
        self.shape = RankLayer(
            num_experts=self.num_experts, expert_range=self.expert_range, hidden=self.hidden,
            valid_intermediate=self.valid_intermediate, padded_intermediate=self.padded_intermediate,
            top_k=self.top_k, tp_size=self.tp_size, tp_rank=self.tp_rank, ep_size=self.ep_size,
        )  # fmt: skip
        self.op_id = register_layer(self)

    @classmethod
    def from_experts(
        cls, experts: ExpertWeights, *, top_k: int, rank: RankSpec | None = None, **kwargs: Any
    ) -> tuple[MoeLayer, RankPlan]:
        """The layer ``rank`` holds of one layer's checkpoint-form ``experts`` (all of them), built
        in memory by the kernel's layout as ``prepkit prepare --layout triton-moe`` would write it,
        and the layout's plan. For the tuner, benchmarks and tests; ``kwargs`` go to
        :meth:`from_tensors`."""
        rank = rank or RankSpec()
        dims = ModelDims(1, experts.num_experts, experts.hidden, experts.intermediate, top_k)
        plan = LAYOUT.plan_rank(dims, rank, LayoutOptions())
        layer = cls.from_tensors(
            LAYOUT.build(experts.experts(*plan.expert_range), plan),
            layout_id=LAYOUT.layout_id,
            rank_layer=RankLayer.of_plan(plan),
            facts=plan.facts,
            **kwargs,
        )
        return layer, plan

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        layout_id: str,
        num_experts: int | None = None,
        expert_range: tuple[int, int] | None = None,
        valid_intermediate: int | None = None,
        top_k: int = 4,
        tp_rank: int = 0,
        rank_layer: RankLayer | None = None,
        device: torch.device | str | None = None,
        tactic_lookup: TacticLookup | None = None,
        facts: Mapping[str, Any] | None = None,
        activations: ActivationPolicy = "bf16",
    ) -> MoeLayer:
        """Build a layer from one rank's tensors of one layer (names may carry a prefix such as
        ``model.layers.3.mlp.experts.``; the suffix decides). The rank's dims come from
        ``rank_layer`` (the layout's record, :mod:`prepkit.layer`) or, without it, from
        ``num_experts``, ``expert_range``, ``valid_intermediate``, ``top_k`` and ``tp_rank``.

        Raises:
            LayoutError: the layout id is not ``triton_moe_v3``, a tensor is missing, or shapes
                disagree with each other or with ``valid_intermediate``.
            PrepkitError: ``activations`` is not a policy.
        """
        check_policy(activations)
        if layout_id != WEIGHT_LAYOUT:
            raise LayoutError(
                f"shards are in layout {layout_id!r}, the bundled kernel reads {WEIGHT_LAYOUT!r}",
                hint="prepare them with: prepkit prepare --layout triton-moe",
            )
        found: dict[str, torch.Tensor] = {}
        for suffix in TENSOR_NAMES:
            hits = [k for k in tensors if k == suffix or k.endswith("." + suffix)]
            if len(hits) != 1:
                raise LayoutError(f"expected one tensor named *{suffix}, found {sorted(hits) or 'none'}")
            found[suffix] = tensors[hits[0]].to(device) if device is not None else tensors[hits[0]]
        facts = dict(facts or {})
        if rank_layer is not None:
            num_experts, expert_range = rank_layer.num_experts, rank_layer.expert_range
            valid_intermediate, top_k, tp_rank = rank_layer.valid_intermediate, rank_layer.top_k, rank_layer.tp_rank
        if num_experts is None or expert_range is None or valid_intermediate is None:
            raise TypeError("from_tensors needs rank_layer, or num_experts, expert_range and valid_intermediate")
        layer = cls(
            w13_blocks=found["w13_blocks"].contiguous(),
            w13_scales=found["w13_scales"].contiguous(),
            w13_bias=found["w13_bias"].contiguous(),
            w2_blocks=found["w2_blocks"].contiguous(),
            w2_scales=found["w2_scales"].contiguous(),
            w2_bias=found["w2_bias"].contiguous(),
            num_experts=num_experts,
            expert_range=(int(expert_range[0]), int(expert_range[1])),
            valid_intermediate=valid_intermediate,
            top_k=top_k,
            tp_size=rank_layer.tp_size if rank_layer is not None else 1,
            tp_rank=tp_rank,
            ep_size=rank_layer.ep_size if rank_layer is not None else 1,
            apply_down_bias=tp_rank == int(facts.get("w2_bias_tp_rank", 0)),
            swiglu_alpha=float(facts.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(facts.get("swiglu_limit", 7.0)),
            tactic_lookup=tactic_lookup,
            activations=activations,
        )
        layer.validate()
        return layer

    @property
    def hidden(self) -> int:
        return self.w2_scales.shape[2]

    @property
    def num_local_experts(self) -> int:
        return self.w13_blocks.shape[0]

    @property
    def padded_intermediate(self) -> int:
        return self.w13_blocks.shape[2] // 2

    def problem(self, num_tokens: int) -> MoeProblem:
        return self.shape.problem(num_tokens)

    def run_eager(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """:func:`moe` on this layer, eagerly: the body of ``torch.ops.prepkit.moe``."""
        return moe(self, hidden_states, router_logits, out_dtype=out_dtype)

    def validate(self) -> None:
        """Raises ``LayoutError`` when the tensors do not form one ``triton_moe_v3`` layer."""
        El, Ip = self.num_local_experts, self.padded_intermediate
        problems = []
        for name, spec in tensor_specs(El, self.hidden, Ip).items():
            t = getattr(self, name)
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                problems.append(f"{name}: {list(t.shape)} {t.dtype}, expected {list(spec.shape)} {spec.dtype}")
        if not 0 < self.valid_intermediate <= Ip or self.valid_intermediate % 32:
            problems.append(f"valid_intermediate {self.valid_intermediate} must be a multiple of 32 in (0, {Ip}]")
        lo, hi = self.expert_range
        if hi - lo != El or not 0 <= lo < hi <= self.num_experts:
            problems.append(f"expert_range {self.expert_range} does not hold {El} of {self.num_experts} experts")
        if problems:
            raise LayoutError("not a triton_moe_v3 layer: " + "; ".join(problems))

    def tactics(self, num_tokens: int) -> tuple[GemmTactic, GemmTactic]:
        """The variant pair for ``num_tokens``: the lookup's, else the default (warned once per
        layer), chosen once by :func:`prepkit.tactics.choose.choose`."""
        chosen = self._chosen.get(num_tokens)
        if chosen is not None:
            return chosen
        choice = choose(
            MoeCall(self.problem(num_tokens), self.tactic_lookup), self._device_info(), self.activations,
            on_cuda=self._on_cuda(), owner=self._warn_owner,
        )  # fmt: skip
        if choice.tuned:
            self._tuned.add(num_tokens)
        chosen = self._chosen[num_tokens] = _pair(choice)
        return chosen

    def _default_pair(self, num_tokens: int) -> tuple[GemmTactic, GemmTactic]:
        return _pair(choose(MoeCall(self.problem(num_tokens)), self._device_info(), self.activations,
                            on_cuda=self._on_cuda(), warn=False))  # fmt: skip

    def fall_back_to_default(self, num_tokens: int, error: BaseException) -> tuple[GemmTactic, GemmTactic] | None:
        """After a tuned pair failed to compile: the default pair for ``num_tokens`` from now on
        (warned), or ``None`` when the failing pair was not the lookup's."""
        if num_tokens not in self._tuned:
            return None
        self._tuned.discard(num_tokens)
        failed = Choice(self._chosen[num_tokens], "lookup")
        choice = fall_back(
            MoeCall(self.problem(num_tokens)), failed, error, self._device_info(), self.activations,
            on_cuda=self._on_cuda(),
        )  # fmt: skip
        pair = self._chosen[num_tokens] = _pair(choice)
        return pair

    def _on_cuda(self) -> bool:
        return self.w13_blocks.device.type == "cuda"

    def _device_info(self) -> DeviceInfo:
        if self.device_info is None:
            self.device_info = DeviceInfo.for_device(self.w13_blocks.device)
        return self.device_info


def _pair(choice: Choice) -> tuple[GemmTactic, GemmTactic]:
    g1, g2 = choice.tactics
    return g1, g2


def _warn_if_decomposed(layer: MoeLayer, device: DeviceInfo, on_cuda: bool) -> None:
    """One warning per process and (policy, capability) when MX activations cannot run natively."""
    if layer.activations == "bf16" or (on_cuda and lowers_natively(device.capability)):
        return
    key = ("mx decomposed", layer.activations, device.capability if on_cuda else (0, 0))
    where = f"{device.name} (sm_{device.capability[0]}{device.capability[1]})" if on_cuda else "the CPU interpreter"
    warn_once(
        key,
        f"activations {layer.activations!r} run decomposed on {where}: Triton upcasts the MX operands to bf16 "
        "before the matrix unit (same numerics, no speed-up); block-scaled MMA needs SM10x, or SM12x with "
        f"Triton >= {'.'.join(map(str, NATIVE_MX_TRITON_SM12X))}",
        stacklevel=3,
    )


def moe(
    layer: MoeLayer,
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    *,
    tactics: tuple[GemmTactic, GemmTactic] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One MoE layer: ``[T, H]`` bf16 activations and ``[T, E]`` router logits -> ``[T, H]``.

    The result is this rank's share (its experts, its intermediate rows); ranks' outputs add up to
    the layer. ``out_dtype`` defaults to the activations' dtype; ``torch.float32`` returns the
    kernel's accumulator without a final cast. ``tactics`` pins the (GEMM1, GEMM2) variants.

    Under ``torch.compile`` the call goes through the registered op ``torch.ops.prepkit.moe``
    (:mod:`prepkit.runtime.op`), so that the compiled graph has no break here; eagerly it runs the
    kernel directly, which costs less host time.

    Raises:
        DeviceError: tensors on different devices.
        ValueError: shapes that do not match the layer, or ``tactics`` pinned under ``torch.compile``.
    """
    target = hidden_states.dtype if out_dtype is None else out_dtype
    if torch.compiler.is_compiling():
        if tactics is not None:
            raise ValueError("moe(): pinned tactics are not supported under torch.compile")
        return torch.ops.prepkit.moe(hidden_states, router_logits, layer.op_id, target)
    if tactics is None and layer._plans:
        key = _plan_key(layer, hidden_states, router_logits)
        plan = layer._plans.get(key) if key is not None else None
        if plan is not None and plan.accepts(hidden_states, router_logits):
            out = plan(hidden_states, router_logits)
            return out if target == torch.float32 else out.to(target)
    if hidden_states.device != layer.w13_blocks.device or router_logits.device != hidden_states.device:
        raise DeviceError(
            f"hidden_states on {hidden_states.device}, router_logits on {router_logits.device}, "
            f"weights on {layer.w13_blocks.device}"
        )
    if hidden_states.dim() != 2 or hidden_states.shape[1] != layer.hidden:
        raise ValueError(f"hidden_states {list(hidden_states.shape)}, expected [T, {layer.hidden}]")
    if tuple(router_logits.shape) != (hidden_states.shape[0], layer.num_experts):
        raise ValueError(
            f"router_logits {list(router_logits.shape)}, expected [{hidden_states.shape[0]}, {layer.num_experts}]"
        )
    _warn_if_decomposed(layer, layer._device_info(), layer.w13_blocks.device.type == "cuda")
    num_tokens = hidden_states.shape[0]
    x = hidden_states if hidden_states.dtype == torch.bfloat16 else hidden_states.to(torch.bfloat16)
    x, logits = x.contiguous(), router_logits.contiguous()
    pair = tactics if tactics is not None else layer.tactics(num_tokens)
    # Calls whose tensors are the kernel's as given can be recorded for cheap replays.
    planned = tactics is None and x is hidden_states and logits is router_logits
    plan_key = _plan_key(layer, x, logits) if planned else None
    try:
        out = _launch(layer, x, logits, pair, plan_key)
    except compile_errors() as err:
        # Tuned variants from another Triton may no longer compile: the default always does.
        fallback = None if tactics is not None else layer.fall_back_to_default(num_tokens, err)
        if fallback is None:
            raise
        out = _launch(layer, x, logits, fallback)
    return out if target == torch.float32 else out.to(target)


def _plan_key(
    layer: MoeLayer, hidden_states: torch.Tensor, router_logits: torch.Tensor
) -> tuple[int, str, torch.dtype, int] | None:
    if hidden_states.device.type != "cuda":
        return None
    from prepkit.kernels.mx.plan import current_stream

    stream = current_stream(hidden_states.device)
    return (hidden_states.shape[0], layer.activations, router_logits.dtype, stream)


def _launch(
    layer: MoeLayer,
    x: torch.Tensor,
    logits: torch.Tensor,
    pair: tuple[GemmTactic, GemmTactic],
    plan_key: tuple[int, str, torch.dtype, int] | None = None,
) -> torch.Tensor:
    """The kernel on ``x``; with a ``plan_key`` its launches are recorded for the next calls of
    that key, where they can be (:func:`prepkit.kernels.mx.plan.plannable`)."""
    from prepkit.kernels.mx import fused_moe, plan_fused_moe  # imports triton: only when a layer runs

    weights = (
        layer.w13_blocks, layer.w13_scales, layer.w13_bias, layer.w2_blocks, layer.w2_scales,
        layer.w2_bias if layer.apply_down_bias else None,
    )  # fmt: skip
    options: dict[str, Any] = dict(
        top_k=layer.top_k, expert_lo=layer.expert_range[0], valid_intermediate=layer.valid_intermediate,
        gemm1=pair[0], gemm2=pair[1], swiglu_alpha=layer.swiglu_alpha, swiglu_limit=layer.swiglu_limit,
        small_scales=layer.small_scales, activations=layer.activations,
    )  # fmt: skip
    if plan_key is None:
        return fused_moe(x, logits, *weights, **options)
    plan, out = plan_fused_moe(x, logits, *weights, **options)
    if plan is not None:
        layer._plans[plan_key] = plan
    return out


def scales_are_small(scales: torch.Tensor) -> bool:
    """Whether every E8M0 byte of ``scales`` is at most 128 (every scale <= 2). One device sync:
    done once per layer at load. gpt-oss weights sit far below (scales near 2^-8 .. 2^-4)."""
    if scales.device.type == "meta" or scales.numel() == 0:
        return False
    return bool(scales.max() <= 128)


def load_moe_layers(
    out_dir: str | Any,
    rank: int = 0,
    device: torch.device | str = "cuda",
    *,
    layers: list[int] | None = None,
    tactic_lookup: TacticLookup | None = None,
    use_tactics_db: bool = True,
    activations: ActivationPolicy = "bf16",
) -> dict[int, MoeLayer]:
    """Load a ``prepkit prepare --layout triton-moe`` shard set's rank onto ``device``.

    The manifest is checked first (layout id and version, rank); the experts then stay on the
    device. Unless ``tactic_lookup`` is given, variants come from the tactic databases (the
    user's, then the bundled ``tactics.db``) through :func:`prepkit.tactics.lookup.make_tactic_lookup`,
    falling back to the built-in default with one warning. ``activations`` is the precision
    policy of every layer (bf16, mxfp8, mxfp4; :mod:`prepkit.kernels.activations`).

    Raises:
        PrepkitError: ``activations`` is not a policy (checked before anything loads).
        DeviceError: ``device`` is not a device this machine has (checked before any file is read).
        LayoutError: the shard set is not in the kernel's layout (both ids are named) or lacks ``rank``.
        VerifyError: a file is missing or disagrees with the manifest.
    """
    from prepkit.runtime.loader import load_shards

    check_policy(activations)
    shards = load_shards(out_dir, rank, device, expect_layout=WEIGHT_LAYOUT, layers=layers)
    if tactic_lookup is None and use_tactics_db:
        from prepkit.tactics.lookup import make_tactic_lookup

        tactic_lookup = make_tactic_lookup(activations=activations)
    record = rank_layer(
        shards.manifest.model.dims,
        RankSpec(tp_size=shards.tp_size, tp_rank=shards.tp_rank, ep_size=shards.ep_size, ep_rank=shards.ep_rank),
    )
    facts = shards.facts
    return {
        index: MoeLayer.from_tensors(
            tensors,
            layout_id=shards.layout_id,
            rank_layer=record,
            device=device,
            tactic_lookup=tactic_lookup,
            facts=facts,
            activations=activations,
        )
        for index, tensors in sorted(shards.layers.items())
    }
