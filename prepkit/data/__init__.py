"""Where the files shipped inside the package live: the model recipes and the bundled tactics DB.

Found through :mod:`importlib.resources`, so they resolve to the installed package's own files
(wheel, editable install or source tree on ``PYTHONPATH``) whatever the working folder. SQLite
and the recipe loader need real paths: a package on disk hands them out as they are, and one
imported from a zip archive gets them extracted once, for the life of the process.
Standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from prepkit.constants import RECIPES_FOLDER, TACTICS_DB_NAME

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

# Holds the extracted copies of a zip-imported package until the interpreter exits.
_EXTRACTED = contextlib.ExitStack()
atexit.register(_EXTRACTED.close)


def _copy_tree(src: Traversable, dest: Path) -> None:
    # resources.as_file takes folders only from Python 3.12 on; this works on every supported one.
    dest.mkdir()
    for child in src.iterdir():
        if child.is_dir():
            _copy_tree(child, dest / child.name)
        else:
            (dest / child.name).write_bytes(child.read_bytes())


@cache
def resource_path(name: str) -> Path:
    """A real filesystem path for the file or folder ``name`` inside this package."""
    resource = resources.files(__name__).joinpath(name)
    if isinstance(resource, Path):
        return resource
    if resource.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix="prepkit-data-"))
        _EXTRACTED.callback(shutil.rmtree, tmp, ignore_errors=True)
        _copy_tree(resource, tmp / name)
        return tmp / name
    return Path(_EXTRACTED.enter_context(resources.as_file(resource)))


def recipes_dir() -> Path:
    """The folder of ``<model>.json`` recipes (read by :mod:`prepkit.recipes`)."""
    return resource_path(RECIPES_FOLDER)


def tactics_db() -> Path:
    """The slim tactics DB the runtime reads after the user's own (written by :mod:`prepkit.tactics.bundle`)."""
    return resource_path(TACTICS_DB_NAME)
