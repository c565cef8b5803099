"""Opening a prepared folder to run it: the checks that can fail before any weight is read (the
layout, the tokenizer, the chat template, the device, the memory a batch needs), then the model.

Every check raises a prepkit error naming the folder, file or value at fault, so that
``prepkit generate`` and ``prepkit bench`` fail in a second, not after minutes of loading.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prepkit.constants import MANIFEST_NAME, TRITON_MOE_LAYOUT_ID
from prepkit.errors import DeviceError, LayoutError, RecipeError
from prepkit.manifest import Manifest

PREPARE_HINT = "prepare it with: prepkit prepare --src MODEL --layout triton-moe --tp 1 --out FOLDER"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Memory besides weights and cache: activations, the kernel's workspaces, cuBLAS, the CUDA context.
HEADROOM_BYTES = 2 << 30


def open_prepared(folder: Path, world_size: int = 1) -> Manifest:
    """The manifest of a prepared folder the runtime can run (triton-moe) on ``world_size``
    processes: one rank, or a split set of that many ranks (torchrun, ``--nproc``).

    Raises:
        LayoutError: no folder, no manifest, another layout, or a split set of another size;
            each with the fix.
    """
    if not folder.is_dir():
        raise LayoutError(f"{folder} is not a folder", hint=PREPARE_HINT)
    if not (folder / MANIFEST_NAME).is_file():
        raise LayoutError(f"{folder} holds no {MANIFEST_NAME}: not a prepared folder", hint=PREPARE_HINT)
    manifest = Manifest.read(folder)
    if manifest.layout.id != TRITON_MOE_LAYOUT_ID:
        raise LayoutError(
            f"{folder} is prepared for {manifest.layout.id!r}; the runtime reads {TRITON_MOE_LAYOUT_ID!r}",
            hint=PREPARE_HINT,
        )
    parallel = manifest.parallel
    if parallel.world_size != world_size and world_size == 1:
        raise LayoutError(
            f"{folder} is split tp={parallel.tp_size} ep={parallel.ep_size}; one GPU runs a tp=1 ep=1 set",
            hint=f"run it on {parallel.world_size} GPUs: --nproc {parallel.world_size} (or torchrun "
            f"--nproc-per-node {parallel.world_size} -m prepkit ...), or {PREPARE_HINT}",
        )
    if parallel.world_size != world_size:
        raise LayoutError(
            f"{folder} is split tp={parallel.tp_size} ep={parallel.ep_size} = {parallel.world_size} ranks; "
            f"the launch has {world_size}",
            hint=f"run it with --nproc {parallel.world_size}",
        )
    return manifest


def check_dependencies() -> None:
    """Raise DependencyError naming the extra to install when transformers or triton is missing."""
    from prepkit.integrations.gpt_oss_parts import check_transformers_version, require_triton

    check_transformers_version()
    require_triton()


def load_tokenizer(folder: Path, *, chat: bool = False) -> Any:
    """transformers' tokenizer from the prepared folder (``prepare`` copies the source's).

    Raises:
        RecipeError: no tokenizer file in the folder, or ``chat`` without a chat template.
    """
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise RecipeError(
            f"{folder} holds no tokenizer ({', '.join(TOKENIZER_FILES)})",
            hint="prepare copies the source's tokenizer files: prepare again from a folder that has them",
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as err:
        raise RecipeError(f"{folder}: the tokenizer cannot be loaded: {err}") from err
    if chat and not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json's chat_template)",
            hint="run without --chat, or prepare from a source folder that has one",
        )
    return tokenizer


def resolve_device(name: str) -> torch.device:
    """``name`` as a device the kernel runs on.

    Raises:
        DeviceError: CUDA asked for without a GPU; the CPU without the Triton interpreter.
    """
    from prepkit.runtime.arguments import parse_device

    device = parse_device(name)
    if device.type == "cpu":
        from prepkit.integrations.gpt_oss_parts import require_kernel_device

        require_kernel_device(device)
    return device


def cache_bytes(config: dict[str, Any], batch: int, max_len: int, dtype_bytes: int = 2, *, ranks: int = 1) -> int:
    """Bytes of the decoder's static KV cache for ``batch`` rows of ``max_len`` tokens on one of
    ``ranks`` ranks (each holds its share of the kv heads)."""
    layers = int(config["num_hidden_layers"])
    kv_heads = int(config["num_key_value_heads"]) // max(1, ranks)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return 2 * layers * batch * kv_heads * max_len * head_dim * dtype_bytes


def weight_bytes(manifest: Manifest, rank: int = 0) -> int:
    """Bytes the rank's files put on the device (bf16 tensors load as stored): of a split set,
    the rank's experts and its share of the shared non-expert files."""
    files = manifest.files
    ranks = manifest.parallel.world_size
    if ranks == 1:
        return sum(record.bytes for rel, record in files.items() if rel.endswith(".safetensors"))
    shared = sum(files[rel].bytes for rel in manifest.shared_files if rel in files)
    own = sum(record.bytes for rel, record in files.items() if rel.startswith(f"rank{rank}/experts-"))
    return own + shared // ranks


