"""Fixtures of the transformers integration tests."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def interpreter() -> None:
    """Skip unless the kernel can run here: a CUDA device, or the Triton interpreter on the CPU
    (each test module sets ``TRITON_INTERPRET=1`` before triton is imported when there is no GPU)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")


@pytest.fixture(scope="module")
def cpu_interpreter() -> None:
    """Skip unless the kernel runs in the Triton interpreter on the CPU: for tests that build their
    model on the CPU and compare the bits the CPU gives (on a GPU host triton is imported for the
    GPU and cannot run a CPU model's kernels; the GPU tests are the twins there)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CPU test: needs the Triton interpreter (TRITON_INTERPRET=1, set where there is no GPU)")
