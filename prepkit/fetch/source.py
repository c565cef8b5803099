"""What to fetch: a hub repo, the revision to pin, and which files (a recipe's patterns, else the
defaults below)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from prepkit.errors import RecipeError

# For an ORG/NAME without a recipe; recipes carry their own lists (recipes/*.json "fetch").
MODEL_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DEFAULT_INCLUDE = MODEL_FILES + TOKENIZER_FILES
DEFAULT_EXCLUDE = ("original/*", "metal/*")
ORIGINAL = "original/*"  # a second copy of the weights, in OpenAI's format: only with --include-original
NEVER = "metal/*"  # a third copy (65 GB, Xet-only) that nothing here reads
REQUIRED = ("config.json", "model.safetensors.index.json")  # a repo without them is refused up front


@dataclass(frozen=True)
class Source:
    repo_id: str
    revision: str
    recipe: str | None = None
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    subset: bool = False  # the user chose the files (--include): no completeness checks

    def narrowed(self, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> Source:
        """``--include`` replaces the file list (as for ``hf download``), ``--exclude`` adds to it."""
        if not include and not exclude:
            return self
        more = tuple(p for p in exclude if p not in self.exclude)
        return replace(self, include=tuple(include) or self.include, exclude=self.exclude + more, subset=bool(include))

    def patterns(self, include_original: bool) -> tuple[list[str], list[str]]:
        include = list(self.include) + ([ORIGINAL] if include_original else [])
        exclude = [p for p in self.exclude if not (include_original and p == ORIGINAL)]
        return include, exclude + ([] if NEVER in exclude else [NEVER])


def resolve_source(model: str, *, revision: str | None = None) -> Source:
    """A recipe name, its hub id or a recipe path -> the recipe's repo and pinned commit; any other
    ``ORG/NAME`` -> that repo at ``main``. ``revision`` overrides either."""
    from prepkit.recipes import load_recipe

    try:
        recipe = load_recipe(model)
    except RecipeError:
        if model.endswith(".json") or model.count("/") != 1 or not all(model.split("/")):
            raise
        return Source(repo_id=model, revision=revision or "main")
    lists = getattr(recipe, "fetch", None) or {}
    return Source(
        repo_id=recipe.repo_id,
        revision=revision or recipe.revision,
        recipe=recipe.name,
        include=tuple(lists.get("include", DEFAULT_INCLUDE)),
        exclude=tuple(lists.get("exclude", DEFAULT_EXCLUDE)),
    )


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # the LFS oid; None for small files stored in git
    git_blob: str | None  # the git blob sha1 of a small file; None for LFS files

    @property
    def oid(self) -> str | None:
        """The hub's id of its bytes (also the etag huggingface_hub names its partial files by)."""
        return self.sha256 or self.git_blob
