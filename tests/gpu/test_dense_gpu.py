"""The dense MX linear on a GPU at gpt-oss's dense shapes (fused qkv, o_proj, lm_head) and decode to
prefill token counts, against the weight dequantized from its stored form, in fp32."""

from __future__ import annotations

import pytest
import torch

from prepkit.layouts import dense_mx

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}
POLICIES = [("mxfp4", "bf16"), ("mxfp4", "mxfp8"), ("mxfp4", "mxfp4"), ("mxfp8", "bf16"), ("mxfp8", "mxfp8")]
TOL = 2e-2  # relative to the output's largest value (bf16 output); errors sit near 4e-3


@pytest.fixture(scope="module")
def weights() -> dict[tuple[str, str], tuple[object, torch.Tensor, torch.Tensor]]:
    """(stored weight, its dequantized fp32 form, a bias) per shape and format, made once."""
    from prepkit.kernels.mx import DenseMxWeights

    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        for fmt in ("mxfp4", "mxfp8"):
            f = dense_mx.mx_format(fmt)
            codes = torch.randint(0, 16 if fmt == "mxfp4" else 256, (n, k), generator=g, device="cuda").to(torch.uint8)
            if fmt == "mxfp8":
                codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)  # no NaN codes
            scales = torch.randint(119, 122, (k // 32, n), generator=g, device="cuda").to(torch.uint8)
            w = DenseMxWeights(dense_mx.codes_to_panels(codes, f), scales, fmt)
            ref = dense_mx.dequantize_kernel_layout(w.blocks, w.scales, f)
            bias = (torch.randn(n, generator=g, device="cuda") * 0.1).to(torch.bfloat16)
            out[(name, fmt)] = (w, ref, bias)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("fmt", "activations"), POLICIES)
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_dense_matches_the_dequantized_weight_at_real_shapes(
    weights: dict, shape: str, fmt: str, activations: str, tokens: int
) -> None:
    from prepkit.kernels.activations import fake_quantize
    from prepkit.kernels.mx import mx_linear

    w, ref_w, bias = weights[(shape, fmt)]
    x = (torch.randn((tokens, w.k), device="cuda") * 0.5).to(torch.bfloat16)
    y = mx_linear(x, w, bias, activations=activations)
    ref = fake_quantize(x.float(), activations, torch.float32) @ ref_w.T + bias.float()
    assert y.shape == (tokens, w.n) and y.dtype == torch.bfloat16
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert err < TOL, f"{shape} {fmt} {activations} T={tokens}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_sweep_space_variants_agree_at_one_token(weights: dict, fmt: str) -> None:
    """Every variant a sweep may pick for o_proj at one token (split-K, TMA) gives the default's sums."""
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.mx import mx_linear
    from prepkit.kernels.variants import dense_sweep_space

    w, ref_w, bias = weights[("o", fmt)]
    x = (torch.randn((1, w.k), device="cuda") * 0.5).to(torch.bfloat16)
    ref = x.float() @ ref_w.T + bias.float()
    for t in dense_sweep_space(fmt, DeviceInfo.from_torch(), 1, w.n, w.k):
        y = mx_linear(x, w, bias, tactic=t)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err < TOL, f"{fmt} {t.key()}: relative error {err:.2e}"


def test_module_captures_in_a_cuda_graph(weights: dict) -> None:
    from prepkit.runtime.dense import MxLinear

    w, _, bias = weights[("qkv", "mxfp4")]
    m = MxLinear(w.blocks, w.scales, bias, "mxfp4")
    x = (torch.randn((1, w.k), device="cuda") * 0.5).to(torch.bfloat16)
    eager = m(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        m(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = m(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    compiled = torch.compile(m, fullgraph=True)
    assert torch.equal(compiled(x), eager)
