"""The bundled Triton MXFP4 MoE kernel. Imports nothing heavy at package import time."""

from __future__ import annotations

from prepkit.distribution import install_hint
from prepkit.errors import DependencyError

GPU_EXTRA = install_hint("gpu")  # what installs triton, the kernel's compiler


def require_triton(what: str) -> None:
    """Import triton, or raise DependencyError saying that ``what`` needs it and how to install it.

    Raises:
        DependencyError: triton cannot be imported (not installed, or broken: its error is kept).
    """
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise DependencyError(f"{what} needs triton, which cannot be imported ({err})", hint=GPU_EXTRA) from err
