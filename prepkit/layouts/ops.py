"""Pure tensor steps shared by the layouts, each next to its inverse.

Permutations are index vectors ``p`` used as gathers along dim 0 (or the dim given):
``out[j] = in[p[j]]``. Everything works on CPU, GPU and ``meta`` tensors alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    return ceil_div(x, multiple) * multiple


# --- padding --------------------------------------------------------------------------------


def pad_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Zero-pad every dim at its end up to ``shape`` (no dim may shrink)."""
    if len(shape) != t.dim():
        raise ValueError(f"pad_to: rank mismatch {list(t.shape)} -> {list(shape)}")
    if tuple(t.shape) == tuple(shape):
        return t
    if any(s < d for s, d in zip(shape, t.shape, strict=False)):
        raise ValueError(f"pad_to cannot shrink {list(t.shape)} to {list(shape)}")
    # Zero only what lies outside ``t``: a full zero fill first would touch every byte twice.
    out = torch.empty(tuple(shape), dtype=t.dtype, device=t.device)
    out[tuple(slice(0, d) for d in t.shape)] = t
    for dim, (have, want) in enumerate(zip(t.shape, shape, strict=False)):
        if want > have:
            index = [slice(0, d) for d in t.shape[:dim]] + [slice(have, want)]
            out[tuple(index)] = 0
    return out


def unpad(t: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, bool]:
    """Inverse of :func:`pad_to`: the leading ``shape`` corner, and whether the rest is all zero."""
    core = t[tuple(slice(0, d) for d in shape)]
    padding_is_zero = int(torch.count_nonzero(t)) == int(torch.count_nonzero(core))
    return core, padding_is_zero


# --- gate/up interleave ----------------------------------------------------------------------


