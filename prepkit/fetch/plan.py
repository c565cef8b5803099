"""The fetch plan: the files to fetch with their hub sizes and hashes (listed online, or those of an
earlier fetch offline), what the target already holds of each, and the disk it needs. Writes nothing."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prepkit.errors import FetchError
from prepkit.fetch import hub
from prepkit.fetch.cache import cached_snapshot, earlier_local_dir, find_model_dir, hub_cache_dir, snapshot_path
from prepkit.fetch.record import read_fetch_record
from prepkit.fetch.source import REQUIRED, RemoteFile, Source
from prepkit.fetch.state import FetchState
from prepkit.fsutil import free_bytes

# "verified" (hashed by an earlier run, untouched since) | "unverified" (present, hub's size) | "cached"
# (the hub cache holds its bytes from another commit: linked, not downloaded) | "wrong-size" | "missing"
# | "forced" (--force-download)
HELD = ("verified", "unverified", "cached")


@dataclass(frozen=True)
class PlannedFile:
    remote: RemoteFile
    status: str
    local_size: int = 0

    @property
    def path(self) -> str:
        return self.remote.path

    @property
    def need_bytes(self) -> int:
        """Extra disk bytes its download takes (a stale copy is deleted first)."""
        return 0 if self.status in HELD else max(self.remote.size - self.local_size, 0)


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
    orphans: tuple[tuple[Path, int], ...]  # partial files of killed runs, removed before downloading
    force: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.remote.size for f in self.files)

    @property
    def need_bytes(self) -> int:
        return sum(f.need_bytes for f in self.files)

    @property
    def download_bytes(self) -> int:
        return sum(f.remote.size for f in self.files if f.status not in HELD)

    @property
    def orphan_bytes(self) -> int:
        return sum(size for _, size in self.orphans)

    @property
    def margin_bytes(self) -> int:
        # Room for huggingface_hub's metadata and filesystem slack; 1 % covers block rounding.
        return 64 * 2**20 + self.need_bytes // 100

    @property
    def fits(self) -> bool:
        return self.need_bytes + self.margin_bytes <= self.free_bytes + self.orphan_bytes

    def count(self, *statuses: str) -> int:
        return sum(1 for f in self.files if f.status in statuses)

    def to_json(self) -> dict[str, Any]:
        keys = ("commit", "endpoint", "offline", "include_original", "total_bytes", "download_bytes", "need_bytes")
        return {
            "repo_id": self.source.repo_id,
            "revision": self.source.revision,
            "recipe": self.source.recipe,
            "dir": str(self.dest),
            "cache": str(self.cache) if self.cache else None,
            **{k: getattr(self, k) for k in (*keys, "free_bytes", "orphan_bytes", "fits", "force")},
            "files": [{"path": f.path, "size": f.remote.size, "status": f.status} for f in self.files],
        }


def offline_env() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "").upper()
    return constants.is_offline_mode() or value in {"1", "ON", "YES", "TRUE"}


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
    """List the files to fetch with their hub sizes and hashes, and what the target already holds.

    The target is ``local_dir`` when given (a plain folder), else the snapshot of the resolved commit
    in the hub cache (``cache_dir``, by default :func:`hub_cache_dir`). A model an earlier prepkit
    fetched into ``$PREPKIT_HOME/models`` is completed there. Online this asks the hub for the commit
    and the file tree; offline (also under HF_HUB_OFFLINE) it reuses the list of an earlier fetch.

    Raises:
        FetchError: the repo or revision does not exist, access is denied, the hub is unreachable,
            no file matches, a required file is missing from the repo, or (offline) nothing was
            fetched into the target before.
    """
    from huggingface_hub import constants

    earlier = earlier_local_dir(source.repo_id, source.revision)
    local = Path(local_dir).expanduser().resolve() if local_dir is not None else earlier
    cache = None if local is not None else Path(cache_dir or hub_cache_dir()).expanduser().resolve()
    offline = offline or offline_env()
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    if offline:
        dest = local or find_model_dir(source.repo_id, source.revision, cache=cache)
        commit, remote = _listed_before(source, dest, include_original)
    else:
        commit, remote = hub.list_remote(source, endpoint=endpoint, token=token, cache=cache)
        snapshot = None if cache is None else cached_snapshot(source.repo_id, commit, cache=cache)
        dest = local or snapshot or snapshot_path(cache, source.repo_id, commit)  # type: ignore[arg-type]
    selected = _select(remote, *source.patterns(include_original))
    if not selected:
        raise FetchError(
            f"no file of {source.repo_id} at {commit[:12]} matches {list(source.include)}",
            hint="check the repo id and --include; a repo without safetensors shards cannot be prepared",
        )
    missing = [name for name in REQUIRED if name not in {f.path for f in selected}]
    if source.recipe is not None and not source.subset and missing:
        raise FetchError(
            f"{source.repo_id} at {commit[:12]} has no {', '.join(missing)}: it is not a transformers-format "
            "gpt-oss checkpoint",
            hint="check the repo id and --revision",
        )
    state = FetchState.load(dest)
    files = [_local_status(dest, f, state, force) for f in selected]
    absent = [f.path for f in files if f.status == "missing"]
    if cache is not None and absent and not offline and not force:
        linked = hub.in_store(source, commit, absent, cache=cache, endpoint=endpoint, token=token)
        files = [PlannedFile(f.remote, "cached") if f.path in linked else f for f in files]
    return FetchPlan(
        source=source,
        commit=commit,
        dest=dest,
        files=tuple(files),
        endpoint=endpoint,
        cache=cache,
        offline=offline,
        include_original=include_original,
        free_bytes=free_bytes(dest),
        orphans=tuple(hub.find_orphans(dest, cache, selected)),
        force=force,
    )


def _select(files: Sequence[RemoteFile], include: list[str], exclude: list[str]) -> list[RemoteFile]:
    from huggingface_hub.utils import filter_repo_objects

    # huggingface_hub's own matcher, so patterns mean what they mean for `hf download`.
    chosen = filter_repo_objects(files, allow_patterns=include, ignore_patterns=exclude, key=lambda f: f.path)
    return sorted(chosen, key=lambda f: f.path)


def _listed_before(source: Source, dest: Path, include_original: bool) -> tuple[str, list[RemoteFile]]:
    """Offline, the hub's list is the one an earlier fetch into ``dest`` stored."""
    state = FetchState.load(dest)
    if state is not None and state.matches(source):
        if include_original and not state.include_original:
            raise FetchError(
                f"the earlier fetch into {dest} did not include original/, and --offline cannot list it",
                hint="run once without --offline to add original/",
            )
        return state.commit, list(state.files)
    record = read_fetch_record(dest)
    if record is not None and record.matches(source):
        return record.commit, list(record.files)
    raise FetchError(
        f"--offline: no earlier fetch of {source.repo_id}@{source.revision} in {dest}",
        hint="run `prepkit fetch` once with network access (it reuses the files already there), "
        "or give the folder it used with --local-dir",
    )


def _local_status(dest: Path, remote: RemoteFile, state: FetchState | None, force: bool) -> PlannedFile:
    try:
        size = (dest / remote.path).stat().st_size
    except OSError:  # absent, or a link to a blob that is gone
        return PlannedFile(remote, "forced" if force else "missing")
    if force:
        return PlannedFile(remote, "forced", size)
    if size != remote.size:
        return PlannedFile(remote, "wrong-size", size)
    return PlannedFile(remote, "verified" if state is not None and state.is_verified(remote) else "unverified", size)
