"""Download a checkpoint from the Hugging Face hub: only the files ``prepare`` needs, each one
checked against the hub's hashes, plus a fetch record that ``prepare`` cites as provenance.

huggingface_hub moves the bytes (``hf_hub_download``); this module adds what it leaves out for a
61 GiB download: a plan with a free-disk check, verification of every file (sha256 for LFS files,
the git blob id for small ones; the library only compares sizes), one retry of a file that fails
it, reuse of copies already on disk, cleanup of the partial files an interrupted run leaves behind
(huggingface_hub 2.x never resumes them), and a completeness check against the index.

Where the files go, by default the Hugging Face cache, huggingface_hub's own layout (so a model
already fetched with ``hf download`` is reused, and one fetched here is reused by everything that
reads the cache)::

    $HF_HUB_CACHE/models--<org>--<name>/blobs/<sha256 or git blob id>   the bytes
    $HF_HUB_CACHE/models--<org>--<name>/snapshots/<commit>/<repo path>   links to the blobs
    .../snapshots/<commit>/prepkit-fetch.json                             written last, when all is verified
    .../snapshots/<commit>/.cache/prepkit/fetch-state.json                plan + per-file verification

With ``--local-dir DIR`` (or a folder fetched by an earlier prepkit into ``$PREPKIT_HOME/models``) the
files are plain files at their repo paths in DIR, with the same record and state beside them and
huggingface_hub's bookkeeping under ``DIR/.cache/huggingface/``. Files already there (from ``hf
download --local-dir DIR``, say) are hashed and kept when they match.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from prepkit import __version__
from prepkit.constants import FETCH_RECORD, INDEX_NAME
from prepkit.errors import FetchError, OutputError, RecipeError
from prepkit.fsutil import format_bytes, free_bytes, write_atomic, write_json_atomic
from prepkit.locks import exclusive

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]

RECORD_FORMAT = "prepkit-fetch/1"
STATE_FORMAT = "prepkit-fetch-state/1"
STATE_PATH = Path(".cache") / "prepkit" / "fetch-state.json"
LOCK_PATH = Path(".cache") / "prepkit" / "fetch.lock"
HF_DOWNLOAD_DIR = Path(".cache") / "huggingface" / "download"
TOTAL_LABEL = "all files"
REWRITE_HINT = "run `prepkit fetch` again to rewrite it"

# Used for an ORG/REPO without a recipe; recipes carry their own lists (recipes/*.json "fetch").
DEFAULT_INCLUDE = (
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
DEFAULT_EXCLUDE = ("original/*", "metal/*")
DEFAULT_ORIGINAL = ("original/*",)
# metal/model.bin is a third copy of the weights (65 GB, Xet-only); nothing here reads it.
NEVER = ("metal/*",)
# Files prepare cannot do without; a repo lacking them is refused before anything is downloaded.
REQUIRED = ("config.json", "model.safetensors.index.json")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_HASH_CHUNK = 8 * 1024 * 1024


class RecipeLike(Protocol):
    repo_id: str
    revision: str


# --------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """What to fetch: a hub repo, the revision to pin, and which files."""

    repo_id: str
    revision: str
    recipe: str | None = None
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    original: tuple[str, ...] = DEFAULT_ORIGINAL
    subset: bool = False  # the user chose the files (--include): no completeness checks

    def narrowed(self, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> Source:
        """``--include`` replaces the recipe's file list (as for ``hf download``); ``--exclude`` adds
        to its exclusions. metal/ stays excluded whatever is asked."""
        if not include and not exclude:
            return self
        return replace(
            self,
            include=tuple(include) or self.include,
            exclude=self.exclude + tuple(p for p in exclude if p not in self.exclude),
            subset=self.subset or bool(include),
        )

    def patterns(self, include_original: bool) -> tuple[list[str], list[str]]:
        include = list(self.include) + (list(self.original) if include_original else [])
        exclude = [p for p in self.exclude if not (include_original and p in self.original)]
        return include, exclude + [p for p in NEVER if p not in exclude]


def resolve_source(model: str, *, revision: str | None = None) -> Source:
    """``gpt-oss-120b`` / ``openai/gpt-oss-120b`` / a recipe path -> the recipe's repo and pinned revision;
    any other ``ORG/NAME`` -> that repo at ``main``. ``revision`` overrides the pin."""
    from prepkit.recipes import load_recipe

    try:
        recipe = load_recipe(model)
    except RecipeError:
        if model.endswith(".json") or model.count("/") != 1 or not all(model.split("/")):
            raise
        return Source(repo_id=model, revision=revision or "main")
    fetch = getattr(recipe, "fetch", None) or {}
    return Source(
        repo_id=recipe.repo_id,
        revision=revision or recipe.revision,
        recipe=recipe.name,
        include=tuple(fetch.get("include", DEFAULT_INCLUDE)),
        exclude=tuple(fetch.get("exclude", DEFAULT_EXCLUDE)),
        original=tuple(fetch.get("original", DEFAULT_ORIGINAL)),
    )


def prepkit_home() -> Path:
    return Path(os.environ.get("PREPKIT_HOME") or Path.home() / ".cache" / "prepkit").expanduser()


def model_dir_for(repo_id: str, revision: str) -> Path:
    """``$PREPKIT_HOME/models/<org>--<name>/<revision>``: where prepkit 0.1 fetched models. Still read
    (by ``prepare``) and still completed (by ``fetch``) when a fetch was started there."""
    safe_revision = revision.replace("/", "--")
    return prepkit_home() / "models" / repo_id.replace("/", "--") / safe_revision


def hub_cache_dir() -> Path:
    """The Hugging Face cache, by huggingface_hub's rule: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``~/.cache/huggingface/hub``. Read from the environment at call time (the library reads it
    once, at import)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def repo_cache_dir(cache: Path, repo_id: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return Path(cache) / repo_folder_name(repo_id=repo_id, repo_type="model")


def cached_commit(cache: Path, repo_id: str, revision: str) -> str | None:
    """The commit ``revision`` names in the cache: itself when it is a commit sha, else what
    ``refs/<revision>`` says (written by whoever fetched that branch or tag)."""
    if _COMMIT.match(revision):
        return revision
    try:
        commit = (repo_cache_dir(cache, repo_id) / "refs" / revision).read_text().strip()
    except (OSError, ValueError):
        return None
    return commit if _COMMIT.match(commit) else None


def snapshot_dir(cache: Path, repo_id: str, commit: str) -> Path:
    return repo_cache_dir(cache, repo_id) / "snapshots" / commit


def find_model_dir(repo_id: str, revision: str, *, cache: Path | None = None) -> Path:
    """Where a model fetched before lies: the hub cache's snapshot of ``revision`` (fetched by prepkit
    or by ``hf download``), else the ``$PREPKIT_HOME/models`` folder of prepkit 0.1. A folder with a
    fetch record wins over one that only holds an index. When neither exists, the snapshot folder a
    fetch would fill (for the error message)."""
    cache = Path(cache) if cache is not None else hub_cache_dir()
    commit = cached_commit(cache, repo_id, revision)
    snapshot = snapshot_dir(cache, repo_id, commit or revision)
    candidates = [snapshot, model_dir_for(repo_id, revision)]
    for marker in (FETCH_RECORD, INDEX_NAME):
        for folder in candidates:
            if (folder / marker).is_file():
                return folder
    return snapshot


def default_model_dir(recipe: RecipeLike) -> Path:
    """Where ``prepare --model <recipe>`` looks when no ``--src`` is given (see :func:`find_model_dir`)."""
    return find_model_dir(recipe.repo_id, recipe.revision)


def earlier_local_dir(source: Source) -> Path | None:
    """The ``$PREPKIT_HOME/models`` folder an earlier prepkit fetched ``source`` into, if any: a rerun
    without ``--local-dir`` goes on there rather than fetching the model a second time."""
    folder = model_dir_for(source.repo_id, source.revision)
    if (folder / FETCH_RECORD).is_file() or (folder / STATE_PATH).is_file():
        return folder
    return None


# ------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # the LFS oid; None for small files stored in git
    git_blob: str | None  # git blob sha1 of a small file; None for LFS files

    @property
    def oid(self) -> str | None:
        """The name of its blob in the hub cache (huggingface_hub names blobs by the file's etag)."""
        return self.sha256 or self.git_blob

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "git_blob": self.git_blob}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RemoteFile:
        return cls(path=raw["path"], size=int(raw["size"]), sha256=raw.get("sha256"), git_blob=raw.get("git_blob"))


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
    state = _State.load(dest)
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
        orphan_bytes=sum(size for _, size in _orphans(dest, cache, source.repo_id)),
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
    with _hub_errors(source, endpoint, api=api, stage="listing"):
        if _COMMIT.match(source.revision):
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
    state = _State.load(dest)
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


