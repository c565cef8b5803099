"""Options of the commands that run a prepared model (``generate``, ``bench``), defined once.
Their choices are literal here so that ``--help`` loads neither torch nor triton; a test checks
them against the runtime's own lists."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

F = Callable[..., Any]

ACTIVATION_CHOICES = ("bf16", "mxfp8", "mxfp4")
STEP_CHOICES = ("modules", "compiled", "kernels")


def prepared_argument(f: F) -> F:
    return click.argument("prepared", type=click.Path(path_type=Path, file_okay=False))(f)


def run_options(f: F) -> F:
    """``--activations``, ``--device`` and ``--step``."""
    f = click.option(
        "--step",
        type=click.Choice(STEP_CHOICES),
        default=None,
        help="Decode step: transformers' modules' operations in a CUDA graph, the compiled step (fused, about "
        "twice as fast per layer), or prepkit's decode kernels (one launch per op, attention over the slots in "
        "use).  [default: compiled on a GPU, modules on the CPU]",
    )(f)
    f = click.option(
        "--device",
        default="cuda",
        show_default=True,
        help="Where to run: cuda, cuda:N, or cpu (the Triton interpreter: tiny models only).",
    )(f)
    return click.option(
        "--activations",
        type=click.Choice(ACTIVATION_CHOICES),
        default="bf16",
        show_default=True,
        help="Activation precision of the MoE and MX dense kernels (mxfp8/mxfp4 run natively on SM12x).",
    )(f)
