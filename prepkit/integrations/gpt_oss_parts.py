"""What the transformers integration's two ways in share: the supported transformers versions,
prepkit's MoE block for gpt-oss, the checks of a prepared set against a model config, and the
device rule of the kernel. Its own module so that the loader and the swap import it, not each
other."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from prepkit.distribution import install_hint
from prepkit.errors import DependencyError, DeviceError, LayoutError, RecipeError
from prepkit.manifest import Manifest
from prepkit.runtime.moe import WEIGHT_LAYOUT, MoeLayer, moe

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


def check_manifest_against_config(manifest: Manifest, config: Any, *, rank: int = 0, allow_split: bool = False) -> None:
    """Raise when the prepared shard set cannot serve the model with this config. A set split
    over ranks serves it only with ``allow_split`` (one process per rank, :mod:`prepkit.distributed`).

    Raises:
        LayoutError: not the bundled kernel's layout (id and version), split over ranks without
            ``allow_split``, or no ``rank``.
        RecipeError: a dim differs; the message names the field and both values.
    """
    layout = manifest.layout
    if layout.id != WEIGHT_LAYOUT:
        raise LayoutError(
            f"layout: the shard set is {layout.id!r} ({layout.name}), the kernel reads {WEIGHT_LAYOUT!r}",
            hint="prepare it with: prepkit prepare --layout triton-moe",
        )
    parallel = manifest.parallel
    if parallel.world_size != 1 and not allow_split:
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


def require_triton() -> None:
    """Raise DependencyError naming the extra to install when triton (the MoE kernel) is missing."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise DependencyError(
            "triton is not installed: prepkit's MoE kernel is a Triton kernel", hint=install_hint("gpu")
        )


def require_kernel_device(device: torch.device) -> None:
    """Raise when the kernel cannot run on ``device``: a CPU needs the Triton interpreter."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise DeviceError(
            "the model's MoE layers are on the CPU, where the kernel runs only on the Triton interpreter",
            hint="use a GPU, or set TRITON_INTERPRET=1 before importing triton (tiny models only)",
        )
