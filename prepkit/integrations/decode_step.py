"""One decoder layer's decode step as two pure functions on tensors, for ``torch.compile``.

Run module by module, a gpt-oss decode step is about 65 small kernels per layer (norms, rotary,
mask, softmax, casts, residual adds), and even inside a CUDA graph their launch gaps cost several
times the layer's bandwidth floor. Compiled, the elementwise and reduction work between the matrix
products fuses into a handful of kernels. The functions take every weight as a tensor argument, not
the layer's modules, so one compiled graph serves every layer (sliding-window and full layers differ
only in the mask tensor) and nothing recompiles per layer.

The first half writes the new key and value into the caller's cache; the second builds the
causal (and sliding-window) mask from the device-side position inside the graph, so the mask fuses
into the softmax. After the second half the caller runs the MoE, whose Triton launches a graph
capture records as they are. The operations follow transformers' eager
gpt-oss modules one for one (RMS norm in fp32, rotary on halves, bf16 scores plus an additive mask
and a sink column), so a compiled step differs from the eager one only in the order of floating
point reductions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
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


@dataclass(frozen=True)
class LayerWeights:
    """The tensors of one decoder layer that the decode step reads, besides the MoE's experts.
    q, k and v are one matrix (``qkv_weight`` ``[q + k + v rows, H]``): one pass over the
    activations and one launch instead of three small ones."""

    input_norm: torch.Tensor
    qkv_weight: Weight
    qkv_bias: torch.Tensor | None
    o_weight: Weight
    o_bias: torch.Tensor | None
    sinks: torch.Tensor
    post_norm: torch.Tensor
    router_weight: torch.Tensor
    router_bias: torch.Tensor

    @classmethod
    def of(cls, layer: Any) -> LayerWeights:
        """The layer's tensors, its q/k/v projections packed into one matrix first (the modules'
        weights become views of it, so the model keeps one copy and computes as before)."""
        attn, router = layer.self_attn, layer.mlp.router
        fused = getattr(attn, "qkv_proj", None)  # MX projections, fused when they were loaded
        if fused is not None:
            qkv_weight: Weight | None = MxWeight.of(fused)
            qkv_bias = fused.bias
        else:
            qkv_weight = pack_projections(attn.q_proj, attn.k_proj, attn.v_proj, "weight")
            qkv_bias = pack_projections(attn.q_proj, attn.k_proj, attn.v_proj, "bias")
        tensors = (
            layer.input_layernorm.weight, qkv_weight, qkv_bias, weight_of(attn.o_proj), attn.o_proj.bias,
            attn.sinks, layer.post_attention_layernorm.weight, router.weight, router.bias,
        )  # fmt: skip
        # Plain tensors (detached views of the parameters), so compiled code treats them as inputs.
        return cls(*(t.detach() if isinstance(t, torch.Tensor) else t for t in tensors))  # type: ignore[arg-type]


def pack_projections(q: nn.Linear, k: nn.Linear, v: nn.Linear, name: str) -> torch.Tensor | None:
    """``q``, ``k`` and ``v``'s parameter ``name`` concatenated along the output rows; each module's
    parameter becomes a view of the packed tensor, so the model holds one copy and computes as
    before (packing again makes a fresh copy and frees the last)."""
    parts = [getattr(m, name) for m in (q, k, v)]
    if any(p is None for p in parts):
        return None
    packed = torch.cat([p.detach() for p in parts])
    start = 0
    for module, part in zip((q, k, v), parts, strict=True):
        view = packed[start : start + part.shape[0]]
        setattr(module, name, nn.Parameter(view, requires_grad=part.requires_grad))
        start += part.shape[0]
    return packed


def project(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, as_reduction: bool) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``as_reduction`` written as a multiply and a sum over
    K (fp32), which the compiler turns into one kernel that streams the weight rows: at one token
    a library GEMM of a few thousand rows leaves most of the bandwidth unused. An MX weight runs
    the bundled dense kernel (one opaque op)."""
    if isinstance(weight, MxWeight):
        return torch.ops.prepkit.mx_linear_stored(x, weight.blocks, weight.scales, bias, weight.fmt, weight.activations)
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


def embed(
    ids: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input rows of ``ids`` and gpt-oss's rotary ``cos``/``sin`` at ``positions`` (``[B, T]``,
    each row's own token positions: a left-padded row's start later than its cache slots)."""
    hidden = F.embedding(ids, table)
    freqs = positions[..., None].float() * inv_freq.float()
    return hidden, (freqs.cos() * scaling).to(hidden.dtype), (freqs.sin() * scaling).to(hidden.dtype)


def token_positions(slots: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Each row's token positions ``[B, T]`` at cache ``slots`` ``[T]``: a row left-padded with
    ``pad[b]`` slots counts from its first real token (as transformers' position ids do)."""
    return (slots[None, :] - pad[:, None]).clamp_min(0)


def attention_in(
    hidden: torch.Tensor,
    mlp_out: torch.Tensor | None,
    w: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    head_dim: int,
    as_reduction: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after the previous layer's MoE (``mlp_out`` added, unless this is the
    first layer) and this layer's rotated query ``[B, heads, T, D]``; the rotated key and the
    value are written into the cache (``keys``/``values`` ``[B, kv_heads, max_len, D]``) at
    ``positions``. ``as_reduction``: see :func:`project`."""
    if mlp_out is not None:
        hidden = hidden + mlp_out
    batch, tokens, _ = hidden.shape
    kv_rows = keys.shape[1] * head_dim
    qkv = project(rms_norm(hidden, w.input_norm, eps), w.qkv_weight, w.qkv_bias, as_reduction)
    query, key, value = qkv.split([qkv.shape[-1] - 2 * kv_rows, kv_rows, kv_rows], dim=-1)
    query = query.reshape(batch, tokens, -1, head_dim).transpose(1, 2)
    key = key.reshape(batch, tokens, -1, head_dim).transpose(1, 2)
    value = value.reshape(batch, tokens, -1, head_dim).transpose(1, 2)
    keys.index_copy_(2, positions, rotate(key, cos, sin))
    values.index_copy_(2, positions, value)
    return hidden, rotate(query, cos, sin)


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
    with one learned sink logit
    per head -> ``[B, T, heads * D]``, as transformers' eager attention computes it."""
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


def attention_out(
    hidden: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    pad: torch.Tensor,
    window: int | None,
    w: LayerWeights,
    scaling: float,
    eps: float,
    as_reduction: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``query`` over the cache (causal, within ``window`` positions for a
    sliding-window layer, past each row's left padding ``pad``) with the learned sinks, the output
    projection and the residual; then the MoE's input (the post-attention norm, ``[B*T, H]``) and router logits."""
    mask = additive_mask(torch.arange(keys.shape[2], device=keys.device), positions, window, query.dtype, pad)
    out = attend(query, keys, values, mask, w.sinks, scaling)
    hidden = hidden + project(out, w.o_weight, w.o_bias, as_reduction)
    x = rms_norm(hidden, w.post_norm, eps).flatten(0, 1)
    return hidden, x, project(x, w.router_weight, w.router_bias, as_reduction)


def head(hidden: torch.Tensor, mlp_out: torch.Tensor, norm: torch.Tensor, lm_head: Weight, eps: float) -> torch.Tensor:
    """The last layer's residual, the final norm and the head on the last position -> logits
    ``[B, vocab]``."""
    hidden = (hidden + mlp_out)[:, -1:]
    return project(rms_norm(hidden, norm, eps), lm_head, None, False)[:, -1]
