"""The name prepkit is published under on the package index, and the install lines built from it.

The import name and the command stay ``prepkit``; ``prepkit`` on the index is an unrelated
project, so every hint that tells a user what to install spells :data:`DISTRIBUTION` (a test keeps
it equal to ``[project] name`` in pyproject.toml). Standard library only and nothing heavy.
"""

from __future__ import annotations

DISTRIBUTION = "prepkit-gpt-oss"


def install_hint(extra: str | None = None, *, upgrade: bool = False) -> str:
    """``pip install 'prepkit-gpt-oss[gpu]'`` for an extra, ``pip install prepkit-gpt-oss`` without."""
    spec = f"'{DISTRIBUTION}[{extra}]'" if extra else DISTRIBUTION
    return f"pip install {'-U ' if upgrade else ''}{spec}"
