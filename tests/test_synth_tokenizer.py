"""``synth --tokenizer``: a word-level tokenizer that fits the synthetic config's vocabulary and
special ids, loads with AutoTokenizer and formats chats; and synthetic checkpoints of other dims
get other default output folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.synth import special_token_ids
from prepkit.synth_tokenizer import MIN_VOCAB, SPECIAL_TOKENS, vocabulary


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


SMALL = ("--layers", "1", "--experts", "4", "--hidden", "64", "--intermediate", "64")


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB, 300, 201088])
def test_the_vocabulary_fills_every_id_and_puts_the_specials_where_the_config_says(vocab_size: int) -> None:
    ids = special_token_ids(vocab_size)
    vocab = vocabulary(ids, vocab_size)
    assert sorted(vocab.values()) == list(range(vocab_size))
    for role, token in SPECIAL_TOKENS.items():
        assert vocab[token] == ids[role]


def test_synth_tokenizer_loads_and_formats_a_chat(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "m"
    r = run("synth", "--out", str(out), *SMALL, "--vocab", "512", "--tokenizer", "-q")
    assert r.exit_code == 0, r.output
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    record = json.loads((out / "prepkit-synth.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {f["path"] for f in record["files"]}  # hashed

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == config["vocab_size"] == 512
    assert tok.eos_token_id == config["eos_token_id"] and tok.pad_token_id == generation["pad_token_id"]
    assert tok.bos_token_id == generation["bos_token_id"]
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello world"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert max(ids) < config["vocab_size"]
    assert tok.unk_token_id not in ids  # the prompt's words are in the vocabulary
    text = tok.decode(ids)
    assert text.startswith("<|start|> user <|message|> hello world <|end|>") and text.endswith("assistant")


def test_synth_tokenizer_refuses_a_vocabulary_too_small_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "m"
    r = run("synth", "--out", str(out), *SMALL, "--vocab", str(MIN_VOCAB - 1), "--tokenizer")
    assert r.exit_code == 3 and "--vocab" in r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_synthetic_checkpoints_of_other_dims_get_other_default_folders(tmp_path: Path) -> None:
    outs = []
    for hidden, intermediate in ((64, 64), (64, 128), (128, 64)):
        src = tmp_path / f"m{hidden}-{intermediate}"
        args = ("--layers", "1", "--experts", "4", "--hidden", str(hidden), "--intermediate", str(intermediate))
        assert run("synth", "--out", str(src), *args, "-q").exit_code == 0
        r = run("prepare", "--src", str(src), "--dry-run", "--json")
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)["plan"]["out"]
        assert f"h{hidden}-i{intermediate}" in out
        outs.append(out)
    assert len(set(outs)) == 3


def test_synth_tokenizer_without_the_library_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from prepkit.errors import DependencyError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else real(name, *a))
    out = tmp_path / "m"
    r = run("synth", "--out", str(out), *SMALL, "--tokenizer")
    assert r.exit_code == DependencyError.exit_code and "tokenizers" in r.stderr and "prepkit-gpt-oss" in r.stderr
    assert not out.exists() or not any(out.iterdir())
