"""Where the files shipped inside the package live: the model recipes and the bundled tactics DB.

Found through the package's own folder (``Path(__file__)``), which is a real folder in a wheel
install and in an editable one alike: SQLite opens only a real file path, so a resource API that
may hand out a temporary extracted copy would buy nothing here. Standard library only.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
# ``<model>.json`` per supported checkpoint (read by :mod:`prepkit.recipes`).
RECIPES_DIR = DATA_DIR / "recipes"
# The slim tactics DB the runtime reads after the user's own (written by :mod:`prepkit.tactics.bundle`).
TACTICS_DB = DATA_DIR / "tactics.db"
