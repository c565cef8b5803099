"""Launch plans on a GPU: a replayed call computes what the ordinary launchers compute, on new
tensors each time, eagerly and inside a CUDA graph, for each activation policy."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.kernels.moe_data import make_layer, random_experts, random_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

E, H, I, TOP_K = 32, 512, 448, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def experts():
    return random_experts(E, H, I, seed=3)


@pytest.mark.parametrize("activations", ["bf16", "mxfp8"])
@pytest.mark.parametrize("tokens", [1, 5, 33, 64])
def test_replay_matches_the_launchers(experts, activations, tokens):
    from prepkit.kernels import mx
    from prepkit.runtime import moe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer, _ = make_layer(experts, TOP_K, device="cuda", activations=activations)
        first = random_inputs(tokens, E, H, seed=1, device="cuda")
        moe(layer, *first)  # recorded
        assert len(layer._plans) == 1
        calls = []
        real = mx.fused_moe
        try:
            mx.fused_moe = lambda *a, **k: calls.append(1) or real(*a, **k)
            for seed in (2, 3, 4):  # new tensors each call: the plan must read them, not the first ones
                x, logits = random_inputs(tokens, E, H, seed=seed, device="cuda")
                out = torch.full((tokens, H), float("nan"), device="cuda")
                out = moe(layer, x, logits, out_dtype=torch.float32)
                ref = real(
                    x, logits, layer.w13_blocks, layer.w13_scales, layer.w13_bias, layer.w2_blocks,
                    layer.w2_scales, layer.w2_bias, top_k=TOP_K, expert_lo=0,
                    valid_intermediate=layer.valid_intermediate, gemm1=layer.tactics(tokens)[0],
                    gemm2=layer.tactics(tokens)[1], small_scales=layer.small_scales, activations=activations,
                )  # fmt: skip
                assert torch.isfinite(out).all()
                assert _rel(out, ref) < 1e-4  # only the order of the fp32 atomic adds differs
        finally:
            mx.fused_moe = real
        assert not calls, "replays must not go through the ordinary launchers"


def test_replay_inside_a_cuda_graph(experts):
    from prepkit.runtime import moe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer, _ = make_layer(experts, TOP_K, device="cuda")
        x, logits = random_inputs(3, E, H, seed=5, device="cuda")
        eager = moe(layer, x, logits, out_dtype=torch.float32).clone()
        moe(layer, x, logits)  # replay once eagerly too
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe(layer, x, logits)  # warm the capture stream's plan
            with torch.cuda.graph(graph, stream=stream):
                captured = moe(layer, x, logits, out_dtype=torch.float32)
        torch.cuda.current_stream().wait_stream(stream)
        for seed in (6, 7):
            nx, nl = random_inputs(3, E, H, seed=seed, device="cuda")
            x.copy_(nx)
            logits.copy_(nl)
            graph.replay()
            torch.cuda.synchronize()
            ref = moe(layer, nx.clone(), nl.clone(), out_dtype=torch.float32)
            assert _rel(captured, ref) < 1e-4
        assert _rel(eager, eager) == 0.0


def test_misaligned_or_strided_inputs_take_the_ordinary_path(experts):
    from prepkit.runtime import moe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer, _ = make_layer(experts, TOP_K, device="cuda")
        x, logits = random_inputs(2, E, H, seed=8, device="cuda")
        ref = moe(layer, x, logits, out_dtype=torch.float32)
        # a view that starts 2 bytes in: the recorded kernels assume 16-byte aligned rows
        big = torch.empty(2 * H + 1, dtype=torch.bfloat16, device="cuda")
        shifted = big[1:].view(2, H)
        shifted.copy_(x)
        assert shifted.data_ptr() % 16 != 0
        out = moe(layer, shifted, logits, out_dtype=torch.float32)
        assert _rel(out, ref) < 1e-4
