"""Hugging Face transformers' gpt-oss running prepkit's MoE kernel from prepared shards.

``from_prepared(prepared_dir)`` (:mod:`prepkit.integrations.gpt_oss_loader`) builds the whole
model from the prepared set alone, with the experts in MXFP4 from the start; it is the way in
for a model too large to hold in bf16.

``use_prepkit_moe(model, prepared_dir)`` replaces each decoder layer's ``mlp`` (router + experts)
with a :class:`PrepkitMoeBlock` that keeps transformers' router module (its logits feed the
kernel, which does the top-k and softmax itself) and runs the experts through
:func:`prepkit.runtime.moe` on shards prepared with ``prepkit prepare --layout triton-moe``.
Attention, norms, embeddings, caches and generation stay transformers'.

Supported: transformers ``>=5.23,<6`` (tested with 5.23.0), whose ``GptOssMLP.forward`` takes
``[B, S, H]`` and returns ``(hidden_states, router_scores)``; the version is checked at call time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from prepkit.constants import DEFAULT_DENSE_FORMAT
from prepkit.errors import RecipeError
from prepkit.integrations.gpt_oss_loader import from_prepared
from prepkit.integrations.gpt_oss_parts import (
    SUPPORTED_TRANSFORMERS,
    TESTED_TRANSFORMERS,
    PrepkitMoeBlock,
    check_manifest_against_config,
    check_transformers_version,
    require_kernel_device,
    supported_range,
)
from prepkit.integrations.static_decode import PrepkitDecoder, generate_greedy
from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.manifest import Manifest
from prepkit.runtime.moe import load_moe_layers


def use_prepkit_moe(
    model: nn.Module,
    prepared_dir: str | Path,
    *,
    rank: int = 0,
    activations: ActivationPolicy = "bf16",
) -> nn.Module:
    """Swap every decoder layer's MoE block of a transformers gpt-oss ``model`` for prepkit's
    kernel on ``prepared_dir`` (``prepkit prepare --layout triton-moe``, tp=1 ep=1), and return
    the model. The experts load onto the device of each layer's router; on a CPU the kernel
    runs only under the Triton interpreter (``TRITON_INTERPRET=1`` before triton is imported).
    A shard set prepared with ``--dense mxfp8|mxfp4`` also replaces the model's q/k/v/o
    projections and lm_head with its MX linears (same policy), on the first router's device.

    Raises:
        DependencyError: transformers is missing or of an unsupported version.
        RecipeError: not a gpt-oss model, or a config field that differs from the manifest (named,
            with both values).
        LayoutError: the shard set is not ``triton_moe_v3``, is split, or lacks ``rank``.
        DeviceError: layers on a CPU without the Triton interpreter.
        VerifyError: a shard file is missing or disagrees with the manifest.
    """
    check_transformers_version()
    check_policy(activations)
    decoder_layers = _decoder_layers(model)
    config = model.config
    manifest = Manifest.read(prepared_dir)
    check_manifest_against_config(manifest, config, rank=rank)
    devices = [_router_device(_router_of(layer, i)) for i, layer in enumerate(decoder_layers)]
    for device in set(devices):
        require_kernel_device(device)
    for index, decoder in enumerate(decoder_layers):
        router = _router_of(decoder, index)
        loaded = load_moe_layers(prepared_dir, rank, _router_device(router), layers=[index], activations=activations)
        # Assigning the new block drops the last reference to the old experts' parameters.
        decoder.mlp = PrepkitMoeBlock(router, loaded[index], index)
    if manifest.dense_format != DEFAULT_DENSE_FORMAT:
        from prepkit.integrations.dense_swap import read_mx_parts, swap_in_mx_linears

        # The prepared set's MX dense weights replace the model's own (freed as each goes).
        parts = read_mx_parts(Path(prepared_dir), manifest.rank_shared_files(rank), devices[0])
        swap_in_mx_linears(model, parts, manifest.dense_format, activations)
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt_oss":
        raise RecipeError(
            f"model_type: the model is {getattr(config, 'model_type', type(model).__name__)!r}, expected 'gpt_oss'"
        )
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RecipeError(f"{type(model).__name__} has no decoder layers at .model.layers")
    return list(layers)


def _router_of(decoder: nn.Module, index: int) -> nn.Module:
    mlp = getattr(decoder, "mlp", None)
    if isinstance(mlp, PrepkitMoeBlock):
        raise RecipeError(f"layer {index} already runs prepkit's MoE", hint="call use_prepkit_moe once per model")
    router = getattr(mlp, "router", None)
    if router is None or not isinstance(getattr(router, "weight", None), torch.Tensor):
        raise RecipeError(f"layer {index}: {type(mlp).__name__} has no router with a weight (not gpt-oss's MoE block)")
    return router


def _router_device(router: nn.Module) -> torch.device:
    weight = router.weight
    assert isinstance(weight, torch.Tensor)  # _router_of checked it
    return weight.device


__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "TESTED_TRANSFORMERS",
    "PrepkitDecoder",
    "PrepkitMoeBlock",
    "from_prepared",
    "require_kernel_device",
    "supported_range",
    "check_manifest_against_config",
    "check_transformers_version",
    "generate_greedy",
    "use_prepkit_moe",
]
