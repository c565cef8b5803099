"""Run prepared MoE layers on the GPU. Importing this package is cheap: no click, rich or
huggingface_hub, and triton only on the first kernel call."""

from __future__ import annotations

from typing import Any

from prepkit.runtime.dense import DenseTacticLookup, MxLinear
from prepkit.runtime.moe import MoeLayer, TacticLookup, default_tactics_for, load_moe_layers, moe
from prepkit.tactics.keys import Environment, ProblemKey, gpt_oss_problems
from prepkit.tactics.lookup import (
    TacticResolver,
    TacticTable,
    lookup_tactic,
    make_dense_tactic_lookup,
    make_tactic_lookup,
)

# What engines call: layers and shards, and the tactic lookup behind them.
__all__ = [
    "DenseTacticLookup",
    "Environment",
    "LoadedShards",
    "MoeLayer",
    "MxLinear",
    "ProblemKey",
    "TacticLookup",
    "TacticResolver",
    "TacticTable",
    "default_tactics_for",
    "gpt_oss_problems",
    "load_moe_layers",
    "load_shards",
    "lookup_tactic",
    "make_dense_tactic_lookup",
    "make_tactic_lookup",
    "moe",
]


def __getattr__(name: str) -> Any:
    # The shard loader lives in its own module and pulls in more; load it on first use.
    if name in ("load_shards", "LoadedShards"):
        from prepkit.runtime import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'prepkit.runtime' has no attribute {name!r}")
