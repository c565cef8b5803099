"""The download threads: each fetches one file through huggingface_hub (or links a blob the cache
already holds), verifies it, and retries it once when its hash does not match."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prepkit import __version__
from prepkit.fetch.cache import repo_cache_dir
from prepkit.fetch.hashing import HashMismatch, digest_file, hash_matches
from prepkit.fetch.hub_errors import hub_errors
from prepkit.fetch.plan import FetchPlan, PlannedFile
from prepkit.fetch.progress import Progress
from prepkit.fetch.source import RemoteFile
from prepkit.fetch.state import FetchState
from prepkit.fsutil import temp_path

logger = logging.getLogger(__name__)


class FileWorker:
    """Fetches and verifies one file; runs in worker threads."""

    def __init__(self, plan: FetchPlan, state: FetchState, progress: Progress, *, token: str | bool | None) -> None:
        self.plan = plan
        self.state = state
        self.progress = progress
        self.token = token

    def run(self, planned: PlannedFile) -> str:
        remote = planned.remote
        target = self.plan.dest / remote.path
        if planned.status == "cached":
            self._link_blob(remote, target)
        if planned.status in ("unverified", "cached"):
            if self._verify(remote, target):
                self.progress.done(remote)
                return "reused"
            logger.warning("%s: present but its hash does not match the hub; fetching it again", remote.path)
            self._discard(target)
        elif planned.status == "wrong-size":
            self._discard(target)
        if self.plan.offline:
            raise HashMismatch(remote.path, remote.oid or "?", "a different hash")
        for attempt in (1, 2):
            self._download(remote, force=attempt > 1)
            if self._verify(remote, target):
                return "downloaded" if attempt == 1 else "retried"
            # Remove it at once so a corrupt file never sits under its final name.
            self._discard(target)
            logger.warning("%s failed verification (attempt %d of 2)", remote.path, attempt)
        raise HashMismatch(remote.path, remote.oid or "?", "a different hash")

    def _blobs(self) -> Path | None:
        return repo_cache_dir(self.plan.cache, self.plan.source.repo_id) / "blobs" if self.plan.cache else None

    def _link_blob(self, remote: RemoteFile, target: Path) -> None:
        """Point the snapshot at a blob the cache already holds, the way huggingface_hub links them
        (a relative symlink); an existing or broken link is replaced."""
        blobs = self._blobs()
        assert blobs is not None and remote.oid is not None
        target.parent.mkdir(parents=True, exist_ok=True)
        link = temp_path(target)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blobs / remote.oid, target.parent))
        os.replace(link, target)

    def _discard(self, target: Path) -> None:
        """Delete a file that failed its check; in the cache its blob too, so the bad bytes are not
        linked again under a hash they do not have."""
        blobs = self._blobs()
        if blobs is not None and target.is_symlink():
            blob = Path(os.path.normpath(target.parent / os.readlink(target)))
            if blob.parent == blobs:
                blob.unlink(missing_ok=True)
        target.unlink(missing_ok=True)

    def _download(self, remote: RemoteFile, *, force: bool) -> None:
        from huggingface_hub import hf_hub_download

        source = self.plan.source
        where: dict[str, Any] = {"cache_dir": self.plan.cache} if self.plan.cache else {"local_dir": self.plan.dest}
        with hub_errors(source, self.plan.endpoint, stage="download", filename=remote.path):
            hf_hub_download(
                source.repo_id,
                remote.path,
                revision=self.plan.commit,
                endpoint=self.plan.endpoint,
                token=self.token,
                force_download=force,
                tqdm_class=self.progress.bar_for(remote),  # type: ignore[arg-type]
                library_name="prepkit",
                library_version=__version__,
                **where,
            )

    def _verify(self, remote: RemoteFile, target: Path) -> bool:
        try:
            st = target.stat()
        except FileNotFoundError:
            return False
        if st.st_size != remote.size:
            return False
        digest = digest_file(target, git_blob=remote.sha256 is None)
        if not hash_matches(remote, digest.sha256, digest.git_blob):
            return False
        self.state.mark(remote, digest, st)
        return True


def run_parallel(
    items: list[PlannedFile], fn: Callable[[PlannedFile], str], max_workers: int
) -> dict[str, str | Exception]:
    """Run ``fn`` over ``items`` on daemon threads: path -> result, or the exception it raised.

    Daemon threads, not a ThreadPoolExecutor: on Ctrl-C the main thread must be able to leave at once
    (an executor joins its threads at exit, i.e. waits for multi-GB transfers). The partial files
    left by an interrupted download are removed by the next run.
    """
    todo: queue.Queue[PlannedFile] = queue.Queue()
    for item in items:
        todo.put(item)
    done: queue.Queue[tuple[str, str | Exception]] = queue.Queue()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((item.path, fn(item)))
            except Exception as err:  # handed to the main thread, which decides
                if not isinstance(err, HashMismatch):
                    stop.set()  # a hub, network or disk error: start nothing new
                done.put((item.path, err))

    count = max(1, min(max_workers, len(items)))
    threads = [threading.Thread(target=loop, daemon=True, name=f"prepkit-fetch-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    results: dict[str, str | Exception] = {}
    try:
        while any(t.is_alive() for t in threads) or not done.empty():
            with contextlib.suppress(queue.Empty):
                path, result = done.get(timeout=0.2)
                results[path] = result
    except BaseException:
        stop.set()
        raise
    return results
