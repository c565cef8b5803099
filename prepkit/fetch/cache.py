"""Where fetched models lie: the Hugging Face cache, looked up through huggingface_hub's public API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from prepkit.constants import FETCH_RECORD, INDEX_NAME

if TYPE_CHECKING:
    from prepkit.recipes import Recipe


def hub_cache_dir() -> Path:
    """huggingface_hub's rule, read at call time (the library reads the environment at import)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def snapshot_dir(cache: Path, repo_id: str, revision: str) -> Path:
    """The cache's snapshot of ``repo_id`` at ``revision`` (a branch or tag through its ref), as
    huggingface_hub finds it by a file of the checkpoint; else, not downloaded yet, where its documented
    layout puts it (a fetch checks the files arrive there, so a change of layout fails loudly)."""
    from huggingface_hub import try_to_load_from_cache

    for marker in (FETCH_RECORD, INDEX_NAME, "config.json"):
        if isinstance(found := try_to_load_from_cache(repo_id, marker, cache_dir=cache, revision=revision), str):
            return Path(found).parent
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / revision


def find_model_dir(repo_id: str, revision: str, *, cache: Path | None = None) -> Path:
    """The snapshot of ``repo_id`` at ``revision`` in the hub cache (``cache``, default the user's)."""
    return snapshot_dir(Path(cache) if cache is not None else hub_cache_dir(), repo_id, revision)


def default_model_dir(recipe: Recipe) -> Path:
    """Where ``prepare --model <recipe>`` looks when no ``--src`` is given."""
    return find_model_dir(recipe.repo_id, recipe.revision)
