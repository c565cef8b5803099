"""``torch.ops.prepkit.moe``: the registered op around ``prepkit.runtime.moe``. Shapes on fake and
meta tensors, torch.library's own consistency checks, and equality with the plain call."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from prepkit.runtime import moe
from prepkit.runtime.op import registered_layer
from tests.kernels.moe_data import make_layer, random_experts, random_inputs

E, H, I, TOP_K = 4, 64, 64, 2


@pytest.fixture(scope="module")
def layer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned tactic for tiny dims
        built, _ = make_layer(random_experts(E, H, I, seed=31), TOP_K)
    return built


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fake_tensors_give_the_output_shape_and_dtype(layer, out_dtype: torch.dtype) -> None:
    with FakeTensorMode():
        x = torch.empty(5, H, dtype=torch.bfloat16)
        logits = torch.empty(5, E)
        out = torch.ops.prepkit.moe(x, logits, layer.op_id, out_dtype)
    assert tuple(out.shape) == (5, H) and out.dtype == out_dtype


def test_meta_tensors_give_the_output_shape(layer) -> None:
    x = torch.empty(3, H, dtype=torch.bfloat16, device="meta")
    out = torch.ops.prepkit.moe(x, torch.empty(3, E, device="meta"), layer.op_id, torch.bfloat16)
    assert out.device.type == "meta" and tuple(out.shape) == (3, H) and out.dtype == torch.bfloat16


def test_the_op_equals_the_plain_call(layer, device: str) -> None:
    if device != "cpu":
        pytest.skip("the CPU interpreter's test; the GPU tests compile the op")
    x, logits = random_inputs(6, E, H, seed=32)
    want = moe(layer, x, logits)
    got = torch.ops.prepkit.moe(x, logits, layer.op_id, torch.bfloat16)
    assert got.abs().max() > 0
    assert torch.equal(got, want)


def test_opcheck_passes(layer, device: str) -> None:
    if device != "cpu":
        pytest.skip("the CPU interpreter's test")
    x, logits = random_inputs(3, E, H, seed=33)
    torch.library.opcheck(torch.ops.prepkit.moe.default, (x, logits, layer.op_id, torch.bfloat16))


def test_compiled_call_has_no_graph_break_and_same_output(layer, device: str) -> None:
    if device != "cpu":
        pytest.skip("the CPU interpreter's test")
    x, logits = random_inputs(4, E, H, seed=34)

    def block(h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return moe(layer, h * 2, r) + 1

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, logits), block(x, logits))


def test_a_freed_layer_is_named_by_its_id() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, _ = make_layer(random_experts(E, H, I, seed=35), TOP_K)
    layer_id = built.op_id
    assert registered_layer(layer_id) is built
    del built
    gc.collect()
    with pytest.raises(KeyError, match=f"no live MoeLayer has id {layer_id}"):
        registered_layer(layer_id)