def check_fits(manifest: Manifest, device: torch.device, batch: int, max_len: int, rank: int = 0) -> dict[str, int]:
    """The bytes a run needs on ``device`` (weights, cache, headroom), checked against its free
    memory before anything loads.

    Raises:
        DeviceError: the batch's cache does not fit beside the weights; names batch and length.
    """
    need = {
        "weights": weight_bytes(manifest, rank),
        "cache": cache_bytes(manifest.model.config, batch, max_len, ranks=manifest.parallel.world_size),
        "headroom": HEADROOM_BYTES,
    }
    if device.type != "cuda":
        return need
    free, _ = torch.cuda.mem_get_info(device)
    if sum(need.values()) > free:
        gib = 1 << 30
        raise DeviceError(
            f"batch {batch} x {max_len} tokens needs {need['cache'] / gib:.1f} GiB of KV cache besides "
            f"{need['weights'] / gib:.1f} GiB of weights; {torch.cuda.get_device_name(device)} has "
            f"{free / gib:.1f} GiB free",
            hint="lower the batch or the context length",
        )
    return need


def check_context(manifest: Manifest, prompt_tokens: int, max_new_tokens: int, max_len: int | None) -> int:
    """The cache length for a prompt and its new tokens: ``max_len`` when given, else just enough.

    Raises:
        RecipeError: the prompt and its new tokens do not fit the cache or the model's context.
    """
    if max_new_tokens < 1:
        raise RecipeError(f"max-new-tokens: {max_new_tokens} is not >= 1")
    need = prompt_tokens + max_new_tokens
    limit = int(manifest.model.config.get("max_position_embeddings") or need)
    if max_len is not None and need > max_len:
        raise RecipeError(
            f"the prompt's {prompt_tokens} tokens and {max_new_tokens} new ones need {need} cache slots; "
            f"--max-len is {max_len}",
            hint="raise --max-len or lower --max-new-tokens",
        )
    if need > limit:
        raise RecipeError(
            f"the prompt's {prompt_tokens} tokens and {max_new_tokens} new ones exceed the model's context "
            f"of {limit} tokens",
            hint="shorten the prompt or lower --max-new-tokens",
        )
    return max_len if max_len is not None else need


@dataclass
class LoadedModel:
    model: Any
    manifest: Manifest
    device: torch.device
    load_s: float


def load_model(
    folder: Path, manifest: Manifest, device: torch.device, activations: str, rank: int | None = None
) -> LoadedModel:
    """transformers' gpt-oss from the prepared folder (:func:`~prepkit.integrations.transformers.from_prepared`):
    of a split set, this process's ``rank``."""
    from prepkit.integrations.gpt_oss_loader import from_prepared

    started = time.perf_counter()
    model = from_prepared(folder, device=device, activations=activations, rank=rank)  # type: ignore[arg-type]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return LoadedModel(model, manifest, device, time.perf_counter() - started)


def device_name(device: torch.device) -> str:
    """How reports name ``device``: the GPU's name and architecture, or the CPU's interpreter."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    return "CPU (Triton interpreter)"
