"""One fetch run, under the folder's lock: check what is there, let huggingface_hub download the rest,
verify every file against the hub's hashes (one more download for a file that fails), check the
index is complete, and write the fetch record."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prepkit.constants import FETCH_RECORD
from prepkit.errors import FetchError, OutputError
from prepkit.fetch import hub
from prepkit.fetch.cache import LOCK_PATH, STATE_PATH
from prepkit.fetch.plan import FetchPlan, PlannedFile
from prepkit.fetch.record import FetchRecord, write_record
from prepkit.fetch.state import FetchState
from prepkit.fsutil import format_bytes
from prepkit.locks import busy_error, exclusive


@dataclass(frozen=True)
class FetchResult:
    plan: FetchPlan
    downloaded: tuple[str, ...]  # fetched from the hub in this run
    reused: tuple[str, ...]  # already present (or in the cache) and verified
    retried: tuple[str, ...]  # failed verification once, fetched again and then passed
    orphans_removed: int
    record: FetchRecord

    def to_json(self) -> dict[str, Any]:
        sizes = {f.path: f.remote.size for f in self.plan.files}
        return {
            "repo_id": self.plan.source.repo_id,
            "revision": self.plan.source.revision,
            "commit": self.plan.commit,
            "dir": str(self.plan.dest),
            "record": str(self.record.path),
            "total_bytes": self.plan.total_bytes,
            "downloaded": list(self.downloaded),
            "downloaded_bytes": sum(sizes[p] for p in self.downloaded),
            "reused": list(self.reused),
            "retried": list(self.retried),
            "orphans_removed": self.orphans_removed,
            "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in self.record.entries],
        }


def fetch(
    plan: FetchPlan, *, token: str | bool | None = None, max_workers: int = 4, on_progress: hub.ProgressFn | None = None
) -> FetchResult:
    """Bring ``plan.dest`` to the planned snapshot, verify every file, and write the fetch record.

    Files verified before are not read again. A file that fails its hash check is downloaded once
    more; if it fails again it is deleted and reported.

    Raises:
        FetchError: not enough disk space (checked first), a hub or network error, disk full, a file
            that failed verification twice, a shard the index names that is not in the snapshot, or
            (offline) files that are missing or fail verification.
        OutputError: another fetch holds the folder.
    """
    dest = plan.dest
    dest.mkdir(parents=True, exist_ok=True)
    with _folder_lock(dest):
        for temp in [*dest.glob(f"{FETCH_RECORD}.tmp-*"), *(dest / STATE_PATH.parent).glob("*.tmp-*")]:
            temp.unlink(missing_ok=True)  # of a killed run: the lock says no live run owns them
        removed = hub.remove_orphans(list(plan.orphans))
        if not plan.fits:
            raise FetchError(
                f"not enough disk space in {dest}: {format_bytes(plan.need_bytes)} to download "
                f"+ {format_bytes(plan.margin_bytes)} margin, {format_bytes(plan.free_bytes + plan.orphan_bytes)} free",
                hint="free some space, or fetch elsewhere with --local-dir DIR or --cache-dir DIR",
            )
        state = _state_for(plan)
        todo = [f for f in plan.files if f.status != "verified"]
        if todo:  # the folder is about to change: until all is verified again it must not look complete
            (dest / FETCH_RECORD).unlink(missing_ok=True)
        if plan.offline:
            _refuse_incomplete(plan, todo)
        progress = hub.Progress(on_progress, plan.download_bytes)
        good = _check(state, [f for f in todo if f.status == "unverified"], max_workers)
        fetched = [f for f in todo if f.path not in good]
        for f in fetched:
            if f.status in ("unverified", "wrong-size"):
                _discard(dest / f.path)  # else huggingface_hub keeps it: it checks names, not bytes
        if plan.offline and fetched:
            raise FetchError(
                f"--offline: {len(fetched)} file(s) in {dest} do not match the hub's hashes and were deleted: "
                + ", ".join(f.path for f in fetched),
                hint="run the same command without --offline to fetch them again",
            )
        failed = _download(plan, state, fetched, plan.force, token, max_workers, progress)
        still_bad = _download(plan, state, failed, True, token, max_workers, progress)
        for f in still_bad:
            _discard(dest / f.path)  # a corrupt file never stays under its final name
        if still_bad:
            raise FetchError(
                f"{len(still_bad)} file(s) failed hash verification twice and were deleted: "
                + ", ".join(f.path for f in still_bad),
                hint="the hub, a proxy or the disk corrupts data; run the fetch again, and check HF_ENDPOINT "
                "if you use a mirror",
            )
        progress.finish()
        if not plan.source.subset:
            _check_index(plan)
        record = write_record(plan, state)
    linked = {f.path for f in fetched if f.status == "cached"}
    downloaded = {f.path for f in fetched} - linked | {f.path for f in failed}
    twice = {f.path for f in failed if f.path not in linked}
    return FetchResult(
        plan=plan,
        downloaded=tuple(sorted(downloaded)),
        reused=tuple(sorted({f.path for f in plan.files} - downloaded)),
        retried=tuple(sorted(twice)),
        orphans_removed=removed,
        record=record,
    )


@contextlib.contextmanager
def _folder_lock(dest: Path) -> Iterator[None]:
    def busy(pid: int | None) -> OutputError:
        hint = "wait for it to finish, or fetch elsewhere with --local-dir"
        return busy_error(OutputError, pid, command="prepkit fetch", target=dest, hint=hint)

    with exclusive(dest / LOCK_PATH, busy=busy):
        yield


def _state_for(plan: FetchPlan) -> FetchState:
    """The folder's state, brought to this plan: the hashes of files still planned are kept (the plan
    has compared them with the hub's)."""
    source, state = plan.source, FetchState.load(plan.dest)
    planned = {f.path: f.remote for f in plan.files}
    if state is None or (state.repo_id, state.commit) != (source.repo_id, plan.commit):
        kept = {p: v for p, v in state.verified.items() if p in planned} if state else {}
        state = FetchState(plan.dest, source.repo_id, source.revision, plan.commit, False, [], kept)
    known = {f.path for f in state.files}
    state.files += [r for p, r in planned.items() if p not in known]
    state.revision = source.revision
    state.include_original = state.include_original or plan.include_original
    if not plan.offline:
        state.save()
    return state


