"""The kernel's MX activation policies (mxfp8, mxfp4) against their own fp32 references.

Without CUDA these run on the Triton CPU interpreter (tiny shapes), with CUDA on the GPU (where
Hopper runs Triton's decomposition of the same dots). The routing launch's quantization is
compared bit for bit with the reference quantizer.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prepkit.kernels.activations import quantize_mx
from prepkit.kernels.reference import moe_reference, relative_error
from prepkit.kernels.tactic import GemmTactic
from prepkit.layouts.base import RankSpec
from prepkit.runtime import moe
from tests.kernels.moe_data import make_layer, random_experts, random_inputs

E, H, I, TOP_K = 8, 64, 96, 4
MX = ("mxfp8", "mxfp4")
FORMAT = {"mxfp8": "e4m3", "mxfp4": "e2m1"}
# Kernel and reference multiply the same quantized values, so only fp32 summation order and the
# rare code flip at GEMM2's input (a SwiGLU value on a rounding edge) differ: measured ~1e-7. The
# bound sits 20x under each policy's own quantization error against bf16 (3.7e-2, 1.3e-1 here),
# so a misplaced scale or value fails it.
TOL = 2e-3

DS = GemmTactic(16, 64, 64, 4, 1, 1, "dot_scaled")


@pytest.fixture(scope="module")
def experts():
    return random_experts(E, H, I, seed=1)


def _inputs(T: int, seed: int, device: str, dead_experts: int = 0):
    return random_inputs(T, E, H, seed=seed, device=device, dead_experts=dead_experts)


def _check(experts, policy, T, tactics, seed=0, spec=None, dead=0, device="cpu"):
    spec = spec or RankSpec()
    layer, plan = make_layer(experts, TOP_K, spec=spec, device=device, activations=policy)
    x, logits = _inputs(T, seed, device, dead)
    out = moe(layer, x, logits, tactics=tactics, out_dtype=torch.float32).cpu()
    kw = dict(
        top_k=TOP_K,
        expert_range=plan.expert_range,
        intermediate_range=plan.intermediate_range,
        apply_down_bias=spec.tp_rank == 0,
        dtype=torch.float64,
    )
    ref = moe_reference(x.cpu(), logits.cpu(), experts.as_dict(), activations=policy, **kw)
    err = relative_error(out, ref)
    assert err < TOL, f"{policy} T={T} {tactics[0].key()} / {tactics[1].key()}: relative error {err:.3g}"
    return out, moe_reference(x.cpu(), logits.cpu(), experts.as_dict(), **kw)


@pytest.mark.parametrize("policy", MX)
@pytest.mark.parametrize("T", [1, 7, 33])
def test_token_counts(experts, device, policy, T):
    out, unquantized = _check(experts, policy, T, (DS, replace(DS, block_n=32)), seed=T, device=device)
    # The policy quantizes for real: well away from the unquantized layer.
    assert relative_error(out, unquantized) > 5 * TOL


@pytest.mark.parametrize("policy", MX)
def test_an_expert_without_tokens(experts, device, policy):
    _check(experts, policy, 7, (DS, replace(DS, split_k=2)), seed=11, dead=3, device=device)


@pytest.mark.parametrize("policy", MX)
@pytest.mark.parametrize(
    "g1, g2",
    [
        # 64-row tiles (no operand swap) with a 128-deep masked K tail (K = 64 and 96).
        (GemmTactic(64, 64, 128, 4, 1, 1, "dot_scaled"), GemmTactic(64, 64, 128, 4, 1, 1, "dot_scaled")),
        # Swapped tiles, a K split with a partial last split, every step masked.
        (
            GemmTactic(32, 128, 64, 4, 2, 1, "dot_scaled", k_loop="masked"),
            GemmTactic(16, 32, 64, 4, 2, 4, "dot_scaled", k_loop="masked"),
        ),
        # TMA weight tiles: swapped and plain, boxes past the K end and past the last expert's rows.
        (
            GemmTactic(16, 64, 128, 4, 3, 1, "dot_scaled", weight_load="tma"),
            GemmTactic(64, 64, 64, 4, 3, 2, "dot_scaled", weight_load="tma"),
        ),
        # GEMM1 tile wider than 2 * I: its last groups lie past the intermediate rows.
        (GemmTactic(16, 256, 64, 4, 1, 1, "dot_scaled"), GemmTactic(16, 64, 256, 4, 1, 1, "dot_scaled")),
    ],
    ids=["m64-k128-tail", "swapped-masked-split4", "tma", "wide-gemm1"],
)
def test_variant_families(experts, device, policy, g1, g2):
    _check(experts, policy, 33, (g1, g2), seed=5, device=device)


@pytest.mark.parametrize("policy", MX)
@pytest.mark.parametrize("tp_size, ep_size", [(2, 1), (3, 2)])
def test_ranks_add_up_to_the_layer(experts, device, policy, tp_size, ep_size):
    x, logits = _inputs(9, tp_size, device)
    total = torch.zeros(9, H, dtype=torch.float64)
    for spec in RankSpec.all_ranks(tp_size, ep_size):
        layer, plan = make_layer(experts, TOP_K, spec=spec, device=device, activations=policy)
        total += moe(layer, x, logits, tactics=(DS, DS), out_dtype=torch.float32).cpu().double()
    full = moe_reference(x.cpu(), logits.cpu(), experts.as_dict(), top_k=TOP_K, dtype=torch.float64, activations=policy)
    assert relative_error(total, full) < TOL


@pytest.mark.parametrize("policy", MX)
@pytest.mark.parametrize("T, hidden", [(1, 64), (7, 288), (33, 288), (70, 96)])
def test_routing_quantizes_each_token_once_bit_exactly(device, policy, T, hidden):
    """288 columns leave a partial 128-column chunk; 33 and 70 tokens take several programs."""
    from prepkit.kernels.mx import from_mx_rows, route

    g = torch.Generator().manual_seed(T)
    mags = torch.exp2(torch.randint(-12, 12, (T, hidden // 32), generator=g).float()).repeat_interleave(32, 1)
    x = (torch.randn(T, hidden, generator=g) * mags).to(torch.bfloat16)
    x[0, :32] = 0.0  # a zero group
    logits = torch.randn(T, E, generator=g)
    r = route(
        logits.to(device),
        top_k=TOP_K,
        expert_lo=0,
        num_local_experts=E,
        hidden=hidden,
        hidden_states=x.to(device),
        activations=policy,
    )
    assert r.x_mx.codes.shape[0] == T  # one quantized row per token, not per pick
    codes, scales = from_mx_rows(r.x_mx)
    want_codes, want_scales = quantize_mx(x.float(), FORMAT[policy])
    assert torch.equal(scales.cpu(), want_scales)
    assert torch.equal(codes.cpu(), want_codes)


@pytest.mark.parametrize("policy", MX)
def test_kernel_rows_round_trip(policy):
    from prepkit.kernels.mx import MxRows, from_mx_rows, group_order, to_mx_rows

    assert sorted(group_order()) == list(range(32))
    g = torch.Generator().manual_seed(0)
    top = 256 if policy == "mxfp8" else 16
    codes = torch.randint(0, top, (5, 96), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 255, (5, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    rows = to_mx_rows(codes, scales, policy)
    assert isinstance(rows, MxRows) and rows.num_cols == 96
    assert rows.codes.shape == (5, 96 if policy == "mxfp8" else 48)
    back, back_scales = from_mx_rows(rows)
    assert torch.equal(back, codes) and torch.equal(back_scales, scales)


def test_tactics_that_cannot_run_a_policy_are_refused(experts, device):
    from prepkit.kernels.mx import fused_moe

    layer, _ = make_layer(experts, TOP_K, device=device)
    x, logits = _inputs(3, 0, device)
    args = (x, logits, layer.w13_blocks, layer.w13_scales, layer.w13_bias, layer.w2_blocks, layer.w2_scales)
    kw = dict(top_k=TOP_K, expert_lo=0, valid_intermediate=I)
    with pytest.raises(ValueError, match="'mxfp8'.*upcast must be 'dot_scaled'"):
        fused_moe(*args, layer.w2_bias, gemm1=replace(DS, upcast="bits"), gemm2=DS, activations="mxfp8", **kw)
    with pytest.raises(ValueError, match="block_n must be >= 64"):
        fused_moe(*args, layer.w2_bias, gemm1=replace(DS, block_n=32), gemm2=DS, activations="mxfp4", **kw)


def test_the_gemms_refuse_rows_of_another_policy(experts, device):
    from prepkit.kernels import mx as k

    layer, _ = make_layer(experts, TOP_K, device=device)
    x, logits = _inputs(3, 0, device)
    r = k.route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H)
    w13 = (layer.w13_blocks, layer.w13_scales, layer.w13_bias)
    with pytest.raises(ValueError, match="routing quantized for 'bf16'"):
        k.gemm1_swiglu(r, x, *w13, valid_intermediate=I, tactic=DS, activations="mxfp8")
    rq = k.route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H, hidden_states=x, activations="mxfp4")
    h1 = k.gemm1_swiglu(rq, x, *w13, valid_intermediate=I, tactic=DS, activations="mxfp4")
    w2 = (layer.w2_blocks, layer.w2_scales, layer.w2_bias)
    with pytest.raises(ValueError, match="h1 holds 'mxfp4' rows"):
        k.gemm2_combine(rq, h1, *w2, tactic=DS, activations="mxfp8")
    with pytest.raises(ValueError, match="need contiguous hidden_states"):
        k.route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H, activations="mxfp8")
