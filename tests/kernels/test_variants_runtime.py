"""Variant space, defaults, the runtime's checks and its import cost (no kernel launches)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from prepkit.errors import LayoutError
from prepkit.kernels.device import GB10, H100, H200, RTX_PRO_6000, DeviceInfo
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import (
    BLOCK_M,
    default_tactics,
    enumerate_tactics,
    invalid_reason,
    shared_mem_bytes,
)
from prepkit.layer import rank_layer
from prepkit.layouts.base import ModelDims
from prepkit.runtime import MoeLayer
from tests.kernels.moe_data import make_layer, random_experts


def layer_call(num_tokens: int, experts: int, hidden: int, intermediate: int, top_k: int):
    """A call of the TP 1 layer of these dims."""
    return rank_layer(ModelDims(1, experts, hidden, intermediate, top_k)).problem(num_tokens)


DEVICES = [H100, H200, RTX_PRO_6000, GB10]


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
def test_enumerated_variants_are_valid_and_cover_every_family(device):
    for gemm in ("gemm1", "gemm2"):
        tactics = enumerate_tactics(gemm, device)
        assert tactics and len(set(tactics)) == len(tactics)
        assert all(invalid_reason(t, gemm, device) is None for t in tactics)
        assert all(shared_mem_bytes(t) <= device.max_shared_mem for t in tactics)
        assert {t.upcast for t in tactics} == {"bits", "asm", "dot_scaled"}
        assert {t.weight_load for t in tactics} == {"ptr", "tma"}  # every listed GPU has TMA
        assert not any(t.weight_load == "tma" and (t.upcast == "dot_scaled" or t.num_stages < 3) for t in tactics)
        assert {t.k_loop for t in tactics} == {"tail", "masked"}
        assert not any(t.k_loop == "masked" and t.upcast == "dot_scaled" for t in tactics)
        # The dot knob exists only where operands swap: no tile runs twice under two names.
        joined = [t for t in tactics if t.swapped_dot == "joined"]
        assert joined and all(t.block_m <= 32 and t.upcast != "dot_scaled" for t in joined)
        assert {t.block_m for t in joined} == {16, 32}
        assert len(joined) == sum(1 for t in tactics if t.block_m <= 32 and t.upcast != "dot_scaled") // 2
        assert {t.split_k for t in tactics} == {1, 2, 4, 8}
        # GEMM1's splits hold every pick's partial sums: row tiles of few rows only.
        assert all(t.block_m <= 32 for t in tactics if gemm == "gemm1" and t.split_k > 1)


def test_small_shared_memory_prunes_more():
    assert len(enumerate_tactics("gemm2", RTX_PRO_6000)) < len(enumerate_tactics("gemm2", H100))


def test_problem_prunes_oversized_row_tiles():
    tactics = enumerate_tactics("gemm1", H100, layer_call(4, 128, 2880, 2880, 4))
    assert {t.block_m for t in tactics} == {16}


def test_invalid_reasons_name_the_knob():
    assert "split" in invalid_reason(GemmTactic(block_m=64, split_k=2), "gemm1", H100)
    assert invalid_reason(GemmTactic(split_k=2), "gemm1", H100) is None
    assert "block_m" in invalid_reason(GemmTactic(block_m=24), "gemm1", H100)
    assert "shared memory" in invalid_reason(GemmTactic(128, 256, 256, 8, 4), "gemm1", GB10)
    old = DeviceInfo("old", (7, 5), 40, 65536)
    assert "sm_80" in invalid_reason(GemmTactic(upcast="asm"), "gemm1", old)
    ampere = DeviceInfo("ampere", (8, 0), 108, 166912)
    assert "sm_90" in invalid_reason(GemmTactic(weight_load="tma"), "gemm1", ampere)
    assert "weight_load" in invalid_reason(GemmTactic(weight_load="bulk"), "gemm1", H100)
    assert "3 stages" in invalid_reason(GemmTactic(num_stages=2, weight_load="tma"), "gemm1", H100)
    assert "k_loop" in invalid_reason(GemmTactic(k_loop="unrolled"), "gemm1", H100)
    assert "dot_scaled" in invalid_reason(GemmTactic(upcast="dot_scaled", k_loop="masked"), "gemm2", H100)
    assert invalid_reason(GemmTactic(k_loop="masked"), "gemm2", H100) is None
    assert "swapped_dot" in invalid_reason(GemmTactic(swapped_dot="fused"), "gemm1", H100)
    assert "block_m <= 32" in invalid_reason(GemmTactic(64, swapped_dot="joined"), "gemm1", H100)
    assert "dot_scaled" in invalid_reason(GemmTactic(upcast="dot_scaled", swapped_dot="joined"), "gemm2", H100)
    assert invalid_reason(GemmTactic(32, swapped_dot="joined"), "gemm2", H100) is None


def test_the_dot_knob_reaches_the_kernel_only_for_swapped_tiles():
    from prepkit.kernels.mx import joins_halves, swaps_operands

    assert swaps_operands(GemmTactic(32)) and not swaps_operands(GemmTactic(64))
    assert not joins_halves(GemmTactic(16)) and joins_halves(GemmTactic(16, swapped_dot="joined"))
    assert joins_halves(GemmTactic(32, swapped_dot="joined")) and joins_halves(GemmTactic(64))


def test_a_default_that_does_not_fit_falls_back_to_pointer_loads_not_two_stage_tma():
    small_hopper = DeviceInfo("small", (9, 0), 132, 60000)
    problem = layer_call(8, 128, 2880, 2880, 4)
    for t, gemm in zip(default_tactics(problem, small_hopper), ("gemm1", "gemm2"), strict=True):
        assert invalid_reason(t, gemm, small_hopper) is None
        assert t.weight_load == "ptr" and t.num_stages == 2, t
    assert default_tactics(problem, H100)[0].weight_load == "tma"  # where it fits, TMA stays


def test_weight_descriptor_only_where_the_tensor_allows_it(device):
    from prepkit.kernels.mx import weight_descriptor

    if device == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the GPU has no TMA unit")
    tma = GemmTactic(16, 32, 64, weight_load="tma")
    w = torch.zeros((2, 3, 64, 128), dtype=torch.uint8, device=device)  # [E, K panels, N, 128]
    assert weight_descriptor(w, tma) is not None
    assert weight_descriptor(w, GemmTactic(16, 32, 64)) is None  # pointer loads asked for
    unaligned = torch.zeros(w.numel() + 1, dtype=torch.uint8, device=device)[1:].view(w.shape)
    assert weight_descriptor(unaligned, tma) is None  # base not 16-byte aligned
    assert weight_descriptor(w[:, :, :32], tma) is None  # not contiguous
    assert weight_descriptor(w[..., :40].contiguous(), tma) is None  # 40-byte rows


@pytest.mark.parametrize("device", [*DEVICES, DeviceInfo("tiny", (7, 5), 8, 49152)], ids=lambda d: d.name)
@pytest.mark.parametrize("T", [0, 1, 2, 7, 64, 512, 1024, 4096, 8192, 65536])
@pytest.mark.parametrize("experts", [4, 32, 128])
def test_default_is_always_valid(device, T, experts):
    g1, g2 = default_tactics(layer_call(T, experts, 2880, 1440, 4), device)
    assert invalid_reason(g1, "gemm1", device) is None
    assert invalid_reason(g2, "gemm2", device) is None


def test_tactic_json_round_trip_and_stable_key():
    t = GemmTactic(16, 64, 128, 4, 3, 2, "asm")
    assert GemmTactic.from_json(t.to_json()) == t
    assert GemmTactic(16, 64, 128, 4, 3, 2).key() == "m16n64k128w4s3sk2"  # keys stored before upcast
    assert t.key().endswith("uasm")
    tma = GemmTactic(16, 64, 128, 4, 3, 2, "asm", "tma")
    assert tma.key() == "m16n64k128w4s3sk2uasmltma" and GemmTactic.from_json(tma.to_json()) == tma
    # The default K loop leaves JSON and key as they were before the field, so stored rows match.
    assert "k_loop" not in tma.to_json()
    masked = GemmTactic(16, 64, 128, 4, 3, 2, "asm", "tma", "masked")
    assert masked.key() == "m16n64k128w4s3sk2uasmltmakmasked" and GemmTactic.from_json(masked.to_json()) == masked
    assert '"k_loop": "masked"' in masked.to_json()
    # The split dot is the default, and stored rows carry neither field nor key suffix for it.
    assert "swapped_dot" not in masked.to_json()
    joined = GemmTactic(16, 64, 128, 4, 3, 2, "asm", "tma", swapped_dot="joined")
    assert joined.key() == "m16n64k128w4s3sk2uasmltmadjoined" and GemmTactic.from_json(joined.to_json()) == joined


def test_layout_ids_agree():
    from prepkit.kernels.mx import WEIGHT_LAYOUT
    from prepkit.layouts.triton_moe import LAYOUT
    from prepkit.runtime.moe import WEIGHT_LAYOUT as RUNTIME_LAYOUT

    assert WEIGHT_LAYOUT == RUNTIME_LAYOUT == LAYOUT.layout_id


def test_wrong_layout_is_refused_naming_both():
    layer, _ = make_layer(random_experts(4, 64, 64, seed=0), 2)
    tensors = {
        name: getattr(layer, name)
        for name in ("w13_blocks", "w13_scales", "w13_bias", "w2_blocks", "w2_scales", "w2_bias")
    }
    with pytest.raises(LayoutError, match="'trtllm_gen_v1'.*'triton_moe_v3'"):
        MoeLayer.from_tensors(
            tensors, layout_id="trtllm_gen_v1", num_experts=4, expert_range=(0, 4), valid_intermediate=64
        )
    del tensors["w2_scales"]
    with pytest.raises(LayoutError, match="w2_scales"):
        MoeLayer.from_tensors(
            tensors, layout_id="triton_moe_v3", num_experts=4, expert_range=(0, 4), valid_intermediate=64
        )


def test_prefixed_names_and_shape_checks():
    layer, _ = make_layer(random_experts(4, 64, 64, seed=0), 2)
    prefixed = {
        f"model.layers.3.mlp.experts.{n}": getattr(layer, n)
        for n in ("w13_blocks", "w13_scales", "w13_bias", "w2_blocks", "w2_scales", "w2_bias")
    }
    ok = MoeLayer.from_tensors(
        prefixed, layout_id="triton_moe_v3", num_experts=4, expert_range=(0, 4), valid_intermediate=64
    )
    assert ok.hidden == 64 and ok.padded_intermediate == 64
    with pytest.raises(LayoutError, match="expert_range"):
        MoeLayer.from_tensors(
            prefixed, layout_id="triton_moe_v3", num_experts=8, expert_range=(0, 2), valid_intermediate=64
        )


def test_wrong_shapes_and_dtypes_are_refused_naming_the_tensor():
    layer, _ = make_layer(random_experts(4, 64, 96, seed=0), 2)
    tensors = {
        name: getattr(layer, name)
        for name in ("w13_blocks", "w13_scales", "w13_bias", "w2_blocks", "w2_scales", "w2_bias")
    }
    tensors["w2_scales"] = tensors["w2_scales"][:, :2]  # one K group of the down projection short
    tensors["w13_bias"] = tensors["w13_bias"].to(torch.bfloat16)
    with pytest.raises(LayoutError) as err:
        MoeLayer.from_tensors(
            tensors, layout_id="triton_moe_v3", num_experts=4, expert_range=(0, 4), valid_intermediate=96
        )
    msg = str(err.value)
    assert "w2_scales: [4, 2, 64] torch.uint8, expected [4, 3, 64] torch.uint8" in msg
    assert "w13_bias: [4, 192] torch.bfloat16, expected [4, 192] torch.float32" in msg
    assert "w13_blocks" not in msg and "w2_blocks" not in msg


def test_lookup_is_used_and_default_warns_once():
    layer, _ = make_layer(random_experts(4, 64, 64, seed=0), 2)
    with pytest.warns(UserWarning, match="no tuned tactic"):
        layer.tactics(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.tactics(5)  # a second miss stays quiet
    assert all(t.upcast != "asm" for t in layer.tactics(5))  # CPU tensors: no inline PTX

    pinned = (GemmTactic(16, 32, 64), GemmTactic(16, 32, 64, split_k=2))
    seen = []

    def lookup(problem, device):
        seen.append((problem, device))
        return pinned

    tuned, _ = make_layer(random_experts(4, 64, 64, seed=0), 2, tactic_lookup=lookup)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.tactics(9) == pinned
    assert seen[0][0] == layer_call(9, 4, 64, 64, 2)


@pytest.mark.parametrize("with_db", [False, True], ids=["no-lookup", "empty-db"])
def test_a_missed_tactic_warns_once_per_layer(tmp_path, with_db, device):
    """A layer without tuned tactics, called at several token counts, says so once; a second layer
    of the same shape says so once more (its own warning), whether the miss is the layer's (no
    lookup) or the tactics DB's."""
    from prepkit.runtime import moe
    from prepkit.tactics.lookup import TacticResolver, make_tactic_lookup
    from tests.kernels.moe_data import random_inputs

    w = random_experts(4, 64, 64, seed=3)
    lookup = None
    if with_db:
        lookup = make_tactic_lookup(
            resolver=TacticResolver(user_db=tmp_path / "none.db", bundled_db=False), kernel_version=1
        )
    layers = [make_layer(w, 2, tactic_lookup=lookup, device=device)[0] for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in layers:
            for T in (1, 3, 9):
                x, logits = random_inputs(T, 4, 64, seed=T, device=device)
                out = moe(layer, x, logits)
                assert out.shape == (T, 64) and out.abs().sum() > 0
    missed = [str(c.message) for c in caught if "no tuned tactic" in str(c.message)]
    assert len(missed) == 2, missed


def test_moe_checks_shapes():
    from prepkit.runtime import moe

    layer, _ = make_layer(random_experts(4, 64, 64, seed=0), 2)
    with pytest.raises(ValueError, match="router_logits"):
        moe(layer, torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="hidden_states"):
        moe(layer, torch.zeros(3, 32, dtype=torch.bfloat16), torch.zeros(3, 4))


def test_importing_the_runtime_is_cheap():
    code = (
        "import sys, prepkit.runtime; "
        "print(sorted(m for m in ('click', 'rich', 'huggingface_hub', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- activation policies -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
def test_mx_policies_keep_every_family_but_the_bf16_knobs(device, policy):
    for gemm in ("gemm1", "gemm2"):
        tactics = enumerate_tactics(gemm, device, activations=policy)
        assert tactics and all(invalid_reason(t, gemm, device, policy) is None for t in tactics)
        assert all(shared_mem_bytes(t, policy) <= device.max_shared_mem for t in tactics)
        # One dot_scaled per K step: the upcast and dot knobs of the bf16 path have one value.
        assert {t.upcast for t in tactics} == {"dot_scaled"}
        assert {t.swapped_dot for t in tactics} == {"split"}
        # Every other family stays: TMA and pointer loads, both K loops, swapped and plain tiles.
        assert {t.weight_load for t in tactics} == {"ptr", "tma"}
        assert {t.k_loop for t in tactics} == {"tail", "masked"}
        assert {t.block_m for t in tactics} == set(BLOCK_M)
        assert {t.split_k for t in tactics} == ({1} if gemm == "gemm1" else {1, 2, 4, 8})
        widths = {t.block_n for t in tactics}
        assert widths == ({64, 128, 256} if gemm == "gemm1" else {32, 64, 128, 256})
    assert len(enumerate_tactics("gemm2", device, activations=policy)) < len(enumerate_tactics("gemm2", device))


def test_mx_invalid_reasons_name_the_policy():
    ds = GemmTactic(16, 64, 128, upcast="dot_scaled")
    assert invalid_reason(ds, "gemm1", H100, "mxfp8") is None
    assert "'mxfp8'" in invalid_reason(replace(ds, upcast="asm"), "gemm1", H100, "mxfp8")
    assert "'mxfp4'" in invalid_reason(replace(ds, swapped_dot="joined"), "gemm2", H100, "mxfp4")
    reason = invalid_reason(replace(ds, block_n=32), "gemm1", H100, "mxfp8")
    assert "'mxfp8'" in reason and "block_n must be >= 64" in reason
    assert invalid_reason(replace(ds, block_n=32), "gemm2", H100, "mxfp8") is None
    assert "activations" in invalid_reason(ds, "gemm1", H100, "fp8")  # type: ignore[arg-type]
    # TMA and the masked K loop run with MX activations, not on the bf16 dot_scaled path.
    tma = replace(ds, weight_load="tma", k_loop="masked")
    assert invalid_reason(tma, "gemm1", H100, "mxfp4") is None
    assert invalid_reason(tma, "gemm1", H100) is not None


def test_mx_operands_are_smaller_in_shared_memory():
    t = GemmTactic(64, 256, 128, 8, 4, upcast="dot_scaled")
    assert shared_mem_bytes(t, "mxfp4") < shared_mem_bytes(t, "mxfp8") < shared_mem_bytes(t)


def test_mx_swaps_few_row_tiles_too():
    from prepkit.kernels.variants import swaps_operands

    ds = GemmTactic(16, 64, 128, upcast="dot_scaled")
    assert not swaps_operands(ds) and swaps_operands(ds, "mxfp8") and swaps_operands(ds, "mxfp4")
    assert not swaps_operands(replace(ds, block_m=64), "mxfp8")


@pytest.mark.parametrize("policy", ["bf16", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("device", [*DEVICES, DeviceInfo("tiny", (7, 5), 8, 49152)], ids=lambda d: d.name)
@pytest.mark.parametrize("T", [1, 7, 64, 4096])
def test_policy_variant_of_every_default_is_valid(device, policy, T):
    from prepkit.kernels.variants import policy_variant

    for t, gemm in zip(default_tactics(layer_call(T, 128, 2880, 2880, 4), device), ("gemm1", "gemm2"), strict=True):
        mapped = policy_variant(t, gemm, device, policy)
        assert invalid_reason(mapped, gemm, device, policy) is None
        if policy == "bf16":
            assert mapped == t
        else:
            assert (mapped.block_m, mapped.block_k, mapped.split_k) == (t.block_m, t.block_k, t.split_k)


def test_unknown_policy_is_a_clear_error():
    from prepkit.errors import PrepkitError
    from prepkit.runtime import load_moe_layers

    with pytest.raises(PrepkitError, match="'fp8'.*bf16, mxfp8, mxfp4"):
        make_layer(random_experts(4, 64, 64, seed=0), 2, activations="fp8")
    with pytest.raises(PrepkitError, match="bf16, mxfp8, mxfp4"):
        load_moe_layers("/nonexistent", activations="int4")  # checked before anything loads


def test_mx_layer_maps_the_default_and_warns_once_where_it_runs_decomposed(monkeypatch):
    from prepkit import warn_once
    from prepkit.kernels.device import lowers_natively
    from prepkit.runtime import moe as run_moe

    monkeypatch.setattr(warn_once, "_SEEN", set())
    w = random_experts(4, 64, 64, seed=0)
    layer, _ = make_layer(w, 2, activations="mxfp8")
    assert layer.activations == "mxfp8"
    with pytest.warns(UserWarning, match="no tuned tactic"):
        g1, g2 = layer.tactics(3)
    assert g1.upcast == g2.upcast == "dot_scaled" and g1.block_n >= 64
    x, logits = torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 4)
    if torch.cuda.is_available():
        pytest.skip("the decomposed warning is checked on the CPU interpreter")
    with pytest.warns(UserWarning, match="'mxfp8' run decomposed on the CPU interpreter"):
        run_moe(layer, x, logits)
    other, _ = make_layer(w, 2, activations="mxfp8")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*decomposed")
        run_moe(layer, x, logits)  # once per process: neither this layer nor another warns again
        run_moe(other, x, logits)
    assert lowers_natively((12, 0)) and lowers_natively((12, 1))
    assert lowers_natively((10, 0)) and not lowers_natively((9, 0))


@pytest.mark.parametrize(
    ("capability", "triton_version", "native"),
    [
        ((12, 0), "3.6.0", True),
        ((12, 1), "3.9.1", True),
        ((12, 1), "3.10.0", True),
        ((12, 0), "3.5.1", False),
        ((12, 1), "3.3.0+git1234", False),
        ((12, 0), "unknown", False),
        ((9, 0), "3.9.0", False),
        ((10, 0), "3.5.0", True),
    ],
)
def test_native_mx_needs_sm12x_and_a_checked_triton(capability, triton_version, native):
    from prepkit.kernels.device import lowers_natively

    assert lowers_natively(capability, triton_version) is native


def test_a_tuned_pair_that_no_longer_compiles_falls_back_to_the_default(monkeypatch):
    """Rows tuned with another Triton may name a variant this Triton cannot build: the layer warns
    once, runs the default for that token count from then on, and a pinned pair still raises."""
    import importlib

    from triton.runtime.errors import OutOfResources

    moe_module = importlib.import_module("prepkit.runtime.moe")
    w = random_experts(4, 64, 64, seed=1)
    layer, _ = make_layer(w, 2)
    tuned = (GemmTactic(16, 32, 64, 4, 2, 1, "bits"), GemmTactic(16, 32, 64, 4, 1, 1, "bits"))
    layer.tactic_lookup = lambda problem, device: tuned
    launched = []

    def fake_launch(layer_, x, logits, pair, plan_key=None):
        launched.append(pair)
        if pair == tuned:
            raise OutOfResources(300000, 101376, "shared memory")
        return torch.zeros(x.shape[0], layer_.hidden)

    monkeypatch.setattr(moe_module, "_launch", fake_launch)
    x, logits = torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 4)
    with pytest.warns(UserWarning, match="do not compile with this Triton"):
        moe_module.moe(layer, x, logits)
    default = layer._default_pair(3)
    assert launched == [tuned, default] and layer.tactics(3) == default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe_module.moe(layer, x, logits)  # the default from now on, no second warning
    assert launched[-1] == default
    with pytest.raises(OutOfResources):  # the caller's own pair is never replaced
        moe_module.moe(layer, x, logits, tactics=tuned)


@pytest.mark.parametrize(("tp", "split"), [(1, 1), (2, 2), (4, 4), (8, 4)])
def test_one_token_default_splits_gemm1_of_a_tp_rank(tp, split):
    """At one token the four picks' GEMM1 tiles of a TP rank leave SMs idle: the default splits
    K while the programs fit one wave at three an SM (TP 1's 360 tiles do not split), and keeps
    whole K for more tokens and for MX activations."""
    from prepkit.layouts.base import RankSpec

    dims = ModelDims(1, 128, 2880, 2880, 4)
    layer = rank_layer(dims, RankSpec(tp_size=tp, tp_rank=0))
    g1, _ = default_tactics(layer.problem(1), H200)
    assert g1.split_k == split and invalid_reason(g1, "gemm1", H200) is None
    assert default_tactics(layer.problem(2), H200)[0].split_k == 1
    assert default_tactics(layer.problem(1), H200, "mxfp8")[0].split_k == 1


@pytest.mark.parametrize(
    ("device", "tp", "split"),
    [(RTX_PRO_6000, 1, 1), (RTX_PRO_6000, 2, 2), (RTX_PRO_6000, 4, 4), (GB10, 1, 1), (GB10, 2, 1), (GB10, 8, 2)],
)
def test_sm12x_one_token_default_splits_gemm1_by_the_same_rule(device, tp, split):
    """SM12x's one-token GEMM1 splits K by the Hopper rule (programs in one wave at three an SM),
    with bf16 activations only: an RTX PRO 6000's TP ranks split, a GB10's tiles fill its 48 SMs
    up to TP 4 (TP 2 over two DGX Sparks does not split)."""
    from prepkit.layouts.base import RankSpec

    dims = ModelDims(1, 128, 2880, 2880, 4)
    layer = rank_layer(dims, RankSpec(tp_size=tp, tp_rank=0))
    g1, _ = default_tactics(layer.problem(1), device)
    assert g1.split_k == split and g1.weight_load == "ptr" and invalid_reason(g1, "gemm1", device) is None
    assert default_tactics(layer.problem(2), device)[0].split_k == 1
    for policy in ("mxfp8", "mxfp4"):
        assert default_tactics(layer.problem(1), device, policy)[0].split_k == 1
