"""The decode step's three ops (one token per row) and their torch implementations.

- :func:`norm_linear`: residual add, RMS norm, projection (q/k/v; the router; the head);
- :func:`rope_cache_attend`: rotary on q and k, the cache write at the device-side position, and
  attention with the learned sinks over the row's live slots;
- :func:`linear_residual`: the output projection and the residual add.

:class:`Ops` holds the three, so that other implementations with the same signatures plug in (the
Triton kernels of :mod:`prepkit.integrations.kernel_ops`); :data:`TORCH_OPS` follows transformers'
eager gpt-oss modules one for one (RMS norm in fp32, rotary on halves, bf16 scores plus an additive
mask and a sink column, bf16 between modules), so the eager step gives the modules' numbers, and
it is the reference the kernels are checked against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class MxWeight:
    """A dense weight prepared in MX (:class:`~prepkit.runtime.dense.MxLinear`'s buffers), passed
    as tensors so that one compiled function serves every layer's."""

    blocks: torch.Tensor
    scales: torch.Tensor
    fmt: str
    activations: str

    @classmethod
    def of(cls, linear: Any) -> MxWeight:
        return cls(linear.weight_blocks.detach(), linear.weight_scales.detach(), linear.fmt, linear.activations)


Weight = torch.Tensor | MxWeight


def weight_of(linear: Any) -> Weight:
    """A Linear's weight, or the stored form of an MX linear's."""
    return MxWeight.of(linear) if hasattr(linear, "weight_blocks") else linear.weight.detach()


def project(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, as_reduction: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``as_reduction`` written as a multiply and a sum over
    K (fp32), which the compiler turns into one kernel that streams the weight rows: at one token
    a library GEMM of a few thousand rows leaves most of the bandwidth unused. An MX weight runs
    the bundled dense kernel (one opaque op under compile)."""
    if isinstance(weight, MxWeight):
        from prepkit.runtime.dense import mx_linear

        return mx_linear(x, weight.blocks, weight.scales, bias, weight.fmt, weight.activations)
    if not as_reduction:
        return F.linear(x, weight, bias)
    out = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gpt-oss's RMS norm: in fp32, the weight applied before the cast back."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """gpt-oss's rotary embedding on ``[B, heads, T, D]`` with ``cos``/``sin`` ``[B, T, D/2]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def token_positions(slots: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Each row's token positions ``[B, T]`` at cache ``slots`` ``[T]``: a row left-padded with
    ``pad[b]`` slots counts from its first real token (as transformers' position ids do)."""
    return (slots[None, :] - pad[:, None]).clamp_min(0)


def additive_mask(
    key_index: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
    pad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive mask for queries at cache slots ``positions`` ``[T]`` over cache slots
    ``key_index``: causal, within ``window`` slots for a sliding-window layer, and past each row's
    ``pad`` (``[B]`` left-padding slots). ``[T, max_len]`` without ``pad``, else ``[B, 1, T, max_len]``."""
    allowed = key_index[None, :] <= positions[:, None]
    if window is not None:
        allowed = allowed & (key_index[None, :] > positions[:, None] - window)
    if pad is not None:
        allowed = allowed[None, None] & (key_index[None, None, None, :] >= pad[:, None, None, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=key_index.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """gpt-oss attention of ``query`` ``[B, heads, T, D]`` over the cache (``keys``/``values``
    ``[B, kv_heads, max_len, D]``, additive ``mask`` ``[T, max_len]`` or ``[B, 1, T, max_len]``)
    with one learned sink logit per head -> ``[B, T, heads * D]``, as transformers' eager
    attention computes it."""
    batch, heads, tokens, head_dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    # Heads kv*group .. kv*group+group-1 share kv head kv: fold the group into the rows
    # (row g*T + t) instead of repeating the cache per head.
    query = query.reshape(batch, kv_heads, group * tokens, head_dim)
    repeats = (group, 1) if mask.dim() == 2 else (1, 1, group, 1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling + mask.repeat(*repeats)
    sinks = sinks.reshape(1, kv_heads, group, 1, 1).expand(batch, -1, -1, tokens, -1)
    scores = torch.cat([scores, sinks.reshape(batch, kv_heads, group * tokens, 1)], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(values.dtype)
    out = torch.matmul(probs, values).reshape(batch, heads, tokens, head_dim).transpose(1, 2)
    return out.reshape(batch, tokens, heads * head_dim)


def norm_linear(
    hidden: torch.Tensor,
    add: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Weight,
    bias: torch.Tensor | None,
    want_normed: bool,
    *,
    as_reduction: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``hidden [B, H]`` plus ``add`` (cast to bf16 first; none for the first layer), its RMS norm,
    and the norm's projection -> ``(summed, summed's projection [B, N], the norm if want_normed)``.
    ``as_reduction``: see :func:`project`."""
    summed = hidden if add is None else hidden + add.to(hidden.dtype)
    normed = rms_norm(summed, norm_weight, eps)
    return summed, project(normed, weight, bias, as_reduction), normed if want_normed else None


def rope_cache_attend(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    pad: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """The fused projection ``qkv [B, (Hq + 2 Hkv) D]`` -> attention output ``[B, Hq D]``: q and k
    rotated (``cos``/``sin`` ``[B, D/2]``), k and v written into ``keys``/``values``
    ``[B, Hkv, L, D]`` at slot ``position`` (0-d, on the device), then attention over each row's
    slots past its left padding ``pad [B]``, causal and within ``window`` slots for a
    sliding-window layer, with one sink logit per head. Masks the rest of the cache rather than
    slicing it, so that shapes never depend on the position."""
    batch = qkv.shape[0]
    kv_heads, length, head_dim = keys.shape[1], keys.shape[2], keys.shape[3]
    kv_rows = kv_heads * head_dim
    query, key, value = qkv.split([qkv.shape[-1] - 2 * kv_rows, kv_rows, kv_rows], dim=-1)
    query = query.reshape(batch, 1, -1, head_dim).transpose(1, 2)
    key = key.reshape(batch, 1, kv_heads, head_dim).transpose(1, 2)
    value = value.reshape(batch, 1, kv_heads, head_dim).transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]
    slots = position.view(1)
    keys.index_copy_(2, slots, rotate(key, cos, sin))
    values.index_copy_(2, slots, value)
    mask = additive_mask(torch.arange(length, device=keys.device), slots, window, qkv.dtype, pad)
    return attend(rotate(query, cos, sin), keys, values, mask, sinks, scaling).reshape(batch, -1)


def linear_residual(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    as_reduction: bool = False,
) -> torch.Tensor:
    """``residual + (x @ weight.T + bias)``, the projection rounded to bf16 before the add."""
    return residual + project(x, weight, bias, as_reduction)


class NormLinear(Protocol):
    def __call__(
        self,
        hidden: torch.Tensor,
        add: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: Weight,
        bias: torch.Tensor | None,
        want_normed: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class RopeCacheAttend(Protocol):
    def __call__(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: torch.Tensor,
        pad: torch.Tensor,
        window: int | None,
        sinks: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor: ...


class LinearResidual(Protocol):
    def __call__(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor: ...


class Linear(Protocol):
    def __call__(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Ops:
    """The ops a layer's step runs; any implementation with these signatures plugs in. ``linear``
    (a projection alone) serves a tensor-parallel rank's output projection, whose residual waits
    for the sum over the ranks."""

    norm_linear: NormLinear
    rope_cache_attend: RopeCacheAttend
    linear_residual: LinearResidual
    linear: Linear = project


TORCH_OPS = Ops(norm_linear, rope_cache_attend, linear_residual)


def torch_ops(projections: str = "linear") -> Ops:
    """The torch ops with their projections as library GEMMs (``"linear"``, :data:`TORCH_OPS`) or
    as fp32 multiply-and-sum reductions (``"reduction"``, see :func:`project`)."""
    if projections == "linear":
        return TORCH_OPS
    if projections == "reduction":
        return Ops(
            functools.partial(norm_linear, as_reduction=True),
            rope_cache_attend,
            functools.partial(linear_residual, as_reduction=True),
            functools.partial(project, as_reduction=True),
        )
    raise ValueError(f"projections must be 'reduction' or 'linear', got {projections!r}")
