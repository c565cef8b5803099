"""Synthetic gpt-oss MXFP4 checkpoints in the exact hub root format, for tests and benchmarks.

Writes ``config.json``, ``generation_config.json``, ``model.safetensors.index.json`` and shards
``model-{i:05d}-of-{last:05d}.safetensors`` numbered from 0 (the hub's "of" is the last index),
with every tensor of every layer, sorted by name as the hub's converter sorted them, split at
tensor granularity so a layer's tensors can straddle two shards. Data is random, never zero;
Statistics follow gpt-oss's: E2M1 codes spread like quantized Gaussian weights, E8M0 scales
around 2^-9 .. 2^-6 (dequantized |w| near 1e-2), small biases, token ids inside the vocabulary,
so that Hugging Face transformers loads the folder and a forward pass stays in the SwiGLU's
unclamped range. Deterministic for a seed: each tensor draws from its own generator seeded by (seed, name).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from prepkit.constants import INDEX_NAME, SYNTH_RECORD
from prepkit.errors import CheckpointError
from prepkit.fsutil import sha256_file, temp_path, write_json_atomic
from prepkit.recipes import Recipe, load_recipe, shape_of

SYNTH_RECORD_FORMAT = "prepkit-synth/1"
SCALE_LOW, SCALE_HIGH = 118, 121  # E8M0 exponents 2^-9 .. 2^-6, where gpt-oss's experts sit
# Probability of each E2M1 magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6 for a Gaussian block whose
# largest of 32 values lands near code 6 (sigma about 2 code units), as a quantizer leaves them.
CODE_MAGNITUDE_WEIGHTS = (0.10, 0.19, 0.18, 0.15, 0.12, 0.15, 0.08, 0.03)
REAL_VOCAB_SIZE = 201088
# The hub's special ids (bos, pad, eos, <|call|>); a smaller vocabulary keeps its last four ids.
REAL_TOKEN_IDS = {"bos": 199998, "pad": 199999, "eos": 200002, "call": 200012}
DEFAULT_MAX_SHARD_BYTES = 4_800_000_000  # the hub converter's cap


def synthetic_config(
    *,
    num_layers: int = 2,
    num_experts: int = 4,
    hidden: int = 2880,
    intermediate: int = 2880,
    top_k: int = 4,
    vocab_size: int = 1024,
    num_attention_heads: int = 8,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
) -> dict[str, Any]:
    """A gpt-oss ``config.json`` with the hub's keys and spellings, dims as given."""
    ids = special_token_ids(vocab_size)
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "experts_per_token": top_k,
        "num_experts_per_tok": top_k,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "num_hidden_layers": num_layers,
        "num_local_experts": num_experts,
        "output_router_logits": False,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """bos / pad / eos / call ids: the hub's with the real vocabulary, else the last four ids,
    so every id indexes the embedding (transformers refuses a padding id outside it)."""
    if vocab_size >= REAL_VOCAB_SIZE:
        return dict(REAL_TOKEN_IDS)
    if vocab_size < len(REAL_TOKEN_IDS):
        raise CheckpointError(f"vocab_size {vocab_size} cannot hold the {len(REAL_TOKEN_IDS)} special token ids")
    return {name: vocab_size - len(REAL_TOKEN_IDS) + i for i, name in enumerate(REAL_TOKEN_IDS)}


