"""The Triton MoE layer against the fp32 oracle built from the source checkpoint.

Without CUDA these run on the Triton CPU interpreter (tiny shapes; the interpreter is slow), with
CUDA on the GPU. Every variant family (upcast mode, split-K, tile sizes) is covered.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prepkit.kernels.reference import moe_reference, relative_error
from prepkit.kernels.tactic import GemmTactic
from prepkit.layouts.base import RankSpec
from prepkit.runtime import moe
from tests.kernels.moe_data import make_layer, random_experts, random_inputs

E, H, I, TOP_K = 8, 64, 96, 4
# bf16 activations and a bf16 intermediate against an fp64 oracle: about 2e-3 is expected.
TOL = 1e-2

SMALL = GemmTactic(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1)


@pytest.fixture(scope="module")
def experts():
    return random_experts(E, H, I, seed=1)


def _inputs(T: int, seed: int, device: str, dead_experts: int = 0):
    return random_inputs(T, E, H, seed=seed, device=device, dead_experts=dead_experts)


def _check(experts, layer, plan, x, logits, tactics, tp_rank=0):
    out = moe(layer, x, logits, tactics=tactics, out_dtype=torch.float32)
    ref = moe_reference(
        x.cpu(),
        logits.cpu(),
        experts.as_dict(),
        top_k=TOP_K,
        expert_range=plan.expert_range,
        intermediate_range=plan.intermediate_range,
        apply_down_bias=tp_rank == 0,
        dtype=torch.float64,
    )
    err = relative_error(out.cpu(), ref)
    assert err < TOL, f"relative error {err:.3g} (tactics {tactics[0].key()} / {tactics[1].key()})"
    return out


# Bigger tiles for 256 tokens keep the interpreter's program count small.
BIG = GemmTactic(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=1)


@pytest.mark.parametrize("T", [1, 7, 33, 256])
def test_token_counts(experts, device, T):
    layer, plan = make_layer(experts, TOP_K, device=device)
    x, logits = _inputs(T, seed=T, device=device)
    tile = BIG if T > 64 else SMALL
    _check(experts, layer, plan, x, logits, (tile, tile))


@pytest.mark.parametrize(
    "g1, g2",
    [
        (GemmTactic(16, 32, 64, 4, 1, 1, "dot_scaled"), GemmTactic(16, 32, 64, 4, 1, 2, "dot_scaled")),
        (SMALL, GemmTactic(16, 32, 64, 4, 1, 4)),  # split-K with a partial last split
        (GemmTactic(32, 64, 128, 4, 2, 1), GemmTactic(32, 64, 128, 4, 2, 1)),  # masked K tail
        (GemmTactic(64, 128, 64, 8, 1, 1), GemmTactic(64, 32, 64, 8, 1, 2, "dot_scaled")),
        # TMA weight tiles: swapped and plain operands, a K split, boxes past the K end and past
        # the last expert's rows (the unit zero-fills them).
        (
            GemmTactic(16, 32, 64, 4, 2, 1, weight_load="tma"),
            GemmTactic(16, 64, 64, 4, 2, 4, weight_load="tma"),
        ),
        (
            GemmTactic(32, 128, 128, 4, 2, 1, weight_load="tma"),
            GemmTactic(64, 128, 128, 4, 2, 1, weight_load="tma"),
        ),
        # Every step masked: the partial last K step inside the loop, with and without a K split.
        (
            GemmTactic(32, 64, 128, 4, 2, 1, k_loop="masked"),
            GemmTactic(16, 32, 128, 4, 2, 4, k_loop="masked"),
        ),
        (
            GemmTactic(16, 32, 128, 4, 2, 1, weight_load="tma", k_loop="masked"),
            GemmTactic(64, 64, 128, 4, 2, 2, weight_load="tma", k_loop="masked"),
        ),
        # GEMM2 adds a 64-row tile in two column halves: with 256 columns over H = 64 the first
        # half is partly past H and the second wholly.
        (SMALL, GemmTactic(64, 256, 64, 4, 1, 1)),
        # Swapped tiles with one dot per K step on the joined halves: a masked K tail, a K split
        # with a partial last split, every step masked, TMA boxes past the K end.
        (
            GemmTactic(32, 64, 128, 4, 2, 1, swapped_dot="joined"),
            GemmTactic(16, 32, 64, 4, 1, 4, swapped_dot="joined"),
        ),
        (
            GemmTactic(16, 32, 128, 4, 2, 1, k_loop="masked", swapped_dot="joined"),
            GemmTactic(16, 64, 64, 4, 2, 2, weight_load="tma", swapped_dot="joined"),
        ),
    ],
    ids=[
        "dot_scaled+split2",
        "split4",
        "k128-tail",
        "m64-mixed",
        "tma-split4",
        "tma-tail-m64",
        "masked-split4",
        "tma-masked-split2",
        "m64-halves-past-h",
        "joined-split4",
        "joined-masked-tma",
    ],  # fmt: skip
)
def test_variant_families(experts, device, g1, g2):
    layer, plan = make_layer(experts, TOP_K, device=device)
    x, logits = _inputs(33, seed=5, device=device)
    _check(experts, layer, plan, x, logits, (g1, g2))


def test_experts_without_tokens(experts, device):
    layer, plan = make_layer(experts, TOP_K, device=device)
    x, logits = _inputs(7, seed=11, device=device, dead_experts=3)
    _check(experts, layer, plan, x, logits, (SMALL, GemmTactic(16, 32, 64, 4, 1, 2)))


def test_ep_rank_with_no_picks_returns_zeros(experts, device):
    layer, plan = make_layer(experts, TOP_K, spec=RankSpec(ep_size=2, ep_rank=0), device=device)
    x, logits = _inputs(5, seed=3, device=device)
    logits[:, : E // 2] -= 100.0  # every pick lands on the other rank
    out = moe(layer, x, logits, tactics=(SMALL, SMALL), out_dtype=torch.float32)
    assert torch.equal(out.cpu(), torch.zeros(5, H))


@pytest.mark.parametrize("tp_size, ep_size", [(2, 1), (3, 2)])
def test_ranks_add_up_to_the_layer(experts, device, tp_size, ep_size):
    x, logits = _inputs(9, seed=tp_size, device=device)
    total = torch.zeros(9, H, dtype=torch.float64)
    for spec in RankSpec.all_ranks(tp_size, ep_size):
        layer, plan = make_layer(experts, TOP_K, spec=spec, device=device)
        total += _check(experts, layer, plan, x, logits, (SMALL, SMALL), tp_rank=spec.tp_rank).cpu().double()
    full = moe_reference(x.cpu(), logits.cpu(), experts.as_dict(), top_k=TOP_K, dtype=torch.float64)
    assert relative_error(total, full) < TOL


def test_every_output_row_is_written(experts, device):
    """The output buffer starts as NaN: routing must clear every row before the combine adds."""
    from prepkit.kernels.mx import fused_moe

    layer, _ = make_layer(experts, TOP_K, device=device)
    x, logits = _inputs(7, seed=2, device=device)
    out = torch.full((7, H), float("nan"), device=device)
    fused_moe(
        x,
        logits,
        layer.w13_blocks,
        layer.w13_scales,
        layer.w13_bias,
        layer.w2_blocks,
        layer.w2_scales,
        layer.w2_bias,
        top_k=TOP_K,
        expert_lo=0,
        valid_intermediate=I,
        gemm1=SMALL,
        gemm2=SMALL,
        out=out,
    )
    assert bool(torch.isfinite(out).all())


def test_wrong_weights_fail_the_check(experts, device):
    """The comparison can fail: dropping the down bias is far outside the tolerance."""
    layer, plan = make_layer(experts, TOP_K, device=device)
    layer.apply_down_bias = False
    x, logits = _inputs(7, seed=4, device=device)
    with pytest.raises(AssertionError, match="relative error"):
        _check(experts, layer, plan, x, logits, (SMALL, SMALL))


def test_nan_never_passes():
    ref = torch.ones(3, 4)
    out = ref.clone()
    out[1, 2] = float("nan")
    assert relative_error(out, ref) == float("inf")
    assert relative_error(ref, ref) == 0.0


def test_reference_routing_matches_kernel_routing(experts, device):
    """Top-k order and softmax weights agree with torch.topk (checked through the tp split)."""
    from prepkit.kernels.reference import route

    x, logits = _inputs(16, seed=8, device=device)
    ids, w = route(logits.cpu(), TOP_K)
    assert torch.allclose(w.sum(-1), torch.ones(16))
    assert bool((w[:, :-1] >= w[:, 1:]).all())
    assert ids.shape == (16, TOP_K)


@pytest.mark.parametrize("T", [1, 5, 32, 33, 70])  # one routing program (picks placed in it) and several
@pytest.mark.parametrize("expert_lo, local", [(0, E), (2, 3)])
@pytest.mark.parametrize("top_k", [TOP_K, 3])
def test_routing_groups_every_local_pick_by_expert(device, T, expert_lo, local, top_k):
    from prepkit.kernels.mx import route

    logits = torch.randn((T, E), generator=torch.Generator().manual_seed(T)).to(device)
    # The routing launch itself, also at one token, where the GEMMs would route by default.
    r = route(logits, top_k=top_k, expert_lo=expert_lo, num_local_experts=local, hidden=H, in_gemms=False)
    assert r.logits is None
    ids = torch.topk(logits.float().cpu(), top_k, dim=-1).indices.flatten()
    assert torch.equal(r.topk_ids.cpu().flatten().long(), ids)
    is_local = (ids >= expert_lo) & (ids < expert_lo + local)
    expected_counts = torch.bincount(ids[is_local] - expert_lo, minlength=local)
    assert torch.equal(r.counts.cpu().long(), expected_counts)
    n = int(is_local.sum())
    placed = r.sorted_picks.cpu()[:n].long()
    assert sorted(placed.tolist()) == torch.nonzero(is_local).flatten().tolist()  # each local pick once
    experts = ids[placed]
    assert torch.all(experts[1:] >= experts[:-1])  # grouped by expert, in expert order
    if T <= 32:  # one program groups in registers: inside an expert, picks keep their order
        assert placed.tolist() == sorted(placed.tolist(), key=lambda p: (int(ids[p]), p))


@pytest.mark.parametrize("T", [3, 40])  # one routing program, and several
def test_routing_zeroes_every_output_column(device, T):
    """Output rows are zeroed in column chunks of 128 by their own programs; 300 columns leave a
    partial last chunk."""
    from prepkit.kernels.mx import route

    hidden = 300
    logits = torch.randn((T, E), generator=torch.Generator().manual_seed(T)).to(device)
    out = torch.full((T, hidden), float("nan"), device=device)
    route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=hidden, out=out)
    assert bool((out == 0).all())


ONE_TOKEN_PAIRS = [
    (SMALL, SMALL),
    (SMALL, GemmTactic(16, 32, 64, 4, 1, 4)),  # GEMM2 split in K: every split reads GEMM1's picks
    (GemmTactic(64, 128, 64, 8, 1, 1), GemmTactic(64, 32, 64, 8, 1, 2, "dot_scaled")),
    (
        GemmTactic(16, 32, 128, 4, 2, 1, weight_load="tma", k_loop="masked", swapped_dot="joined"),
        GemmTactic(16, 64, 64, 4, 2, 2, weight_load="tma", swapped_dot="joined"),
    ),
    # GEMM1 split in K: only the first split's programs store the picks and zero the output
    (GemmTactic(16, 32, 64, 4, 1, 2), SMALL),
    (GemmTactic(16, 64, 64, 4, 3, 4, weight_load="tma", k_loop="masked", swapped_dot="joined"), SMALL),
]


def _one_token_logits(device: str, seed: int, ties: bool) -> torch.Tensor:
    logits = torch.randn((1, E), generator=torch.Generator().manual_seed(seed))
    if ties:  # the top values tie in pairs: the lower expert id comes first, as the routing launch has it
        logits[0, 6] = logits[0, 1] = 3.0
        logits[0, 5] = logits[0, 2] = 2.5
    return logits.to(device)


@pytest.mark.parametrize(
    "pair", ONE_TOKEN_PAIRS, ids=["small", "split4", "m64", "tma-joined", "gemm1-split2", "gemm1-tma-split4"]
)
# EP 4 holds 2 experts a rank: fewer than the picks, which still get a row block each.
@pytest.mark.parametrize(
    "spec",
    [None, RankSpec(tp_size=2, tp_rank=1), RankSpec(ep_size=2, ep_rank=1), RankSpec(ep_size=4, ep_rank=2)],
    ids=["tp1", "tp2-rank1", "ep2-rank1", "ep4-rank2"],
)
@pytest.mark.parametrize("ties", [False, True])
def test_one_token_is_routed_by_the_gemms(experts, device, pair, spec, ties):
    """At one token GEMM1 picks the experts from the logits (no routing launch) and zeroes the
    output: the same picks and weights, bit for bit, as the routing launch, and the same layer."""
    from prepkit.kernels.mx import gemm1_swiglu, gemm2_combine, route

    layer, plan = make_layer(experts, TOP_K, spec=spec, device=device)
    x, _ = _inputs(1, seed=21, device=device)
    logits = _one_token_logits(device, seed=22, ties=ties)
    lo = layer.expert_range[0]
    kwargs = dict(top_k=TOP_K, expert_lo=lo, num_local_experts=layer.num_local_experts, hidden=H)
    launched = route(logits, **kwargs, in_gemms=False)
    out = torch.full((1, H), float("nan"), device=device)
    routing = route(logits, **kwargs, out=out)
    assert routing.logits is logits and routing.expert_lo == lo
    h1 = gemm1_swiglu(routing, x, layer.w13_blocks, layer.w13_scales, layer.w13_bias,
                      valid_intermediate=layer.valid_intermediate, tactic=pair[0])  # fmt: skip
    assert torch.equal(routing.topk_ids.cpu(), launched.topk_ids.cpu())
    assert torch.equal(routing.topk_weights.cpu(), launched.topk_weights.cpu())
    w2_bias = layer.w2_bias if layer.apply_down_bias else None
    gemm2_combine(routing, h1, layer.w2_blocks, layer.w2_scales, w2_bias, tactic=pair[1])
    ref = moe_reference(
        x.cpu(), logits.cpu(), experts.as_dict(), top_k=TOP_K, expert_range=plan.expert_range,
        intermediate_range=plan.intermediate_range, apply_down_bias=layer.apply_down_bias, dtype=torch.float64,
    )  # fmt: skip
    if not ref.any():  # an EP rank none of whose experts the token picked adds nothing
        assert torch.equal(out.cpu(), torch.zeros(1, H))
    else:
        assert relative_error(out.cpu(), ref) < TOL


def test_one_token_keeps_the_routing_launch_for_mx_activations(device):
    """The MX policies quantize the token's row in the routing launch, so it stays."""
    from prepkit.kernels.mx import route, routes_in_gemms

    assert routes_in_gemms(1, "bf16") and not routes_in_gemms(2, "bf16")
    assert not routes_in_gemms(1, "mxfp8") and not routes_in_gemms(1, "mxfp4")
    logits = _one_token_logits(device, seed=3, ties=False)
    x = torch.randn((1, H)).to(torch.bfloat16).to(device)
    r = route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H, hidden_states=x, activations="mxfp8")
    assert r.logits is None
    ids = torch.topk(logits.float().cpu(), TOP_K, dim=-1).indices
    assert torch.equal(r.topk_ids.cpu().long(), ids)


