from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.constants import MANIFEST_NAME
from prepkit.dims import ModelDims
from prepkit.errors import VerifyError
from prepkit.fsutil import json_bytes
from prepkit.manifest import (
    FETCHED,
    LOCAL,
    MANIFEST_VERSION,
    FileHash,
    LayoutRecord,
    Manifest,
    ModelRecord,
    Parallel,
    Provenance,
    RankRecord,
    TensorRecord,
)
from prepkit.runtime import load_shards


@pytest.fixture(scope="module")
def prepared(ep_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("manifest") / "tp2-ep2"
    args = ["prepare", "--src", str(ep_ckpt), "--tp", "2", "--ep", "2", "--layout", "triton-moe", "-q"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    return out


def test_written_manifest_reads_back_equal_and_serializes_to_the_same_bytes(prepared: Path) -> None:
    data = (prepared / MANIFEST_NAME).read_bytes()
    manifest = Manifest.read(prepared)
    assert json_bytes(manifest.to_json()) == data
    assert Manifest.from_json(json.loads(data)) == manifest
    assert manifest.parallel == Parallel(tp_size=2, ep_size=2)
    assert [(r.rank, r.tp_rank, r.ep_rank, r.expert_range) for r in manifest.ranks] == [
        (0, 0, 0, (0, 2)),
        (1, 1, 0, (0, 2)),
        (2, 0, 1, (2, 4)),
        (3, 1, 1, (2, 4)),
    ]
    assert manifest.layout.id == "triton_moe_v3" and manifest.model.provenance.kind == "prepkit synth"
    assert all(f.sha256 and f.bytes > 0 for f in manifest.files.values())


def test_json_keys_are_the_format_the_readers_use(prepared: Path) -> None:
    raw = json.loads((prepared / MANIFEST_NAME).read_text())
    assert set(raw) == {
        "format",
        "format_version",
        "prepkit_version",
        "fingerprint",
        "layout",
        "model",
        "parallel",
        "expert_tensor_prefix",
        "shared_files",
        "shared_file_link",
        "ranks",
        "files",
    }
    assert raw["format_version"] == MANIFEST_VERSION
    assert set(raw["layout"]) == {"name", "id", "w13_row_order", "options"}
    assert set(raw["parallel"]) == {"tp_size", "ep_size"}
    assert set(raw["model"]) == {
        "recipe",
        "repo_id",
        "revision",
        "dims",
        "config",
        "provenance",
        "synth_record",
        "seed",
        "source_files",
    }
    assert set(raw["model"]["dims"]) == {"num_layers", "num_experts", "hidden", "intermediate", "top_k"}
    assert set(raw["ranks"][0]) == {
        "rank",
        "tp_rank",
        "ep_rank",
        "expert_range",
        "intermediate_range",
        "valid_intermediate",
        "padded_intermediate",
        "padded_hidden",
        "sharding_rule",
        "facts",
        "tensors",
        "files",
    }
    assert set(next(iter(raw["ranks"][0]["tensors"].values()))) == {"shape", "dtype", "dims"}
    assert set(next(iter(raw["files"].values()))) == {"sha256", "bytes"}
    # the loader reads a manifest written back from the dataclass, and answers from its fields
    shards = load_shards(prepared, rank=3, layers=[0])
    assert (shards.tp_size, shards.ep_size, shards.ep_rank, shards.expert_range) == (2, 2, 1, (2, 4))
    assert shards.dims == raw["model"]["dims"]


def _manifest(provenance: Provenance) -> Manifest:
    return Manifest(
        prepkit_version="0.0.0",
        fingerprint="f" * 64,
        layout=LayoutRecord("trtllm-gen", "trtllm_gen_v1", "up_gate", {"trtllm_version": "1.2"}),
        model=ModelRecord(
            "gpt-oss-120b", "openai/gpt-oss-120b", "main", ModelDims(2, 4, 64, 96, 2), {"a": [1]}, provenance
        ),
        parallel=Parallel(2, 1),
        expert_tensor_prefix="model.layers.{layer}.mlp.experts.",
        shared_files=("shared/non-expert-00000.safetensors",),
        shared_file_link="symlink",
        ranks=(
            RankRecord(
                rank=0,
                tp_rank=0,
                ep_rank=0,
                expert_range=(0, 4),
                intermediate_range=(0, 64),
                valid_intermediate=64,
                padded_intermediate=128,
                padded_hidden=128,
                sharding_rule="pad-before-shard",
                facts={"k": 1.5},
                tensors={"w2_bias": TensorRecord((4, 128), "float32", ("E", "H"))},
                files=("rank0/experts-00000.safetensors",),
            ),
        ),
        files={"rank0/experts-00000.safetensors": FileHash("ab" * 32, 12)},
    )


@pytest.mark.parametrize(
    "provenance",
    [
        Provenance(LOCAL, {"model.safetensors": FileHash("cd" * 32, 7)}),
        Provenance(
            FETCHED,
            {"model.safetensors": FileHash("cd" * 32, 7)},
            source_repo="openai/gpt-oss-120b",
            source_revision="main",
            source_commit="e" * 40,
            fetched_at="2025-08-05T00:00:00+00:00",
            fetch_record="prepkit-fetch.json",
        ),
    ],
    ids=["local", "fetch"],
)
def test_every_provenance_kind_round_trips(provenance: Provenance) -> None:
    manifest = _manifest(provenance)
    raw = json.loads(json_bytes(manifest.to_json()))
    assert Manifest.from_json(raw) == manifest
    cited = {k for k in raw["model"] if k not in ("recipe", "repo_id", "revision", "dims", "config")}
    extra = {"source_repo", "source_revision", "source_commit", "fetched_at", "fetch_record"}
    assert cited == {"provenance", "source_files"} | (extra if provenance.kind == FETCHED else set())


@pytest.mark.parametrize("version", [MANIFEST_VERSION + 1, 0, None])
def test_other_format_versions_are_refused_naming_the_file_and_both_versions(
    prepared: Path, tmp_path: Path, version: int | None
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    raw = json.loads((copy / MANIFEST_NAME).read_text())
    raw["format_version"] = version
    (copy / MANIFEST_NAME).write_text(json.dumps(raw))
    want = rf"{copy / MANIFEST_NAME} has format_version {version}, this prepkit reads format_version {MANIFEST_VERSION}"
    with pytest.raises(VerifyError, match=want) as caught:
        load_shards(copy, rank=0)
    newer = version == MANIFEST_VERSION + 1
    assert caught.value.hint == ("upgrade prepkit" if newer else "prepare the shards again with this prepkit")
    result = CliRunner().invoke(cli, ["verify", str(copy), "-q"])
    assert result.exit_code == VerifyError.exit_code and "format_version" in result.stderr


def test_a_manifest_missing_a_key_is_refused_naming_it(prepared: Path) -> None:
    raw = json.loads((prepared / MANIFEST_NAME).read_text())
    del raw["ranks"][1]["padded_hidden"]
    with pytest.raises(VerifyError, match="somewhere/manifest.json.*padded_hidden"):
        Manifest.from_json(raw, "somewhere/manifest.json")


def test_the_manifest_module_does_not_import_torch() -> None:
    code = "import sys, prepkit.manifest; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
