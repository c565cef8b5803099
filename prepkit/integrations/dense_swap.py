"""Dense weights prepared in MX (``prepare --dense mxfp8|mxfp4``) into a transformers model: each
quantized ``nn.Linear`` (q/k/v/o projections, lm_head) becomes a
:class:`~prepkit.runtime.dense.MxLinear` over its stored blocks and scales, with the Linear's own
bias. The MX linear runs as a torch op, so graph capture and ``torch.compile`` see one opaque call.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from prepkit.errors import VerifyError
from prepkit.kernels.activations import ActivationPolicy
from prepkit.layouts.dense_mx import BLOCKS_SUFFIX, SCALES_SUFFIX, mx_format

MxParts = dict[str, dict[str, torch.Tensor]]  # weight name -> {"blocks": ..., "scales": ...}


def mx_part_of(stored_name: str) -> tuple[str, str] | None:
    """``x.weight_blocks`` -> ``("x.weight", "blocks")`` (and ``_scales``); None for other names."""
    for suffix, part in ((BLOCKS_SUFFIX, "blocks"), (SCALES_SUFFIX, "scales")):
        if stored_name.endswith(".weight" + suffix):
            return stored_name[: -len(suffix)], part
    return None


def read_mx_parts(root: Path, rels: list[str], device: torch.device) -> MxParts:
    """Every MX dense tensor of the files ``root/rels``, on ``device``, by the weight it encodes."""
    parts: MxParts = {}
    for rel in rels:
        try:
            with safe_open(str(root / rel), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open handles are not dicts)
                    found = mx_part_of(name)
                    if found is not None:
                        add_part(parts, rel, name, found, f.get_tensor(name).to(device))
        except SafetensorError as err:
            raise VerifyError(f"{root / rel} cannot be read: {err}", hint=f"run: prepkit verify {root}") from err
    return parts


def add_part(parts: MxParts, rel: str, name: str, found: tuple[str, str], tensor: torch.Tensor) -> None:
    weight, part = found
    if part in parts.setdefault(weight, {}):
        raise VerifyError(f"{rel}: tensor {name} is stored twice")
    parts[weight][part] = tensor


def swap_in_mx_linears(model: nn.Module, parts: MxParts, fmt: str, activations: ActivationPolicy) -> int:
    """Replace each Linear that ``parts`` holds a weight for by an MX linear (its bias kept);
    returns how many were replaced.

    Raises:
        VerifyError: a weight with blocks but no scales (or the reverse), one with no Linear in
            the model, or stored shapes that disagree with the Linear's (each named).
    """
    from prepkit.runtime.dense import MxLinear, db_tactic_lookup

    mx = mx_format(fmt)
    for weight, stored in sorted(parts.items()):
        missing = {"blocks", "scales"} - set(stored)
        if missing:
            raise VerifyError(f"the prepared shard set holds no {weight}_{missing.pop()} for {weight}")
        owner_name = weight.rpartition(".")[0]
        try:
            linear = model.get_submodule(owner_name)
        except AttributeError:
            linear = None
        if not isinstance(linear, nn.Linear):
            raise VerifyError(f"tensor {weight}{BLOCKS_SUFFIX} has no Linear module in {type(model).__name__}")
        blocks, scales = stored["blocks"], stored["scales"]
        k = scales.shape[0] * 32 if scales.dim() == 2 else -1
        panels = -(-linear.in_features // mx.panel_k)
        expected_blocks = (panels, linear.out_features, blocks.shape[-1] if blocks.dim() == 3 else -1)
        if k != linear.in_features or scales.shape[1] != linear.out_features or tuple(blocks.shape) != expected_blocks:
            raise VerifyError(
                f"{weight}: stored blocks {list(blocks.shape)} and scales {list(scales.shape)} do not encode "
                f"a [{linear.out_features}, {linear.in_features}] {fmt} weight"
            )
        bias = None if linear.bias is None else linear.bias.detach()
        parent_name, _, child = owner_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent,
            child,
            MxLinear(blocks, scales, bias, fmt, activations=activations, tactic_lookup=db_tactic_lookup()),
        )
    fuse_attention_inputs(model)
    return len(parts)


def fuse_attention_inputs(model: nn.Module) -> None:
    """Give each attention whose q/k/v are MX linears a ``qkv_proj``: the three fused into one
    launch, whose buffers q, k and v then view (one copy in memory). transformers' attention
    keeps calling q, k and v; prepkit's decode step calls ``qkv_proj``."""
    from prepkit.runtime.dense import MxLinear, fuse_projections

    for module in list(model.modules()):  # adding qkv_proj changes the tree
        parts = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if all(isinstance(p, MxLinear) for p in parts):
            module.qkv_proj = fuse_projections(parts)  # type: ignore[arg-type]
