"""The hub side of a fetch, all through huggingface_hub's public API: the commit and file list, which
files the cache already holds, the download itself (parallelism, locks, atomic renames and the cache
layout are the library's), its progress, and the partial files a killed download leaves."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prepkit import __version__
from prepkit.errors import FetchError
from prepkit.fetch.hub_errors import hub_errors
from prepkit.fetch.source import RemoteFile, Source

COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
ProgressFn = Callable[[str, int, int], None]
TOTAL_LABEL = "all files"


def list_remote(
    source: Source, *, endpoint: str, token: str | bool | None, cache: Path | None
) -> tuple[str, list[RemoteFile]]:
    """The commit ``source.revision`` names and every file of the repo there, with size and hash. In
    the cache, a branch or tag gets its ref (so ``prepare --model`` and ``--offline`` find it)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint, token=token, library_name="prepkit", library_version=__version__)
    with hub_errors(source, endpoint, api=api):
        # repo_info first, even for a commit (then at the default branch: servers differ on unknown
        # commits): it fails at once without network, where the paged tree listing retries for 26 s.
        is_commit = COMMIT_SHA.fullmatch(source.revision) is not None
        commit = source.revision if is_commit else api.repo_info(source.repo_id, revision=source.revision).sha
        if is_commit:
            api.repo_info(source.repo_id)
        if not commit:
            raise FetchError(f"{endpoint} did not resolve {source.repo_id}@{source.revision} to a commit")
        if cache is not None and commit != source.revision:
            api.resolve_revision(source.repo_id, revision=source.revision, cache_dir=cache)
        tree = list(api.list_repo_tree(source.repo_id, revision=commit, recursive=True))
    files = []
    for e in tree:
        if isinstance(e, RepoFile):
            lfs = e.lfs
            size = int(lfs.size if lfs is not None else e.size)
            files.append(RemoteFile(e.path, size, lfs.sha256 if lfs else None, None if lfs else e.blob_id))
    return commit, files


def in_store(source: Source, commit: str, paths: list[str], *, cache: Path, endpoint: str, token: Any) -> set[str]:
    """Which of ``paths`` (absent from the snapshot) the cache holds already, from another commit:
    huggingface_hub links those instead of downloading them."""
    from huggingface_hub import snapshot_download

    with hub_errors(source, endpoint):
        infos = snapshot_download(
            source.repo_id, revision=commit, cache_dir=cache, allow_patterns=_exactly(paths), endpoint=endpoint,
            token=token, dry_run=True, tqdm_class=_Bar,
        )  # fmt: skip
    return {info.filename for info in infos if not isinstance(info, str) and not info.will_download}


def _exactly(paths: list[str]) -> list[str]:
    return [glob.escape(p) for p in paths]  # patterns that match these paths and nothing else


class Progress:
    """Bytes written by the download, reported as one total; also how a download is called off: every
    chunk written passes through :meth:`advance`, which raises once :attr:`cancel` is set."""

    def __init__(self, on_progress: ProgressFn | None, total: int) -> None:
        self.report = on_progress or (lambda label, done, total: None)
        self.total, self.done, self.base = total, 0, 0
        self.cancel = threading.Event()
        self.lock = threading.Lock()
        if total:
            self.report(TOTAL_LABEL, 0, total)

    def bar_class(self) -> type[_Bar]:
        self.base = self.done  # a new download starts new bars
        return type("ProgressBar", (_Bar,), {"owner": self})

    def advance(self, bar: _Bar) -> None:
        if self.cancel.is_set():
            raise _CalledOff
        with self.lock:
            self.done = max(self.done, min(self.total, self.base + bar.n))
            self.report(TOTAL_LABEL, self.done, self.total)

    def finish(self) -> None:
        if self.total:
            self.report(TOTAL_LABEL, self.total, self.total)


class _CalledOff(Exception):
    """Raised inside huggingface_hub's download threads to stop them (they delete their partial file)."""


class _Bar:
    """The part of tqdm huggingface_hub drives; draws nothing. Of its bars, those counting bytes feed
    :class:`Progress` (the byte bars move together; the highest is taken)."""

    owner: Progress | None = None
    format_dict: dict[str, Any] = {}

    def __init__(self, *args: Any, total: int | None = None, initial: int = 0, unit: str = "", **kwargs: Any) -> None:
        self.n, self.total, self.bytes = int(initial or 0), total, unit == "B"

    def update(self, n: float | None = 1) -> None:
        self.n += int(n or 0)
        if self.bytes and self.owner is not None:
            self.owner.advance(self)

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None  # refresh, close, set_postfix_str, set_description, ...

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def download(
    source: Source,
    commit: str,
    paths: list[str],
    *,
    where: dict[str, Path],
    force: bool,
    endpoint: str,
    token: str | bool | None,
    max_workers: int,
    progress: Progress,
) -> None:
    """``snapshot_download`` of exactly ``paths`` at ``commit`` into ``where`` (cache_dir or local_dir).

    It runs in a daemon thread so that Ctrl-C returns at once: the main thread then calls the
    download off, and each transfer stops at its next chunk, deleting its partial file."""
    from huggingface_hub import snapshot_download

    failure: list[BaseException] = []

    def run() -> None:
        try:
            snapshot_download(
                source.repo_id, revision=commit, allow_patterns=_exactly(paths), force_download=force,
                max_workers=max_workers, tqdm_class=progress.bar_class(), endpoint=endpoint, token=token,
                library_name="prepkit", library_version=__version__, **where,
            )  # fmt: skip
        except BaseException as err:  # handed to the main thread
            failure.append(err)

    thread = threading.Thread(target=run, daemon=True, name="prepkit-fetch")
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    except BaseException:
        progress.cancel.set()
        thread.join(15)
        raise
    if failure:
        with hub_errors(source, endpoint, filename=paths[0] if len(paths) == 1 else None):
            raise failure[0]


def find_orphans(dest: Path, cache: Path | None, files: list[RemoteFile]) -> list[tuple[Path, int]]:
    """Partial files of downloads killed before they could delete them (huggingface_hub never resumes
    them). In a plain folder, all under its ``.cache/huggingface`` (the fetch holds the folder). In the
    cache, those of the planned files only, as huggingface_hub's cache scan lists them, and only
    when idle for twice the library's read timeout: a live download writes more often than that."""
    if cache is None:
        root = dest / ".cache" / "huggingface"
        found = list(root.rglob("*.incomplete")) if root.is_dir() else []
    else:
        from huggingface_hub import constants, scan_cache_dir

        try:
            partial = scan_cache_dir(cache).incomplete_files
        except Exception:  # no cache yet, or one it cannot read: nothing of ours to clean
            return []
        oids = {f.oid for f in files}
        idle = time.time() - 2 * constants.HF_HUB_DOWNLOAD_TIMEOUT
        found = [p.file_path for p in partial if p.file_path.name.split(".")[0] in oids]
        found = [p for p in found if _mtime(p) < idle]
    return [(p, p.stat().st_size) for p in found if p.exists()]


def _mtime(path: Path) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return float("inf")


def remove_orphans(orphans: list[tuple[Path, int]]) -> int:
    removed = 0
    for path, _ in orphans:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed
