"""One process's part in a launch, from start to end: read the environment, join the group on
this rank's device, and find the group again later (``from_prepared`` runs its checks over it)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch

from prepkit.distributed.group import CHECK_TIMEOUT_S, RankGroup, device_for, init_group
from prepkit.distributed.launch_env import LaunchEnv
from prepkit.errors import LayoutError

_current: RankGroup | None = None


def start(requested_device: str | torch.device) -> RankGroup | None:
    """Join the launch this process belongs to (torchrun's or ``--nproc``'s environment), or
    None for a single process. The device is this rank's (``cuda:LOCAL_RANK`` or the CPU)."""
    global _current
    env = LaunchEnv.from_environ()
    if env is None:
        return None
    if _current is None:
        _current = init_group(env, device_for(env, requested_device))
    return _current


def rank_group(device: torch.device, split: str = "the shard set is split") -> RankGroup:
    """The group this process joined, through :func:`start` or by its own
    ``torch.distributed.init_process_group`` (then adopted here, on ``device``). ``split`` says
    how the set is split, for the error.

    Raises:
        LayoutError: torch.distributed is not initialised: a split set needs one process per rank.
    """
    global _current
    if _current is not None:
        return _current
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise LayoutError(
            f"parallel: {split}, which runs one process per rank, and torch.distributed is not initialised "
            "(one process runs a tp=1 ep=1 set)",
            hint="start with: torchrun --nproc-per-node N -m prepkit generate FOLDER (or prepkit generate --nproc N), "
            "or call torch.distributed.init_process_group before from_prepared",
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    env = LaunchEnv(rank, world, device.index or 0, "", 0)
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=CHECK_TIMEOUT_S))
    _current = RankGroup(env, device, dist.get_backend(), side)
    return _current


def forget() -> None:
    """Drop the remembered group (after the process group is destroyed)."""
    global _current
    _current = None


def leave() -> None:
    """Leave the process group this process joined, if any (NCCL warns at exit otherwise)."""
    from prepkit.distributed.group import leave_group

    leave_group()
    forget()


def start_ranks(requested_device: str | torch.device, folder: Path) -> RankGroup | None:
    """:func:`start`, then the checks before loading (:func:`~prepkit.distributed.preflight.preflight`)
    over a launch; None for a single process.

    Raises:
        LaunchError: on every rank, when the launch does not fit ``folder``'s set.
    """
    group = start(requested_device)
    if group is not None:
        from prepkit.distributed.preflight import preflight

        preflight(group, folder)
    return group
