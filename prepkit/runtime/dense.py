"""``MxLinear``: a dense MX weight (``prepare --dense mxfp8|mxfp4``) as an ``nn.Module`` run by the
bundled kernel family (:func:`prepkit.kernels.mx.mx_linear`).

Under ``torch.compile`` the forward goes through the registered op ``torch.ops.prepkit.mx_linear``
(one opaque node with a fake implementation, so ``fullgraph=True`` holds); eagerly, and under
CUDA-graph capture, it runs the op's body directly, which costs less host time. The op takes the
weight's tensors (not a module), so one compiled function serves every layer's weights
(:mod:`prepkit.integrations.decode_step`); it chooses the variant of each token count through the
tactic DBs, once per shape. A module chooses through its own lookup, once per token count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.mx_formats import pairing_reason
from prepkit.tactics.choose import DEFAULT, Choice, DenseCall, DenseTacticLookup, choose, compile_errors, fall_back
from prepkit.warn_once import new_owner

if TYPE_CHECKING:
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.mx.dense import DenseMxWeights
    from prepkit.kernels.tactic import GemmTactic


class MxLinear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` stored in MX (``fmt`` ``mxfp4``/``mxfp8``): ``blocks``
    ``[P, out_features, 128]`` uint8 K panels, ``scales`` ``[in_features/32, out_features]``
    uint8 E8M0 (:mod:`prepkit.layouts.dense_mx`), ``bias`` ``[out_features]`` or ``None``.
    ``activations``: the policy (bf16, mxfp8, mxfp4 with mxfp4 weights); ``tactic_lookup``: the
    variant per call, else :func:`~prepkit.kernels.mx.default_dense_tactic`."""

    weight_blocks: torch.Tensor
    weight_scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        blocks: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        fmt: str,
        *,
        activations: ActivationPolicy = "bf16",
        tactic_lookup: DenseTacticLookup | None = None,
    ) -> None:
        super().__init__()
        from prepkit.kernels.mx.dense import check_weights

        check_weights(blocks, scales, fmt)
        self.activations = check_policy(activations)
        reason = pairing_reason(self.activations, fmt)
        if reason is not None:
            raise ValueError(reason)
        self.fmt = fmt
        self.in_features = scales.shape[0] * 32
        self.out_features = scales.shape[1]
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != self.out_features):
            raise ValueError(f"bias: shape {list(bias.shape)}, expected [{self.out_features}]")
        self.register_buffer("weight_blocks", blocks)
        self.register_buffer("weight_scales", scales)
        self.register_buffer("bias", bias.contiguous() if bias is not None else None)
        self.tactic_lookup = tactic_lookup
        self._tactics: dict[tuple[int, torch.device], Choice] = {}
        self._warn_owner = new_owner()  # this module's warnings are its own
        self._weights: DenseMxWeights | None = None
        self._device_info: DeviceInfo | None = None

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"activations={self.activations}, bias={self.bias is not None}"
        )

    @classmethod
    def fused(cls, parts: list[MxLinear]) -> MxLinear:
        """One module whose outputs are those of ``parts`` one after the other (q, k, v -> qkv):
        weights concatenated along N, biases too (zeros for a part without one, unless none has one).

        Raises:
            ValueError: no parts, or parts of different formats, inputs or activation policies.
        """
        if not parts:
            raise ValueError("MxLinear.fused needs at least one part")
        first = parts[0]
        for i, p in enumerate(parts[1:], 1):
            if (p.fmt, p.in_features, p.activations) != (first.fmt, first.in_features, first.activations):
                raise ValueError(
                    f"part {i} is {p.fmt} with {p.in_features} inputs and activations {p.activations!r}, "
                    f"part 0 {first.fmt} with {first.in_features} and {first.activations!r}"
                )
        biases = [p.bias for p in parts]
        bias = None
        if any(b is not None for b in biases):
            ref = next(b for b in biases if b is not None)
            bias = torch.cat(
                [b if b is not None else ref.new_zeros(p.out_features) for b, p in zip(biases, parts, strict=True)]
            )
        return cls(
            torch.cat([p.weight_blocks for p in parts], dim=1),
            torch.cat([p.weight_scales for p in parts], dim=1),
            bias,
            first.fmt,
            activations=first.activations,
            tactic_lookup=first.tactic_lookup,
        )

    def weights(self) -> DenseMxWeights:
        """The buffers as the kernel's :class:`~prepkit.kernels.mx.DenseMxWeights` (rebuilt
        after the module moved, e.g. by ``.to(device)``)."""
        w = self._weights
        if w is None or w.blocks is not self.weight_blocks or w.scales is not self.weight_scales:
            from prepkit.kernels.mx.dense import DenseMxWeights

            w = self._weights = DenseMxWeights(self.weight_blocks, self.weight_scales, self.fmt)
            self._tactics.clear()
            self._device_info = None
        return w

    def device_info(self) -> DeviceInfo:
        if self._device_info is None:
            self._device_info = kernel_device(self.weight_blocks.device)
        return self._device_info

    def tactic(self, num_tokens: int) -> GemmTactic:
        """The variant for ``num_tokens`` rows: the lookup's, else the default (warned once per
        module); chosen once by :func:`prepkit.tactics.choose.choose`."""
        return self._choice(num_tokens).tactics[0]

    def _call(self, num_tokens: int) -> DenseCall:
        return DenseCall(num_tokens, self.out_features, self.in_features, self.fmt, self.tactic_lookup)

    def _choice(self, num_tokens: int) -> Choice:
        key = (num_tokens, self.weight_blocks.device)
        c = self._tactics.get(key)
        if c is None:
            c = self._tactics[key] = choose(
                self._call(num_tokens), self.device_info(), self.activations,
                on_cuda=self.weight_blocks.device.type == "cuda", owner=self._warn_owner,
            )  # fmt: skip
        return c

    def _fall_back(self, num_tokens: int, error: BaseException) -> GemmTactic | None:
        """After the tuned variant failed to compile: the default from now on (warned), or ``None``
        when the failing variant was no lookup's."""
        key = (num_tokens, self.weight_blocks.device)
        failed = self._tactics.get(key)
        if failed is None or not failed.tuned:
            return None
        c = self._tactics[key] = fall_back(
            self._call(num_tokens), failed, error, self.device_info(), self.activations,
            on_cuda=self.weight_blocks.device.type == "cuda",
        )  # fmt: skip
        return c.tactics[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.prepkit.mx_linear(
                x, self.weight_blocks, self.weight_scales, self.bias, self.fmt, self.activations
            )
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel on ``x [..., in_features]`` (bf16; other float dtypes are cast in and out)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: shape {list(x.shape)}, expected [..., {self.in_features}]")
        if x.device != self.weight_blocks.device:
            raise ValueError(f"x on {x.device}, weights on {self.weight_blocks.device}")
        return run_dense(x, self.weights(), self.bias, self.activations, self.tactic, self._fall_back)


def run_dense(
    x: torch.Tensor,
    weights: DenseMxWeights,
    bias: torch.Tensor | None,
    activations: ActivationPolicy,
    tactic: Callable[[int], GemmTactic],
    fall_back_to: Callable[[int, BaseException], GemmTactic | None],
) -> torch.Tensor:
    """``x [..., K] @ W^T + bias`` in ``x``'s dtype (bf16 inside) with the variant ``tactic(rows)``;
    after a variant that does not compile, ``fall_back_to(rows, error)``'s (``None``: re-raise)."""
    from prepkit.kernels.mx.dense import launch_dense

    dtype = x.dtype
    x2 = x.reshape(-1, weights.k)
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], weights.n), dtype=torch.bfloat16, device=x.device)
    try:
        launch_dense(x2, weights, bias, tactic(x2.shape[0]), activations, out)
    except compile_errors() as err:
        # A variant tuned with another Triton may no longer compile: the default always does.
        fallback = fall_back_to(x2.shape[0], err)
        if fallback is None:
            raise
        launch_dense(x2, weights, bias, fallback, activations, out)
    y = out.view(*x.shape[:-1], weights.n)
    return y if dtype == torch.bfloat16 else y.to(dtype)


