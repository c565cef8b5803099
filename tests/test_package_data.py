"""The files prepkit ships inside its package: where they are found, what pyproject puts in the
wheel, and the ``PREPKIT_RECIPES`` override. (``.ci/wheel-check`` builds and runs the real wheel.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

import prepkit
from prepkit import data, recipes
from prepkit.tactics.lookup import bundled_db_path

PKG = Path(prepkit.__file__).resolve().parent
ROOT = PKG.parent


def test_recipes_and_the_tactics_db_live_inside_the_package() -> None:
    # importlib.resources resolves them in the package that was imported (this tree), not a copy
    assert data.recipes_dir() == PKG / "data" / "recipes" and data.recipes_dir().is_dir()
    assert data.tactics_db() == PKG / "data" / "tactics.db" and data.tactics_db().is_file()
    assert data.recipes_dir() == recipes.RECIPES_DIR  # no PREPKIT_RECIPES in the test environment
    names = recipes.available()
    assert {"gpt-oss-120b", "gpt-oss-20b"} <= set(names)
    for name in names:
        assert recipes.load_recipe(name).path.parent == data.recipes_dir()
    assert bundled_db_path() == data.tactics_db()
    # one copy only: nothing left at the repository top for a source checkout to fall back on
    assert not (ROOT / "recipes").exists() and not (ROOT / "tactics.db").exists()


def test_pyproject_ships_every_data_file_and_the_license() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = project["tool"]["setuptools"]["package-data"]["prepkit"]
    shipped = sorted(p.relative_to(PKG).as_posix() for p in (PKG / "data").rglob("*") if p.is_file())
    data_files = [p for p in shipped if not p.endswith((".py", ".pyc")) and "__pycache__" not in p]
    assert "data/tactics.db" in data_files and "data/recipes/gpt-oss-120b.json" in data_files
    for path in data_files:
        assert any(fnmatch(path, g) for g in globs), f"{path} is not in package-data {globs}"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_prepkit_recipes_overrides_the_packaged_folder(tmp_path: Path) -> None:
    mine = tmp_path / "recipes"
    mine.mkdir()
    raw = json.loads((data.recipes_dir() / "gpt-oss-20b.json").read_text())
    (mine / "my-model.json").write_text(json.dumps({**raw, "name": "my-model"}))
    code = (
        "from prepkit import recipes\n"
        "print(recipes.available(), recipes.load_recipe('my-model').name)\n"
        "try:\n"
        "    recipes.load_recipe('gpt-oss-120b')\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, err, '|', err.hint)\n"
    )
    env = {**os.environ, "PREPKIT_RECIPES": str(mine), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    lines = out.stdout.splitlines()
    assert lines[0] == "['my-model'] my-model"
    assert lines[1] == (
        f"RecipeError no recipe 'gpt-oss-120b' in {mine} | known models: my-model; the folder is set by PREPKIT_RECIPES"
    )


def test_the_cli_finds_the_recipes_from_any_folder(tmp_path: Path) -> None:
    """Run from a folder that is not the repository: the recipe still resolves."""
    env = {k: v for k, v in os.environ.items() if k != "PREPKIT_RECIPES"}
    env["PYTHONPATH"] = str(ROOT)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    code = "from prepkit import recipes; r = recipes.load_recipe('openai/gpt-oss-120b'); print(r.name, r.repo_id)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=workdir)
    assert out.stdout.split() == ["gpt-oss-120b", "openai/gpt-oss-120b"]


def test_a_zip_imported_package_gets_real_paths(tmp_path: Path) -> None:
    """SQLite opens only real files: from a zip archive the DB and the recipes are extracted."""
    import zipfile

    archive = tmp_path / "prepkit.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in [PKG / "__init__.py", PKG / "errors.py", PKG / "constants.py", *(PKG / "data").rglob("*")]:
            if path.is_file() and "__pycache__" not in path.parts:
                zf.write(path, path.relative_to(ROOT).as_posix())
    code = (
        "import sqlite3, prepkit.data as d\n"
        "assert '.zip' in d.__file__, d.__file__\n"
        "db = d.tactics_db()\n"
        "winners = sqlite3.connect(f'file:{db}?mode=ro', uri=True).execute('select count(*) from winner')\n"
        "print(db.is_file(), winners.fetchone()[0] > 0)\n"
        "print(sorted(p.name for p in d.recipes_dir().glob('*.json')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(archive)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "True True"
    assert lines[1] == "['gpt-oss-120b.json', 'gpt-oss-20b.json']"
