"""Where fetched models lie: the Hugging Face cache (huggingface_hub's own layout, read from the
environment at call time), prepkit 0.1's ``$PREPKIT_HOME/models`` folders, and the bookkeeping paths
a fetch keeps inside its target folder."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Protocol

from prepkit.constants import FETCH_RECORD, INDEX_NAME
from prepkit.fetch.source import Source

STATE_PATH = Path(".cache") / "prepkit" / "fetch-state.json"
LOCK_PATH = Path(".cache") / "prepkit" / "fetch.lock"
HF_DOWNLOAD_DIR = Path(".cache") / "huggingface" / "download"

COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


class RecipeLike(Protocol):
    repo_id: str
    revision: str


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
    if COMMIT_SHA.match(revision):
        return revision
    try:
        commit = (repo_cache_dir(cache, repo_id) / "refs" / revision).read_text().strip()
    except (OSError, ValueError):
        return None
    return commit if COMMIT_SHA.match(commit) else None


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
