"""What a fetch keeps in its target folder besides the files: the lock (one fetch per folder), the
temp files of killed runs, the partial downloads of interrupted ones, and the cache's refs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from prepkit.constants import FETCH_RECORD
from prepkit.errors import OutputError
from prepkit.fetch.cache import HF_DOWNLOAD_DIR, LOCK_PATH, STATE_PATH, repo_cache_dir
from prepkit.fsutil import format_bytes, write_atomic
from prepkit.locks import busy_error, exclusive

logger = logging.getLogger(__name__)


def find_orphans(dest: Path, cache: Path | None, repo_id: str) -> list[tuple[Path, int]]:
    """Partial downloads an interrupted run left (huggingface_hub writes each under a new unique
    name and never resumes one): under a plain folder's download bookkeeping, or in the cache's
    blobs of this repo, skipping any whose download another process still holds the lock of."""
    if cache is None:
        root, pattern = dest / HF_DOWNLOAD_DIR, "**/*.incomplete"
    else:
        root, pattern = repo_cache_dir(cache, repo_id) / "blobs", "*.incomplete"
    if not root.is_dir():
        return []
    found = []
    for path in root.glob(pattern):
        if cache is not None and _download_in_progress(cache, repo_id, path):
            continue
        with contextlib.suppress(OSError):
            found.append((path, path.stat().st_size))
    return found


def _download_in_progress(cache: Path, repo_id: str, partial: Path) -> bool:
    """Whether a live process holds huggingface_hub's lock on the blob ``partial`` is becoming
    (``<etag>.<random>.incomplete`` under ``.locks/<repo folder>/<etag>.lock``)."""
    import filelock

    etag = partial.name.split(".", 1)[0]
    lock = filelock.FileLock(str(cache / ".locks" / repo_cache_dir(cache, repo_id).name / f"{etag}.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return True
    except OSError:
        return False  # no lock folder (never locked) or not writable: nobody downloads here
    lock.release()
    return False


def remove_orphans(dest: Path, cache: Path | None, repo_id: str) -> int:
    removed = 0
    for path, size in find_orphans(dest, cache, repo_id):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
            logger.info("removed partial file of an interrupted run: %s (%s)", path.name, format_bytes(size))
    return removed


@contextlib.contextmanager
def folder_lock(dest: Path) -> Iterator[None]:
    """One fetch per folder: the orphan cleanup would delete another run's in-flight partial files."""

    def busy(pid: int | None) -> OutputError:
        hint = "wait for it to finish, or fetch elsewhere with --local-dir"
        # busy is exit 3 for every command that writes a folder or DB
        return busy_error(OutputError, pid, command="prepkit fetch", target=dest, hint=hint)

    with exclusive(dest / LOCK_PATH, busy=busy):
        yield


def remove_own_temps(dest: Path, cache: Path | None, repo_id: str) -> None:
    """Temp files of the record, the state and the ref a killed fetch left; called under the folder
    lock, so none of them belongs to a live run."""
    patterns = [(dest, f"{FETCH_RECORD}.tmp-*"), (dest / STATE_PATH.parent, "*.tmp-*")]
    if cache is not None:
        patterns.append((repo_cache_dir(cache, repo_id) / "refs", "**/*.tmp-*"))
    for folder, pattern in patterns:
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)


def write_ref(cache: Path, repo_id: str, revision: str, commit: str) -> None:
    """``refs/<revision>`` names the commit, as huggingface_hub writes it (no newline), so that
    ``prepare --model`` and ``fetch --offline`` find the snapshot of a branch or tag."""
    if revision == commit:
        return
    ref = repo_cache_dir(cache, repo_id) / "refs" / revision
    with contextlib.suppress(OSError):
        if ref.read_text() == commit:
            return
    write_atomic(ref, [commit.encode()])
