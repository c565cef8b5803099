"""A tiny prepared folder with a tokenizer, run on the Triton interpreter when there is no GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when the kernel module is imported: decide before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from prepkit.synth import write_synthetic_checkpoint  # noqa: E402
from tests.integrations.test_transformers import TINY, _prepare  # noqa: E402
from tests.tokenizer_files import write_tokenizer_files  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = write_synthetic_checkpoint(tmp_path_factory.mktemp("gen") / "model", seed=31, **TINY)
    write_tokenizer_files(src, TINY["vocab_size"])
    return src


@pytest.fixture(scope="session")
def tiny_prepared(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("triton")
    return _prepare(tiny_source, tmp_path_factory.mktemp("gen") / "triton", "--layout", "triton-moe")
