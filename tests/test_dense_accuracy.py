"""The MX dense-weight accuracy report (benchmarks/dense_accuracy.py) at tiny shapes: its errors
stay inside what each format's rounding rule allows, mxfp8 beats mxfp4 on the same weights, and
an unchanged model agrees with itself everywhere."""

from __future__ import annotations

import warnings

import pytest
import torch

from benchmarks import dense_accuracy as acc
from prepkit.layouts.dense_mx import MXFP4, MXFP8, dequantize, quantize
from prepkit.recipes import load_recipe

TINY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize("distribution", acc.DISTRIBUTIONS)
def test_tensor_errors_sit_inside_the_formats_bounds(distribution: str) -> None:
    errors = {f.name: acc.tensor_error("q", (96, 256), f, distribution, seed=3, chunk_rows=40) for f in (MXFP8, MXFP4)}
    for e in errors.values():
        assert 0.5 < e.max_error_over_bound <= 1.0  # some element uses most of its half grid step
        assert 0 < e.relative_error <= e.relative_error_bound
    # e4m3 keeps 3 mantissa bits: a normal element moves by at most 2**-4 of itself.
    assert errors["mxfp8"].relative_error < 2**-4
    # e2m1 keeps 1: at most 2**-2 of a normal element; small ones may round to zero.
    assert errors["mxfp4"].relative_error < 2**-2
    assert errors["mxfp4"].zeroed_share > 10 * errors["mxfp8"].zeroed_share
    assert errors["mxfp8"].relative_error * 3 < errors["mxfp4"].relative_error


def test_synthetic_weights_have_the_stated_statistics() -> None:
    outliers = acc.outlier_columns(2880, seed=0)
    assert len(outliers) == round(2880 * acc.OUTLIER_COLUMN_SHARE)
    for distribution in acc.DISTRIBUTIONS:
        w = acc.synthetic_rows(512, 2880, distribution, 5, outliers).float()
        bulk = torch.ones(2880, dtype=torch.bool)
        bulk[outliers] = False
        assert w[:, bulk].std().item() == pytest.approx(acc.WEIGHT_STD, rel=0.05)
        assert w[:, outliers].std().item() == pytest.approx(acc.WEIGHT_STD * acc.OUTLIER_GAIN, rel=0.1)
    gaussian = acc.synthetic_rows(512, 2880, "gaussian", 5, outliers).float()[:, bulk]
    heavy = acc.synthetic_rows(512, 2880, "student-t", 5, outliers).float()[:, bulk]
    kurtosis = [((x / x.std()) ** 4).mean().item() for x in (gaussian, heavy)]
    assert kurtosis[0] == pytest.approx(3, abs=0.2)
    assert kurtosis[1] > 5


@pytest.mark.parametrize("fmt", [MXFP8, MXFP4], ids=lambda f: f.name)
def test_round_trip_in_row_chunks_is_the_whole_weights(fmt: acc.MxFormat) -> None:
    w = acc.synthetic_rows(70, 96, "student-t", 1, acc.outlier_columns(96, 1))
    codes, scales = quantize(w, fmt)
    assert torch.equal(acc.mx_round_trip(w, fmt, "w", chunk_rows=16), dequantize(codes, scales, fmt))


def test_dense_bytes_count_the_projections_of_every_layer_and_the_head() -> None:
    dims = load_recipe("gpt-oss-120b").reference_dims
    heads, kv, head_dim, hidden = (
        dims[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")
    )
    per_layer = 2 * heads * head_dim * hidden + 2 * kv * head_dim * hidden
    params = dims["num_hidden_layers"] * per_layer + dims["vocab_size"] * hidden
    assert acc.dense_bytes_per_token(None) == 2 * params
    # One byte (fp8) or half (fp4) an element, 1/32 byte of scale, plus the panels' K padding.
    assert params * (1 + 1 / 32) < acc.dense_bytes_per_token(MXFP8) < params * (1 + 1 / 32) * 1.03
    assert params * (0.5 + 1 / 32) < acc.dense_bytes_per_token(MXFP4) < params * (0.5 + 1 / 32) * 1.08


def test_logits_agreement_counts_flipped_argmaxes_and_clear_margins() -> None:
    ref = torch.zeros(4, 10)
    ref[:, 0] = torch.tensor([1.0, 1.0, 0.05, 0.05])  # rows 2 and 3 are near-ties with column 1
    out = ref.clone()
    out[1, 1] = 2.0  # a flip where the margin is clear
    out[2, 1] = 0.1  # a flip at a near-tie
    same = acc.logits_agreement(ref, ref, margin=0.2)
    assert (same.relative_error, same.agreement, same.margin_positions, same.margin_agreement) == (0.0, 1.0, 2, 1.0)
    got = acc.logits_agreement(ref, out, margin=0.2)
    assert got.agreement == 0.5
    assert (got.margin_positions, got.margin_agreement) == (2, 0.5)
    assert got.relative_error == pytest.approx(((2.0**2 + 0.1**2) / (1 + 1 + 0.05**2 + 0.05**2)) ** 0.5)


@pytest.fixture(scope="module")
def tiny_config() -> object:
    pytest.importorskip("transformers", reason="needs transformers (pip install 'prepkit-gpt-oss[test]')")
    return acc.small_gpt_oss_config(2, 4, 512, **TINY_DIMS)


def test_an_unchanged_model_agrees_with_itself(tiny_config: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = acc.build_model(tiny_config, seed=0)
        again = acc.build_model(tiny_config, seed=0)
    tokens = torch.randint(512, (48,), generator=torch.Generator().manual_seed(0))
    ref = acc.teacher_forced_logits(model, tokens)
    same = acc.logits_agreement(ref, acc.teacher_forced_logits(again, tokens))
    assert (same.relative_error, same.agreement) == (0.0, 1.0)
    assert set(acc.dense_linears(model)) == {
        *(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"),
        "lm_head.weight",
    }
    for param in model.parameters():  # bf16 values, the source checkpoint's
        assert torch.equal(param, param.to(torch.bfloat16).float())


def test_mx_dense_weights_move_the_logits_by_their_format(tiny_config: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = acc.model_agreement(tiny_config, 0, [MXFP8, MXFP4], positions=48)
    assert list(got)[0::2] == ["mxfp8", "mxfp4"]
    assert all(name.startswith("noise ") for name in list(got)[1::2])
    assert 0 < got["mxfp8"].relative_error < got["mxfp4"].relative_error < 1
    assert got["mxfp8"].agreement >= got["mxfp4"].agreement
    for a in got.values():
        assert a.positions == 48 and 0 <= a.margin_positions <= 48