def _check(state: FetchState, files: list[PlannedFile], max_workers: int) -> set[str]:
    """Hash ``files`` in parallel (hashlib lets go of the GIL); the paths that match the hub."""
    if not files:
        return set()
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(files)))) as pool:
        return {f.path for f, ok in zip(files, pool.map(lambda f: state.check(f.remote), files), strict=True) if ok}


def _download(
    plan: FetchPlan,
    state: FetchState,
    files: list[PlannedFile],
    force: bool,
    token: str | bool | None,
    max_workers: int,
    progress: hub.Progress,
) -> list[PlannedFile]:
    """Download ``files`` and verify them; those that fail verification."""
    if not files:
        return []
    where = {"cache_dir": plan.cache} if plan.cache is not None else {"local_dir": plan.dest}
    paths = [f.path for f in files]
    kwargs = {"where": where, "endpoint": plan.endpoint, "token": token, "max_workers": max_workers}
    hub.download(plan.source, plan.commit, paths, force=force, progress=progress, **kwargs)  # type: ignore[arg-type]
    absent = [p for p in paths if not (plan.dest / p).exists()]
    if absent:  # e.g. the hub went away mid-run, or huggingface_hub put its snapshot elsewhere
        hint = "run the same command again; finished files are kept"
        raise FetchError(f"the download of {', '.join(absent)} left nothing in {plan.dest}", hint=hint)
    good = _check(state, files, max_workers)
    return [f for f in files if f.path not in good]


def _discard(path: Path) -> None:
    """Delete a file that failed its check; in the cache the blob its link points to as well, so its
    bytes are not linked again under a hash they do not have."""
    if path.is_symlink():
        Path(os.path.realpath(path)).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _refuse_incomplete(plan: FetchPlan, todo: list[PlannedFile]) -> None:
    absent = [f.path for f in todo if f.status != "unverified"]
    if absent:
        listed = ", ".join(absent[:10]) + (f" and {len(absent) - 10} more" if len(absent) > 10 else "")
        raise FetchError(
            f"--offline: the snapshot in {plan.dest} is incomplete: {len(absent)} file(s) missing or of "
            f"the wrong size: {listed}",
            hint="run the same command without --offline to complete it",
        )


def _check_index(plan: FetchPlan) -> None:
    """Every shard the index names must be in the snapshot (and so verified by now)."""
    index_path = plan.dest / "model.safetensors.index.json"
    present = {f.path for f in plan.files}
    if "model.safetensors.index.json" not in present:
        return
    try:
        shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise FetchError(f"{index_path} is not a valid safetensors index: {err}") from err
    missing = [s for s in shards if s not in present]
    if missing:
        raise FetchError(
            f"model.safetensors.index.json names {len(missing)} shard(s) that {plan.source.repo_id} at "
            f"{plan.commit[:12]} does not have: {', '.join(missing)}",
            hint="the repo is incomplete at this revision; try another --revision",
        )
