from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from prepkit.checkpoint import Checkpoint
from prepkit.cli import cli
from prepkit.errors import LayoutError, VerifyError
from prepkit.layouts import LayoutOptions, RankSpec, get_layout
from prepkit.recipes import load_recipe
from prepkit.runtime import load_shards


@pytest.fixture(scope="module")
def prepared(ep_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "tp2"
    result = CliRunner().invoke(cli, ["prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.stderr
    return out


def test_loaded_tensors_invert_to_the_source(prepared: Path, ep_ckpt: Path) -> None:
    shards = load_shards(prepared, rank=1, expect_layout="trtllm_gen_v1")
    assert shards.layout_name == "trtllm-gen" and shards.tp_rank == 1
    assert shards.valid_intermediate == 256 and shards.padded_intermediate == 256
    assert shards.facts["valid_intermediate_size"] == 256
    ckpt = Checkpoint(ep_ckpt, load_recipe("gpt-oss-120b"))
    layout = get_layout(shards.layout_id)
    plan = layout.plan_rank(ckpt.dims, RankSpec(tp_size=2, tp_rank=1), LayoutOptions())
    back = layout.invert(shards.layer(1), plan)
    want = ckpt.read_experts(1).intermediate_slice(*shards.intermediate_range)
    for role, t in want.as_dict().items():
        assert torch.equal(back.as_dict()[role], t), role


def test_mismatches_are_refused_naming_both_values(prepared: Path) -> None:
    with pytest.raises(LayoutError, match="trtllm_gen_v1.*expected 'cutlass_sm90_v1'"):
        load_shards(prepared, rank=0, expect_layout="cutlass_sm90_v1")
    with pytest.raises(LayoutError, match="not rank 5"):
        load_shards(prepared, rank=5)


def test_tampered_shapes_and_hashes_are_caught(prepared: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["ranks"][0]["tensors"]["w2_weight"]["shape"][0] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(VerifyError, match="w2_weight"):
        load_shards(copy, rank=0)
    victim = copy / "rank1" / "experts-00000.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match="sha256"):
        load_shards(copy, rank=1, check_hashes=True)


def test_importing_the_runtime_is_cheap() -> None:
    code = (
        "import sys, prepkit.runtime; from prepkit.runtime import load_shards; "
        "print(sorted(m for m in ('click', 'rich', 'huggingface_hub', 'triton', 'sqlite_utils') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_truncated_or_unreadable_shard_is_named(prepared: Path, tmp_path: Path) -> None:
    import shutil

    copy = Path(shutil.copytree(prepared, tmp_path / "copy"))
    victim = copy / "rank1" / "experts-00001.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[:100])  # shorter than its own header
    with pytest.raises(VerifyError, match=f"{victim} is 100 bytes, the manifest says {len(data)}"):
        load_shards(copy, rank=1)
    garbled = bytearray(data)
    garbled[8:16] = b"\xff" * 8  # the header is no longer JSON; the size is unchanged
    victim.write_bytes(bytes(garbled))
    with pytest.raises(VerifyError, match=f"{victim} cannot be read"):
        load_shards(copy, rank=1)


def test_cuda_without_a_gpu_is_a_device_error(prepared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prepkit.errors import DeviceError
    from prepkit.runtime import load_moe_layers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", torch.device("cuda", 0)):
        with pytest.raises(DeviceError, match="no CUDA device"):
            load_shards(prepared, rank=0, device=device)
        with pytest.raises(DeviceError, match="no CUDA device"):
            load_moe_layers(prepared, rank=0, device=device, use_tactics_db=False)
    with pytest.raises(DeviceError, match="'gpu' is not a torch device"):
        load_shards(prepared, rank=0, device="gpu")
    with pytest.raises(DeviceError, match="expected a str or torch.device"):
        load_shards(prepared, rank=0, device=0.5)


def test_bad_ranks_and_layers_are_named_before_any_shard_is_opened(
    prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prepkit.errors import RecipeError
    from prepkit.runtime import loader

    def no_shard_may_be_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a shard file was opened")

    monkeypatch.setattr(loader, "load_file", no_shard_may_be_read)
    with pytest.raises(LayoutError, match=r"layers: layer 5 does not exist: .* holds 2 layers \(0\.\.1\)"):
        load_shards(prepared, rank=0, layers=[5])
    with pytest.raises(LayoutError, match=r"layer -1 does not exist"):
        load_shards(prepared, rank=0, layers=[0, -1])
    for rank in (1.0, True, "1"):
        with pytest.raises(RecipeError, match=f"rank: expected an int, got {rank!r}"):
            load_shards(prepared, rank=rank)  # type: ignore[arg-type]
    with pytest.raises(RecipeError, match="layers: expected a list of layer indexes"):
        load_shards(prepared, rank=0, layers=1)  # type: ignore[arg-type]
    with pytest.raises(RecipeError, match=r"layers: expected ints, got 0\.0"):
        load_shards(prepared, rank=0, layers=[0.0])  # type: ignore[list-item]
    monkeypatch.undo()
    # an int of another kind is an int: numpy's, and a 0-d torch tensor
    import numpy as np

    shards = load_shards(prepared, rank=np.int64(1), layers=(torch.tensor(1),))
    assert shards.rank == 1 and sorted(shards.layers) == [1]
