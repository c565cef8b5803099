"""``from_prepared(prepared_dir)``: transformers' gpt-oss built from a prepared shard set alone.

The model is laid out on the meta device from the manifest's copy of the source ``config.json``;
each decoder layer's experts module is dropped there, before any of its parameters could take
memory. Non-expert tensors are then streamed from the rank's non-expert files to the device one
tensor at a time, and each layer's experts go from its expert file to the device in MXFP4, as
the :class:`~prepkit.runtime.moe.MoeLayer` that :class:`PrepkitMoeBlock` runs. Host memory stays
near one shard file (read through safetensors' memory map) and device memory at the loaded bytes.

Nothing is read from the source checkpoint or the hub: the tokenizer and the generation defaults
come from the prepared folder too, when ``prepare`` found them in the source.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from prepkit.errors import LaunchError, LayoutError, RecipeError, VerifyError
from prepkit.fsutil import sha256_file
from prepkit.integrations.dense_swap import MxParts, add_part, mx_part_of, swap_in_mx_linears
from prepkit.integrations.fast_generate import enable_fast_generate
from prepkit.integrations.gpt_oss_parts import (
    PrepkitMoeBlock,
    check_manifest_against_config,
    check_transformers_version,
    require_kernel_device,
    require_triton,
)
from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.layouts.dense_mx import DEFAULT_DENSE_FORMAT
from prepkit.manifest import Manifest, experts_file
from prepkit.model_files import GENERATION_CONFIG
from prepkit.recipes import check_config, load_recipe
from prepkit.runtime.arguments import check_rank, parse_device
from prepkit.runtime.moe import load_moe_layers

if TYPE_CHECKING:
    from transformers import GptOssConfig, GptOssForCausalLM

    from prepkit.distributed.dense_split import DenseSplit

CONFIG_FIELD = "manifest.json model.config"  # where the errors say a config field lives


def from_prepared(
    prepared_dir: str | Path,
    *,
    device: str | torch.device = "cuda",
    activations: ActivationPolicy = "bf16",
    dtype: torch.dtype = torch.bfloat16,
    rank: int | None = None,
    check_hashes: bool = False,
) -> GptOssForCausalLM:
    """A ready (``eval()``) transformers ``GptOssForCausalLM`` on ``device`` whose MoE blocks
    run prepkit's kernel, built from ``prepared_dir`` alone (``prepkit prepare --layout
    triton-moe --tp 1``): config from the manifest, non-expert weights in ``dtype``, experts in
    MXFP4 with ``activations`` as their precision policy. No expert is ever held in bf16. A shard
    set prepared with ``--dense mxfp8|mxfp4`` gets MX linears for its q/k/v/o projections and
    lm_head (:mod:`prepkit.integrations.dense_swap`), run with the same policy. Its ``generate``
    runs prepkit's graph-captured decode step for the calls that step supports, transformers'
    own loop otherwise (:mod:`prepkit.integrations.fast_generate`).

    On ``device="cpu"`` the kernel runs only under the Triton interpreter (``TRITON_INTERPRET=1``
    before triton is imported; tiny models). ``check_hashes`` re-hashes each file against the
    manifest before reading it (what ``prepkit verify`` does); by default files are checked for
    presence, size and readable headers, and every tensor for its shape.

    A split set (``prepare --tp N --ep M``, N x M > 1) loads one rank per process, with
    torch.distributed initialised over N x M processes (torchrun, ``--nproc``): ``rank`` is this
    process's (the default), ``device`` its GPU. Before any weight loads, every rank checks the
    launch against the set together (:mod:`prepkit.distributed.preflight`). Each rank then loads
    its prepared experts, its share of the attention heads and of the head's vocabulary rows, and
    sums / gathers its partial outputs over the ranks (:mod:`prepkit.distributed.model_hooks`), so
    that ``model(input_ids)`` and ``model.generate`` give the whole model's output on every rank.
    Its ``generate`` is transformers' own loop.

    Raises:
        DependencyError: triton is missing (the ``gpu`` extra).
        RecipeError: transformers outside the supported range, ``rank`` not an int, or a manifest
            config field that is missing or invalid (named).
        LayoutError: not the kernel's layout, a split shard set without torch.distributed, heads or
            vocabulary that do not divide among the ranks, a split set of MX dense weights, or no ``rank``.
        LaunchError: the launch does not fit the split set (on every rank, see
            :func:`prepkit.distributed.preflight.preflight`), or ``rank`` is not this process's.
        DeviceError: ``device`` is not a device this machine has (CUDA without a GPU), or is the
            CPU without the Triton interpreter.
        VerifyError: a missing, truncated or unreadable file, a tensor whose shape differs, or a
            model tensor the shard set does not hold (each named).
        PrepkitError: ``activations`` is not a policy.
    """
    check_transformers_version()
    require_triton()
    check_policy(activations)
    dtype = check_dtype(dtype)
    target = parse_device(device)
    asked_rank = None if rank is None else check_rank(rank)
    require_kernel_device(target)
    root = Path(prepared_dir)
    manifest = Manifest.read(root)
    config = gpt_oss_config(manifest)
    split: DenseSplit | None = None
    if manifest.parallel.world_size > 1:
        rank, split = join_ranks(root, manifest, config, target, asked_rank)
    else:
        rank = 0 if asked_rank is None else asked_rank
    check_manifest_against_config(manifest, config, rank=rank, allow_split=split is not None)
    non_expert = manifest.rank_shared_files(rank)
    for rel in [*non_expert, *(experts_file(rank, i) for i in range(config.num_hidden_layers))]:
        check_file(root, manifest, rel, check_hashes=check_hashes)
    # Checked before any weight loads: a damaged file should not cost the minutes of loading.
    if GENERATION_CONFIG in manifest.files:
        check_file(root, manifest, GENERATION_CONFIG, check_hashes=check_hashes)
    generation_config = read_generation_config(root)

    model = meta_skeleton(config if split is None else split.local_config(config), dtype)
    if split is not None:
        # the head holds this rank's vocabulary rows; the embedding stays whole
        model.lm_head = nn.Linear(config.hidden_size, split.local_vocab, bias=False, device="meta", dtype=dtype)
    mx_parts: MxParts = {}
    for rel in non_expert:
        stream_tensors(model, root, rel, target, dtype, mx_parts, split=split)
    load_mx_dense(model, manifest, mx_parts, activations)
    model.model.rotary_emb = _rotary_on(model, target)
    load_experts(model, root, manifest, rank, target, activations)
    check_nothing_on_meta(model)
    if generation_config is not None:
        model.generation_config = generation_config
    if split is not None:
        from prepkit.distributed.collectives import Collectives
        from prepkit.distributed.launch_env import one_host
        from prepkit.distributed.model_hooks import attach_collectives

        attach_collectives(model, Collectives(target, symmetric=one_host()))
        return model.eval()  # transformers' loop: the graph-captured step is one process's
    return enable_fast_generate(model.eval())


def join_ranks(
    root: Path, manifest: Manifest, config: GptOssConfig, device: torch.device, rank: int | None
) -> tuple[int, DenseSplit]:
    """This process's rank of a split set and its share of the dense weights, after every rank
    passed the checks before loading.

    Raises:
        LayoutError: no torch.distributed, MX dense weights, or heads / vocabulary that do not divide.
        LaunchError: the launch does not fit the set (every rank), or ``rank`` is not this process's.
    """
    from prepkit.distributed.dense_split import DenseSplit
    from prepkit.distributed.preflight import preflight
    from prepkit.distributed.session import rank_group

    parallel = manifest.parallel
    group = rank_group(device, f"the shard set is split tp={parallel.tp_size} ep={parallel.ep_size}")
    preflight(group, root)
    if rank is not None and rank != group.rank:
        raise LaunchError(f"rank: {rank} was asked for, this process is rank {group.rank} of {group.world_size}")
    if manifest.dense_format != DEFAULT_DENSE_FORMAT:
        raise LayoutError(
            f"{root} holds {manifest.dense_format} dense weights; a split set loads bf16 dense weights only",
            hint="prepare it without --dense (the default, bf16)",
        )
    return group.rank, DenseSplit.of(config, group.world_size, group.rank)


def check_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` as a floating ``torch.dtype`` the non-expert weights can load in; the names
    ``"bfloat16"``, ``"float16"`` and ``"float32"`` are taken too.

    Raises:
        RecipeError: anything else, named.
    """
    allowed = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in allowed:
        return allowed[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype in allowed.values():
        return dtype
    raise RecipeError(
        f"dtype: {dtype!r} is not a dtype the weights load in",
        hint="use torch.bfloat16, torch.float16 or torch.float32",
    )


def read_generation_config(root: Path) -> Any:
    """transformers' ``GenerationConfig`` from ``root/generation_config.json``, or None without one.

    Raises:
        RecipeError: the file does not parse or transformers rejects it (the file named).
    """
    path = root / GENERATION_CONFIG
    if not path.is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(root))
    except (OSError, ValueError, TypeError) as err:
        raise RecipeError(f"{path} cannot be read: {err}", hint=f"run: prepkit verify {root}") from err


