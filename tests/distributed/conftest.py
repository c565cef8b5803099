"""Tiny prepared sets (one rank, tp 2, ep 2) and a way to start the tests' launches: real
processes on the CPU, talking over gloo, the kernel on the Triton interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when the kernel module is imported: decide before that
    # (for the tests run in this process after these, too).
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
pytest.importorskip("transformers", reason="needs transformers (pip install 'prepkit-gpt-oss[test]')")

from prepkit.synth import write_synthetic_checkpoint  # noqa: E402
from tests.integrations.test_transformers import TINY, _prepare  # noqa: E402
from tests.tokenizer_files import write_tokenizer_files  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# What the brief of a failed start promises: every rank out, with its message, within a minute.
START_FAILS_WITHIN_S = 60.0


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float


# The CPU twins start processes that run the kernels on the Triton interpreter. A GPU host runs the
# GPU twins instead: its Triton may be one whose interpreter cannot run these kernels (3.6 cannot).
cpu_twin = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU twin (the interpreter); a GPU host runs the GPU twins"
)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def run_launch(command: list[str], timeout_s: float = 240.0) -> Launch:
    """Run ``command`` (which starts the ranks itself) with this checkout importable and the CPU
    kernel on the interpreter; its output and wall time."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["TRITON_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a CI machine of two cores
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    began = time.monotonic()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return Launch(done.returncode, done.stdout, done.stderr, time.monotonic() - began)


def prepkit(*args: str) -> list[str]:
    return [sys.executable, "-m", "prepkit", *args]


@pytest.fixture(scope="session")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = write_synthetic_checkpoint(tmp_path_factory.mktemp("dist") / "model", seed=31, **TINY)
    write_tokenizer_files(src, TINY["vocab_size"])
    return src


@pytest.fixture(scope="session")
def tp1(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prepare(source, tmp_path_factory.mktemp("dist") / "tp1", "--layout", "triton-moe")


@pytest.fixture(scope="session")
def tp2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prepare(source, tmp_path_factory.mktemp("dist") / "tp2", "--layout", "triton-moe", "--tp", "2")


@pytest.fixture(scope="session")
def ep2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prepare(source, tmp_path_factory.mktemp("dist") / "ep2", "--layout", "triton-moe", "--ep", "2")
