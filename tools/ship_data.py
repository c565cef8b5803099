"""Build step: the recipes and the bundled tactics DB live at the repository top (the sources of
truth) and are copied into the wheel's ``prepkit/data/``, where :mod:`prepkit.data` finds them.

Wired in as setuptools' ``build_py`` by ``[tool.setuptools.cmdclass]`` in pyproject.toml. The copies
are listed as package data of ``prepkit.data``, so the wheel, the sdist (which carries the root
files and this module) and a strict editable install all get them through setuptools' own steps.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent.parent
DATA_PACKAGE = "prepkit.data"
# Relative to the repository top, and to prepkit/data/ in the wheel. The names are prepkit.constants'
# RECIPES_FOLDER and TACTICS_DB_NAME (not imported: the package is not importable while it builds).
SHIPPED = ("recipes/*.json", "tactics.db")


def shipped_files() -> list[str]:
    """The root files that go into ``prepkit/data/``, as paths relative to the repository top."""
    files = sorted({p.relative_to(ROOT).as_posix() for pattern in SHIPPED for p in ROOT.glob(pattern) if p.is_file()})
    if "tactics.db" not in files or not any(f.startswith("recipes/") for f in files):
        raise FileNotFoundError(f"{ROOT} lacks tactics.db or recipes/*.json, which the wheel must carry")
    return files


class BuildPyWithRootData(build_py):
    """setuptools' ``build_py`` plus the root data files, placed in ``prepkit/data/`` of the build."""

    def _root_data(self) -> tuple[str, str, str, list[str]]:
        build_dir = str(Path(self.build_lib, *DATA_PACKAGE.split(".")))
        # relative like setuptools' own package folders, so the sdist lists the files as it lists those
        return DATA_PACKAGE, os.path.relpath(ROOT), build_dir, shipped_files()

    def _get_data_files(self) -> list[tuple[str, str, str, list[str]]]:
        return [*super()._get_data_files(), self._root_data()]

    def get_data_files_without_manifest(self) -> list[tuple[str, str, str, list[str]]]:
        return [*super().get_data_files_without_manifest(), self._root_data()]

    def get_source_files(self) -> list[str]:
        # the sdist must carry this step too, or a wheel built from it would lack the data
        return [*super().get_source_files(), os.path.relpath(Path(__file__).resolve())]
