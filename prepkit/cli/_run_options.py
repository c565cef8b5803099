"""Options of the commands that run a prepared model (``generate``, ``bench``), defined once.
Their choices are literal here so that ``--help`` loads neither torch nor triton; a test checks
them against the runtime's own lists."""

from __future__ import annotations

import os
import sys
import warnings
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
    """``--activations``, ``--device``, ``--step`` and ``--nproc``."""
    f = click.option(
        "--nproc",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Run a split set (prepare --tp/--ep) as this many processes on this host, one GPU each, as "
        "torchrun --nproc-per-node would; rank 0 prints the results.",
    )(f)
    f = click.option(
        "--step",
        type=click.Choice(STEP_CHOICES),
        default=None,
        help="Decode step: transformers' modules' operations in a CUDA graph, the compiled step (fused, about "
        "twice as fast per layer), or prepkit's decode kernels (one launch per op, attention over the slots in "
        "use).  [default on a GPU: kernels for one row, compiled for more; modules on the CPU]",
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


def as_ranks(nproc: int) -> int | None:
    """Start the command as ``nproc`` ranks and return their exit code, for ``--nproc`` > 1; else
    None, after quieting this process when it is a rank other than 0 (results and progress
    come from rank 0; errors from every rank).

    Raises:
        click.UsageError: ``--nproc`` given to a process that is already one rank of a launch.
    """
    from prepkit import console
    from prepkit.distributed.launch_env import LaunchEnv

    env = LaunchEnv.from_environ()
    if nproc > 1:
        if env is not None:
            raise click.UsageError(f"--nproc {nproc}: this process is already rank {env.rank} of {env.world_size}")
        from prepkit.distributed.spawn import prepkit_command, spawn, without_nproc

        argv = click.get_current_context().meta.get("prepkit.argv", [])
        return spawn(nproc, prepkit_command(without_nproc(argv)))
    if env is not None:
        from prepkit.distributed.session import leave

        click.get_current_context().call_on_close(leave)  # NCCL warns at exit when a group is left open
    if env is not None and not env.is_main:
        console.set_quiet(True)
        console.silence_stdout()
        sys.stdin = open(os.devnull)  # noqa: SIM115  (rank 0 reads the prompt and sends it)
        warnings.simplefilter("ignore")  # rank 0 gives the same warnings
    return None


def other_rank() -> bool:
    """Whether this process is a rank other than 0 of a launch (it shows no progress)."""
    from prepkit.distributed.launch_env import LaunchEnv

    env = LaunchEnv.from_environ()
    return env is not None and not env.is_main
