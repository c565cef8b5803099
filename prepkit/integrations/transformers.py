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

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prepkit.constants import DEFAULT_DENSE_FORMAT
from prepkit.distribution import install_hint
from prepkit.errors import DependencyError, DeviceError, LayoutError, RecipeError
from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.manifest import Manifest
from prepkit.runtime.moe import WEIGHT_LAYOUT, MoeLayer, load_moe_layers, moe

SUPPORTED_TRANSFORMERS = ((5, 23), (6, 0))  # [lowest, first unsupported)
TESTED_TRANSFORMERS = "5.23.0"


def supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TRANSFORMERS
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def check_transformers_version(version: str | None = None) -> str:
    """The installed (or given) transformers version, when this module supports it.

    Raises:
        DependencyError: transformers is missing or outside :data:`SUPPORTED_TRANSFORMERS`.
    """
    if version is None:
        try:
            import transformers
        except ImportError as err:
            raise DependencyError(
                "transformers is not installed",
                hint=f"{install_hint('transformers')} (transformers{supported_range()})",
            ) from err
        version = str(transformers.__version__)
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise DependencyError(f"transformers version {version!r} is not a release number")
    have = (int(found[1]), int(found[2]))
    lo, hi = SUPPORTED_TRANSFORMERS
    if not lo <= have < hi:
        raise DependencyError(
            f"transformers {version} is not supported: prepkit's gpt-oss MoE swap supports transformers"
            f"{supported_range()} (tested with {TESTED_TRANSFORMERS})",
            hint=f"pip install 'transformers{supported_range()}'",
        )
    return version


class PrepkitMoeBlock(nn.Module):
    """Drop-in for transformers' ``GptOssMLP``: same input, same ``(hidden_states, router_scores)``.

    The expert tensors live in ``layer`` (a :class:`MoeLayer`), not as parameters: they are not
    trainable, not in ``state_dict`` and not moved by ``model.to``; they stay on the device they
    were loaded onto.
    """

    def __init__(self, router: nn.Module, layer: MoeLayer, index: int) -> None:
        super().__init__()
        self.router = router  # kept as transformers' module so its output hooks (router_logits) still fire
        self.moe_layer = layer
        self.layer_index = index

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden)
        router_logits, router_scores, _ = self.router(flat)
        out = moe(self.moe_layer, flat, router_logits)
        return out.reshape(batch, seq, hidden), router_scores

    def extra_repr(self) -> str:
        layer = self.moe_layer
        return (
            f"layer={self.layer_index}, experts={layer.num_experts}, hidden={layer.hidden}, "
            f"intermediate={layer.valid_intermediate}, top_k={layer.top_k}, activations={layer.activations!r}"
        )


@dataclass(frozen=True)
class _Field:
    manifest_key: str
    manifest_value: Any


def check_manifest_against_config(manifest: Manifest, config: Any, *, rank: int = 0) -> None:
    """Raise when the prepared shard set cannot serve the model with this config.

    Raises:
        LayoutError: not the bundled kernel's layout (id and version), split over ranks, or no ``rank``.
        RecipeError: a dim differs; the message names the field and both values.
    """
    layout = manifest.layout
    if layout.id != WEIGHT_LAYOUT:
        raise LayoutError(
            f"layout: the shard set is {layout.id!r} ({layout.name}), the kernel reads {WEIGHT_LAYOUT!r}",
            hint="prepare it with: prepkit prepare --layout triton-moe",
        )
    parallel = manifest.parallel
    if parallel.world_size != 1:
        # transformers runs the model in one process; ranks' partial outputs would need an all-reduce.
        raise LayoutError(
            f"parallel: the shard set is split tp={parallel.tp_size} ep={parallel.ep_size}, "
            "the transformers integration needs tp=1 ep=1",
            hint="prepare it with: prepkit prepare --layout triton-moe --tp 1 --ep 1",
        )
    if manifest.rank_record(rank) is None:
        raise LayoutError(f"rank: the shard set holds ranks {sorted(r.rank for r in manifest.ranks)}, not {rank}")
    dims = manifest.model.dims
    fields = {
        "num_hidden_layers": _Field("num_layers", dims.num_layers),
        "num_local_experts": _Field("num_experts", dims.num_experts),
        "hidden_size": _Field("hidden", dims.hidden),
        "intermediate_size": _Field("intermediate", dims.intermediate),
        "num_experts_per_tok": _Field("top_k", dims.top_k),
    }
    for key, expected in fields.items():
        have = getattr(config, key, None)
        if have != expected.manifest_value:
            raise RecipeError(
                f"{key}: the model config says {have}, the prepared shards' {expected.manifest_key} is "
                f"{expected.manifest_value}",
                hint="prepare the shards from this model's checkpoint",
            )
    facts = manifest.rank_record(rank).facts  # type: ignore[union-attr]
    for key in ("swiglu_limit", "swiglu_alpha"):
        have, prepared = getattr(config, key, None), facts.get(key)
        if have is not None and prepared is not None and float(have) != float(prepared):
            raise RecipeError(f"{key}: the model config says {have}, the prepared shards say {prepared}")


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


def require_kernel_device(device: torch.device) -> None:
    """Raise when the kernel cannot run on ``device``: a CPU needs the Triton interpreter."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise DeviceError(
            "the model's MoE layers are on the CPU, where the kernel runs only on the Triton interpreter",
            hint="use a GPU, or set TRITON_INTERPRET=1 before importing triton (tiny models only)",
        )


def __getattr__(name: str) -> Any:
    # The loader builds on this module's block and checks: re-exported on first use, so that
    # either module may be imported first.
    if name == "from_prepared":
        from prepkit.integrations.gpt_oss_loader import from_prepared

        return from_prepared
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


# Graph-captured greedy decoding has its own module; it is part of this integration's surface.
from prepkit.integrations.static_decode import PrepkitDecoder, generate_greedy  # noqa: E402

__all__ = [
    "PrepkitDecoder",
    "PrepkitMoeBlock",
    "check_manifest_against_config",
    "check_transformers_version",
    "generate_greedy",
    "use_prepkit_moe",
]
