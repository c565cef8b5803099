"""The kernel package's former name, kept for one release: :mod:`prepkit.kernels.mx` holds the MoE
and dense MX kernels. Importing ``prepkit.kernels.moe_mxfp4`` (or one of its modules) gives the
same module objects, so patches and ``is`` checks see one kernel. The tactics DB names the kernel
by ``prepkit.tactics.keys.KERNEL_NAME``, not by this path."""

from __future__ import annotations

import importlib
import sys

from prepkit.kernels.mx import *  # noqa: F403
from prepkit.kernels.mx import KERNEL_VERSION, __all__  # noqa: F401

_MODULES = ("_buffers", "_chain", "_dense", "_gemm", "_ids", "_mainloop", "_mx", "_mx_rows", "_record", "_routing",
            "_steps", "_target", "_upcast", "dense", "launch", "plan")  # fmt: skip
for _name in _MODULES:
    _module = importlib.import_module(f"prepkit.kernels.mx.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module
