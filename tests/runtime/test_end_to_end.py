"""checkpoint -> prepkit prepare --layout triton-moe -> load_moe_layers -> moe, against the
fp32 reference computed from the source checkpoint dequantized (not from the prepared tensors)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from prepkit.checkpoint import Checkpoint
from prepkit.cli import cli
from prepkit.errors import LayoutError
from prepkit.kernels.reference import moe_reference, relative_error
from prepkit.recipes import load_recipe
from prepkit.runtime import load_moe_layers, moe
from prepkit.synth import write_synthetic_checkpoint

from .conftest import DEVICE


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("e2e") / "model",
        num_layers=2,
        num_experts=4,
        hidden=64,
        intermediate=96,
        top_k=2,
        num_shards=2,
        seed=21,
    )


def _prepare(source: Path, out: Path, *extra: str) -> None:
    result = CliRunner().invoke(cli, ["prepare", "--src", str(source), "--out", str(out), "-q", *extra])
    assert result.exit_code == 0, result.stderr


def test_prepared_shards_run_and_match_the_source(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    _prepare(source, out, "--layout", "triton-moe", "--tp", "2")
    ckpt = Checkpoint(source, load_recipe("gpt-oss-120b"))
    ckpt.validate()
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 64, generator=g) * 0.5).to(torch.bfloat16)
    logits = torch.randn(7, 4, generator=g)
    layer_index = 1
    total = torch.zeros(7, 64)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for rank in range(2):
            layers = load_moe_layers(out, rank=rank, device=DEVICE, layers=[layer_index], use_tactics_db=False)
            total += moe(layers[layer_index], x.to(DEVICE), logits.to(DEVICE), out_dtype=torch.float32).cpu()
    experts = ckpt.read_experts(layer_index).as_dict()
    ref = moe_reference(x, logits, experts, top_k=2)
    assert relative_error(total, ref) < 2e-2


def test_a_shard_set_of_another_layout_is_refused(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    _prepare(source, out, "--layout", "trtllm-gen")
    with pytest.raises(LayoutError, match="trtllm_gen_v1.*triton_moe_v3|triton_moe_v3.*trtllm_gen_v1"):
        load_moe_layers(out, rank=0, device=DEVICE)