def gpt_oss_config(manifest: Manifest) -> GptOssConfig:
    """transformers' config from the manifest's copy of the source ``config.json``, without its
    quantization entry (the experts are prepkit's, everything else loads as plain tensors).

    Raises:
        RecipeError: a field the model needs is missing or invalid; the message names it.
    """
    from transformers import GptOssConfig

    raw = dict(manifest.model.config)
    problems = check_config(load_recipe(manifest.model.recipe), raw, CONFIG_FIELD)
    if problems:
        raise RecipeError("; ".join(problems), hint="prepare the shards again from the model's checkpoint")
    raw.pop("quantization_config", None)
    try:
        return GptOssConfig.from_dict(raw)
    except Exception as err:  # transformers' validators raise their own classes (strict dataclasses)
        raise RecipeError(
            f"{CONFIG_FIELD}: transformers rejects the config: {err}",
            hint="prepare the shards again from the model's checkpoint",
        ) from err


def check_file(root: Path, manifest: Manifest, rel: str, *, check_hashes: bool = False) -> None:
    """Raise VerifyError naming ``rel`` when it is missing, or its size (or sha256) is not the
    manifest's."""
    path = root / rel
    recorded = manifest.files.get(rel)
    hint = f"run: prepkit verify {root}"
    if not path.is_file():
        raise VerifyError(f"{path} is missing", hint=hint)
    if recorded is None:
        # A rank folder's link to a shared file is recorded under the shared name.
        recorded = manifest.files.get(f"shared/{Path(rel).name}")
    if recorded is None:
        raise VerifyError(f"{rel} is not in {root / 'manifest.json'}", hint="prepare the shards again")
    size = path.stat().st_size
    if size != recorded.bytes:
        raise VerifyError(f"{path} is {size} bytes, the manifest says {recorded.bytes}", hint=hint)
    if check_hashes and sha256_file(path) != recorded.sha256:
        raise VerifyError(f"{path}: sha256 differs from the manifest", hint=hint)


