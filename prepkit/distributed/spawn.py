"""``--nproc N``: start N copies of a command on this host the way torchrun does (each with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), wait for them, and
exit as they did. For several hosts, torchrun itself is the launcher."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from prepkit.distributed.launch_env import LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE

# After one rank fails, the others get this long to fail on their own (the start checks end
# every rank within a minute) before they are stopped.
GRACE_S = 70.0
INTERRUPTED_EXIT = 130


def free_port() -> int:
    """A TCP port free on this host now, for the ranks to meet on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environ(base: Mapping[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(base)
    env.update({
        RANK: str(rank), LOCAL_RANK: str(rank), WORLD_SIZE: str(world_size), LOCAL_WORLD_SIZE: str(world_size),
        MASTER_ADDR: "127.0.0.1", MASTER_PORT: str(port),
    })  # fmt: skip
    return env


def without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--nproc N`` (or ``--nproc=N``): what each rank runs."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def exit_code_of(codes: Sequence[int | None]) -> int:
    """The launch's exit code: 0 when every rank ended 0, else the lowest rank's own failure
    (an exit code it chose), else any failure (a signal)."""
    failed = [c for c in codes if c not in (0, None)]
    if not failed:
        return 0
    own = [c for c in failed if c is not None and c > 0]
    return own[0] if own else 1


def spawn(nproc: int, command: Sequence[str], *, environ: Mapping[str, str] | None = None) -> int:
    """Run ``command`` as ranks 0..nproc-1 on this host; return the launch's exit code."""
    port = free_port()
    base = os.environ if environ is None else environ
    procs = [subprocess.Popen(list(command), env=rank_environ(base, rank, nproc, port)) for rank in range(nproc)]
    deadline: float | None = None
    try:
        while any(p.poll() is None for p in procs):
            if deadline is None and any(p.returncode not in (0, None) for p in procs):
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                deadline = float("inf")
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return INTERRUPTED_EXIT
    return exit_code_of([p.returncode for p in procs])


def prepkit_command(argv: Sequence[str]) -> list[str]:
    """This interpreter running ``prepkit`` with ``argv``."""
    return [sys.executable, "-m", "prepkit", *argv]
