from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prepkit.checkpoint import Checkpoint
from prepkit.errors import CheckpointError
from prepkit.recipes import load_recipe

RECIPE = load_recipe("gpt-oss-120b")


@pytest.fixture()
def ckpt_copy(ep_ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(ep_ckpt, dst)
    return dst


def _shard_of(root: Path, name: str) -> Path:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    return root / index["weight_map"][name]


def test_reads_every_expert_through_the_index(synthetic_ckpt: Path) -> None:
    ckpt = Checkpoint(synthetic_ckpt, RECIPE)
    ckpt.validate()
    index = json.loads((synthetic_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    files_of_layer0 = {index[n] for n in ckpt.expert_names(0)} | {index[n] for n in ckpt.expert_names(1)}
    assert len(files_of_layer0) > 1, "fixture should make layers straddle shard files"
    w = ckpt.read_experts(1)
    assert tuple(w.gate_up_proj_blocks.shape) == (3, 5760, 90, 16)
    part = ckpt.read_experts_range(1, 1, 3)
    assert torch.equal(part.down_proj_scales, w.down_proj_scales[1:3])
    assert int(torch.count_nonzero(w.gate_up_proj_blocks)) > 0
    assert int(w.gate_up_proj_scales.max()) < 255


def test_every_problem_is_reported_at_once(ckpt_copy: Path) -> None:
    # wrong dtype and wrong shape in one shard, a tensor missing from the index, a truncated shard
    name_dtype = "model.layers.0.mlp.experts.down_proj_bias"
    name_shape = "model.layers.1.mlp.router.weight"
    shard = _shard_of(ckpt_copy, name_dtype)
    tensors = load_file(shard)
    tensors[name_dtype] = tensors[name_dtype].float()
    if name_shape in tensors:
        tensors[name_shape] = tensors[name_shape][:, :-32].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = ckpt_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.gate_up_proj_scales"]
    index_path.write_text(json.dumps(index))
    other = {p for p in ckpt_copy.glob("model-*.safetensors")} - {shard}
    victim = sorted(other)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        Checkpoint(ckpt_copy, RECIPE).validate()
    msg = str(err.value)
    assert f"{name_dtype} has dtype F32, expected BF16" in msg
    assert "model.layers.1.mlp.experts.gate_up_proj_scales: not in model.safetensors.index.json" in msg
    assert f"{victim.name}: truncated" in msg
    assert shard.name in msg


def test_missing_shard_is_named(ckpt_copy: Path) -> None:
    victim = sorted(ckpt_copy.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: missing"):
        Checkpoint(ckpt_copy, RECIPE).validate()


def test_not_a_gpt_oss_mxfp4_config(ckpt_copy: Path) -> None:
    cfg_path = ckpt_copy / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "llama"
    del cfg["quantization_config"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        Checkpoint(ckpt_copy, RECIPE)
    assert "model_type is 'llama'" in str(err.value) and "quant_method is None" in str(err.value)


def test_missing_folder_hints_at_fetch(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path / "nope", RECIPE)
    assert "prepkit fetch" in (err.value.hint or "")


def test_config_aliases_are_accepted(ckpt_copy: Path) -> None:
    cfg_path = ckpt_copy / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg.pop("num_experts_per_tok")
    cfg_path.write_text(json.dumps(cfg))
    ckpt = Checkpoint(ckpt_copy, RECIPE)
    assert ckpt.dims.num_experts == 4 and ckpt.dims.top_k == 4
