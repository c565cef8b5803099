"""The fetch plan: the files to fetch with their hub sizes and hashes (listed online, or reused from
an earlier fetch offline), what the target folder already holds of each, and the disk it needs.
Planning writes nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prepkit import __version__
from prepkit.errors import FetchError
from prepkit.fetch.cache import (
    COMMIT_SHA,
    cached_commit,
    earlier_local_dir,
    hub_cache_dir,
    repo_cache_dir,
    snapshot_dir,
)
from prepkit.fetch.folder import find_orphans
from prepkit.fetch.hub_errors import hub_errors
from prepkit.fetch.record import read_fetch_record
from prepkit.fetch.source import REQUIRED, RemoteFile, Source
from prepkit.fetch.state import FetchState
from prepkit.fsutil import free_bytes


@dataclass(frozen=True)
class PlannedFile:
    remote: RemoteFile
    # "verified" | "unverified" (present, right size, not hashed yet) | "cached" (its blob is in the
    # hub cache, not yet linked into this snapshot) | "wrong-size" | "missing"
    status: str
    local_size: int = 0

    @property
    def path(self) -> str:
        return self.remote.path

    @property
    def need_bytes(self) -> int:
        """Extra disk bytes a download of this file takes (a stale copy is deleted first)."""
        if self.status in ("verified", "unverified", "cached"):
            return 0
        return max(self.remote.size - self.local_size, 0)


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
    orphan_bytes: int  # partial files of earlier runs, deleted before downloading

    @property
    def total_bytes(self) -> int:
        return sum(f.remote.size for f in self.files)

    @property
    def need_bytes(self) -> int:
        return sum(f.need_bytes for f in self.files)

    @property
    def download_bytes(self) -> int:
        return sum(f.remote.size for f in self.files if f.status in ("missing", "wrong-size"))

    @property
    def margin_bytes(self) -> int:
        # Room for huggingface_hub's metadata and filesystem slack; 1 % covers block rounding.
        return 64 * 2**20 + self.need_bytes // 100

    @property
    def fits(self) -> bool:
        return self.need_bytes + self.margin_bytes <= self.free_bytes + self.orphan_bytes

    def count(self, status: str) -> int:
        return sum(1 for f in self.files if f.status == status)

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.source.repo_id,
            "revision": self.source.revision,
            "commit": self.commit,
            "recipe": self.source.recipe,
            "dir": str(self.dest),
            "cache": str(self.cache) if self.cache else None,
            "endpoint": self.endpoint,
            "offline": self.offline,
            "include_original": self.include_original,
            "total_bytes": self.total_bytes,
            "download_bytes": self.download_bytes,
            "need_bytes": self.need_bytes,
            "free_bytes": self.free_bytes,
            "orphan_bytes": self.orphan_bytes,
            "fits": self.fits,
            "files": [{"path": f.path, "size": f.remote.size, "status": f.status} for f in self.files],
        }


def plan_fetch(
    source: Source,
    local_dir: Path | None = None,
    *,
    cache_dir: Path | None = None,
    include_original: bool = False,
    offline: bool = False,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> FetchPlan:
    """List the files to fetch with their hub sizes and hashes, and what the target already holds.

    The target is ``local_dir`` when given (a plain folder), else the hub cache (``cache_dir``, by
    default :func:`hub_cache_dir`): the snapshot folder of the resolved commit, where blobs already
    in the cache count as present. A model an earlier prepkit fetched into ``$PREPKIT_HOME/models``
    is completed there. Online this asks the hub for the commit and the file tree; offline it reuses
    the plan an earlier fetch stored. Nothing is written.

    Raises:
        FetchError: the repo or revision does not exist, access is denied, the hub is unreachable,
            no file matches, a required file is missing from the repo, or (offline) nothing was
            fetched into the target before.
    """
    from huggingface_hub import constants

    local = Path(local_dir).expanduser().resolve() if local_dir is not None else earlier_local_dir(source)
    cache = None if local is not None else Path(cache_dir or hub_cache_dir()).expanduser().resolve()
    offline = offline or bool(constants.HF_HUB_OFFLINE)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    include, exclude = source.patterns(include_original)
    if offline:
        commit, remote = _plan_offline(source, local, cache, include_original)
    else:
        commit, remote = _plan_online(source, endpoint=endpoint, token=token)
    dest = local if local is not None else snapshot_dir(cache, source.repo_id, commit)  # type: ignore[arg-type]
    selected = _select(remote, include, exclude)
    if not selected:
        raise FetchError(
            f"no file of {source.repo_id} at {commit[:12]} matches {include} (excluding {exclude})",
            hint="check --model and --include; a repo without safetensors shards cannot be prepared",
        )
    if source.recipe is not None and not source.subset:
        names = {f.path for f in selected}
        missing = [name for name in REQUIRED if name not in names]
        if missing:
            raise FetchError(
                f"{source.repo_id} at {commit[:12]} has no {', '.join(missing)}: it is not a "
                "transformers-format gpt-oss checkpoint",
                hint="check --model and --revision",
            )
    state = FetchState.load(dest)
    blobs = repo_cache_dir(cache, source.repo_id) / "blobs" if cache is not None else None
    files = tuple(_local_status(dest, f, state, blobs) for f in selected)
    return FetchPlan(
        source=source,
        commit=commit,
        dest=dest,
        files=files,
        endpoint=endpoint,
        cache=cache,
        offline=offline,
        include_original=include_original,
        free_bytes=free_bytes(dest),
        orphan_bytes=sum(size for _, size in find_orphans(dest, cache, source.repo_id)),
    )


def _select(files: Sequence[RemoteFile], include: list[str], exclude: list[str]) -> list[RemoteFile]:
    from huggingface_hub.utils import filter_repo_objects

    # huggingface_hub's own matcher, so patterns mean what they mean for `hf download`.
    chosen = filter_repo_objects(files, allow_patterns=include, ignore_patterns=exclude, key=lambda f: f.path)
    return sorted(chosen, key=lambda f: f.path)


def _plan_online(source: Source, *, endpoint: str, token: str | bool | None) -> tuple[str, list[RemoteFile]]:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint, token=token, library_name="prepkit", library_version=__version__)
    with hub_errors(source, endpoint, api=api, stage="listing"):
        if COMMIT_SHA.match(source.revision):
            commit = source.revision  # immutable: no need to resolve it
        else:
            sha = api.repo_info(source.repo_id, revision=source.revision).sha
            if not sha:
                raise FetchError(f"{endpoint} did not resolve {source.repo_id}@{source.revision} to a commit")
            commit = sha
        tree = list(api.list_repo_tree(source.repo_id, revision=commit, recursive=True))
    remote = []
    for entry in tree:
        if not isinstance(entry, RepoFile):
            continue
        lfs = entry.lfs
        remote.append(
            RemoteFile(
                path=entry.path,
                size=int(lfs.size if lfs is not None else entry.size),
                sha256=lfs.sha256 if lfs is not None else None,
                git_blob=None if lfs is not None else entry.blob_id,
            )
        )
    return commit, remote


def _plan_offline(
    source: Source, local: Path | None, cache: Path | None, include_original: bool
) -> tuple[str, list[RemoteFile]]:
    if local is not None:
        dest = local
    else:
        assert cache is not None
        commit = cached_commit(cache, source.repo_id, source.revision)
        if commit is None:
            raise FetchError(
                f"--offline: {source.repo_id}@{source.revision} is not in the Hugging Face cache {cache}",
                hint="run `prepkit fetch` once with network access, or give the folder it used with --local-dir",
            )
        dest = snapshot_dir(cache, source.repo_id, commit)
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


def _local_status(dest: Path, remote: RemoteFile, state: FetchState | None, blobs: Path | None) -> PlannedFile:
    path = dest / remote.path
    try:
        st = path.stat()
    except FileNotFoundError:
        # In the hub cache, the same bytes may already be a blob (another revision, or a broken link).
        if blobs is not None and remote.oid is not None:
            with contextlib.suppress(OSError):
                if (blobs / remote.oid).stat().st_size == remote.size:
                    return PlannedFile(remote, "cached", remote.size)
        return PlannedFile(remote, "missing")
    if st.st_size != remote.size:
        return PlannedFile(remote, "wrong-size", st.st_size)
    if state is not None and state.is_verified(remote, st):
        return PlannedFile(remote, "verified", st.st_size)
    return PlannedFile(remote, "unverified", st.st_size)
