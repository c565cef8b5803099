"""The decode step of a gpt-oss model (one token per row) as pure functions on tensors, run
eagerly or through ``torch.compile``.

A layer's step is three ops (their boundaries are shared with the kernels that replace them):

- :func:`norm_linear`: residual add, RMS norm, projection (q/k/v; the router; the head);
- :func:`rope_cache_attend`: rotary on q and k, the cache write at the device-side position, and
  attention with the learned sinks over the row's live slots;
- :func:`linear_residual`: the output projection and the residual add;

then the MoE. :class:`Ops` holds the three, so that other implementations with the same signatures
plug in; :data:`TORCH_OPS` is the torch one, which follows transformers' eager gpt-oss modules one
for one (RMS norm in fp32, rotary on halves, bf16 scores plus an additive mask and a sink column,
bf16 between modules), so the eager step gives the modules' numbers.

The functions take every weight as a tensor argument, not the layer's modules, so one compiled
graph serves every layer (sliding-window and full layers differ only in ``window``) and nothing
recompiles per layer. Run module by module, a decode step is about 65 small kernels per layer;
compiled, the elementwise and reduction work between the matrix products fuses into a handful.
The MoE and the tensor-parallel hooks run between the compiled pieces (see :class:`DecodeStep`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    router_bias: torch.Tensor | None

    @classmethod
    def of(cls, layer: Any) -> LayerWeights:
        """The layer's tensors. q, k and v are fused first unless they were at load
        (:func:`~prepkit.runtime.dense.fuse_projections`: the modules' tensors become views of the
        fused ones, so the model keeps one copy and computes as before)."""
        from prepkit.runtime.dense import fuse_projections

        attn, router = layer.self_attn, layer.mlp.router
        qkv = getattr(attn, "qkv_proj", None)  # MX projections are fused at load
        if qkv is None:
            qkv = fuse_projections([attn.q_proj, attn.k_proj, attn.v_proj])
        tensors = (
            layer.input_layernorm.weight, weight_of(qkv), qkv.bias, weight_of(attn.o_proj), attn.o_proj.bias,
            attn.sinks, layer.post_attention_layernorm.weight, router.weight, router.bias,
        )  # fmt: skip
        # Plain tensors (detached views of the parameters), so compiled code treats them as inputs.
        return cls(*(t.detach() if isinstance(t, torch.Tensor) else t for t in tensors))  # type: ignore[arg-type]


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


# --- The step's three ops: the torch implementations -------------------------------------------


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


@dataclass(frozen=True)
class Ops:
    """The three ops a layer's step runs; any implementation with these signatures plugs in."""

    norm_linear: NormLinear
    rope_cache_attend: RopeCacheAttend
    linear_residual: LinearResidual


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
        )
    raise ValueError(f"projections must be 'reduction' or 'linear', got {projections!r}")


# --- The step's pieces: what runs between the MoE and the hooks ----------------------------------


