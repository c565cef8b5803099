"""prepkit's permutations, 128x4 swizzle and SM90 scale fold byte-compared with FlashInfer's own
CPU-usable helpers (docs/layouts.md §5.1). Skipped where FlashInfer is not installed; CI installs
the pinned one (``make install-flashinfer``) and sets PREPKIT_REQUIRE_FLASHINFER=1, so there a
missing FlashInfer fails instead."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if os.environ.get("PREPKIT_REQUIRE_FLASHINFER") == "1":
    try:
        flashinfer = importlib.import_module("flashinfer")
    except ImportError as err:
        raise RuntimeError(f"PREPKIT_REQUIRE_FLASHINFER=1 but flashinfer does not import: {err} (see .ci/run)") from err
else:
    flashinfer = pytest.importorskip("flashinfer")

from flashinfer.fused_moe import core as fi_core  # noqa: E402
from flashinfer.fused_moe import interleave_moe_scales_for_sm90_mixed_gemm  # noqa: E402

from prepkit.layouts import ops  # noqa: E402
from prepkit.layouts.base import ExpertWeights, LayoutOptions, ModelDims, RankSpec  # noqa: E402
from prepkit.layouts.cutlass_sm12x import LAYOUT as SM12X  # noqa: E402
from prepkit.layouts.cutlass_sm12x import padded_pieces  # noqa: E402
from prepkit.layouts.cutlass_sm90 import LAYOUT as SM90  # noqa: E402
from prepkit.layouts.cutlass_sm90 import fold_scales_sm90  # noqa: E402

ROWS = [32, 64, 128, 768, 1536, 2944, 3072, 5888]
H = I = 2880


def rand_u8(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(1, 255, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def private_swizzle_helpers() -> list[tuple[str, object]]:
    """FlashInfer's private pure-torch 128x4 swizzles; they may move between releases."""
    found = []
    for module, attr in [
        ("flashinfer.diffusion_ops.minimax_h3_fc1_swiglu", "_swizzle_sf_128x4"),
        ("flashinfer.experimental.kimi_k3_fp8_projection.cake_backend", "swizzle_sf_128x4"),
    ]:
        try:
            found.append((f"{module}.{attr}", getattr(importlib.import_module(module), attr)))
        except (ImportError, AttributeError):
            continue
    return found


SWIZZLES = private_swizzle_helpers()


def test_flashinfer_version() -> None:
    assert flashinfer.__version__.startswith("0.7."), "the SM90 layout targets FlashInfer 0.7.x"


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("epilogue_tile_m", [64, 128])
def test_row_shuffle(m: int, epilogue_tile_m: int) -> None:
    t = torch.empty((m, 8), dtype=torch.uint8)
    want = flashinfer.utils.get_shuffle_matrix_a_row_indices(t, epilogue_tile_m)
    assert torch.equal(ops.shuffle_row_indices(m, epilogue_tile_m), want.long())
    sf = flashinfer.utils.get_shuffle_matrix_sf_a_row_indices(t, epilogue_tile_m, 32) if m % 128 == 0 else None
    if sf is not None:
        assert torch.equal(ops.shuffle_row_indices(m, epilogue_tile_m), sf.long())


@pytest.mark.parametrize("m", ROWS)
def test_gated_reorder_and_w13_and_w2_permutations(m: int) -> None:
    t = torch.empty((m, 4), dtype=torch.uint8)
    assert torch.equal(ops.gated_reorder_indices(m), fi_core.get_reorder_rows_for_gated_act_gemm_row_indices(t).long())
    cache: dict = {}
    w13 = fi_core._maybe_get_cached_w3_w1_permute_indices(cache, t, 128)
    assert torch.equal(ops.w13_row_indices(m, 128), w13.long())
    if m % 128 == 0:
        w13_sf = fi_core._maybe_get_cached_w3_w1_permute_indices(cache, t, 128, num_elts_per_sf=32)
        assert torch.equal(ops.w13_row_indices(m, 128), w13_sf.long())
    w2 = fi_core.get_w2_permute_indices_with_cache(cache, t, 128)
    assert torch.equal(ops.shuffle_row_indices(m, 128), w2.long())