def fuse_projections(parts: Sequence[nn.Module]) -> nn.Module:
    """One module of the parts' kind (``nn.Linear`` or :class:`MxLinear`) whose outputs are those
    of ``parts`` one after the other (q, k, v -> qkv): weights and biases concatenated along the
    output rows (a zero bias for a part without one, unless none has one). Each part's tensors then
    become views of the fused module's, so the parts compute as before, alone, and the model holds
    one copy; bf16 parts that already view one fused tensor (fused before) fuse into it again,
    without a copy.

    Raises:
        ValueError: no parts, parts of mixed kinds, or parts that do not share their input
            (or, MX, their format and activation policy).
    """
    if not parts:
        raise ValueError("fuse_projections needs at least one part")
    fused: nn.Module
    if all(isinstance(p, MxLinear) for p in parts):
        fused = MxLinear.fused(list(parts))  # type: ignore[arg-type]
        rows = {"weight_blocks": 1, "weight_scales": 1, "bias": 0}  # the dim of the output rows
    elif all(isinstance(p, nn.Linear) for p in parts):
        fused = _fused_linear(list(parts))  # type: ignore[arg-type]
        rows = {"weight": 0, "bias": 0}
    else:
        raise ValueError(f"fuse_projections: parts {[type(p).__name__ for p in parts]} are not all of one kind")
    lo = 0
    for part in parts:
        hi = lo + int(part.out_features)  # type: ignore[arg-type]
        for name, dim in rows.items():
            own, whole = getattr(part, name), getattr(fused, name)
            if own is None or whole is None:
                continue
            view = whole.detach().narrow(dim, lo, hi - lo)
            setattr(
                part, name, nn.Parameter(view, requires_grad=own.requires_grad) if name in part._parameters else view
            )
        lo = hi
    return fused


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    first = parts[0]
    for i, p in enumerate(parts[1:], 1):
        if p.in_features != first.in_features:
            raise ValueError(f"part {i} has {p.in_features} inputs, part 0 {first.in_features}")
    weights = [p.weight.detach() for p in parts]
    weight = _rows_of_one_tensor(weights)
    fused = nn.Linear(first.in_features, sum(w.shape[0] for w in weights), bias=False, device="meta")
    fused.weight = nn.Parameter(weight if weight is not None else torch.cat(weights), first.weight.requires_grad)
    if any(p.bias is not None for p in parts):
        ref = next(p.bias for p in parts if p.bias is not None)
        biases = [p.bias.detach() if p.bias is not None else ref.new_zeros(p.out_features) for p in parts]
        bias = _rows_of_one_tensor(biases)
        fused.bias = nn.Parameter(bias if bias is not None else torch.cat(biases), ref.requires_grad)
    return fused


