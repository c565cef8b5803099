"""Where fetched models lie: the Hugging Face cache (looked up through huggingface_hub's public API),
prepkit 0.1's ``$PREPKIT_HOME/models`` folders, and the bookkeeping paths a fetch keeps in its folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from prepkit.constants import FETCH_RECORD, INDEX_NAME

STATE_PATH = Path(".cache") / "prepkit" / "fetch-state.json"
LOCK_PATH = Path(".cache") / "prepkit" / "fetch.lock"


class RecipeLike(Protocol):
    repo_id: str
    revision: str


def prepkit_home() -> Path:
    return Path(os.environ.get("PREPKIT_HOME") or Path.home() / ".cache" / "prepkit").expanduser()


def model_dir_for(repo_id: str, revision: str) -> Path:
    """``$PREPKIT_HOME/models/<org>--<name>/<revision>``: where prepkit 0.1 fetched models; still read
    by ``prepare`` and completed by ``fetch`` when a fetch was started there."""
    return prepkit_home() / "models" / repo_id.replace("/", "--") / revision.replace("/", "--")


def hub_cache_dir() -> Path:
    """``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else huggingface_hub's default; read at call time (the
    library reads the environment once, at import)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def cached_snapshot(repo_id: str, revision: str, *, cache: Path | None = None) -> Path | None:
    """The cache's snapshot folder of ``repo_id`` at ``revision`` (a branch or tag through its ref), when
    it holds a fetch record, an index or a config; asked of huggingface_hub, which owns the layout."""
    from huggingface_hub import try_to_load_from_cache

    for marker in (FETCH_RECORD, INDEX_NAME, "config.json"):
        found = try_to_load_from_cache(repo_id, marker, cache_dir=cache or hub_cache_dir(), revision=revision)
        if isinstance(found, str):
            return Path(found).parent
    return None


def find_model_dir(repo_id: str, revision: str, *, cache: Path | None = None) -> Path:
    """Where a model fetched before lies: its snapshot in the hub cache, else prepkit 0.1's folder; one
    with a fetch record wins over one with only an index. When neither exists, the snapshot path a
    fetch would fill."""
    cache = Path(cache) if cache is not None else hub_cache_dir()
    candidates = [cached_snapshot(repo_id, revision, cache=cache), model_dir_for(repo_id, revision)]
    for marker in (FETCH_RECORD, INDEX_NAME):
        for folder in candidates:
            if folder is not None and (folder / marker).is_file():
                return folder
    return candidates[0] or snapshot_path(cache, repo_id, revision)


def snapshot_path(cache: Path, repo_id: str, commit: str) -> Path:
    """The snapshot folder huggingface_hub's documented cache layout gives a commit not downloaded yet;
    a fetch checks it against the folder ``snapshot_download`` returns, so a change fails loudly."""
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


def default_model_dir(recipe: RecipeLike) -> Path:
    """Where ``prepare --model <recipe>`` looks when no ``--src`` is given (see :func:`find_model_dir`)."""
    return find_model_dir(recipe.repo_id, recipe.revision)


def earlier_local_dir(repo_id: str, revision: str) -> Path | None:
    """The ``$PREPKIT_HOME/models`` folder an earlier prepkit fetched into, if any: a rerun without
    ``--local-dir`` goes on there rather than fetching the model a second time."""
    folder = model_dir_for(repo_id, revision)
    return folder if (folder / FETCH_RECORD).is_file() or (folder / STATE_PATH).is_file() else None