def _local_status(dest: Path, remote: RemoteFile, state: _State | None, blobs: Path | None) -> PlannedFile:
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


def _orphans(dest: Path, cache: Path | None, repo_id: str) -> list[tuple[Path, int]]:
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


# ------------------------------------------------------------------------------- local bookkeeping


@dataclass
class _State:
    """The plan of the latest fetch into a folder and what has been verified since; rewritten after
    every verified file, so an interrupted run loses no verification work."""

    dest: Path
    repo_id: str
    revision: str
    commit: str
    include_original: bool
    files: list[RemoteFile]
    verified: dict[str, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, dest: Path) -> _State | None:
        path = dest / STATE_PATH
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != STATE_FORMAT:
                return None
            return cls(
                dest=dest,
                repo_id=raw["repo_id"],
                revision=raw["revision"],
                commit=raw["commit"],
                include_original=bool(raw.get("include_original")),
                files=[RemoteFile.from_json(f) for f in raw["files"]],
                verified=dict(raw.get("verified", {})),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("ignoring unreadable %s", path)
            return None

    def matches(self, source: Source) -> bool:
        return self.repo_id == source.repo_id and source.revision in (self.revision, self.commit)

    def is_verified(self, remote: RemoteFile, st: os.stat_result) -> bool:
        entry = self.verified.get(remote.path)
        if not entry or entry.get("size") != st.st_size or entry.get("mtime_ns") != st.st_mtime_ns:
            return False
        return _hash_matches(remote, entry.get("sha256"), entry.get("git_blob"))

    def mark(self, remote: RemoteFile, digest: _Digest, st: os.stat_result) -> None:
        with self.lock:
            self.verified[remote.path] = {
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "sha256": digest.sha256,
                "git_blob": digest.git_blob,
            }
            self.save()

    def save(self) -> None:
        payload = {
            "format": STATE_FORMAT,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "include_original": self.include_original,
            "files": [f.to_json() for f in self.files],
            "verified": self.verified,
        }
        write_json_atomic(self.dest / STATE_PATH, payload)


@dataclass(frozen=True)
class _Digest:
    sha256: str
    git_blob: str | None  # only for files stored in git (small): their oid on the hub


def _hash_file(path: Path, *, git_blob: bool) -> _Digest:
    """One read of ``path``: its sha256 (the LFS oid, and what the record cites), and for a small
    file stored in git also its git blob sha1 (the oid the hub gives for it)."""
    sha256 = hashlib.sha256()
    blob = None
    if git_blob:
        blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            sha256.update(chunk)
            if blob is not None:
                blob.update(chunk)
    return _Digest(sha256=sha256.hexdigest(), git_blob=blob.hexdigest() if blob is not None else None)


def _hash_matches(remote: RemoteFile, sha256: str | None, git_blob: str | None) -> bool:
    if remote.sha256 is not None:
        return sha256 == remote.sha256
    if remote.git_blob is not None:
        return git_blob == remote.git_blob
    return sha256 is not None  # the hub gave no hash: the size check is all there is


@contextlib.contextmanager
def _folder_lock(dest: Path) -> Iterator[None]:
    """One fetch per folder: the orphan cleanup would delete another run's in-flight partial files."""

    def busy(pid: int | None) -> OutputError:
        holder = f" (pid {pid})" if pid else ""
        return OutputError(  # busy is exit 3 for every command that writes a folder or DB
            f"another prepkit fetch{holder} is writing {dest}",
            hint="wait for it to finish, or fetch elsewhere with --local-dir",
        )

    with exclusive(dest / LOCK_PATH, busy=busy):
        yield


def _remove_own_temps(dest: Path, cache: Path | None, repo_id: str) -> None:
    """Temp files of the record, the state and the ref a killed fetch left; called under the folder
    lock, so none of them belongs to a live run."""
    patterns = [(dest, f"{FETCH_RECORD}.tmp-*"), (dest / STATE_PATH.parent, "*.tmp-*")]
    if cache is not None:
        patterns.append((repo_cache_dir(cache, repo_id) / "refs", "**/*.tmp-*"))
    for folder, pattern in patterns:
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)