def deinterleave_rows(t: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint rows ``[g0, u0, g1, u1, ...]`` -> ``(gate, up)`` along ``dim``."""
    n = t.shape[dim]
    if n % 2:
        raise ValueError(f"cannot de-interleave an odd number of rows ({n})")
    pairs = t.unflatten(dim, (n // 2, 2))
    d = dim % t.dim()
    return pairs.select(d + 1, 0), pairs.select(d + 1, 1)


def interleave_rows(gate: torch.Tensor, up: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`deinterleave_rows`."""
    d = dim % gate.dim()
    return torch.stack((gate, up), dim=d + 1).flatten(d, d + 1)


# --- row permutations (TRT-LLM fp4_utils / FlashInfer utils semantics) ----------------------


def shuffle_block_size(epilogue_tile_m: int) -> int:
    """Rows per shuffle block: 32 when the epilogue tile is a multiple of 128, else 16."""
    return 32 if epilogue_tile_m % 128 == 0 else 16


@lru_cache(maxsize=64)  # pure in (m, tile); the result is never written to
def shuffle_row_indices(m: int, epilogue_tile_m: int = 128) -> torch.Tensor:
    """The trtllm-gen "shuffle matrix A" row gather for ``m`` rows.

    Inside each block of ``blk`` rows, output row ``t`` reads input row ``(t % 8) * (blk/8) + t // 8``:
    the block is an 8 x (blk/8) grid read column by column, which is the row order the kernel's
    epilogue tile writes in.
    """
    blk = shuffle_block_size(epilogue_tile_m)
    if m % blk:
        raise ValueError(f"row shuffle needs rows % {blk} == 0, got {m}")
    j = torch.arange(m, dtype=torch.int64)
    t = j % blk
    return (j - t) + (t % 8) * (blk // 8) + t // 8


@lru_cache(maxsize=64)  # pure in (m, tile); the result is never written to
def gated_reorder_indices(m: int) -> torch.Tensor:
    """Interleave the two halves of ``m`` rows: output ``[r0, r_{m/2}, r1, r_{m/2+1}, ...]``."""
    if m % 2:
        raise ValueError(f"gated reorder needs an even row count, got {m}")
    j = torch.arange(m, dtype=torch.int64)
    return torch.where(j % 2 == 0, j // 2, m // 2 + (j - 1) // 2)


@lru_cache(maxsize=64)  # pure in (m, tile); the result is never written to
def w13_row_indices(m: int, epilogue_tile_m: int = 128) -> torch.Tensor:
    """Gated reorder first, then the row shuffle: ``out = in[gated][shuffle]``."""
    return gated_reorder_indices(m)[shuffle_row_indices(m, epilogue_tile_m)]


def inverse_permutation(p: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(p)
    inv[p] = torch.arange(p.numel(), dtype=p.dtype, device=p.device)
    return inv


# --- 128x4 block-scale interleave (computeSFIndex, SWIZZLED_128x4) ----------------------------


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """``[..., R, C]`` uint8 scales -> ``[..., Rp, Cp]`` bytes in the 128x4 tiled order.

    ``Rp = roundup(R, 128)``, ``Cp = roundup(C, 4)``; the returned tensor's memory, read flat per
    leading index, is the engine's buffer (padding entries are zero). Byte ``(r, c)`` goes to
    ``(r//128)*128*Cp + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``.
    """
    *lead, R, C = scales.shape
    Rp, Cp = round_up(R, 128), round_up(C, 4)
    padded = pad_to(scales, (*lead, Rp, Cp))
    n = len(lead)
    if padded.dtype == torch.uint8:
        # The four bytes of a column group move together: permute 32-bit words, not bytes.
        words = padded.contiguous().view(torch.int32).reshape(*lead, Rp // 128, 4, 32, Cp // 4)
        order = [*range(n), n, n + 3, n + 2, n + 1]
        return words.permute(order).contiguous().view(torch.uint8).reshape(*lead, Rp, Cp)
    tiles = padded.reshape(*lead, Rp // 128, 4, 32, Cp // 4, 4)
    order = [*range(n), n, n + 3, n + 2, n + 1, n + 4]
    return tiles.permute(order).reshape(*lead, Rp, Cp)


def unswizzle_scales_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales_128x4`, cropped back to ``[..., rows, cols]``."""
    *lead, Rp, Cp = swizzled.shape
    n = len(lead)
    tiles = swizzled.reshape(*lead, Rp // 128, Cp // 4, 32, 4, 4)
    order = [*range(n), n, n + 3, n + 2, n + 1, n + 4]
    linear = tiles.permute(order).reshape(*lead, Rp, Cp)
    return linear[..., :rows, :cols]


# --- TP helpers -----------------------------------------------------------------------------


def gather_rows(src: torch.Tensor, rows: torch.Tensor, cols: int) -> torch.Tensor:
    """``[E, R, C]`` -> ``[E, len(rows), cols]``: output row ``j`` is ``src[:, rows[j]]`` where
    ``rows[j] >= 0`` and zero where it is ``-1``; columns past ``C`` are zero.

    One gather straight into the padded buffer: pad-then-permute written as a single pass.
    """
    E, _, C = src.shape
    out = torch.empty((E, rows.numel(), cols), dtype=src.dtype, device=src.device)
    zero_rows = (rows < 0).nonzero().flatten()  # on the index's own device (meta has no values)
    torch.index_select(src, 1, rows.clamp(min=0).to(src.device), out=out[:, :, :C])
    if cols > C:
        out[:, :, C:] = 0
    # Padding rows come in whole 32-row shuffle blocks, so they form few runs: slice-fill those.
    for lo, hi in _runs(zero_rows):
        out[:, lo:hi] = 0
    return out


def _runs(sorted_indices: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal ``[lo, hi)`` runs of consecutive values in a sorted 1-D index tensor."""
    if not sorted_indices.numel():
        return []
    values = sorted_indices.tolist()
    runs = []
    lo = prev = values[0]
    for v in values[1:]:
        if v != prev + 1:
            runs.append((lo, prev + 1))
            lo = v
        prev = v
    runs.append((lo, prev + 1))
    return runs


def trtllm_weight_alignment(weight_alignment: int, scaling_vector_size: int, tp_size: int, dim: int) -> int:
    """TRT-LLM ``_get_weight_alignment``: the multiple a sharded dim is padded to before slicing,
    chosen so every rank gets the same, kernel-aligned count and no scale block is cut."""
    a = math.lcm(math.lcm(weight_alignment, scaling_vector_size), tp_size)
    per_rank = ceil_div(dim, a) * a // tp_size
    if per_rank % weight_alignment:
        a = weight_alignment * ceil_div(per_rank, weight_alignment) * tp_size
    return a