def test_shuffle_matrix_a_and_reorder_rows_bytes() -> None:
    w = rand_u8((768, 96), 1)
    assert torch.equal(w[ops.shuffle_row_indices(768, 128)], flashinfer.shuffle_matrix_a(w, 128))
    assert torch.equal(w[ops.gated_reorder_indices(768)], fi_core.reorder_rows_for_gated_act_gemm(w))


@pytest.mark.skipif(not SWIZZLES, reason="no private FlashInfer 128x4 swizzle in this release")
@pytest.mark.parametrize("shape", [(128, 4), (5888, 96), (2944, 92), (3072, 92), (200, 7), (1, 3)])
@pytest.mark.parametrize("helper", SWIZZLES, ids=[name for name, _ in SWIZZLES])
def test_128x4_swizzle(shape: tuple[int, int], helper: tuple[str, object]) -> None:
    _, fn = helper
    s = rand_u8(shape, shape[0] * 7 + shape[1])
    want = fn(s).flatten()  # type: ignore[operator]
    got = ops.swizzle_scales_128x4(s).flatten()
    assert got.numel() == want.numel() and torch.equal(got, want)


def test_128x4_unswizzle() -> None:
    mod = pytest.importorskip("flashinfer.diffusion_ops.minimax_h3_fc1_swiglu")
    if not hasattr(mod, "_unswizzle_sf_128x4"):
        pytest.skip("private unswizzle moved")
    s = rand_u8((200, 7), 3)
    flat = ops.swizzle_scales_128x4(s).flatten()
    assert torch.equal(mod._unswizzle_sf_128x4(flat, 200, 7), s)


@pytest.mark.parametrize("shape", [(2, 5888, 92), (2, 2944, 48), (1, 768, 92), (3, 128, 12)])
def test_sm90_scale_fold(shape: tuple[int, int, int]) -> None:
    s = rand_u8(shape, sum(shape))
    want = interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=32)
    got = fold_scales_sm90(s)
    assert tuple(want.shape) == (shape[0], shape[1] // 64, shape[2] // 4, 16, 16)
    assert torch.equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("tp", [1, 8])
def test_layout_scales_equal_flashinfer_applied_to_the_padded_matrices(tp: int) -> None:
    """End to end on real dims: the scales prepkit writes for both CUTLASS layouts equal FlashInfer's
    helpers applied to the same [up ; gate]-stacked, zero-padded matrices."""
    dims = ModelDims(num_layers=1, num_experts=2, hidden=H, intermediate=I, top_k=1)
    g = torch.Generator().manual_seed(tp)
    w = ExpertWeights.from_mapping(
        {
            role: (
                torch.randint(1, 255, shape, dtype=torch.uint8, generator=g)
                if dtype == torch.uint8
                else torch.randn(shape, generator=g).to(dtype)
            )
            for role, (shape, dtype) in dims.source_shapes().items()
        }
    )
    spec = RankSpec(tp_size=tp, tp_rank=tp - 1)
    plan = SM90.plan_rank(dims, spec, LayoutOptions())
    pieces = padded_pieces(w, plan)
    out90 = SM90.build(w, plan)
    for name, key in [("w3_w1_weight_scale", "w13_scales"), ("w2_weight_scale", "w2_scales")]:
        want = interleave_moe_scales_for_sm90_mixed_gemm(pieces[key], group_size=32)
        assert torch.equal(out90[name].flatten(), want.flatten()), name
    out12 = SM12X.build(w, SM12X.plan_rank(dims, spec, LayoutOptions()))
    if SWIZZLES:
        _, fn = SWIZZLES[0]
        for name, key in [("w3_w1_weight_scale", "w13_scales"), ("w2_weight_scale", "w2_scales")]:
            for e in range(2):
                assert torch.equal(out12[name][e].flatten(), fn(pieces[key][e]).flatten()), name  # type: ignore[operator]


def test_cuda_only_helpers_refuse_cpu_tensors() -> None:
    """The two helpers the GPU tests compare against really need CUDA (so they live in tests/gpu)."""
    with pytest.raises((ValueError, RuntimeError)):
        flashinfer.block_scale_interleave(rand_u8((128, 4), 0))
    from flashinfer.fused_moe import interleave_moe_weights_for_sm90_mixed_gemm

    with pytest.raises(ValueError, match="CUDA"):
        interleave_moe_weights_for_sm90_mixed_gemm(rand_u8((1, 16, 32), 0), "fp4")