def _rows_of_one_tensor(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive rows ``tensors`` are, when they are that already (the views an
    earlier fusion left); else ``None``. Building a second decoder then costs no second copy."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        same = t.dtype == first.dtype and t.device == first.device and t.shape[1:] == first.shape[1:]
        if not (same and t.is_contiguous() and t.untyped_storage().data_ptr() == storage):
            return None
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def kernel_device(device: torch.device) -> DeviceInfo:
    """The kernels' description of ``device``; CPU tensors run only under the Triton interpreter,
    described as a Hopper part."""
    from prepkit.kernels.device import DeviceInfo

    return DeviceInfo.for_device(device)


@functools.cache
def db_tactic_lookup() -> DenseTacticLookup:
    """One lookup in the tactic DBs for every MX linear of the process (it caches problem keys
    and warns once per untuned problem)."""
    from prepkit.tactics.lookup import make_dense_tactic_lookup

    return make_dense_tactic_lookup()


_SHARED_CHOICES: dict[tuple[int, int, int, str, str, torch.device], Choice] = {}


def _shared_call(tokens: int, weights: DenseMxWeights) -> DenseCall:
    return DenseCall(tokens, weights.n, weights.k, weights.fmt, db_tactic_lookup())


def shared_tactic(tokens: int, weights: DenseMxWeights, activations: ActivationPolicy) -> GemmTactic:
    """The variant for ``tokens`` rows through a weight given as tensors: the tactic DBs', else the
    default; chosen once per shape and device (tensors carry no lookup of their own)."""
    key = (tokens, weights.n, weights.k, weights.fmt, activations, weights.blocks.device)
    c = _SHARED_CHOICES.get(key)
    if c is None:
        device = weights.blocks.device
        c = _SHARED_CHOICES[key] = choose(
            _shared_call(tokens, weights), kernel_device(device), activations, on_cuda=device.type == "cuda"
        )
    return c.tactics[0]


def shared_fall_back(
    tokens: int, weights: DenseMxWeights, activations: ActivationPolicy, error: BaseException
) -> GemmTactic | None:
    """After the DBs' variant for this shape failed to compile: the default from now on (warned),
    or ``None`` when the failing variant was already the default."""
    key = (tokens, weights.n, weights.k, weights.fmt, activations, weights.blocks.device)
    failed = _SHARED_CHOICES.get(key)
    if failed is None or failed.source == DEFAULT:
        return None
    device = weights.blocks.device
    c = _SHARED_CHOICES[key] = fall_back(
        _shared_call(tokens, weights), failed, error, kernel_device(device), activations,
        on_cuda=device.type == "cuda",
    )  # fmt: skip
    return c.tactics[0]


def mx_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    activations: str,
) -> torch.Tensor:
    """``x [..., K] @ W^T + bias`` for the MX weight stored as ``blocks``/``scales``: the registered
    op under ``torch.compile`` (one opaque node), else its body (less host time)."""
    if torch.compiler.is_compiling():
        return torch.ops.prepkit.mx_linear(x, blocks, scales, bias, fmt, activations)
    return _mx_linear_body(x, blocks, scales, bias, fmt, activations)


def _mx_linear_body(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    activations: str,
) -> torch.Tensor:
    from prepkit.kernels.mx.dense import DenseMxWeights

    weights = DenseMxWeights(blocks, scales, fmt)
    policy = check_policy(activations)
    return run_dense(
        x, weights, bias, policy,
        lambda tokens: shared_tactic(tokens, weights, policy),
        lambda tokens, err: shared_fall_back(tokens, weights, policy, err),
    )  # fmt: skip


@torch.library.custom_op("prepkit::mx_linear", mutates_args=())
def mx_linear_op(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    activations: str,
) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype through the stored MX weight
    ``blocks``/``scales`` (``fmt``, activation policy ``activations``). The weights are arguments,
    not a module, so one compiled function serves every layer without a recompile per module."""
    return _mx_linear_body(x, blocks, scales, bias, fmt, activations)


@mx_linear_op.register_fake
def _mx_linear_fake(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    activations: str,
) -> Any:
    return x.new_empty((*x.shape[:-1], scales.shape[1]))
