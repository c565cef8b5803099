"""The dense weights of a checkpoint under ``prepare --dense``: which layouts take an MX format,
the bytes each weight is stored in, and each weight quantized (``prepare``) or checked against its
source (``verify --src``) a slice of rows at a time.

Rows are independent (a block is 32 elements of one row), so slicing changes no byte, and memory
stays at one slice whatever the weight's size (gpt-oss's lm_head is 201,088 x 2,880).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from prepkit.checkpoint import Checkpoint, TensorEntry
from prepkit.constants import DEFAULT_DENSE_FORMAT
from prepkit.errors import LayoutError
from prepkit.layouts import LAYOUTS, Layout
from prepkit.layouts.dense_mx import (
    MX_DENSE_LAYOUT_IDS,
    MxFormat,
    dequantize_kernel_layout,
    is_dense_weight,
    mx_format,
    rounding_bound,
    stored_names,
    to_kernel_layout,
)
from prepkit.layouts.triton_moe import PANEL_BYTES
from prepkit.mxfp4 import BLOCK_ELEMS

# Elements quantized at once: mxfp4's nearest-code search holds 8 float32 distances an element.
ROW_SLICE_ELEMENTS = 1 << 21

RowsFn = Callable[[int, int], torch.Tensor]  # (lo, hi) -> rows [lo, hi) of a tensor


def mx_dense_layout_names() -> list[str]:
    """The ``--layout`` spellings whose engine reads MX dense weights."""
    return sorted(name for name, layout in LAYOUTS.items() if layout.layout_id in MX_DENSE_LAYOUT_IDS)


def check_layout_reads(layout: Layout, dense: str) -> None:
    """Refuse an MX ``dense`` format for a layout whose engine reads only bf16 dense weights.

    Raises:
        LayoutError: naming the layout, the format and the layouts that can.
    """
    if dense == DEFAULT_DENSE_FORMAT or layout.layout_id in MX_DENSE_LAYOUT_IDS:
        return
    can = " or ".join(f"--layout {name}" for name in mx_dense_layout_names())
    raise LayoutError(
        f"--dense {dense} is refused for --layout {layout.name}: that engine reads dense weights in bf16 only; "
        f"MX dense weights are read by {can} (the bundled kernel's engine)",
        hint=f"use {can} --dense {dense}, or keep --layout {layout.name} with --dense bf16",
    )


def check_dense_weights(ckpt: Checkpoint, names: list[str], fmt: MxFormat) -> None:
    """Every weight ``--dense`` quantizes must be a float ``[N, K]`` with K a multiple of 32.

    Raises:
        LayoutError: naming every weight that is not.
    """
    bad = []
    for name in names:
        entry = ckpt.entries[name]
        floating = entry.dtype is not None and entry.dtype.is_floating_point
        if len(entry.shape) != 2 or entry.shape[1] % BLOCK_ELEMS or not floating:
            bad.append(f"{name} ({entry.dtype_name} {list(entry.shape)})")
    if bad:
        raise LayoutError(
            f"--dense {fmt.name} needs float [N, K] weights with K a multiple of {BLOCK_ELEMS}; "
            f"these are not: {', '.join(bad)}",
            hint="prepare this checkpoint with --dense bf16",
        )


def is_quantized(name: str, dense: str) -> bool:
    """Whether checkpoint tensor ``name`` is stored in MX form under ``--dense dense``."""
    return dense != DEFAULT_DENSE_FORMAT and is_dense_weight(name)


def stored_bytes(entry: TensorEntry, dense: str) -> int:
    """Bytes the output holds for checkpoint tensor ``entry`` under ``--dense dense``."""
    if not is_quantized(entry.name, dense):
        return entry.nbytes
    n, k = entry.shape
    return mx_format(dense).stored_bytes(n, k)


def row_slices(n: int, k: int) -> Iterator[tuple[int, int]]:
    step = max(1, ROW_SLICE_ELEMENTS // max(k, 1))
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)


def quantize_weight(ckpt: Checkpoint, name: str, fmt: MxFormat) -> dict[str, torch.Tensor]:
    """Weight ``name`` of ``ckpt`` in MX form, by its stored names: ``{name_blocks: [P, N, 128],
    name_scales: [K/32, N]}`` uint8, quantized from float32 a slice of rows at a time."""
    n, k = ckpt.entries[name].shape
    blocks = torch.empty((-(-k // fmt.panel_k), n, PANEL_BYTES), dtype=torch.uint8)
    scales = torch.empty((k // BLOCK_ELEMS, n), dtype=torch.uint8)
    for lo, hi in row_slices(n, k):
        part = to_kernel_layout(ckpt.read_rows(name, lo, hi).to(torch.float32), fmt, name)
        blocks[:, lo:hi] = part["blocks"]
        scales[:, lo:hi] = part["scales"]
    blocks_name, scales_name = stored_names(name)
    return {blocks_name: blocks, scales_name: scales}


def check_stored_weight(
    name: str, shape: tuple[int, int], fmt: MxFormat, source: RowsFn, blocks: RowsFn, scales: RowsFn
) -> str | None:
    """The first problem of a stored MX weight against its source, or None.

    Each dequantized value must lie within the format's rounding bound of its source value (the
    bound taken at the scale the rounding rule gives the source, so a damaged scale cannot widen
    it), and the stored bytes must be the rule's: a changed byte that happens to stay within the
    bound (a source value on a tie) is caught too. ``blocks`` and ``scales`` give rows of the
    stored tensors (``[P, rows, 128]``, ``[K/32, rows]``).
    """
    n, k = shape
    blocks_name, scales_name = stored_names(name)
    for lo, hi in row_slices(n, k):
        want = source(lo, hi).to(torch.float32)
        got_blocks, got_scales = blocks(lo, hi), scales(lo, hi)
        try:
            got = dequantize_kernel_layout(got_blocks, got_scales, fmt, name)
        except LayoutError as err:
            return str(err)
        if got.shape != want.shape:
            return f"{name}: the stored blocks and scales hold rows of {got.shape[1]} values, the source {k}"
        rule = to_kernel_layout(want, fmt, name)
        error = (got - want).abs()
        bound = rounding_bound(want, rule["scales"].transpose(0, 1), fmt)
        beyond = ~(error <= bound)  # NaN counts as beyond
        if bool(beyond.any()):
            i, j = (int(x) for x in beyond.nonzero()[0])
            return (
                f"{name}: element [{lo + i}, {j}] dequantizes to {float(got[i, j]):.6g}, the source holds "
                f"{float(want[i, j]):.6g}: off by {float(error[i, j]):.3g}, beyond the {fmt.name} rounding "
                f"bound {float(bound[i, j]):.3g}"
            )
        for stored_name, stored, expected in (
            (blocks_name, got_blocks, rule["blocks"]),
            (scales_name, got_scales, rule["scales"]),
        ):
            differs = stored != expected
            if bool(differs.any()):
                index = [int(x) for x in differs.nonzero()[0]]
                index[1] += lo  # both hold rows along dim 1
                return f"{stored_name}: byte {index} differs from the {fmt.name} rounding of the source"
    return None