# Four 64-wide K steps in GEMM1 (hidden 256): every split of 2 and 4 sums real steps.
WIDE_H = 256


@pytest.fixture(scope="module")
def wide_experts():
    return random_experts(E, WIDE_H, I, seed=4)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize(
    "g1",
    [
        GemmTactic(16, 32, 64, 4, 1, 2),
        GemmTactic(16, 64, 64, 4, 3, 4, weight_load="tma", k_loop="masked", swapped_dot="joined"),
        GemmTactic(32, 32, 128, 4, 2, 2, swapped_dot="joined"),  # the last split's step is partial
    ],
    ids=["split2", "tma-joined-split4", "m32-split2"],
)
def test_gemm1_split_k_matches_the_unsplit_layer(wide_experts, device, T, g1):
    """GEMM1 with K splits (one token routed by the GEMMs, and grouped picks): the last split of
    each tile sums every split's partials and applies SwiGLU; the layer matches the unsplit one
    and the reference, and every tile's counter is back at zero for the next call."""
    from prepkit.kernels.mx.dense import split_counters

    layer, plan = make_layer(wide_experts, TOP_K, device=device)
    x, logits = random_inputs(T, E, WIDE_H, seed=40 + T, device=device)
    g2 = GemmTactic(16, 32, 64, 4, 1, 1)
    split = moe(layer, x, logits, tactics=(g1, g2), out_dtype=torch.float32)
    whole = moe(layer, x, logits, tactics=(replace(g1, split_k=1), g2), out_dtype=torch.float32)
    ref = moe_reference(
        x.cpu(), logits.cpu(), wide_experts.as_dict(), top_k=TOP_K, expert_range=plan.expert_range,
        intermediate_range=plan.intermediate_range, apply_down_bias=True, dtype=torch.float64,
    )  # fmt: skip
    assert relative_error(split.cpu(), ref) < TOL
    assert relative_error(split.cpu(), whole.cpu().double()) < 1e-5
    assert not bool(split_counters(x.device, 1).any())
