"""Where the files prepkit ships live: the model recipes and the bundled tactics DB.

Their sources of truth are ``recipes/`` and ``tactics.db`` at the repository top; the build copies
them into the wheel's ``prepkit/data/`` (tools/ship_data.py). One resolver serves both: the
package's own files through :mod:`importlib.resources` (a wheel, whatever the working folder),
else the top of the source checkout this package was imported from (an editable install or the
tree on ``PYTHONPATH``). SQLite and the recipe loader need real paths: a package on disk hands
them out as they are, and one imported from a zip archive gets them extracted once, for the life
of the process. Standard library only.
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
    from importlib.abc import Traversable  # importlib.resources.abc from Python 3.11

# A source checkout: prepkit/data/ -> prepkit/ -> the repository top, recognised by its pyproject.
_CHECKOUT = Path(__file__).resolve().parent.parent.parent

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
    """A real filesystem path for the shipped file or folder ``name``: the package's copy, else the
    source checkout's. Where neither has it, the package's path, which does not exist (the callers
    report a missing recipe or skip a missing bundled DB)."""
    resource = resources.files(__name__).joinpath(name)
    in_checkout = _CHECKOUT / name
    # An empty folder is no copy: one left behind by an older checkout's layout must not hide the top's.
    packaged = resource.is_file() or (resource.is_dir() and any(True for _ in resource.iterdir()))
    if not packaged and in_checkout.exists() and (_CHECKOUT / "pyproject.toml").is_file():
        return in_checkout
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
