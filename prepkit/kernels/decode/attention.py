"""``rope_cache_attend``: the decode step's attention as one Triton launch (op 2 of the decode step).

Rotary on the token's query and key, the rotated key and the value written into the caches at
slot ``position``, and gpt-oss attention (GQA, one learned sink logit per head in the softmax's
denominator) over the slots in use only: ``[max(pad[b], position - window + 1), position]`` for a
sliding-window layer, ``[pad[b], position]`` otherwise. ``position`` and ``pad`` are read by the
kernel from device memory and the grid depends on neither, so one captured CUDA graph serves every
step. The torch path it replaces reads the whole cache (every one of ``L`` slots) each step.
"""

from __future__ import annotations

import math

import torch
import triton

from prepkit.kernels.decode.attention_kernel import LOG2E, _rope_cache_attend_kernel
from prepkit.kernels.decode.problems import ATTENTION_KERNEL
from prepkit.kernels.decode.variants import DecodeVariant
from prepkit.kernels.mx._chain import chain_launch
from prepkit.kernels.mx._target import interpreting, stream_key

KERNEL_NAME = ATTENTION_KERNEL  # the name the tuner and the step know it by
# The matrix instructions' smallest tile edge: the query group is padded to it, blocks of slots
# and the head size are at least it.
MIN_TILE = 16
MAX_SPLIT = 16
# Programs the default split aims for: about one per SM of a large GPU.
TARGET_PROGRAMS = 128


