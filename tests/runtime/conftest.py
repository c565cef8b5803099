"""The runtime tests that run the bundled kernel use the kernel tests' rule: the GPU when there is
one, else the Triton CPU interpreter (set before any kernel module is imported)."""

from __future__ import annotations

from tests.kernels.conftest import DEVICE, device

__all__ = ["DEVICE", "device"]
