"""One fetch run: bring the target folder to the planned snapshot under its lock, verify every
file, check the index is complete, and write the fetch record."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prepkit.constants import FETCH_RECORD
from prepkit.errors import FetchError
from prepkit.fetch.folder import folder_lock, remove_orphans, remove_own_temps, write_ref
from prepkit.fetch.hashing import HashMismatch
from prepkit.fetch.plan import FetchPlan
from prepkit.fetch.progress import Progress, ProgressFn
from prepkit.fetch.record import FetchRecord, write_record
from prepkit.fetch.state import FetchState
from prepkit.fetch.worker import FileWorker, run_parallel
from prepkit.fsutil import format_bytes


@dataclass(frozen=True)
class FetchResult:
    plan: FetchPlan
    downloaded: tuple[str, ...]  # fetched from the hub in this run
    reused: tuple[str, ...]  # already present and verified (by hash now, or by an earlier run)
    retried: tuple[str, ...]  # failed verification once, fetched again and then passed
    orphans_removed: int
    record: FetchRecord

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.plan.source.repo_id,
            "revision": self.plan.source.revision,
            "commit": self.plan.commit,
            "dir": str(self.plan.dest),
            "record": str(self.record.path),
            "total_bytes": self.plan.total_bytes,
            "downloaded": list(self.downloaded),
            "downloaded_bytes": sum(f.remote.size for f in self.plan.files if f.path in set(self.downloaded)),
            "reused": list(self.reused),
            "retried": list(self.retried),
            "orphans_removed": self.orphans_removed,
            "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in self.record.entries],
        }


def fetch(
    plan: FetchPlan,
    *,
    token: str | bool | None = None,
    max_workers: int = 4,
    on_progress: ProgressFn | None = None,
) -> FetchResult:
    """Bring ``plan.dest`` to the planned snapshot, verify every file, and write the fetch record.

    Files already verified are never downloaded again. A file that fails its hash check is deleted
    and downloaded once more; if it fails again it is deleted and reported.

    Raises:
        FetchError: not enough disk space (checked first), another fetch holds the folder, a hub or
            network error, disk full, a file that failed verification twice, a shard named by the
            index that is not in the snapshot, or (offline) files that are missing or fail verification.
    """
    dest = plan.dest
    dest.mkdir(parents=True, exist_ok=True)
    repo_id = plan.source.repo_id
    with folder_lock(dest):
        remove_own_temps(dest, plan.cache, repo_id)
        removed = remove_orphans(dest, plan.cache, repo_id)
        if not plan.fits:
            raise FetchError(
                f"not enough disk space in {dest}: {format_bytes(plan.need_bytes)} to download "
                f"+ {format_bytes(plan.margin_bytes)} margin, {format_bytes(plan.free_bytes + plan.orphan_bytes)} free",
                hint="free some space, or fetch elsewhere with --local-dir DIR or --cache-dir DIR",
            )
        if plan.cache is not None and not plan.offline:
            write_ref(plan.cache, repo_id, plan.source.revision, plan.commit)
        state = FetchState.load(dest)
        if state is None or state.commit != plan.commit or state.repo_id != plan.source.repo_id:
            # A new commit: keep the hashes of files still planned; the plan compared them already.
            planned = {f.path for f in plan.files}
            kept = {p: v for p, v in state.verified.items() if p in planned} if state else {}
            state = FetchState(
                dest,
                plan.source.repo_id,
                plan.source.revision,
                plan.commit,
                plan.include_original,
                [f.remote for f in plan.files],
                kept,
            )
        else:
            state.revision = plan.source.revision
            known = {f.path for f in state.files}
            state.files += [f.remote for f in plan.files if f.path not in known]
            state.include_original = state.include_original or plan.include_original
        if not plan.offline:
            state.save()
        if any(f.status != "verified" for f in plan.files):
            # The folder is about to change: until every file is verified again it must not look complete.
            (dest / FETCH_RECORD).unlink(missing_ok=True)
        if plan.offline:
            _refuse_incomplete_offline(plan)
        progress = Progress(on_progress, plan)
        worker = FileWorker(plan, state, progress, token=token)
        results = run_parallel([f for f in plan.files if f.status != "verified"], worker.run, max_workers)
        errors = [r for r in results.values() if isinstance(r, Exception)]
        mismatched = [err for err in errors if isinstance(err, HashMismatch)]
        others = [err for err in errors if not isinstance(err, HashMismatch)]
        if others:
            raise others[0]
        if mismatched and plan.offline:
            names = ", ".join(sorted(err.path for err in mismatched))
            raise FetchError(
                f"--offline: {len(mismatched)} file(s) in {dest} do not match the hub's hashes and were "
                f"deleted: {names}",
                hint="run the same command without --offline to fetch them again",
            )
        if mismatched:
            names = ", ".join(sorted(err.path for err in mismatched))
            raise FetchError(
                f"{len(mismatched)} file(s) failed hash verification twice and were deleted: {names}",
                hint="the hub, a proxy or the disk corrupts data; run the fetch again, and check "
                "HF_ENDPOINT if you use a mirror",
            )
        if not plan.source.subset:
            _check_index(plan)
        record = write_record(plan, state)
    verified_before = [f.path for f in plan.files if f.status == "verified"]
    return FetchResult(
        plan=plan,
        downloaded=tuple(sorted(p for p, r in results.items() if r in ("downloaded", "retried"))),
        reused=tuple(sorted(verified_before + [p for p, r in results.items() if r == "reused"])),
        retried=tuple(sorted(p for p, r in results.items() if r == "retried")),
        orphans_removed=removed,
        record=record,
    )


def _refuse_incomplete_offline(plan: FetchPlan) -> None:
    absent = [f.path for f in plan.files if f.status in ("missing", "wrong-size")]
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
    if not any(f.path == "model.safetensors.index.json" for f in plan.files):
        return
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise FetchError(f"{index_path} is not a valid safetensors index: {err}") from err
    present = {f.path for f in plan.files}
    missing = [s for s in shards if s not in present]
    if missing:
        raise FetchError(
            f"model.safetensors.index.json names {len(missing)} shard(s) that {plan.source.repo_id} at "
            f"{plan.commit[:12]} does not have: {', '.join(missing)}",
            hint="the repo is incomplete at this revision; try another --revision",
        )