def meta_skeleton(config: GptOssConfig, dtype: torch.dtype) -> GptOssForCausalLM:
    """The model on the meta device, without its experts modules: nothing has memory yet, and
    the experts' parameters never will."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for index, decoder in enumerate(model.model.layers):
        if not hasattr(decoder.mlp, "router"):
            raise RecipeError(f"layer {index}: {type(decoder.mlp).__name__} has no router (not gpt-oss's MoE block)")
        del decoder.mlp.experts
    return model


def stream_tensors(
    model: nn.Module,
    root: Path,
    rel: str,
    device: torch.device,
    dtype: torch.dtype,
    mx_parts: MxParts | None = None,
    *,
    split: DenseSplit | None = None,
) -> int:
    """Put every tensor of ``root/rel`` into the meta parameter of the same name, on ``device``
    (floating tensors in ``dtype``), one tensor at a time; returns the bytes loaded. The blocks
    and scales of MX dense weights go to ``mx_parts`` instead, as they are (``--dense``). With
    ``split``, each tensor is this rank's slice of it, read from the file's memory map alone:
    the whole tensor is never read."""
    loaded = 0
    try:
        with safe_open(str(root / rel), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open handles are not dicts)
                if mx_parts is not None and (found := mx_part_of(name)) is not None:
                    tensor = f.get_tensor(name)
                    add_part(mx_parts, rel, name, found, tensor.to(device))
                    loaded += tensor.numel()
                    continue
                owner, _, attr = name.rpartition(".")
                module = _submodule(model, owner)
                param = module._parameters.get(attr) if module is not None else None
                if module is None or param is None:
                    raise VerifyError(f"{rel}: tensor {name} has no place in {type(model).__name__}")
                if param.device.type != "meta":
                    raise VerifyError(f"{rel}: tensor {name} is stored twice")
                placement, lo, hi = split.placement(name) if split is not None else ("whole", 0, 0)
                if placement == "none":
                    module._parameters[attr] = None  # another rank adds it, once
                    continue
                if placement == "rows":
                    tensor = f.get_slice(name)[lo:hi]
                elif placement == "cols":
                    tensor = f.get_slice(name)[:, lo:hi]
                else:
                    tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise VerifyError(
                        f"{rel}: {name} is {list(tensor.shape)}, the model config gives {list(param.shape)}"
                    )
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)  # on the host: the device holds only the final copy
                module._parameters[attr] = nn.Parameter(tensor.to(device), requires_grad=False)
                loaded += tensor.numel() * tensor.element_size()
                del tensor
    except SafetensorError as err:
        raise VerifyError(f"{root / rel} cannot be read: {err}", hint=f"run: prepkit verify {root}") from err
    return loaded


def load_mx_dense(model: nn.Module, manifest: Manifest, mx_parts: MxParts, activations: ActivationPolicy) -> None:
    """Swap in the MX linears of a ``--dense mxfp8|mxfp4`` shard set; nothing for bf16 ones.

    Raises:
        VerifyError: the files hold MX dense tensors and the manifest records none, or the
            reverse.
    """
    fmt = manifest.dense_format
    if mx_parts and fmt == DEFAULT_DENSE_FORMAT:
        first = min(mx_parts)
        raise VerifyError(
            f"the shard set holds MX tensors for {first} but manifest.json records bf16 dense weights",
            hint="prepare the shards again",
        )
    if fmt != DEFAULT_DENSE_FORMAT:
        if not mx_parts:
            raise VerifyError(f"manifest.json records {fmt} dense weights, the shard set holds none")
        swap_in_mx_linears(model, mx_parts, fmt, activations)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _rotary_on(model: Any, device: torch.device) -> nn.Module:
    # inv_freq is computed from the config, not stored: compute it again, off the meta device.
    rotary = model.model.rotary_emb
    return type(rotary)(config=model.config).to(device)


def load_experts(
    model: Any,
    root: Path,
    manifest: Manifest,
    rank: int,
    device: torch.device,
    activations: ActivationPolicy,
) -> None:
    """Each layer's experts, one layer at a time, from its file to ``device`` in MXFP4; each
    decoder's MoE block becomes a :class:`PrepkitMoeBlock` around its (loaded) router."""
    from prepkit.tactics.lookup import make_tactic_lookup

    lookup = make_tactic_lookup(activations=activations)
    for index, decoder in enumerate(model.model.layers):
        # load_moe_layers names an unreadable expert file itself (VerifyError)
        layers = load_moe_layers(root, rank, device, layers=[index], tactic_lookup=lookup, activations=activations)
        decoder.mlp = PrepkitMoeBlock(decoder.mlp.router, layers[index], index)


def check_nothing_on_meta(model: nn.Module) -> None:
    """Raise VerifyError naming every parameter and buffer the shard set did not fill."""
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if left:
        shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        raise VerifyError(
            f"the prepared shard set holds no tensor for {shown}",
            hint="prepare the shards again from the model's checkpoint",
        )
