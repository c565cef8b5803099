"""Synthetic checkpoints look like gpt-oss: token ids inside the vocabulary, |w| near 1e-2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from prepkit import mxfp4
from prepkit.errors import CheckpointError
from prepkit.synth import REAL_TOKEN_IDS, special_token_ids, write_synthetic_checkpoint


def test_token_ids_index_the_embedding(tmp_path: Path) -> None:
    out = write_synthetic_checkpoint(tmp_path / "m", num_layers=1, hidden=64, intermediate=64, vocab_size=256)
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    ids = [config["pad_token_id"], config["eos_token_id"], generation["bos_token_id"], *generation["eos_token_id"]]
    assert all(0 <= i < 256 for i in ids)
    assert len(set(ids)) == 4  # bos, pad, eos, call stay distinct
    assert special_token_ids(201088) == REAL_TOKEN_IDS
    with pytest.raises(CheckpointError, match="vocab_size 3"):
        special_token_ids(3)


def test_expert_weights_have_gpt_oss_magnitudes(tmp_path: Path) -> None:
    out = write_synthetic_checkpoint(tmp_path / "m", num_layers=1, num_experts=4, hidden=256, intermediate=256)
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    for proj in ("gate_up_proj", "down_proj"):
        prefix = f"model.layers.0.mlp.experts.{proj}"
        w = mxfp4.dequantize(tensors[prefix + "_blocks"], tensors[prefix + "_scales"]).float()
        assert 5e-3 < float(w.abs().mean()) < 3e-2, proj
        # Quantized Gaussian weights rarely reach the top code (+-6); uniform bytes would give 1/8.
        codes = mxfp4.unpack_nibbles(tensors[prefix + "_blocks"]) & 7
        assert float((codes == 7).float().mean()) < 0.05
        assert float(tensors[prefix + "_bias"].float().abs().mean()) < 0.05
        scales = tensors[prefix + "_scales"]
        assert int(scales.min()) >= 118 and int(scales.max()) <= 121
