"""``prepare --dense``: bf16 output exactly as before, MX dense weights written, recorded, verified."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.constants import PREPARE_LOCK
from prepkit.synth import write_synthetic_checkpoint


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def _tree_hashes(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != PREPARE_LOCK
    }


@pytest.fixture(scope="module")
def pinned_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic checkpoint whose bytes and modification times (the plan fingerprint reads them)
    are fixed, so a prepared folder's every byte, the manifest's included, is reproducible."""
    src = write_synthetic_checkpoint(
        tmp_path_factory.mktemp("pinned") / "src",
        num_layers=2,
        num_experts=4,
        hidden=256,
        intermediate=512,
        num_shards=2,
        seed=5,
    )
    for path in src.iterdir():
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    return src


# Every file of the output, as prepkit wrote it before ``--dense`` existed (same version string).
BF16_OUTPUT = {
    "trtllm-gen": {
        "generation_config.json": "30c85b919b421587f2547ff1d82076746888cdca05560f91bafca5604a534d58",
        "manifest.json": "6da7ebb0723b59dbaca3634ae7f7cc3ccae619f69ae321df2b3a2bfea6be8b3d",
        "rank0/experts-00000.safetensors": "503083eb61ca8ad27460a46b4fc59f69c3c71aef30d50d71ac462aaf5c4889b4",
        "rank0/experts-00001.safetensors": "68945173f9d93ae365163faa8a7e3bc1a9f1b68fc34689d6e4128d5a32ee8783",
        "rank0/model.safetensors.index.json": "16fa1e394c7ca213285856588e3bc8c8fd00eeb331a8a59b1be20df2c4c6eeec",
        "rank0/non-expert-00000.safetensors": "186bec426c1b185f609ee48b7779fb8d63502c83f1bd04addeb6069059c95c0e",
        "rank1/experts-00000.safetensors": "c87ac8ebaa2bb8c2e3261463eb50e7e15834523ec9e634b8bdd1d4eae0961ee2",
        "rank1/experts-00001.safetensors": "db5254e4e72fb6cdc49daad8e34ab8ed6fc3729f5349a63d06778abb7ec52cc8",
        "rank1/model.safetensors.index.json": "3a5434e84fcdd51ee1f000ea2cdb52f6e61793041c4592ce8c8c7dd50b61c160",
        "rank1/non-expert-00000.safetensors": "186bec426c1b185f609ee48b7779fb8d63502c83f1bd04addeb6069059c95c0e",
        "shared/non-expert-00000.safetensors": "186bec426c1b185f609ee48b7779fb8d63502c83f1bd04addeb6069059c95c0e",
    },
    "triton-moe": {
        "generation_config.json": "30c85b919b421587f2547ff1d82076746888cdca05560f91bafca5604a534d58",
        "manifest.json": "c3d1a2e2f8b3d0d039a85bfe956e92726d54e974f7f60338dbb5e426cbcd982c",
        "rank0/experts-00000.safetensors": "d13c0b8243f4191b40931ddca8b6df1a3996e15ab0577d5b6e61beab079e084f",
        "rank0/experts-00001.safetensors": "ce0a7d5c72212c49839d0f6107870d3c93463d5f6fcc0c9cd8bcb5a624fbb7d5",
        "rank0/model.safetensors.index.json": "d6dacda6fca3c53283c67499ec617128b4c41c2d5353e93cd74b50a87e97a965",
        "rank0/non-expert-00000.safetensors": "186bec426c1b185f609ee48b7779fb8d63502c83f1bd04addeb6069059c95c0e",
        "shared/non-expert-00000.safetensors": "186bec426c1b185f609ee48b7779fb8d63502c83f1bd04addeb6069059c95c0e",
    },
}


@pytest.mark.parametrize(("layout", "tp"), [("trtllm-gen", "2"), ("triton-moe", "1")])
@pytest.mark.parametrize("dense", [None, "bf16"], ids=["default", "explicit"])
def test_bf16_output_is_byte_identical_to_before(
    pinned_ckpt: Path, tmp_path: Path, layout: str, tp: str, dense: str | None
) -> None:
    out = tmp_path / "out"
    extra = ["--dense", dense] if dense else []
    code, _, stderr = run(
        "prepare", "--src", str(pinned_ckpt), "--layout", layout, "--tp", tp, "--out", str(out), "-q", *extra
    )
    assert code == 0, stderr
    assert _tree_hashes(out) == BF16_OUTPUT[layout]
