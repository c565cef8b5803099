"""Full-size checks of the bundled MoE kernel on a GPU (gpt-oss-120b dims: E=128, H=I=2880, top-4).

The experts are random checkpoint bytes; they go through the triton-moe layout and the kernel, and
the oracle dequantizes the *source* bytes with prepkit.mxfp4 in fp32.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from prepkit.mxfp4 import FP4_VALUES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

E, H, I, TOP_K = 128, 2880, 2880, 4
TOL = 1e-2  # bf16 activations and intermediate; measured errors sit near 3e-3


@pytest.fixture(scope="module")
def checkpoint():
    from prepkit.layouts.base import ExpertWeights

    g = torch.Generator(device="cuda").manual_seed(0)

    def u8(shape, lo, hi):
        return torch.randint(lo, hi, shape, generator=g, device="cuda", dtype=torch.uint8)

    return ExpertWeights(
        gate_up_proj_blocks=u8((E, 2 * I, H // 32, 16), 0, 256),
        gate_up_proj_scales=u8((E, 2 * I, H // 32), 119, 124),
        gate_up_proj_bias=(torch.randn((E, 2 * I), generator=g, device="cuda") * 0.1).to(torch.bfloat16),
        down_proj_blocks=u8((E, H, I // 32, 16), 0, 256),
        down_proj_scales=u8((E, H, I // 32), 119, 124),
        down_proj_bias=(torch.randn((E, H), generator=g, device="cuda") * 0.1).to(torch.bfloat16),
    )


def _layer(checkpoint, spec):
    from prepkit.runtime import MoeLayer

    return MoeLayer.from_experts(checkpoint, top_k=TOP_K, rank=spec)


def _inputs(T, seed, dead=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn((T, E), generator=g, device="cuda")
    if dead:
        logits[:, :dead] -= 100.0
    return x, logits


def _reference(checkpoint, x, logits, plan, tp_rank):
    from prepkit.kernels.reference import moe_reference

    torch.backends.cuda.matmul.allow_tf32 = False
    return moe_reference(
        x,
        logits,
        checkpoint.as_dict(),
        top_k=TOP_K,
        expert_range=plan.expert_range,
        intermediate_range=plan.intermediate_range,
        apply_down_bias=tp_rank == 0,
    )


TACTICS = [
    None,  # the built-in default for the token count
    ("m16n64k128w4s3sk1", "m16n64k128w4s3sk4"),
    ("m64n128k64w8s3sk1", "m32n64k256w4s3sk2"),
    ("m16n64k128w4s3sk1udot_scaled", "m16n128k128w4s3sk2udot_scaled"),
    ("m16n64k128w4s3sk1", "m64n64k128w4s3sk1uasm"),
    ("m128n128k64w8s3sk1uasm", "m16n64k256w4s3sk2uasm"),
    ("m16n128k128w4s4sk1uasmltma", "m16n256k128w8s3sk4uasmltma"),
    ("m64n256k64w4s3sk1uasmltma", "m32n128k256w4s3sk2uasmltma"),
    ("m16n64k256w4s3sk1uasmltmakmasked", "m16n128k128w4s4sk2uasmltmakmasked"),
    ("m32n128k128w4s4sk1uasmltmadjoined", "m16n128k128w4s4sk4uasmdjoined"),
]


def _parse(key: str):
    import re

    from prepkit.kernels.tactic import GemmTactic

    m = re.fullmatch(
        r"m(\d+)n(\d+)k(\d+)w(\d+)s(\d+)sk(\d+)(?:u(bits|asm|dot_scaled))?(?:l(ptr|tma))?"
        r"(?:k(tail|masked))?(?:d(split|joined))?",
        key,
    )
    assert m, key
    bm, bn, bk, w, s, sk = (int(v) for v in m.groups()[:6])
    return GemmTactic(
        bm, bn, bk, w, s, sk, m.group(7) or "bits", m.group(8) or "ptr", m.group(9) or "tail", m.group(10) or "split"
    )


@pytest.mark.parametrize("T", [1, 7, 33, 256])
@pytest.mark.parametrize(
    "keys",
    TACTICS,
    ids=["default", "split4", "big", "dot_scaled", "asm64", "asm128", "tma16", "tma64", "masked", "joined"],
)
def test_full_size_layer(checkpoint, T, keys):
    from prepkit.kernels.reference import relative_error
    from prepkit.layouts.base import RankSpec
    from prepkit.runtime import moe

    layer, plan = _layer(checkpoint, RankSpec())
    x, logits = _inputs(T, seed=T)
    tactics = None if keys is None else (_parse(keys[0]), _parse(keys[1]))
    with pytest.warns(UserWarning, match="no tuned tactic") if keys is None else contextlib.nullcontext():
        out = moe(layer, x, logits, tactics=tactics, out_dtype=torch.float32)
    err = relative_error(out, _reference(checkpoint, x, logits, plan, 0))
    assert err < TOL, f"T={T} {keys}: relative error {err:.3g}"


@pytest.mark.parametrize("tp_size, ep_size", [(2, 1), (8, 1), (1, 4)])
def test_full_size_ranks(checkpoint, tp_size, ep_size):
    from prepkit.kernels.reference import relative_error
    from prepkit.layouts.base import RankSpec
    from prepkit.runtime import moe

    x, logits = _inputs(33, seed=tp_size * 10 + ep_size, dead=5)
    specs = RankSpec.all_ranks(tp_size, ep_size)
    for spec in (specs[0], specs[-1]):
        layer, plan = _layer(checkpoint, spec)
        out = moe(layer, x, logits, out_dtype=torch.float32)
        err = relative_error(out, _reference(checkpoint, x, logits, plan, spec.tp_rank))
        assert err < TOL, f"{spec}: relative error {err:.3g}"


@pytest.mark.parametrize(
    "tp_size, keys",
    [
        (2, None),  # the one-token default splits GEMM1's K on a TP 2 rank (and 4 ways on TP 4)
        (4, None),
        (1, ("m16n64k256w4s4sk2uasmltmakmaskeddjoined", "m16n64k256w4s4sk2uasmltmakmasked")),
        (2, ("m16n64k256w4s4sk8uasmltmakmasked", "m16n64k256w4s3sk2uasmltmakmasked")),
    ],
    ids=["tp2-default", "tp4-default", "tp1-joined-split2", "tp2-split8"],
)
def test_full_size_one_token_gemm1_k_splits(checkpoint, tp_size, keys):
    """GEMM1 with K splits at one token (the GEMMs route it): the last split of each tile sums the
    partials and applies SwiGLU, for the first and the last TP rank."""
    from prepkit.kernels.reference import relative_error
    from prepkit.kernels.variants import default_tactics
    from prepkit.layouts.base import RankSpec
    from prepkit.runtime import moe

    x, logits = _inputs(1, seed=70 + tp_size)
    specs = RankSpec.all_ranks(tp_size, 1)
    for spec in (specs[0], specs[-1]):
        layer, plan = _layer(checkpoint, spec)
        if keys is None:
            from prepkit.kernels.device import H100

            tactics = default_tactics(layer.problem(1), H100)
            assert tactics[0].split_k > 1
        else:
            tactics = (_parse(keys[0]), _parse(keys[1]))
        out = moe(layer, x, logits, tactics=tactics, out_dtype=torch.float32)
        err = relative_error(out, _reference(checkpoint, x, logits, plan, spec.tp_rank))
        assert err < TOL, f"{spec} {tactics[0].key()}: relative error {err:.3g}"


def test_sample_of_every_enumerated_variant():
    """A stride through the whole variant space on small shapes: a failing variant is a failure."""
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.reference import relative_error
    from prepkit.kernels.variants import enumerate_tactics
    from prepkit.layouts.base import ExpertWeights, RankSpec
    from prepkit.runtime import moe

    e, h, i = 8, 512, 256
    g = torch.Generator(device="cuda").manual_seed(7)

    def u8(shape, lo, hi):
        return torch.randint(lo, hi, shape, generator=g, device="cuda", dtype=torch.uint8)

    small = ExpertWeights(
        gate_up_proj_blocks=u8((e, 2 * i, h // 32, 16), 0, 256),
        gate_up_proj_scales=u8((e, 2 * i, h // 32), 119, 124),
        gate_up_proj_bias=(torch.randn((e, 2 * i), generator=g, device="cuda") * 0.1).to(torch.bfloat16),
        down_proj_blocks=u8((e, h, i // 32, 16), 0, 256),
        down_proj_scales=u8((e, h, i // 32), 119, 124),
        down_proj_bias=(torch.randn((e, h), generator=g, device="cuda") * 0.1).to(torch.bfloat16),
    )
    from prepkit.kernels.reference import moe_reference
    from prepkit.layouts.base import LayoutOptions, ModelDims
    from prepkit.layouts.triton_moe import LAYOUT
    from prepkit.runtime import MoeLayer

    plan = LAYOUT.plan_rank(ModelDims(1, e, h, i, TOP_K), RankSpec(), LayoutOptions())
    layer = MoeLayer.from_tensors(
        LAYOUT.build(small, plan),
        layout_id=LAYOUT.layout_id,
        num_experts=e,
        expert_range=(0, e),
        valid_intermediate=i,
        top_k=TOP_K,
        facts=plan.facts,
    )
    x = torch.randn((40, h), generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn((40, e), generator=g, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = moe_reference(x, logits, small.as_dict(), top_k=TOP_K)
    device = DeviceInfo.from_torch()
    g1s = enumerate_tactics("gemm1", device)
    g2s = enumerate_tactics("gemm2", device)
    n = 24
    failures = []
    for j in range(n):
        g1, g2 = g1s[j * len(g1s) // n], g2s[(j * 7919) % len(g2s)]
        out = moe(layer, x, logits, tactics=(g1, g2), out_dtype=torch.float32)
        err = relative_error(out, ref)
        if not err < TOL:
            failures.append(f"{g1.key()}/{g1.upcast} + {g2.key()}/{g2.upcast}: {err:.3g}")
    assert not failures, failures


FOLD_PAIRS = [
    ("m16n128k128w4s4sk1uasmltma", "m16n128k128w4s4sk2uasmltma"),
    ("m64n256k64w4s3sk1uasm", "m64n256k64w4s3sk1uasmltma"),
    ("m16n128k128w4s4sk1uasmltmadjoined", "m32n128k128w4s4sk2uasmdjoined"),
]


@pytest.mark.parametrize("keys", FOLD_PAIRS)
def test_folded_upcast_gives_the_same_bits(checkpoint, keys):
    from prepkit.kernels import mx as k
    from prepkit.layouts.base import RankSpec

    layer, _ = _layer(checkpoint, RankSpec())
    assert layer.small_scales == (True, True)  # scale bytes 119..123
    t1, t2 = (_parse(key) for key in keys)
    x, logits = _inputs(96, seed=11)
    # One routing for both: with several routing programs the grouped row order is arrival order.
    r = k.route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H)
    h1s, outs = [], []
    for small in (False, True):
        r.out.zero_()
        h1 = k.gemm1_swiglu(r, x, layer.w13_blocks, layer.w13_scales, layer.w13_bias, valid_intermediate=I,
                            tactic=t1, small_scales=small)  # fmt: skip
        k.gemm2_combine(r, h1, layer.w2_blocks, layer.w2_scales, layer.w2_bias, tactic=t2, small_scales=small)
        h1s.append(h1)
        outs.append(r.out.clone())
    assert torch.equal(h1s[0], h1s[1])
    # GEMM2 adds the picks with fp32 atomics in arrival order: equal up to that order.
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5 * float(outs[0].abs().max()))


def test_scales_above_two_keep_the_two_step_upcast(checkpoint):
    from dataclasses import replace

    from prepkit.layouts.base import RankSpec
    from prepkit.runtime import moe

    big = checkpoint.down_proj_scales.clone()
    big[:, :7, 3] = 131  # scale 2^4 on a few down-projection groups of every expert
    ck = replace(checkpoint, down_proj_scales=big)
    layer, plan = _layer(ck, RankSpec())
    assert layer.small_scales == (True, False)
    x, logits = _inputs(7, seed=12)
    got = moe(layer, x, logits, out_dtype=torch.float32)
    want = _reference(ck, x, logits, plan, 0)
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < TOL


# TMA tiles the tuner may pick, both K loops; two-stage TMA tiles (excluded from the variant space)
# failed exactly this check: wrong rows that moved from launch to launch.
STABLE_TILES = [
    "m16n128k128w4s3sk1uasmltma",
    "m16n128k128w4s4sk1uasmltmakmasked",
    "m16n64k256w4s3sk1uasmltmakmasked",
    "m16n128k64w4s3sk1uasmltma",
    "m32n128k128w4s4sk1uasmltma",
    "m64n256k64w4s3sk1uasmltma",
    "m16n128k128w4s4sk1uasmltmadjoined",
    "m32n128k128w4s4sk1uasmltmakmaskeddjoined",
]


@pytest.mark.parametrize("key", STABLE_TILES)
def test_gemm1_gives_the_same_bits_in_every_launch(checkpoint, key):
    """GEMM1 has no atomics, so every launch of a TMA tile, and the same tile with pointer loads and
    the tail K loop (same summation order), give the same bits."""
    from dataclasses import replace

    from prepkit.kernels import mx as k
    from prepkit.layouts.base import RankSpec

    layer, _ = _layer(checkpoint, RankSpec())
    t = _parse(key)
    x, logits = _inputs(256, seed=13)
    r = k.route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H)
    w13 = (layer.w13_blocks, layer.w13_scales, layer.w13_bias)

    def run(tactic):
        return k.gemm1_swiglu(r, x, *w13, valid_intermediate=I, tactic=tactic, small_scales=layer.small_scales[0])

    want = run(replace(t, weight_load="ptr", k_loop="tail"))
    for launch in range(4):
        got = run(t)
        bad = int((got != want).sum())
        assert bad == 0, f"{key}, launch {launch}: {bad} values differ from pointer loads"


@pytest.mark.parametrize(("upcast", "scale_hi"), [(2, 231), (3, 129)])
def test_inline_ptx_upcast_matches_the_integer_one_for_every_byte(upcast, scale_hi):
    """Every byte value (both nibbles, both signs) under many scales: the inline-PTX upcast (2; 3
    folds the scale) gives the bits of the integer one (scales kept where both are exact: no bf16
    subnormals, and at most 2^1 for the folded multiplier)."""
    from tests.gpu.upcast_probe import upcast_tile

    n, c = 64, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.arange(n * c, device="cuda") % 256).to(torch.uint8).view(n, c)
    s = torch.randint(20, scale_hi, (n, c), generator=g, device="cuda", dtype=torch.uint8)
    got = {}
    for u in (0, upcast):
        lo, hi = (torch.empty((n, c), dtype=torch.bfloat16, device="cuda") for _ in range(2))
        upcast_tile[(1,)](w, s, lo, hi, UPCAST=u, N=n, C=c)
        got[u] = (lo, hi)
    for ref, out in zip(got[0], got[upcast], strict=True):
        assert torch.equal(ref.view(torch.int16), out.view(torch.int16))
    # The integer path against plain arithmetic: low nibble j, high nibble j + 16 of each byte.
    values = torch.tensor(FP4_VALUES, device="cuda")
    mult = torch.exp2(s.float() - 127)
    assert torch.equal(got[0][0].float(), values[(w & 0xF).long()] * mult)
    assert torch.equal(got[0][1].float(), values[(w >> 4).long()] * mult)


# --- activation policies (mxfp8, mxfp4): Hopper runs Triton's decomposition of the same dots ------

# Kernel and reference multiply the same quantized values: summation order and rare code flips at
# GEMM2's input remain (the interpreter measures ~1e-7 at tiny shapes). 2e-3 sits over 10x under
# each policy's own quantization error against bf16, so a misplaced scale or value fails.
MX_TOL = 2e-3
MX_TACTICS = [
    None,  # the default for the token count, mapped onto the policy
    ("m16n64k128w4s3sk1udot_scaled", "m16n64k128w4s3sk4udot_scaled"),
    ("m64n128k64w8s3sk1udot_scaled", "m32n64k256w4s3sk2udot_scaledkmasked"),
    ("m16n128k128w4s4sk1udot_scaledltma", "m64n256k64w4s3sk1udot_scaledltma"),
]


@pytest.mark.parametrize("policy", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 7, 33, 256])
@pytest.mark.parametrize("keys", MX_TACTICS, ids=["default", "swapped-split4", "big-masked", "tma"])
def test_full_size_layer_activations(checkpoint, policy, T, keys):
    from prepkit.kernels.reference import moe_reference, relative_error
    from prepkit.layouts.base import RankSpec
    from prepkit.runtime import moe

    layer, plan = _layer(checkpoint, RankSpec())
    layer.activations = policy
    x, logits = _inputs(T, seed=T, dead=5 if T == 7 else 0)
    tactics = None if keys is None else (_parse(keys[0]), _parse(keys[1]))
    out = moe(layer, x, logits, tactics=tactics, out_dtype=torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = moe_reference(x, logits, checkpoint.as_dict(), top_k=TOP_K, activations=policy)
    err = relative_error(out, ref)
    assert err < MX_TOL, f"{policy} T={T} {keys}: relative error {err:.3g}"


@pytest.mark.parametrize("policy", ["mxfp8", "mxfp4"])
def test_routing_quantization_matches_the_reference_bits(policy):
    from prepkit.kernels import mx as k
    from prepkit.kernels.activations import POLICY_FORMAT, quantize_mx

    x, logits = _inputs(256, seed=21)
    x[3, :64] = 0.0
    r = k.route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H, hidden_states=x, activations=policy)
    codes, scales = k.from_mx_rows(r.x_mx)
    want_codes, want_scales = quantize_mx(x.float(), POLICY_FORMAT[policy])
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)


def test_activation_policies_against_the_unquantized_layer(checkpoint, capsys):
    """What each policy costs in accuracy on the real dims: printed (pytest -s), and bounded."""
    from prepkit.kernels.reference import moe_reference, relative_error
    from prepkit.layouts.base import RankSpec
    from prepkit.runtime import moe

    layer, _ = _layer(checkpoint, RankSpec())
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for T in (1, 33, 256):
        x, logits = _inputs(T, seed=100 + T)
        ref = moe_reference(x, logits, checkpoint.as_dict(), top_k=TOP_K)
        errs = {}
        for policy in ("bf16", "mxfp8", "mxfp4"):
            layer.activations = policy
            layer._chosen.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                errs[policy] = relative_error(moe(layer, x, logits, out_dtype=torch.float32), ref)
        rows.append((T, errs))
    with capsys.disabled():
        print("\nrelative error vs the unquantized reference (E=128, H=I=2880, top-4)")
        for T, errs in rows:
            print(f"  T={T:4d}  " + "  ".join(f"{p} {e:.3g}" for p, e in errs.items()))
    for _, errs in rows:
        assert errs["bf16"] < TOL
        # e4m3 keeps 3 mantissa bits, e2m1 one: each policy costs more than the one before it.
        assert errs["bf16"] < errs["mxfp8"] < 0.1 and errs["mxfp8"] < errs["mxfp4"] < 0.5
