"""prepkit: offline preparation of gpt-oss MXFP4 MoE weights for NVIDIA inference engines."""

from prepkit.errors import PrepkitError

__version__ = "0.1.0"
__all__ = ["PrepkitError", "__version__"]
