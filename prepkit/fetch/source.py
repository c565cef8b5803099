"""What to fetch: a hub repo, the revision to pin, the file patterns (a recipe's, else the defaults
below), and the files the hub lists for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from prepkit.errors import RecipeError

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


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # the LFS oid; None for small files stored in git
    git_blob: str | None  # git blob sha1 of a small file; None for LFS files

    @property
    def oid(self) -> str | None:
        """The hub's id of its bytes (also the etag huggingface_hub names its blob and partial files by)."""
        return self.sha256 or self.git_blob

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "git_blob": self.git_blob}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RemoteFile:
        return cls(path=raw["path"], size=int(raw["size"]), sha256=raw.get("sha256"), git_blob=raw.get("git_blob"))