def group_rows(query_heads: int, kv_heads: int) -> int:
    """The rows of a program's query tile: the heads sharing one kv head, padded to a power of two >= 16."""
    return max(MIN_TILE, triton.next_power_of_2(query_heads // kv_heads))


def default_variant(batch: int, kv_heads: int, head_dim: int, slots: int) -> DecodeVariant:
    """A variant valid for every problem of these dims: 128 slots a block (fewer for a short cache)
    with three stages, and splits over ``slots`` (the slots in use, or the cache's length when
    unknown) for about 128 programs, never a split of less than one block. The fastest in a sweep
    of every candidate on an H100 (docs/decode.md): at batch 1, 3.6 us over a 128-slot window and
    9.7 us over 4,096 slots, where 64-slot blocks took 5.6 and 13.1."""
    block_n = max(MIN_TILE, min(128, 1 << max(0, (slots - 1).bit_length())))
    programs = max(1, batch * kv_heads)
    split = min(MAX_SPLIT, 8, max(1, TARGET_PROGRAMS // programs), max(1, slots // block_n))
    split = 1 << int(math.log2(split))
    return DecodeVariant(block_n=block_n, block_k=head_dim, num_warps=4, split_k=split, num_stages=3)


def variant_reason(variant: DecodeVariant, head_dim: int) -> str | None:
    """Why ``variant`` cannot run attention of ``head_dim``, or None when it can."""
    if variant.block_n < MIN_TILE or variant.block_n & (variant.block_n - 1):
        return f"block_n {variant.block_n} is not a power of two >= {MIN_TILE}"
    if not 1 <= variant.split_k <= MAX_SPLIT:
        return f"split {variant.split_k} is outside 1..{MAX_SPLIT}"
    if variant.num_warps not in (1, 2, 4, 8):
        return f"num_warps {variant.num_warps} is not 1, 2, 4 or 8"
    if not 1 <= variant.num_stages <= 4:
        return f"num_stages {variant.num_stages} is outside 1..4"
    if variant.block_k != head_dim:
        return f"block_k {variant.block_k} is not the head size {head_dim}"
    return None


# Per device and stream (as the dense kernel's split counters): the splits' partial states and one
# arrival counter per (row, kv head), zero between calls (each call's last split resets its own).
# Calls on one stream run one after another and can share them; calls on two streams must not.
_WORKSPACES: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device, states: int, rows: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``(partial outputs, partial max and sum, counters)`` for ``states`` split states of ``rows``
    x ``head_dim`` on ``device``'s current stream, grown (counters zeroed) when short. Make it before
    a CUDA graph capture (one call outside the capture does), so the capture allocates nothing."""
    key = stream_key(device)
    have = _WORKSPACES.get(key)
    acc_size, ml_size = states * rows * head_dim, states * rows * 2
    if have is None or have[0].numel() < acc_size or have[1].numel() < ml_size or have[2].numel() < states:
        have = _WORKSPACES[key] = (
            torch.empty(acc_size, dtype=torch.float32, device=device),
            torch.empty(ml_size, dtype=torch.float32, device=device),
            torch.zeros(max(states, 1024), dtype=torch.int32, device=device),
        )
    return have


def check_inputs(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    pad: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    """``(batch, query heads, kv heads, slots, head size)`` of valid inputs; ValueError naming the
    tensor at fault otherwise."""
    if keys.dim() != 4 or keys.dtype != torch.bfloat16:
        raise ValueError(f"keys: {list(keys.shape)} {keys.dtype}, expected [B, Hkv, L, D] bfloat16")
    batch, kv_heads, slots, head_dim = keys.shape
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"values: {list(values.shape)} {values.dtype}, expected keys' {list(keys.shape)} bfloat16")
    if head_dim < MIN_TILE or head_dim & (head_dim - 1):
        raise ValueError(f"keys: head size {head_dim} is not a power of two >= {MIN_TILE}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys and values: the head dimension must be contiguous")
    width = qkv.shape[-1] if qkv.dim() == 2 else -1
    if qkv.dim() != 2 or qkv.shape[0] != batch or qkv.dtype != torch.bfloat16 or width % head_dim:
        raise ValueError(
            f"qkv: {list(qkv.shape)} {qkv.dtype}, expected [{batch}, (Hq + 2 * {kv_heads}) * {head_dim}] bf16"
        )
    query_heads = width // head_dim - 2 * kv_heads
    if query_heads <= 0 or query_heads % kv_heads:
        raise ValueError(f"qkv: {query_heads} query heads, expected a positive multiple of {kv_heads} kv heads")
    if qkv.stride(-1) != 1:
        raise ValueError("qkv: the last dimension must be contiguous")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (batch, head_dim // 2) or t.stride(-1) != 1:
            raise ValueError(f"{name}: {list(t.shape)}, expected [{batch}, {head_dim // 2}] with a contiguous last dim")
    if position.dim() != 0 or position.dtype != torch.int64:
        raise ValueError(f"position: {list(position.shape)} {position.dtype}, expected a 0-d int64 tensor")
    if pad.shape != (batch,) or pad.dtype != torch.int64:
        raise ValueError(f"pad: {list(pad.shape)} {pad.dtype}, expected [{batch}] int64")
    if sinks.shape != (query_heads,) or not sinks.is_contiguous():
        raise ValueError(f"sinks: {list(sinks.shape)}, expected [{query_heads}] contiguous")
    if window is not None and window < 1:
        raise ValueError(f"window: {window}, expected None or at least 1")
    tensors = {"qkv": qkv, "cos": cos, "sin": sin, "values": values, "position": position, "pad": pad, "sinks": sinks}
    for name, t in tensors.items():
        if t.device != keys.device:
            raise ValueError(f"{name} on {t.device}, keys on {keys.device}")
    return batch, query_heads, kv_heads, slots, head_dim


def rope_cache_attend(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    pad: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor,
    scaling: float,
    variant: DecodeVariant | None = None,
) -> torch.Tensor:
    """gpt-oss decode attention of one token per row -> ``[B, Hq * D]`` bf16, in one launch.

    ``qkv`` ``[B, (Hq + 2 Hkv) * D]`` (the fused projection's output: queries, keys, values),
    ``cos``/``sin`` ``[B, D/2]``, caches ``keys``/``values`` ``[B, Hkv, L, D]`` (slot ``position``
    of both is overwritten with the rotated key and the value), ``position`` a 0-d int64 tensor and
    ``pad`` ``[B]`` int64 (left-padding slots per row) on the device, ``window`` the sliding
    window's length or None, ``sinks`` ``[Hq]``. ``variant``: :func:`default_variant` when None.
    Slots after ``position`` are never read."""
    batch, query_heads, kv_heads, slots, head_dim = check_inputs(
        qkv, cos, sin, keys, values, position, pad, window, sinks
    )
    if variant is None:
        variant = default_variant(batch, kv_heads, head_dim, slots)
    reason = variant_reason(variant, head_dim)
    if reason is not None:
        raise ValueError(f"{KERNEL_NAME} variant {variant.name()}: {reason}")
    rows = group_rows(query_heads, kv_heads)
    out = torch.empty((batch, query_heads * head_dim), dtype=torch.bfloat16, device=qkv.device)
    programs = batch * kv_heads
    if variant.split_k > 1:
        part_acc, part_ml, counts = workspace(qkv.device, programs * variant.split_k, rows, head_dim)
    else:  # never touched: the kernel's split branch is compiled out
        part_acc, part_ml, counts = out, out, pad
    _rope_cache_attend_kernel[(programs, variant.split_k)](
        qkv, cos, sin, keys, values, position, pad, sinks, out,
        part_acc, part_ml, counts,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        out.stride(0),
        window if window is not None else 0, slots, scaling * LOG2E,
        HQ=query_heads, HKV=kv_heads, D=head_dim, GROUP_PAD=rows, BLOCK_N=variant.block_n,
        SPLIT=variant.split_k, HAS_WINDOW=window is not None, DOT_FP32=interpreting(),
        num_warps=variant.num_warps, num_stages=variant.num_stages, **chain_launch(qkv.device),
    )  # fmt: skip
    return out
