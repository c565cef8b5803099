"""Variant space, defaults, the runtime's checks and its import cost (no kernel launches)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from prepkit.errors import LayoutError
from prepkit.kernels.device import GB10, H100, H200, RTX_PRO_6000, DeviceInfo
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import (
    MoeProblem,
    default_tactics,
    enumerate_tactics,
    invalid_reason,
    shared_mem_bytes,
)
from prepkit.runtime import MoeLayer
from tests.kernels.moe_data import make_layer, random_experts

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
        splits = {t.split_k for t in tactics}
        assert splits == ({1} if gemm == "gemm1" else {1, 2, 4, 8})


def test_small_shared_memory_prunes_more():
    assert len(enumerate_tactics("gemm2", RTX_PRO_6000)) < len(enumerate_tactics("gemm2", H100))


def test_problem_prunes_oversized_row_tiles():
    tactics = enumerate_tactics("gemm1", H100, MoeProblem(4, 128, 2880, 2880, 4))
    assert {t.block_m for t in tactics} == {16}


def test_invalid_reasons_name_the_knob():
    assert "split" in invalid_reason(GemmTactic(split_k=2), "gemm1", H100)
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
    from prepkit.kernels.moe_mxfp4 import joins_halves, swaps_operands

    assert swaps_operands(GemmTactic(32)) and not swaps_operands(GemmTactic(64))
    assert not joins_halves(GemmTactic(16)) and joins_halves(GemmTactic(16, swapped_dot="joined"))
    assert joins_halves(GemmTactic(32, swapped_dot="joined")) and joins_halves(GemmTactic(64))


def test_a_default_that_does_not_fit_falls_back_to_pointer_loads_not_two_stage_tma():
    small_hopper = DeviceInfo("small", (9, 0), 132, 60000)
    problem = MoeProblem(8, 128, 2880, 2880, 4)
    for t, gemm in zip(default_tactics(problem, small_hopper), ("gemm1", "gemm2"), strict=True):
        assert invalid_reason(t, gemm, small_hopper) is None
        assert t.weight_load == "ptr" and t.num_stages == 2, t
    assert default_tactics(problem, H100)[0].weight_load == "tma"  # where it fits, TMA stays


def test_weight_descriptor_only_where_the_tensor_allows_it(device):
    from prepkit.kernels.moe_mxfp4 import weight_descriptor

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
    g1, g2 = default_tactics(MoeProblem(T, experts, 2880, 1440, 4), device)
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
    from prepkit.kernels.moe_mxfp4 import WEIGHT_LAYOUT
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
    assert seen[0][0] == MoeProblem(9, 4, 64, 64, 2)


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
