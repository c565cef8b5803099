"""``torch.ops.prepkit.moe``: :func:`prepkit.runtime.moe` as a registered torch operator, so that
``torch.compile`` (``fullgraph=True``) and CUDA-graph capture see one opaque node, not a graph break.

The op takes the activations, the router logits and a *layer id*, not the layer's tensors: a
:class:`~prepkit.runtime.moe.MoeLayer` carries state that no op argument can (its tactic lookup,
the per-token-count variant choice, the fallback after a failed compile), and its six weight
tensors never change after load. Each layer registers itself here once, at construction; the id is
a plain int attribute, which ``torch.compile`` bakes into the graph as a constant. The registry
holds weak references, so registering keeps no layer alive.
"""

from __future__ import annotations

from typing import Protocol

import torch

from prepkit.runtime.registry import WeakRegistry


class EagerLayer(Protocol):
    """What the op needs of a layer: its eager call (a :class:`~prepkit.runtime.moe.MoeLayer`'s;
    named by this protocol so that the op does not import the module that imports it)."""

    def run_eager(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor: ...


_LAYERS: WeakRegistry[EagerLayer] = WeakRegistry("torch.ops.prepkit.moe", "MoeLayer")


def register(layer: EagerLayer) -> int:
    """A new id under which the op finds ``layer`` (held weakly; the id is dropped with it)."""
    return _LAYERS.add(layer)


def registered_layer(layer_id: int) -> EagerLayer:
    """The layer behind ``layer_id``.

    Raises:
        KeyError: no live layer has that id (it was never registered, or has been freed).
    """
    return _LAYERS.get(layer_id)


@torch.library.custom_op("prepkit::moe", mutates_args=())
def moe_op(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, layer_id: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """``[T, H]`` activations, ``[T, E]`` router logits -> ``[T, H]`` in ``out_dtype``, through
    layer ``layer_id``'s experts (eagerly: the op body is the plain :func:`~prepkit.runtime.moe` call)."""
    return registered_layer(layer_id).run_eager(hidden_states, router_logits, out_dtype)


@moe_op.register_fake
def _moe_fake(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, layer_id: int, out_dtype: torch.dtype
) -> torch.Tensor:
    # The shape and dtype only; the real call checks shapes against the layer.
    torch._check(router_logits.shape[0] == hidden_states.shape[0])
    return hidden_states.new_empty(hidden_states.shape, dtype=out_dtype)
