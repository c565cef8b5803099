"""One decoder layer's decode step as two pure functions on tensors, for ``torch.compile``.

Run module by module, a gpt-oss decode step is about 65 small kernels per layer (norms, rotary,
mask, softmax, casts, residual adds), and even inside a CUDA graph their launch gaps cost several
times the layer's bandwidth floor. Compiled, the elementwise and reduction work between the matrix
products fuses into a handful of kernels. The functions take every weight as a tensor argument, not
the layer's modules, so one compiled graph serves every layer (sliding-window and full layers differ
only in the mask tensor) and nothing recompiles per layer.

Between the two halves the caller writes the new key and value into its cache (in-place writes
into a cache are kept out of the compiled graphs), and after the second it runs the MoE, whose
Triton launches the graph capture records as they are. The operations follow transformers' eager
gpt-oss modules one for one (RMS norm in fp32, rotary on halves, bf16 scores plus an additive mask
and a sink column), so a compiled step differs from the eager one only in the order of floating
point reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class LayerWeights:
    """The tensors of one decoder layer that the decode step reads, besides the MoE's experts."""

    input_norm: torch.Tensor
    q_weight: torch.Tensor
    q_bias: torch.Tensor | None
    k_weight: torch.Tensor
    k_bias: torch.Tensor | None
    v_weight: torch.Tensor
    v_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    sinks: torch.Tensor
    post_norm: torch.Tensor
    router_weight: torch.Tensor
    router_bias: torch.Tensor

    @classmethod
    def of(cls, layer: nn.Module) -> LayerWeights:
        attn, router = layer.self_attn, layer.mlp.router
        tensors = (
            layer.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
            attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
            attn.sinks, layer.post_attention_layernorm.weight, router.weight, router.bias,
        )  # fmt: skip
        # Plain tensors (detached views of the parameters), so compiled code treats them as inputs.
        return cls(*(None if t is None else t.detach() for t in tensors))


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


def attention_in(
    hidden: torch.Tensor,
    mlp_out: torch.Tensor | None,
    w: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual stream after the previous layer's MoE (``mlp_out`` added, unless this is the
    first layer), and this layer's rotated query, key and value ``[B, heads, T, D]``."""
    if mlp_out is not None:
        hidden = hidden + mlp_out
    batch, tokens, _ = hidden.shape
    x = rms_norm(hidden, w.input_norm, eps)
    query = F.linear(x, w.q_weight, w.q_bias).view(batch, tokens, -1, head_dim).transpose(1, 2)
    key = F.linear(x, w.k_weight, w.k_bias).view(batch, tokens, -1, head_dim).transpose(1, 2)
    value = F.linear(x, w.v_weight, w.v_bias).view(batch, tokens, -1, head_dim).transpose(1, 2)
    return hidden, rotate(query, cos, sin), rotate(key, cos, sin), value


def attention_out(
    hidden: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    w: LayerWeights,
    scaling: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``query`` over the cache (``keys``/``values`` ``[B, kv_heads, max_len, D]``,
    additive ``mask`` ``[T, max_len]``) with the learned sinks, the output projection and the
    residual; then the MoE's input (the post-attention norm, ``[B*T, H]``) and router logits."""
    batch, heads, tokens, head_dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    # Heads kv*group .. kv*group+group-1 share kv head kv: fold the group into the rows.
    query = query.reshape(batch, kv_heads, group * tokens, head_dim)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling + mask.repeat(group, 1)
    sinks = w.sinks.reshape(1, kv_heads, group, 1, 1).expand(batch, -1, -1, tokens, -1)
    scores = torch.cat([scores, sinks.reshape(batch, kv_heads, group * tokens, 1)], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(values.dtype)
    out = torch.matmul(probs, values).reshape(batch, heads, tokens, head_dim).transpose(1, 2)
    hidden = hidden + F.linear(out.reshape(batch, tokens, heads * head_dim), w.o_weight, w.o_bias)
    x = rms_norm(hidden, w.post_norm, eps).reshape(batch * tokens, -1)
    return hidden, x, F.linear(x, w.router_weight, w.router_bias)


def head(hidden: torch.Tensor, mlp_out: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float):
    """The last layer's residual, the final norm and the head on the last position -> greedy ids
    ``[B, 1]``."""
    hidden = (hidden + mlp_out)[:, -1:]
    return F.linear(rms_norm(hidden, norm, eps), lm_head)[:, -1].argmax(-1, keepdim=True)
