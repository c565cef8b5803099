"""Dense MX weights: the rounding rule, its bound, and the stored layout's inverse."""

from __future__ import annotations

import pytest
import torch

from prepkit.errors import LayoutError
from prepkit.layouts import dense_mx
from prepkit.layouts.dense_mx import MX_FORMATS, MXFP4, MXFP8
from prepkit.layouts.triton_moe import PANEL_BYTES
from prepkit.mxfp4 import FP4_VALUES

FORMATS = list(MX_FORMATS.values())


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # gpt-oss-like: small values, a few large outliers per row.
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.rand(n, k, generator=g) < 0.01] *= 20
    return w.to(torch.bfloat16)


def _grid(fmt: dense_mx.MxFormat) -> torch.Tensor:
    if fmt is MXFP4:
        return torch.tensor(FP4_VALUES)
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_puts_the_block_maximum_in_the_top_binade_without_clipping(fmt: dense_mx.MxFormat) -> None:
    w = _weight(8, 256).float()
    _, scales = dense_mx.quantize(w, fmt)
    amax = w.unflatten(-1, (-1, 32)).abs().amax(-1)
    scale = torch.exp2(scales.float() - 127)
    assert bool((amax / scale <= fmt.max_value).all())
    assert bool((amax / scale > fmt.max_value / 2).all())  # one step smaller would clip


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_element_is_the_nearest_grid_value(fmt: dense_mx.MxFormat) -> None:
    w = _weight(4, 128, seed=1).float()
    codes, scales = dense_mx.quantize(w, fmt)
    got = dense_mx.dequantize(codes, scales, fmt)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    grid = _grid(fmt)
    grid = grid[torch.isfinite(grid)]
    nearest = (w / scale).unsqueeze(-1).sub(grid).abs().amin(-1) * scale
    assert torch.allclose((got - w).abs(), nearest, rtol=0, atol=1e-12)
    assert bool(((got - w).abs() <= dense_mx.rounding_bound(w, scales, fmt)).all())


def test_fp4_ties_go_to_the_even_code() -> None:
    # 32 elements so one scale: block max 6 -> scale 1; 0.25, 0.75, 2.5, 5 sit half way.
    row = torch.zeros(1, 32)
    row[0, :5] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0])
    codes, scales = dense_mx.quantize(row, MXFP4)
    assert int(scales[0, 0]) == 127
    assert dense_mx.dequantize(codes, scales, MXFP4)[0, :5].tolist() == [6.0, 0.0, 1.0, 2.0, 4.0]


def test_an_all_zero_block_gets_the_smallest_scale() -> None:
    w = _weight(2, 64, seed=2).float()
    w[0, :32] = 0
    codes, scales = dense_mx.quantize(w, MXFP8)
    assert int(scales[0, 0]) == 0
    assert bool((dense_mx.dequantize(codes, scales, MXFP8)[0, :32] == 0).all())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("k", [2880, 96, 256])
def test_kernel_layout_round_trips(fmt: dense_mx.MxFormat, k: int) -> None:
    w = _weight(24, k, seed=k)
    stored = dense_mx.to_kernel_layout(w, fmt)
    panels = -(-k // fmt.panel_k)
    assert list(stored["blocks"].shape) == [panels, 24, PANEL_BYTES]
    assert list(stored["scales"].shape) == [k // 32, 24]
    assert stored["blocks"].numel() + stored["scales"].numel() == fmt.stored_bytes(24, k)
    codes, scales = dense_mx.quantize(w, fmt)
    back_codes, back_scales = dense_mx.from_kernel_layout(stored["blocks"], stored["scales"], fmt)
    assert torch.equal(back_codes, codes)
    assert torch.equal(back_scales, scales)
    assert torch.equal(dense_mx.codes_to_panels(back_codes, fmt), stored["blocks"])


def test_fp4_panels_use_the_moe_byte_order() -> None:
    # Byte j of a stored group (before the fragment order) holds elements j and j + 16.
    codes = torch.randint(0, 16, (1, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    panel = dense_mx.codes_to_panels(codes, MXFP4)[0, 0, :16]
    from prepkit.layouts.triton_moe import FRAGMENT_ORDER

    for stored, j in enumerate(FRAGMENT_ORDER):
        assert int(panel[stored]) == int(codes[0, j]) | (int(codes[0, j + 16]) << 4)


def test_nonzero_panel_padding_is_refused() -> None:
    stored = dense_mx.to_kernel_layout(_weight(4, 96), MXFP4)
    stored["blocks"][-1, 0, -1] = 1
    with pytest.raises(LayoutError, match="weight_blocks"):
        dense_mx.from_kernel_layout(stored["blocks"], stored["scales"], MXFP4)


def test_bad_weights_are_named() -> None:
    with pytest.raises(LayoutError, match="q_proj"):
        dense_mx.to_kernel_layout(torch.ones(4, 40), MXFP4, "q_proj")
    bad = _weight(4, 64).float()
    bad[1, 3] = float("nan")
    with pytest.raises(LayoutError, match="lm_head.*NaN"):
        dense_mx.to_kernel_layout(bad, MXFP8, "lm_head")
    with pytest.raises(LayoutError, match="bf16"):
        dense_mx.mx_format("bf16")


def test_only_projections_and_the_head_are_dense_weights() -> None:
    assert dense_mx.is_dense_weight("model.layers.3.self_attn.q_proj.weight")
    assert dense_mx.is_dense_weight("lm_head.weight")
    for other in (
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.3.self_attn.sinks",
        "model.layers.3.mlp.router.weight",
        "model.embed_tokens.weight",
        "model.layers.x.self_attn.o_proj.weight",
    ):
        assert not dense_mx.is_dense_weight(other)
