"""FlashInfer's CUDA-only helpers against prepkit's CPU bytes (docs/layouts.md §5.1 lists what needs a
GPU): ``block_scale_interleave`` vs the 128x4 swizzle, and the SM90 mixed-GEMM weight interleave
vs ``interleave_weights_sm90``. Skipped without CUDA or FlashInfer.

The public ``interleave_moe_weights_for_sm90_mixed_gemm`` builds FlashInfer's whole SM90 CUTLASS
MoE module on first use (a long nvcc job where no prebuilt JIT cache is installed), so the same
kernel is also checked by compiling only the source file FlashInfer ships it in.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

from prepkit.layouts import ops  # noqa: E402
from prepkit.layouts.base import ExpertWeights, LayoutOptions, ModelDims, RankSpec  # noqa: E402
from prepkit.layouts.cutlass_sm12x import LAYOUT as SM12X  # noqa: E402
from prepkit.layouts.cutlass_sm12x import padded_pieces  # noqa: E402
from prepkit.layouts.cutlass_sm90 import LAYOUT as SM90  # noqa: E402
from prepkit.layouts.cutlass_sm90 import interleave_weights_sm90  # noqa: E402

H = I = 2880
DIMS = ModelDims(num_layers=1, num_experts=2, hidden=H, intermediate=I, top_k=1)
KERNEL_SOURCE = "nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_mixed_utils.cu"


def rand_u8(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def real_weights(seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights.from_mapping(
        {
            role: (
                torch.randint(1, 255, shape, dtype=torch.uint8, generator=g)
                if dtype == torch.uint8
                else torch.randn(shape, generator=g).to(dtype)
            )
            for role, (shape, dtype) in DIMS.source_shapes().items()
        }
    )


# --- block_scale_interleave ------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 4), (5888, 92), (2944, 48), (3072, 92), (200, 7), (2, 1536, 92)])
def test_block_scale_interleave_equals_the_128x4_swizzle(shape: tuple[int, ...]) -> None:
    s = rand_u8(shape, sum(shape))
    want = flashinfer.block_scale_interleave(s.cuda()).cpu()
    got = ops.swizzle_scales_128x4(s).flatten()
    assert got.numel() == want.numel() and torch.equal(got, want)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_sm12x_scales_equal_block_scale_interleave(tp: int) -> None:
    w = real_weights(tp)
    plan = SM12X.plan_rank(DIMS, RankSpec(tp_size=tp, tp_rank=tp - 1), LayoutOptions())
    out = SM12X.build(w, plan)
    pieces = padded_pieces(w, plan)
    for name, key in [("w3_w1_weight_scale", "w13_scales"), ("w2_weight_scale", "w2_scales")]:
        want = flashinfer.block_scale_interleave(pieces[key].cuda()).cpu()  # [E, R, C]: per expert
        assert torch.equal(out[name].flatten(), want), name


# --- SM90 weight interleave ------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped_kernel():  # noqa: ANN201 (a torch extension module)
    """FlashInfer's own kernel source, built alone, behind a per-expert loop like its binding's."""
    from flashinfer.jit import env
    from torch.utils.cpp_extension import load_inline

    source = Path(env.FLASHINFER_CSRC_DIR) / KERNEL_SOURCE
    if not source.exists():
        pytest.skip(f"{source} is not shipped in this FlashInfer")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    cuda = f"""
#include "{source}"
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
torch::Tensor shipped_interleave_fp4(torch::Tensor w) {{
  TORCH_CHECK(w.is_cuda() && w.dtype() == torch::kUInt8 && w.dim() == 3 && w.is_contiguous());
  auto out = torch::empty_like(w);
  int64_t n = w.size(1), kb = w.size(2);
  for (int64_t e = 0; e < w.size(0); ++e) {{
    tensorrt_llm::kernels::cutlass_kernels::interleave_fp4_weights_for_sm90_mixed_gemm(
        w.data_ptr<uint8_t>() + e * n * kb, out.data_ptr<uint8_t>() + e * n * kb, (int)n, (int)(2 * kb),
        at::cuda::getCurrentCUDAStream());
  }}
  return out;
}}
"""
    return load_inline(
        name="prepkit_fi_sm90_interleave",
        cpp_sources="torch::Tensor shipped_interleave_fp4(torch::Tensor w);",
        cuda_sources=cuda,
        functions=["shipped_interleave_fp4"],
        verbose=False,
    )


SM90_SHAPES = [(1, 16, 32), (2, 48, 96), (2, 3072, 1472), (2, 2944, 768), (1, 5888, 1472)]


@pytest.mark.parametrize("shape", SM90_SHAPES)
def test_sm90_interleave_equals_flashinfers_kernel_source(shipped_kernel, shape: tuple[int, ...]) -> None:  # noqa: ANN001
    w = rand_u8(shape, sum(shape))
    want = shipped_kernel.shipped_interleave_fp4(w.cuda())
    torch.cuda.synchronize()
    assert torch.equal(interleave_weights_sm90(w), want.cpu())


def test_sm90_layout_weights_equal_flashinfers_kernel_source(shipped_kernel) -> None:  # noqa: ANN001
    w = real_weights(7)
    plan = SM90.plan_rank(DIMS, RankSpec(tp_size=2, tp_rank=1), LayoutOptions())
    out = SM90.build(w, plan)
    pieces = padded_pieces(w, plan)
    for name, key in [("w3_w1_weight", "w13"), ("w2_weight", "w2")]:
        want = shipped_kernel.shipped_interleave_fp4(pieces[key].cuda().contiguous()).cpu()
        assert torch.equal(out[name], want), name


@pytest.mark.skipif(
    os.environ.get("PREPKIT_FLASHINFER_FULL_JIT") != "1",
    reason="builds FlashInfer's whole SM90 CUTLASS MoE module; set PREPKIT_FLASHINFER_FULL_JIT=1",
)
@pytest.mark.parametrize("shape", [(2, 48, 96), (2, 3072, 1472)])
def test_sm90_interleave_equals_the_public_helper(shape: tuple[int, ...]) -> None:
    from flashinfer.fused_moe import interleave_moe_weights_for_sm90_mixed_gemm

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the SM90 module builds for SM90 only")
    w = rand_u8(shape, sum(shape))
    want = interleave_moe_weights_for_sm90_mixed_gemm(w.cuda(), "fp4").cpu()
    assert torch.equal(interleave_weights_sm90(w), want)