def _write_ref(cache: Path, repo_id: str, revision: str, commit: str) -> None:
    """``refs/<revision>`` names the commit, as huggingface_hub writes it (no newline), so that
    ``prepare --model`` and ``fetch --offline`` find the snapshot of a branch or tag."""
    if revision == commit:
        return
    ref = repo_cache_dir(cache, repo_id) / "refs" / revision
    with contextlib.suppress(OSError):
        if ref.read_text() == commit:
            return
    write_atomic(ref, [commit.encode()])


# ---------------------------------------------------------------------------------------- record


@dataclass(frozen=True)
class RecordFile:
    path: str
    size: int
    sha256: str
    lfs: bool
    git_blob: str | None = None


@dataclass(frozen=True)
class FetchRecord:
    """What ``prepkit-fetch.json`` says: the repo, the exact commit, and every file with its hash."""

    path: Path
    repo_id: str
    revision: str
    commit: str
    endpoint: str
    recipe: str | None
    include_original: bool
    fetched_at: str
    prepkit_version: str
    entries: tuple[RecordFile, ...]

    @property
    def files(self) -> tuple[RemoteFile, ...]:
        return tuple(
            RemoteFile(e.path, e.size, e.sha256 if e.lfs else None, None if e.lfs else e.git_blob) for e in self.entries
        )

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def matches(self, source: Source) -> bool:
        return self.repo_id == source.repo_id and source.revision in (self.revision, self.commit)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "prepkit_version": self.prepkit_version,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "endpoint": self.endpoint,
            "recipe": self.recipe,
            "include_original": self.include_original,
            "fetched_at": self.fetched_at,
            "total_bytes": self.total_bytes,
            "files": [
                {"path": e.path, "size": e.size, "sha256": e.sha256, "lfs": e.lfs}
                | ({} if e.lfs else {"git_blob": e.git_blob})
                for e in self.entries
            ],
        }


