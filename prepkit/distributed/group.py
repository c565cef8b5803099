"""The process group of a launch: NCCL between GPUs, gloo between CPU processes, and a gloo side
group with a short timeout for the checks before loading, so that a rank that fails or never
answers ends the others' wait in seconds, not at NCCL's default of minutes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from prepkit.distributed.launch_env import LaunchEnv
from prepkit.errors import LaunchError

# Each check's exchange gives up after this long; with the rest of a failing start it keeps
# the exit on every rank under a minute.
CHECK_TIMEOUT_S = 40.0


@dataclass
class RankGroup:
    """This process's rank, its device, and the groups it talks through."""

    env: LaunchEnv
    device: torch.device
    backend: str  # of the default group
    side: Any  # gloo ProcessGroup for the checks (CHECK_TIMEOUT_S)
    problem: str | None = None  # what this rank found wrong while joining, for the checks to tell every rank

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


def device_for(env: LaunchEnv, requested: str | torch.device) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` when CUDA is asked for, else the CPU.

    Raises:
        LaunchError: one GPU index named for all ranks (``cuda:N``), which would put them on one GPU.
    """
    asked = torch.device(requested)
    if asked.type == "cpu":
        return asked
    if asked.type != "cuda":
        raise LaunchError(f"device: {str(asked)!r}: ranks run on cuda (one GPU each) or on the cpu")
    if asked.index is not None:
        raise LaunchError(
            f"device: {str(asked)!r} names one GPU for all {env.world_size} ranks; each rank takes cuda:LOCAL_RANK",
            hint="pass --device cuda, and choose the GPUs with CUDA_VISIBLE_DEVICES",
        )
    return torch.device("cuda", env.local_rank)


def init_group(env: LaunchEnv, device: torch.device) -> RankGroup:
    """Join the launch's process group (or take the one already joined) and make the side group.
    A rank whose GPU does not exist still joins (CPU tensors go over gloo, CUDA ones over NCCL,
    whose communicators start at first use), so that the checks can end every rank.

    Raises:
        LaunchError: the group's world or rank differs from the environment's.
    """
    import torch.distributed as dist

    problem = None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index is None or device.index >= count:
            problem = f"LOCAL_RANK={env.local_rank} names cuda:{device.index}, this host has {count} GPU(s)"
        else:
            torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size)
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise LaunchError(
            f"the process group is rank {dist.get_rank()} of {dist.get_world_size()}, the environment says "
            f"rank {env.rank} of {env.world_size}"
        )
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=CHECK_TIMEOUT_S))
    return RankGroup(env, device, dist.get_backend(), side, problem)


def leave_group() -> None:
    """Leave the process group, when this process joined one (NCCL warns at exit otherwise)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def from_rank0(group: RankGroup, value: Any) -> Any:
    """Rank 0's ``value`` on every rank: what each rank must see alike (the prompt read from
    stdin, a drawn seed), over the side group.

    Raises:
        LaunchError: a rank did not answer within :data:`CHECK_TIMEOUT_S`.
    """
    import torch.distributed as dist

    box = [value]
    try:
        dist.broadcast_object_list(box, src=0, group=group.side)
    except (RuntimeError, ValueError) as err:
        raise LaunchError(
            f"rank {group.rank}: rank 0 did not send its input within {CHECK_TIMEOUT_S:.0f} s ({err})"
        ) from err
    return box[0]
