"""Kernel tests run on the GPU when there is one, else on the Triton CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

# Triton picks interpreter or compiler when a kernel module is imported, so decide here, before any
# test imports prepkit.kernels.mx: without CUDA the kernels run on the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    return DEVICE
