"""``prepare --dense``: bf16 output exactly as before, MX dense weights written, recorded, verified."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from prepkit.checkpoint import Checkpoint
from prepkit.cli import cli
from prepkit.constants import DENSE_MX_LAYOUT_ID, INDEX_NAME, JOURNAL_NAME, MANIFEST_NAME, PREPARE_LOCK
from prepkit.errors import LayoutError, VerifyError
from prepkit.fsutil import format_bytes, json_bytes, sha256_file
from prepkit.layouts import dense_mx
from prepkit.layouts.dense_mx import MXFP4, MXFP8, mx_format
from prepkit.layouts.triton_moe import PANEL_BYTES
from prepkit.manifest import DenseTensorRecord, Manifest
from prepkit.prepare import dense as dense_weights
from prepkit.recipes import load_recipe
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


def _tensor_bytes(path: Path) -> int:
    """Bytes of a safetensors file past its header."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header_len


def _offset_of(path: Path, name: str) -> tuple[int, int]:
    """File offset of tensor ``name``'s first byte, and its byte count."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    lo, hi = header[name]["data_offsets"]
    return 8 + header_len + lo, hi - lo


@pytest.fixture(scope="module", params=["mxfp8", "mxfp4"])
def mx_prepared(request: pytest.FixtureRequest, ep_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    fmt = request.param
    out = tmp_path_factory.mktemp("dense") / fmt
    code, _, stderr = run(
        "prepare", "--src", str(ep_ckpt), "--layout", "triton-moe", "--tp", "2", "--dense", fmt, "--out", str(out), "-q"
    )
    assert code == 0, stderr
    return out


def test_mx_dense_weights_are_written_recorded_and_verified(mx_prepared: Path, ep_ckpt: Path) -> None:
    manifest = Manifest.read(mx_prepared)
    fmt = mx_format(manifest.dense_format)
    assert manifest.dense_format == mx_prepared.name
    ckpt = Checkpoint(ep_ckpt, load_recipe(manifest.model.recipe))
    ckpt.validate()
    dense_names = sorted(n for n in ckpt.non_expert_names() if dense_mx.is_dense_weight(n))
    # 2 layers x q/k/v/o, and the head
    assert len(dense_names) == 9 and "lm_head.weight" in dense_names
    assert manifest.dense is not None and manifest.dense.layout_id == DENSE_MX_LAYOUT_ID
    assert sorted(manifest.dense.tensors) == dense_names
    shared = mx_prepared / manifest.shared_files[0]
    with safe_open(str(shared), framework="pt") as f:
        stored = set(f.keys())  # noqa: SIM118  (safe_open handles are not dicts)
        for name in dense_names:
            record = manifest.dense.tensors[name]
            n, k = ckpt.entries[name].shape
            assert record == DenseTensorRecord(fmt.name, (n, k), name + "_blocks", name + "_scales")
            assert name not in stored
            blocks, scales = f.get_tensor(record.blocks), f.get_tensor(record.scales)
            assert blocks.dtype == scales.dtype == torch.uint8
            assert list(blocks.shape) == [-(-k // fmt.panel_k), n, PANEL_BYTES] and list(scales.shape) == [k // 32, n]
            source = ckpt.read(name).float()
            got = dense_mx.dequantize_kernel_layout(blocks, scales, fmt, name)
            # MX rounding moved values (the source is bf16), each within its format's bound
            assert not torch.equal(got, source)
            assert bool(((got - source).abs() <= dense_mx.rounding_bound(source, scales.T, fmt)).all())
        # every other non-expert tensor is carried through unchanged
        for name in sorted(set(ckpt.non_expert_names()) - set(dense_names)):
            assert torch.equal(f.get_tensor(name), ckpt.read(name)), name
        assert f.metadata()["dense_format"] == fmt.name and f.metadata()["dense_layout"] == DENSE_MX_LAYOUT_ID
    # each rank's index maps the stored names to the linked shared file
    for r in (0, 1):
        weight_map = json.loads((mx_prepared / f"rank{r}" / INDEX_NAME).read_text())["weight_map"]
        assert weight_map["lm_head.weight_blocks"] == weight_map["lm_head.weight_scales"] == shared.name
        assert "lm_head.weight" not in weight_map and "model.embed_tokens.weight" in weight_map
    code, stdout, stderr = run("verify", str(mx_prepared), "--src", str(ep_ckpt), "--json", "-q")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["ok"] and report["shared_tensors_checked"] == len(ckpt.non_expert_names())


def test_planned_bytes_are_the_written_bytes(mx_prepared: Path, ep_ckpt: Path, tmp_path: Path) -> None:
    fmt = mx_format(mx_prepared.name)
    code, stdout, stderr = run(
        "prepare", "--src", str(ep_ckpt), "--layout", "triton-moe", "--tp", "2", "--dense", fmt.name,
        "--out", str(tmp_path / "o"), "--dry-run", "--json",
    )  # fmt: skip
    assert code == 0, stderr
    plan = json.loads(stdout)["plan"]
    manifest = Manifest.read(mx_prepared)
    assert plan["shared_bytes"] == sum(_tensor_bytes(mx_prepared / rel) for rel in manifest.shared_files)
    experts = sum(_tensor_bytes(mx_prepared / rel) for rel in manifest.files if "/experts-" in rel)
    assert plan["bytes_to_write"] == experts + plan["shared_bytes"]
    # the bytes saved against bf16: 2 bytes an element, against the MX blocks and scales
    ckpt = Checkpoint(ep_ckpt, load_recipe("gpt-oss-120b"))
    ckpt.validate()
    shapes = [ckpt.entries[n].shape for n in ckpt.non_expert_names() if dense_mx.is_dense_weight(n)]
    bf16 = sum(2 * n * k for n, k in shapes)
    mx = sum(fmt.stored_bytes(n, k) for n, k in shapes)
    dense = plan["dense"]
    assert (dense["format"], dense["layout_id"], dense["tensors"]) == (fmt.name, DENSE_MX_LAYOUT_ID, 9)
    assert (dense["bf16_bytes"], dense["bytes"], dense["bytes_saved"]) == (bf16, mx, bf16 - mx)
    assert plan["shared_bytes"] == sum(e.nbytes for e in ckpt.entries.values() if "experts" not in e.name) - bf16 + mx
    code, stdout, _ = run(
        "prepare", "--src", str(ep_ckpt), "--layout", "triton-moe", "--dense", fmt.name,
        "--out", str(tmp_path / "o"), "--dry-run",
    )  # fmt: skip
    assert code == 0
    assert f"{fmt.name} ({DENSE_MX_LAYOUT_ID})" in stdout and f"{format_bytes(bf16 - mx)} saved" in stdout
    assert not (tmp_path / "o").exists()


def test_bf16_dry_run_shows_the_dense_weights_unchanged(ep_ckpt: Path, tmp_path: Path) -> None:
    args = ("prepare", "--src", str(ep_ckpt), "--out", str(tmp_path / "o"), "--dry-run")
    code, stdout, _ = run(*args, "--json")
    dense = json.loads(stdout)["plan"]["dense"]
    assert code == 0 and dense["format"] == "bf16" and dense["layout_id"] is None
    assert dense["bytes"] == dense["bf16_bytes"] > 0 and dense["bytes_saved"] == 0
    code, stdout, _ = run(*args)
    assert code == 0 and "bf16, as in the checkpoint" in stdout


@pytest.mark.parametrize("layout", ["trtllm-gen", "cutlass-sm90", "cutlass-sm12x"])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_layouts_whose_engine_reads_only_bf16_are_refused(ep_ckpt: Path, tmp_path: Path, layout: str, fmt: str) -> None:
    out = tmp_path / "o"
    for extra in ((), ("--dry-run",)):
        code, _, stderr = run(
            "prepare", "--src", str(ep_ckpt), "--layout", layout, "--dense", fmt, "--out", str(out), *extra
        )
        assert code == LayoutError.exit_code == 3 and "Traceback" not in stderr
        assert f"--dense {fmt} is refused for --layout {layout}" in stderr and "--layout triton-moe" in stderr
        assert not out.exists()


def test_the_default_folder_names_an_mx_format(ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = run(
        "prepare", "--src", str(ep_ckpt), "--layout", "triton-moe", "--dense", "mxfp4", "--dry-run", "--json"
    )
    assert code == 0 and json.loads(stdout)["plan"]["out"].endswith("-triton-moe-tp1-mxfp4")
    code, stdout, _ = run("prepare", "--src", str(ep_ckpt), "--layout", "triton-moe", "--dry-run", "--json")
    assert code == 0 and json.loads(stdout)["plan"]["out"].endswith("-triton-moe-tp1")


@pytest.mark.parametrize("which", ["blocks", "scales"])
def test_a_flipped_byte_is_caught_even_with_the_manifest_hash_rewritten(
    mx_prepared: Path, ep_ckpt: Path, tmp_path: Path, which: str
) -> None:
    out = tmp_path / "out"
    shutil.copytree(mx_prepared, out, symlinks=True)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    rel = manifest["shared_files"][0]
    victim = out / rel
    name = f"model.layers.1.self_attn.o_proj.weight_{which}"
    offset, size = _offset_of(victim, name)
    data = bytearray(victim.read_bytes())
    data[offset + size // 3] ^= 0x01  # the lowest bit: one grid step, or a factor of 2 in a scale
    victim.write_bytes(bytes(data))
    code, _, stderr = run("verify", str(out))
    assert code == 6 and f"{rel}: sha256 differs" in stderr
    manifest["files"][rel]["sha256"] = sha256_file(victim)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert run("verify", str(out))[0] == 0  # the hashes alone now agree
    code, _, stderr = run("verify", str(out), "--src", str(ep_ckpt))
    assert code == 6 and "model.layers.1.self_attn.o_proj.weight" in stderr, stderr
    assert "element [" in stderr or "byte [" in stderr


def test_a_resume_with_another_dense_format_is_refused(
    ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prepkit.prepare import write

    out = tmp_path / "out"
    args = ("prepare", "--src", str(ep_ckpt), "--layout", "triton-moe", "--tp", "2", "--out", str(out), "-q")

    def full(self: write._RankFile, *rest: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(write._RankFile, "write_chunk", full)
        assert run(*args, "--dense", "mxfp8")[0] == 3
    assert (out / JOURNAL_NAME).is_file() and not (out / MANIFEST_NAME).exists()
    before = _tree_hashes(out)
    code, _, stderr = run(*args, "--dense", "mxfp4")
    assert code == 3 and "unfinished run of another plan" in stderr and "--dense is mxfp8 there, mxfp4 here" in stderr
    code, _, stderr = run(*args)
    assert code == 3 and "--dense is mxfp8 there, bf16 here" in stderr
    assert _tree_hashes(out) == before  # a refused run writes nothing
    assert run(*args, "--dense", "mxfp8")[0] == 0  # the command that started it finishes it
    clean = tmp_path / "clean"
    assert run(*args[:-2], str(clean), "-q", "--dense", "mxfp8")[0] == 0
    files = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert files == json.loads((clean / MANIFEST_NAME).read_text())["files"]  # resumed bytes = clean bytes
    code, _, stderr = run(*args, "--dense", "mxfp4")
    assert (
        code == 3
        and "holds a different prepared shard set" in stderr
        and "--dense is mxfp8 there, mxfp4 here" in stderr
    )
    bf16 = tmp_path / "bf16"
    assert run(*args[:-2], str(bf16), "-q")[0] == 0
    code, _, stderr = run(*args[:-2], str(bf16), "-q", "--dense", "mxfp8")
    assert code == 3 and "--dense is bf16 there, mxfp8 here" in stderr


def test_weights_quantized_a_slice_of_rows_at_a_time_match_the_whole(
    ep_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint(ep_ckpt, load_recipe("gpt-oss-120b"))
    ckpt.validate()
    monkeypatch.setattr(dense_weights, "ROW_SLICE_ELEMENTS", 3 * 256 + 5)  # slices of 3 rows, the last shorter
    for fmt in (MXFP8, MXFP4):
        got = dense_weights.quantize_weight(ckpt, "lm_head.weight", fmt)
        whole = dense_mx.to_kernel_layout(ckpt.read("lm_head.weight").float(), fmt)
        assert torch.equal(got["lm_head.weight_blocks"], whole["blocks"])
        assert torch.equal(got["lm_head.weight_scales"], whole["scales"])


def test_the_dense_record_round_trips_and_a_bf16_manifest_has_none(
    mx_prepared: Path, ep_ckpt: Path, tmp_path: Path
) -> None:
    raw = json.loads((mx_prepared / MANIFEST_NAME).read_bytes())
    manifest = Manifest.from_json(raw)
    assert json_bytes(manifest.to_json()) == (mx_prepared / MANIFEST_NAME).read_bytes()
    assert set(raw["dense"]) == {"format", "layout_id", "tensors"}
    assert set(raw["dense"]["tensors"]["lm_head.weight"]) == {"format", "shape", "blocks", "scales"}
    raw["dense"]["layout_id"] = "dense_mx_v99"
    with pytest.raises(VerifyError, match="dense_mx_v99.*dense_mx_v1"):
        Manifest.from_json(raw, "x/manifest.json")
    out = tmp_path / "bf16"
    assert run("prepare", "--src", str(ep_ckpt), "--layout", "triton-moe", "--out", str(out), "-q")[0] == 0
    assert "dense" not in json.loads((out / MANIFEST_NAME).read_text())
    assert Manifest.read(out).dense_format == "bf16" and Manifest.read(out).dense is None
