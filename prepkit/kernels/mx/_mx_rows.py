"""MX-quantized rows as the kernels read and write them, and their conversion from and to one code
per value in natural order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prepkit.kernels.activations import ActivationPolicy


@dataclass
class MxRows:
    """Rows quantized to MX: ``codes`` uint8 ``[rows, n]`` (e4m3) or ``[rows, n/2]`` (two e2m1 per
    byte), each 32-value group in the kernel's group order (:mod:`prepkit.kernels.mx._mx`); ``scales``
    uint8 ``[rows, n/32]`` E8M0. Both contiguous."""

    codes: torch.Tensor
    scales: torch.Tensor
    activations: ActivationPolicy

    @property
    def num_cols(self) -> int:
        return self.scales.shape[1] * 32

    @classmethod
    def empty(cls, rows: int, cols: int, activations: ActivationPolicy, device: torch.device) -> MxRows:
        code_cols = cols if activations == "mxfp8" else cols // 2
        return cls(
            torch.empty((rows, code_cols), dtype=torch.uint8, device=device),
            torch.empty((rows, cols // 32), dtype=torch.uint8, device=device),
            activations,
        )


def group_order() -> list[int]:
    """Value index (inside a 32-value group) at each position of the kernel's group order."""
    from prepkit.layouts.triton_moe import FRAGMENT_ORDER

    return [FRAGMENT_ORDER[p] + 16 * t for p in range(16) for t in range(2)]


def to_mx_rows(codes: torch.Tensor, scales: torch.Tensor, activations: ActivationPolicy) -> MxRows:
    """One code per value in natural order (:func:`prepkit.kernels.activations.quantize_mx`) ->
    the kernel's :class:`MxRows` (group order; e2m1 packed two per byte, low nibble first)."""
    order = torch.tensor(group_order(), device=codes.device)
    stored = codes.unflatten(-1, (-1, 32))[..., order].flatten(-2)
    if activations == "mxfp4":
        stored = stored[..., 0::2] | (stored[..., 1::2] << 4)
    return MxRows(stored.contiguous(), scales.contiguous(), activations)


def from_mx_rows(rows: MxRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_mx_rows`: (codes one per value in natural order, scales)."""
    stored = rows.codes
    if rows.activations == "mxfp4":
        stored = torch.stack((stored & 0xF, stored >> 4), dim=-1).flatten(-2)
    inverse = torch.argsort(torch.tensor(group_order(), device=stored.device))
    return stored.unflatten(-1, (-1, 32))[..., inverse].flatten(-2), rows.scales
