"""Where tactics DBs are: the user's, the bundled one, and the one a reading command shows.

Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from prepkit.constants import TACTICS_DB_NAME
from prepkit.data import tactics_db
from prepkit.errors import TacticsError


def user_db_path() -> Path:
    """``$PREPKIT_TACTICS_DB``, else ``$XDG_CACHE_HOME/prepkit/tactics.db`` (``~/.cache``)."""
    env = os.environ.get("PREPKIT_TACTICS_DB")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "prepkit" / TACTICS_DB_NAME


def bundled_db_path() -> Path | None:
    """The DB shipped with the package (:func:`prepkit.data.tactics_db`), in a wheel install and an
    editable one alike; ``None`` if it is missing (a broken install: the lookup then skips it)."""
    path = tactics_db()
    return path if path.is_file() else None


def db_to_read(explicit: Path | None = None) -> Path:
    """The DB a reading command shows: ``explicit``, else the user DB if it exists, else the
    bundled one (the first two tiers of the lookup order).

    Raises:
        TacticsError: none of them exists.
    """
    if explicit is not None:
        return explicit
    user = user_db_path()
    if user.is_file():
        return user
    bundled = bundled_db_path()
    if bundled is None:
        raise TacticsError("no tactics DB found", hint="run `prepkit tune`, or pass --db")
    return bundled