def tensor_table(recipe: Recipe, config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor of a checkpoint with this config."""
    table: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for rules in (recipe.layer_tensors, recipe.expert_tensors):
            for rule in rules.values():
                table[rule.name(layer)] = (shape_of(rule, config), rule.dtype)
    for rule in recipe.global_tensors.values():
        table[rule.name()] = (shape_of(rule, config), rule.dtype)
    return table


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random, never-all-zero contents appropriate to the tensor's role."""
    g = _generator(seed, name)
    if dtype == torch.uint8 and name.endswith("_scales"):
        return torch.randint(SCALE_LOW, SCALE_HIGH + 1, shape, dtype=torch.uint8, generator=g)
    if dtype == torch.uint8:
        return _random_fp4_bytes(shape, g)
    values = torch.randn(shape, generator=g, dtype=torch.float32)
    values = 1.0 + 0.1 * values if name.endswith("norm.weight") else 0.02 * values
    return values.to(dtype)


def _code_table() -> torch.Tensor:
    """256 E2M1 nibbles (sign bit 8) whose frequencies follow ``CODE_MAGNITUDE_WEIGHTS``, each
    sign half and never nibble 8 (-0, which a quantizer does not write)."""
    counts = [round(128 * w) for w in CODE_MAGNITUDE_WEIGHTS]
    counts[1] += 128 - sum(counts)  # rounding remainder onto a common small code
    codes = [c for c, n in enumerate(counts) for _ in range(n)]
    return torch.tensor(codes + [c | 8 if c else 0 for c in codes], dtype=torch.uint8)


def _random_fp4_bytes(shape: tuple[int, ...], g: torch.Generator, chunk: int = 1 << 24) -> torch.Tensor:
    # In chunks: the table lookup needs int64 indices, 16 bytes per output byte at once otherwise.
    table = _code_table()
    out = torch.empty(shape, dtype=torch.uint8)
    flat = out.view(-1)
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        pair = torch.randint(0, 1 << 16, (n,), generator=g)  # one draw for both nibbles
        flat[start : start + n] = table[pair & 255] | (table[pair >> 8] << 4)
    return out


def shard_names(count: int) -> list[str]:
    return [f"model-{i:05d}-of-{count - 1:05d}.safetensors" for i in range(count)]


def plan_shards(sizes: dict[str, int], max_shard_bytes: int, num_shards: int | None = None) -> list[list[str]]:
    """Split the sorted names into shards: at most ``max_shard_bytes`` payload each, or exactly
    ``num_shards`` shards cut where the running byte count crosses each ``total / num_shards``."""
    if num_shards:
        total = sum(sizes.values())
        cut: list[list[str]] = [[] for _ in range(num_shards)]
        start = 0
        for name in sorted(sizes):
            cut[min(num_shards - 1, start * num_shards // max(total, 1))].append(name)
            start += sizes[name]
        return [names for names in cut if names]
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes):
        if shards[-1] and used + sizes[name] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def write_synthetic_checkpoint(
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    num_experts: int = 4,
    hidden: int = 2880,
    intermediate: int = 2880,
    top_k: int = 4,
    vocab_size: int = 1024,
    num_attention_heads: int = 8,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    num_shards: int | None = None,
    seed: int = 0,
    recipe: Recipe | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    tokenizer: bool = False,
) -> Path:
    """Write a gpt-oss MXFP4 checkpoint into ``out_dir`` and return it.

    ``num_shards`` (if given) overrides ``max_shard_bytes`` with an even split, which is the easy
    way to make a small model's layers straddle shard files. ``tokenizer`` adds a small word-level
    tokenizer with a chat template (:mod:`prepkit.synth_tokenizer`) that fits the vocabulary.
    """
    recipe = recipe or load_recipe("gpt-oss-120b")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = synthetic_config(
        num_layers=num_layers,
        num_experts=num_experts,
        hidden=hidden,
        intermediate=intermediate,
        top_k=top_k,
        vocab_size=vocab_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
    )
    ids = special_token_ids(vocab_size)
    table = tensor_table(recipe, config)
    sizes = {n: _nbytes(s, d) for n, (s, d) in table.items()}
    total = sum(sizes.values())
    groups = plan_shards(sizes, max_shard_bytes, num_shards)
    files = shard_names(len(groups))
    weight_map: dict[str, str] = {}
    done = 0
    for file_name, names in zip(files, groups, strict=False):
        tensors = {n: random_tensor(n, *table[n], seed=seed) for n in names}
        tmp = temp_path(out / file_name)
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, out / file_name)
        for n in names:
            weight_map[n] = file_name
        done += sum(sizes[n] for n in names)
        if on_progress:
            on_progress("synthesize", done, total)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / INDEX_NAME, index)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["bos"],
            "do_sample": True,
            "eos_token_id": [ids["eos"], ids["pad"], ids["call"]],
            "pad_token_id": ids["pad"],
            "transformers_version": "4.55.0.dev0",
        },
    )
    _write_json(out / "config.json", config)
    if tokenizer:
        from prepkit.synth_tokenizer import write_tokenizer

        write_tokenizer(out, ids, vocab_size)
    # Hashes taken now, while the bytes are fresh, so prepare can cite them as provenance
    # instead of reading the whole checkpoint again (as it does with a fetch record).
    record = {
        "format": SYNTH_RECORD_FORMAT,
        "generator": "prepkit synth",
        # Random weights of the recipe's format, at this size: what prepare names its output after.
        "synthetic": True,
        "recipe": recipe.name,
        "num_layers": num_layers,
        "num_experts": num_experts,
        "hidden": hidden,
        "intermediate": intermediate,
        "seed": seed,
        "files": [
            {"path": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(out.iterdir())
            if p.is_file() and p.name != SYNTH_RECORD
        ],
    }
    _write_json(out / SYNTH_RECORD, record)
    return out


@dataclass(frozen=True)
class SynthFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class SynthRecord:
    """What ``prepkit-synth.json`` says: the seed, and every file with the hash taken at creation."""

    seed: int | None
    files: tuple[SynthFile, ...]
    recipe: str | None = None  # None in records written before the size was recorded
    num_layers: int | None = None
    num_experts: int | None = None
    hidden: int | None = None  # None in records written before the dims were recorded
    intermediate: int | None = None

    def label(self, recipe_name: str) -> str:
        """``synthetic-gpt-oss-120b-2l-4e-h2880-i2880``: a name that says it is no real checkpoint,
        and its size and dims, so synthetic checkpoints of other dims get other default folders."""
        size = f"-{self.num_layers}l-{self.num_experts}e" if self.num_layers and self.num_experts else ""
        if size and self.hidden and self.intermediate:
            size += f"-h{self.hidden}-i{self.intermediate}"
        return f"synthetic-{self.recipe or recipe_name}{size}"


def read_synth_record(model_dir: str | Path) -> SynthRecord | None:
    """The synth record of ``model_dir``, or None when ``prepkit synth`` did not write the folder.

    Raises:
        CheckpointError: the record exists but is not a synth record this version can read.
    """
    path = Path(model_dir) / SYNTH_RECORD
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable: {err}", hint="write the model again: prepkit synth") from err
    try:
        if raw.get("format") != SYNTH_RECORD_FORMAT:
            raise ValueError(f"format is {raw.get('format')!r}, expected {SYNTH_RECORD_FORMAT!r}")
        files = tuple(SynthFile(f["path"], int(f["size"]), f["sha256"]) for f in raw["files"])
        dims = ("num_layers", "num_experts", "hidden", "intermediate")
        size = {k: int(raw[k]) if raw.get(k) is not None else None for k in dims}
        return SynthRecord(seed=raw.get("seed"), files=files, recipe=raw.get("recipe"), **size)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{path} is not a prepkit synth record: {err}", hint="write the model again: prepkit synth"
        ) from err


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _write_json(path: Path, payload: Any) -> None:
    # Keys in the order they are built (config.json follows the hub's order, which is not sorted).
    write_json_atomic(path, payload, sort_keys=False)


def checkpoint_label(model_dir: str | Path, recipe_name: str) -> str:
    """What ``prepare`` calls the checkpoint in ``model_dir``: the recipe's name, or for a folder
    ``prepkit synth`` wrote, a name that says it is synthetic and how big (see :meth:`SynthRecord.label`).

    Raises:
        CheckpointError: the folder has a synth record this version cannot read.
    """
    record = read_synth_record(model_dir)
    return recipe_name if record is None else record.label(recipe_name)
