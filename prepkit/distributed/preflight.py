"""The checks every rank passes before any weight loads, all ranks answering together: the
world's size against the set's tp x ep, this rank's files, the prepared set each rank opened
(by a hash of its manifest) and the GPU each rank holds. Each rank checks what it can alone,
then all reports are exchanged over the side group; a problem of any rank fails every rank
with the same message."""

from __future__ import annotations

import hashlib
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from prepkit.constants import MANIFEST_NAME
from prepkit.distributed.group import CHECK_TIMEOUT_S, RankGroup
from prepkit.errors import LaunchError, PrepkitError
from prepkit.manifest import Manifest, experts_file


@dataclass(frozen=True)
class RankReport:
    """What one rank found before loading."""

    rank: int
    host: str
    device: str  # "cuda:1", "cpu"
    device_id: str | None  # the GPU's uuid; None on the CPU, where ranks may share the device
    fingerprint: str | None  # sha256 of the manifest this rank read; None when it could not
    problem: str | None  # this rank's own failure, or None


def manifest_fingerprint(folder: Path) -> str:
    """The sha256 of ``folder``'s manifest: equal on two ranks when they opened the same set."""
    return hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest()


def device_id(device: torch.device) -> str | None:
    """The GPU's uuid (two ranks on one GPU share it), or None for the CPU."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"cuda:{device.index}"


def rank_files(manifest: Manifest, rank: int) -> list[str]:
    """The files rank ``rank`` reads: its links to the non-expert files and its expert files."""
    layers = manifest.model.dims.num_layers
    return [*manifest.rank_shared_files(rank), *(experts_file(rank, i) for i in range(layers))]


def local_problem(folder: Path, rank: int, world_size: int) -> tuple[str | None, str | None]:
    """``(fingerprint, problem)`` of what this rank sees alone."""
    try:
        fingerprint = manifest_fingerprint(folder)
    except OSError as err:
        return None, f"{folder / MANIFEST_NAME} cannot be read ({err.strerror or err})"
    try:
        manifest = Manifest.read(folder)
        parallel = manifest.parallel
        if parallel.world_size != world_size:
            return fingerprint, (
                f"{folder} is prepared for tp={parallel.tp_size} x ep={parallel.ep_size} = {parallel.world_size} "
                f"ranks, the launch has {world_size}"
            )
        if manifest.rank_record(rank) is None:
            return fingerprint, f"{folder} holds no rank {rank} in its manifest"
        for rel in rank_files(manifest, rank):
            if not (folder / rel).is_file():
                return fingerprint, f"{folder / rel} is missing"
    except PrepkitError as err:
        return fingerprint, str(err)
    return fingerprint, None


def local_report(group: RankGroup, folder: Path) -> RankReport:
    fingerprint, problem = local_problem(folder, group.rank, group.world_size)
    return RankReport(
        rank=group.rank,
        host=socket.gethostname(),
        device=str(group.device),
        device_id=None if group.problem else device_id(group.device),
        fingerprint=fingerprint,
        problem=group.problem or problem,
    )


def find_problems(reports: list[RankReport], world_size: int) -> list[str]:
    """Every problem across the ranks' reports, each once, naming the ranks it concerns."""
    problems: dict[str, list[int]] = {}
    for report in reports:
        if report.problem is not None:
            problems.setdefault(report.problem, []).append(report.rank)
    out = [f"{_ranks(ranks, world_size)}: {problem}" for problem, ranks in problems.items()]
    prints = {r.fingerprint for r in reports if r.fingerprint is not None}
    if len(prints) > 1:
        listed = ", ".join(f"rank {r.rank} {r.fingerprint[:12]}" for r in reports if r.fingerprint)
        out.append(f"the ranks opened different prepared sets (manifest sha256: {listed})")
    holders: dict[tuple[str, str], list[RankReport]] = {}
    for report in reports:
        if report.device_id is not None:
            holders.setdefault((report.host, report.device_id), []).append(report)
    for (host, _), sharing in holders.items():
        if len(sharing) > 1:
            who = ", ".join(f"rank {r.rank} ({r.device})" for r in sharing)
            out.append(f"one GPU on {host} is used by {who}")
    return out


def exchange(group: RankGroup, report: RankReport) -> list[RankReport]:
    """Every rank's report, in rank order, over the side group.

    Raises:
        LaunchError: a rank did not answer within :data:`CHECK_TIMEOUT_S`.
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * group.world_size
    try:
        dist.all_gather_object(gathered, asdict(report), group=group.side)
    except (RuntimeError, ValueError) as err:  # gloo's timeout, a peer that left
        raise LaunchError(
            f"rank {group.rank}: not every rank answered the start checks within {CHECK_TIMEOUT_S:.0f} s ({err})",
            hint="another rank failed or never started: see its own message",
        ) from err
    return [RankReport(**raw) for raw in gathered]


def preflight(group: RankGroup, folder: Path) -> None:
    """Run the checks on every rank; return when all pass.

    Raises:
        LaunchError: on every rank, with every problem found on any rank.
    """
    reports = exchange(group, local_report(group, folder))
    problems = find_problems(reports, group.world_size)
    if problems:
        raise LaunchError(
            f"the launch does not fit the prepared set (seen by rank {group.rank}): " + "; ".join(problems),
            hint="run as many processes as the set has ranks (tp x ep), one GPU each, all on one prepared set; "
            f"check the set with: prepkit verify {folder}",
        )


def _ranks(ranks: list[int], world_size: int) -> str:
    if len(ranks) == world_size and world_size > 1:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