def read_fetch_record(model_dir: str | Path) -> FetchRecord | None:
    """The fetch record of ``model_dir``, or None when the folder was not (completely) fetched by prepkit.

    Raises:
        FetchError: the record exists but is not a prepkit fetch record this version can read.
    """
    path = Path(model_dir) / FETCH_RECORD
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise FetchError(f"{path} is unreadable: {err}", hint=REWRITE_HINT) from err
    try:
        if raw.get("format") != RECORD_FORMAT:
            raise ValueError(f"format is {raw.get('format')!r}, expected {RECORD_FORMAT!r}")
        entries = tuple(
            RecordFile(
                path=f["path"],
                size=int(f["size"]),
                sha256=f["sha256"],
                lfs=bool(f["lfs"]),
                git_blob=f.get("git_blob"),
            )
            for f in raw["files"]
        )
        return FetchRecord(
            path=path,
            repo_id=raw["repo_id"],
            revision=raw["revision"],
            commit=raw["commit"],
            endpoint=raw["endpoint"],
            recipe=raw.get("recipe"),
            include_original=bool(raw.get("include_original")),
            fetched_at=raw["fetched_at"],
            prepkit_version=raw["prepkit_version"],
            entries=entries,
        )
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise FetchError(f"{path} is not a prepkit fetch record: {err}", hint=REWRITE_HINT) from err


