"""The torch-side MX codec (prepkit.mx_codec) against the kernels' own quantizer, bit for bit, and
the one E2M1 rounding rule shared by the activation and the weight quantizers."""

from __future__ import annotations

import pytest
import torch

from prepkit import mx_codec
from prepkit.mx_formats import MX_FORMATS, MXFP4


def _rows_with_edges(policy: str, seed: int = 0) -> torch.Tensor:
    """bf16 rows: random values, and groups built on the format's rounding midpoints (ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((5, 128), generator=g) * torch.logspace(-3, 3, 5)[:, None]
    grid = mx_codec.decode_elements(torch.arange(8, dtype=torch.uint8), MX_FORMATS["mxfp4"])
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties of e2m1 at unit scale (the 6.0 keeps the scale at 1)
    x[0, :32] = torch.cat([mids, -mids, torch.full((16,), 0.0), torch.tensor([6.0, -0.0])])
    x[1, 32:64] = 0.0  # an all-zero group
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("policy", ["mxfp8", "mxfp4"])
def test_the_kernels_quantizer_is_the_codecs_ocp_rule(device: str, policy: str) -> None:
    from prepkit.kernels.mx import from_mx_rows
    from prepkit.kernels.mx.dense import quantize_rows

    x = _rows_with_edges(policy).to(device)
    codes, scales = from_mx_rows(quantize_rows(x, policy, natural=False))  # type: ignore[arg-type]
    want_codes, want_scales = mx_codec.quantize_ocp(x.float().cpu(), MX_FORMATS[policy])
    assert torch.equal(scales.cpu(), want_scales)
    assert torch.equal(codes.cpu(), want_codes)


def test_both_scale_rules_round_elements_alike() -> None:
    # At a unit scale (a block whose largest magnitude is the format's maximum) the two scale rules
    # agree, so the codes show the one rounding rule: nearest, ties to the even code.
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    ocp, s1 = mx_codec.quantize_ocp(vals, MXFP4)
    up, s2 = mx_codec.quantize_round_up(vals, MXFP4)
    assert torch.equal(s1, s2) and int(s1[0]) == 127
    assert torch.equal(ocp, up)
    assert ocp[:8].tolist() == [0, 2, 2, 4, 4, 6, 6, 7]


def test_stored_weights_write_zero_unsigned_and_activations_keep_the_sign() -> None:
    vals = torch.tensor([-0.0, -0.1] + [6.0] * 30)
    up, _ = mx_codec.quantize_round_up(vals, MXFP4)
    ocp, _ = mx_codec.quantize_ocp(vals, MXFP4)
    assert up[:2].tolist() == [0, 8] and ocp[:2].tolist() == [8, 8]


def test_the_checkpoint_form_round_trips_through_the_oracle() -> None:
    from prepkit import mxfp4

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (3, 4), dtype=torch.uint8, generator=g)
    values = mxfp4.dequantize(blocks, scales)
    b2, s2 = mx_codec.quantize_mxfp4_blocks(values)
    assert torch.equal(mxfp4.dequantize(b2, s2), values)


def test_an_unknown_element_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="e2m1"):
        mx_codec.element_format("e5m2")
