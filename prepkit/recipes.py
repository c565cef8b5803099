"""Per-model data (hub repo, pinned revision, tensor names and shapes) from ``recipes/*.json``.

Recipes hold names and shape *formulas*; actual dims come from the checkpoint's config.json, so a
small synthetic gpt-oss checkpoint is prepared by the same recipe as the real one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prepkit.data import recipes_dir
from prepkit.dims import ModelDims
from prepkit.errors import RecipeError

RECIPES_ENV = "PREPKIT_RECIPES"


def recipes_root() -> Path:
    """The recipes folder: ``$PREPKIT_RECIPES`` when set (read at each call, so a change takes
    effect without a new process), else the bundled one."""
    return Path(os.environ.get(RECIPES_ENV) or recipes_dir())


DTYPES = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32}
SAFETENSORS_DTYPES = {
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "F8_E4M3": torch.float8_e4m3fn,
}

# Spellings of the same config value across transformers versions and the original format.
CONFIG_ALIASES = {
    "num_local_experts": ("num_local_experts", "num_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "experts_per_token"),
}


@dataclass(frozen=True)
class TensorRule:
    template: str  # full name with ``{layer}`` where per-layer
    shape: tuple[str, ...]  # formulas over config keys, e.g. "2*intermediate_size"
    dtype: torch.dtype

    def name(self, layer: int | None = None) -> str:
        return self.template.format(layer=layer)


@dataclass(frozen=True)
class Recipe:
    name: str
    repo_id: str
    revision: str
    model_type: str
    quant_method: str
    reference_dims: dict[str, int]
    expert_prefix: str
    expert_tensors: dict[str, TensorRule]  # role (checkpoint suffix) -> rule
    layer_tensors: dict[str, TensorRule]
    global_tensors: dict[str, TensorRule]
    fetch: dict[str, list[str]]
    path: Path

    def expert_name(self, layer: int, role: str) -> str:
        return self.expert_tensors[role].name(layer)

    def output_expert_prefix(self, layer: int) -> str:
        return self.expert_prefix.format(layer=layer)


def available() -> list[str]:
    return sorted(p.stem for p in recipes_root().glob("*.json"))


def _known_models_hint() -> str:
    known = f"known models: {', '.join(available()) or 'none'}"
    return known + (f"; the folder is set by {RECIPES_ENV}" if os.environ.get(RECIPES_ENV) else "")


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a recipe by model name (``gpt-oss-120b``), hub id (``openai/gpt-oss-120b``) or path."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        wanted = str(name_or_path).split("/")[-1]
        path = recipes_root() / f"{wanted}.json"
    if not path.is_file():
        raise RecipeError(f"no recipe {str(name_or_path)!r} in {path.parent}", hint=_known_models_hint())
    try:
        raw = json.loads(path.read_text())
        layer_prefix = raw["layer_prefix"]
        expert_prefix = raw["expert_prefix"]

        def rules(table: dict[str, Any], prefix: str) -> dict[str, TensorRule]:
            return {k: TensorRule(prefix + k, tuple(v["shape"]), DTYPES[v["dtype"]]) for k, v in table.items()}

        return Recipe(
            name=raw["name"],
            repo_id=raw["repo_id"],
            revision=raw["revision"],
            model_type=raw["model_type"],
            quant_method=raw["quant_method"],
            reference_dims=dict(raw["reference_dims"]),
            expert_prefix=expert_prefix,
            expert_tensors=rules(raw["expert_tensors"], expert_prefix),
            layer_tensors=rules(raw["layer_tensors"], layer_prefix),
            global_tensors=rules(raw["global_tensors"], ""),
            fetch={k: list(v) for k, v in raw["fetch"].items()},
            path=path,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise RecipeError(f"recipe {path} is malformed: {err!r}") from err


def recipe_depth(name: str) -> int | None:
    """The decoder layers of the named recipe's model (``None`` for an unknown recipe)."""
    try:
        return int(load_recipe(name).reference_dims["num_hidden_layers"])
    except (RecipeError, KeyError, ValueError):
        return None


def config_value(config: dict[str, Any], key: str) -> Any:
    for alias in CONFIG_ALIASES.get(key, (key,)):
        if alias in config:
            return config[alias]
    raise KeyError(key)


_TERM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*|\d+)$")


def eval_dim(formula: str, config: dict[str, Any]) -> int:
    """Evaluate ``a*b``, ``2*x`` or ``x/32`` over config keys (no eval(): recipes are data)."""
    total: int | None = None
    for op, term in re.findall(r"(^|[*/])\s*([A-Za-z_0-9]+)", formula.replace(" ", "")):
        if not _TERM.match(term):
            raise RecipeError(f"bad shape formula {formula!r}")
        value = int(term) if term.isdigit() else int(config_value(config, term))
        if total is None:
            total = value
        elif op == "*":
            total *= value
        else:
            total //= value
    if total is None:
        raise RecipeError(f"bad shape formula {formula!r}")
    return total


def shape_of(rule: TensorRule, config: dict[str, Any]) -> tuple[int, ...]:
    return tuple(eval_dim(f, config) for f in rule.shape)


def model_dims(config: dict[str, Any]) -> ModelDims:
    return ModelDims(
        num_layers=int(config["num_hidden_layers"]),
        num_experts=int(config_value(config, "num_local_experts")),
        hidden=int(config["hidden_size"]),
        intermediate=int(config["intermediate_size"]),
        top_k=int(config_value(config, "num_experts_per_tok")),
    )


def check_config(recipe: Recipe, config: dict[str, Any], where: str) -> list[str]:
    """Every reason ``config`` cannot be prepared with ``recipe`` (empty when it can)."""
    problems: list[str] = []
    if config.get("model_type") != recipe.model_type:
        problems.append(f"{where}: model_type is {config.get('model_type')!r}, expected {recipe.model_type!r}")
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant != recipe.quant_method:
        problems.append(f"{where}: quantization_config.quant_method is {quant!r}, expected {recipe.quant_method!r}")
    for key in (
        "num_hidden_layers",
        "num_local_experts",
        "hidden_size",
        "intermediate_size",
        "num_experts_per_tok",
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ):
        try:
            value = config_value(config, key)
        except KeyError:
            problems.append(f"{where}: missing {key!r}")
            continue
        if not isinstance(value, int) or value <= 0:
            problems.append(f"{where}: {key} must be a positive integer, got {value!r}")
    for key in ("hidden_size", "intermediate_size"):
        value = config.get(key)
        if isinstance(value, int) and value % 32:
            problems.append(f"{where}: {key}={value} is not a multiple of the MXFP4 block (32)")
    return problems
