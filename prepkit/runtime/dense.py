"""``MxLinear``: a dense MX weight (``prepare --dense mxfp8|mxfp4``) as an ``nn.Module`` run by the
bundled kernel family (:func:`prepkit.kernels.mx.mx_linear`).

Under ``torch.compile`` the forward goes through the registered op ``torch.ops.prepkit.mx_linear``
(one opaque node with a fake implementation, so ``fullgraph=True`` holds); eagerly, and under
CUDA-graph capture, it launches the kernel directly, which costs less host time. As with the MoE
op (:mod:`prepkit.runtime.op`), the op takes a module id rather than the weights: the module
keeps state no op argument can (its tactic per token count, its lookup), and registers itself
once, weakly. The tactic of each token count is chosen once and cached.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.mx_formats import pairing_reason
from prepkit.runtime.registry import WeakRegistry
from prepkit.tactics.choose import Choice, DenseCall, DenseTacticLookup, choose, compile_errors, fall_back
from prepkit.warn_once import new_owner

if TYPE_CHECKING:
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.mx.dense import DenseMxWeights
    from prepkit.kernels.tactic import GemmTactic


_MODULES: WeakRegistry[MxLinear] = WeakRegistry("torch.ops.prepkit.mx_linear", "MxLinear")


def registered_linear(module_id: int) -> MxLinear:
    """The module behind ``module_id``.

    Raises:
        KeyError: no live MxLinear has that id.
    """
    return _MODULES.get(module_id)


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
        self.op_id = _MODULES.add(self)

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
            return torch.ops.prepkit.mx_linear(x, self.op_id, self.out_features)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel on ``x [..., in_features]`` (bf16; other float dtypes are cast in and out)."""
        from prepkit.kernels.mx.dense import launch_dense

        weights = self.weights()
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: shape {list(x.shape)}, expected [..., {self.in_features}]")
        if x.device != self.weight_blocks.device:
            raise ValueError(f"x on {x.device}, weights on {self.weight_blocks.device}")
        dtype = x.dtype
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty((x2.shape[0], self.out_features), dtype=torch.bfloat16, device=x.device)
        try:
            launch_dense(x2, weights, self.bias, self.tactic(x2.shape[0]), self.activations, out)
        except compile_errors() as err:
            # A variant tuned with another Triton may no longer compile: the default always does.
            fallback = self._fall_back(x2.shape[0], err)
            if fallback is None:
                raise
            launch_dense(x2, weights, self.bias, fallback, self.activations, out)
        y = out.view(*x.shape[:-1], self.out_features)
        return y if dtype == torch.bfloat16 else y.to(dtype)


def fuse_sharing(parts: list[MxLinear]) -> MxLinear:
    """:meth:`MxLinear.fused`, after which each part's buffers are views of the fused module's
    (the kernel reads rows of a wider weight in place): q, k and v run alone or as one launch,
    with one copy of their weights in memory."""
    fused = MxLinear.fused(parts)
    lo = 0
    for part in parts:
        hi = lo + part.out_features
        part.weight_blocks = fused.weight_blocks[:, lo:hi]
        part.weight_scales = fused.weight_scales[:, lo:hi]
        if part.bias is not None and fused.bias is not None:
            part.bias = fused.bias[lo:hi]
        lo = hi
    return fused


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


_STORED_TACTICS: dict[tuple[int, int, int, str, str, torch.device], GemmTactic] = {}


def stored_tactic(tokens: int, blocks: torch.Tensor, scales: torch.Tensor, fmt: str, activations: str) -> GemmTactic:
    """The variant for a weight given as tensors (the DB's, else the default), chosen once per shape."""
    n, k = scales.shape[1], scales.shape[0] * 32
    key = (tokens, n, k, fmt, activations, blocks.device)
    t = _STORED_TACTICS.get(key)
    if t is None:
        t = _STORED_TACTICS[key] = choose(
            DenseCall(tokens, n, k, fmt, db_tactic_lookup()), kernel_device(blocks.device), check_policy(activations),
            on_cuda=blocks.device.type == "cuda",
        ).tactics[0]  # fmt: skip
    return t


@torch.library.custom_op("prepkit::mx_linear_stored", mutates_args=())
def mx_linear_stored_op(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    activations: str,
) -> torch.Tensor:
    """``x [..., K]`` (bf16) -> ``[..., N]`` through the stored MX weight ``blocks``/``scales``.
    The weights are arguments, not a module id, so one compiled function serves every layer
    (:mod:`prepkit.integrations.decode_step`) without a recompile per module."""
    from prepkit.kernels.mx.dense import DenseMxWeights, launch_dense

    weights = DenseMxWeights(blocks, scales, fmt)
    x2 = x.reshape(-1, weights.k).to(torch.bfloat16).contiguous()
    out = torch.empty((x2.shape[0], weights.n), dtype=torch.bfloat16, device=x.device)
    tactic = stored_tactic(x2.shape[0], blocks, scales, fmt, activations)
    launch_dense(x2, weights, bias, tactic, check_policy(activations), out)
    return out.view(*x.shape[:-1], weights.n).to(x.dtype)


@mx_linear_stored_op.register_fake
def _mx_linear_stored_fake(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    activations: str,
) -> Any:
    return x.new_empty((*x.shape[:-1], scales.shape[1]))


@torch.library.custom_op("prepkit::mx_linear", mutates_args=())
def mx_linear_op(x: torch.Tensor, module_id: int, out_features: int) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., out_features]`` in ``x``'s dtype through MxLinear ``module_id``."""
    return registered_linear(module_id).run(x)


@mx_linear_op.register_fake
def _mx_linear_fake(x: torch.Tensor, module_id: int, out_features: int) -> Any:
    return x.new_empty((*x.shape[:-1], out_features))
