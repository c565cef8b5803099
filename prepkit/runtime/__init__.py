"""Run prepared MoE layers on the GPU. Importing this package is cheap: no click, rich or
huggingface_hub, and triton only on the first kernel call."""

from __future__ import annotations

from typing import Any

from prepkit.runtime.moe import MoeLayer, TacticLookup, default_tactics_for, load_moe_layers, moe

__all__ = ["LoadedShards", "MoeLayer", "TacticLookup", "default_tactics_for", "load_moe_layers", "load_shards", "moe"]


def __getattr__(name: str) -> Any:
    # The shard loader lives in its own module and pulls in more; load it on first use.
    if name in ("load_shards", "LoadedShards"):
        from prepkit.runtime import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'prepkit.runtime' has no attribute {name!r}")
