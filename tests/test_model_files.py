"""``prepare`` carries the source's tokenizer and generation files into the prepared folder, lists
them in the manifest, and ``verify`` checks them; a source without them is prepared as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.constants import INDEX_NAME, MANIFEST_NAME
from prepkit.fsutil import sha256_file
from prepkit.model_files import MODEL_FILES, copy_model_files, model_files_in
from prepkit.synth import write_synthetic_checkpoint
from tests.tokenizer_files import write_tokenizer_files

SMALL = {"num_layers": 2, "num_experts": 4, "hidden": 64, "intermediate": 64, "top_k": 2, "vocab_size": 256}


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


@pytest.fixture
def with_tokenizer(tmp_path: Path) -> Path:
    src = write_synthetic_checkpoint(tmp_path / "src", seed=3, **SMALL)
    write_tokenizer_files(src, SMALL["vocab_size"])
    return src


def test_prepare_copies_and_lists_the_model_files(with_tokenizer: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(with_tokenizer), "--out", str(out), "-q")[0] == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    names = {p.name for p in model_files_in(with_tokenizer)}
    assert names == {
        "chat_template.jinja",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    for name in names:
        assert (out / name).read_bytes() == (with_tokenizer / name).read_bytes()
        assert manifest["files"][name] == {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size}
    assert run("verify", str(out), "-q")[0] == 0
    # A rerun keeps the folder as it is.
    before = {n: (out / n).stat().st_ino for n in names}
    assert run("prepare", "--src", str(with_tokenizer), "--out", str(out), "-q")[0] == 0
    assert {n: (out / n).stat().st_ino for n in names} == before
    assert json.loads((out / MANIFEST_NAME).read_text()) == manifest


def test_verify_finds_a_changed_tokenizer(with_tokenizer: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(with_tokenizer), "--out", str(out), "-q")[0] == 0
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text().replace("w1", "w9"))
    code, output = run("verify", str(out))
    assert code == 6 and "tokenizer.json" in output


def test_a_source_without_model_files_is_prepared_as_before(tmp_path: Path) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", seed=3, **SMALL)
    (src / "generation_config.json").unlink()  # synth writes one; the hub's folders may lack it
    assert model_files_in(src) == []
    out = tmp_path / "out"
    assert run("prepare", "--src", str(src), "--out", str(out), "-q")[0] == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    top_level = {rel for rel in manifest["files"] if "/" not in rel}
    assert top_level == set()
    assert set(manifest["files"]) == {
        "shared/non-expert-00000.safetensors",
        "rank0/experts-00000.safetensors",
        "rank0/experts-00001.safetensors",
        f"rank0/{INDEX_NAME}",
    }
    assert not any((out / name).exists() for name in MODEL_FILES)


def test_the_tokenizer_loads_from_the_prepared_folder(with_tokenizer: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "out"
    assert run("prepare", "--src", str(with_tokenizer), "--out", str(out), "-q")[0] == 0
    ours = transformers.AutoTokenizer.from_pretrained(str(out))
    theirs = transformers.AutoTokenizer.from_pretrained(str(with_tokenizer))
    text = "w1 w7 w200 unknown"
    assert ours(text).input_ids == theirs(text).input_ids == [2, 8, 201, 0]
    chat = [{"role": "user", "content": "w3 w4"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert ours.eos_token == "<|endoftext|>"


def test_copy_replaces_a_stale_copy_and_keeps_a_current_one(with_tokenizer: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    written = copy_model_files(with_tokenizer, out)
    assert (out / "tokenizer.json").read_bytes() == (with_tokenizer / "tokenizer.json").read_bytes()
    assert written["tokenizer.json"].sha256 == sha256_file(with_tokenizer / "tokenizer.json")
    assert not list(out.glob("*.tmp-*"))
    inode = (out / "tokenizer.json").stat().st_ino
    assert copy_model_files(with_tokenizer, out) == written
    assert (out / "tokenizer.json").stat().st_ino == inode
