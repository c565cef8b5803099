"""Dense weights (attention projections, lm_head) in MX formats: ``prepare --dense``.

Pure functions on tensors, no I/O. A weight ``[N, K]`` (K a multiple of 32) becomes element codes
with one E8M0 scale per 32 consecutive elements of a row, stored the way the bundled kernel
family reads its MoE weights (:mod:`prepkit.layouts.triton_moe`), so the dense kernel shares the
MoE mainloop:

* ``<name>_blocks``: the codes cut along K into panels of :data:`PANEL_BYTES` bytes,
  ``[P, N, PANEL_BYTES]`` uint8, the last panel zero-padded. mxfp4 packs two codes a byte in the
  MoE weights' order (byte j of a group holds elements j and j + 16, the group's 16 bytes in MMA
  fragment order), so a panel holds 256 elements; mxfp8 stores one e4m3 byte per element in
  natural order, 128 elements a panel.
* ``<name>_scales``: E8M0 bytes transposed to ``[K/32, N]``.

The formats are :mod:`prepkit.mx_formats`' records, the codec :mod:`prepkit.mx_codec`'s.
Rounding rule (the one OpenAI's Triton MX kernels use for weights, "round the scale up"): a
block's scale is ``2 ** ceil(log2(amax / max_element))``, so no element of the block saturates;
each element then rounds to the nearest value of its format, ties to the even code. (OCP MX v1.0
takes ``floor(log2(amax)) - emax`` instead and clamps the largest elements; the round-up rule
gives up a fraction of a bit of small-value resolution for no clipping at all.) Every element is
then within half a grid step of its source: :func:`rounding_bound`. A zero is stored as +0.
"""

from __future__ import annotations

import torch

from prepkit.constants import DEFAULT_DENSE_FORMAT, TRITON_MOE_LAYOUT_ID
from prepkit.errors import LayoutError
from prepkit.layouts.triton_moe import (
    PANEL_BYTES,
    from_fragment_order,
    from_panels,
    shuffle_nibbles,
    to_fragment_order,
    to_panels,
    unshuffle_nibbles,
)
from prepkit.mx_codec import dequantize as mx_dequantize
from prepkit.mx_codec import quantize_round_up
from prepkit.mx_formats import MX_FORMATS as MX_FORMATS
from prepkit.mx_formats import MXFP4 as MXFP4
from prepkit.mx_formats import MXFP8 as MXFP8
from prepkit.mx_formats import MxFormat as MxFormat
from prepkit.mxfp4 import BLOCK_BYTES, BLOCK_ELEMS, E8M0_BIAS, pack_nibbles, unpack_nibbles

# The expert layouts whose engine also reads MX dense weights: the bundled kernel family's.
MX_DENSE_LAYOUT_IDS = (TRITON_MOE_LAYOUT_ID,)
BLOCKS_SUFFIX = "_blocks"  # ``x.weight`` -> ``x.weight_blocks`` and ``x.weight_scales``,
SCALES_SUFFIX = "_scales"  # the checkpoint's own spelling for its MXFP4 experts
# The dense weights ``--dense`` quantizes: each decoder layer's attention projections (the
# part after ``model.layers.<i>.``) and the output head. Biases, norms, sinks, the router and
# the embedding (read one row per token) stay as the checkpoint has them.
LAYER_DENSE_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
)
LM_HEAD_WEIGHT = "lm_head.weight"
# ``prepare --dense``: the checkpoint's own dtype, or an MX format.
DENSE_FORMATS = (DEFAULT_DENSE_FORMAT, *MX_FORMATS)


def mx_format(name: str) -> MxFormat:
    """The MX format called ``name``.

    Raises:
        LayoutError: ``name`` is not an MX format (``bf16`` is not one).
    """
    try:
        return MX_FORMATS[name]
    except KeyError:
        raise LayoutError(f"dense format {name!r} is not an MX format (one of {', '.join(MX_FORMATS)})") from None


