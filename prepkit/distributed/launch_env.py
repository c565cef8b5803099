"""The environment torchrun (and ``--nproc``) gives each process: its rank, the world's size,
its GPU on the host and where the ranks meet."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from prepkit.errors import LaunchError

# The variables torchrun sets for every worker; ``--nproc`` sets the same ones.
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE = "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"


@dataclass(frozen=True)
class LaunchEnv:
    """One process's place in a launch."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        """Rank 0 prints the results; the others stay quiet."""
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
        """The launch this process is part of, or None when it was not started as one of several
        (no ``WORLD_SIZE``, or a world of one).

        Raises:
            LaunchError: a variable that is not a number, or a rank outside the world (named).
        """
        env = os.environ if environ is None else environ
        if WORLD_SIZE not in env:
            return None
        world = _int_of(env, WORLD_SIZE)
        if world <= 1:
            return None
        rank = _int_of(env, RANK)
        local = _int_of(env, LOCAL_RANK) if LOCAL_RANK in env else rank
        if not 0 <= rank < world:
            raise LaunchError(f"{RANK}={rank} is outside the world of {WORLD_SIZE}={world}")
        missing = [name for name in (MASTER_ADDR, MASTER_PORT) if not env.get(name)]
        if missing:
            raise LaunchError(
                f"{' and '.join(missing)} not set: the ranks have nowhere to meet",
                hint="start with torchrun, or with prepkit's --nproc",
            )
        return cls(rank, world, local, env[MASTER_ADDR], _int_of(env, MASTER_PORT))


def _int_of(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(
            f"{name}={raw!r} is not a whole number", hint="start with torchrun, or with --nproc"
        ) from None


def one_host(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every rank of the launch runs on this host (``LOCAL_WORLD_SIZE`` equals
    ``WORLD_SIZE``): symmetric memory reaches peers over NVLink on one host only. False when the
    launcher does not say."""
    env = os.environ if environ is None else environ
    local, world = env.get(LOCAL_WORLD_SIZE), env.get(WORLD_SIZE)
    return local is not None and local == world
