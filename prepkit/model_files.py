"""The files a model ships besides its weights and config: tokenizer, chat template, generation
defaults. ``prepare`` copies those the source folder has to the top of the prepared folder, so
that ``AutoTokenizer.from_pretrained(prepared_dir)`` and the transformers loader need nothing
but the prepared set; the manifest lists them among its files (sha256 and size), so ``verify``
checks them like any other file.

A source without any of them leaves the prepared folder, and its manifest, as they were before
this copy existed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prepkit.fsutil import sha256_file
from prepkit.shards import WrittenFile, write_output_file

# The names transformers' tokenizer and generation-config loaders look for at a model's top level.
MODEL_FILES = (
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
)
GENERATION_CONFIG = "generation_config.json"
_COPY_CHUNK = 8 * 1024 * 1024


def is_model_file(name: str) -> bool:
    """Whether ``name`` (at the top of a prepared folder) is one of :data:`MODEL_FILES`."""
    return name in MODEL_FILES


def model_files_in(src: str | Path) -> list[Path]:
    """The :data:`MODEL_FILES` that ``src`` holds as regular files, sorted by name."""
    root = Path(src)
    return [root / name for name in MODEL_FILES if (root / name).is_file()]


def copy_model_files(src: str | Path, out_dir: str | Path) -> dict[str, WrittenFile]:
    """Copy the source's model files to the top of ``out_dir`` (each written under a temporary
    name and renamed when complete), keyed by their path relative to ``out_dir``. A copy already
    there with the same bytes is kept, so a rerun rewrites nothing."""
    root = Path(out_dir)
    written: dict[str, WrittenFile] = {}
    for path in model_files_in(src):
        rel = path.name
        target = root / rel
        source_sha = sha256_file(path)
        if target.is_file() and target.stat().st_size == path.stat().st_size and sha256_file(target) == source_sha:
            written[rel] = WrittenFile(rel, source_sha, target.stat().st_size)
            continue
        written[rel] = write_output_file(root, rel, lambda path=path: _chunks(path))
    return written


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            yield chunk