# -------------------------------------------------------------------------------------- download


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


class _HashMismatch(Exception):
    def __init__(self, path: str, expected: str, actual: str) -> None:
        super().__init__(f"{path}: expected {expected}, got {actual}")
        self.path = path


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
    with _folder_lock(dest):
        _remove_own_temps(dest, plan.cache, repo_id)
        removed = _remove_orphans(dest, plan.cache, repo_id)
        if not plan.fits:
            raise FetchError(
                f"not enough disk space in {dest}: {format_bytes(plan.need_bytes)} to download "
                f"+ {format_bytes(plan.margin_bytes)} margin, {format_bytes(plan.free_bytes + plan.orphan_bytes)} free",
                hint="free some space, or fetch elsewhere with --local-dir DIR or --cache-dir DIR",
            )
        if plan.cache is not None and not plan.offline:
            _write_ref(plan.cache, repo_id, plan.source.revision, plan.commit)
        state = _State.load(dest)
        if state is None or state.commit != plan.commit or state.repo_id != plan.source.repo_id:
            # A new commit: keep the hashes of files still planned; the plan compared them already.
            planned = {f.path for f in plan.files}
            kept = {p: v for p, v in state.verified.items() if p in planned} if state else {}
            state = _State(
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
        progress = _Progress(on_progress, plan)
        worker = _Worker(plan, state, progress, token=token)
        results = _run_parallel([f for f in plan.files if f.status != "verified"], worker.run, max_workers)
        errors = [r for r in results.values() if isinstance(r, Exception)]
        mismatched = [err for err in errors if isinstance(err, _HashMismatch)]
        others = [err for err in errors if not isinstance(err, _HashMismatch)]
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
        record = _write_record(plan, state)
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


def _remove_orphans(dest: Path, cache: Path | None, repo_id: str) -> int:
    removed = 0
    for path, size in _orphans(dest, cache, repo_id):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
            logger.info("removed partial file of an interrupted run: %s (%s)", path.name, format_bytes(size))
    return removed


class _Worker:
    """Fetches and verifies one file; runs in worker threads."""

    def __init__(self, plan: FetchPlan, state: _State, progress: _Progress, *, token: str | bool | None) -> None:
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
            raise _HashMismatch(remote.path, remote.oid or "?", "a different hash")
        for attempt in (1, 2):
            self._download(remote, force=attempt > 1)
            if self._verify(remote, target):
                return "downloaded" if attempt == 1 else "retried"
            # Remove it at once so a corrupt file never sits under its final name.
            self._discard(target)
            logger.warning("%s failed verification (attempt %d of 2)", remote.path, attempt)
        raise _HashMismatch(remote.path, remote.oid or "?", "a different hash")

    def _blobs(self) -> Path | None:
        return repo_cache_dir(self.plan.cache, self.plan.source.repo_id) / "blobs" if self.plan.cache else None

    def _link_blob(self, remote: RemoteFile, target: Path) -> None:
        """Point the snapshot at a blob the cache already holds, the way huggingface_hub links them
        (a relative symlink); an existing or broken link is replaced."""
        blobs = self._blobs()
        assert blobs is not None and remote.oid is not None
        target.parent.mkdir(parents=True, exist_ok=True)
        link = target.with_name(f"{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
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
        with _hub_errors(source, self.plan.endpoint, stage="download", filename=remote.path):
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
        digest = _hash_file(target, git_blob=remote.sha256 is None)
        if not _hash_matches(remote, digest.sha256, digest.git_blob):
            return False
        self.state.mark(remote, digest, st)
        return True


def _run_parallel(
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
                if not isinstance(err, _HashMismatch):
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


def _write_record(plan: FetchPlan, state: _State) -> FetchRecord:
    entries = []
    for f in plan.files:
        verified = state.verified[f.path]
        entries.append(
            RecordFile(
                path=f.path,
                size=f.remote.size,
                sha256=verified["sha256"],
                lfs=f.remote.sha256 is not None,
                git_blob=None if f.remote.sha256 is not None else verified.get("git_blob"),
            )
        )
    record = FetchRecord(
        path=plan.dest / FETCH_RECORD,
        repo_id=plan.source.repo_id,
        revision=plan.source.revision,
        commit=plan.commit,
        endpoint=plan.endpoint,
        recipe=plan.source.recipe,
        include_original=plan.include_original,
        fetched_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        prepkit_version=__version__,
        entries=tuple(entries),
    )
    write_json_atomic(record.path, record.to_json())
    return record


# -------------------------------------------------------------------------------------- progress


class _Progress:
    """Per-file and total byte counts, fed by huggingface_hub's progress-bar hooks from many threads."""

    def __init__(self, on_progress: ProgressFn | None, plan: FetchPlan) -> None:
        self._report = on_progress
        self._lock = threading.Lock()
        self._per_file: dict[str, int] = {}
        self._total = sum(f.remote.size for f in plan.files if f.status != "verified")
        self._done = 0
        if self._report is not None and self._total:
            self._report(TOTAL_LABEL, 0, self._total)

    def set(self, remote: RemoteFile, done: int) -> None:
        if self._report is None:
            return
        with self._lock:
            done = max(0, min(done, remote.size))
            self._done += done - self._per_file.get(remote.path, 0)
            self._per_file[remote.path] = done
            self._report(remote.path, done, remote.size)
            self._report(TOTAL_LABEL, self._done, self._total)

    def done(self, remote: RemoteFile) -> None:
        self.set(remote, remote.size)

    def bar_for(self, remote: RemoteFile) -> Callable[..., _Bar]:
        def make(**kwargs: Any) -> _Bar:
            return _Bar(self, remote, initial=int(kwargs.get("initial") or 0))

        return make


class _Bar:
    """The subset of the tqdm interface huggingface_hub drives (HTTP and Xet paths); draws nothing."""

    def __init__(self, progress: _Progress, remote: RemoteFile, *, initial: int = 0) -> None:
        self._progress = progress
        self._remote = remote
        self.n = initial
        self.total: int | None = remote.size
        progress.set(remote, self.n)

    def update(self, n: int | float | None = 1) -> None:
        self.n += int(n or 0)
        self._progress.set(self._remote, self.n)

    def update_transfer(self, n: int | float | None = 1) -> None:
        pass  # network bytes; disk bytes (update) are what the bars show

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


# ---------------------------------------------------------------------------------------- errors


@contextlib.contextmanager
def _hub_errors(
    source: Source, endpoint: str, *, stage: str, api: Any = None, filename: str | None = None
) -> Iterator[None]:
    """Turn huggingface_hub / httpx2 / OS errors into one FetchError with the next step to take."""
    import httpx2
    from huggingface_hub import errors as hf

    repo = source.repo_id
    what = f"{filename} of {repo}" if filename else repo
    token_hint = "if the repo is private, set HF_TOKEN (or run `hf auth login`)"
    try:
        yield
    except (FetchError, _HashMismatch):
        raise
    except hf.GatedRepoError as err:  # before RepositoryNotFoundError: it is a subclass of it
        raise FetchError(
            f"{repo} is gated and this account has not been granted access",
            hint=f"accept the terms at {endpoint}/{repo}, then set HF_TOKEN to a token of that account",
        ) from err
    except hf.RevisionNotFoundError as err:
        raise FetchError(f"revision {source.revision!r} not found in {repo}", hint=_revision_hint(source, api)) from err
    except hf.RepositoryNotFoundError as err:
        if stage == "listing" and _repo_exists(api, repo):
            # Some servers (olah) answer an unknown branch with RepoNotFound.
            raise FetchError(
                f"revision {source.revision!r} not found in {repo}", hint=_revision_hint(source, api)
            ) from err
        raise FetchError(f"repository {repo} not found at {endpoint}", hint=f"check --model; {token_hint}") from err
    except hf.LocalEntryNotFoundError as err:  # before RemoteEntryNotFoundError's base: it shares it
        raise FetchError(f"cannot reach {endpoint} for {what}", hint=_network_hint()) from err
    except hf.RemoteEntryNotFoundError as err:
        if stage == "listing":
            # The tree of an unknown commit: the hub says RevisionNotFound, olah says EntryNotFound.
            raise FetchError(
                f"revision {source.revision!r} not found in {repo}", hint=_revision_hint(source, api)
            ) from err
        raise FetchError(f"{what} is missing at {source.revision}", hint="check --revision") from err
    except hf.HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            raise FetchError(f"{endpoint} refused access to {what} (HTTP {status})", hint=token_hint) from err
        if status == 429:
            raise FetchError(
                f"{endpoint} is rate limiting requests for {what} (HTTP 429)",
                hint="wait a few minutes and run the same command again; finished files are kept",
            ) from err
        raise FetchError(
            f"{endpoint} failed on {what} (HTTP {status})",
            hint="run the same command again later; finished files are kept",
        ) from err
    except (httpx2.ConnectError, httpx2.TimeoutException, hf.OfflineModeIsEnabled) as err:
        raise FetchError(f"cannot reach {endpoint} for {what}: {err}", hint=_network_hint()) from err
    except httpx2.HTTPError as err:
        raise FetchError(
            f"the transfer of {what} broke off: {err}",
            hint="run the same command again; finished files are kept",
        ) from err
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FetchError(
                f"disk full while writing {what}: {err.strerror}",
                hint="free some space and run the same command again; finished files are kept, "
                "partial ones are removed",
            ) from err
        if "Consistency check failed" in str(err):
            raise FetchError(
                f"{what} arrived with the wrong size (the connection dropped?)",
                hint="run the same command again; finished files are kept",
            ) from err
        raise FetchError(f"cannot write {what}: {err}") from err
    except ValueError as err:
        if "too large" in str(err):  # > 50 GB over plain HTTP (huggingface_hub's MAX_HTTP_DOWNLOAD_SIZE)
            raise FetchError(
                f"{what} is too large for a plain HTTP download", hint="install hf_xet, and unset HF_HUB_DISABLE_XET"
            ) from err
        raise


def _network_hint() -> str:
    return (
        "check the network and HF_ENDPOINT; if the model was fetched completely before, "
        "add --offline to check it without the hub"
    )


def _repo_exists(api: Any, repo: str) -> bool:
    if api is None:
        return False
    try:
        api.list_repo_refs(repo)
    except Exception:
        return False
    return True


def _revision_hint(source: Source, api: Any) -> str:
    hint = "give a branch, a tag or a full 40-character commit sha with --revision"
    if api is not None:
        with contextlib.suppress(Exception):
            refs = api.list_repo_refs(source.repo_id)
            names = sorted({b.name for b in refs.branches} | {t.name for t in refs.tags})
            if names:
                hint += f"; {source.repo_id} has: {', '.join(names[:10])}"
    return hint
