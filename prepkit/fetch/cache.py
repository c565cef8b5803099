"""Where fetched models lie: the Hugging Face cache (looked up through huggingface_hub's public API),
else prepkit 0.1's ``$PREPKIT_HOME/models`` folders."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from prepkit.constants import FETCH_RECORD, INDEX_NAME
from prepkit.fetch.record import STATE_PATH

if TYPE_CHECKING:
    from prepkit.recipes import Recipe


def model_dir_for(repo_id: str, revision: str) -> Path:
    """Where prepkit 0.1 fetched models; still read by ``prepare`` and completed by ``fetch``."""
    home = Path(os.environ.get("PREPKIT_HOME") or Path.home() / ".cache" / "prepkit").expanduser()
    return home / "models" / repo_id.replace("/", "--") / revision.replace("/", "--")


def hub_cache_dir() -> Path:
    """huggingface_hub's rule, read at call time (the library reads the environment at import)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def cached_snapshot(repo_id: str, revision: str, cache: Path) -> Path | None:
    """The cache's snapshot of ``repo_id`` at ``revision`` (a branch or tag through its ref) holding a
    fetch record, an index or a config, as huggingface_hub finds it."""
    from huggingface_hub import try_to_load_from_cache

    for marker in (FETCH_RECORD, INDEX_NAME, "config.json"):
        found = try_to_load_from_cache(repo_id, marker, cache_dir=cache, revision=revision)
        if isinstance(found, str):
            return Path(found).parent
    return None


def snapshot_dir(cache: Path, repo_id: str, commit: str) -> Path:
    """The snapshot of a commit: as huggingface_hub finds it, else (not downloaded yet) as its documented
    layout places it; a fetch checks the files arrive there, so a change of layout fails loudly."""
    return (
        cached_snapshot(repo_id, commit, cache)
        or cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit
    )


def find_model_dir(repo_id: str, revision: str, *, cache: Path | None = None) -> Path:
    """The cache's snapshot, else prepkit 0.1's folder; one with a fetch record wins over one with only
    an index. When neither exists, the snapshot a fetch would fill."""
    cache = Path(cache) if cache is not None else hub_cache_dir()
    snapshot, legacy = snapshot_dir(cache, repo_id, revision), model_dir_for(repo_id, revision)
    for marker in (FETCH_RECORD, INDEX_NAME):
        for folder in (snapshot, legacy):
            if (folder / marker).is_file():
                return folder
    return snapshot


def default_model_dir(recipe: Recipe) -> Path:
    """Where ``prepare --model <recipe>`` looks when no ``--src`` is given."""
    return find_model_dir(recipe.repo_id, recipe.revision)


def earlier_local_dir(repo_id: str, revision: str) -> Path | None:
    """The prepkit 0.1 folder an earlier fetch started, where a rerun without ``--local-dir`` goes on."""
    folder = model_dir_for(repo_id, revision)
    return folder if (folder / FETCH_RECORD).is_file() or (folder / STATE_PATH).is_file() else None