def is_dense_weight(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is one that ``--dense`` quantizes."""
    if name == LM_HEAD_WEIGHT:
        return True
    parts = name.split(".")
    return (
        len(parts) == 6
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and ".".join(parts[3:]) in LAYER_DENSE_WEIGHTS
    )


def stored_names(name: str) -> tuple[str, str]:
    """The blocks and scales tensor names that hold the MX form of weight ``name``."""
    return name + BLOCKS_SUFFIX, name + SCALES_SUFFIX


def _check_weight(values: torch.Tensor, name: str) -> None:
    if values.dim() != 2 or values.shape[1] % BLOCK_ELEMS:
        raise LayoutError(f"{name}: shape {list(values.shape)} is not [N, K] with K a multiple of {BLOCK_ELEMS}")
    if not values.is_floating_point():
        raise LayoutError(f"{name}: dtype {values.dtype} is not a floating point weight")
    if not bool(torch.isfinite(values).all()):
        raise LayoutError(f"{name}: holds NaN or Inf values, which no MX scale can represent")


def quantize(values: torch.Tensor, fmt: MxFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` floats -> ``(codes [..., K] uint8, scales [..., K/32] uint8)``: E2M1 codes
    0..15 for mxfp4, e4m3fn bytes for mxfp8, E8M0 scale bytes (module docstring's rule)."""
    return quantize_round_up(values, fmt)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """Inverse of :func:`quantize` up to rounding: float32 ``[..., K]``."""
    return mx_dequantize(codes, scales, fmt)


def rounding_bound(values: torch.Tensor, scales: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """Per element, half the format's grid step at the element's magnitude (in source units):
    the most that round-to-nearest may move it, given the block's ``scales``."""
    exponent = (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1)
    scaled = torch.ldexp(values.to(torch.float32).unflatten(-1, (-1, BLOCK_ELEMS)).abs(), -exponent)
    binade = torch.floor(torch.log2(scaled.clamp(min=2.0**fmt.min_normal_exponent)))
    step = torch.exp2(binade - fmt.mantissa_bits)
    return torch.ldexp(step / 2, exponent).flatten(-2)


def to_kernel_layout(weight: torch.Tensor, fmt: MxFormat, name: str = "weight") -> dict[str, torch.Tensor]:
    """``[N, K]`` floats -> ``{"blocks": [P, N, PANEL_BYTES], "scales": [K/32, N]}`` uint8."""
    _check_weight(weight, name)
    codes, scales = quantize(weight, fmt)
    return {"blocks": codes_to_panels(codes, fmt), "scales": scales.transpose(0, 1).contiguous()}


def codes_to_panels(codes: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """Element codes ``[N, K]`` -> stored panels ``[P, N, PANEL_BYTES]``."""
    if fmt is MXFP4:
        groups = pack_nibbles(codes).unflatten(-1, (-1, BLOCK_BYTES))  # checkpoint order
        rows = to_fragment_order(shuffle_nibbles(groups)).flatten(-2)
    else:
        rows = codes
    return to_panels(rows)


def panels_to_codes(blocks: torch.Tensor, k: int, fmt: MxFormat, name: str = "weight_blocks") -> torch.Tensor:
    """Inverse of :func:`codes_to_panels`: ``[P, N, PANEL_BYTES]`` -> codes ``[N, k]``.

    Raises:
        LayoutError: the panels do not hold rows of ``k`` elements, or their padding is not zero.
    """
    rows = from_panels(blocks, k // fmt.elements_per_byte, name)
    if fmt is not MXFP4:
        return rows
    groups = unshuffle_nibbles(from_fragment_order(rows.unflatten(-1, (-1, BLOCK_BYTES))))
    return unpack_nibbles(groups.flatten(-2))


def from_kernel_layout(
    blocks: torch.Tensor, scales: torch.Tensor, fmt: MxFormat, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``(blocks, scales)`` -> ``(codes [N, K], scales [N, K/32])``; K from the scales.

    Raises:
        LayoutError: the shapes or dtypes do not describe one weight (the message names it).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 3 or scales.dim() != 2:
        raise LayoutError(
            f"{name}: blocks {list(blocks.shape)} {blocks.dtype} and scales {list(scales.shape)} "
            f"{scales.dtype} are not [P, N, {PANEL_BYTES}] and [K/32, N] uint8"
        )
    k = scales.shape[0] * BLOCK_ELEMS
    if blocks.shape[1] != scales.shape[1]:
        raise LayoutError(f"{name}: blocks hold {blocks.shape[1]} rows, scales {scales.shape[1]}")
    codes = panels_to_codes(blocks, k, fmt, name + BLOCKS_SUFFIX)
    return codes, scales.transpose(0, 1)


def dequantize_kernel_layout(
    blocks: torch.Tensor, scales: torch.Tensor, fmt: MxFormat, name: str = "weight"
) -> torch.Tensor:
    """Stored ``(blocks, scales)`` -> the float32 weight ``[N, K]`` they encode."""
    codes, row_scales = from_kernel_layout(blocks, scales, fmt, name)
    return dequantize(codes, row_scales, fmt)
