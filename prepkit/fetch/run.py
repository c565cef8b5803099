"""One fetch, under the folder's lock: hash what is there, let huggingface_hub download the rest,
verify it (a file that fails is downloaded once more), check the index, write the record."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from prepkit import __version__
from prepkit.constants import FETCH_RECORD, INDEX_NAME
from prepkit.errors import FetchError, OutputError
from prepkit.fetch import hub, record
from prepkit.fetch.plan import FetchPlan, PlannedFile
from prepkit.fetch.record import STATE_PATH, FetchRecord
from prepkit.fsutil import format_bytes
from prepkit.locks import busy_error, exclusive

LOCK_PATH = Path(".cache") / "prepkit" / "fetch.lock"


@dataclass(frozen=True)
class FetchResult:
    plan: FetchPlan
    downloaded: tuple[str, ...]  # fetched from the hub in this run
    reused: tuple[str, ...]  # already there (or in the cache) and verified
    retried: tuple[str, ...]  # failed verification once, fetched again, then passed
    record: FetchRecord


def fetch(
    plan: FetchPlan, *, token: str | bool | None = None, max_workers: int = 4, on_progress: hub.ProgressFn | None = None
) -> FetchResult:
    """Bring ``plan.dest`` to the planned snapshot, verify every file, and write the fetch record.

    Raises:
        FetchError: no disk space, a hub, network or disk error, a file failing verification twice,
            an incomplete index, or (offline) files missing or failing verification.
        OutputError: another fetch holds the folder.
    """
    dest, progress, lock = plan.dest, hub.Progress(on_progress, plan.download_bytes), threading.Lock()
    entries = {f.path: f.entry for f in plan.files if f.entry is not None}

    def save(path: Path) -> FetchRecord:  # the record, or (at STATE_PATH) what is verified so far
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        head = (plan.source.repo_id, plan.source.revision, plan.commit, plan.endpoint, plan.source.recipe)
        done = tuple(entries[f.path] for f in plan.files if f.path in entries)
        (saved := FetchRecord(path, *head, plan.include_original, now, __version__, done)).save()
        return saved

    def check(files: list[PlannedFile]) -> list[PlannedFile]:
        """Hash ``files`` in parallel (hashlib lets go of the GIL); those that fail."""

        def verify(f: PlannedFile) -> bool:
            entry = record.verify_file(dest, f.remote)
            with lock:
                if entry is not None:
                    entries[f.path] = entry
                    save(dest / STATE_PATH)
            return entry is not None

        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            return [f for f, ok in zip(files, pool.map(verify, files), strict=True) if not ok]

    def download(files: list[PlannedFile], *, force: bool) -> list[PlannedFile]:
        """Download ``files`` and verify them; those that fail."""
        if not files:
            return []
        where = {"cache_dir": plan.cache} if plan.cache is not None else {"local_dir": dest}
        paths = [f.path for f in files]
        kw = {"force_download": force, "token": token, "max_workers": max_workers, **where}
        hub.snapshot(plan.source, plan.commit, paths, endpoint=plan.endpoint, progress=progress, **kw)
        if absent := [p for p in paths if not (dest / p).exists()]:  # e.g. the library moved its layout
            raise FetchError(f"the download of {', '.join(absent)} left nothing in {dest}", hint=hub.AGAIN)
        return check(files)

    dest.mkdir(parents=True, exist_ok=True)
    hint = "wait for it to finish, or fetch elsewhere with --local-dir"
    busy = lambda pid: busy_error(OutputError, pid, command="prepkit fetch", target=dest, hint=hint)  # noqa: E731
    with exclusive(dest / LOCK_PATH, busy=busy):
        for temp in [*dest.glob(f"{FETCH_RECORD}.tmp-*"), *(dest / STATE_PATH.parent).glob("*.tmp-*")]:
            temp.unlink(missing_ok=True)  # of a killed run: the lock says no live run owns them
        if not plan.fits:
            raise FetchError(
                f"not enough disk space in {dest}: {format_bytes(plan.need_bytes)} to download + "
                f"{format_bytes(plan.margin_bytes)} margin, {format_bytes(plan.free_bytes)} free",
                hint="free some space, or fetch elsewhere with --local-dir DIR or --cache-dir DIR",
            )
        todo = [f for f in plan.files if f.status != "verified"]
        if todo:  # until every file is verified again, the folder must not look complete
            (dest / FETCH_RECORD).unlink(missing_ok=True)
            save(dest / STATE_PATH)
        stale = check([f for f in todo if f.status == "unverified"]) + [f for f in todo if f.status == "wrong-size"]
        for f in stale:
            _discard(dest / f.path)  # else the library keeps it: it checks names, not bytes
        fetched = stale + [f for f in todo if f.status not in ("unverified", "wrong-size")]
        if plan.offline and fetched:
            raise FetchError(
                f"--offline: the snapshot in {dest} is incomplete: {len(fetched)} file(s) missing, of the wrong size, "
                f"or that do not match the hub's hashes (deleted): {', '.join(f.path for f in fetched)}",
                hint="run the same command without --offline to fetch them again",
            )
        failed = download(fetched, force=plan.force)
        if still_bad := download(failed, force=True):
            for f in still_bad:
                _discard(dest / f.path)  # a corrupt file never stays under its final name
            raise FetchError(
                f"{len(still_bad)} file(s) failed hash verification twice and were deleted: "
                + ", ".join(f.path for f in still_bad),
                hint="the hub, a proxy or the disk corrupts data; run the fetch again (check HF_ENDPOINT for a mirror)",
            )
        progress.advance(progress.total)
        if not plan.source.subset:
            _check_index(plan)
        final = save(dest / FETCH_RECORD)
    linked = {f.path for f in fetched if f.status == "cached"}
    downloaded = {f.path for f in fetched} - linked | {f.path for f in failed}
    reused, retried = {f.path for f in plan.files} - downloaded, {f.path for f in failed} - linked
    return FetchResult(plan, tuple(sorted(downloaded)), tuple(sorted(reused)), tuple(sorted(retried)), final)


def _discard(path: Path) -> None:
    """Delete a file that failed its check, and in the cache the blob it links to (not to be relinked)."""
    if path.is_symlink():
        Path(os.path.realpath(path)).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _check_index(plan: FetchPlan) -> None:
    """Every shard the index names must be in the snapshot (and so verified by now)."""
    present = {f.path for f in plan.files}
    if INDEX_NAME not in present:
        return
    try:
        shards = sorted(set(json.loads((plan.dest / INDEX_NAME).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise FetchError(f"{plan.dest / INDEX_NAME} is not a valid safetensors index: {err}") from err
    if missing := [s for s in shards if s not in present]:
        raise FetchError(
            f"{INDEX_NAME} names {len(missing)} shard(s) that {plan.source.repo_id} at {plan.commit[:12]} does not "
            f"have: {', '.join(missing)}",
            hint="the repo is incomplete at this revision; try another --revision",
        )
