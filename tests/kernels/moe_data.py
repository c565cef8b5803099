"""Tiny MoE layers in checkpoint form for the kernel and layout tests."""

from __future__ import annotations

import torch

from prepkit import mxfp4
from prepkit.layouts.base import ExpertWeights
from prepkit.mx_codec import quantize_mxfp4_blocks


def random_experts(E: int, H: int, I: int, *, seed: int, device: str = "cpu") -> ExpertWeights:
    """Checkpoint-form experts whose values are MXFP4-exact, with realistic magnitudes."""
    g = torch.Generator().manual_seed(seed)

    def quantized(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Per-row spread of magnitudes so the E8M0 scales differ between groups.
        spread = 2.0 ** torch.randint(-2, 3, (E, rows, 1), generator=g)
        w = torch.randn(E, rows, cols, generator=g) * (0.02 * spread)
        blocks, scales = quantize_mxfp4_blocks(w)
        return blocks.reshape(*scales.shape, mxfp4.BLOCK_BYTES), scales

    gu_b, gu_s = quantized(2 * I, H)
    dn_b, dn_s = quantized(H, I)
    return ExpertWeights(
        gate_up_proj_blocks=gu_b.to(device),
        gate_up_proj_scales=gu_s.to(device),
        gate_up_proj_bias=(torch.randn(E, 2 * I, generator=g) * 0.1).to(torch.bfloat16).to(device),
        down_proj_blocks=dn_b.to(device),
        down_proj_scales=dn_s.to(device),
        down_proj_bias=(torch.randn(E, H, generator=g) * 0.1).to(torch.bfloat16).to(device),
    )


def make_layer(w: ExpertWeights, top_k: int, spec=None, device: str = "cpu", **kwargs):
    """Prepare ``w`` with the triton-moe layout for ``spec`` and wrap it as a runtime layer."""
    from prepkit.runtime import MoeLayer

    return MoeLayer.from_experts(w, top_k=top_k, rank=spec, device=device, **kwargs)


def random_inputs(T: int, E: int, H: int, *, seed: int, device: str = "cpu", dead_experts: int = 0):
    """``[T, H]`` bf16 tokens and ``[T, E]`` router logits; the first ``dead_experts`` experts
    never make a token's top-k."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    if dead_experts:
        logits[:, :dead_experts] -= 100.0
    return x.to(device), logits.to(device)
