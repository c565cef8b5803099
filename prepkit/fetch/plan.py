"""The fetch plan: the files with their hub sizes and hashes (listed online; offline, those of the
record of an earlier fetch), what the target holds of each, and the disk it needs. Writes nothing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prepkit.constants import FETCH_RECORD
from prepkit.errors import FetchError
from prepkit.fetch import hub
from prepkit.fetch.cache import hub_cache_dir, snapshot_dir
from prepkit.fetch.record import STATE_PATH, RecordFile, read_record
from prepkit.fetch.source import REQUIRED, RemoteFile, Source
from prepkit.fsutil import free_bytes

# Hashed by an earlier run | present, to hash | in the cache from another commit, to link. Not held:
HELD = ("verified", "unverified", "cached")  # "wrong-size", "missing", "forced" (--force-download)


@dataclass(frozen=True)
class PlannedFile:
    remote: RemoteFile
    status: str
    local_size: int = 0
    entry: RecordFile | None = None  # what an earlier run verified, for a "verified" file

    @property
    def path(self) -> str:
        return self.remote.path


@dataclass(frozen=True)
class FetchPlan:
    source: Source
    commit: str
    dest: Path
    files: tuple[PlannedFile, ...]
    endpoint: str
    cache: Path | None  # the hub cache when ``dest`` is one of its snapshots; None for a plain folder
    offline: bool
    include_original: bool
    free_bytes: int
    force: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.remote.size for f in self.files)

    @property
    def download_bytes(self) -> int:
        return sum(f.remote.size for f in self.files if f.status not in HELD)

    @property
    def need_bytes(self) -> int:  # a stale copy is deleted before its download
        return sum(max(f.remote.size - f.local_size, 0) for f in self.files if f.status not in HELD)

    @property
    def margin_bytes(self) -> int:  # the library's metadata and filesystem slack
        return 64 * 2**20 + self.need_bytes // 100

    @property
    def fits(self) -> bool:
        return self.need_bytes + self.margin_bytes <= self.free_bytes


def plan_fetch(
    source: Source,
    local_dir: Path | None = None,
    *,
    cache_dir: Path | None = None,
    include_original: bool = False,
    offline: bool = False,
    force: bool = False,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> FetchPlan:
    """Plan a fetch into ``local_dir``, else the commit's snapshot in the hub cache. Offline (also under
    HF_HUB_OFFLINE) the hub's list is an earlier fetch's record.

    Raises:
        FetchError: no such repo or revision, no access, no hub, no matching or required file, or
            (offline) no fetch completed there.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import filter_repo_objects

    local = Path(local_dir).expanduser().resolve() if local_dir else None
    cache = None if local is not None else Path(cache_dir or hub_cache_dir()).expanduser().resolve()
    offline = offline or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    if offline and force:
        raise FetchError("--force-download needs the hub, and --offline or HF_HUB_OFFLINE=1 says not to ask it")
    if offline:
        dest = local or snapshot_dir(cache, source.repo_id, source.revision)  # type: ignore[arg-type]
        record = read_record(dest / FETCH_RECORD)
        if record is None or not record.matches(source) or (include_original and not record.include_original):
            what = "with original/ " if record and record.matches(source) else ""
            raise FetchError(
                f"--offline: no earlier fetch of {source.repo_id}@{source.revision} {what}completed in {dest}",
                hint="run `prepkit fetch` once with network access (it reuses the files already there), "
                "or give the folder it used with --local-dir",
            )
        commit, remote = record.commit, record.files
    else:
        commit, remote = hub.list_remote(source, endpoint=endpoint, token=token, cache=cache)
        dest = local or snapshot_dir(cache, source.repo_id, commit)  # type: ignore[arg-type]
    # huggingface_hub's own matcher: patterns mean what they mean for `hf download`.
    include, exclude = source.patterns(include_original)
    selected = list(filter_repo_objects(remote, allow_patterns=include, ignore_patterns=exclude, key=lambda f: f.path))
    names = {f.path for f in selected}
    lacking = [n for n in REQUIRED if n not in names] if source.recipe and not source.subset else []
    if not selected or lacking:
        what = f"no {', '.join(lacking)}: not a transformers-format gpt-oss checkpoint" if selected else "no file"
        hint = "check the repo id, --revision and --include"
        raise FetchError(f"{source.repo_id} at {commit[:12]} has {what} (files: {list(source.include)})", hint=hint)
    known = _verified_before(dest, source)
    files = [_status(dest, f, known.get(f.path), force) for f in selected]
    absent = [f.path for f in files if f.status == "missing"]
    if cache is not None and absent and not offline:  # the library links these, not downloads them
        kw = {"cache_dir": cache, "token": token, "dry_run": True}
        infos = hub.snapshot(source, commit, absent, endpoint=endpoint, progress=hub.Progress(None, 0), **kw)
        held = {i.filename for i in infos if not i.will_download}
        files = [PlannedFile(f.remote, "cached") if f.path in held else f for f in files]
    return FetchPlan(
        source, commit, dest, tuple(files), endpoint, cache, offline, include_original, free_bytes(dest), force
    )


def _verified_before(dest: Path, source: Source) -> dict[str, RecordFile]:
    """The entries of the state and record of earlier runs (the record wins); of another commit too, as
    an entry counts only while its hash is the hub's and the file is untouched."""
    known: dict[str, RecordFile] = {}
    for path in (dest / STATE_PATH, dest / FETCH_RECORD):
        try:
            record = read_record(path)
        except FetchError:
            continue  # unreadable: its files are hashed again
        if record is not None and record.repo_id == source.repo_id:
            known |= {e.path: e for e in record.entries}
    return known


def _status(dest: Path, remote: RemoteFile, entry: RecordFile | None, force: bool) -> PlannedFile:
    try:
        st = (dest / remote.path).stat()
    except OSError:  # absent, or a link to a blob that is gone
        return PlannedFile(remote, "forced" if force else "missing")
    if force or st.st_size != remote.size:
        return PlannedFile(remote, "forced" if force else "wrong-size", st.st_size)
    if entry is not None and entry.mtime_ns == st.st_mtime_ns and entry.matches(remote):
        return PlannedFile(remote, "verified", st.st_size, entry)
    return PlannedFile(remote, "unverified", st.st_size)