def embed(
    ids: torch.Tensor, table: torch.Tensor, position: torch.Tensor, pad: torch.Tensor, inv_freq: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The input rows of ``ids`` ``[B]`` and gpt-oss's rotary ``cos``/``sin`` ``[B, D/2]`` at cache
    slot ``position`` (a left-padded row's token position is ``pad[b]`` slots less)."""
    hidden = F.embedding(ids, table)
    freqs = token_positions(position.view(1), pad)[:, 0, None].float() * inv_freq.float()
    return hidden, (freqs.cos() * scaling).to(hidden.dtype), (freqs.sin() * scaling).to(hidden.dtype)


@dataclass(frozen=True)
class LayerShape:
    """What a layer's step needs besides its tensors: the norms' epsilon, the attention's score
    scaling and sliding window (``None``: full attention)."""

    eps: float
    scaling: float
    window: int | None


def attention_in(
    hidden: torch.Tensor,
    mlp_out: torch.Tensor | None,
    w: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    pad: torch.Tensor,
    shape: LayerShape,
    ops: Ops,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream with the previous layer's MoE output added (``summed``) and this
    layer's attention output (before the output projection)."""
    summed, qkv, _ = ops.norm_linear(hidden, mlp_out, w.input_norm, shape.eps, w.qkv_weight, w.qkv_bias, False)
    out = ops.rope_cache_attend(qkv, cos, sin, keys, values, position, pad, shape.window, w.sinks, shape.scaling)
    return summed, out


def mlp_in(
    hidden: torch.Tensor, add: torch.Tensor | None, w: LayerWeights, shape: LayerShape, ops: Ops
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden`` (plus ``add``) -> (that sum, the MoE's input ``[B, H]``, its router logits)."""
    hidden, logits, x = ops.norm_linear(hidden, add, w.post_norm, shape.eps, w.router_weight, w.router_bias, True)
    assert x is not None  # want_normed
    return hidden, x, logits


def attention(
    hidden: torch.Tensor,
    mlp_out: torch.Tensor | None,
    w: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    pad: torch.Tensor,
    shape: LayerShape,
    ops: Ops,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to its MoE: -> (the residual stream after attention, the MoE's input, router logits)."""
    summed, out = attention_in(hidden, mlp_out, w, cos, sin, keys, values, position, pad, shape, ops)
    hidden = ops.linear_residual(out, w.o_weight, w.o_bias, summed)
    return mlp_in(hidden, None, w, shape, ops)


def attention_unreduced(
    hidden: torch.Tensor,
    mlp_out: torch.Tensor | None,
    w: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    pad: torch.Tensor,
    shape: LayerShape,
    ops: Ops,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` up to the output projection, without the residual (a tensor-parallel rank
    holds a share of it): -> (the residual stream, this rank's projection)."""
    summed, out = attention_in(hidden, mlp_out, w, cos, sin, keys, values, position, pad, shape, ops)
    return summed, project(out, w.o_weight, w.o_bias)


def head(
    hidden: torch.Tensor, mlp_out: torch.Tensor, norm: torch.Tensor, lm_head: Weight, eps: float, ops: Ops
) -> torch.Tensor:
    """The last layer's residual, the final norm and the head -> logits ``[B, vocab]``."""
    return ops.norm_linear(hidden, mlp_out, norm, eps, lm_head, None, False)[1]


Hook = Callable[[torch.Tensor], torch.Tensor]
MoeCall = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (MoE input [B, H], router logits) -> [B, H]


@dataclass(frozen=True)
class Pieces:
    """The step's functions, plain or compiled (one graph each, the MoE and the hooks between)."""

    embed: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attention: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attention_unreduced: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    mlp_in: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    head: Callable[..., torch.Tensor]

    @classmethod
    def plain(cls) -> Pieces:
        return cls(embed, attention, attention_unreduced, mlp_in, head)

    @classmethod
    def compiled(cls) -> Pieces:
        def comp(fn: Callable[..., Any]) -> Callable[..., Any]:
            return torch.compile(fn, fullgraph=True, dynamic=False)

        return cls(comp(embed), comp(attention), comp(attention_unreduced), comp(mlp_in), comp(head))


@dataclass
class Layer:
    """One decoder layer as the step runs it: its tensors, its shape and its MoE call."""

    weights: LayerWeights
    shape: LayerShape
    moe: MoeCall


def layer_step(
    pieces: Pieces,
    layer: Layer,
    hidden: torch.Tensor,
    mlp_out: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    pad: torch.Tensor,
    ops: Ops,
    reduce: Hook | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of the decode step: ``hidden`` ``[B, H]`` (the residual stream before the
    previous layer's MoE output ``mlp_out`` is added) -> (this layer's residual stream after
    attention, its MoE output); writes the layer's cache at ``position``. ``reduce`` (tensor
    parallelism) sums the ranks' shares of the output projection and of the MoE output."""
    w, shape = layer.weights, layer.shape
    args = (hidden, mlp_out, w, cos, sin, keys, values, position, pad, shape, ops)
    if reduce is None:
        hidden, x, logits = pieces.attention(*args)
    else:
        summed, o = pieces.attention_unreduced(*args)
        hidden, x, logits = pieces.mlp_in(summed, reduce(o), w, shape, ops)
    out = layer.moe(x, logits)
    return hidden, out if reduce is None else reduce(out)


@dataclass
class DecodeStep:
    """Logits for one new token per row from the device-side state; every layer through
    :func:`layer_step`, eagerly or (``compiled``) through ``torch.compile``'d pieces.

    ``ops``: the layer ops (default :data:`TORCH_OPS`); ``reduce``: applied to the output
    projection before its residual add and to each MoE output; ``gather``: applied to the head's
    logits (both for tensor parallelism; ``None``: a single rank)."""

    layers: Sequence[Layer]
    embed_table: torch.Tensor
    inv_freq: torch.Tensor
    rope_scaling: float
    final_norm: torch.Tensor
    lm_head: Weight
    eps: float
    ops: Ops = TORCH_OPS
    reduce: Hook | None = None
    gather: Hook | None = None
    compiled: bool = False
    pieces: Pieces = field(init=False)

    def __post_init__(self) -> None:
        self.pieces = Pieces.compiled() if self.compiled else Pieces.plain()

    def __call__(
        self,
        ids: torch.Tensor,
        position: torch.Tensor,
        pad: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """``ids`` ``[B]`` at cache slot ``position`` (0-d) -> logits ``[B, vocab]``; writes each
        layer's ``keys``/``values`` ``[B, Hkv, L, D]`` at ``position``."""
        p = self.pieces
        hidden, cos, sin = p.embed(ids, self.embed_table, position, pad, self.inv_freq, self.rope_scaling)
        mlp_out: torch.Tensor | None = None
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            hidden, mlp_out = layer_step(
                p, layer, hidden, mlp_out, cos, sin, k, v, position, pad, self.ops, self.reduce
            )
        assert mlp_out is not None, "the model has layers"
        logits = p.head(hidden, mlp_out, self.final_norm, self.lm_head, self.eps, self.ops)
        return logits if self.gather is None else self.gather(logits)


def moe_call(mlp: Any) -> MoeCall:
    """The MoE call of a decoder layer's ``mlp``: prepkit's kernel on the step's router logits, or
    (transformers' own block) the module, whose router computes the same logits again."""
    layer = getattr(mlp, "moe_layer", None)
    if layer is not None:
        from prepkit.runtime.moe import moe

        return functools.partial(moe, layer)

    def module(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return mlp(x[:, None])[0][:, 0]

    return module


def step_of_model(
    model: Any,
    *,
    ops: Ops = TORCH_OPS,
    compiled: bool = False,
    reduce: Hook | None = None,
    gather: Hook | None = None,
) -> DecodeStep:
    """The decode step of a transformers gpt-oss ``model`` (its q/k/v fused on the way)."""
    config, base = model.config, model.model
    eps = float(base.norm.variance_epsilon)
    windows = {"full_attention": None, "sliding_attention": config.sliding_window}
    layers = [
        Layer(
            LayerWeights.of(layer),
            LayerShape(eps, float(layer.self_attn.scaling), windows[config.layer_types[index]]),
            moe_call(layer.mlp),
        )
        for index, layer in enumerate(base.layers)
    ]
    rotary = base.rotary_emb
    return DecodeStep(
        layers, base.embed_tokens.weight.detach(), rotary.inv_freq, float(rotary.attention_scaling),
        base.norm.weight.detach(), weight_of(model.lm_head), eps, ops, reduce, gather, compiled,
    )  # fmt: skip
