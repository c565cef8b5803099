"""The decode step of a gpt-oss model (one token per row) as pure functions on tensors, run
eagerly or through ``torch.compile``.

A layer's step is the three ops of :mod:`prepkit.integrations.decode_ops` (norm and q/k/v; rotary,
cache write and attention; output projection and residual), then the router's norm and projection,
then the MoE. The functions take every weight as a tensor argument, not the layer's modules, so one
compiled graph serves every layer (sliding-window and full layers differ only in ``window``) and
nothing recompiles per layer. The MoE and the tensor-parallel hooks run between the compiled pieces
(see :class:`DecodeStep`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from prepkit.integrations.decode_ops import TORCH_OPS, Ops, Weight, token_positions, weight_of


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
    return summed, ops.linear(out, w.o_weight, w.o_bias)


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

    @classmethod
    def kernels(cls) -> Pieces:
        """For ops that are kernels of their own (:mod:`prepkit.integrations.kernel_ops`): only the
        embedding and the rotary angles compile (one graph); the layers and the head run their
        launches as they are."""
        return cls(torch.compile(embed, fullgraph=True, dynamic=False), attention, attention_unreduced, mlp_in, head)


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
    kernels: bool = False  # the ops are kernels: only the embedding compiles (Pieces.kernels)
    pieces: Pieces = field(init=False)

    def __post_init__(self) -> None:
        if self.kernels:
            self.pieces = Pieces.kernels()
        else:
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


def moe_call(mlp: Any, out_dtype: torch.dtype | None = None) -> MoeCall:
    """The MoE call of a decoder layer's ``mlp``: prepkit's kernel on the step's router logits, or
    (transformers' own block) the module, whose router computes the same logits again.
    ``out_dtype=torch.float32`` keeps prepkit's accumulator as it is: the next op casts it while it
    adds it (one launch fewer), with the same bf16 rounding."""
    layer = getattr(mlp, "moe_layer", None)
    if layer is not None:
        from prepkit.runtime.moe import moe

        return functools.partial(moe, layer, out_dtype=out_dtype)

    def module(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return mlp(x[:, None])[0][:, 0]

    return module


def step_of_model(
    model: Any,
    *,
    ops: Ops = TORCH_OPS,
    compiled: bool = False,
    kernels: bool = False,
    reduce: Hook | None = None,
    gather: Hook | None = None,
    reduce_fp32: bool = False,
) -> DecodeStep:
    """The decode step of a transformers gpt-oss ``model`` (its q/k/v fused on the way);
    ``kernels``: ``ops`` are launches of their own (see :class:`DecodeStep`). With ``kernels``
    the MoE hands its output on in fp32 (the next op rounds it to bf16 as it adds it, one launch
    fewer): on one rank always, under ``reduce`` when ``reduce_fp32`` says the sum takes fp32 at
    no extra cost."""
    config, base = model.config, model.model
    eps = float(base.norm.variance_epsilon)
    windows = {"full_attention": None, "sliding_attention": config.sliding_window}
    layers = [
        Layer(
            LayerWeights.of(layer),
            LayerShape(eps, float(layer.self_attn.scaling), windows[config.layer_types[index]]),
            moe_call(layer.mlp, torch.float32 if kernels and (reduce is None or reduce_fp32) else None),
        )
        for index, layer in enumerate(base.layers)
    ]
    rotary = base.rotary_emb
    return DecodeStep(
        layers, base.embed_tokens.weight.detach(), rotary.inv_freq, float(rotary.attention_scaling),
        base.norm.weight.detach(), weight_of(model.lm_head), eps, ops, reduce, gather, compiled,
        kernels,
    )  # fmt: skip
